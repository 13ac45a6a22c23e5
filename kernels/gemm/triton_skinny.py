"""Skinny linear layers on the GPU: y = x @ W^T (+ b) for few rows of x (a verify forward's 2-65 tree nodes).

Why our own: at 8-64 rows a linear layer is a pure weight read (arithmetic intensity of M flops per byte), and
cuBLAS's kernels for that shape reach ~55% of the H200's bandwidth (`scripts/profile_verify.py`: the 2B model's 187
matmuls take 1.65 ms against their 0.92 ms weight-read floor). This kernel streams each weight tile once, with the
few rows of x held in registers, and spreads a short N over more programs by splitting K (partial sums added in
float32).

Layout: x [M, K] and W [N, K] with unit stride along K (nn.Linear's weight is), y [M, N] in x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["SkinnyConfig", "triton_skinny_linear", "block_m", "MAX_ROWS"]

from . import MAX_ROWS  # beyond it a GEMM is no longer a pure weight read: left to cuBLAS


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration: tile sizes along N and K, the number of K splits, warps and pipeline stages."""

    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        # With K split, the first split's program adds the bias.
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32) * (pid_k == 0).to(tl.float32)
        acc += bias[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def block_m(rows: int) -> int:
    """The row tile for `rows` rows of x."""
    # tl.dot needs at least 16 along every dimension.
    return max(16, triton.next_power_of_2(rows))


def triton_skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) for at most `MAX_ROWS` rows of x; returns [..., N] in x's dtype."""
    config = config or SkinnyConfig()
    *lead, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has K={k}, weight is {tuple(weight.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"triton_skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    split = max(1, min(config.split_k, triton.cdiv(k, config.block_k)))
    k_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_split)
    atomic = split > 1
    y = torch.zeros(m, n, device=x.device, dtype=torch.float32) if atomic else torch.empty(m, n, device=x.device,
                                                                                           dtype=x.dtype)
    grid = (triton.cdiv(n, config.block_n), split)
    _skinny_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, m, n, k, k_split, x2.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, ATOMIC=atomic, BLOCK_M=block_m(m), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if atomic:
        y = y.to(x.dtype)
    return y.view(*lead, n)
