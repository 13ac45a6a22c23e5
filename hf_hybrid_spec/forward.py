"""Calling a transformers causal LM with a cache across transformers 5.x releases.

transformers 5.17 names the cache argument `past_key_values`; later releases call it `cache` (keeping the old
name as a deprecated alias). This module finds the right name once per model class and runs ordinary and
tree forwards.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
from torch import nn

from .cache import HybridTreeCache
from .tree import VerifyTree

__all__ = ["cache_kwarg", "forward_tokens", "forward_tree", "sdpa_without_cudnn"]

# cuDNN's SDPA backend builds an execution plan for each new shape it sees (tens of milliseconds) and caches it;
# stock decoding meets one shape per prompt, but a speculative loop meets a new key length at every step (eager tree
# verification, the drafters' own attention), so on the first request with a given prompt length each step paid that
# build: EAGLE steps took ten times their graph-replayed time. The flag is process-wide, so concurrent
# calls share one switch-off: the first to enter saves the user's setting, the last to leave restores it.
_CUDNN_LOCK = threading.Lock()
_CUDNN_USERS = 0
_CUDNN_SAVED = True


@contextlib.contextmanager
def sdpa_without_cudnn():
    """Context in which F.scaled_dot_product_attention never picks the cuDNN backend (the other backends stay as the
    user set them); safe to nest and to enter from several threads at once."""
    global _CUDNN_USERS, _CUDNN_SAVED
    with _CUDNN_LOCK:
        if _CUDNN_USERS == 0:
            _CUDNN_SAVED = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _CUDNN_USERS += 1
    try:
        yield
    finally:
        with _CUDNN_LOCK:
            _CUDNN_USERS -= 1
            if _CUDNN_USERS == 0:
                torch.backends.cuda.enable_cudnn_sdp(_CUDNN_SAVED)


@functools.cache
def _cache_kwarg_for(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model: nn.Module) -> str:
    return _cache_kwarg_for(type(model))


def forward_tokens(
    model: nn.Module,
    input_ids: torch.Tensor,
    cache,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 1,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
    **model_inputs,
):
    """An ordinary (causal) forward of `input_ids` [B, T] that appends to `cache` (`model_inputs`: more inputs of the
    model's forward, e.g. a multimodal prompt's pixel values)."""
    kwargs = {cache_kwarg(model): cache, **model_inputs}
    if output_attentions:
        kwargs["output_attentions"] = True
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        output_hidden_states=output_hidden_states,
        **kwargs,
    )


def forward_tree(
    model: nn.Module,
    tree: VerifyTree,
    cache: HybridTreeCache,
    prefix_length: int,
    root_position: torch.Tensor,
    prefix_mask: torch.Tensor | None = None,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
    position_offsets: torch.Tensor | None = None,
):
    """Run the whole tree through `model` in one forward, leaving `cache` in tree mode (commit or abort next).

    Args:
        tree: the verify tree (root first).
        prefix_length: tokens already committed in `cache`.
        root_position: [B] position id of the root.
        prefix_mask: optional [B, prefix_length] padding mask of the committed tokens.
        position_offsets: [R, B] multimodal RoPE offsets (`VerifyTree.position_ids`), for models that take them.
    """
    b = tree.tokens.shape[0]
    if prefix_mask is None:
        prefix_mask = torch.ones(b, prefix_length, dtype=torch.long, device=tree.tokens.device)
    mask = tree.attention_mask(prefix_mask, dtype=model.dtype)
    cache.begin_tree(tree.parent, prefix_length)
    try:
        return forward_tokens(
            model,
            tree.tokens,
            cache,
            position_ids=tree.position_ids(root_position, position_offsets),
            attention_mask=mask,
            logits_to_keep=0,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
    except BaseException:
        cache.abort()
        raise
