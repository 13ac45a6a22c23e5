"""Topology helpers for draft trees given as parent pointers.

A tree of N nodes per batch row is a `parent` tensor of shape [B, N] (int64): `parent[b, i] < i` is the
index of node i's parent, and -1 means node i hangs directly off the committed state. Nodes are in
topological order, so a node's ancestors always come before it. Rows may be padded: padding nodes are
ordinary children of the committed state (parent -1) that nobody descends from, so they never change the
result of a real node.

Everything here is plain PyTorch on any device; the kernels and the cache use these to build masks,
paths and conv windows. `node_strided` is the layout rule the Triton launchers read per-node inputs with; `pow2` and
`cdiv` their tile and grid arithmetic.
"""

from __future__ import annotations

import torch

__all__ = [
    "validate_parent",
    "node_depth",
    "ancestor_mask",
    "path_mask",
    "ancestors_at_distance",
    "path_nodes",
    "node_strided",
    "writable_state",
    "finish_state",
    "pow2",
    "cdiv",
    "index_arg",
]


def validate_parent(parent: torch.Tensor, n: int | None = None) -> None:
    """Raise ValueError unless `parent` is a valid topologically ordered parent table [B, N].

    Values are checked for CPU tensors only: on an accelerator the check would cost a host sync per layer
    (and break CUDA-graph capture), so callers there validate the tree once, where it is built.
    """
    if parent.ndim != 2:
        raise ValueError(f"parent must be [B, N], got shape {tuple(parent.shape)}")
    if n is not None and parent.shape[1] != n:
        raise ValueError(f"parent has {parent.shape[1]} nodes, inputs have {n}")
    if parent.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parent must be an integer tensor, got {parent.dtype}")
    if parent.device.type != "cpu":
        return
    idx = torch.arange(parent.shape[1], device=parent.device)
    if bool(((parent >= idx) | (parent < -1)).any()):
        raise ValueError("parent[b, i] must satisfy -1 <= parent[b, i] < i (nodes in topological order)")


def node_depth(parent: torch.Tensor) -> torch.Tensor:
    """Depth of every node, [B, N] int64; children of the committed state have depth 0."""
    b, n = parent.shape
    if parent.device.type == "cpu":
        # Draft trees are small and live on the host: a Python walk beats N tiny tensor ops.
        rows = []
        for row in parent.tolist():
            depth: list[int] = []
            for p in row:
                depth.append(depth[p] + 1 if p >= 0 else 0)
            rows.append(depth)
        return torch.tensor(rows, dtype=torch.long).view(b, n)
    if n > 8:
        # On an accelerator, log2(N) batched matmuls instead of N launches.
        return ancestor_mask(parent, include_self=True).sum(-1) - 1
    depth = torch.zeros(b, n, dtype=torch.long, device=parent.device)
    # Topological order: the parent's depth is final before the child's is read.
    for i in range(n):
        p = parent[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0).view(b, 1)).view(b) + 1, 0)
    return depth


def ancestor_mask(parent: torch.Tensor, include_self: bool = True) -> torch.Tensor:
    """Boolean [B, N, N] with mask[b, i, j] = node j is on the root path of node i.

    Built by doubling: reach_{2k} = reach_k @ reach_k, so log2(depth) boolean matmuls instead of a walk.
    """
    b, n = parent.shape
    dev = parent.device
    eye = torch.eye(n, dtype=torch.bool, device=dev).expand(b, n, n)
    # Direct parent edges: step[b, i, p] = True.
    step = torch.zeros(b, n, n + 1, dtype=torch.bool, device=dev)
    step.scatter_(2, torch.where(parent >= 0, parent, n).long().unsqueeze(-1), True)
    step = step[..., :n]
    reach = eye | step
    hops = 1
    while hops < n:
        reach = torch.bmm(reach.float(), reach.float()) > 0
        hops *= 2
    return reach if include_self else reach & ~eye


def path_mask(parent: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """Boolean [B, N]: nodes on the path from the committed state to `leaf` [B] (inclusive).

    A row with leaf = -1 selects nothing.
    """
    b, n = parent.shape
    mask = torch.zeros(b, n + 1, dtype=torch.bool, device=parent.device)
    cur = leaf.to(torch.long).clone()
    par = torch.cat([parent.to(torch.long), torch.full((b, 1), -1, dtype=torch.long, device=parent.device)], dim=1)
    # Walk up at most N steps; finished rows park on the sentinel column n.
    for _ in range(n):
        cur = torch.where(cur >= 0, cur, n)
        mask.scatter_(1, cur.view(b, 1), True)
        if bool((cur == n).all()):
            break
        cur = par.gather(1, cur.view(b, 1)).view(b)
    return mask[:, :n]


def path_nodes(parent: torch.Tensor, leaf: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the node indices from the first node under the committed state down to `leaf` (root first)."""
    rows = []
    par = parent.tolist()
    for b, lf in enumerate(leaf.tolist()):
        nodes = []
        cur = lf
        while cur >= 0:
            nodes.append(cur)
            cur = par[b][cur]
        rows.append(torch.tensor(nodes[::-1], dtype=torch.long, device=parent.device))
    return rows


def ancestors_at_distance(parent: torch.Tensor, width: int) -> torch.Tensor:
    """[B, N, width] int64: entry d is node i's ancestor d steps up (d = 0 is i itself).

    Where the walk leaves the tree after s steps (s <= d), the entry is -(d - s + 1): -1 names the newest
    committed token, -2 the one before it, and so on. The short causal conv reads its window this way.
    """
    b, n = parent.shape
    par = parent.to(torch.long)
    out = torch.empty(b, n, width, dtype=torch.long, device=parent.device)
    cur = torch.arange(n, device=parent.device).expand(b, n).clone()
    for d in range(width):
        out[..., d] = cur
        inside = cur >= 0
        nxt = par.gather(1, cur.clamp(min=0))
        cur = torch.where(inside, nxt, cur - 1)
    return out


def node_strided(x: torch.Tensor) -> torch.Tensor:
    """`x` [B, N, ...] as it is when a kernel can read it through one node stride: the trailing dims contiguous
    within a node, nodes evenly spaced (batch stride = N x node stride); else a contiguous copy.

    The views a mixer splits out of one [B, N, C] projection (q / k / v, or x / B / C / dt) are of that kind, so the
    tree kernels read them in place instead of paying a copy launch per input and layer.
    """
    if x.is_contiguous():  # one C call: the common case, and this runs per input, layer and step
        return x
    shape, strides = x.shape, x.stride()
    step = 1  # a node's elements, once the trailing dims are known to be contiguous
    for size, stride in zip(reversed(shape[2:]), reversed(strides[2:])):
        if stride != step and size != 1:
            return x.contiguous()
        step *= size
    if strides[1] >= step and (shape[0] == 1 or strides[0] == shape[1] * strides[1]):
        return x
    return x.contiguous()


def writable_state(into: torch.Tensor | None, h0: torch.Tensor) -> torch.Tensor:
    """Where a commit kernel writes the new state of `h0` (fp32, contiguous): `into` itself when the kernel can
    write it directly (fp32, contiguous, h0's shape: the cache's own state buffer, possibly h0 itself), else a new
    tensor (copied into `into` afterwards by `finish_state`)."""
    if into is not None and into.dtype == torch.float32 and into.is_contiguous() and into.shape == h0.shape:
        return into
    return torch.empty_like(h0)


def finish_state(into: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """The commit's result: `new`, copied into `into` where the kernel could not write `into` directly."""
    if into is None or new is into:
        return new
    into.copy_(new)
    return into


# The launchers' tile and grid arithmetic on Python ints. Not triton.next_power_of_2 / triton.cdiv: in recent Triton
# those are constexpr functions that unwrap every argument on each host call (four to six calls per launch), and an
# eager verify forward launches two tree ops per recurrent layer.
def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def index_arg(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A [B] index tensor (accepted leaves, node counts) as a launcher hands it to a kernel: as it is where it is
    already on `device`, int32 or int64 and contiguous (the kernels load either and cast), else an int32 copy there.
    Not a cast per call: the runners keep leaves in int64, and inside a captured commit graph the cast was one more
    kernel per layer and step."""
    if t.device == device and t.dtype in (torch.int32, torch.int64) and t.is_contiguous():
        return t
    return t.to(device=device, dtype=torch.int32).contiguous()
