"""Tree forward shared by gated-delta-rule mixers (Qwen3.5, Qwen3-Next, OLMo-hybrid).

Each family only says how it projects hidden states into (pre-conv qkv, z, b, a); the short conv, the gated
delta rule over the tree and the output norm are the same for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import HybridTreeCache, PendingRecurrent
from ..fusion import fusable
from ..kernels import tree_causal_conv1d, tree_gated_delta_rule


@dataclass
class GatedDeltaProjection:
    """Per-token projections of a gated-delta mixer.

    Attributes:
        qkv: [B, N, 2*key_dim + value_dim] input of the short conv (q, k, v concatenated, pre-conv).
        z: [B, N, HV, Vd] output gate.
        b: [B, N, HV] write-strength logits (beta = sigmoid(b)).
        a: [B, N, HV] decay logits (g = -exp(A_log) * softplus(a + dt_bias)).
    """

    qkv: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor


# What the tree conv ops compute after the convolution (`get_adapter` refuses a model whose mixers ask for another).
SUPPORTED_CONV_ACTIVATIONS = ("silu", "swish")


def conv_activation(name: str | None) -> str | None:
    if name is None or name in SUPPORTED_CONV_ACTIVATIONS:
        return name
    raise NotImplementedError(f"tree verification supports silu convs only, this layer uses {name!r}")


@fusable
def gated_delta_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Write strengths beta = sigmoid(b) and log-decays g = -exp(A_log) * softplus(a + dt_bias), both [B, N, HV].

    g in fp32, as the stock layer computes it (else A might overflow to -inf in fp16). One fused kernel under
    `compile_verify` instead of ~8 small ones.
    """
    return b.sigmoid(), -A_log.float().exp() * F.softplus(a.float() + dt_bias)


def make_gated_delta_tree_forward(project: Callable[[nn.Module, torch.Tensor], GatedDeltaProjection]):
    def tree_forward(mod: nn.Module, hidden_states: torch.Tensor, cache: HybridTreeCache) -> torch.Tensor:
        bsz, n, _ = hidden_states.shape
        tree = cache.tree
        proj = project(mod, hidden_states)
        conv_state, recurrent_state = cache.recurrent_states(mod.layer_idx)
        mixed = tree_causal_conv1d(
            proj.qkv,
            mod.conv1d.weight.squeeze(1),
            mod.conv1d.bias,
            tree.parent_on(hidden_states.device),
            conv_state,
            activation=conv_activation(mod.activation),
        )
        q, k, v = torch.split(mixed, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        q = q.reshape(bsz, n, -1, mod.head_k_dim)
        k = k.reshape(bsz, n, -1, mod.head_k_dim)
        v = v.reshape(bsz, n, -1, mod.head_v_dim)
        beta, g = gated_delta_gates(proj.b, proj.a, mod.A_log, mod.dt_bias)
        out = tree_gated_delta_rule(
            q, k, v, g, beta, tree.parent_on(hidden_states.device), recurrent_state, use_qk_l2norm=True,
            num_nodes=tree.num_nodes,
        )
        cache.stash(mod.layer_idx, PendingRecurrent(conv_inputs=proj.qkv, recurrent=out))
        core = out.o.reshape(-1, mod.head_v_dim)
        core = mod.norm(core, proj.z.reshape(-1, mod.head_v_dim)).reshape(bsz, n, -1)
        return mod.out_proj(core)

    return tree_forward
