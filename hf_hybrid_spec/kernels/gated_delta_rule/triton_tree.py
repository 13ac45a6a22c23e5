"""Triton kernels: closed-form tree gated delta rule (Bole design) and the factorized state commit.

What this file does:
    - `tree_gated_delta_rule_fwd_kernel`: one program per (batch row, value head, V tile) holds the whole
      tree (N <= 128 nodes padded to BT, a power of two >= 16). On chip it builds the ancestor mask from the
      parent pointers, the path cumsum of the gates, the ancestor-masked system (I + A) U = RHS, solves it
      exactly, and reads every node's output off the committed state and the factors U.
    - `commit_gated_delta_rule_kernel`: one program per (batch row, value head, K tile, V tile) reads the
      committed state once, adds the rank-1 terms of the accepted path and writes the new state once.
    - host launchers (`tree_gated_delta_rule_fwd`, `commit_gated_delta_rule_fwd`) that allocate and pick the
      grid, and the public `triton_tree_gated_delta_rule` / `triton_commit_gated_delta_rule`, which validate
      like the PyTorch versions and return the same dataclass.

Math (per value head; see torch_tree.py): with G_i the gate summed over node i's root path and j over the
proper ancestors of i,

    A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j)                       strictly lower-triangular, ancestor-masked
    (I + A) U = beta * (V - exp(G) * (K S0))                           U = the per-node corrections u
    O = scale * (exp(G) * (Q S0) + (D * Q K^T) U)                      D[i, j] = exp(G_i - G_j), j ancestor-or-self

A has a nonzero entry only from a node to a proper ancestor, so any product of more than `depth` factors
vanishes: A^(D+1) = 0 with D the largest number of proper ancestors of a node. The inverse is the finite
Neumann series sum_{k<=D} (-A)^k, which the kernel applies by repeated squaring,
(I - A)(I + A^2)(I + A^4)..., in ceil(log2(D+1)) steps: exact algebra, not an approximation.

Ancestor mask: built on chip by walking parent pointers (all nodes step up together, one load of the parent
row per step, D+1 steps), so the kernel takes the same `parent` tensor as every other backend and nothing
per tree has to be precomputed on the host. The walk costs D+1 dependent L1/L2 loads of a [BT] vector,
small next to the matrix work.

Only o and the factors (u, g_cum, and the fp32 / l2-normalized keys when they differ from the input) are
written to HBM; there is no per-node state anywhere.

Precision: all accumulation is fp32. Products of fp32 operands use TF32x3 (fp32-accurate, on the tensor
cores) when the inputs are fp32 (the tests' contract, rel. err. < 1e-4) and TF32 when the inputs are
bf16/fp16 (their rounding is already coarser than TF32's); products of two raw bf16/fp16 inputs (Q K^T,
K K^T) run in the input dtype with fp32 accumulation, which is exact per product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tree import cdiv, finish_state, index_arg, node_strided, pow2, validate_parent, writable_state
from .common import TreeGatedDeltaOutput, check_shapes


@triton.jit
def _ancestor_mask(p_parent, o_t, m_t):
    """Boolean [BT, BT]: mask[i, j] = node j is on node i's root path (i itself included).

    Every node steps one parent up per iteration; the loop ends when all walks have left the tree, so it runs
    (max depth + 1) times. Padding rows (m_t false) start outside the tree and keep only their diagonal.
    """
    b_cur = tl.load(p_parent + o_t, mask=m_t, other=-1).to(tl.int32)
    b_anc = o_t[:, None] == o_t[None, :]
    while tl.max(b_cur, axis=0) >= 0:
        b_anc = b_anc | (b_cur[:, None] == o_t[None, :])
        b_cur = tl.load(p_parent + b_cur, mask=b_cur >= 0, other=-1).to(tl.int32)
    return b_anc


@triton.jit
def _num_squarings(b_anc, LOG2_BT: tl.constexpr):
    """ceil(log2(D + 1)) for D the largest number of proper ancestors: how many factors (I + (-A)^(2^s)) the
    Neumann product needs so that every power up to A^D is covered."""
    b_depth = tl.max(tl.sum(b_anc.to(tl.int32), axis=1), axis=0) - 1
    n_steps = 0
    for s in tl.static_range(LOG2_BT):
        # Bit length of D: the number of powers of two <= D.
        n_steps += ((b_depth >> s) > 0).to(tl.int32)
    return n_steps


@triton.heuristics({"USE_NUM_NODES": lambda args: args["num_nodes"] is not None})
@triton.jit(do_not_specialize=["N"])
def tree_gated_delta_rule_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    parent,
    h0,
    num_nodes,
    o,
    u,
    k_out,
    g_cum,
    scale,
    N,
    stride_qn,
    stride_kn,
    stride_vn,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    LOG2_BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    STORE_K: tl.constexpr,
    HALF_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_NUM_NODES: tl.constexpr,
):
    """q, k [B, N, H, K]; v [B, N, HV, V] (each read through its node stride, stride_qn / stride_kn / stride_vn
    elements, heads and features contiguous); g, beta [B, N, HV]; parent [B, N]; h0 [B, HV, K, V] fp32;
    num_nodes [B] | None -> o [B, N, HV, V], u [B, N, HV, V] fp32, k_out [B, N, H, K] fp32, g_cum [B, N, HV] fp32.
    Grid: (cdiv(V, BV), B * HV)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_b64 = i_b.to(tl.int64)

    o_t = tl.arange(0, BT)
    m_t = o_t < N
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    # Per-node scalars of this head; token t of head hv sits at ((b * N + t) * HV + hv).
    o_th = (i_b64 * N + o_t) * HV + i_hv
    # q, k, v may be views into one [B, N, C] projection (node stride C): heads and features are contiguous.
    p_q = q + (i_b64 * N + o_t[:, None]) * stride_qn + i_h * K
    p_k = k + (i_b64 * N + o_t[:, None]) * stride_kn + i_h * K
    p_h0 = h0 + (i_b64 * HV + i_hv) * K * V + o_v[None, :]

    # Phase 1: K K^T, K S0 and Q S0 in one pass over K, so the committed state is read once.
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_ks = tl.zeros([BT, BV], dtype=tl.float32)
    b_qs = tl.zeros([BT, BV], dtype=tl.float32)
    b_ssq_k = tl.zeros([BT], dtype=tl.float32)
    b_ssq_q = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(p_q + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(p_k + o_k[None, :], mask=m_tk, other=0.0)
        b_h = tl.load(p_h0 + o_k[:, None] * V, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_qf = b_q.to(tl.float32)
        b_kf = b_k.to(tl.float32)
        if HALF_DOT:
            b_kk += tl.dot(b_k, tl.trans(b_k))
        else:
            b_kk += tl.dot(b_kf, tl.trans(b_kf), input_precision=DOT_PRECISION)
        b_ks += tl.dot(b_kf, b_h, input_precision=DOT_PRECISION)
        b_qs += tl.dot(b_qf, b_h, input_precision=DOT_PRECISION)
        if USE_QK_L2NORM:
            b_ssq_k += tl.sum(b_kf * b_kf, axis=1)
            b_ssq_q += tl.sum(b_qf * b_qf, axis=1)
    if USE_QK_L2NORM:
        # Normalizing rows of Q and K scales rows / columns of every product above.
        b_rk = tl.rsqrt(b_ssq_k + 1e-6)
        b_rq = tl.rsqrt(b_ssq_q + 1e-6)
        b_kk = b_kk * b_rk[:, None] * b_rk[None, :]
        b_ks = b_ks * b_rk[:, None]
        b_qs = b_qs * b_rq[:, None]

    # The tree enters only now, so the ancestor mask is not live during the K loop.
    b_anc = _ancestor_mask(parent + i_b64 * N, o_t, m_t)
    n_steps = _num_squarings(b_anc, LOG2_BT)
    b_g = tl.load(g + o_th, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + o_th, mask=m_t, other=0.0).to(tl.float32)
    # Path cumsum along parent pointers: G = ancestor-mask @ g.
    b_G = tl.sum(tl.where(b_anc, b_g[None, :], 0.0), axis=1)
    # P = -A with A strictly below the diagonal (proper ancestors only). Mask before exp: off-path
    # differences can be positive and overflow.
    m_strict = b_anc & (o_t[:, None] != o_t[None, :])
    b_P = -b_beta[:, None] * tl.exp(tl.where(m_strict, b_G[:, None] - b_G[None, :], float("-inf"))) * b_kk

    p_v = v + (i_b64 * N + o_t[:, None]) * stride_vn + i_hv * V + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_v = tl.load(p_v, mask=m_tv, other=0.0).to(tl.float32)
    b_expG = tl.exp(b_G)
    b_U = b_beta[:, None] * (b_v - b_expG[:, None] * b_ks)

    # U <- (I + P)(I + P^2)(I + P^4)... RHS = sum_{k < 2^n_steps} (-A)^k RHS = (I + A)^{-1} RHS, exactly,
    # since A^(D+1) = 0 and 2^n_steps >= D + 1. With no ancestors at all, P = 0 and this is a no-op.
    b_U += tl.dot(b_P, b_U, input_precision=DOT_PRECISION)
    for _ in range(1, n_steps):
        b_P = tl.dot(b_P, b_P, input_precision=DOT_PRECISION)
        b_U += tl.dot(b_P, b_U, input_precision=DOT_PRECISION)

    # Phase 2: Q K^T after the solve, so two [BT, BT] score matrices are never live together.
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(p_q + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(p_k + o_k[None, :], mask=m_tk, other=0.0)
        b_kf = b_k.to(tl.float32)
        if HALF_DOT:
            b_qk += tl.dot(b_q, tl.trans(b_k))
        else:
            b_qk += tl.dot(b_q.to(tl.float32), tl.trans(b_kf), input_precision=DOT_PRECISION)
        # A compile-time flag around a run-time test: Triton cannot fold the two into one `if`.
        if STORE_K:  # noqa: SIM102
            # One program per key head writes the keys as the recurrence used them.
            if (i_v == 0) & (i_hv % (HV // H) == 0):
                if USE_QK_L2NORM:
                    b_kf = b_kf * b_rk[:, None]
                p_ko = k_out + ((i_b64 * N + o_t[:, None]) * H + i_h) * K + o_k[None, :]
                tl.store(p_ko, b_kf, mask=m_tk)
    if USE_QK_L2NORM:
        b_qk = b_qk * b_rq[:, None] * b_rk[None, :]
    # Walk the parents again (D+1 cheap steps) rather than keep a [BT, BT] decay matrix live through the solve.
    b_anc = _ancestor_mask(parent + i_b64 * N, o_t, m_t)
    b_qk = b_qk * tl.exp(tl.where(b_anc, b_G[:, None] - b_G[None, :], float("-inf")))
    b_o = b_expG[:, None] * b_qs + tl.dot(b_qk, b_U, input_precision=DOT_PRECISION)
    b_o = b_o * scale
    if USE_NUM_NODES:
        # Padding nodes output exactly zero; their factors are computed like any other root child.
        b_o = tl.where((o_t < tl.load(num_nodes + i_b))[:, None], b_o, 0.0)

    p_o = o + ((i_b64 * N + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_tv)
    p_u = u + ((i_b64 * N + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
    tl.store(p_u, b_U, mask=m_tv)
    if i_v == 0:
        tl.store(g_cum + o_th, b_G, mask=m_t)


@triton.jit(do_not_specialize=["N"])
def commit_gated_delta_rule_kernel(
    h0,
    k,
    u,
    g_cum,
    parent,
    leaf,
    h_out,
    N,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """h0 [B, HV, K, V] fp32; k [B, N, H, K], u [B, N, HV, V], g_cum [B, N, HV] fp32 factors; parent [B, N];
    leaf [B] -> h_out [B, HV, K, V] fp32 = exp(G_leaf) h0 + sum_{j on path} exp(G_leaf - G_j) k_j u_j^T.
    Grid: (cdiv(K, BK) * cdiv(V, BV), B * HV)."""
    i_kv, i_bh = tl.program_id(0), tl.program_id(1)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_b64 = i_b.to(tl.int64)

    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    o_h = (i_b64 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    # Issue the one read of the state before the pointer chase below.
    b_h = tl.load(h0 + o_h, mask=m_kv, other=0.0)

    i_leaf = tl.load(leaf + i_b).to(tl.int32)
    b_gl = tl.load(g_cum + (i_b64 * N + i_leaf) * HV + i_hv, mask=i_leaf >= 0, other=0.0)
    # leaf = -1 multiplies by exactly 1.0 and adds nothing: the row is copied bit for bit.
    b_h = tl.where(i_leaf >= 0, b_h * tl.exp(b_gl), b_h)
    i_cur = i_leaf
    # Walk leaf -> root; the order of the rank-1 terms does not matter (they are summed).
    while i_cur >= 0:
        o_n = i_b64 * N + i_cur
        b_gj = tl.load(g_cum + o_n * HV + i_hv)
        b_kj = tl.load(k + (o_n * H + i_h) * K + o_k, mask=o_k < K, other=0.0)
        b_uj = tl.load(u + (o_n * HV + i_hv) * V + o_v, mask=o_v < V, other=0.0)
        b_h += (tl.exp(b_gl - b_gj) * b_kj)[:, None] * b_uj[None, :]
        i_cur = tl.load(parent + o_n).to(tl.int32)
    tl.store(h_out + o_h, b_h, mask=m_kv)


def _dot_precision(dtype: torch.dtype) -> str:
    # Triton's "ieee" fp32 dot runs on FMA units and holds whole operand rows in registers: at BT = 64 it
    # spills kilobytes per thread. "tf32x3" (three TF32 tensor-core products, hi*hi + hi*lo + lo*hi) keeps
    # fp32 accuracy on the tensor cores. 16-bit inputs are already coarser than TF32.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def tree_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parent: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    num_nodes: torch.Tensor | None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> TreeGatedDeltaOutput:
    """Launcher: no validation and no host sync (the public function validates). Shapes as the public op.

    block_v / num_warps override the V tile and warps per program (None: the defaults below); for tuning
    sweeps on a GPU, e.g. from benchmarks/tree_kernels.py.
    """
    bsz, n, h, kdim = q.shape
    hv, vdim = v.shape[2:]
    if n > 128:
        raise ValueError(f"the tree kernel holds the whole tree in one program: N <= 128, got {n}")
    store_k = use_qk_l2norm or k.dtype != torch.float32
    # q, k and v are read through a node stride, so the views a mixer splits out of its projection go in as they are
    # (no copy: that was 3 launches per layer). k is copied when it is returned as the factor the commit reads.
    q, v = node_strided(q), node_strided(v)
    k = node_strided(k) if store_k else k.contiguous()
    g, beta, parent = (t.contiguous() for t in (g, beta, parent))
    h0 = initial_state.float().contiguous()
    # At least 16 on every dot dimension: the tensor-core minimum on NVIDIA GPUs.
    bt = max(16, pow2(n))
    # Sizes chosen from ptxas' reports for sm_90 (no spills up to BT = 64 in bf16; about 1 KB per thread at
    # BT = 128): K chunks of 32, and narrower V tiles at BT = 128 to make room for the [BT, BT] matrices.
    bk = min(32, max(16, pow2(kdim)))
    # V tiles of at least 32, as the Mamba-2 launcher's P tiles: with fp32 inputs (TF32x3 dots) at BT = 64 a 16-wide
    # tile faulted with an illegal address on the H200 under Triton 3.6 (B1-N64-HV2-K32-V16 in fp32, the
    # first run of tests/kernels/test_kernels.py compiled on a GPU); real layers (V = 128) never had 16-wide tiles.
    bv = block_v or min(64 if bt <= 64 else 32, max(32, pow2(vdim)))
    o = torch.empty(bsz, n, hv, vdim, dtype=q.dtype, device=q.device)
    u = torch.empty(bsz, n, hv, vdim, dtype=torch.float32, device=q.device)
    g_cum = torch.empty(bsz, n, hv, dtype=torch.float32, device=q.device)
    k_out = torch.empty(bsz, n, h, kdim, dtype=torch.float32, device=q.device) if store_k else k
    grid = (cdiv(vdim, bv), bsz * hv)
    tree_gated_delta_rule_fwd_kernel[grid](
        q, k, v, g, beta, parent, h0,
        None if num_nodes is None else index_arg(num_nodes, q.device),
        o, u, k_out, g_cum,
        scale,
        n,
        q.stride(1), k.stride(1), v.stride(1),
        H=h, HV=hv, K=kdim, V=vdim,
        BT=bt, LOG2_BT=bt.bit_length() - 1, BK=bk, BV=bv,
        USE_QK_L2NORM=use_qk_l2norm,
        STORE_K=store_k,
        # The interpreter has no 16-bit matmul; there the raw products go through fp32 (same values, exact).
        HALF_DOT=q.is_cuda and q.dtype in (torch.float16, torch.bfloat16),
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps or (4 if bt <= 16 else 8),
    )
    return TreeGatedDeltaOutput(o=o, u=u, k=k_out, g_cum=g_cum)


def commit_gated_delta_rule_fwd(
    initial_state: torch.Tensor, out: TreeGatedDeltaOutput, parent: torch.Tensor, leaf: torch.Tensor,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launcher for the commit; returns a new [B, HV, K, V] fp32 tensor, or `into` written (in place when it is the
    fp32 contiguous initial state: each program reads its tile before it writes it)."""
    bsz, hv, kdim, vdim = initial_state.shape
    n, h = out.k.shape[1:3]
    h0 = initial_state.float().contiguous()
    new = writable_state(into, h0)
    bk = min(64, pow2(kdim))
    bv = min(64, pow2(vdim))
    grid = (cdiv(kdim, bk) * cdiv(vdim, bv), bsz * hv)
    commit_gated_delta_rule_kernel[grid](
        h0, out.k.contiguous(), out.u.contiguous(), out.g_cum.contiguous(), parent.contiguous(),
        index_arg(leaf, h0.device), new,
        n, H=h, HV=hv, K=kdim, V=vdim, BK=bk, BV=bv,
    )
    return finish_state(into, new)


def triton_tree_gated_delta_rule(
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
    """Same contract as `hf_hybrid_spec.kernels.tree_gated_delta_rule`.

    Args:
        q, k: [B, N, H, K]; v: [B, N, HV, V], HV a multiple of H; g, beta: [B, N, HV]; parent: [B, N] int,
            N <= 128; initial_state: [B, HV, K, V] (read only); scale: K**-0.5 when None;
            num_nodes: [B] | None, nodes >= num_nodes[b] output exactly 0.

    Returns:
        TreeGatedDeltaOutput(o [B, N, HV, V] q.dtype, u [B, N, HV, V] fp32, k [B, N, H, K] fp32,
        g_cum [B, N, HV] fp32).
    """
    bsz, _, _, _, kdim, _ = check_shapes(q, k, v, g, beta, parent, initial_state)
    if num_nodes is not None and num_nodes.shape != (bsz,):
        raise ValueError(f"num_nodes must be [B] = ({bsz},), got {tuple(num_nodes.shape)}")
    tensors = (q, k, v, g, beta, parent, initial_state)
    if any(t.device != q.device for t in tensors):
        raise ValueError("all inputs must be on the same device")
    return tree_gated_delta_rule_fwd(
        q, k, v, g, beta, parent, initial_state,
        kdim**-0.5 if scale is None else float(scale), use_qk_l2norm, num_nodes,
    )


def triton_commit_gated_delta_rule(
    initial_state: torch.Tensor, out: TreeGatedDeltaOutput, parent: torch.Tensor, leaf: torch.Tensor,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `hf_hybrid_spec.kernels.commit_gated_delta_rule`: [B, HV, K, V] fp32, a new tensor or
    `into` written."""
    bsz, hv, kdim, vdim = initial_state.shape
    n = out.u.shape[1]
    if out.u.shape != (bsz, n, hv, vdim) or out.k.shape[::3] != (bsz, kdim) or out.g_cum.shape != (bsz, n, hv):
        raise ValueError(
            f"factors do not match initial_state {tuple(initial_state.shape)}: "
            f"u {tuple(out.u.shape)}, k {tuple(out.k.shape)}, g_cum {tuple(out.g_cum.shape)}"
        )
    validate_parent(parent, n)
    if leaf.shape != (bsz,):
        raise ValueError(f"leaf must be [B] = ({bsz},), got {tuple(leaf.shape)}")
    return commit_gated_delta_rule_fwd(initial_state, out, parent, leaf, into)
