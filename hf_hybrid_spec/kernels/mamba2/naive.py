"""Reference tree Mamba-2, written from the recurrence node by node (one state per node, fp32)."""

from __future__ import annotations

import math

import torch

from ..tree import path_nodes
from .common import TreeMamba2Output, finish_output, prepare_mamba2


def naive_tree_mamba2(
    x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None, dt_softplus=True,
    dt_limit=(0.0, math.inf), num_nodes=None,
) -> TreeMamba2Output:
    """Same contract as `tree_mamba2`; see `common.prepare_mamba2` for shapes."""
    p = prepare_mamba2(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus, dt_limit, num_nodes)
    bsz, n, h, pdim = p.x.shape
    y = torch.zeros(bsz, n, h, pdim, dtype=torch.float32, device=x.device)
    a_cum = torch.zeros(bsz, n, h, dtype=torch.float32, device=x.device)
    par = parent.tolist()
    for b in range(bsz):
        states = []
        for i in range(n):
            pi = par[b][i]
            prev = p.initial_state[b] if pi < 0 else states[pi]
            da = p.dt[b, i] * p.a  # [H]
            a_cum[b, i] = da + (0.0 if pi < 0 else a_cum[b, pi])
            hs = prev * da.exp()[:, None, None] + (p.dt[b, i][:, None] * p.x[b, i])[:, :, None] * p.b_h[b, i][:, None, :]
            states.append(hs)
            y[b, i] = torch.einsum("hps,hs->hp", hs, p.c_h[b, i])
    return TreeMamba2Output(y=finish_output(y, p, x.dtype), x=p.x, b=p.b, dt=p.dt, a_cum=a_cum)


def naive_commit_mamba2(initial_state, out: TreeMamba2Output, parent, leaf) -> torch.Tensor:
    """Replay the recurrence along the root->leaf path from the stored factors. Returns [B, H, P, S]."""
    h = initial_state.shape[1]
    rep = h // out.b.shape[2]
    new = initial_state.detach().clone().float()
    for b, nodes in enumerate(path_nodes(parent, leaf)):
        s = new[b]
        prev_cum = torch.zeros(h, device=s.device)
        for i in nodes.tolist():
            s = s * (out.a_cum[b, i] - prev_cum).exp()[:, None, None]
            prev_cum = out.a_cum[b, i]
            bh = out.b[b, i].repeat_interleave(rep, dim=0)  # [H, S]
            s = s + (out.dt[b, i][:, None] * out.x[b, i])[:, :, None] * bh[:, None, :]
        new[b] = s
    return new
