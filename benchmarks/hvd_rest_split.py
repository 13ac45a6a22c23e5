"""Where a call's time outside drafting and verification goes, for suffix-only, suffix-only with the hidden-state
plumbing of a model drafter, and HVD (the "rest" column of `benchmarks/hvd_bench.py`).

On the H200, HVD once verified exactly suffix-only's drafts on qwen3_5-small tool_calls (no model-drafter
run) and still took 2-7% longer per call, in the bench's "rest" (+0.10-0.16 ms per forward). This times, per call:
the prefill forward, the drafter's begin / accept / end, the loop's draft and verify columns, and what is left. The
middle variant ("suffix+hidden") is the suffix drafter declaring the EAGLE drafter's hidden layers, so the loop asks
the prefill for hidden states and the static runner keeps the hidden-state history: what HVD's plumbing costs
before its policy does anything. Methods run interleaved, call by call, `--repeats` times each.

    python benchmarks/hvd_rest_split.py --model ../shared/models/qwen3_5-small --compile --compile-verify \\
        --dtype bfloat16 --workload tool_calls
"""

from __future__ import annotations

import statistics
import time

import hvd_bench
import torch
from bench import SuffixStores, quiet_gc
from sessions import timed_generate
from workloads import load_suite

import hf_hybrid_spec.generate as generate_module
from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.drafters import Drafter, make_drafter
from hf_hybrid_spec.hvd.factory import make_cost_profile

PARTS = ("prefill", "begin", "accept", "end", "draft", "verify", "other")


class Timed(Drafter):
    """Delegates to `inner`, timing its begin / accept / end (host time; the loop's own sync points are unchanged)."""

    name = "timed"

    def __init__(self, inner: Drafter, hidden_layers: tuple[int, ...] | None = None):
        self.inner = inner
        self.target_hidden_layers = tuple(inner.target_hidden_layers if hidden_layers is None else hidden_layers)
        self.respects_budget = inner.respects_budget
        self.seconds = dict.fromkeys(("begin", "accept", "end"), 0.0)

    def _timed(self, part, fn, *args):
        start = time.perf_counter()
        fn(*args)
        self.seconds[part] += time.perf_counter() - start

    def begin(self, input_ids, context=None, hidden=None):
        self._timed("begin", self.inner.begin, input_ids, context, hidden if self.inner.target_hidden_layers else None)

    def propose(self, input_ids, budget):
        return self.inner.propose(input_ids, budget)

    def overlap(self):
        self.inner.overlap()

    def accept(self, input_ids, result, hidden=None):
        self._timed("accept", self.inner.accept, input_ids, result, hidden if self.inner.target_hidden_layers else None)

    def end(self, input_ids):
        self._timed("end", self.inner.end, input_ids)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--eagle", default=None)
    parser.add_argument("--predictor", default=None)
    parser.add_argument("--workload", default="tool_calls", choices=hvd_bench.WORKLOADS)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-verify", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    argv = ["--model", args.model, "--dtype", args.dtype] + (["--compile"] if args.compile else []) + \
        (["--compile-verify"] if args.compile_verify else [])
    for flag, value in (("--eagle", args.eagle), ("--predictor", args.predictor)):
        if value:
            argv += [flag, value]
    bargs = hvd_bench.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model, tok = hvd_bench.load_model(args.model, dtype, bargs.device, None)
    eagle_path = hvd_bench._default(bargs.eagle, "drafters", args.model, "-eagle3")
    predictor = hvd_bench._default(bargs.predictor, "payoff", args.model)
    from hf_hybrid_spec.eagle import EagleDrafter

    eagle = EagleDrafter.from_pretrained(eagle_path).to(device=bargs.device, dtype=dtype).eval()
    methods = hvd_bench.Methods(bargs, model, eagle, predictor, None)  # profiled here, kept in memory
    make_cost_profile(methods.learned, model, eagle)
    layers = tuple(make_drafter(methods.learned, model, eagle).target_hidden_layers)

    prefill = [0.0]
    plain_forward = generate_module.forward_tokens
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed_forward(*a, **k):  # the loop's prefill (its only forward_tokens call)
        sync()
        start = time.perf_counter()
        out = plain_forward(*a, **k)
        sync()
        prefill[0] += time.perf_counter() - start
        return out

    generate_module.forward_tokens = timed_forward

    variants = {
        "suffix": lambda: Timed(make_drafter(methods.suffix, model)),
        "suffix+hidden": lambda: Timed(make_drafter(methods.suffix, model), layers),
        "hvd": lambda: Timed(make_drafter(methods.learned, model, eagle)),
    }
    suite = load_suite(bargs.workloads)
    sessions = suite.select([args.workload], "heldout", args.sessions, interleave=True)
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, eos_token_id=None,
                      pad_token_id=tok.pad_token_id)
    parts = {name: {p: [] for p in PARTS + ("total",)} for name in variants}
    mismatches = dict.fromkeys(variants, 0)
    stores = SuffixStores()
    for warm in (True, False):
        if not warm:
            quiet_gc()
        for session in sessions[:1] if warm else sessions:
            outputs: list[str] = []
            for call in range(session.num_calls):
                ids = tok(session.prompt(call, outputs), return_tensors="pt").input_ids.to(bargs.device)
                ref = timed_generate(model, ids, gen_kwargs).sequences
                outputs.append(tok.decode(ref[0, ids.shape[1]:]))
                for rep in range(args.repeats):
                    for name, build in (variants.items() if rep % 2 == 0 else reversed(variants.items())):
                        drafter = build()
                        saved = stores.snapshot(name) if rep < args.repeats - 1 else None
                        stores.enter(name)
                        prefill[0] = 0.0
                        run = timed_generate(model, ids, gen_kwargs, assistant_config=methods.suffix
                                             if name != "hvd" else methods.learned, drafter=drafter)
                        stores.leave(name)
                        if saved is not None:
                            stores.restore(name, saved)
                        # (bf16 on the static path can flip a near-tie against stock greedy, for every variant
                        # alike: counted, as the bench's --allow-mismatch does; fp32 identity is what CI tests)
                        mismatches[name] += int(not torch.equal(run.sequences, ref))
                        if warm:
                            continue
                        got = dict(prefill=prefill[0], draft=run.stats.draft_seconds,
                                   verify=run.stats.verify_seconds, **drafter.seconds)
                        got["other"] = run.seconds - sum(got.values())
                        got["total"] = run.seconds
                        for p, v in got.items():
                            parts[name][p].append(1e3 * v)
    calls = len(parts["suffix"]["total"])
    print(f"{args.model} {args.dtype} {args.workload}: {calls} timed calls per variant (ms per call, median); "
          f"calls differing from stock greedy: {mismatches}")
    print(f"{'variant':<15}" + "".join(f"{p:>10}" for p in PARTS + ("total",)))
    for name, values in parts.items():
        print(f"{name:<15}" + "".join(f"{statistics.median(values[p]):>10.3f}" for p in PARTS + ("total",)))
    base = parts["suffix"]["total"]
    for name in ("suffix+hidden", "hvd"):
        ratios = [b / m for b, m in zip(base, parts[name]["total"])]
        print(f"suffix / {name} per call: median {statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f}")


if __name__ == "__main__":
    main()
