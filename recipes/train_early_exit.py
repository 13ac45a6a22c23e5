"""LayerSkip-style early-exit fine-tuning (TRL + peft LoRA) that raises `layerskip` acceptance while keeping
the full model's greedy predictions within a tolerance you set.

    python recipes/train_early_exit.py --model ../shared/models/qwen3_5-small --exit-layer 4 \
        --max-steps 200 --min-agreement 0.97 --out ee_out

What it does:

- Data: .py files of an installed package (`--train-package`, default `transformers`) cut into blocks of
  `--seq-len` tokens; held-out check text: the built-in code prompts plus another package
  (`--eval-package`, default `trl`). networkx, sympy and pandas are refused (held out of the fixtures).
- Model: LoRA adapters (peft) on the linear layers of the first `--exit-layer` decoder layers (or all layers,
  `--lora-layers all`); everything else is frozen.
- Loss (per token, over real tokens): `exit_weight * KL(teacher || early exit) + keep_weight * KL(teacher || full)`
  where the teacher is the unchanged model (the adapter disabled) and the early exit is exactly the
  `layerskip` draft (`ModelAdapter.early_exit`: the first E layers, then the model's own final norm and head).
  Distilling the exit towards the full model's distribution is what acceptance rewards; `--exit-target labels`
  uses cross-entropy on the data instead (LayerSkip's original early-exit loss).
- Tolerance: every `--check-every` steps, top-1 agreement of the full model with the original full model on
  the held-out text (teacher forced) is measured; when it falls below `--min-agreement` training stops and
  the last adapter weights that met it are restored. The final weights always meet it.
- Report: before and after, on the held-out text: full-model agreement, early-exit top-1 agreement with the
  full model, perplexity of the full model and of the exit, and measured greedy acceptance alpha at
  k = 1..4 of `AssistantConfig(drafter="layerskip", exit_layer=E)` (after a correctness gate); a table and a
  JSON line last. Saves the LoRA adapter (`save_pretrained`) and, with `--merge`, the merged model and
  tokenizer, ready for `drafter="layerskip"`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

from hf_hybrid_spec.cli import argument_parser


def parse_args(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="path / Hub id, or tiny:<model_type> (with --tokenizer)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    parser.add_argument("--exit-layer", type=int, required=True, help="E: the draft uses the first E layers")
    parser.add_argument("--train-package", default="transformers", help="installed package whose sources train")
    parser.add_argument("--eval-package", default="trl", help="installed package held out for the checks")
    parser.add_argument("--max-train-files", type=int, default=400)
    parser.add_argument("--max-eval-files", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-blocks", type=int, default=4096, help="training blocks kept")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-layers", choices=["exit", "all"], default="exit",
                        help="adapt the first E layers only, or every layer")
    parser.add_argument("--exit-weight", type=float, default=1.0)
    parser.add_argument("--keep-weight", type=float, default=1.0,
                        help="weight of KL(original full || full): keeps the full model where it was")
    parser.add_argument("--exit-target", choices=["teacher", "labels"], default="teacher")
    parser.add_argument("--min-agreement", type=float, default=0.97,
                        help="least top-1 agreement of the full model with the original, on held-out text")
    parser.add_argument("--check-every", type=int, default=25, help="steps between tolerance checks")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows of --seq-len tokens")
    parser.add_argument("--eval-prompts", type=int, default=6, help="prompts for measured acceptance (0: skip)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--merge", action="store_true", help="also save the merged model + tokenizer")
    parser.add_argument("--bf16", action="store_true", help="train under bf16 autocast (checks stay in fp32)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    if args.train_package == args.eval_package:
        parser.error("--train-package and --eval-package must differ (the check text must be held out)")
    if not 0.0 < args.min_agreement <= 1.0:
        parser.error("--min-agreement must be in (0, 1]")
    return args


if __name__ == "__main__":
    parse_args()  # --help, --version and bad options answer here, before torch and the models load

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_hybrid_spec.analysis import (DraftKind, analyze, evenly_spaced_windows, perplexity, text_set,  # noqa: E402
                                     token_stream)
from hf_hybrid_spec.hub import files_as_umask  # noqa: E402
from hf_hybrid_spec.models import get_adapter  # noqa: E402


@dataclass
class Snapshot:
    """Held-out measurements of one model state.

    Attributes:
        full_agreement: top-1 agreement of the full model with the original full model (teacher forced).
        exit_agreement: top-1 agreement of the early exit with the (current) full model.
        full_perplexity / exit_perplexity: on the held-out chunks.
        alpha: k -> measured greedy acceptance of the layerskip drafter (None when not measured).
        mean_accepted_length: k -> tokens per target forward.
    """

    full_agreement: float
    exit_agreement: float
    full_perplexity: float
    exit_perplexity: float
    alpha: dict | None = None
    mean_accepted_length: dict | None = None


def load(args):
    if args.model.startswith("tiny:"):
        from hf_hybrid_spec.testing import tiny_model

        if not args.tokenizer:
            raise SystemExit("--model tiny:<family> needs --tokenizer PATH (its vocabulary sets the model's)")
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        model = tiny_model(args.model.split(":", 1)[1], vocab_size=len(tok))
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    return model.eval(), tok


def blocks(stream: torch.Tensor, seq_len: int, limit: int) -> list[list[int]]:
    n = min(limit, stream.numel() // seq_len)
    if n == 0:
        raise SystemExit(f"the training text has fewer than {seq_len} tokens")
    return stream[: n * seq_len].view(n, seq_len).tolist()


def lora_targets(model, exit_layer: int, which: str) -> list[str]:
    """Full names of the nn.Linear modules inside the decoder layers LoRA adapts."""
    layers = get_adapter(model).decoder_layers(model)
    chosen = {id(layer) for layer in (layers[:exit_layer] if which == "exit" else layers)}
    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            owner = next((layer for layer in layers if any(m is module for m in layer.modules())), None)
            if owner is not None and id(owner) in chosen:
                names.append(name)
    if not names:
        raise SystemExit("no linear layer found to adapt")
    return names


@torch.no_grad()
def top1(model, windows: list[torch.Tensor], exit_ctx=None) -> list[torch.Tensor]:
    """Argmax next-token predictions per window ([T] each), through the early exit when `exit_ctx` is given."""
    preds = []
    for w in tqdm(windows, desc="top-1 check", leave=False):
        if exit_ctx is None:
            logits = model(input_ids=w, use_cache=False).logits
        else:
            with exit_ctx():
                logits = model(input_ids=w, use_cache=False).logits
        preds.append(logits[0].argmax(-1))
    return preds


def agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    same = sum(int((x == y).sum()) for x, y in zip(a, b))
    return same / sum(x.numel() for x in a)


class EarlyExitTrainer(SFTTrainer):
    """SFTTrainer whose loss is the early-exit distillation loss of the module docstring."""

    def __init__(self, *args, exit_ctx, exit_weight: float, keep_weight: float, exit_target: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_ctx = exit_ctx
        self.exit_weight = exit_weight
        self.keep_weight = keep_weight
        self.exit_target = exit_target

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        fwd = dict(input_ids=ids, attention_mask=mask, use_cache=False)
        with torch.no_grad(), model.disable_adapter():
            teacher = model(**fwd).logits.float().log_softmax(-1)
        full = model(**fwd).logits.float().log_softmax(-1)
        with self.exit_ctx():
            early = model(**fwd).logits.float().log_softmax(-1)

        def kl(student):  # KL(teacher || student) per token: [B, T]
            return (teacher.exp() * (teacher - student)).sum(-1)

        keep = kl(full)[real].mean()
        if self.exit_target == "teacher":
            exit_loss = kl(early)[real].mean()
        else:
            labels = inputs["labels"][:, 1:]
            exit_loss = torch.nn.functional.nll_loss(early[:, :-1].reshape(-1, early.shape[-1]), labels.reshape(-1),
                                                     ignore_index=-100)
        loss = self.exit_weight * exit_loss + self.keep_weight * keep
        return (loss, None) if return_outputs else loss


class AgreementGuard(TrainerCallback):
    """Stops training when the full model's top-1 agreement with the original falls below `min_agreement`,
    restoring the last adapter weights that met it."""

    def __init__(self, model, windows, reference, exit_ctx, min_agreement: float, every: int):
        self.model = model
        self.windows = windows
        self.reference = reference
        self.exit_ctx = exit_ctx
        self.min_agreement = min_agreement
        self.every = every
        self.good = self._trainable_state()
        self.history: list[dict] = []
        self.stopped_at: int | None = None

    def _trainable_state(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def check(self, step: int) -> bool:
        was_training = self.model.training
        self.model.eval()
        # The unwrapped model (LoRA layers included): the trainer wraps the PEFT model's forward in autocast
        # when training in bf16, and the check must compare fp32 predictions with the fp32 reference.
        base = self.model.get_base_model()
        full = top1(base, self.windows)
        early = top1(base, self.windows, self.exit_ctx)
        self.model.train(was_training)
        entry = dict(step=step, full_agreement=agreement(full, self.reference), exit_agreement=agreement(early, full))
        self.history.append(entry)
        ok = entry["full_agreement"] >= self.min_agreement
        if ok:
            self.good = self._trainable_state()
        return ok

    def restore(self) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in self.good:
                    p.copy_(self.good[n])

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 and not self.check(state.global_step):
            self.stopped_at = state.global_step
            self.restore()
            control.should_training_stop = True
        return control


def snapshot(model, windows, reference, chunks, exit_ctx, prompts, exit_layer, ks, new_tokens) -> Snapshot:
    full = top1(model, windows)
    early = top1(model, windows, exit_ctx)
    snap = Snapshot(full_agreement=agreement(full, reference), exit_agreement=agreement(early, full),
                    full_perplexity=perplexity(model, chunks), exit_perplexity=perplexity(model, chunks, exit_ctx))
    if prompts:
        kind = DraftKind(f"layerskip:E={exit_layer}", dict(drafter="layerskip", exit_layer=exit_layer))
        report = analyze(model, prompts, chunks[:1], [kind], tuple(ks), new_tokens, progress=False)
        if report.gate_mismatches:
            raise SystemExit(f"correctness gate failed: {report.gate_mismatches} speculative outputs differ from "
                             "plain greedy")
        snap.alpha = report.results[0].alpha
        snap.mean_accepted_length = report.results[0].mean_accepted_length
    return snap


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    model, tok = load(args)
    adapter = get_adapter(model)
    num_layers = len(adapter.decoder_layers(model))
    if not 1 <= args.exit_layer < num_layers:
        raise SystemExit(f"train_early_exit.py: error: --exit-layer must be in [1, {num_layers - 1}] for this "
                         f"{num_layers}-layer model")

    eval_stream = token_stream(text_set(args.eval_package, max_files=args.max_eval_files), tok, tok.eos_token_id)
    windows = evenly_spaced_windows(eval_stream, args.eval_windows, args.seq_len)
    prompts = evenly_spaced_windows(eval_stream, args.eval_prompts, 128) if args.eval_prompts else []
    train_texts = text_set(args.train_package, with_prompts=False, max_files=args.max_train_files)
    train = blocks(token_stream(train_texts, tok, tok.eos_token_id), args.seq_len, args.max_blocks)

    def exit_base():
        return adapter.early_exit(model, args.exit_layer)

    reference = top1(model, windows)
    before = snapshot(model, windows, reference, windows, exit_base, prompts, args.exit_layer, args.ks,
                      args.new_tokens)

    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                      target_modules=lora_targets(model, args.exit_layer, args.lora_layers))
    peft_model = get_peft_model(model, lora)
    guard = AgreementGuard(peft_model, windows, reference, exit_base, args.min_agreement, args.check_every)
    config = SFTConfig(
        output_dir=os.path.join(args.out, "trainer"), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=min(10, args.max_steps // 10),
        logging_steps=max(1, args.check_every), save_strategy="no", report_to=[], seed=args.seed,
        max_length=args.seq_len, packing=False, use_cpu=not torch.cuda.is_available(), disable_tqdm=False,
        dataloader_num_workers=0, bf16=args.bf16, fp16=False,
    )
    trainer = EarlyExitTrainer(
        model=peft_model, args=config, train_dataset=Dataset.from_dict({"input_ids": train}), processing_class=tok,
        callbacks=[guard], exit_ctx=exit_base, exit_weight=args.exit_weight, keep_weight=args.keep_weight,
        exit_target=args.exit_target,
    )
    trainer.train()
    # The tolerance holds for the weights we keep, whatever the last step did.
    if not guard.check(trainer.state.global_step):
        guard.restore()
    peft_model.eval()
    os.makedirs(args.out, exist_ok=True)
    peft_model.save_pretrained(os.path.join(args.out, "adapter"))
    files_as_umask(os.path.join(args.out, "adapter"))
    merged = peft_model.merge_and_unload().eval()
    after = snapshot(merged, windows, reference, windows, exit_base, prompts, args.exit_layer, args.ks,
                     args.new_tokens)
    if args.merge:
        merged.save_pretrained(os.path.join(args.out, "merged"))
        tok.save_pretrained(os.path.join(args.out, "merged"))
        files_as_umask(os.path.join(args.out, "merged"))

    stopped = f" (stopped by the tolerance at step {guard.stopped_at})" if guard.stopped_at else ""
    print(f"\nmodel={args.model} exit_layer={args.exit_layer}/{num_layers} steps={trainer.state.global_step}{stopped}")
    print(f"{'':<8}{'full agree':>12}{'exit agree':>12}{'full ppl':>10}{'exit ppl':>10}"
          + "".join(f"{'a@' + str(k):>8}" for k in args.ks))
    for name, s in (("before", before), ("after", after)):
        alphas = "".join(f"{s.alpha[k]:>8.3f}" for k in args.ks) if s.alpha else ""
        print(f"{name:<8}{s.full_agreement:>12.4f}{s.exit_agreement:>12.4f}{s.full_perplexity:>10.3f}"
              f"{s.exit_perplexity:>10.3f}{alphas}")
    summary = dict(model=args.model, exit_layer=args.exit_layer, steps=trainer.state.global_step,
                   stopped_by_tolerance_at=guard.stopped_at, min_agreement=args.min_agreement,
                   checks=guard.history, before=asdict(before), after=asdict(after), args=vars(args))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
