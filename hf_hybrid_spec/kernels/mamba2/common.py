"""Shared contract of the tree Mamba-2 ops: the output dataclass and input preparation.

Mamba-2 (SSD) with a scalar decay per head, as Falcon-H1, Bamba, Nemotron-H and GraniteMoeHybrid use it:

    dt_i = clamp(softplus(dt_i + dt_bias), *dt_limit)
    h_i  = exp(dt_i * A) * h_parent(i) + dt_i * x_i B_i^T       # h: [P, S] per head
    y_i  = h_i C_i + D * x_i,  then y_i *= silu(z_i) if a gate z is given
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import run_commit
from ..tree import validate_parent


@dataclass
class TreeMamba2Output:
    """Result of verifying a draft tree on one Mamba-2 layer.

    Attributes:
        y: [B, N, H, P] in the dtype of `x`; each node's output given the state along its own root path.
        x: [B, N, H, P] float32; the inputs as the recurrence used them (a token-level factor).
        b: [B, N, G, S] float32; the input projections B (a token-level factor).
        dt: [B, N, H] float32; the processed step sizes (bias, softplus and limits applied).
        a_cum: [B, N, H] float32; sum of dt * A from the committed state down to each node (log decay).
    """

    y: torch.Tensor
    x: torch.Tensor
    b: torch.Tensor
    dt: torch.Tensor
    a_cum: torch.Tensor

    def commit(self, initial_state: torch.Tensor, parent: torch.Tensor, leaf: torch.Tensor,
               on_path: torch.Tensor | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The exact SSM state [B, H, P, S] (float32, a new tensor) after each row's root->leaf path.

        leaf: [B] the accepted node per row (-1: nothing accepted, the state comes back bit-identical); on_path:
        optional [B, N] bool mask of each row's path, when the caller has it; into: written and returned instead of
        a new tensor (may be `initial_state`: the commit in place). Dispatches like the public ops."""
        return run_commit("commit_mamba2", initial_state.device, (initial_state, self, parent, leaf), on_path, into)


@dataclass
class PreparedMamba2:
    x: torch.Tensor  # [B, N, H, P] fp32
    dt: torch.Tensor  # [B, N, H] fp32, processed
    a: torch.Tensor  # [H] fp32
    b_h: torch.Tensor  # [B, N, H, S] fp32, B expanded to heads
    c_h: torch.Tensor  # [B, N, H, S] fp32
    b: torch.Tensor  # [B, N, G, S] fp32
    d: torch.Tensor | None  # [H] fp32
    z: torch.Tensor | None  # [B, N, H, P] fp32
    initial_state: torch.Tensor  # [B, H, P, S] fp32
    valid: torch.Tensor  # [B, N] fp32


def process_dt(dt, dt_bias, dt_softplus, dt_limit) -> torch.Tensor:
    # Same order as transformers' mamba2_chunk_scan: bias in the input dtype, softplus, clamp, then fp32.
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = torch.clamp(dt, min=lo, max=hi)
    return dt.float()


def check_mamba2(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, num_nodes) -> None:
    """Raise ValueError unless the inputs have the public op's shapes (every backend checks the same)."""
    if x.ndim != 4:
        raise ValueError(f"x must be [B, N, H, P], got {tuple(x.shape)}")
    bsz, n, h, p = x.shape
    if dt.shape != (bsz, n, h):
        raise ValueError(f"dt must be [B, N, H] = {(bsz, n, h)}, got {tuple(dt.shape)}")
    if A.shape != (h,):
        raise ValueError(f"A must be [H] = ({h},), got {tuple(A.shape)}")
    if B.ndim != 4 or B.shape[:2] != (bsz, n) or C.shape != B.shape:
        raise ValueError(f"B and C must both be [B, N, G, S], got {tuple(B.shape)} and {tuple(C.shape)}")
    g, s = B.shape[2:]
    if h % g != 0:
        raise ValueError(f"H={h} heads must be a multiple of G={g} groups")
    if initial_state.shape != (bsz, h, p, s):
        raise ValueError(f"initial_state must be [B, H, P, S] = {(bsz, h, p, s)}, got {tuple(initial_state.shape)}")
    if D is not None and D.shape != (h,):
        raise ValueError(f"D must be [H] = ({h},), got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have the shape of x {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None and dt_bias.shape != (h,):
        raise ValueError(f"dt_bias must be [H] = ({h},), got {tuple(dt_bias.shape)}")
    if num_nodes is not None and num_nodes.shape != (bsz,):
        raise ValueError(f"num_nodes must be [B] = ({bsz},), got {tuple(num_nodes.shape)}")
    validate_parent(parent, n)
    if parent.shape[0] != bsz:
        raise ValueError(f"parent has batch {parent.shape[0]}, inputs have {bsz}")


def prepare_mamba2(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, dt_softplus, dt_limit, num_nodes):
    check_mamba2(x, dt, A, B, C, parent, initial_state, D, z, dt_bias, num_nodes)
    bsz, n, h, _ = x.shape
    g = B.shape[2]
    if num_nodes is None:
        valid = torch.ones(bsz, n, dtype=torch.float32, device=x.device)
    else:
        valid = (torch.arange(n, device=x.device)[None, :] < num_nodes.to(x.device)[:, None]).float()
    rep = h // g
    bf, cf = B.float(), C.float()
    return PreparedMamba2(
        x=x.float(),
        dt=process_dt(dt, dt_bias, dt_softplus, dt_limit),
        a=A.float(),
        b_h=bf.repeat_interleave(rep, dim=2),
        c_h=cf.repeat_interleave(rep, dim=2),
        b=bf,
        d=None if D is None else D.float(),
        z=None if z is None else z.float(),
        initial_state=initial_state.float(),
        valid=valid,
    )


def finish_output(y, p: PreparedMamba2, dtype) -> torch.Tensor:
    if p.d is not None:
        y = y + p.d[:, None] * p.x
    if p.z is not None:
        y = y * F.silu(p.z)
    return (y * p.valid[..., None, None]).to(dtype)
