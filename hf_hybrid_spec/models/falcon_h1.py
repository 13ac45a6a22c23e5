"""Falcon-H1: parallel hybrid (Mamba-2 and attention side by side in every layer), with muP multipliers on
the SSM input projection and an optional gated RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from .base import ModelAdapter
from .mamba2 import make_mamba2_tree_forward, norm_gate, silu_gate
from .mlp import multiplied_gated_silu_mlp


def project(mod: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return mod.in_proj(h * mod.ssm_in_multiplier) * mod.mup_vector


def gate(mod: nn.Module, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return norm_gate(mod, y, z) if mod.mamba_rms_norm else silu_gate(mod, y, z)


ADAPTER = ModelAdapter(
    name="falcon_h1",
    model_types=("falcon_h1",),
    mixers={"FalconH1Mixer": make_mamba2_tree_forward(project, gate)},
    kind="parallel",
    attention=("FalconH1Attention",),
    layer_tuple_length=1,
    mlps={"FalconH1MLP": multiplied_gated_silu_mlp},
)
