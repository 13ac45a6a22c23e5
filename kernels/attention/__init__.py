"""Attention of a few tree nodes over a static KV cache (the verify forward's attention layers).

`torch_tree_attention` is the reference (softmax(q k^T * scale + mask) v, grouped-query heads); the Triton kernel
(`triton_tree.triton_tree_attention`) computes the same in one split pass over the keys and one combine.
"""

from __future__ import annotations

import torch

__all__ = ["torch_tree_attention"]


def torch_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q [B, Hq, N, D], k / v [B, Hkv, L, D] (Hq a multiple of Hkv; query head h reads kv head h // (Hq / Hkv)),
    mask [B or 1, 1, N, L] additive. Returns [B, N, Hq, D] in q's dtype (float32 math)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ k.transpose(-1, -2) * scale + mask.float()
    return (scores.softmax(-1) @ v).transpose(1, 2).to(q.dtype)
