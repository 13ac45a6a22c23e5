"""The verify forward's attention on our tree-attention kernel (`kernels.attention`), through transformers'
`AttentionInterface`.

`routed_attention(modules)` makes the given attention layers call the implementation registered here as
`TREE_ATTENTION` for the duration of a block (the static runner's fused verify forward: its warm-up and graph
capture, `AssistantConfig(compile_verify=True)`). The registered function runs the Triton kernel only for calls made
inside such a block in the same thread (a context variable), where it applies (CUDA, an additive 4D mask of the
tree's shape, no dropout, sliding window or soft-capping), and otherwise sdpa, the layers' own implementation (only
layers on sdpa are switched). The switch itself is the layers' shared config (`_attn_implementation`): transformers
picks the function from it, and there is no per-call way in. So it is counted (the first block in switches, the last
out switches back), and any other caller that runs meanwhile (another thread) reaches the registered function with no
block of its own active and gets exactly sdpa. The tree's mask is always given as a prepared 4D tensor, which
transformers' mask creation returns as is whatever the implementation (a mask function is registered under the same
name all the same).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["TREE_ATTENTION", "routed_attention", "tree_attention_forward", "kernel_applies", "kernel_supports",
           "set_tree_attention", "tree_attention_enabled"]

TREE_ATTENTION = "hf_hybrid_spec_tree"
_enabled = True
# Whether this context is inside a `routed_attention` block (the kernel's calls), and how many blocks hold each
# switched config (by id, with the config).
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_hybrid_spec_tree_attention", default=False)
_SWITCHED: dict[int, list] = {}
_SWITCH_LOCK = threading.Lock()


def set_tree_attention(enabled: bool) -> None:
    """Route the fused verify forward's attention to the kernel (the default) or not, process-wide, for runners
    built afterwards; off is the forward as it was before it, for A/B measurements
    (`benchmarks/ab_parallel_linears.py`)."""
    global _enabled
    _enabled = bool(enabled)


def tree_attention_enabled() -> bool:
    return _enabled


def kernel_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, dropout: float,
                   kwargs: dict) -> bool:
    """Whether the Triton kernel computes this attention call (see the module docstring)."""
    return query.device.type == "cuda" and kernel_supports(query, key, value, mask, dropout, kwargs)


def kernel_supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask, dropout: float,
                    kwargs: dict) -> bool:
    """The kernel's conditions on the call's shapes, dtypes and options (the device aside)."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return False
    if dropout or any(kwargs.get(name) is not None for name in ("sliding_window", "softcap", "s_aux")):
        return False
    b, hq, n, d = query.shape
    return (query.dtype in (torch.float16, torch.bfloat16, torch.float32) and key.dtype == value.dtype == query.dtype
            and key.shape[-1] == value.shape[-1] == d and key.shape[:3] == value.shape[:3] and hq % key.shape[1] == 0
            and mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == 1
            and tuple(mask.shape[-2:]) == (n, key.shape[2]) and d <= 256)


def tree_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs):
    """An `AttentionInterface` function: query [B, Hq, N, D], key / value [B, Hkv, L, D] -> ([B, N, Hq, D], None)."""
    if _ACTIVE.get() and kernel_applies(query, key, value, attention_mask, dropout if module.training else 0.0, kwargs):
        from ..kernels.attention.triton_tree import triton_tree_attention

        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        contiguous = [t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, attention_mask)]
        # Triton launches on the current device: a layer on another GPU (device_map) makes its own current.
        on_device = torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()
        with on_device:
            return triton_tree_attention(*contiguous, scale), None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)


@functools.cache
def register() -> None:
    """Register `TREE_ATTENTION` with transformers' attention and mask interfaces (once; before the first block that
    switches a layer to it: importing transformers' modeling code takes seconds, so not at import)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(TREE_ATTENTION, tree_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(TREE_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def routed_attention(modules: list[nn.Module]) -> Iterator[None]:
    """Within the block, the given attention modules (`ModelAdapter.attention_modules`) run on the tree-attention
    kernel, in this thread (see the module docstring). Configs on sdpa only: an eager layer keeps its own numerics
    (its eager function is the model file's own)."""
    register()
    configs = [m.config for m in modules if getattr(m, "config", None) is not None]
    held = []
    with _SWITCH_LOCK:
        for config in {id(c): c for c in configs}.values():
            entry = _SWITCHED.get(id(config))
            if entry is None:
                if config._attn_implementation != "sdpa":
                    continue
                config._attn_implementation = TREE_ATTENTION
                entry = _SWITCHED[id(config)] = [config, 0]
            entry[1] += 1
            held.append(config)
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        with _SWITCH_LOCK:
            for config in held:
                entry = _SWITCHED[id(config)]
                entry[1] -= 1
                if entry[1] == 0:
                    config._attn_implementation = "sdpa"
                    del _SWITCHED[id(config)]
