"""Qwen3-Next: sequential hybrid with gated-delta layers whose q/k/v/z and b/a come from two fused,
head-interleaved projections."""

from __future__ import annotations

import torch
from torch import nn

from ..fusion import parallel_linears
from .base import ModelAdapter
from .gated_deltanet import GatedDeltaProjection, make_gated_delta_tree_forward


def project(mod: nn.Module, h: torch.Tensor) -> GatedDeltaProjection:
    # The stock layer's own de-interleaving, so any layout change upstream is followed here too.
    q, k, v, z, b, a = mod.fix_query_key_value_ordering(*parallel_linears(h, mod.in_proj_qkvz, mod.in_proj_ba))
    bsz, n = h.shape[:2]
    qkv = torch.cat([t.reshape(bsz, n, -1) for t in (q, k, v)], dim=-1)
    return GatedDeltaProjection(qkv=qkv, z=z, b=b, a=a)


ADAPTER = ModelAdapter(
    name="qwen3_next",
    model_types=("qwen3_next",),
    mixers={"Qwen3NextGatedDeltaNet": make_gated_delta_tree_forward(project)},
    attention=("Qwen3NextAttention",),
)
