"""Tree attention on the GPU: N tree nodes (a few to 64) attend over a static KV cache of L slots through an
additive mask [N, L] (committed prefix + each node's ancestors), grouped-query heads.

Why our own: the verify forward's attention went through SDPA with a 4D mask, which copies K and V to every query
head first (GQA with a mask is not taken by the fused kernels) and then runs one program per (head, 64 queries):
for N = 8 nodes over ~600 slots a handful of programs walk all keys. Here one program serves a block of rows (the
G query heads of one KV head x the nodes, so K and V are read once per KV head) over one split of the keys, many
splits in parallel, and a second kernel combines the splits' partial softmax sums.

Masked keys carry the mask's large negative value (dtype min), never -inf, so a split whose keys are all masked
for a row yields finite garbage with a running max near that value, and its weight exp(m_split - m_max) in the
combine is exactly 0; every row has at least one visible key (its own node).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tree import cdiv, pow2

__all__ = ["triton_tree_attention"]




@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, m_ptr, l_ptr,
                  sq_b, sq_h, sq_n, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_n,
                  N, L, G, HKV, D, scale, L_PER_SPLIT, S,
                  BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # row = g * N + node
    r_ok = rows < G * N
    g = rows // N
    node = rows % N
    h = hk * G + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + node[:, None] * sq_n + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_R,), -3.4e38, tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    start = pid_s * L_PER_SPLIT
    end = tl.minimum(start + L_PER_SPLIT, L)
    for l0 in range(start, end, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        l_ok = offs_l < end
        kv_ok = l_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + b * sk_b + hk * sk_h + offs_l[:, None] * sk_l + offs_d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        bias = tl.load(mask_ptr + b * sm_b + node[:, None] * sm_n + offs_l[None, :],
                       mask=r_ok[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
        s = tl.where(l_ok[None, :], s * scale + bias, -3.0e38)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * sv_b + hk * sv_h + offs_l[:, None] * sv_l + offs_d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # Partials laid out [B, Hq, N, S] (+ [D] for o): row (b, h, node), split pid_s.
    part = ((b * HKV * G + h) * N + node) * S + pid_s
    tl.store(m_ptr + part, m_i, mask=r_ok)
    tl.store(l_ptr + part, l_i, mask=r_ok)
    tl.store(o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=r_ok[:, None])


@triton.jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, so_b, so_n, so_h, N, HQ, D, S,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # (b * HQ + h) * N + node
    node = row % N
    h = (row // N) % HQ
    b = row // (N * HQ)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < S
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + row * S + offs_s, mask=s_ok, other=-3.4e38)
    m_max = tl.max(m, 0)
    w = tl.where(s_ok, tl.exp(m - m_max), 0.0)
    l = tl.load(l_ptr + row * S + offs_s, mask=s_ok, other=0.0)
    o = tl.load(o_ptr + (row * S + offs_s[:, None]) * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w * l, 0)
    tl.store(out_ptr + b * so_b + node * so_n + h * so_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


def _splits(programs: int, blocks: int, target: int = 128) -> int:
    return max(1, min(blocks, cdiv(target, programs)))


def triton_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """As `torch_tree_attention`: q [B, Hq, N, D], k / v [B, Hkv, L, D], mask [B or 1, 1, N, L] additive (finite
    large negative values for masked keys); returns [B, N, Hq, D] in q's dtype. Last dims must be contiguous."""
    bsz, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if hq % hkv or v.shape[:3] != k.shape[:3] or v.shape[-1] != d or k.shape[-1] != d:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if mask.shape[-2:] != (n, length) or mask.shape[0] not in (1, bsz):
        raise ValueError(f"mask {tuple(mask.shape)} must be [B or 1, 1, {n}, {length}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    group = hq // hkv
    block_d = pow2(d)
    block_r = max(16, min(pow2(group * n), 32 if block_d > 128 else 64))
    block_l = 32 if block_d > 128 else 64
    row_blocks = cdiv(group * n, block_r)
    splits = _splits(bsz * hkv * row_blocks, cdiv(length, block_l))
    per_split = cdiv(cdiv(length, splits), block_l) * block_l
    splits = cdiv(length, per_split)
    o = torch.empty(bsz, hq, n, splits, block_d, device=q.device, dtype=torch.float32)
    m = torch.empty(bsz, hq, n, splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _split_kernel[(bsz * hkv, row_blocks, splits)](
        q, k, v, mask, o, m, l, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2),
        n, length, group, hkv, d, float(scale), per_split, splits,
        BLOCK_R=block_r, BLOCK_L=block_l, BLOCK_D=block_d, IEEE=q.dtype == torch.float32, num_warps=4,
    )
    out = torch.empty(bsz, n, hq, d, device=q.device, dtype=q.dtype)
    _combine_kernel[(bsz * hq * n,)](
        o, m, l, out, out.stride(0), out.stride(1), out.stride(2), n, hq, d, splits,
        BLOCK_S=pow2(splits), BLOCK_D=block_d, num_warps=4,
    )
    return out
