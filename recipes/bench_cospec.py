"""Benchmark of lossy verification on next-line code completion: target-only, draft-only, lossless speculation,
FLy, typical acceptance and CoSpec, for both target/draft pairings of the fixtures, side by side.

    python recipes/bench_cospec.py --task cospec_data --split test --limit 200 --out bench_cospec

1. Correctness gate (first `--gate` examples, both pairings): lossless speculation and CoSpec with an arbiter
   that never overrides must equal target-only greedy token for token; CoSpec with an arbiter that always
   overrides must equal draft-only greedy. Any difference stops the benchmark.
2. Timing: per example, every method runs back to back in one process (the two plain AR runs are shared by the
   pairings: qwen AR is target-only for one and draft-only for the other), in a balanced order per example, so
   the noise of a shared machine hits all methods alike. The target's and the draft's prefill of the prompt are
   timed too, to also report a decode-phase speedup (total minus prefill), an estimate.
3. A table per pairing: accuracy (exact next line), wins / losses against target-only, speedup over target-only
   autoregressive decoding (summed wall time), target forwards per generated token, arbiter overrides per
   example; a PNG of accuracy against speedup; a JSON line last.

CoSpec uses the trained arbiters in `--arbiters/<target>_drafted-by_<draft>` (see recipes/train_cospec.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from hf_hybrid_spec.cli import argument_parser


def parse_args(argv=None):
    p = argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True, help="directory of the task DatasetDict (recipes/cospec_task.py)")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=200, help="first N examples of the split")
    p.add_argument("--models", nargs=2, default=["../shared/models/qwen3_5-small", "../shared/models/falcon_h1-small"],
                   help="the two fixtures (same tokenizer); each drafts for the other")
    p.add_argument("--arbiters", default="checkpoints/arbiters", help="folder of trained arbiters, one per pairing")
    p.add_argument("--max-depth", type=int, default=6, help="draft chain length")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--fly-window", type=int, default=3, help="FLy's window (FLy: 6 for 15-token drafts)")
    p.add_argument("--fly-threshold", type=float, default=0.3, help="FLy's entropy gate (top-3 entropy, nats)")
    p.add_argument("--pairing", default="both", choices=["both", "0", "1"],
                   help="both pairings, or only model 0 (or 1) as the target: two processes can split the work")
    p.add_argument("--gate", type=int, default=5, help="examples in the correctness gate")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench_cospec", help="folder for results.json and accuracy_speedup.png")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help, --version and bad options answer here, before torch and the models load

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench.balanced_order
from bench import balanced_order  # noqa: E402
from cospec_task import load_task, method_config, run_method  # noqa: E402

from hf_hybrid_spec.cospec import ConstantArbiter, CoSpecArbiter  # noqa: E402

SPEC_METHODS = ("lossless", "fly", "typical", "cospec")
ROWS = ("target", "draft") + SPEC_METHODS


def pairing_name(target: str, draft: str) -> str:
    return f"{target}_drafted-by_{draft}"


@torch.no_grad()
def prefill_seconds(model, tokenizer, prompt: str) -> float:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    model(ids, logits_to_keep=1)
    return time.perf_counter() - t0


def gate(examples, models, tokenizer, pairings, args) -> None:
    for ex in tqdm(examples, desc="gate", leave=False):
        for tname, dname in pairings:
            target, draft = models[tname], models[dname]
            ref_t = run_method("target", ex, target, draft, tokenizer, args.max_new_tokens)
            ref_d = run_method("draft", ex, target, draft, tokenizer, args.max_new_tokens)
            checks = {
                "lossless": (run_method("lossless", ex, target, draft, tokenizer, args.max_new_tokens, args.max_depth),
                             ref_t),
                "never-override": (run_method("cospec", ex, target, draft, tokenizer, args.max_new_tokens,
                                              args.max_depth, arbiter=ConstantArbiter(False)), ref_t),
                "always-override": (run_method("cospec", ex, target, draft, tokenizer, args.max_new_tokens,
                                               args.max_depth, arbiter=ConstantArbiter(True)), ref_d),
            }
            for name, (got, want) in checks.items():
                if got.completion != want.completion:
                    raise SystemExit(f"correctness gate failed: {name} on {ex['id']} ({tname} <- {dname}): "
                                     f"{got.completion!r} != {want.completion!r}")


def summarize(records: list[dict], pairing: str) -> dict:
    """Per-method totals of one pairing."""
    rows = {}
    base = [r["runs"][pairing]["target"] for r in records]
    t_base = sum(b["seconds"] for b in base)
    p_t = sum(r["prefill"][pairing]["target"] for r in records)
    p_d = sum(r["prefill"][pairing]["draft"] for r in records)
    for m in ROWS:
        runs = [r["runs"][pairing][m] for r in records]
        secs = sum(x["seconds"] for x in runs)
        tokens = max(1, sum(x["new_tokens"] for x in runs))
        prefill = p_t if m == "target" else p_d if m == "draft" else p_t + p_d
        rows[m] = {
            "accuracy": sum(x["correct"] for x in runs) / len(runs),
            "wins": sum(x["correct"] and not b["correct"] for x, b in zip(runs, base)),
            "losses": sum(b["correct"] and not x["correct"] for x, b in zip(runs, base)),
            "speedup": t_base / secs,
            "decode_speedup": (t_base - p_t) / max(1e-9, secs - prefill),
            "target_forwards_per_token": sum(x["target_forwards"] for x in runs) / tokens,
            "overrides_per_example": sum(x["overrides"] for x in runs) / len(runs),
            "seconds": secs,
        }
    return rows


def print_table(pairing: str, rows: dict, n: int) -> None:
    print(f"\n{pairing}  ({n} examples)")
    print(f"{'method':<10} {'accuracy':>9} {'wins/losses':>12} {'speedup':>8} {'decode':>7} {'fwd/tok':>8} "
          f"{'overrides':>9}")
    for m, r in rows.items():
        print(f"{m:<10} {r['accuracy']:>9.3f} {r['wins']:>5}/{r['losses']:<6} {r['speedup']:>8.2f} "
              f"{r['decode_speedup']:>7.2f} {r['target_forwards_per_token']:>8.3f} {r['overrides_per_example']:>9.2f}")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4.5), squeeze=False)
    for ax, (pairing, rows) in zip(axes[0], summary.items()):
        for m, r in rows.items():
            ax.scatter(r["speedup"], r["accuracy"], s=50)
            ax.annotate(m, (r["speedup"], r["accuracy"]), textcoords="offset points", xytext=(5, 4))
        ax.axhline(rows["target"]["accuracy"], color="gray", lw=0.8, ls="--")
        ax.set_xlabel("speedup over target-only AR (wall time, CPU)")
        ax.set_ylabel("exact next-line accuracy")
        ax.set_title(pairing.replace("_drafted-by_", " drafted by "))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = [Path(m).name for m in args.models]
    models = {n: AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32, attn_implementation="sdpa").eval()
              for n, m in zip(names, args.models)}
    tokenizer = AutoTokenizer.from_pretrained(args.models[0])
    pairings = [(names[0], names[1]), (names[1], names[0])]
    if args.pairing != "both":
        pairings = [pairings[int(args.pairing)]]
    arbiters = {pairing_name(t, d): CoSpecArbiter.from_pretrained(Path(args.arbiters) / pairing_name(t, d)).eval()
                for t, d in pairings}
    split = load_task(args.task)[args.split]
    examples = split.select(range(min(args.limit, len(split))))

    gate(examples.select(range(min(args.gate, len(examples)))), models, tokenizer, pairings, args)

    records = []
    for i, ex in enumerate(tqdm(examples, desc="examples")):
        jobs = [("ar", n) for n in names] + [(m, pr) for pr in pairings for m in SPEC_METHODS]
        jobs = balanced_order(jobs, i)  # each job first, and right after each other job, equally often
        ar, runs = {}, {pairing_name(t, d): {} for t, d in pairings}
        for kind, what in jobs:
            if kind == "ar":
                ar[what] = run_method("target", ex, models[what], None, tokenizer, args.max_new_tokens)
                continue
            t, d = what
            overrides = {"fly_window": args.fly_window, "fly_entropy_threshold": args.fly_threshold}
            cfg = method_config(kind, args.max_depth, arbiter=arbiters[pairing_name(t, d)] if kind == "cospec" else None,
                                **(overrides if kind == "fly" else {}))
            runs[pairing_name(t, d)][kind] = run_method(kind, ex, models[t], models[d], tokenizer,
                                                        args.max_new_tokens, args.max_depth, config=cfg)
        pre = {n: prefill_seconds(models[n], tokenizer, ex["prompt"]) for n in names}
        rec = {"id": ex["id"], "runs": {}, "prefill": {}}
        for t, d in pairings:
            key = pairing_name(t, d)
            draft_only = dict(vars(ar[d]), target_forwards=0)
            rec["runs"][key] = {"target": vars(ar[t]), "draft": draft_only, **{m: vars(r) for m, r in runs[key].items()}}
            rec["prefill"][key] = {"target": pre[t], "draft": pre[d]}
        records.append(rec)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {pairing_name(t, d): summarize(records, pairing_name(t, d)) for t, d in pairings}
    for pairing, rows in summary.items():
        print_table(pairing, rows, len(records))
    plot(summary, out / "accuracy_speedup.png")
    (out / "results.json").write_text(json.dumps({"summary": summary, "records": records}, indent=1) + "\n")
    print(json.dumps({"examples": len(records), "split": args.split, "max_depth": args.max_depth,
                      "fly_window": args.fly_window, "summary": summary}))


if __name__ == "__main__":
    main()
