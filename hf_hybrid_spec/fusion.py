"""Inductor-fused regions of the target's verify forward (`AssistantConfig.compile_verify`, on by default on a GPU).

A verify forward captured as a CUDA graph has no Python or launch overhead left, but it still runs every small kernel
eager PyTorch issues: on a 2B Qwen3.5-shaped model about a thousand kernels per forward, most of them the dtype casts,
squares, means and scales of RMSNorms, the gated output norm, the gate math of each mixer and the MLP's activation, each
costing its launch latency, against matmuls that read the weights once. Stock `generate(cache_implementation="static")`
compiles the whole forward for the same reason. We cannot hand the whole verify forward to torch.compile (the tree
cache's bookkeeping and our Triton kernels sit inside it), so we compile the pure regions instead:

- modules whose class name ends in one of `FUSABLE_SUFFIXES` (the families' RMSNorm, gated RMSNorm and MLP
  classes: functions of their inputs and weights only), one compile per class for every instance and every tree
  size (`dynamic=True`; parameters are graph inputs), run in place of the instances' forwards only within
  `fused_regions` (the runner's warm-up and capture, or its eager CPU forward), and only in that thread;
- functions of ours marked with `@fusable` (the mixers' gate math), compiled on first use under `fused_regions`;
- `parallel_linears`: independent projections of one input (a gated-delta mixer's qkv / z / b / a, an MLP's gate
  and up) run on side streams next to the largest one, so in the captured graph they are parallel branches. At a
  few rows a linear layer is a short weight read, and cuBLAS reaches the bandwidth only on the large ones (a
  32x2048 projection costs nearly what a 2048x2048 one does): run one after the other, the small ones cost their
  latency in full. Model adapters give MLP forwards that use it
  (`ModelAdapter.mlps`); they replace the compiled class forward of those modules within the regions.

Numerics are those of a compiled model (the fused reductions round differently in the last bits, as stock
static+compile does; fp32 stays exact). It is on by default wherever the verify forward is captured on a GPU
(`compile_verify="auto"`): there a batch's plain step, fused, costs about half of stock's compiled decode step, and
unfused about as much. A region whose compile fails warns once and runs eagerly from then on: fusion never decides
what is committed beyond that rounding.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers.utils import logging

from .routing import is_routed, overriding, route

logger = logging.get_logger(__name__)

__all__ = ["FUSABLE_SUFFIXES", "fusable", "fused_regions", "fusable_modules", "parallel_linears", "set_parallel",
           "parallel_enabled"]

# Class-name endings of modules that are pure functions of (inputs, own weights) in every supported family.
FUSABLE_SUFFIXES = ("RMSNorm", "RMSNormGated", "MLP")

_state = threading.local()
_compiled_classes: dict[type, Callable] = {}  # class -> its compiled forward (as an unbound function)
_lock = threading.Lock()
_side_streams: dict[torch.device, list[torch.cuda.Stream]] = {}
_parallel = True


def set_parallel(enabled: bool) -> None:
    """Turn the parallel projections on (the default) or off, process-wide, for static runners built afterwards
    (each keeps the setting it was built with, `parallel_enabled`, and hands it to `fused_regions`); off is the
    fused forward as it was before them, for A/B measurements (`benchmarks/ab_parallel_linears.py`)."""
    global _parallel
    _parallel = bool(enabled)


def parallel_enabled() -> bool:
    return _parallel


def _active() -> bool:
    return getattr(_state, "depth", 0) > 0


# Graphs one compiled region may hold: a class's forward serves inputs of several ranks (an RMSNorm over hidden states
# and over heads), sizes of 1 are specialized (a plain step's width, a batch of one), and a batched runner brings a
# shape family per batch size. Dynamo's default (8) runs a region eagerly from the ninth variant on, silently.
RECOMPILE_LIMIT = 64


def _recompile_limit():
    """A context in which dynamo keeps up to RECOMPILE_LIMIT graphs per compiled region (the setting's name changed
    across torch releases)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            return config.patch(**{name: max(getattr(config, name), RECOMPILE_LIMIT)})
    return contextlib.nullcontext()


def _compile(fn: Callable, name: str) -> Callable:
    """`fn` compiled by Inductor (dynamic shapes: one compile serves every tree size), falling back to `fn` for
    good, with a warning, if compiling it fails. Tensor arguments go in contiguous: views of fused projections have
    strides that change with the tree's width, and each new stride pattern would be a graph of its own."""
    compiled = torch.compile(fn, dynamic=True)
    failed = False

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal failed
        if not failed:
            try:
                args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
                with _recompile_limit():
                    return compiled(*args, **kwargs)
            except Exception as err:  # an Inductor/toolchain failure must not stop decoding
                failed = True
                logger.warning("compile_verify: compiling %s failed, it runs eagerly (%s: %s)", name,
                               type(err).__name__, err)
        return fn(*args, **kwargs)

    return run


def fusable(fn: Callable) -> Callable:
    """Marks a pure tensor function of ours (no Python side effects, no host reads) to run compiled while
    `fused_regions` is active, and as written otherwise."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _active():
            return fn(*args, **kwargs)
        if not compiled:
            with _lock:
                if not compiled:
                    compiled.append(_compile(fn, fn.__qualname__))
        return compiled[0](*args, **kwargs)

    return wrapper


def _streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    with _lock:
        streams = _side_streams.setdefault(device, [])
        while len(streams) < count:
            streams.append(torch.cuda.Stream(device))
        return streams[:count]


def parallel_linears(x: torch.Tensor, *linears: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`tuple(linear(x) for linear in linears)`. Inside `fused_regions(..., parallel=True)` on a GPU the first (give
    the largest first) runs on the current stream and each other one on a side stream that waits for the current
    stream's work before it and is waited for after it: eagerly they overlap, and in a captured graph they are
    parallel branches (CUDA-graph capture follows the fork and the join). Elsewhere they run in order.

    Memory is safe without `record_stream`: a side stream's output is freed only after its readers were enqueued
    on the current stream, and the side stream's next work (the next fork) waits for everything enqueued there.
    """
    parallel = _active() and getattr(_state, "parallel", False)
    if len(linears) < 2 or not parallel or x.device.type != "cuda" or torch.compiler.is_compiling():
        return tuple(linear(x) for linear in linears)
    main = torch.cuda.current_stream(x.device)
    sides = _streams(x.device, len(linears) - 1)
    outputs: list[torch.Tensor | None] = [None] * len(linears)
    for i, (linear, side) in enumerate(zip(linears[1:], sides), start=1):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            outputs[i] = linear(x)
    outputs[0] = linears[0](x)
    for side in sides:
        main.wait_stream(side)
    return tuple(outputs)


def fusable_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that `fused_regions` runs compiled (routed here, once: `routing.route`).

    Modules with an instance-level forward of someone else's (accelerate's hooks for device_map / offload, or
    another wrapper) are left alone: running the compiled class forward would skip it.
    """
    modules = [m for m in model.modules()
               if type(m).__name__.endswith(FUSABLE_SUFFIXES) and getattr(m, "_hf_hook", None) is None
               and ("forward" not in m.__dict__ or is_routed(m))]
    for m in modules:
        route(m)
    return modules


def _class_forward(cls: type) -> Callable:
    with _lock:
        if cls not in _compiled_classes:
            _compiled_classes[cls] = _compile(cls.forward, f"{cls.__name__}.forward")
        return _compiled_classes[cls]


def _run_as(function: Callable, module: nn.Module) -> Callable:
    """An override (`routing`) that runs `function(module, *args, **kwargs)` instead of the module's forward."""
    def override(base, *args, **kwargs):
        return function(module, *args, **kwargs)

    return override


@contextlib.contextmanager
def fused_regions(model: nn.Module, modules: list[nn.Module] | None = None,
                  forwards: dict[nn.Module, Callable] | None = None, parallel: bool = True) -> Iterator[None]:
    """Within the block, `model`'s fusable modules (`fusable_modules`, or the given list) and the `@fusable`
    functions run compiled; a module in `forwards` (module -> function(module, *args)) runs that function instead
    (`ModelAdapter.fused_forwards`); `parallel_linears` runs its projections side by side when `parallel`.
    For calls made in this thread only (`routing.overriding`): other callers of the model meanwhile run it
    as it is."""
    modules = fusable_modules(model) if modules is None else modules
    forwards = forwards or {}
    # A module wrapped by someone else since it was routed (a hook, another tool) keeps their wrapper as it is.
    overrides = {m: _run_as(forwards.get(m) or _class_forward(type(m)), m) for m in modules if is_routed(m)}
    outer_parallel = getattr(_state, "parallel", False)
    _state.depth = getattr(_state, "depth", 0) + 1
    _state.parallel = parallel
    try:
        with overriding(overrides):
            yield
    finally:
        _state.depth -= 1
        _state.parallel = outer_parallel
