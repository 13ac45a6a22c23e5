"""Reference tree Mamba-1, written from the recurrence node by node (one state per node, fp32)."""

from __future__ import annotations

import torch

from ..tree import path_nodes
from .common import TreeMamba1Output, node_output, prepare_mamba1, replay_paths, step


def naive_tree_mamba1(x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None,
                      dt_softplus=True) -> TreeMamba1Output:
    """Same contract as `tree_mamba1`; see `common.prepare_mamba1` for shapes."""
    p = prepare_mamba1(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus)
    bsz, n, d = x.shape
    y = torch.zeros(bsz, n, d, dtype=x.dtype, device=x.device)
    par = parent.tolist()
    for b in range(bsz):
        states = []
        for i in range(n):
            prev = p.initial_state[b] if par[b][i] < 0 else states[par[b][i]]
            idx = torch.tensor([i], device=x.device)
            states.append(step(prev[None], p, b, idx)[0])
            y[b, i] = node_output(states[-1][None], p, b, idx, x.dtype)[0]
    return TreeMamba1Output(y=y, x=p.x, b=p.b, dt=p.dt, a=p.a)


def naive_commit_mamba1(initial_state, out: TreeMamba1Output, parent, leaf) -> torch.Tensor:
    """Replay the recurrence along each row's root->leaf path from the stored factors. Returns [B, D, S] fp32."""
    return replay_paths(initial_state, out, [nodes.tolist() for nodes in path_nodes(parent, leaf)])
