"""LFM2: gated short-conv layers (no recurrent state beyond the conv window) and attention layers."""

from __future__ import annotations

import torch
from torch import nn

from ..cache import HybridTreeCache, PendingRecurrent
from ..kernels import tree_causal_conv1d
from .base import ModelAdapter


def tree_forward(mod: nn.Module, hidden_states: torch.Tensor, cache: HybridTreeCache) -> torch.Tensor:
    b_gate, c_gate, x = mod.in_proj(hidden_states).chunk(3, dim=-1)
    bx = b_gate * x  # [B, N, D], the conv's input
    conv_state, _ = cache.recurrent_states(mod.layer_idx)
    conv_out = tree_causal_conv1d(
        bx, mod.conv.weight.squeeze(1), mod.conv.bias, cache.tree.parent_on(hidden_states.device), conv_state, activation=None
    )
    cache.stash(mod.layer_idx, PendingRecurrent(conv_inputs=bx))
    return mod.out_proj(c_gate * conv_out)


ADAPTER = ModelAdapter(
    name="lfm2",
    model_types=("lfm2",),
    mixers={"Lfm2ShortConv": tree_forward},
    attention=("Lfm2Attention",),
)
