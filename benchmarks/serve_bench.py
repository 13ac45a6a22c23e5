"""Benchmark: serving agentic multi-turn sessions under Poisson arrivals, in one process.

    python benchmarks/serve_bench.py --model ../shared/models/qwen3_5-small --rates 0.5 2 8 --out out/serve
    python benchmarks/serve_bench.py --model tiny:qwen3_5_text --dtype float32 --device cpu --sessions 4 --dry-run

Sessions come from the workload suite (`benchmarks/workloads.json`: agent loops, code edits, tool calls, plain code).
Sessions arrive as a Poisson process at each `--rates` value (sessions per second); within a session call i + 1 is sent
the moment call i returns, its prompt the token ids of call i's prompt, call i's reply and the session's next text
(an agent that keeps token ids, so a follow-up call extends the last one token for token). Methods:

- `stock`: stock `generate(cache_implementation="static")` (compiled; warmed up first) serving requests one at a
  time in arrival order, the way a user without a batching engine serves;
- `cb`: our continuous batching with speculation off (every step a plain decode step over the running requests);
- `cb+spec`: our continuous batching with tree speculation (`AssistantConfig()` as it comes), prefix reuse on;
- `cb+spec-noreuse`: the same without the prefix store (what reuse saves on follow-up calls' time to first token);
- `cb+spec-lanes2`: `cb+spec` with the slots split between two engines stepped in turn (`ServingConfig(lanes=2)`:
  one's host work while the device runs the other's forward);
- `cb-unfused`, `cb+spec-unfused` (not run unless named in `--methods`): `cb` and `cb+spec` with the engine's runner
  without the fused verify forward (`AssistantConfig(compile_verify=False)`; "auto", the default, fuses on a GPU), for
  an A/B of the two runners in one run.

With `--fault-every N` each CB method also runs as `<method>+faults`: every N-th request sent fails in its own
stopping criterion; its error comes back (`faults` counts them) and the client sends the call again. `unanswered`
counts requests without an answer when a run ends (lost ones, unless the `--max-seconds` bound cut the run).
With `--sampling-share P` the calls of that share of the sessions (chosen with `--seed`) sample as Qwen3.5's
generation config asks (temperature 0.7, top-p 0.95, top-k 20), stock's and ours; the others stay greedy (the gate
checks greedy replies).

First a correctness gate (each CB method's greedy replies against plain `generate` on the same prompts: exact in fp32;
bf16 reports the share of identical replies), an untimed pass over the sessions (autotuning and compiles of every
prompt shape), then every method at every rate, bounded by `--max-seconds` per run.
Per run: time to first token and time per output token (p50 / p99, ms), TTFT of follow-up calls, committed tokens/s
over the run, mean accepted length. A table, a PNG (TPOT p50 and throughput against the rate), and a JSON line last.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench import load_model, quiet_gc
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.utils import logging
from workloads import load_suite

from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.config import AssistantConfig
from hf_hybrid_spec.drafters.suffix_native import native_available
from hf_hybrid_spec.serving import ContinuousBatchingManager, ServingConfig

logger = logging.get_logger(__name__)

DEFAULT_METHODS = ("stock", "cb", "cb+spec", "cb+spec-noreuse", "cb+spec-lanes2")
METHODS = DEFAULT_METHODS + ("cb-unfused", "cb+spec-unfused")


@dataclass
class Call:
    """One request of the load: its session and call index, when it was sent, its first and last token's times
    (perf_counter seconds), new tokens, prompt tokens reused from the prefix store and mean accepted length."""

    session: int
    call: int
    sent: float
    first: float
    last: float
    new_tokens: int
    prompt_tokens: int
    reused: int = 0
    accepted: float = 1.0


def session_pieces(tokenizer, sessions) -> list[list[list[int]]]:
    """Each session's texts as token ids (call i's new text)."""
    return [[tokenizer(t, add_special_tokens=False).input_ids for t in s.texts] for s in sessions]


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) of `count` sessions at `rate` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# The sampling Qwen3.5's generation config asks for: the settings of the sampled sessions (`--sampling-share`).
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.95, top_k=20)


def _gen(tokenizer, max_new: int, sampling: bool = False) -> GenerationConfig:
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    settings = SAMPLING if sampling else dict(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new, eos_token_id=eos,
                            pad_token_id=(tokenizer.pad_token_id if tokenizer is not None else None) or eos or 0,
                            **settings)


def sampled_sessions(sessions: int, share: float, seed: int) -> frozenset[int]:
    """The sessions whose calls sample (`SAMPLING`): round(share * sessions) of them, chosen with `seed`."""
    return frozenset(random.Random(seed).sample(range(sessions), round(share * sessions)))


class InjectedFault(RuntimeError):
    pass


class _FailingCriterion:
    """A stopping criterion that raises at its first call: the injected fault of `--fault-every` (one request's own
    hook failing, as a user's criterion or processor can)."""

    def __call__(self, input_ids, scores, **kwargs):
        raise InjectedFault("injected fault")


@dataclass
class RunCounts:
    """What a run's requests came to beyond their calls: faults injected (each answered with its error, then sent
    again, as a client retries) and requests still unanswered when the run ended (lost, unless the bound cut it)."""

    faults: int = 0
    unanswered: int = 0


def run_cb(manager: ContinuousBatchingManager, pieces, times: list[float], max_new: int, deadline: float,
           bar, fault_every: int = 0, counts: RunCounts | None = None, sampled: frozenset[int] = frozenset(),
           sampling: GenerationConfig | None = None) -> list[Call]:
    """Drive `manager` with the sessions arriving at `times`; each call's follow-up sent when it returns. With
    `fault_every` N, every N-th request sent carries a stopping criterion that raises: its error must come back, and
    the call is sent again (its time to first token counts from the first send). The calls of the `sampled` sessions
    carry the `sampling` generation config (the others the manager's)."""
    counts = counts if counts is not None else RunCounts()
    start = time.perf_counter()
    due = sorted((t, s) for s, t in enumerate(times))
    prompts: dict[int, list[int]] = {}
    inflight: dict[str, tuple[int, int, float]] = {}
    calls: list[Call] = []
    sent_count = 0

    def send(s: int, call: int, sent: float) -> None:
        nonlocal sent_count
        sent_count += 1
        fault = fault_every > 0 and sent_count % fault_every == 0
        rid = manager.add_request(prompts[s], max_new_tokens=max_new, record_timestamps=True,
                                  generation_config=sampling if s in sampled else None,
                                  stopping_criteria=[_FailingCriterion()] if fault else None)
        inflight[rid] = (s, call, sent)

    while (due or inflight) and time.perf_counter() - start < deadline:
        now = time.perf_counter()
        while due and due[0][0] <= now - start:
            _, s = due.pop(0)
            prompts[s] = list(pieces[s][0])
            send(s, 0, time.perf_counter())
        out = manager.get_result(timeout=0.001)
        if out is None:
            continue
        s, call, sent = inflight.pop(out.request_id)
        if out.error is not None and "injected fault" in str(out.error):
            counts.faults += 1
            send(s, call, sent)
            continue
        bar.update(1)
        if out.error is not None:  # counted, and the session ends there (summaries report `failed`)
            logger.warning("session %d call %d failed: %s", s, call, out.error)
            calls.append(Call(s, call, sent, float("nan"), float("nan"), -1, len(out.prompt_ids)))
            continue
        stamps = out.timestamps or [time.perf_counter()]
        stats = out.spec_stats
        calls.append(Call(s, call, sent, stamps[0], stamps[-1], len(out.generated_tokens), len(out.prompt_ids),
                          out.reused_prefix_tokens, stats.mean_accepted_length if stats else 1.0))
        if call + 1 < len(pieces[s]):
            prompts[s] = prompts[s] + list(out.generated_tokens) + list(pieces[s][call + 1])
            send(s, call + 1, time.perf_counter())
    counts.unanswered = len(inflight)
    for rid in inflight:
        manager.cancel_request(rid)
    return calls


class _Stamps:
    """A streamer that keeps the time of every token after the prompt (synchronized: it reads the token)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt = True

    def put(self, value):
        if self._prompt:
            self._prompt = False
            return
        value.cpu()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_stock(model, tokenizer, pieces, times: list[float], max_new: int, deadline: float, bar,
              sampled: frozenset[int] = frozenset()) -> list[Call]:
    """Stock static generate serving one request at a time in the order they were sent."""
    start = time.perf_counter()
    queue = [(start + t, s, 0, list(pieces[s][0])) for s, t in enumerate(times)]
    heapq.heapify(queue)
    gen, sampling = _gen(tokenizer, max_new), _gen(tokenizer, max_new, sampling=True)
    calls = []
    while queue and time.perf_counter() - start < deadline:
        sent, s, call, prompt = heapq.heappop(queue)
        wait = sent - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        stamps = _Stamps()
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="static", streamer=stamps,
                             generation_config=sampling if s in sampled else gen)
        new = out[0, len(prompt):].tolist()
        calls.append(Call(s, call, sent, stamps.times[0], stamps.times[-1], len(new), len(prompt)))
        bar.update(1)
        if call + 1 < len(pieces[s]):
            heapq.heappush(queue, (time.perf_counter(), s, call + 1, prompt + new + list(pieces[s][call + 1])))
    return calls


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def summarize(calls: list[Call]) -> dict:
    failed = sum(c.new_tokens < 0 for c in calls)
    calls = [c for c in calls if c.new_tokens >= 0]
    ttft = [1e3 * (c.first - c.sent) for c in calls]
    follow = [1e3 * (c.first - c.sent) for c in calls if c.call > 0]
    tpot = [1e3 * (c.last - c.first) / (c.new_tokens - 1) for c in calls if c.new_tokens > 1]
    span = (max(c.last for c in calls) - min(c.sent for c in calls)) if calls else float("nan")
    tokens = sum(c.new_tokens for c in calls)
    return {"calls": len(calls), "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "follow_ttft_p50": percentile(follow, 50), "tpot_p50": percentile(tpot, 50),
            "tpot_p99": percentile(tpot, 99), "tokens_per_s": tokens / span if span > 0 else float("nan"),
            "accepted": sum(c.accepted * c.new_tokens for c in calls) / max(tokens, 1),
            "reused_tokens": sum(c.reused for c in calls), "prompt_tokens": sum(c.prompt_tokens for c in calls),
            "failed": failed}


def make_manager(model, method: str, prefill: str, args, gen: GenerationConfig) -> ContinuousBatchingManager:
    base = method.removesuffix("-unfused")
    serving = ServingConfig(max_slots=args.max_slots, max_total_tokens=args.max_total_tokens,
                            prefix_cache_bytes=0 if base in ("cb", "cb+spec-noreuse") else args.prefix_cache_mb << 20,
                            speculation=base != "cb", prefill=prefill, prefill_chunk=args.prefill_chunk,
                            lanes=2 if base.endswith("-lanes2") else 1)
    unfused = args.unfused or method.endswith("-unfused")
    config = AssistantConfig(global_cache=False, compile_verify=False if unfused else "auto")
    return ContinuousBatchingManager(model, config, serving, gen)


class _ThreadProfile:
    """cProfile enabled around each engine step from `armed` on, on the engine's thread. Before Python 3.12 it sees
    that thread alone; from 3.12 the other threads' calls during a step show too (the bench's own polling, as lock
    acquires and condition waits)."""

    def __init__(self):
        import cProfile
        import threading

        self.profile = cProfile.Profile()
        self.armed = threading.Event()


def profile_thread(manager: ContinuousBatchingManager) -> _ThreadProfile:
    """Wrap the manager's loop so that its steps after `armed` is set (the warm-up request done) are profiled."""
    profiler, step = _ThreadProfile(), manager.engine.step

    def profiled_step():
        if not profiler.armed.is_set():
            return step()
        profiler.profile.enable()
        try:
            return step()
        finally:
            profiler.profile.disable()

    manager.engine.step = profiled_step
    return profiler


def report_profile(profiler: _ThreadProfile, label: str, out: str | None, filename: str, top: int = 25) -> None:
    """Print the `top` host functions of the profiled steps by own time (and the full lists to `out/filename`)."""
    import io
    import pstats

    stream = io.StringIO()
    pstats.Stats(profiler.profile, stream=stream).sort_stats("tottime").print_stats(top)
    print(f"--- profile {label}\n" + "\n".join(stream.getvalue().splitlines()[-top - 2 :]))
    if out:
        stream = io.StringIO()
        stats = pstats.Stats(profiler.profile, stream=stream)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats("hf_hybrid_spec", 60)
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / filename).write_text(stream.getvalue())


def cb_runs(methods, modes, fault_every: int = 0) -> list[tuple[str, str, str, int]]:
    """(label, method, prefill mode, fault_every) of every CB run at a rate; the label names the mode when several are
    given. With `fault_every`, each run is followed by the same run with faults injected (label `+faults`)."""
    runs = [(m if len(modes) == 1 else f"{m}/{mode}", m, mode) for m in methods if m != "stock" for mode in modes]
    return [(label + suffix, m, mode, every) for label, m, mode in runs
            for suffix, every in ([("", 0), ("+faults", fault_every)] if fault_every else [("", 0)])]


def gate(model, tokenizer, pieces, args, gen) -> dict:
    """Greedy replies of each CB method (in each prefill mode) on the first calls of a few sessions against plain
    generate."""
    prompts = [p[0] for p in pieces[: args.gate]]
    refs = []
    for ids in prompts:
        t = torch.tensor([ids], device=model.device)
        refs.append(model.generate(t, attention_mask=torch.ones_like(t), generation_config=gen)[0, len(ids):].tolist())
    shares = {}
    # Every CB method of the default list, whatever --methods runs, and the unfused ones where asked for.
    gated = [m for m in METHODS[1:] if m in DEFAULT_METHODS or m in args.methods]
    for label, method, mode, _ in cb_runs(gated, args.prefill):
        manager = make_manager(model, method, mode, args, gen)
        with manager:
            rids = [manager.add_request(ids, max_new_tokens=args.max_new_tokens) for ids in prompts]
            outs = [manager.get_result(rid, timeout=600) for rid in rids]
        same = [o is not None and o.generated_tokens == r for o, r in zip(outs, refs)]
        shares[label] = sum(same) / len(same)
        if not all(same) and not args.allow_mismatch:
            raise SystemExit(f"gate failed: {label} differs from plain generate on {same.count(False)} of "
                             f"{len(same)} prompts (pass --allow-mismatch in bf16)")
    return shares


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        axes[0].plot([r["rate"] for r in mine], [r["tpot_p50"] for r in mine], marker="o", label=method)
        axes[1].plot([r["rate"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=method)
    axes[0].set(xlabel="sessions per second", ylabel="TPOT p50 (ms)", xscale="log")
    axes[1].set(xlabel="sessions per second", ylabel="committed tokens/s", xscale="log")
    axes[1].legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint path (with its tokenizer) or tiny:<family>")
    parser.add_argument("--suite", default=str(Path(__file__).with_name("workloads.json")))
    parser.add_argument("--split", default="heldout", help="heldout, train or any")
    parser.add_argument("--sessions", type=int, default=24, help="sessions per run")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0, 8.0], help="sessions per second")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-slots", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--prefix-cache-mb", type=int, default=1024)
    parser.add_argument("--prefill", nargs="+", default=[ServingConfig.prefill], choices=["eager", "chunked"],
                        help="how our engine runs joining prompts (ServingConfig.prefill); with both, every CB method "
                             "runs in each mode, labelled method/mode")
    parser.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per step with --prefill chunked")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="bound on each run")
    parser.add_argument("--gate", type=int, default=4, help="prompts in the correctness gate")
    parser.add_argument("--allow-mismatch", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampling-share", type=float, default=0.0,
                        help="share of the sessions whose calls sample as Qwen3.5's generation config asks "
                             "(temperature 0.7, top-p 0.95, top-k 20; chosen with --seed); the rest greedy")
    parser.add_argument("--no-warm-pass", action="store_true", help="skip the untimed pass over the sessions")
    parser.add_argument("--out", default=None, help="folder for the PNG and the JSON")
    parser.add_argument("--dry-run", action="store_true", help="2 sessions, one rate, small bounds (a smoke test)")
    parser.add_argument("--unfused", action="store_true",
                        help="every engine's runner without the fused verify forward (AssistantConfig("
                             "compile_verify=False); the default \"auto\" fuses on a GPU)")
    parser.add_argument("--fault-every", type=int, default=0,
                        help="also run each CB method with every N-th request failing in its own stopping criterion "
                             "(answered with its error, then sent again); 0: no fault runs")
    parser.add_argument("--profile", nargs="*", default=[], choices=METHODS[1:],
                        help="CB methods whose timed runs also run the engine's thread under cProfile (host functions "
                             "by own time printed, all of them to --out/profile_<method>_<rate>.txt, punctuation as _)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.sessions, args.rates, args.max_new_tokens, args.max_seconds = 2, args.rates[:1], 8, 60.0
        args.gate = 1

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), args.device)
    if tokenizer is None:
        raise SystemExit("serve_bench needs a checkpoint with a tokenizer (the sessions are text)")
    suite = load_suite(args.suite)
    sessions = suite.select(split=None if args.split == "any" else args.split, interleave=True)[: args.sessions]
    pieces = session_pieces(tokenizer, sessions)
    gen = _gen(tokenizer, args.max_new_tokens)
    if not 0.0 <= args.sampling_share <= 1.0:
        parser.error(f"--sampling-share is a share between 0 and 1, got {args.sampling_share}")
    sampled = sampled_sessions(len(pieces), args.sampling_share, args.seed)
    sampling = _gen(tokenizer, args.max_new_tokens, sampling=True)
    quiet_gc()
    shares = gate(model, tokenizer, pieces, args, gen)
    logger.warning("gate: identical greedy replies %s", shares)
    total_calls = sum(len(p) for p in pieces)
    if not args.no_warm_pass:
        # One untimed pass over every session first: the prefill kernels' Triton autotuning (per shape) and compiles
        # happen here, not inside whichever method runs first.
        for mode in args.prefill:
            manager = make_manager(model, "cb+spec", mode, args, gen)
            with manager:
                bar = tqdm(total=total_calls, desc=f"warm pass ({mode})", unit="call", leave=False)
                run_cb(manager, pieces, arrivals(len(pieces), max(args.rates), args.seed), args.max_new_tokens,
                       args.max_seconds, bar)
                bar.close()
    rows = []
    for rate in args.rates:
        times = arrivals(len(pieces), rate, args.seed)
        runs = (([("stock", "stock", None, 0)] if "stock" in args.methods else [])
                + cb_runs(args.methods, args.prefill, args.fault_every))
        for label, method, mode, fault_every in runs:
            counts = RunCounts()
            bar = tqdm(total=total_calls, desc=f"{label} @ {rate}/s", unit="call", leave=False)
            if method == "stock":
                # Several prompt lengths, with a streamer as timed: dynamo's dynamic shapes settle before timing.
                warm = torch.tensor([max((p[0] for p in pieces), key=len)], device=model.device)
                for n in sorted({warm.shape[1], warm.shape[1] // 2 + 1, warm.shape[1] // 4 + 1, 7, 3}):
                    model.generate(warm[:, :n], attention_mask=torch.ones_like(warm[:, :n]), generation_config=gen,
                                   cache_implementation="static", streamer=_Stamps())
                calls = run_stock(model, tokenizer, pieces, times, args.max_new_tokens, args.max_seconds, bar,
                                  sampled)
            else:
                manager = make_manager(model, method, mode, args, gen)
                profiler = profile_thread(manager) if method in args.profile else None
                with manager:
                    warm = manager.add_request(pieces[0][0], max_new_tokens=args.max_new_tokens)  # captures, budget
                    manager.get_result(warm, timeout=600)
                    if manager.engine.prefixes is not None:
                        manager.engine.prefixes.clear()
                    before = dataclasses.replace(manager.engine.stats)
                    if profiler is not None:
                        profiler.armed.set()
                    calls = run_cb(manager, pieces, times, args.max_new_tokens, args.max_seconds, bar, fault_every,
                                   counts, sampled, sampling)
                    after = manager.engine.stats
                    engine = {f.name: round(getattr(after, f.name) - getattr(before, f.name), 4)
                              for f in dataclasses.fields(after)}
                if profiler is not None:
                    name = "".join(c if c.isalnum() else "_" for c in f"{label}_{rate:g}")
                    report_profile(profiler, f"{label} @ {rate}/s", args.out, f"profile_{name}.txt")
            bar.close()
            summary = summarize(calls)
            rows.append({"method": label, "rate": rate, **summary, **dataclasses.asdict(counts),
                         "complete": summary["calls"] == total_calls,
                         **({"engine": engine} if method != "stock" else {})})
    cols = ("method", "rate", "calls", "failed", "faults", "unanswered", "ttft_p50", "ttft_p99", "follow_ttft_p50", "tpot_p50", "tpot_p99",
            "tokens_per_s", "accepted")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    for r in rows:
        if "engine" in r:
            e = r["engine"]
            logger.warning("%s @ %s/s engine: %d steps, %.2f tokens/step; seconds: prefill %.2f, begin %.2f, draft "
                           "%.2f, verify %.2f, record %.2f", r["method"], r["rate"], e["steps"],
                           e["new_tokens"] / max(e["steps"], 1), e["prefill_seconds"], e["begin_seconds"],
                           e["draft_seconds"], e["verify_seconds"], e["record_seconds"])
    result = {"bench": "serve", "model": args.model, "dtype": args.dtype, "device": str(model.device),
              "sessions": len(pieces), "calls": total_calls, "max_new_tokens": args.max_new_tokens,
              "sampled_sessions": len(sampled),
              "max_slots": args.max_slots, "prefill": args.prefill, "gate": shares, "rows": rows,
              "suffix_trie": "native" if native_available() else "python"}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out / "serve.png")
        (out / "serve.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
