"""Shared contract of the tree attention ops: input validation."""

from __future__ import annotations

import torch


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q must be [B, Hq, N, D] and k, v [B, Hkv, L, D] alike; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    bsz, hq, n, d = q.shape
    if k.shape[0] != bsz or k.shape[-1] != d or hq % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (batch, head dim, Hq a multiple of Hkv)")
    if mask.ndim != 4 or mask.shape[0] not in (1, bsz) or mask.shape[1] != 1 or mask.shape[-2:] != (n, k.shape[2]):
        raise ValueError(f"mask {tuple(mask.shape)} must be [B or 1, 1, {n}, {k.shape[2]}]")
