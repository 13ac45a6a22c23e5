"""Closed-form tree gated delta rule in PyTorch: the CPU path, and the math the Triton kernel implements.

With G_i the log decay summed over node i's root path and j ranging over proper ancestors of i, the
per-node corrections u solve a unit lower-triangular system (topological order):

    u_i + beta_i * sum_j exp(G_i - G_j) (k_i . k_j) u_j = beta_i * (v_i - exp(G_i) S0^T k_i)

and every output is read off the committed state and its ancestors' factors:

    o_i = scale * (exp(G_i) S0^T q_i + sum_{j in path(i)} exp(G_i - G_j) (q_i . k_j) u_j)

Entries between different branches are zero, so a chain gives the chunked recurrence exactly. No state
per node is formed: only [N, N] score matrices per head and the factors u.
"""

from __future__ import annotations

import torch

from ..tree import ancestor_mask, path_mask
from .common import TreeGatedDeltaOutput, prepare_inputs


def torch_tree_gated_delta_rule(
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
    p = prepare_inputs(q, k, v, g, beta, parent, initial_state, scale, use_qk_l2norm, num_nodes)
    anc = ancestor_mask(parent, include_self=True)  # [B, N, N]
    strict = anc & ~torch.eye(anc.shape[-1], dtype=torch.bool, device=anc.device)
    # Heads first: [B, HV, N, *].
    qh, kh, vh = (t.transpose(1, 2) for t in (p.q_hv, p.k_hv, p.v))
    gh, bh = p.g.transpose(1, 2), p.beta.transpose(1, 2)
    g_cum = torch.einsum("bij,bhj->bhi", anc.float(), gh)  # [B, HV, N]
    diff = g_cum[..., :, None] - g_cum[..., None, :]
    # Mask before exp: off-path differences can be positive and overflow.
    decay_anc = torch.where(anc[:, None], diff, float("-inf")).exp()
    decay_strict = torch.where(strict[:, None], diff, float("-inf")).exp()
    a = bh[..., None] * decay_strict * (kh @ kh.transpose(-1, -2))
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    rhs_v = bh[..., None] * vh
    rhs_k = (bh * g_cum.exp())[..., None] * kh
    w = torch.linalg.solve_triangular(eye + a, torch.cat([rhs_v, rhs_k], dim=-1), upper=False, unitriangular=True)
    w_v, w_k = w.split([vh.shape[-1], kh.shape[-1]], dim=-1)
    s0 = p.initial_state  # [B, HV, K, V]
    u = w_v - w_k @ s0
    o = g_cum.exp()[..., None] * (qh @ s0) + (decay_anc * (qh @ kh.transpose(-1, -2))) @ u
    o = p.scale * o.transpose(1, 2) * p.valid[..., None, None]
    return TreeGatedDeltaOutput(
        o=o.to(q.dtype), u=u.transpose(1, 2).contiguous(), k=p.k, g_cum=g_cum.transpose(1, 2).contiguous()
    )


def torch_commit_gated_delta_rule(
    initial_state: torch.Tensor,
    out: TreeGatedDeltaOutput,
    parent: torch.Tensor,
    leaf: torch.Tensor,
    on_path: torch.Tensor | None = None,
) -> torch.Tensor:
    """S* = exp(G_leaf) S0 + sum_{j on path} exp(G_leaf - G_j) k_j u_j^T; rows with leaf = -1 unchanged.

    on_path: optional [B, N] bool mask of the root->leaf path, when the caller already has it.
    """
    bsz, hv = initial_state.shape[:2]
    group = hv // out.k.shape[2]
    on_path = path_mask(parent, leaf) if on_path is None else on_path  # [B, N]
    leaf_c = leaf.clamp(min=0).long()
    g_leaf = out.g_cum.gather(1, leaf_c.view(bsz, 1, 1).expand(bsz, 1, hv)).squeeze(1)  # [B, HV]
    w = torch.where(on_path[..., None], (g_leaf[:, None, :] - out.g_cum), float("-inf")).exp()  # [B, N, HV]
    k_hv = out.k.repeat_interleave(group, dim=2)  # [B, N, HV, K]
    s0 = initial_state.float()
    new = g_leaf.exp()[..., None, None] * s0 + torch.einsum("bnh,bnhk,bnhv->bhkv", w, k_hv, out.u)
    keep = (leaf < 0).view(bsz, 1, 1, 1)
    return torch.where(keep, s0, new)
