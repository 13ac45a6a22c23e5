"""Shared contract of the tree gated delta rule ops: the output dataclass and input validation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import run_commit
from ..tree import validate_parent


@dataclass
class TreeGatedDeltaOutput:
    """Result of verifying a draft tree on one gated-delta layer.

    Attributes:
        o: [B, N, HV, V] in the dtype of `q`; node i's output given the state along its own root path.
        u: [B, N, HV, V] float32; the delta-rule correction of each node ("new value"). Together with `k`
            and `g_cum` it rebuilds the state of any root path without a per-node state.
        k: [B, N, H, K] float32; the keys as the recurrence used them (l2-normalized if asked).
        g_cum: [B, N, HV] float32; log decay accumulated from the committed state down to each node.
    """

    o: torch.Tensor
    u: torch.Tensor
    k: torch.Tensor
    g_cum: torch.Tensor

    def commit(self, initial_state: torch.Tensor, parent: torch.Tensor, leaf: torch.Tensor,
               on_path: torch.Tensor | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The exact state [B, HV, K, V] (float32, a new tensor) after each row's root->leaf path, rebuilt from these
        factors.

        leaf: [B] the accepted node per row (-1: nothing accepted, the state comes back bit-identical); on_path:
        optional [B, N] bool mask of each row's path, when the caller has it; into: written and returned instead of
        a new tensor (may be `initial_state`: the commit in place). Dispatches like the public ops."""
        return run_commit("commit_gated_delta_rule", initial_state.device, (initial_state, self, parent, leaf), on_path,
                          into)


@dataclass
class PreparedInputs:
    q_hv: torch.Tensor  # [B, N, HV, K] fp32, scaled later by `scale`
    k_hv: torch.Tensor  # [B, N, HV, K] fp32
    k: torch.Tensor  # [B, N, H, K] fp32
    v: torch.Tensor  # [B, N, HV, V] fp32
    g: torch.Tensor  # [B, N, HV] fp32
    beta: torch.Tensor  # [B, N, HV] fp32
    initial_state: torch.Tensor  # [B, HV, K, V] fp32
    scale: float
    valid: torch.Tensor  # [B, N] fp32, 1 for real nodes, 0 for padding


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as fla and transformers: x * rsqrt(sum(x^2) + eps).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_shapes(q, k, v, g, beta, parent, initial_state) -> tuple[int, int, int, int, int, int]:
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, N, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    bsz, n, h, kdim = q.shape
    if v.ndim != 4 or v.shape[:2] != (bsz, n):
        raise ValueError(f"v must be [B, N, HV, V] with B={bsz}, N={n}, got {tuple(v.shape)}")
    hv, vdim = v.shape[2:]
    if hv % h != 0:
        raise ValueError(f"HV={hv} value heads must be a multiple of H={h} query/key heads")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (bsz, n, hv):
            raise ValueError(f"{name} must be [B, N, HV] = {(bsz, n, hv)}, got {tuple(t.shape)}")
    if initial_state.shape != (bsz, hv, kdim, vdim):
        raise ValueError(f"initial_state must be [B, HV, K, V] = {(bsz, hv, kdim, vdim)}, got {tuple(initial_state.shape)}")
    validate_parent(parent, n)
    if parent.shape[0] != bsz:
        raise ValueError(f"parent has batch {parent.shape[0]}, inputs have {bsz}")
    return bsz, n, h, hv, kdim, vdim


def valid_mask(num_nodes: torch.Tensor | None, bsz: int, n: int, device) -> torch.Tensor:
    if num_nodes is None:
        return torch.ones(bsz, n, dtype=torch.float32, device=device)
    if num_nodes.shape != (bsz,):
        raise ValueError(f"num_nodes must be [B] = ({bsz},), got {tuple(num_nodes.shape)}")
    return (torch.arange(n, device=device)[None, :] < num_nodes.to(device)[:, None]).float()


def prepare_inputs(q, k, v, g, beta, parent, initial_state, scale, use_qk_l2norm, num_nodes) -> PreparedInputs:
    bsz, n, h, hv, kdim, _ = check_shapes(q, k, v, g, beta, parent, initial_state)
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    group = hv // h
    return PreparedInputs(
        q_hv=qf.repeat_interleave(group, dim=2),
        k_hv=kf.repeat_interleave(group, dim=2),
        k=kf,
        v=v.float(),
        g=g.float(),
        beta=beta.float(),
        initial_state=initial_state.float(),
        scale=kdim**-0.5 if scale is None else float(scale),
        valid=valid_mask(num_nodes, bsz, n, q.device),
    )
