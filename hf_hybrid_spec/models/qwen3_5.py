"""Qwen3.5 (`qwen3_5_text`, and the text backbone of `qwen3_5`): sequential hybrid, 3 gated-delta layers per
full-attention layer, separate q/k/v, z, b and a projections."""

from __future__ import annotations

import torch
from torch import nn

from ..fusion import parallel_linears
from .base import ModelAdapter
from .gated_deltanet import GatedDeltaProjection, make_gated_delta_tree_forward
from .mlp import gated_silu_mlp


def project(mod: nn.Module, h: torch.Tensor) -> GatedDeltaProjection:
    bsz, n, _ = h.shape
    # Under compile_verify the three small projections run beside the large one (`parallel_linears`).
    qkv, z, b, a = parallel_linears(h, mod.in_proj_qkv, mod.in_proj_z, mod.in_proj_b, mod.in_proj_a)
    return GatedDeltaProjection(qkv=qkv, z=z.reshape(bsz, n, -1, mod.head_v_dim), b=b, a=a)


ADAPTER = ModelAdapter(
    name="qwen3_5",
    model_types=("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"),
    mixers={"Qwen3_5GatedDeltaNet": make_gated_delta_tree_forward(project),
            "Qwen3_5MoeGatedDeltaNet": make_gated_delta_tree_forward(project)},
    attention=("Qwen3_5Attention", "Qwen3_5MoeAttention"),
    mlps={"Qwen3_5MLP": gated_silu_mlp, "Qwen3_5MoeMLP": gated_silu_mlp},
)
