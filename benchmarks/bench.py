"""Benchmark: stock greedy `generate` vs speculative decoding, side by side on one prompt set.

    python benchmarks/bench.py --model ../shared/models/qwen3_5-small --drafters suffix ngram --out out/

1. Correctness gate: every drafter's greedy output is compared with stock greedy on every prompt.
2. Timing: per prompt, stock greedy and each drafter run back to back (same process, same prompt), so ratios
   are measured side by side on a noisy machine. `--stock-static` adds stock generate with
   `cache_implementation="static"` (transformers compiles its forward); `--compiled` adds each drafter with
   `AssistantConfig(compile=True)` (static tree cache, CUDA graphs).
3. A table (ms/token, committed tokens per target forward, per-forward time against the weight-bytes floor,
   speedup), PNGs of accepted lengths and of ms/token, and a JSON line last.

Models: a local path / Hub id, or `random:qwen3_5-2b` / `random:falcon_h1-1.5b` (~2B Qwen3.5- / ~1.4B
Falcon-H1-shaped random-init models, for forward cost only) or `tiny:<model_type>` (the test suite's tiny configs).
`--device-map` splits the target over devices (pipeline placement).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.config import AssistantConfig
from hf_hybrid_spec.drafters import Drafter, suffix
from hf_hybrid_spec.engine import static
from hf_hybrid_spec.generate import speculative_generate
from hf_hybrid_spec.models import get_adapter
from hf_hybrid_spec.prompts import code_prompts
from hf_hybrid_spec.tree import DraftTree, build_verify_tree

logger = logging.get_logger(__name__)
T = TypeVar("T")

# Named drafter presets; `ngram` is transformers' prompt lookup at the settings the project compares against.
# `default` is `AssistantConfig()` as a user gets it (compile="auto" and compile_verify="auto": the static path with
# CUDA graphs and the fused verify forward on one GPU, eager elsewhere); the other rows without "+graphs" run eagerly
# (compile=False), the "+graphs" rows compile=True without the fused regions, the "+fused" rows with them.
PRESETS = {
    "default": dict(),
    "suffix": dict(drafter="suffix", compile=False),
    "suffix-chain": dict(drafter="suffix", tree=False, compile=False),
    "ngram": dict(drafter="ngram", ngram_size=3, max_draft_tokens=8, compile=False),
}


def random_qwen3_5_2b_config():
    """A Qwen3.5-shaped ~2B config: 24 layers (3 gated-delta : 1 attention), hidden 2048, vocab 151936."""
    return AutoConfig.for_model(
        "qwen3_5_text", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )


def random_falcon_h1_1_5b_config():
    """A Falcon-H1-shaped ~1.4B config: 24 parallel attention + Mamba-2 layers, hidden 2048, the Mamba-2 mixer of
    the kernel benchmark (24 heads of 64, state 128, one group), vocab 65536."""
    return AutoConfig.for_model(
        "falcon_h1", vocab_size=65536, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, mamba_d_ssm=1536, mamba_n_heads=24,
        mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=128,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )


RANDOM_MODELS = {"qwen3_5-2b": random_qwen3_5_2b_config, "falcon_h1-1.5b": random_falcon_h1_1_5b_config}


def load_model(spec: str, dtype: torch.dtype, device: str, device_map: str | None = None):
    """Returns (model, tokenizer or None).

    device_map: None (all on `device`), "auto" (transformers' `device_map="auto"`; path models only) or a comma
    list of devices: the decoder layers split in halves between the first and the last (pipeline placement).
    """
    if device_map is not None and device_map != "auto":
        from accelerate import dispatch_model

        from hf_hybrid_spec.testing import layer_split_device_map

        devices = [torch.device(d) for d in device_map.split(",")]
        model, tok = load_model(spec, dtype, str(devices[0]))
        return dispatch_model(model, device_map=layer_split_device_map(model, devices)), tok
    if device_map == "auto" and (spec.startswith("random:") or spec.startswith("tiny:")):
        raise ValueError("--device-map auto needs a checkpoint path; give a device list for random:/tiny: models")
    if spec.startswith("random:"):
        name = spec.split(":", 1)[1]
        if name not in RANDOM_MODELS:
            raise ValueError(f"unknown random model {name!r} (known: {', '.join(RANDOM_MODELS)})")
        torch.manual_seed(0)
        with torch.device(device):  # initialize on the device: a 2B init on the host takes minutes
            model = AutoModelForCausalLM.from_config(RANDOM_MODELS[name](), dtype=dtype,
                                                     attn_implementation="sdpa")
        return model.eval(), None
    if spec.startswith("tiny:"):
        from hf_hybrid_spec.testing import tiny_model

        return tiny_model(spec.split(":", 1)[1], dtype=dtype).to(device), None
    if device_map == "auto":
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa", device_map="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device)
    return model.eval(), AutoTokenizer.from_pretrained(spec)


def placement(model) -> dict[str, int]:
    """Parameter count per device (one entry unless the model is split by a device map)."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        counts[str(p.device)] = counts.get(str(p.device), 0) + p.numel()
    return counts


def encode_prompts(tokenizer, n: int, device, vocab_size: int, prompt_tokens: int | None):
    if tokenizer is None:
        # Random-weight models: random token prompts, with a repeated span so cache drafters have something.
        gen = torch.Generator().manual_seed(0)
        out = []
        for _ in range(n):
            base = torch.randint(2, vocab_size, (prompt_tokens or 64,), generator=gen)
            out.append(base.view(1, -1).to(device))
        return out
    texts = code_prompts()
    encoded = []
    for i in range(n):
        text = texts[i % len(texts)]
        ids = tokenizer(text, return_tensors="pt").input_ids
        if prompt_tokens is not None and ids.shape[1] < prompt_tokens:
            # Context ahead of a short prompt: the other prompts, whole and in turn, as earlier code of the same file
            # (so the prompt itself and every line before it stay intact; only the far end is cut).
            # Past the first len(texts) rows the other prompts come in another (seeded) order, so no two rows repeat.
            others = [texts[(i + j) % len(texts)] for j in range(1, len(texts))]
            if i >= len(texts):
                random.Random(i // len(texts)).shuffle(others)
            ids = tokenizer("\n\n".join(others + [text]), return_tensors="pt").input_ids
        if prompt_tokens is not None:
            # Exactly `prompt_tokens` (the end of a longer prompt): stock static+compile builds a cache per prompt
            # length and recompiles for a new one, which a steady-state comparison must not time.
            ids = ids[:, -prompt_tokens:]
        encoded.append(ids.to(device))
    return encoded


@dataclass
class MethodResult:
    name: str
    kind: str = "spec"  # "stock", "stock_static" or "spec"
    seconds: float = 0.0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    target_forwards: int = 0
    mismatches: int = 0
    draft_seconds: float = 0.0  # spec only: host + device time in the drafter
    graph_captures: int = 0  # spec only: CUDA graphs captured during the timed calls (0 in a steady state)
    compiles: int = 0  # stock static only: torch.compile graphs compiled during the timed calls (0 in a steady state)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.seconds / max(self.new_tokens, 1)

    @property
    def mean_accepted_length(self) -> float | None:
        return statistics.fmean(self.accepted_lengths) if self.accepted_lengths else None

    @property
    def ms_per_forward(self) -> float:
        forwards = self.target_forwards if self.kind == "spec" else self.new_tokens
        return 1000.0 * self.seconds / max(forwards, 1)


def quiet_gc() -> None:
    """Collect now and freeze what survives (model, tokenizer, caches): the garbage collector then never walks
    them inside a timed call. A full collection over a loaded model's objects takes tens of milliseconds, which
    would land in whichever method's call happened to trigger it.

    Unfrozen and collected again at exit: frozen cycles that hold Triton objects outlive the interpreter's last
    collection, and Triton's bindings then print a page of nanobind "leaked instance" lines."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    atexit.unregister(_unfreeze_gc)  # once per process, however many benches a process runs
    atexit.register(_unfreeze_gc)


def _unfreeze_gc() -> None:
    import gc

    gc.unfreeze()
    gc.collect()


def _sync(device):
    if torch.device(device).type == "cuda":
        for index in range(torch.cuda.device_count()):  # every GPU: a model may be split over several
            torch.cuda.synchronize(index)


def run_stock(model, ids, gen_kwargs, static=False):
    if static:
        return model.generate(ids, do_sample=False, cache_implementation="static", **gen_kwargs)
    return model.generate(ids, do_sample=False, **gen_kwargs)


def dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a recompile inside a timed call shows here)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def run_spec(model, ids, gen_kwargs, cfg, draft_model):
    return model.generate(ids, do_sample=False, custom_generate=speculative_generate, assistant_config=cfg,
                          draft_model=draft_model, return_dict_in_generate=True, **gen_kwargs)


def weight_floor_ms(model, bandwidth_gbps: float) -> float:
    """Milliseconds to read every weight once at `bandwidth_gbps` (a decode forward's memory floor)."""
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return 1000.0 * n_bytes / (bandwidth_gbps * 1e9)


def measure_copy_bandwidth_gbps(device) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling of a memory-bound forward."""
    if torch.device(device).type != "cuda":
        return None
    x = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000.0 / 10
    return 2 * x.numel() / seconds / 1e9


class _SizeSweep(Drafter):
    """Warm-up drafter: a chain of the next size on each step, so every tree-size variant of the kernels (and
    every graph bucket) is compiled before timing starts."""

    def __init__(self, sizes):
        self.sizes = list(sizes)

    def propose(self, input_ids, budget):
        n = min(self.sizes.pop(0) if self.sizes else 1, budget.max_nodes, budget.max_depth)
        tokens = input_ids[:, -1:].expand(1, n).clone()
        return DraftTree(tokens=tokens, parents=(torch.arange(n, device=tokens.device) - 1).view(1, -1))


def warm_up_tree_sizes(model, ids, cfg, sizes=(1, 7, 15, 16, 31, 32, 63)):
    sizes = [min(s, cfg.max_draft_tokens) for s in sizes]
    cfg = cfg.replace(max_depth=max(sizes))
    model.generate(ids, do_sample=False, max_new_tokens=len(sizes) + 1, eos_token_id=None,
                   custom_generate=speculative_generate, assistant_config=cfg, drafter=_SizeSweep(sizes))


def time_verify_buckets(model, prefix_length: int, reps: int = 30, fuse: bool = False) -> dict[int, float]:
    """Milliseconds per graph-replayed verify forward, per tree-size bucket of the model's most recently used
    static runner built with `fuse` (compile_verify) ({} without one or without CUDA graphs). Chains of n nodes
    over `prefix_length` committed tokens; each forward is aborted, so the cache is left as it was."""
    runners = [r for r in static._RUNNERS.get(model, {}).values() if r.fuse == fuse]
    if not runners:
        return {}
    runner = runners[-1]
    if not runner.use_graphs:
        return {}
    device = runner.device
    times = {}
    for n in runner.buckets:
        tokens = torch.ones(1, n - 1, dtype=torch.long, device=device)
        draft = DraftTree(tokens=tokens, parents=(torch.arange(n - 1, device=device) - 1).view(1, -1))
        tree = build_verify_tree(torch.ones(1, dtype=torch.long, device=device), draft)
        for _ in range(3):
            runner.forward(tree, prefix_length, prefix_length)
            runner.abort()
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            runner.forward(tree, prefix_length, prefix_length)
            runner.abort()
        torch.cuda.synchronize(device)
        times[n] = 1000.0 * (time.perf_counter() - t) / reps
    return times


def balanced_order(methods: Sequence[T], index: int) -> list[T]:
    """The methods' running order for the `index`-th timed prompt: a Williams design, so that over every `n` prompts
    (`2n` for an odd number `n` of methods) each method runs first equally often and right after each other method
    equally often.

    Why not a rotation: rotating keeps the cyclic order, so every method always follows the same one (HVD always
    right after the threshold policy, suffix-only after the oracle), and whatever a run leaves behind (warm host
    caches, the allocator, GPU clocks after an EAGLE-heavy method) lands on the same method at every prompt.
    """
    n = len(methods)
    if n < 2:
        return list(methods)
    # Base row 0, 1, n-1, 2, n-2, ...: its successive differences cover every non-zero residue once, so the n
    # shifted rows put every ordered pair side by side exactly once (n even); for odd n the mirrored rows make it
    # exactly twice over 2n rows.
    base = [0]
    low, high = 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    period = n if n % 2 == 0 else 2 * n
    row = index % period
    order = [methods[(b + row % n) % n] for b in base]
    return order[::-1] if row >= n else order


class SuffixStores:
    """One process-wide suffix cache per method, so that a method only ever learns from its own earlier
    prompts, never from another method's (or its own earlier) run of the same prompt."""

    def __init__(self):
        self.stores: dict[str, dict] = {}

    def enter(self, name: str) -> None:
        suffix._GLOBAL.clear()
        suffix._GLOBAL.update(self.stores.get(name, {}))

    def leave(self, name: str) -> None:
        self.stores[name] = dict(suffix._GLOBAL)
        suffix._GLOBAL.clear()

    def snapshot(self, name: str) -> dict:
        """A copy of `name`'s store as it is now (outside enter/leave), for `restore`."""
        return {key: cache.copy() for key, cache in self.stores.get(name, {}).items()}

    def restore(self, name: str, snapshot: dict) -> None:
        """Put back a `snapshot`: a repeated call then learns from exactly what the first one did."""
        self.stores[name] = snapshot


def build_methods(names: list[str], dtype, device, compiled: bool = False, compiled_only: bool = False,
                  fused: bool = False, target=None):
    methods = []
    for name in names:
        if name == "mtp" or name.startswith("mtp:"):
            # mtp[:<mtp.safetensors>][:tree]: the target checkpoint's MTP head (or a shard of one), a chain of 3 or a
            # 12-node tree of depth 3, top-k 3.
            from hf_hybrid_spec.mtp import MtpHead

            parts = name.split(":")[1:]
            shape = parts.pop() if parts and parts[-1] in ("chain", "tree") else "chain"
            head = MtpHead.from_target(target, load=True, checkpoint=parts[0] if parts else None,
                                       layers=1 if parts else None)
            nodes, top_k = (12, 3) if shape == "tree" else (3, 1)
            methods.append((f"mtp-{shape}", AssistantConfig(drafter="mtp", max_draft_tokens=nodes, max_depth=3,
                                                            draft_top_k=top_k, compile=False), head))
        elif name in PRESETS:
            methods.append((name, AssistantConfig(**PRESETS[name]), None))
        elif name.startswith("model:"):
            draft, _ = load_model(name.split(":", 1)[1], dtype, device)
            methods.append((name, AssistantConfig(drafter="model", max_depth=6, compile=False), draft))
        elif name.startswith("eagle:"):
            # eagle:<checkpoint dir>[:tree|chain]; the tree is EAGLE-2's 60 nodes, depth 6, top-k 10.
            from hf_hybrid_spec.eagle import EagleDrafter

            path, _, shape = name.split(":", 1)[1].partition(":")
            draft = EagleDrafter.from_pretrained(path).to(device=device, dtype=dtype).eval()
            if shape == "chain":
                cfg = AssistantConfig(drafter="eagle", max_draft_tokens=6, max_depth=6, draft_top_k=1, compile=False)
            else:
                cfg = AssistantConfig(drafter="eagle", max_draft_tokens=60, max_depth=6, draft_top_k=10, compile=False)
            methods.append((name.rsplit("/", 1)[-1] if "/" in name else name, cfg, draft))
        elif name.startswith("layerskip:"):
            methods.append((name, AssistantConfig(drafter="layerskip", exit_layer=int(name.split(":")[1]),
                                                  max_depth=4, compile=False), None))
        elif name.startswith("self_ssm"):
            variant = name.split(":")[1] if ":" in name else "zero_attention"
            methods.append((name, AssistantConfig(drafter="self_ssm", ssm_variant=variant, max_depth=2, compile=False),
                            None))
        elif name.startswith("config:"):
            methods.append((name, AssistantConfig.from_pretrained(name.split(":", 1)[1]), None))
        else:
            raise ValueError(f"unknown drafter {name!r}: use {sorted(PRESETS)}, model:<path> or config:<dir>")
    graphs = [(f"{name}+graphs", cfg.replace(compile=True, compile_verify=False), draft) for name, cfg, draft in methods
              if name != "default"]
    if fused:  # the same graphs with the target's pure regions compiled (compile_verify), side by side
        graphs += [(f"{name}+fused", cfg.replace(compile_verify=True), draft) for name, cfg, draft in graphs]
    if compiled_only:  # the default configuration is kept: it is what a user who sets nothing runs
        return [m for m in methods if m[0] == "default"] + graphs
    return methods + graphs if compiled else methods


def plot_histograms(results: list[MethodResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in results if r.accepted_lengths]
    fig, axes = plt.subplots(1, len(spec), figsize=(4 * len(spec), 3.2), squeeze=False)
    for ax, r in zip(axes[0], spec):
        top = max(r.accepted_lengths)
        ax.hist(r.accepted_lengths, bins=range(1, top + 2), align="left", rwidth=0.85)
        ax.set_title(f"{r.name}: mean {r.mean_accepted_length:.2f}")
        ax.set_xlabel("tokens committed per target forward")
        ax.set_ylabel("forwards")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speed(results: list[MethodResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.4 * len(results) + 2, 3.4))
    names = [r.name for r in results]
    values = [r.ms_per_token for r in results]
    ax.bar(names, values, color=["tab:gray" if r.kind != "spec" else "tab:blue" for r in results])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per generated token")
    ax.set_title(title, fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(argv: list[str] | None = None) -> dict:
    """The benchmark; returns the summary (also printed as the JSON line last)."""
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True,
                        help="path / Hub id, random:qwen3_5-2b, random:falcon_h1-1.5b or tiny:<model_type>")
    parser.add_argument("--drafters", nargs="+", default=["suffix", "ngram"],
                        help=f"presets {sorted(PRESETS)}, model:<path>, eagle:<dir>[:chain], mtp[:<mtp.safetensors>][:tree], "
                             "layerskip:<E>, "
                             "self_ssm[:<variant>] or config:<dir with assistant_config.json>")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="make every prompt exactly this many tokens (left-fill short ones with other prompts, "
                             "keep the end of long ones)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--keep-eos", action="store_true", help="stop at eos (default: generate exactly max-new-tokens)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-gate", action="store_true", help="skip the untimed correctness pass")
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="report but do not fail on outputs that differ from stock greedy (low precision)")
    parser.add_argument("--out", default=None, help="directory for results.json and the histogram PNG")
    parser.add_argument("--device-map", default=None,
                        help="split the target over devices: 'auto' (transformers' device_map='auto', checkpoint "
                             "paths) or a list such as 'cuda:0,cuda:1' (first half of the layers on the first)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--stock-static", action="store_true",
                        help="also time stock generate with cache_implementation='static' (compiled forward)")
    parser.add_argument("--compiled", action="store_true",
                        help="also time each drafter with AssistantConfig(compile=True) (static cache, CUDA graphs)")
    parser.add_argument("--compiled-only", action="store_true",
                        help="time only the compile=True variants of the drafters (implies --compiled)")
    parser.add_argument("--compile-verify", action="store_true",
                        help="with --compiled / --compiled-only, also time each compiled drafter with "
                             "AssistantConfig(compile_verify=True) (the fused verify forward: norms, MLPs and gates "
                             "compiled by Inductor, parallel projections, the tree-attention kernel; '+graphs+fused' "
                             "rows)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for the code prompts of a random: model (its ids must fit the vocabulary)")
    parser.add_argument("--bucket-sweep", action="store_true",
                        help="also time one graph-replayed verify forward per tree-size bucket (CUDA only)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype, args.device, args.device_map)
    if args.device_map:
        args.device = str(model.get_input_embeddings().weight.device)  # prompts go where the embedding is
        print(f"device map: parameters per device {placement(model)}")
    if args.tokenizer:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        if len(tok) > model.config.get_text_config().vocab_size:
            raise ValueError(f"--tokenizer {args.tokenizer} has {len(tok)} tokens, more than the model's vocabulary")
    if args.compile_verify and not (args.compiled or args.compiled_only):
        parser.error("--compile-verify needs --compiled or --compiled-only")
    methods = build_methods(args.drafters, dtype, args.device, compiled=args.compiled or args.compiled_only,
                            compiled_only=args.compiled_only, fused=args.compile_verify, target=model)
    vocab = model.config.get_text_config().vocab_size
    prompts = encode_prompts(tok, args.num_prompts, args.device, vocab, args.prompt_tokens)
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens)
    if not args.keep_eos:
        gen_kwargs.update(eos_token_id=None, min_new_tokens=args.max_new_tokens)

    # Warm up every path on a full-length request (compilation, graph capture, allocator), so the timed runs
    # see the steady state a server would. Our adapters are installed first and stock static+compile warms up
    # last: torch.compile guards on the modules' forwards, so compiling before the routing is installed would
    # recompile inside the first timed call (seconds on a 2B model).
    # The warm-ups' wall times are reported: what a process's first call costs (compiles, captures, autotuning).
    get_adapter(model)
    run_stock(model, prompts[0], gen_kwargs)
    first_call = {}
    for name, cfg, draft in methods:
        start = time.perf_counter()
        warm_up_tree_sizes(model, prompts[0], cfg)
        run_spec(model, prompts[0], gen_kwargs, cfg, draft)
        _sync(args.device)
        first_call[name] = time.perf_counter() - start
    if args.stock_static:
        for i in range(2):
            start = time.perf_counter()
            run_stock(model, prompts[0], gen_kwargs, static=True)
            _sync(args.device)
            if i == 0:
                first_call["stock static+compile"] = time.perf_counter() - start
    suffix.clear_global_suffix_cache()
    quiet_gc()

    # 1. Correctness gate.
    gate_ok = True
    mismatches = {name: 0 for name, _, _ in methods}
    if not args.skip_gate:
        for ids in tqdm(prompts, desc="correctness gate"):
            ref = run_stock(model, ids, gen_kwargs)
            for name, cfg, draft in methods:
                out = run_spec(model, ids, gen_kwargs, cfg, draft)
                if not torch.equal(out.sequences, ref):
                    mismatches[name] += 1
        suffix.clear_global_suffix_cache()
        gate_ok = not any(mismatches.values())
        print(f"correctness gate: {'PASS' if gate_ok else 'FAIL'} (prompts differing from stock greedy: {mismatches})")
        if not gate_ok and not args.allow_mismatch:
            print(json.dumps({"gate": "fail", "mismatches": mismatches}))
            sys.exit(1)

    # 2. Timing, interleaved per prompt.
    stock = MethodResult("stock greedy", kind="stock")
    stock_static = MethodResult("stock static+compile", kind="stock_static") if args.stock_static else None
    results = {name: MethodResult(name) for name, _, _ in methods}
    stores = SuffixStores()
    for ids in tqdm(prompts, desc="timing"):
        _sync(args.device)
        t = time.perf_counter()
        ref = run_stock(model, ids, gen_kwargs)
        _sync(args.device)
        stock.seconds += time.perf_counter() - t
        stock.new_tokens += ref.shape[1] - ids.shape[1]
        if stock_static is not None:
            _sync(args.device)
            compiled_before = dynamo_graphs()
            t = time.perf_counter()
            out = run_stock(model, ids, gen_kwargs, static=True)
            _sync(args.device)
            stock_static.seconds += time.perf_counter() - t
            stock_static.compiles += dynamo_graphs() - compiled_before
            stock_static.new_tokens += out.shape[1] - ids.shape[1]
            stock_static.mismatches += int(not torch.equal(out, ref))
        for name, cfg, draft in methods:
            stores.enter(name)
            captures_before = static.CAPTURES.total
            _sync(args.device)
            t = time.perf_counter()
            out = run_spec(model, ids, gen_kwargs, cfg, draft)
            _sync(args.device)
            stores.leave(name)
            r = results[name]
            r.seconds += time.perf_counter() - t
            r.new_tokens += out.sequences.shape[1] - ids.shape[1]
            r.accepted_lengths += out.spec_stats.accepted_lengths
            r.target_forwards += out.spec_stats.target_forwards
            r.mismatches += int(not torch.equal(out.sequences, ref))
            r.draft_seconds += out.spec_stats.draft_seconds
            r.graph_captures += static.CAPTURES.total - captures_before

    # 3. Report.
    all_results = [stock, *([stock_static] if stock_static else []), *results.values()]
    bandwidth = measure_copy_bandwidth_gbps(args.device)
    floor = weight_floor_ms(model, bandwidth) if bandwidth else None
    best_stock = min((r for r in all_results if r.kind != "spec"), key=lambda r: r.ms_per_token)
    print(f"\nmodel={args.model} device={args.device} dtype={args.dtype} prompts={len(prompts)} "
          f"max_new_tokens={args.max_new_tokens}"
          + (f" copy_bw={bandwidth:.0f}GB/s weight_floor={floor:.3f}ms" if floor else ""))
    print(f"{'method':<34}{'tokens/s':>10}{'ms/token':>10}{'tok/fwd':>9}{'ms/fwd':>9}{'draft ms':>9}{'x floor':>9}"
          f"{'vs stock':>10}{'vs best':>9}{'mismatch':>10}{'captures':>10}"
          "  (captures: CUDA graphs captured, or for stock static+compile graphs compiled, while timed)")
    for r in all_results:
        acc = f"{r.mean_accepted_length:.2f}" if r.mean_accepted_length else "1.00"
        xfloor = f"{r.ms_per_forward / floor:.1f}" if floor else "-"
        draft_ms = f"{1000 * r.draft_seconds / max(r.target_forwards, 1):.2f}" if r.kind == "spec" else "-"
        print(f"{r.name:<34}{r.tokens_per_second:>10.1f}{r.ms_per_token:>10.2f}{acc:>9}{r.ms_per_forward:>9.2f}"
              f"{draft_ms:>9}{xfloor:>9}{stock.ms_per_token / r.ms_per_token:>9.2f}x"
              f"{best_stock.ms_per_token / r.ms_per_token:>8.2f}x{r.mismatches:>10}"
              f"{r.compiles if r.kind == 'stock_static' else r.graph_captures:>10}")
    print("first call of the process, s (warm-up: compiles, captures; later methods reuse earlier ones' kernels): "
          + ", ".join(f"{name} {sec:.1f}" for name, sec in first_call.items()))
    buckets, fused_buckets = {}, {}
    if args.bucket_sweep:
        buckets = time_verify_buckets(model, prompts[0].shape[1])
        fused_buckets = time_verify_buckets(model, prompts[0].shape[1], fuse=True)
        ar = stock_static.ms_per_token if stock_static else None
        for label, sweep in (("", buckets), (", fused", fused_buckets)):
            for n, ms in sweep.items():
                print(f"verify forward{label}, {n:>3}-node bucket (graph replay): {ms:.3f} ms"
                      + (f" = {ms / ar:.2f}x stock static+compile ms/token" if ar else "")
                      + (f" = {ms / floor:.1f}x weight floor" if floor else ""))
    summary = {
        "model": args.model,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu",
        "dtype": args.dtype,
        "placement": placement(model),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "gate": "skipped" if args.skip_gate else ("pass" if gate_ok else "fail"),
        "gate_mismatches": mismatches,
        "stock_tokens_per_s": round(stock.tokens_per_second, 3),
        "stock_ms_per_token": round(stock.ms_per_token, 4),
        "stock_static_ms_per_token": round(stock_static.ms_per_token, 4) if stock_static else None,
        "stock_static_mismatches": stock_static.mismatches if stock_static else None,
        "stock_static_compiles_while_timed": stock_static.compiles if stock_static else None,
        "copy_bandwidth_gbps": round(bandwidth, 1) if bandwidth else None,
        "weight_floor_ms": round(floor, 4) if floor else None,
        "verify_ms_by_bucket": {str(n): round(ms, 4) for n, ms in buckets.items()},
        "fused_verify_ms_by_bucket": {str(n): round(ms, 4) for n, ms in fused_buckets.items()},
        "first_call_seconds": {name: round(sec, 2) for name, sec in first_call.items()},
        "methods": {
            r.name: {
                "tokens_per_s": round(r.tokens_per_second, 3),
                "ms_per_token": round(r.ms_per_token, 3),
                "mean_accepted_length": None if r.mean_accepted_length is None else round(r.mean_accepted_length, 3),
                "speedup": round(r.tokens_per_second / stock.tokens_per_second, 3),
                "speedup_vs_best_stock": round(best_stock.ms_per_token / r.ms_per_token, 3),
                "ms_per_forward": round(r.ms_per_forward, 4),
                "target_forwards": r.target_forwards,
                "mismatches": r.mismatches,
                "draft_ms_per_forward": round(1000 * r.draft_seconds / max(r.target_forwards, 1), 4),
                "graph_captures_while_timed": r.graph_captures,
            }
            for r in results.values()
        },
    }
    if args.out:
        import os

        os.makedirs(args.out, exist_ok=True)
        plot_histograms(all_results, os.path.join(args.out, "accepted_lengths.png"))
        plot_speed(all_results, os.path.join(args.out, "ms_per_token.png"),
                   f"{args.model} ({args.device}, {args.dtype})")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
