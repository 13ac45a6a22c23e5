"""Benchmark: batched speculative decoding against stock batched decoding, at several batch sizes, same process.

    python benchmarks/batch_bench.py --model ../shared/models/qwen3_5-small --batch-sizes 1 4 8 --out out/batch
    python benchmarks/batch_bench.py --model random:qwen3_5-2b --drafters acceptance:0.6 acceptance:0.8 ...

For each batch size B: B prompts of exactly `--prompt-tokens` tokens (code prompts for a checkpoint, random tokens for
`random:` models), or with `--prompt-source sympy` windows of an installed package's source files (which the fixtures
never saw) of `--prompt-tokens` to `--prompt-tokens-max` tokens, left-padded as a tokenizer pads a batch, then

1. stock `generate(cache_implementation="static")` (transformers compiles its forward; warmed up first, so no compile
   is timed) and stock eager `generate`: the baselines, and the greedy reference;
   (methods run as `AssistantConfig()` comes, compile="auto" and compile_verify="auto": the batched static runner
   with CUDA graphs and the fused verify forward on a GPU)
2. correctness gate: each method's greedy rows against stock eager's (exact in fp32; bf16 rounds batched trees and
   single tokens differently, so `--allow-mismatch` reports the share of identical rows instead of failing);
3. each method timed after a warm-up call (the batch budget's calibration happens there): `suffix` (the default
   drafter, batch budget "auto"), `suffix:fixed` (every row its full tree), `suffix:eager` (compile=False),
   `suffix:unfused` (the captured verify forward without its pure regions Inductor-compiled, `compile_verify=False`),
   `eagle` (the EAGLE-3 drafter of `--eagle`, its default 60-node trees, one expansion for every row per step; a
   random-weight drafter for tiny: / random: models), `eagle:fused` (its passes Inductor-compiled before capture,
   `compile_drafter=True`), `eagle:eager` (compile=False), `mtp` (the checkpoint's MTP head of `--mtp`, its default
   chain of 3, one expansion for every row per step; `mtp:tree`: trees of 12 nodes, depth 3, top-k 4; a random head
   for tiny: / random: models) and
   `acceptance:P` (the target's own continuation with each token corrupted with probability 1 - P: a known
   acceptance on random weights; at B > 1 one drafter for the batch drafting on the device, so the greedy batch runs
   the pipelined step as EAGLE does). `random:` models get `testing.decisive_head` (the argmax is the current token
   by a wide margin: bf16 rounding cannot flip it, so the continuation the acceptance drafters follow holds). Any
   method with `+chunked` or `+eager` appended runs with that `prefill` (the prompts through the captured verify
   forward, or one eager forward; the default "auto" picks by the call's prompt tokens) for a side-by-side comparison;
   `+nographs` (a diagnostic) runs the batched static runner without CUDA graphs, its ops launched one by one;
   `serve` / `serve:plain`: the serving engine's `generate_batch` over the same prompts (unpadded, as lists of token
   ids, each its own request: continuous batching, every prompt in a slot of its own, the suffix drafter / no
   speculation; the engine takes no hidden-state drafter such as EAGLE yet) with the same generation config;

`--preset min-new` runs every call greedy with one logits processor: the model's eos on, and `min_new_tokens` (every
call's is `max_new_tokens`) removing it at each step; `--preset penalty` adds `repetition_penalty=1.1`, a processor
that reads each position's ids. `--preset sampling` runs every call, stock's and ours, with the sampling Qwen3.5's
generation config asks for (temperature 0.7, top-p 0.95, top-k 20); there is no gate then (a sample is not stock's
sample: the suite tests the distribution), and the `acceptance:P` methods, which follow the greedy continuation, are
refused.

A table (aggregate committed tokens/s, per-row ms/token, mean accepted length, the share of plain steps the budget
chose, the speedup over stock static), a PNG of tokens/s against B, and a JSON line last.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time

import torch
from bench import _sync, encode_prompts, load_model, quiet_gc
from tqdm.auto import tqdm
from transformers.utils import logging

from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.config import AssistantConfig
from hf_hybrid_spec.engine import budget
from hf_hybrid_spec.generate import speculative_generate
from hf_hybrid_spec.serving import ServingConfig, generate_batch
from hf_hybrid_spec.testing import acceptance_batch_drafter, acceptance_drafter, decisive_head

logger = logging.get_logger(__name__)


# Generation settings of every call (`--preset`): greedy; greedy with one logits processor (`min-new`: the model's eos
# on, so `min_new_tokens`, which every call sets to `max_new_tokens`, removes it at every step: each row still makes
# all its tokens); `penalty`: the same and a repetition penalty of 1.1 (a processor that reads the ids); or the
# sampling of Qwen3.5's generation config. "model" stands for the model's eos id.
PRESETS = {"greedy": {}, "min-new": dict(eos_token_id="model"),
           "penalty": dict(eos_token_id="model", repetition_penalty=1.1),
           "sampling": dict(do_sample=True, temperature=0.7, top_p=0.95, top_k=20)}


def batch_of(prompts: list[torch.Tensor], rows: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `rows` prompts (cycled), left-padded to the longest as `tokenizer(..., padding=True)` with left
    padding gives them: (input_ids [rows, L], attention_mask [rows, L])."""
    chosen = [prompts[i % len(prompts)] for i in range(rows)]
    width = max(p.shape[1] for p in chosen)
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=chosen[0].device)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(chosen):
        ids[b, width - p.shape[1] :] = p[0]
        mask[b, width - p.shape[1] :] = 1
    return ids, mask


def source_prompts(tokenizer, module: str, n: int, shortest: int, longest: int, device, seed: int = 0) -> list:
    """`n` windows of the Python source of the installed package `module` (e.g. sympy or networkx, which the
    fixtures never saw): [1, L_i] each, L_i drawn between `shortest` and `longest` tokens (seeded), each from another
    file (files in a seeded order), starting at a seeded line of it."""
    import importlib.util
    import pathlib
    import random

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--prompt-source {module}: no installed package of that name")
    files = sorted(pathlib.Path(next(iter(spec.submodule_search_locations))).rglob("*.py"))
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for path in files:
        if len(out) == n:
            break
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        if len(lines) < 40:
            continue
        length = rng.randint(shortest, longest)
        start = rng.randrange(0, max(1, len(lines) - 40))
        ids = tokenizer("".join(lines[start : start + 4 * length]), return_tensors="pt").input_ids
        if ids.shape[1] >= length:
            out.append(ids[:, :length].to(device))
    if len(out) < n:
        raise SystemExit(f"--prompt-source {module}: only {len(out)} source windows of {shortest}-{longest} tokens")
    return out


def first_differences(sequences: torch.Tensor, reference: torch.Tensor, prompt_length: int) -> str:
    """Where each differing row first leaves the reference ([B, L] both), counted in new tokens: "row: index"."""
    differ = sequences != reference
    return ", ".join(f"row {b} at {differ[b].nonzero()[0].item() - prompt_length}"
                     for b in range(sequences.shape[0]) if differ[b].any())


def timed(fn, device, seed: int | None = None) -> tuple[float, object]:
    """`fn()`'s wall time, the device synchronized on both sides; with `seed`, torch's generators seeded first (a
    sampling call then draws the same tokens in every run and at every commit)."""
    if seed is not None:
        torch.manual_seed(seed)
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def graphs(model, on: bool):
    """With `on` False, the batched static runners built inside run without CUDA graphs (the `+nographs` diagnostic):
    the model's pooled runners are dropped on the way in and out, so no runner crosses the boundary."""
    if on:
        yield
        return
    from hf_hybrid_spec.engine import static

    init = static.StaticRunner.__init__
    static._RUNNERS.pop(model, None)
    static.StaticRunner.__init__ = functools.partialmethod(init, use_graphs=False)
    try:
        yield
    finally:
        static.StaticRunner.__init__ = init
        static._RUNNERS.pop(model, None)


def method_kwargs(name: str, reference: torch.Tensor, vocab: int, max_new: int, eagle=None, mtp=None) -> dict:
    """generate kwargs of method `name` (see the module docstring) for a batch whose stock output is `reference`;
    `eagle` the EagleDrafter of the eagle methods, `mtp` the MtpHead of the mtp methods."""
    if name.endswith("+nographs"):
        return method_kwargs(name.removesuffix("+nographs"), reference, vocab, max_new, eagle, mtp)
    for mode in ("chunked", "eager"):
        if name.endswith(f"+{mode}"):
            kwargs = method_kwargs(name.removesuffix(f"+{mode}"), reference, vocab, max_new, eagle, mtp)
            kwargs["assistant_config"] = kwargs["assistant_config"].replace(prefill=mode)
            return kwargs
    if name in ("suffix", "serve"):
        return dict(assistant_config=AssistantConfig(global_cache=False))
    if name == "serve:plain":
        return dict(assistant_config=AssistantConfig(global_cache=False), speculation=False)
    if name == "suffix:fixed":
        return dict(assistant_config=AssistantConfig(global_cache=False, batch_budget="fixed"))
    if name == "suffix:eager":
        return dict(assistant_config=AssistantConfig(global_cache=False, compile=False))
    if name == "suffix:unfused":
        return dict(assistant_config=AssistantConfig(global_cache=False, compile=True, compile_verify=False))
    if name in ("eagle", "eagle:fused", "eagle:eager"):
        extra = {"eagle:fused": dict(compile=True, compile_drafter=True), "eagle:eager": dict(compile=False)}
        return dict(draft_model=eagle, assistant_config=AssistantConfig(drafter="eagle", **extra.get(name, {})))
    if name == "mtp":
        return dict(draft_model=mtp, assistant_config=AssistantConfig(drafter="mtp"))
    if name == "mtp:tree":
        return dict(draft_model=mtp, assistant_config=AssistantConfig(drafter="mtp", max_draft_tokens=12, max_depth=3,
                                                                      draft_top_k=4))
    if name.startswith("acceptance:"):
        p = float(name.split(":", 1)[1])
        config = AssistantConfig(max_draft_tokens=8, max_depth=8)
        if reference.shape[0] == 1:
            return dict(drafter=acceptance_drafter(reference[0].tolist(), p, depth=8, vocab_size=vocab),
                        assistant_config=config)
        rows = [reference[b].tolist() for b in range(reference.shape[0])]
        return dict(drafter=acceptance_batch_drafter(rows, p, depth=8, vocab_size=vocab), assistant_config=config)
    raise ValueError(f"unknown method {name!r} (suffix, suffix:fixed, suffix:eager, suffix:unfused, eagle, eagle:fused, "
                     "eagle:eager, mtp, mtp:tree, acceptance:P; any with +chunked or +eager; serve, serve:plain)")


def serve_call(model, ids: torch.Tensor, mask: torch.Tensor, gen: dict, kwargs: dict):
    """`generate_batch` over the batch's prompts (each row's tokens without its padding), every prompt in a slot of
    its own, read back as `generate`'s output: sequences [B, L + new] (left-padded as the batch) and `spec_stats`
    summed over the requests, with the engine's own timings (`ServingStats`: its steps' drafting, verification and
    records, its prefills and drafters' begins as the set-up) and `engine_steps` / `record_seconds`."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hf_hybrid_spec.engine.outputs import SpecStats
    from hf_hybrid_spec.serving import manager

    rows = [ids[b][mask[b].bool()].tolist() for b in range(ids.shape[0])]
    new = gen["max_new_tokens"]
    config = GenerationConfig(**{k: v for k, v in gen.items() if k != "attention_mask"})
    serving = ServingConfig(max_slots=len(rows), max_total_tokens=ids.shape[1] + new,
                            speculation=kwargs.pop("speculation", True))
    made, make = [], manager.make_engine
    manager.make_engine = lambda *a, **k: made.append(make(*a, **k)) or made[-1]  # its engine, for its timings
    try:
        results = generate_batch(model, rows, generation_config=config, serving_config=serving, **kwargs)
    finally:
        manager.make_engine = make
    sequences = torch.full((ids.shape[0], ids.shape[1] + new), gen["pad_token_id"], dtype=ids.dtype)
    sequences[:, : ids.shape[1]] = ids.cpu()
    own = made[0].stats
    stats = SpecStats(draft_seconds=own.draft_seconds, verify_seconds=own.verify_seconds,
                      setup_seconds=own.prefill_seconds + own.begin_seconds)
    stats.engine_steps, stats.record_seconds = own.steps, own.record_seconds
    for b in range(len(rows)):
        out = results[f"req_{b}"]
        if out.error:
            raise RuntimeError(f"generate_batch failed row {b}: {out.error}")
        sequences[b, ids.shape[1] : ids.shape[1] + len(out.generated_tokens)] = torch.tensor(out.generated_tokens)
        stats.target_forwards += out.spec_stats.target_forwards
        stats.accepted_lengths += out.spec_stats.accepted_lengths
        stats.plain_steps += out.spec_stats.plain_steps
    return SimpleNamespace(sequences=sequences.to(ids.device), spec_stats=stats)


def load_eagle(path: str | None, model, spec: str):
    """The EagleDrafter at `path`; by default the committed one of a fixture (checkpoints/drafters/<name>-eagle3), or a
    random-weight one shaped for `model` (tiny: / random: models: exactness and speed, not acceptance)."""
    import os

    from hf_hybrid_spec.eagle import EagleDrafter

    if path is None and not spec.startswith(("tiny:", "random:")):
        guess = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoints", "drafters",
                             f"{os.path.basename(spec.rstrip('/'))}-eagle3")
        path = guess if os.path.isdir(guess) else None
    if path is None:
        torch.manual_seed(1)
        vocab = model.config.get_text_config().vocab_size
        return EagleDrafter.from_target(model, draft_vocab_size=min(vocab, 2048))
    drafter = EagleDrafter.from_pretrained(path)
    return drafter.to(device=model.device, dtype=model.dtype)


def load_mtp(path: str | None, model, spec: str):
    """The MtpHead of the checkpoint shard at `path`; by default the committed one of a fixture
    (checkpoints/mtp/<name>/mtp.safetensors), or a random one shaped for `model` (tiny: / random: models)."""
    import os

    from hf_hybrid_spec.mtp import MtpHead

    if path is None and not spec.startswith(("tiny:", "random:")):
        guess = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoints", "mtp",
                             os.path.basename(spec.rstrip("/")), "mtp.safetensors")
        path = guess if os.path.isfile(guess) else None
    if path is None:
        torch.manual_seed(1)
        return MtpHead.from_target(model, layers=1)
    return MtpHead.from_target(model, load=True, checkpoint=path, layers=1)


def run(argv: list[str] | None = None) -> dict:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="checkpoint path, random:qwen3_5-2b / random:falcon_h1-1.5b, "
                                                        "or tiny:<model_type>")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--drafters", nargs="+", default=["suffix"],
                        help="suffix, suffix:fixed, suffix:eager, suffix:unfused, eagle, eagle:fused, eagle:eager, "
                             "mtp, mtp:tree, acceptance:P")
    parser.add_argument("--eagle", default=None, help="EAGLE-3 drafter folder for the eagle methods (default: the "
                                                      "fixture's committed one, or a random one for tiny:/random:)")
    parser.add_argument("--mtp", default=None, help="MTP checkpoint shard (mtp.safetensors) for the mtp methods "
                                                    "(default: the fixture's committed one, or a random head)")
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="tokens per prompt (with --prompt-tokens-max: the shortest)")
    parser.add_argument("--prompt-tokens-max", type=int, default=None,
                        help="with --prompt-source: prompts of varied lengths up to this many tokens, left-padded")
    parser.add_argument("--prompt-source", default=None,
                        help="an installed package whose .py files give the prompts (e.g. sympy, networkx: the "
                             "fixtures never saw them); default: the built-in code prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-stock-static", action="store_true", help="skip stock static+compile (CPU smoke runs)")
    parser.add_argument("--allow-mismatch", action="store_true", help="report, do not fail on, rows that differ "
                                                                        "from stock greedy (bf16)")
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="batch sizes at which one more call of each method runs under cProfile (host functions by "
                             "own time, written to --out/profile_B<B>_<method>.txt and the top lines printed)")
    parser.add_argument("--kernel-profile", type=int, nargs="*", default=[],
                        help="batch sizes at which one more call of each method runs under torch.profiler (CUDA): the "
                             "device's busy time against the wall time, and the kernels by device time")
    parser.add_argument("--log-budget", action="store_true",
                        help="log the pipelined step's width decisions (measured acceptance per width, the drafting "
                             "step's cost, the choice) to stderr")
    parser.add_argument("--preset", default="greedy", choices=sorted(PRESETS),
                        help="generation settings of every call, stock's and ours")
    parser.add_argument("--seed", type=int, default=0,
                        help="torch.manual_seed before every timed call (stock's and ours): sampling calls draw the "
                             "same tokens in every run, so two commits compare on the same samples")
    parser.add_argument("--out", default=None, help="folder for the PNG and results.json")
    args = parser.parse_args(argv)
    sampling = PRESETS[args.preset].get("do_sample", False)
    if sampling and any(name.startswith("acceptance:") for name in args.drafters):
        parser.error("the acceptance:P methods follow the greedy continuation: not with --preset sampling")
    if args.prompt_tokens_max is not None and (not args.prompt_source or args.prompt_tokens_max < args.prompt_tokens):
        parser.error("--prompt-tokens-max needs --prompt-source and at least --prompt-tokens")
    if args.log_budget:
        import logging

        budget_log = logging.getLogger("hf_hybrid_spec.engine.pipeline")
        budget_log.setLevel(logging.DEBUG)
        budget_log.addHandler(logging.StreamHandler())

    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype, args.device)
    if args.model.startswith("random:"):
        decisive_head(model)  # greedy choices that bf16 rounding cannot flip (see `testing.decisive_head`)
    vocab = model.config.get_text_config().vocab_size
    if args.prompt_source:
        if tokenizer is None:
            parser.error("--prompt-source needs a checkpoint with a tokenizer")
        prompts = source_prompts(tokenizer, args.prompt_source, max(args.batch_sizes), args.prompt_tokens,
                                 args.prompt_tokens_max or args.prompt_tokens, args.device, args.seed)
    else:
        prompts = encode_prompts(tokenizer, max(args.batch_sizes), args.device, vocab, args.prompt_tokens)
    eagle = load_eagle(args.eagle, model, args.model) if any(n.startswith("eagle") for n in args.drafters) else None
    mtp = load_mtp(args.mtp, model, args.model) if any(n.startswith("mtp") for n in args.drafters) else None
    gen = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False,
               eos_token_id=None, pad_token_id=model.config.get_text_config().pad_token_id or 0)
    gen.update(PRESETS[args.preset])
    if gen["eos_token_id"] == "model":
        gen["eos_token_id"] = model.generation_config.eos_token_id
        if gen["eos_token_id"] is None:
            parser.error(f"--preset {args.preset} needs the model's eos token: {args.model} has none")
    quiet_gc()
    rows_out, gate_failures = [], []
    base_gen = gen
    for rows in tqdm(args.batch_sizes, desc="batch sizes"):
        ids, mask = batch_of(prompts, rows, base_gen["pad_token_id"])
        gen = dict(base_gen, attention_mask=mask)
        tokens = rows * args.max_new_tokens
        entry = {"batch": rows}
        model.generate(ids, **gen)  # warm-up: kernels compile and autotune for this batch size on first use
        seconds, reference = timed(lambda: model.generate(ids, **gen), args.device, args.seed)
        entry["stock_eager"] = tokens / seconds
        if not args.no_stock_static:
            model.generate(ids, cache_implementation="static", **gen)  # compiles for this batch size
            seconds, _ = timed(lambda: model.generate(ids, cache_implementation="static", **gen), args.device,
                               args.seed)
            entry["stock_static"] = tokens / seconds
            # Its call split in two: the prompt and first token (no compiled step runs), then the steps.
            first = dict(gen, max_new_tokens=1, min_new_tokens=1)
            first_seconds, _ = timed(lambda: model.generate(ids, cache_implementation="static", **first),
                                     args.device, args.seed)
            entry["stock_static.first_ms"] = 1000 * first_seconds
            entry["stock_static.step_ms"] = 1000 * (seconds - first_seconds) / max(args.max_new_tokens - 1, 1)
        # The acceptance drafters propose the target's continuation as this loop computes it: in bf16 a batched tree
        # forward rounds differently from stock's one-token steps, and a row that drifts from stock's greedy would
        # otherwise accept nothing after the drift (its measured acceptance would not be the one asked for).
        own = reference
        if any(name.startswith("acceptance:") for name in args.drafters):
            own = model.generate(ids, custom_generate=speculative_generate, **gen,
                                 **method_kwargs("acceptance:1.0", reference, vocab, args.max_new_tokens))
        for name in args.drafters:
            kwargs = method_kwargs(name, own if name.startswith("acceptance:") else reference, vocab,
                                   args.max_new_tokens, eagle, mtp)
            if name.startswith("serve"):
                call = functools.partial(serve_call, model, ids, mask, gen)
            else:
                def call(kwargs):
                    return model.generate(ids, custom_generate=speculative_generate, return_dict_in_generate=True,
                                          **gen, **kwargs)
            with graphs(model, not name.endswith("+nographs")):
                call(kwargs)  # warm-up, calibration
                kwargs = method_kwargs(name, own if name.startswith("acceptance:") else reference, vocab,
                                       args.max_new_tokens, eagle, mtp)  # fresh drafters
                seconds, out = timed(lambda: call(kwargs), args.device, args.seed)
            same = (out.sequences == reference).all(-1).float().mean().item() if not sampling else float("nan")
            if same < 1.0:
                gate_failures.append(f"B={rows} {name}: {same:.0%} of rows identical to stock greedy "
                                     f"({first_differences(out.sequences, reference, ids.shape[1])})")
            stats = out.spec_stats
            entry[name] = tokens / seconds
            entry[f"{name}.row_ms_per_token"] = 1000 * seconds / args.max_new_tokens
            entry[f"{name}.mean_accepted"] = stats.mean_accepted_length
            entry[f"{name}.plain_steps"] = stats.plain_steps / max(stats.target_forwards, 1)
            entry[f"{name}.identical_rows"] = same
            steps = max(getattr(stats, "engine_steps", stats.target_forwards), 1)  # a serving engine's own steps
            if hasattr(stats, "engine_steps"):
                entry[f"{name}.record_ms_per_step"] = 1000 * stats.record_seconds / steps
            entry[f"{name}.draft_ms_per_step"] = 1000 * stats.draft_seconds / steps
            entry[f"{name}.verify_ms_per_step"] = 1000 * stats.verify_seconds / steps
            entry[f"{name}.steps"] = steps
            # The call's wall time outside its steps: before the first (prefill, first token, drafter's begin, cost
            # model) and around the loop (generate's own set-up, the output's assembly).
            entry[f"{name}.call_ms"] = 1000 * seconds
            entry[f"{name}.setup_ms"] = 1000 * stats.setup_seconds
            entry[f"{name}.outside_ms"] = 1000 * (seconds - stats.setup_seconds - stats.draft_seconds
                                                  - stats.verify_seconds)
            if rows in args.kernel_profile and args.device.startswith("cuda"):
                kwargs = method_kwargs(name, own if name.startswith("acceptance:") else reference, vocab,
                                       args.max_new_tokens, eagle, mtp)
                kernel_profile(lambda: call(kwargs), f"B={rows} {name}")
            if rows in args.profile:
                kwargs = method_kwargs(name, own if name.startswith("acceptance:") else reference, vocab,
                                       args.max_new_tokens, eagle, mtp)
                profile_call(lambda: call(kwargs), args.device, f"B={rows} {name}", args.out,
                             f"profile_B{rows}_{name.replace(':', '_')}.txt")
        rows_out.append(entry)
        # Each batch size's line as soon as it is measured (a run cut short by a time limit keeps what it measured).
        tqdm.write("done: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}))
    if gate_failures and not args.allow_mismatch:
        print("correctness gate failed:\n  " + "\n  ".join(gate_failures))
        return {"gate": "failed", "failures": gate_failures}

    base = "stock_static" if not args.no_stock_static else "stock_eager"
    header = f"{'B':>4} {'stock eager':>12} {'stock static':>13} " + " ".join(
        f"{name + ' tok/s':>22} {'x' + base[6:]:>8} {'acc':>5} {'plain':>6}" for name in args.drafters)
    print(header)
    for e in rows_out:
        line = f"{e['batch']:>4} {e['stock_eager']:>12.0f} {e.get('stock_static', float('nan')):>13.0f} "
        line += " ".join(f"{e[n]:>22.0f} {e[n] / e[base]:>8.2f} {e[n + '.mean_accepted']:>5.2f} "
                         f"{e[n + '.plain_steps']:>6.0%}" for n in args.drafters)
        print(line)
    if gate_failures:
        print("rows differing from stock greedy (--allow-mismatch): " + "; ".join(gate_failures))
    print("per step (ms): " + "; ".join(
        f"B={e['batch']} {n} draft {e[n + '.draft_ms_per_step']:.2f} verify {e[n + '.verify_ms_per_step']:.2f}"
        for e in rows_out for n in args.drafters))
    if not args.no_stock_static:
        print("stock static per call (ms): " + "; ".join(
            f"B={e['batch']} prompt and first token {e['stock_static.first_ms']:.1f}, {e['stock_static.step_ms']:.3f} "
            "per step" for e in rows_out))
    print("per call (ms): " + "; ".join(
        f"B={e['batch']} {n} {e[n + '.call_ms']:.1f} (set-up {e[n + '.setup_ms']:.1f}, other outside the steps "
        f"{e[n + '.outside_ms']:.1f})" for e in rows_out for n in args.drafters))
    costs = {f"B={key[3]} ctx={key[4]}": {w: round(s * 1e3, 3) for w, s in zip(c.widths, c.seconds)}
             for key, c in budget._COSTS.items()}
    if costs:
        print("verify cost models (width: ms): " + "; ".join(f"{k} {v}" for k, v in costs.items()))
    result = {"model": args.model, "dtype": args.dtype, "preset": args.preset, "prompt_tokens": args.prompt_tokens,
              "prompt_tokens_max": args.prompt_tokens_max, "prompt_source": args.prompt_source,
              "max_new_tokens": args.max_new_tokens, "device": torch.cuda.get_device_name() if
              args.device.startswith("cuda") else "cpu", "rows": rows_out, "mismatches": gate_failures,
              "cost_models": costs}
    if args.out:
        import os

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        plot(rows_out, args.drafters, not args.no_stock_static, os.path.join(args.out, "batch_throughput.png"),
             args.model)
    print(json.dumps(result))
    return result


def profile_call(fn, device, label: str, out: str | None, filename: str, top: int = 12) -> None:
    """Run `fn` once under cProfile; print the `top` host functions by own time (all of them to `out/filename`)."""
    import cProfile
    import io
    import os
    import pstats

    profiler = cProfile.Profile()
    _sync(device)
    profiler.enable()
    fn()
    _sync(device)
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    print(f"--- profile {label}\n" + "\n".join(stream.getvalue().splitlines()[-top - 2 :]))
    if out:
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats("hf_hybrid_spec|kernels", 60)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, filename), "w") as f:
            f.write(stream.getvalue())


def kernel_profile(fn, label: str, top: int = 12) -> None:
    """Run `fn` once under torch.profiler: print the wall time, the device's busy time (kernels and copies summed)
    and the `top` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(f"--- kernels {label}: wall {wall * 1e3:.1f} ms (profiled), device busy {busy * 1e3:.1f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:6d}x  {e.key[:90]}")


def plot(rows: list[dict], methods: list[str], with_static: bool, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [e["batch"] for e in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [e["stock_eager"] for e in rows], "o--", label="stock eager")
    if with_static:
        ax.plot(xs, [e["stock_static"] for e in rows], "s--", label="stock static+compile")
    for name in methods:
        ax.plot(xs, [e[name] for e in rows], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("committed tokens / s (all rows)")
    ax.set_title(title.rsplit("/", 1)[-1])
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    result = run()
    return 1 if result.get("gate") == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
