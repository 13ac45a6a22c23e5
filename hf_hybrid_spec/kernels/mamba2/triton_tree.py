"""Triton kernels: closed-form tree Mamba-2 (SSD with a scalar decay per head) and the factorized commit.

What this file does:
    - `tree_mamba2_fwd_kernel`: one program per (batch row, head, P tile) holds the whole tree (N <= 128,
      padded to BT). On chip: the ancestor mask from the parent pointers (shared helper with the gated delta
      rule), dt processing (bias, softplus, limits), the path cumsum L = ancestor-mask @ (dt * A), and

          y_i = exp(L_i) (h0 C_i) + sum_{j ancestor-or-self of i} exp(L_i - L_j) (C_i . B_j) dt_j x_j
                (+ D x_i, then * silu(z_i))

      There is no system to solve: unlike the delta rule, an SSD step does not read the state it writes to.
    - `commit_mamba2_kernel`: one program per (batch row, head, P tile, S tile) reads h0 once and writes
      h* = exp(L_leaf) h0 + sum_{j on path} exp(L_leaf - L_j) dt_j x_j B_j^T once.
    - launchers and the public `triton_tree_mamba2` / `triton_commit_mamba2`, validating like the PyTorch
      versions (`common.prepare_mamba2`'s checks) and returning `TreeMamba2Output`.

Only y and the factors (dt, a_cum, and fp32 copies of x and B when the inputs are not fp32) reach HBM. Dot
precision follows the gated delta rule kernel: TF32x3 (fp32-accurate) for fp32 inputs, TF32 (fp32 operands)
and the input dtype (raw C B^T) for bf16/fp16 inputs, fp32 accumulation always.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..gated_delta_rule.triton_tree import _ancestor_mask
from ..tree import cdiv, finish_state, index_arg, node_strided, pow2, validate_parent, writable_state
from .common import TreeMamba2Output, check_mamba2


@triton.jit
def _softplus(x):
    """softplus(x) = log1p(exp(x)), and x above 20 (torch's threshold).

    log(1 + e) alone loses all digits when e is tiny; log(w) * e / (w - 1) with w = 1 + e rounded is exact
    to an ulp (Goldberg), and w == 1 means log1p(e) = e to working precision."""
    e = tl.exp(x)
    w = 1.0 + e
    lp = tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _process_dt(b_dt, dt_bias, i_h, dt_min, dt_max, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                HAS_DT_LIMIT: tl.constexpr):
    """Raw dt (input dtype) -> clamp(softplus(dt + dt_bias), dt_min, dt_max) in fp32, rounded to the input
    dtype after each step the way `common.process_dt` (and transformers) compute it in that dtype."""
    dtype = b_dt.dtype
    if HAS_DT_BIAS:
        b_dt = (b_dt.to(tl.float32) + tl.load(dt_bias + i_h).to(dtype).to(tl.float32)).to(dtype)
    b_dt = b_dt.to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = _softplus(b_dt).to(dtype).to(tl.float32)
    if HAS_DT_LIMIT:
        b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max).to(dtype).to(tl.float32)
    return b_dt


@triton.heuristics({
    "HAS_D": lambda args: args["D"] is not None,
    "HAS_Z": lambda args: args["z"] is not None,
    "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
    "USE_NUM_NODES": lambda args: args["num_nodes"] is not None,
})
@triton.jit(do_not_specialize=["N", "dt_min", "dt_max"])
def tree_mamba2_fwd_kernel(
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
    num_nodes,
    y,
    x_out,
    b_out,
    dt_out,
    a_cum,
    dt_min,
    dt_max,
    N,
    stride_xn,
    stride_dtn,
    stride_bn,
    stride_cn,
    H: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    S: tl.constexpr,
    BT: tl.constexpr,
    BP: tl.constexpr,
    BS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr,
    STORE_X: tl.constexpr,
    STORE_B: tl.constexpr,
    HALF_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_NUM_NODES: tl.constexpr,
):
    """x, z [B, N, H, P]; dt [B, N, H]; A, D, dt_bias [H]; Bm, Cm [B, N, G, S]; parent [B, N];
    h0 [B, H, P, S] fp32; num_nodes [B] | None -> y [B, N, H, P], x_out [B, N, H, P] fp32,
    b_out [B, N, G, S] fp32, dt_out, a_cum [B, N, H] fp32. Grid: (cdiv(P, BP), B * H).
    x, dt, Bm and Cm are read through their node strides (stride_xn, ...; the rest contiguous), so a mixer's split
    views of one projection go in without copies; z and the outputs are contiguous."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    i_b64 = i_b.to(tl.int64)

    o_t = tl.arange(0, BT)
    m_t = o_t < N
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < P

    # One pass over the state size: C B^T and C h0^T, so h0 is read once.
    b_cb = tl.zeros([BT, BT], dtype=tl.float32)
    b_ch = tl.zeros([BT, BP], dtype=tl.float32)
    p_bc = (i_b64 * N + o_t[:, None]) * G * S + i_g * S  # b_out
    p_b = Bm + (i_b64 * N + o_t[:, None]) * stride_bn + i_g * S
    p_c = Cm + (i_b64 * N + o_t[:, None]) * stride_cn + i_g * S
    p_h0 = h0 + (i_b64 * H + i_h) * P * S + o_p[:, None] * S
    for i_s in range(tl.cdiv(S, BS)):
        o_s = i_s * BS + tl.arange(0, BS)
        m_s = o_s < S
        m_ts = m_t[:, None] & m_s[None, :]
        b_b = tl.load(p_b + o_s[None, :], mask=m_ts, other=0.0)
        b_c = tl.load(p_c + o_s[None, :], mask=m_ts, other=0.0)
        b_h = tl.load(p_h0 + o_s[None, :], mask=m_p[:, None] & m_s[None, :], other=0.0)
        b_bf = b_b.to(tl.float32)
        b_cf = b_c.to(tl.float32)
        if HALF_DOT:
            b_cb += tl.dot(b_c, tl.trans(b_b))
        else:
            b_cb += tl.dot(b_cf, tl.trans(b_bf), input_precision=DOT_PRECISION)
        b_ch += tl.dot(b_cf, tl.trans(b_h), input_precision=DOT_PRECISION)
        # A compile-time flag around a run-time test: Triton cannot fold the two into one `if`.
        if STORE_B:  # noqa: SIM102
            # One program per group writes the fp32 copy of B.
            if (i_p == 0) & (i_h % (H // G) == 0):
                tl.store(b_out + p_bc + o_s[None, :], b_bf, mask=m_ts)

    # The tree enters only now, so the ancestor mask is not live during the loop over S.
    b_anc = _ancestor_mask(parent + i_b64 * N, o_t, m_t)
    o_th = (i_b64 * N + o_t) * H + i_h
    b_dt = _process_dt(tl.load(dt + (i_b64 * N + o_t) * stride_dtn + i_h, mask=m_t, other=0.0), dt_bias, i_h,
                       dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS, HAS_DT_LIMIT)
    # Rows past N get dt = 0 (softplus of the 0 they loaded is not 0); nothing descends from them anyway.
    b_dt = tl.where(m_t, b_dt, 0.0)
    # Path cumsum along parent pointers: L = ancestor-mask @ (dt * A).
    b_L = tl.sum(tl.where(b_anc, (b_dt * tl.load(A + i_h).to(tl.float32))[None, :], 0.0), axis=1)
    # Weight of x_j in y_i. Mask before exp: off-path differences can be positive and overflow.
    b_m = tl.exp(tl.where(b_anc, b_L[:, None] - b_L[None, :], float("-inf"))) * b_cb * b_dt[None, :]

    o_tp = (i_b64 * N + o_t[:, None]) * H * P + i_h * P + o_p[None, :]
    m_tp = m_t[:, None] & m_p[None, :]
    b_x = tl.load(x + (i_b64 * N + o_t[:, None]) * stride_xn + i_h * P + o_p[None, :], mask=m_tp,
                  other=0.0).to(tl.float32)
    b_y = tl.exp(b_L)[:, None] * b_ch
    b_y += tl.dot(b_m, b_x, input_precision=DOT_PRECISION)
    if HAS_D:
        b_y += tl.load(D + i_h).to(tl.float32) * b_x
    if HAS_Z:
        b_z = tl.load(z + o_tp, mask=m_tp, other=0.0).to(tl.float32)
        b_y = b_y * b_z * tl.sigmoid(b_z)
    if USE_NUM_NODES:
        # Padding nodes output exactly zero; their factors are computed like any other root child.
        b_y = tl.where((o_t < tl.load(num_nodes + i_b))[:, None], b_y, 0.0)

    tl.store(y + o_tp, b_y.to(y.dtype.element_ty), mask=m_tp)
    if STORE_X:
        tl.store(x_out + o_tp, b_x, mask=m_tp)
    if i_p == 0:
        tl.store(dt_out + o_th, b_dt, mask=m_t)
        tl.store(a_cum + o_th, b_L, mask=m_t)


@triton.jit(do_not_specialize=["N"])
def commit_mamba2_kernel(
    h0,
    x,
    b,
    dt,
    a_cum,
    parent,
    leaf,
    h_out,
    N,
    H: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    S: tl.constexpr,
    BP: tl.constexpr,
    BS: tl.constexpr,
):
    """h0 [B, H, P, S] fp32; factors x [B, N, H, P], b [B, N, G, S], dt, a_cum [B, N, H] fp32; parent [B, N];
    leaf [B] -> h_out [B, H, P, S] fp32. Grid: (cdiv(P, BP) * cdiv(S, BS), B * H)."""
    i_ps, i_bh = tl.program_id(0), tl.program_id(1)
    i_p, i_s = i_ps // tl.cdiv(S, BS), i_ps % tl.cdiv(S, BS)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    i_b64 = i_b.to(tl.int64)

    o_p = i_p * BP + tl.arange(0, BP)
    o_s = i_s * BS + tl.arange(0, BS)
    m_ps = (o_p < P)[:, None] & (o_s < S)[None, :]
    o_h = (i_b64 * H + i_h) * P * S + o_p[:, None] * S + o_s[None, :]
    # Issue the one read of the state before the pointer chase below.
    b_h = tl.load(h0 + o_h, mask=m_ps, other=0.0)

    i_leaf = tl.load(leaf + i_b).to(tl.int32)
    b_al = tl.load(a_cum + (i_b64 * N + i_leaf) * H + i_h, mask=i_leaf >= 0, other=0.0)
    # leaf = -1 keeps the loaded values untouched: the row is copied bit for bit.
    b_h = tl.where(i_leaf >= 0, b_h * tl.exp(b_al), b_h)
    i_cur = i_leaf
    while i_cur >= 0:
        o_n = i_b64 * N + i_cur
        b_w = tl.exp(b_al - tl.load(a_cum + o_n * H + i_h)) * tl.load(dt + o_n * H + i_h)
        b_xj = tl.load(x + (o_n * H + i_h) * P + o_p, mask=o_p < P, other=0.0)
        b_bj = tl.load(b + (o_n * G + i_g) * S + o_s, mask=o_s < S, other=0.0)
        b_h += (b_w * b_xj)[:, None] * b_bj[None, :]
        i_cur = tl.load(parent + o_n).to(tl.int32)
    tl.store(h_out + o_h, b_h, mask=m_ps)


def tree_mamba2_fwd(
    x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus, dt_limit, num_nodes,
    block_p: int | None = None, num_warps: int | None = None,
):
    """Launcher: no validation and no host sync (the public function validates). Shapes as the public op.

    block_p / num_warps override the P tile and warps per program (None: the defaults below), for tuning sweeps.
    """
    bsz, n, h, p = x.shape
    g, s = B.shape[2:]
    if n > 128:
        raise ValueError(f"the tree kernel holds the whole tree in one program: N <= 128, got {n}")
    store_x, store_b = x.dtype != torch.float32, B.dtype != torch.float32
    # x, dt, B and C are read through a node stride: the views the mixer splits out of its projection and conv output
    # go in as they are (4 copy launches per layer before). x and B are copied when they are returned as the
    # factors the commit reads (fp32 inputs: no fp32 copy is stored).
    x = node_strided(x) if store_x else x.contiguous()
    B = node_strided(B) if store_b else B.contiguous()
    dt, C = node_strided(dt), node_strided(C)
    A, parent = A.contiguous(), parent.contiguous()
    h0 = initial_state.float().contiguous()
    bt = max(16, pow2(n))
    # Sizes chosen from ptxas' reports for sm_90: no spills up to BT = 64 with S chunks of 32; narrower P tiles
    # at BT = 128 to make room for the [BT, BT] matrices.
    # P tiles of at least 32: with fp32 inputs (TF32x3 dots) and 16-wide P tiles at BT = 64, Triton 3.6 on the H200
    # builds a kernel that faults with an illegal address (a tiny Falcon-H1 with head dim 16); 32 wide runs clean.
    bp = block_p or min(64 if bt <= 64 else 32, max(32, pow2(p)))
    bs = min(32, max(16, pow2(s)))
    dev = x.device
    y = torch.empty(bsz, n, h, p, dtype=x.dtype, device=dev)
    dt_out = torch.empty(bsz, n, h, dtype=torch.float32, device=dev)
    a_cum = torch.empty(bsz, n, h, dtype=torch.float32, device=dev)
    x_out = torch.empty(bsz, n, h, p, dtype=torch.float32, device=dev) if store_x else x
    b_out = torch.empty(bsz, n, g, s, dtype=torch.float32, device=dev) if store_b else B
    lo, hi = dt_limit
    grid = (cdiv(p, bp), bsz * h)
    tree_mamba2_fwd_kernel[grid](
        x, dt, A, B, C, parent, h0,
        None if D is None else D.contiguous(),
        None if z is None else z.contiguous(),
        None if dt_bias is None else dt_bias.contiguous(),
        None if num_nodes is None else index_arg(num_nodes, dev),
        y, x_out, b_out, dt_out, a_cum,
        float(lo), float(hi), n,
        x.stride(1), dt.stride(1), B.stride(1), C.stride(1),
        H=h, G=g, P=p, S=s, BT=bt, BP=bp, BS=bs,
        DT_SOFTPLUS=bool(dt_softplus),
        # Same condition as common.process_dt: the default (0, inf) is no clamp at all.
        HAS_DT_LIMIT=lo > 0.0 or hi != math.inf,
        STORE_X=store_x,
        STORE_B=store_b,
        # The interpreter has no 16-bit matmul; there the raw products go through fp32 (same values, exact).
        HALF_DOT=x.is_cuda and C.dtype in (torch.float16, torch.bfloat16),
        # As in the gated delta rule: fp32-accurate TF32x3 for fp32 inputs (Triton's "ieee" dot spills), TF32 else.
        DOT_PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps or (4 if bt <= 16 else 8),
    )
    return TreeMamba2Output(y=y, x=x_out, b=b_out, dt=dt_out, a_cum=a_cum)


def commit_mamba2_fwd(initial_state, out: TreeMamba2Output, parent, leaf, into=None) -> torch.Tensor:
    """Launcher for the commit; returns a new [B, H, P, S] fp32 tensor, or `into` written (in place when it is the
    fp32 contiguous initial state: each program reads its tile before it writes it)."""
    bsz, h, p, s = initial_state.shape
    n, g = out.b.shape[1:3]
    h0 = initial_state.float().contiguous()
    new = writable_state(into, h0)
    bp = min(64, pow2(p))
    bs = min(64, pow2(s))
    grid = (cdiv(p, bp) * cdiv(s, bs), bsz * h)
    commit_mamba2_kernel[grid](
        h0, out.x.contiguous(), out.b.contiguous(), out.dt.contiguous(), out.a_cum.contiguous(),
        parent.contiguous(), index_arg(leaf, h0.device), new,
        n, H=h, G=g, P=p, S=s, BP=bp, BS=bs,
    )
    return finish_state(into, new)


def triton_tree_mamba2(
    x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None, dt_softplus=True,
    dt_limit=(0.0, math.inf), num_nodes=None,
) -> TreeMamba2Output:
    """Same contract as `hf_hybrid_spec.kernels.tree_mamba2`.

    Args:
        x: [B, N, H, P]; dt: [B, N, H] raw; A: [H]; B, C: [B, N, G, S]; parent: [B, N], N <= 128;
            initial_state: [B, H, P, S] (read only); D: [H] | None; z: [B, N, H, P] | None; dt_bias: [H] | None;
            dt = clamp(softplus(dt + dt_bias), *dt_limit); num_nodes: [B] | None.

    Returns:
        TreeMamba2Output(y [B, N, H, P] x.dtype, x, b, dt, a_cum fp32 factors).
    """
    check_mamba2(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, num_nodes)
    return tree_mamba2_fwd(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus, dt_limit, num_nodes)


def triton_commit_mamba2(initial_state, out: TreeMamba2Output, parent, leaf, into=None) -> torch.Tensor:
    """Same contract as `hf_hybrid_spec.kernels.commit_mamba2`: [B, H, P, S] fp32, a new tensor or `into` written."""
    bsz, h, p, s = initial_state.shape
    n = out.x.shape[1]
    if out.x.shape != (bsz, n, h, p) or out.b.shape[::3] != (bsz, s) or out.dt.shape != (bsz, n, h):
        raise ValueError(
            f"factors do not match initial_state {tuple(initial_state.shape)}: "
            f"x {tuple(out.x.shape)}, b {tuple(out.b.shape)}, dt {tuple(out.dt.shape)}"
        )
    validate_parent(parent, n)
    if leaf.shape != (bsz,):
        raise ValueError(f"leaf must be [B] = ({bsz},), got {tuple(leaf.shape)}")
    return commit_mamba2_fwd(initial_state, out, parent, leaf, into)
