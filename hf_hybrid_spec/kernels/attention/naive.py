"""Reference tree attention, written from the definition one query node and head at a time (fp32): the test oracle."""

from __future__ import annotations

import torch

from .common import check_attention_inputs


def naive_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Same contract as `torch_tree_attention`: a node's output is the softmax-weighted sum of the values of the keys
    its additive mask leaves open."""
    check_attention_inputs(q, k, v, mask)
    bsz, hq, n, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(bsz, n, hq, d, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        row_mask = mask[b if mask.shape[0] > 1 else 0, 0].float()  # [N, L]
        for h in range(hq):
            keys, values = k[b, h // group].float(), v[b, h // group].float()  # [L, D]
            for i in range(n):
                weights = torch.softmax(keys @ q[b, h, i].float() * scale + row_mask[i], dim=0)  # [L]
                out[b, i, h] = weights @ values
    return out.to(q.dtype)
