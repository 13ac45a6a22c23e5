"""Baseline for the benchmark: branch-by-branch tree verification of Mamba-2, one state per node in HBM.

What this file does:
    - `branch_mamba2_fwd_kernel`: ONE fused kernel; one program per (batch row, head, P tile) walks the nodes
      in topological order with the [BP, S] state tile in registers, steps node i from its parent's state
      (registers when the parent is node i-1, else a load from HBM) and stores every node's state:
      [B, N, H, P, S] fp32 of transient memory.
    - `triton_branch_mamba2` returns y and those states; commit is
      `gated_delta_rule.triton_branch.branch_commit` (a gather of the accepted node's state).

A benchmark baseline, not a production path. Same contract for y as `tree_mamba2` (no varlen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..tree import cdiv, pow2
from .common import check_mamba2
from .triton_tree import _process_dt


@dataclass
class BranchMamba2Output:
    """y: [B, N, H, P] in x's dtype; states: [B, N, H, P, S] fp32, the SSM state after every node."""

    y: torch.Tensor
    states: torch.Tensor


@triton.heuristics({
    "HAS_D": lambda args: args["D"] is not None,
    "HAS_Z": lambda args: args["z"] is not None,
    "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
})
@triton.jit(do_not_specialize=["N", "dt_min", "dt_max"])
def branch_mamba2_fwd_kernel(
    x,
    dt,
    A,
    Bm,
    Cm,
    parent,
    h0,
    D,
    z,
    dt_bias,
    y,
    states,
    dt_min,
    dt_max,
    N,
    H: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    S: tl.constexpr,
    BP: tl.constexpr,
    BS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
):
    """x, z [B, N, H, P]; dt [B, N, H]; A, D, dt_bias [H]; Bm, Cm [B, N, G, S]; parent [B, N];
    h0 [B, H, P, S] fp32 -> y [B, N, H, P], states [B, N, H, P, S] fp32. Grid: (cdiv(P, BP), B * H); BS >= S."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    i_b64 = i_b.to(tl.int64)

    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < P
    o_s = tl.arange(0, BS)
    m_s = o_s < S
    m_ps = m_p[:, None] & m_s[None, :]
    o_ps = o_p[:, None] * S + o_s[None, :]

    b_a = tl.load(A + i_h).to(tl.float32)
    p_h0 = h0 + (i_b64 * H + i_h) * P * S + o_ps
    b_h = tl.load(p_h0, mask=m_ps, other=0.0)
    for i in range(N):
        o_n = i_b64 * N + i
        i_par = tl.load(parent + o_n).to(tl.int32)
        # The registers hold node i-1's state; any other parent is read back from HBM.
        if i_par != i - 1:
            if i_par < 0:
                b_h = tl.load(p_h0, mask=m_ps, other=0.0)
            else:
                b_h = tl.load(states + ((i_b64 * N + i_par) * H + i_h) * P * S + o_ps, mask=m_ps, other=0.0)
        b_dt = _process_dt(tl.load(dt + o_n * H + i_h), dt_bias, i_h, dt_min, dt_max,
                           HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
        b_x = tl.load(x + (o_n * H + i_h) * P + o_p, mask=m_p, other=0.0).to(tl.float32)
        b_b = tl.load(Bm + (o_n * G + i_g) * S + o_s, mask=m_s, other=0.0).to(tl.float32)
        b_c = tl.load(Cm + (o_n * G + i_g) * S + o_s, mask=m_s, other=0.0).to(tl.float32)

        b_h = b_h * tl.exp(b_dt * b_a) + (b_dt * b_x)[:, None] * b_b[None, :]
        b_y = tl.sum(b_h * b_c[None, :], axis=1)
        if HAS_D:
            b_y += tl.load(D + i_h).to(tl.float32) * b_x
        if HAS_Z:
            b_z = tl.load(z + (o_n * H + i_h) * P + o_p, mask=m_p, other=0.0).to(tl.float32)
            b_y = b_y * b_z * tl.sigmoid(b_z)
        tl.store(y + (o_n * H + i_h) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)
        tl.store(states + (o_n * H + i_h) * P * S + o_ps, b_h, mask=m_ps)
        # A later node of this program may load this state back: make the stores visible to all its threads.
        tl.debug_barrier()


def branch_mamba2_fwd(
    x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus, dt_limit
) -> BranchMamba2Output:
    """Launcher: no validation, no host sync. Allocates [B, N, H, P, S] fp32."""
    bsz, n, h, p = x.shape
    g, s = B.shape[2:]
    x, dt, A, B, C, parent = (t.contiguous() for t in (x, dt, A, B, C, parent))
    h0 = initial_state.float().contiguous()
    y = torch.empty(bsz, n, h, p, dtype=x.dtype, device=x.device)
    states = torch.empty(bsz, n, h, p, s, dtype=torch.float32, device=x.device)
    bs = pow2(s)
    bp = min(pow2(p), max(16, 8192 // bs))
    lo, hi = dt_limit
    branch_mamba2_fwd_kernel[(cdiv(p, bp), bsz * h)](
        x, dt, A, B, C, parent, h0,
        None if D is None else D.contiguous(),
        None if z is None else z.contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
        y, states, float(lo), float(hi), n,
        H=h, G=g, P=p, S=s, BP=bp, BS=bs,
        DT_SOFTPLUS=bool(dt_softplus), HAS_DT_LIMIT=lo > 0.0 or hi != math.inf,
        num_warps=4 if bp * bs <= 4096 else 8,
    )
    return BranchMamba2Output(y=y, states=states)


def triton_branch_mamba2(
    x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None, dt_softplus=True,
    dt_limit=(0.0, math.inf),
) -> BranchMamba2Output:
    """Branch-by-branch tree verification; shapes as `tree_mamba2` (validated the same way)."""
    check_mamba2(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, None)
    return branch_mamba2_fwd(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus, dt_limit)
