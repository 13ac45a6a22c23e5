"""Triton kernels: tree short causal conv (depthwise, width W) and the commit of its window.

What this file does:
    - `tree_causal_conv1d_fwd_kernel`: one program per (channel tile, node tile, batch row). Each node walks
      W - 1 parent pointers up its own ancestor chain; where the chain leaves the tree it continues into the
      committed window `conv_state` (newest entry last), exactly like `tree.ancestors_at_distance`.
    - `commit_causal_conv1d_kernel`: one program per (channel tile, batch row) writes the window after the
      accepted path: the last S entries of [conv_state, x[path]], read once and written once.
    - launchers and the public `triton_tree_causal_conv1d` / `triton_commit_causal_conv1d`, which validate
      like the PyTorch versions.

The conv is memory-bound (W multiply-adds per loaded element), so the kernels only make sure each input
row is read with contiguous channel tiles; the ancestor walk reads a [BN] vector of parent pointers per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tree import cdiv, index_arg, pow2, validate_parent
from .common import check_conv_inputs


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit(do_not_specialize=["N"])
def tree_causal_conv1d_fwd_kernel(
    x,
    weight,
    bias,
    parent,
    conv_state,
    y,
    N,
    C,
    S,
    W: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
    USE_SILU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """x [B, N, C]; weight [C, W]; bias [C] | None; parent [B, N]; conv_state [B, C, S] -> y [B, N, C].
    Grid: (cdiv(C, BC), cdiv(N, BN), B)."""
    i_c, i_n, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b64 = i_b.to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C

    # b_cur >= 0: a tree node; b_cur = -d: the d-th newest committed input (slot S - d of the window).
    b_cur = o_n
    b_y = tl.zeros([BN, BC], dtype=tl.float32)
    for d in tl.static_range(W):
        # weight[:, W - 1] multiplies the newest input, the node itself (d = 0).
        b_w = tl.load(weight + o_c * W + (W - 1 - d), mask=m_c, other=0.0).to(tl.float32)
        m_tree = (b_cur >= 0) & m_n
        m_old = (b_cur < 0) & m_n
        p_x = x + (i_b64 * N + b_cur[:, None]) * C + o_c[None, :]
        b_x = tl.load(p_x, mask=m_tree[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        p_s = conv_state + (i_b64 * C + o_c[None, :]) * S + (S + b_cur[:, None])
        b_s = tl.load(p_s, mask=m_old[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        b_y += (b_x + b_s) * b_w[None, :]
        if d < W - 1:
            b_par = tl.load(parent + i_b64 * N + b_cur, mask=m_tree, other=-1).to(tl.int32)
            b_cur = tl.where(b_cur >= 0, b_par, b_cur - 1)
    if HAS_BIAS:
        b_y += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    if USE_SILU:
        b_y = b_y * tl.sigmoid(b_y)
    p_y = y + (i_b64 * N + o_n[:, None]) * C + o_c[None, :]
    tl.store(p_y, b_y.to(p_y.dtype.element_ty), mask=m_n[:, None] & m_c[None, :])


@triton.jit(do_not_specialize=["N"])
def commit_causal_conv1d_kernel(
    conv_state,
    x,
    parent,
    leaf,
    new_state,
    N,
    C,
    S,
    BC: tl.constexpr,
    BS: tl.constexpr,
):
    """conv_state [B, C, S]; x [B, N, C]; parent [B, N]; leaf [B] -> new_state [B, C, S] = last S entries of
    [conv_state, x[root .. leaf]]. Grid: (cdiv(C, BC), B)."""
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    i_b64 = i_b.to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_s = tl.arange(0, BS)
    m_s = o_s < S

    # Walking up from the leaf, the node d steps up lands in window slot S - 1 - d (when d < S); the walk's
    # length L shifts the surviving committed entries left by L.
    i_cur = tl.load(leaf + i_b).to(tl.int32)
    b_src = tl.full([BS], -1, dtype=tl.int32)
    n_path = i_cur * 0
    while i_cur >= 0:
        b_src = tl.where(o_s == S - 1 - n_path, i_cur, b_src)
        i_cur = tl.load(parent + i_b64 * N + i_cur).to(tl.int32)
        n_path += 1

    m_new = (b_src >= 0) & m_s
    m_old = (b_src < 0) & m_s
    p_old = conv_state + (i_b64 * C + o_c[:, None]) * S + (o_s + n_path)[None, :]
    b_old = tl.load(p_old, mask=m_c[:, None] & m_old[None, :], other=0.0)
    p_new = x + (i_b64 * N + b_src[None, :]) * C + o_c[:, None]
    b_new = tl.load(p_new, mask=m_c[:, None] & m_new[None, :], other=0.0)
    # Committed entries are moved, not recomputed: leaf = -1 copies the row bit for bit.
    b_out = tl.where(m_new[None, :], b_new.to(b_old.dtype), b_old)
    p_out = new_state + (i_b64 * C + o_c[:, None]) * S + o_s[None, :]
    tl.store(p_out, b_out, mask=m_c[:, None] & m_s[None, :])


def tree_causal_conv1d_fwd(x, weight, bias, parent, conv_state, activation) -> torch.Tensor:
    """Launcher: no validation, no host sync. Returns y [B, N, C] in x's dtype."""
    bsz, n, c = x.shape
    width = weight.shape[1]
    x, weight, parent, conv_state = (t.contiguous() for t in (x, weight, parent, conv_state))
    y = torch.empty(bsz, n, c, dtype=x.dtype, device=x.device)
    bn = min(16, pow2(n))
    # [16, 128] tiles: no spills on sm_90 (ptxas), where [16, 256] spilled the W gathered pointer tiles.
    bc = min(128, pow2(c))
    grid = (cdiv(c, bc), cdiv(n, bn), bsz)
    tree_causal_conv1d_fwd_kernel[grid](
        x, weight, None if bias is None else bias.contiguous(), parent, conv_state, y,
        n, c, conv_state.shape[-1],
        W=width, BN=bn, BC=bc, USE_SILU=activation is not None,
    )
    return y


def commit_causal_conv1d_fwd(conv_state, x, parent, leaf) -> torch.Tensor:
    """Launcher for the window commit; returns a new [B, C, S] tensor in conv_state's dtype."""
    bsz, c, s = conv_state.shape
    conv_state, x, parent = (t.contiguous() for t in (conv_state, x, parent))
    new = torch.empty_like(conv_state)
    bc = min(256, pow2(c))
    commit_causal_conv1d_kernel[(cdiv(c, bc), bsz)](
        conv_state, x, parent, index_arg(leaf, x.device), new,
        x.shape[1], c, s, BC=bc, BS=pow2(s),
    )
    return new


def triton_tree_causal_conv1d(x, weight, bias, parent, conv_state, activation="silu") -> torch.Tensor:
    """Same contract as `hf_hybrid_spec.kernels.tree_causal_conv1d`.

    Args:
        x: [B, N, C]; weight: [C, W]; bias: [C] | None; parent: [B, N]; conv_state: [B, C, S], S >= W - 1,
            oldest first; activation: "silu" / "swish" / None.

    Returns:
        [B, N, C] in x's dtype.
    """
    bsz = check_conv_inputs(x, weight, bias, parent, conv_state, activation)[0]
    if parent.shape[0] != bsz:
        raise ValueError(f"parent has batch {parent.shape[0]}, x has {bsz}")
    return tree_causal_conv1d_fwd(x, weight, bias, parent, conv_state, activation)


def triton_commit_causal_conv1d(conv_state, x, parent, leaf) -> torch.Tensor:
    """Same contract as `hf_hybrid_spec.kernels.commit_causal_conv1d`: [B, C, S], a new tensor."""
    if conv_state.ndim != 3 or x.ndim != 3 or x.shape[0] != conv_state.shape[0] or x.shape[2] != conv_state.shape[1]:
        raise ValueError(
            f"conv_state must be [B, C, S] and x [B, N, C], got {tuple(conv_state.shape)} and {tuple(x.shape)}"
        )
    validate_parent(parent, x.shape[1])
    if parent.shape[0] != x.shape[0] or leaf.shape != (x.shape[0],):
        raise ValueError(
            f"parent must be [B, N] and leaf [B] with B={x.shape[0]}, got {tuple(parent.shape)}, {tuple(leaf.shape)}"
        )
    return commit_causal_conv1d_fwd(conv_state, x, parent, leaf)
