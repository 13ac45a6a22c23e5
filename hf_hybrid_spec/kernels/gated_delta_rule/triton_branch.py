"""Baseline for the benchmark: branch-by-branch tree verification of the gated delta rule, done the strongest
way that still materializes one state per node (what SGLang's hybrid backend does for trees, fused).

What this file does:
    - `branch_gated_delta_rule_fwd_kernel`: ONE fused kernel; one program per (batch row, value head, V tile)
      walks the nodes in topological order with the [K, BV] state tile in registers. Node i steps from its
      parent's state (kept in registers when the parent is node i-1, the common case in depth-first order,
      otherwise loaded back from HBM), and stores its own state: [B, N, HV, K, V] fp32 of transient memory.
    - `triton_branch_gated_delta_rule` returns the outputs and those states; `branch_commit` gathers the
      accepted node's state (a copy per row).

Not a production path (it is the thing the closed form replaces); it is here so the benchmark compares
against a real fused kernel rather than a Python loop. Same contract for o as `tree_gated_delta_rule`
(no varlen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..tree import cdiv, pow2
from .common import check_shapes


@dataclass
class BranchGatedDeltaOutput:
    """o: [B, N, HV, V] in q's dtype; states: [B, N, HV, K, V] fp32, the state after every node."""

    o: torch.Tensor
    states: torch.Tensor


@triton.jit(do_not_specialize=["N"])
def branch_gated_delta_rule_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    parent,
    h0,
    o,
    states,
    scale,
    N,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):
    """q, k [B, N, H, K]; v [B, N, HV, V]; g, beta [B, N, HV]; parent [B, N]; h0 [B, HV, K, V] fp32
    -> o [B, N, HV, V], states [B, N, HV, K, V] fp32. Grid: (cdiv(V, BV), B * HV); BK >= K."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_b64 = i_b.to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]

    p_h0 = h0 + (i_b64 * HV + i_hv) * K * V + o_kv
    b_h = tl.load(p_h0, mask=m_kv, other=0.0)
    for i in range(N):
        o_n = i_b64 * N + i
        i_par = tl.load(parent + o_n).to(tl.int32)
        # The registers hold node i-1's state; any other parent is read back from HBM.
        if i_par != i - 1:
            if i_par < 0:
                b_h = tl.load(p_h0, mask=m_kv, other=0.0)
            else:
                p_par = states + ((i_b64 * N + i_par) * HV + i_hv) * K * V + o_kv
                b_h = tl.load(p_par, mask=m_kv, other=0.0)
        b_q = tl.load(q + (o_n * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (o_n * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_v = tl.load(v + (o_n * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + o_n * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + o_n * HV + i_hv).to(tl.float32)

        b_h *= tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
        tl.store(o + (o_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        tl.store(states + (o_n * HV + i_hv) * K * V + o_kv, b_h, mask=m_kv)
        # A later node of this program may load this state back: make the stores visible to all its threads.
        tl.debug_barrier()


def branch_gated_delta_rule_fwd(
    q, k, v, g, beta, parent, initial_state, scale, use_qk_l2norm
) -> BranchGatedDeltaOutput:
    """Launcher: no validation, no host sync; `scale` must be a float. Allocates [B, N, HV, K, V] fp32."""
    bsz, n, h, kdim = q.shape
    hv, vdim = v.shape[2:]
    q, k, v, g, beta, parent = (t.contiguous() for t in (q, k, v, g, beta, parent))
    h0 = initial_state.float().contiguous()
    o = torch.empty(bsz, n, hv, vdim, dtype=q.dtype, device=q.device)
    states = torch.empty(bsz, n, hv, kdim, vdim, dtype=torch.float32, device=q.device)
    bk = pow2(kdim)
    # The whole K column of the state stays in registers: bound the tile at 8K fp32 values.
    bv = min(pow2(vdim), max(16, 8192 // bk))
    grid = (cdiv(vdim, bv), bsz * hv)
    branch_gated_delta_rule_fwd_kernel[grid](
        q, k, v, g, beta, parent, h0, o, states,
        scale, n,
        H=h, HV=hv, K=kdim, V=vdim, BK=bk, BV=bv, USE_QK_L2NORM=use_qk_l2norm,
        num_warps=4 if bk * bv <= 4096 else 8,
    )
    return BranchGatedDeltaOutput(o=o, states=states)


def triton_branch_gated_delta_rule(
    q, k, v, g, beta, parent, initial_state, scale=None, use_qk_l2norm=False
) -> BranchGatedDeltaOutput:
    """Branch-by-branch tree verification; shapes as `tree_gated_delta_rule` (validated the same way)."""
    kdim = check_shapes(q, k, v, g, beta, parent, initial_state)[4]
    scale = kdim**-0.5 if scale is None else float(scale)
    return branch_gated_delta_rule_fwd(q, k, v, g, beta, parent, initial_state, scale, use_qk_l2norm)


def branch_commit(initial_state: torch.Tensor, states: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """The accepted node's materialized state per row ([B, *state]); leaf = -1 keeps initial_state."""
    bsz = states.shape[0]
    rows = torch.arange(bsz, device=states.device)
    picked = states[rows, leaf.clamp(min=0).to(states.device)]
    return torch.where((leaf < 0).to(states.device).view(bsz, *[1] * (picked.ndim - 1)), initial_state.float(), picked)
