"""Routed module forwards: per-call changes to how a model computes, never visible to other callers.

Speculation sometimes runs the target differently from what every other caller of the same model object expects:
a recurrent mixer solves a draft tree in closed form, self-speculation runs the model with its attention removed or
its last layers skipped, the fused verify forward runs some modules compiled. Swapping a shared module's forward for
the duration of such a call would change it for every thread using the model (a plain `generate` beside a
self-speculative one would then compute with attention off). Instead:

- `route(module)` gives the module, once, an instance-level forward (a `RoutedForward`, like accelerate's hooks)
  that runs the module's own forward unless told otherwise. A recurrent mixer routed with a `tree_forward` runs it
  whenever the cache it is called with is a `HybridTreeCache` in tree mode (a property of that call's cache).
- `overriding({module: fn})` tells it otherwise, for the calls made inside the block, in this thread (a context
  variable): there a call of `module` runs `fn(base, *args, **kwargs)`, `base` being what it would run otherwise.
  Other threads, and this one after the block, see the module as it is.

While torch.compile traces a model (stock `generate(cache_implementation="static")` on a model we routed), a routed
forward is its module's own forward: no override is ever active inside someone else's compiled graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from .cache import HybridTreeCache

__all__ = ["RoutedForward", "route", "is_routed", "overriding", "find_mixer_cache", "ROUTED_FLAG", "TreeForward", "Override"]

# (module, hidden_states [B, N, D], cache in tree mode) -> output [B, N, D]
TreeForward = Callable[[nn.Module, torch.Tensor, HybridTreeCache], torch.Tensor]
# (base, *args, **kwargs) -> what the module returns; `base(*args, **kwargs)` is the call without the override.
Override = Callable[..., object]

ROUTED_FLAG = "__hf_hybrid_spec_routed__"

_OVERRIDES: contextvars.ContextVar[Mapping[nn.Module, Override] | None] = contextvars.ContextVar(
    "hf_hybrid_spec_overrides", default=None)
_INSTALL_LOCK = threading.Lock()


def find_mixer_cache(args: tuple, kwargs: dict):
    """The cache argument of a mixer call, whatever transformers version named it."""
    for name in ("cache", "cache_params", "past_key_values"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    for a in args:
        if isinstance(a, HybridTreeCache):
            return a
    return None


def _tree_forward_under_accelerate_hooks(module: nn.Module, tree_forward: TreeForward, cache, args, kwargs):
    """The tree forward of a mixer that accelerate dispatched (device_map placement or offload).

    Its hook wraps the stock forward, which the tree path bypasses, so the hook's steps run here: inputs go to
    the execution device and offloaded weights (meta at rest) come in. Tree forwards also read some submodules'
    weights directly (conv1d.weight, ...) without calling them, so every offloaded submodule is brought in too.
    """
    hook = module._hf_hook
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    offloaded = []
    if getattr(hook, "offload", True):  # placement-only hooks (a split over GPUs) offload nothing: skip the scan
        offloaded = [m for m in module.modules() if m is not module and getattr(m, "_hf_hook", None) is not None
                     and any(p.is_meta for p in m.parameters(recurse=False))]
    for m in offloaded:
        m._hf_hook.pre_forward(m)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    out = tree_forward(module, hidden_states, cache)
    for m in offloaded:
        m._hf_hook.post_forward(m, None)
    return hook.post_forward(module, out)


class RoutedForward:
    """A module's forward once routed (see the module docstring).

    An object, not a closure: `copy.deepcopy(model)` (TRL's reference models, EMA copies) copies it with the module,
    its attributes rebound to the copy (the module through deepcopy's memo, the original bound method to the copied
    module). A closure would be shared as it is, and the copy would run the original model's weights.
    """

    def __init__(self, module: nn.Module, original: Callable, tree_forward: TreeForward | None = None):
        self.module, self.original, self.tree_forward = module, original, tree_forward
        functools.update_wrapper(self, original)
        setattr(self, ROUTED_FLAG, True)

    def __call__(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            overrides = _OVERRIDES.get()
            if overrides is not None:
                override = overrides.get(self.module)
                if override is not None:
                    return override(self.base, *args, **kwargs)
        return self.base(*args, **kwargs)

    def base(self, *args, **kwargs):
        """The call without overrides: the tree forward for a routed mixer in tree mode, else the module's own."""
        if self.tree_forward is not None:
            cache = find_mixer_cache(args, kwargs)
            if isinstance(cache, HybridTreeCache) and cache.in_tree_mode:
                module = self.module
                if getattr(module, "_hf_hook", None) is not None:
                    return _tree_forward_under_accelerate_hooks(module, self.tree_forward, cache, args, kwargs)
                hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                return self.tree_forward(module, hidden_states, cache)
        return self.original(*args, **kwargs)


def route(module: nn.Module, tree_forward: TreeForward | None = None) -> RoutedForward:
    """Install the routed forward on `module` (once; later calls return it, adding `tree_forward` if given)."""
    with _INSTALL_LOCK:
        current = module.__dict__.get("forward")
        if isinstance(current, RoutedForward) and current.module is module:
            if tree_forward is not None:
                current.tree_forward = tree_forward
            return current
        routed = RoutedForward(module, module.forward, tree_forward)
        module.forward = routed
        return routed


def is_routed(module: nn.Module) -> bool:
    current = module.__dict__.get("forward")
    return isinstance(current, RoutedForward) and current.module is module


@contextlib.contextmanager
def overriding(overrides: Mapping[nn.Module, Override]) -> Iterator[None]:
    """Within the block, in this context only, each module in `overrides` runs its override (see the module
    docstring); the modules are routed here if they were not yet. Nested blocks add to the outer ones."""
    for module in overrides:
        route(module)
    outer = _OVERRIDES.get()
    token = _OVERRIDES.set(dict(overrides) if outer is None else {**outer, **overrides})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)
