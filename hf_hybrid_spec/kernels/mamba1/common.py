"""Shared contract of the tree Mamba-1 ops (Jamba's mixer): the output dataclass and input preparation.

Mamba-1 (the selective scan) with a decay per channel and state entry:

    dt_i = softplus(dt_i + dt_bias)                                  # [D] per node
    h_i  = exp(dt_i[:, None] * A) * h_parent(i) + (dt_i * x_i)[:, None] * B_i[None, :]   # h: [D, S]
    y_i  = h_i C_i + D_skip * x_i,  then y_i *= silu(z_i) if a gate z is given

Unlike Mamba-2 (a scalar decay per head) the decay is a [D, S] matrix per node, so the closed form over a tree
(every node's output from its ancestors' token factors, as the gated-delta and Mamba-2 ops solve it) needs the path
sums of dt * A for every node and entry: an [N, D, S] tensor, a state's worth per node, and N * depth * D * S work.
Walking the tree one depth level at a time does the same work with states for one level at a time, so that is the
tree form here (`torch_tree`). What is kept for the commit is token-level: dt, x and B per node ([N, D] and [N, S]);
the commit replays the accepted path (at most depth + 1 steps) from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import run_commit
from ..tree import validate_parent


@dataclass
class TreeMamba1Output:
    """Result of verifying a draft tree on one Mamba-1 layer.

    Attributes:
        y: [B, N, D] in the dtype of `x`; each node's output given the state along its own root path.
        x: [B, N, D] float32; the inputs as the recurrence used them (a token-level factor).
        b: [B, N, S] float32; the input projections B (a token-level factor).
        dt: [B, N, D] float32; the processed step sizes (bias and softplus applied).
        a: [D, S] float32; the decay rates A (negative).
    """

    y: torch.Tensor
    x: torch.Tensor
    b: torch.Tensor
    dt: torch.Tensor
    a: torch.Tensor

    def commit(self, initial_state: torch.Tensor, parent: torch.Tensor, leaf: torch.Tensor,
               on_path: torch.Tensor | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The exact SSM state [B, D, S] (float32, a new tensor) after each row's root->leaf path.

        leaf: [B] the accepted node per row (-1: nothing accepted, the state comes back bit-identical); on_path:
        optional [B, N] bool mask of each row's path, when the caller has it; into: written and returned instead of
        a new tensor (may be `initial_state`: the commit in place). Dispatches like the public ops."""
        return run_commit("commit_mamba1", initial_state.device, (initial_state, self, parent, leaf), on_path, into)


@dataclass
class PreparedMamba1:
    x: torch.Tensor  # [B, N, D] fp32
    dt: torch.Tensor  # [B, N, D] fp32, processed
    a: torch.Tensor  # [D, S] fp32
    b: torch.Tensor  # [B, N, S] fp32
    c: torch.Tensor  # [B, N, S] in C's dtype (the stock output matmul runs there)
    d: torch.Tensor | None  # [D]
    z: torch.Tensor | None  # [B, N, D]
    initial_state: torch.Tensor  # [B, D, S] fp32


def prepare_mamba1(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus) -> PreparedMamba1:
    if x.ndim != 3:
        raise ValueError(f"x must be [B, N, D], got {tuple(x.shape)}")
    bsz, n, d = x.shape
    if dt.shape != x.shape:
        raise ValueError(f"dt must be [B, N, D] = {(bsz, n, d)}, got {tuple(dt.shape)}")
    if A.ndim != 2 or A.shape[0] != d:
        raise ValueError(f"A must be [D, S] with D = {d}, got {tuple(A.shape)}")
    s = A.shape[1]
    if B.shape != (bsz, n, s) or C.shape != B.shape:
        raise ValueError(f"B and C must both be [B, N, S] = {(bsz, n, s)}, got {tuple(B.shape)} and {tuple(C.shape)}")
    if initial_state.shape != (bsz, d, s):
        raise ValueError(f"initial_state must be [B, D, S] = {(bsz, d, s)}, got {tuple(initial_state.shape)}")
    if D is not None and D.shape != (d,):
        raise ValueError(f"D must be [D] = ({d},), got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have the shape of x {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None and dt_bias.shape != (d,):
        raise ValueError(f"dt_bias must be [D] = ({d},), got {tuple(dt_bias.shape)}")
    validate_parent(parent, n)
    # The order of the stock decode step (transformers' selective_state_update): bias and softplus in dt's dtype.
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return PreparedMamba1(x=x.float(), dt=dt.float(), a=A.float(), b=B.float(), c=C, d=D, z=z,
                          initial_state=initial_state.float())


def step(state: torch.Tensor, p: PreparedMamba1, rows: torch.Tensor | slice, nodes: torch.Tensor) -> torch.Tensor:
    """The states after nodes `nodes` of batch rows `rows` from their parents' `state` [k, D, S] (fp32)."""
    dt = p.dt[rows, nodes]  # [k, D]
    decay = torch.exp(dt[..., None] * p.a)
    return state * decay + (dt * p.x[rows, nodes])[..., None] * p.b[rows, nodes][:, None, :]


def node_output(state: torch.Tensor, p: PreparedMamba1, rows, nodes, dtype: torch.dtype) -> torch.Tensor:
    """y [k, D] of nodes from their states [k, D, S], as the stock decode step computes it."""
    y = torch.matmul(state.to(p.c.dtype), p.c[rows, nodes][..., None]).squeeze(-1)
    x = p.x[rows, nodes].to(dtype)
    if p.d is not None:
        y = y + x * p.d
    if p.z is not None:
        y = y * F.silu(p.z[rows, nodes])
    return y.to(dtype)


def replay_paths(initial_state: torch.Tensor, out: TreeMamba1Output, paths: list[list[int]]) -> torch.Tensor:
    """The state [B, D, S] (fp32) after each row's path (node lists, root side first; empty: unchanged)."""
    new = initial_state.detach().clone().float()
    for row, nodes in enumerate(paths):
        s = new[row]
        for i in nodes:
            dt = out.dt[row, i]
            s = s * torch.exp(dt[:, None] * out.a) + (dt * out.x[row, i])[:, None] * out.b[row, i][None, :]
        new[row] = s
    return new
