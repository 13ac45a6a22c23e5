"""Jamba: sequential hybrid of attention and Mamba-1 layers (selective scan, a decay per channel and state entry).

The mixer's tree forward: the short conv over the tree (`tree_causal_conv1d`), Jamba's RMS norms on dt, B and C, then
the tree selective scan (`tree_mamba1`, level by level: `kernels.mamba1.common` says why there is no closed form to
solve here), gated by silu(z), as the stock decode step computes one token.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import HybridTreeCache, PendingRecurrent
from ..kernels import tree_causal_conv1d, tree_mamba1
from .base import ModelAdapter
from .gated_deltanet import conv_activation


def jamba_tree_forward(mod: nn.Module, hidden_states: torch.Tensor, cache: HybridTreeCache) -> torch.Tensor:
    dtype = hidden_states.dtype
    tree = cache.tree
    parent = tree.parent_on(hidden_states.device)
    xbc, gate = mod.in_proj(hidden_states).chunk(2, dim=-1)  # [B, N, D] each
    conv_state, recurrent_state = cache.recurrent_states(mod.layer_idx)
    x = tree_causal_conv1d(xbc, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, parent, conv_state,
                           activation=conv_activation(mod.activation))
    time_step, b, c = torch.split(mod.x_proj(x), [mod.time_step_rank, mod.ssm_state_size, mod.ssm_state_size], dim=-1)
    time_step = mod.dt_layernorm(time_step)
    b = mod.b_layernorm(b)
    c = mod.c_layernorm(c)
    dt = time_step @ mod.dt_proj.weight.t()  # the bias goes in with the softplus, as in the stock scan
    out = tree_mamba1(x, dt, -torch.exp(mod.A_log.float()), b, c, parent, recurrent_state, D=mod.D, z=gate,
                      dt_bias=None if mod.dt_proj.bias is None else mod.dt_proj.bias.float(), dt_softplus=True)
    cache.stash(mod.layer_idx, PendingRecurrent(conv_inputs=xbc, recurrent=out))
    return mod.out_proj(out.y.to(dtype))


ADAPTER = ModelAdapter(
    name="jamba",
    model_types=("jamba",),
    mixers={"JambaMambaMixer": jamba_tree_forward},
    attention=("JambaAttention",),
)
