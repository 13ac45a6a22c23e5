"""Inductor-fused regions of the target's verify forward (`AssistantConfig(compile=True, compile_verify=True)`).

A verify forward captured as a CUDA graph has no Python or launch overhead left, but it still runs every small
kernel eager PyTorch issues: on a 2B Qwen3.5-shaped model ~1,000 kernels per forward, most of them the dtype
casts, squares, means and scales of RMSNorms, the gated output norm, the gate math of each mixer and the MLP's
activation, 1-4 us each, against matmuls that read the weights once. Stock `generate(cache_implementation="static")`
compiles the whole forward for the same reason. We cannot hand the whole verify forward to torch.compile (the tree
cache's bookkeeping and our Triton kernels sit inside it), so we compile the pure regions instead:

- modules whose class name ends in one of `FUSABLE_SUFFIXES` (the families' RMSNorm, gated RMSNorm and MLP
  classes: functions of their inputs and weights only), one compile per class for every instance and every tree
  size (`dynamic=True`; parameters are graph inputs), swapped in on the instances only while `fused_regions` is
  active (the runner's warm-up and capture, or its eager CPU forward);
- functions of ours marked with `@fusable` (the mixers' gate math), compiled on first use under `fused_regions`.

Numerics are those of a compiled model (the fused reductions round differently in the last bits, as stock
static+compile does), which is why this is opt-in. A region whose compile fails warns once and runs eagerly from
then on: fusion never decides what is committed beyond that rounding.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["FUSABLE_SUFFIXES", "fusable", "fused_regions", "fusable_modules"]

# Class-name endings of modules that are pure functions of (inputs, own weights) in every supported family.
FUSABLE_SUFFIXES = ("RMSNorm", "RMSNormGated", "MLP")

_state = threading.local()
_compiled_classes: dict[type, Callable] = {}  # class -> its compiled forward (as an unbound function)
_lock = threading.Lock()


def _active() -> bool:
    return getattr(_state, "depth", 0) > 0


def _compile(fn: Callable, name: str) -> Callable:
    """`fn` compiled by Inductor (dynamic shapes: one compile serves every tree size), falling back to `fn` for
    good, with a warning, if compiling it fails."""
    compiled = torch.compile(fn, dynamic=True)
    failed = False

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal failed
        if not failed:
            try:
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


def fusable_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose forward `fused_regions` swaps for the compiled one.

    Modules that already have an instance-level forward (accelerate's hooks for device_map / offload, or another
    wrapper) are left alone: replacing it would skip the hook.
    """
    return [m for m in model.modules()
            if type(m).__name__.endswith(FUSABLE_SUFFIXES) and "forward" not in m.__dict__
            and getattr(m, "_hf_hook", None) is None]


def _class_forward(cls: type) -> Callable:
    with _lock:
        if cls not in _compiled_classes:
            _compiled_classes[cls] = _compile(cls.forward, f"{cls.__name__}.forward")
        return _compiled_classes[cls]


@contextlib.contextmanager
def fused_regions(model: nn.Module, modules: list[nn.Module] | None = None) -> Iterator[None]:
    """Within the block, `model`'s fusable modules (`fusable_modules`, or the given list) and the `@fusable`
    functions run compiled. Instance forwards are put back on exit, whatever happens. Not for concurrent use on
    one model (as `ModelAdapter.suppress_attention`): the static runner that uses it is leased to one call."""
    modules = fusable_modules(model) if modules is None else modules
    swapped = []
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        for m in modules:
            if "forward" in m.__dict__:  # wrapped since the list was made (a hook, another tool): leave it be
                continue
            m.forward = functools.partial(_class_forward(type(m)), m)
            swapped.append(m)
        yield
    finally:
        for m in swapped:
            del m.forward
        _state.depth -= 1
