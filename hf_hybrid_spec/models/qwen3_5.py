"""Qwen3.5 (`qwen3_5_text`, and the text backbone of `qwen3_5`): sequential hybrid, 3 gated-delta layers per
full-attention layer, separate q/k/v, z, b and a projections."""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelAdapter
from .gated_deltanet import GatedDeltaProjection, make_gated_delta_tree_forward


def project(mod: nn.Module, h: torch.Tensor) -> GatedDeltaProjection:
    bsz, n, _ = h.shape
    return GatedDeltaProjection(
        qkv=mod.in_proj_qkv(h),
        z=mod.in_proj_z(h).reshape(bsz, n, -1, mod.head_v_dim),
        b=mod.in_proj_b(h),
        a=mod.in_proj_a(h),
    )


ADAPTER = ModelAdapter(
    name="qwen3_5",
    model_types=("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"),
    mixers={"Qwen3_5GatedDeltaNet": make_gated_delta_tree_forward(project),
            "Qwen3_5MoeGatedDeltaNet": make_gated_delta_tree_forward(project)},
    attention=("Qwen3_5Attention", "Qwen3_5MoeAttention"),
)
