"""Tree attention in PyTorch: softmax(q k^T * scale + mask) v for all nodes at once (grouped-query heads)."""

from __future__ import annotations

import torch

from .common import check_attention_inputs


def torch_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q [B, Hq, N, D], k / v [B, Hkv, L, D] (Hq a multiple of Hkv; query head h reads kv head h // (Hq / Hkv)),
    mask [B or 1, 1, N, L] additive. Returns [B, N, Hq, D] in q's dtype (float32 math)."""
    check_attention_inputs(q, k, v, mask)
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ k.transpose(-1, -2) * scale + mask.float()
    return (scores.softmax(-1) @ v).transpose(1, 2).to(q.dtype)
