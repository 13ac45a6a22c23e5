"""Reference tree gated delta rule, written from the recurrence (fp32, one node at a time).

Per value head, for node i with parent p (the committed state S0 when p = -1):

    S_i = exp(g_i) * S_p
    u_i = beta_i * (v_i - S_i^T k_i)          # the delta-rule correction ("new value")
    S_i = S_i + k_i u_i^T
    o_i = scale * S_i^T q_i

This file materializes one state per node on purpose: it is the oracle that the closed-form PyTorch path
and the Triton kernels are tested against, not a path to run at scale.
"""

from __future__ import annotations

import torch

from ..tree import path_nodes
from .common import TreeGatedDeltaOutput, prepare_inputs


def naive_tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parent: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    num_nodes: torch.Tensor | None = None,
) -> TreeGatedDeltaOutput:
    """Same contract as `tree_gated_delta_rule`; see `common.prepare_inputs` for shapes."""
    p = prepare_inputs(q, k, v, g, beta, parent, initial_state, scale, use_qk_l2norm, num_nodes)
    bsz, n, hv = p.g.shape
    vdim = p.v.shape[-1]
    o = torch.zeros(bsz, n, hv, vdim, dtype=torch.float32, device=q.device)
    u = torch.zeros_like(o)
    g_cum = torch.zeros(bsz, n, hv, dtype=torch.float32, device=q.device)
    par = parent.tolist()
    for b in range(bsz):
        states: list[torch.Tensor] = []
        for i in range(n):
            pi = par[b][i]
            prev = p.initial_state[b] if pi < 0 else states[pi]
            g_prev = torch.zeros(hv, device=q.device) if pi < 0 else g_cum[b, pi]
            g_cum[b, i] = g_prev + p.g[b, i]
            s = prev * p.g[b, i].exp()[:, None, None]  # [HV, K, V]
            ki, qi = p.k_hv[b, i], p.q_hv[b, i]  # [HV, K]
            ui = p.beta[b, i][:, None] * (p.v[b, i] - torch.einsum("hkv,hk->hv", s, ki))
            s = s + ki[:, :, None] * ui[:, None, :]
            states.append(s)
            u[b, i] = ui
            o[b, i] = p.scale * torch.einsum("hkv,hk->hv", s, qi)
    o = o * p.valid[..., None, None]
    return TreeGatedDeltaOutput(o=o.to(q.dtype), u=u, k=p.k, g_cum=g_cum)


def naive_commit_gated_delta_rule(
    initial_state: torch.Tensor, out: TreeGatedDeltaOutput, parent: torch.Tensor, leaf: torch.Tensor
) -> torch.Tensor:
    """Replay the recurrence along the root->leaf path only, from the stored factors. Returns [B, HV, K, V]."""
    bsz, hv = initial_state.shape[:2]
    group = hv // out.k.shape[2]
    new = initial_state.detach().clone().float()
    for b, nodes in enumerate(path_nodes(parent, leaf)):
        s = new[b]
        g_prev = torch.zeros(hv, device=s.device)
        for i in nodes.tolist():
            s = s * (out.g_cum[b, i] - g_prev).exp()[:, None, None]
            g_prev = out.g_cum[b, i]
            ki = out.k[b, i].repeat_interleave(group, dim=0)  # [HV, K]
            s = s + ki[:, :, None] * out.u[b, i][:, None, :]
        new[b] = s
    return new
