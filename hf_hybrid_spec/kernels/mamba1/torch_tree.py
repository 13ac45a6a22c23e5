"""Tree Mamba-1 in PyTorch, one depth level at a time (see `common` for why not in closed form)."""

from __future__ import annotations

import torch

from ..tree import node_depth, path_nodes
from .common import TreeMamba1Output, node_output, prepare_mamba1, replay_paths, step


def torch_tree_mamba1(x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None,
                      dt_softplus=True) -> TreeMamba1Output:
    """Verify a draft tree on a Mamba-1 layer: y [B, N, D] and the token factors for `torch_commit_mamba1`.

    Level d's nodes (of every row) are computed together from their parents' states, which level d - 1 left: the
    states of one level are held at a time, never one per node of the tree."""
    p = prepare_mamba1(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus)
    bsz, n, d = x.shape
    y = torch.zeros(bsz, n, d, dtype=x.dtype, device=x.device)
    depth = node_depth(parent).to(x.device)  # [B, N], 0 for children of the committed state
    par = parent.long().to(x.device)
    # slot[b, i]: where node i's state sits among the states of its level (set when the level is computed).
    slot = torch.zeros(bsz, n, dtype=torch.long, device=x.device)
    states = p.initial_state  # the level above the first: the committed state of each row
    for level in range(int(depth.max()) + 1 if n else 0):
        rows, nodes = (depth == level).nonzero(as_tuple=True)
        parent_states = states[rows] if level == 0 else states[slot[rows, par[rows, nodes]]]
        states = step(parent_states, p, rows, nodes)
        y[rows, nodes] = node_output(states, p, rows, nodes, x.dtype)
        slot[rows, nodes] = torch.arange(rows.numel(), device=x.device)
    return TreeMamba1Output(y=y, x=p.x, b=p.b, dt=p.dt, a=p.a)


def torch_commit_mamba1(initial_state, out: TreeMamba1Output, parent, leaf, on_path=None) -> torch.Tensor:
    """The state [B, D, S] (fp32) after each row's root->leaf path (leaf -1: unchanged), replayed from the factors.

    With `on_path` ([B, N] bool, each row's path) every node is visited in topological order and its step kept only
    on the path: fixed-shape device ops, no host read (what a captured commit needs). Without it the path is walked
    on the host (fewer ops)."""
    if on_path is None:
        return replay_paths(initial_state, out, [nodes.tolist() for nodes in path_nodes(parent, leaf)])
    state = initial_state.detach().float().clone()
    for i in range(out.dt.shape[1]):
        dt = out.dt[:, i]  # [B, D]
        stepped = state * torch.exp(dt[..., None] * out.a) + (dt * out.x[:, i])[..., None] * out.b[:, i][:, None, :]
        state = torch.where(on_path[:, i].to(state.device)[:, None, None], stepped, state)
    return state
