"""Vectorized tree causal conv in PyTorch: gather each node's window through its ancestors-at-distance
table, then one multiply-add. The CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tree import ancestors_at_distance, path_mask
from .common import check_conv_inputs


def torch_tree_causal_conv1d(x, weight, bias, parent, conv_state, activation="silu"):
    bsz, n, c, width = check_conv_inputs(x, weight, bias, parent, conv_state, activation)
    s = conv_state.shape[-1]
    # Buffer rows: committed window (oldest..newest) then the N tree inputs, so that index -d of the
    # ancestors table (the d-th newest committed input) lands on row s - d.
    buf = torch.cat([conv_state.transpose(1, 2).float(), x.float()], dim=1)  # [B, S + N, C]
    anc = ancestors_at_distance(parent, width)  # [B, N, W], newest first
    rows = torch.where(anc >= 0, anc + s, s + anc)
    win = buf.gather(1, rows.view(bsz, n * width, 1).expand(-1, -1, c)).view(bsz, n, width, c)
    # weight[:, -1] multiplies the newest input.
    y = torch.einsum("bnwc,cw->bnc", win, weight.float().flip(-1))
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype)


def torch_commit_causal_conv1d(conv_state, x, parent, leaf, on_path=None):
    """on_path: optional [B, N] bool mask of the root->leaf path, when the caller already has it."""
    s = conv_state.shape[-1]
    on_path = path_mask(parent, leaf) if on_path is None else on_path  # [B, N]
    rows = []
    for b in range(conv_state.shape[0]):
        # On-path nodes in index order are the path from the root down (topological order).
        nodes = on_path[b].nonzero().flatten()
        seq = torch.cat([conv_state[b], x[b, nodes].transpose(0, 1).to(conv_state.dtype)], dim=-1)
        rows.append(seq[:, -s:])
    return torch.stack(rows)
