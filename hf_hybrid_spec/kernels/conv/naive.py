"""Reference tree causal conv, written node by node.

Node i convolves over its own ancestor chain: the W inputs ending at i are, newest first, x_i, x_parent(i),
... and, once the chain leaves the tree, the newest committed inputs held in `conv_state`. Committing a path
appends the path's inputs to the window and keeps its last S entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tree import path_nodes
from .common import check_conv_inputs


def naive_tree_causal_conv1d(x, weight, bias, parent, conv_state, activation="silu"):
    """x [B, N, C], weight [C, W], bias [C] | None, parent [B, N], conv_state [B, C, S] -> out [B, N, C]."""
    bsz, n, c, width = check_conv_inputs(x, weight, bias, parent, conv_state, activation)
    out = torch.empty(bsz, n, c, dtype=torch.float32, device=x.device)
    par = parent.tolist()
    wf = weight.float()
    for b in range(bsz):
        for i in range(n):
            chain = []  # newest first
            cur = i
            while cur >= 0 and len(chain) < width:
                chain.append(x[b, cur].float())
                cur = par[b][cur]
            s = conv_state.shape[-1]
            t = 1
            while len(chain) < width:
                chain.append(conv_state[b, :, s - t].float())
                t += 1
            window = torch.stack(chain[::-1], dim=-1)  # [C, W], oldest first
            y = (window * wf).sum(-1)
            if bias is not None:
                y = y + bias.float()
            out[b, i] = y
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def naive_commit_causal_conv1d(conv_state, x, parent, leaf):
    """Window after the root->leaf path: last S of [conv_state, x[path]]. Returns a new [B, C, S] tensor."""
    new = conv_state.clone()
    s = conv_state.shape[-1]
    for b, nodes in enumerate(path_nodes(parent, leaf)):
        if nodes.numel() == 0:
            continue
        seq = torch.cat([conv_state[b], x[b, nodes].transpose(0, 1).to(conv_state.dtype)], dim=-1)
        new[b] = seq[:, -s:]
    return new
