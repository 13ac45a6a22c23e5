"""Closed-form tree Mamba-2 in PyTorch (the CPU path; the math the Triton kernel implements).

With L_i the sum of dt*A over node i's root path and j over i's ancestors (itself included):

    y_i = exp(L_i) h0 C_i + sum_j exp(L_i - L_j) (C_i . B_j) dt_j x_j  (+ D x_i, gate)
    h*  = exp(L_leaf) h0 + sum_{j on path} exp(L_leaf - L_j) dt_j x_j B_j^T
"""

from __future__ import annotations

import math

import torch

from ..tree import ancestor_mask, path_mask
from .common import TreeMamba2Output, finish_output, prepare_mamba2


def torch_tree_mamba2(
    x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None, dt_softplus=True,
    dt_limit=(0.0, math.inf), num_nodes=None,
) -> TreeMamba2Output:
    p = prepare_mamba2(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus, dt_limit, num_nodes)
    anc = ancestor_mask(parent, include_self=True)  # [B, N, N]
    da = p.dt * p.a  # [B, N, H]
    a_cum = torch.einsum("bij,bjh->bih", anc.float(), da)  # [B, N, H]
    diff = a_cum.transpose(1, 2)[..., :, None] - a_cum.transpose(1, 2)[..., None, :]  # [B, H, N, N]
    decay = torch.where(anc[:, None], diff, float("-inf")).exp()
    cb = torch.einsum("bihs,bjhs->bhij", p.c_h, p.b_h)
    m = decay * cb * p.dt.transpose(1, 2)[:, :, None, :]  # weight of x_j in y_i
    y = torch.einsum("bhij,bjhp->bihp", m, p.x)
    y = y + a_cum.exp()[..., None] * torch.einsum("bhps,bihs->bihp", p.initial_state, p.c_h)
    return TreeMamba2Output(y=finish_output(y, p, x.dtype), x=p.x, b=p.b, dt=p.dt, a_cum=a_cum)


def torch_commit_mamba2(initial_state, out: TreeMamba2Output, parent, leaf, on_path=None) -> torch.Tensor:
    """on_path: optional [B, N] bool mask of the root->leaf path, when the caller already has it."""
    bsz, h = initial_state.shape[:2]
    rep = h // out.b.shape[2]
    on_path = path_mask(parent, leaf) if on_path is None else on_path
    leaf_c = leaf.clamp(min=0).long()
    a_leaf = out.a_cum.gather(1, leaf_c.view(bsz, 1, 1).expand(bsz, 1, h)).squeeze(1)  # [B, H]
    w = torch.where(on_path[..., None], a_leaf[:, None, :] - out.a_cum, float("-inf")).exp() * out.dt  # [B, N, H]
    b_h = out.b.repeat_interleave(rep, dim=2)  # [B, N, H, S]
    s0 = initial_state.float()
    new = a_leaf.exp()[..., None, None] * s0 + torch.einsum("bnh,bnhp,bnhs->bhps", w, out.x, b_h)
    return torch.where((leaf < 0).view(bsz, 1, 1, 1), s0, new)
