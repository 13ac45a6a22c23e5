"""Triton kernel of `rows.gather_rows`: the rows of up to four sources in one launch (see `rows`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tree import cdiv, pow2


@triton.jit
def gather_rows_kernel(s0, s1, s2, s3, out, order, dst, stride_s0, stride_s1, stride_s2, stride_s3, stride_out_l,
                       stride_out_t, H, BH: tl.constexpr):
    """out[l, 0, dst[r], :] = s_l[0, order[r], :]. Grid: (R, L, cdiv(H, BH)); sources past L are never read."""
    i_r, i_l, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(order + i_r).to(tl.int64)
    pos = tl.load(dst + i_r).to(tl.int64)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    # One branch per source pointer: a program reads exactly one of them.
    if i_l == 0:
        b_v = tl.load(s0 + row * stride_s0 + o_h, mask=m_h, other=0.0)
    elif i_l == 1:
        b_v = tl.load(s1 + row * stride_s1 + o_h, mask=m_h, other=0.0)
    elif i_l == 2:
        b_v = tl.load(s2 + row * stride_s2 + o_h, mask=m_h, other=0.0)
    else:
        b_v = tl.load(s3 + row * stride_s3 + o_h, mask=m_h, other=0.0)
    tl.store(out + i_l.to(tl.int64) * stride_out_l + pos * stride_out_t + o_h, b_v, mask=m_h)


def triton_gather_rows(out: torch.Tensor, sources: tuple[torch.Tensor, ...], order: torch.Tensor,
                       dst: torch.Tensor) -> None:
    """`rows.gather_rows` for 1-4 sources on one device, unit-stride rows (checked by the caller)."""
    n_src = len(sources)
    if not 1 <= n_src <= 4:
        raise ValueError(f"one launch takes 1-4 sources, got {n_src}")
    padded = list(sources) + [sources[0]] * (4 - n_src)
    hidden = out.shape[3]
    bh = min(pow2(hidden), 2048)
    grid = (order.numel(), n_src, cdiv(hidden, bh))
    gather_rows_kernel[grid](*padded, out, order, dst, *(s.stride(1) for s in padded), out.stride(0), out.stride(2),
                             hidden, BH=bh)
