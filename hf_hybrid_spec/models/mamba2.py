"""Tree forward shared by Mamba-2 mixers (Falcon-H1, Bamba, Nemotron-H, GraniteMoeHybrid).

Families differ in how the input projection is scaled and in how the gate is applied at the end; the conv
and the SSD over the tree are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import HybridTreeCache, PendingRecurrent
from ..kernels import tree_causal_conv1d, tree_mamba2
from .gated_deltanet import conv_activation


def plain_projection(mod: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return mod.in_proj(hidden_states)


def norm_gate(mod: nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return mod.norm(y, gate)


def make_mamba2_tree_forward(
    project: Callable[[nn.Module, torch.Tensor], torch.Tensor] = plain_projection,
    gate: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = norm_gate,
):
    """project(mod, h) -> [B, N, d_inner + conv_dim + H] (gate, xBC, dt); gate(mod, y [B, N, d_inner], z)."""

    def tree_forward(mod: nn.Module, hidden_states: torch.Tensor, cache: HybridTreeCache) -> torch.Tensor:
        bsz, n, _ = hidden_states.shape
        dtype = hidden_states.dtype
        tree = cache.tree
        projected = project(mod, hidden_states)
        z, xbc, dt = projected.split([mod.intermediate_size, mod.conv_dim, mod.num_heads], dim=-1)
        conv_state, recurrent_state = cache.recurrent_states(mod.layer_idx)
        xbc_conv = tree_causal_conv1d(
            xbc, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, tree.parent_on(hidden_states.device), conv_state,
            activation=conv_activation(mod.activation),
        )
        groups_state = mod.n_groups * mod.ssm_state_size
        x, b, c = torch.split(xbc_conv, [mod.intermediate_size, groups_state, groups_state], dim=-1)
        out = tree_mamba2(
            x.reshape(bsz, n, mod.num_heads, mod.head_dim),
            dt,
            -torch.exp(mod.A_log.float()),
            b.reshape(bsz, n, mod.n_groups, mod.ssm_state_size),
            c.reshape(bsz, n, mod.n_groups, mod.ssm_state_size),
            tree.parent_on(hidden_states.device),
            recurrent_state,
            D=mod.D,
            dt_bias=mod.dt_bias,
            dt_softplus=True,
            # The stock single-token decode step ignores `time_step_limit` (only the chunked path clamps);
            # a verify step stands in for decode steps, so it follows decode to stay identical to plain greedy.
            dt_limit=(0.0, math.inf),
            num_nodes=tree.num_nodes,
        )
        cache.stash(mod.layer_idx, PendingRecurrent(conv_inputs=xbc, recurrent=out))
        y = gate(mod, out.y.reshape(bsz, n, -1), z)
        return mod.out_proj(y.to(dtype))

    return tree_forward


def silu_gate(mod: nn.Module, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return y * F.silu(z)
