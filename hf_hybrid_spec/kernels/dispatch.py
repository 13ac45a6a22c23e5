"""The ops of `hf_hybrid_spec.kernels` (see the package docstring): the implementations of every op folder, and the
un-prefixed functions that dispatch on the tensors' device and the backend in effect."""


from __future__ import annotations

import math

import torch

from . import tree
from .attention import naive_tree_attention, torch_tree_attention
from .backend import get_backend, resolve, set_backend, triton_available, use_backend
from .conv import (
    naive_commit_causal_conv1d,
    naive_tree_causal_conv1d,
    torch_commit_causal_conv1d,
    torch_tree_causal_conv1d,
)
from .gated_delta_rule import (
    TreeGatedDeltaOutput,
    naive_commit_gated_delta_rule,
    naive_tree_gated_delta_rule,
    torch_commit_gated_delta_rule,
    torch_tree_gated_delta_rule,
)
from .mamba1 import TreeMamba1Output, naive_commit_mamba1, naive_tree_mamba1, torch_commit_mamba1, torch_tree_mamba1
from .mamba2 import TreeMamba2Output, naive_commit_mamba2, naive_tree_mamba2, torch_commit_mamba2, torch_tree_mamba2
from .ops import implementation, registered, run_commit

__all__ = [
    "implementation",
    "run_commit",
    "TreeGatedDeltaOutput",
    "TreeMamba2Output",
    "TreeMamba1Output",
    "tree_mamba1",
    "commit_mamba1",
    "naive_tree_mamba1",
    "naive_commit_mamba1",
    "torch_tree_mamba1",
    "torch_commit_mamba1",
    "tree_gated_delta_rule",
    "commit_gated_delta_rule",
    "tree_causal_conv1d",
    "commit_causal_conv1d",
    "tree_mamba2",
    "commit_mamba2",
    "naive_tree_gated_delta_rule",
    "naive_commit_gated_delta_rule",
    "naive_tree_causal_conv1d",
    "naive_commit_causal_conv1d",
    "naive_tree_mamba2",
    "naive_commit_mamba2",
    "torch_tree_gated_delta_rule",
    "torch_commit_gated_delta_rule",
    "torch_tree_causal_conv1d",
    "torch_commit_causal_conv1d",
    "torch_tree_mamba2",
    "torch_commit_mamba2",
    "tree_attention",
    "naive_tree_attention",
    "torch_tree_attention",
    "registered",
    "resolve",
    "set_backend",
    "get_backend",
    "use_backend",
    "triton_available",
    "tree",
]

def tree_gated_delta_rule(
    q, k, v, g, beta, parent, initial_state, scale=None, use_qk_l2norm=False, num_nodes=None
) -> TreeGatedDeltaOutput:
    """Verify a draft tree on a gated-delta layer in closed form.

    Args:
        q, k: [B, N, H, K]; v: [B, N, HV, V] with HV a multiple of H (value head h reads key head h // (HV/H)).
        g: [B, N, HV] log decay (<= 0); beta: [B, N, HV] write strength.
        parent: [B, N] int, parent[b, i] < i, -1 for children of the committed state.
        initial_state: [B, HV, K, V] float32, the committed state; never modified.
        scale: query scale, K**-0.5 when None. use_qk_l2norm: l2-normalize q and k first (Qwen3.5 does).
        num_nodes: optional [B] count of real nodes per row (varlen); later nodes are padding, output 0.

    Returns:
        TreeGatedDeltaOutput with o [B, N, HV, V] and the token-level factors that `commit_gated_delta_rule`
        needs to rebuild the state of any root path.
    """
    return implementation("tree_gated_delta_rule", q.device)(
        q, k, v, g, beta, parent, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm, num_nodes=num_nodes
    )


def commit_gated_delta_rule(initial_state, out: TreeGatedDeltaOutput, parent, leaf, on_path=None,
                            into=None) -> torch.Tensor:
    """Exact state after the root->leaf path, [B, HV, K, V] float32 (a new tensor, or `into` written).

    leaf: [B] int, the accepted node per row; -1 leaves that row's state unchanged (bit-identical).
    on_path: optional [B, N] bool mask of each row's root->leaf path, when the caller has it already.
    into: where to write the state, e.g. `initial_state` itself (the commit in place: no copy of the whole state).
    """
    return out.commit(initial_state, parent, leaf, on_path, into)


def tree_causal_conv1d(x, weight, bias, parent, conv_state, activation="silu") -> torch.Tensor:
    """Depthwise causal conv where every node convolves over its own ancestor chain.

    Args:
        x: [B, N, C] inputs of the tree nodes; weight: [C, W]; bias: [C] or None.
        parent: [B, N] as above. conv_state: [B, C, S], S >= W - 1, the last S committed inputs (oldest first).
        activation: "silu" / "swish" or None.

    Returns:
        [B, N, C] in the dtype of x.
    """
    return implementation("tree_causal_conv1d", x.device)(x, weight, bias, parent, conv_state, activation)


def commit_causal_conv1d(conv_state, x, parent, leaf, on_path=None) -> torch.Tensor:
    """Conv window after the root->leaf path: the last S entries of [conv_state, x[path]], [B, C, S]."""
    return run_commit("commit_causal_conv1d", conv_state.device, (conv_state, x, parent, leaf), on_path)


def tree_mamba2(
    x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None, dt_softplus=True,
    dt_limit=(0.0, math.inf), num_nodes=None,
) -> TreeMamba2Output:
    """Verify a draft tree on a Mamba-2 layer in closed form.

    Args:
        x: [B, N, H, P]; dt: [B, N, H] raw step sizes; A: [H] (negative); B, C: [B, N, G, S], H a multiple of G.
        parent: [B, N]; initial_state: [B, H, P, S] float32, never modified.
        D: [H] skip, z: [B, N, H, P] gate (y *= silu(z)), dt_bias: [H]; dt = clamp(softplus(dt + dt_bias), *dt_limit).
        num_nodes: optional [B] count of real nodes per row.

    Returns:
        TreeMamba2Output with y [B, N, H, P] and the factors `commit_mamba2` needs.
    """
    return implementation("tree_mamba2", x.device)(
        x, dt, A, B, C, parent, initial_state, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=dt_limit, num_nodes=num_nodes,
    )


def commit_mamba2(initial_state, out: TreeMamba2Output, parent, leaf, on_path=None, into=None) -> torch.Tensor:
    """Exact SSM state after the root->leaf path, [B, H, P, S] float32; leaf = -1 leaves a row unchanged; `into` as
    `commit_gated_delta_rule`'s."""
    return out.commit(initial_state, parent, leaf, on_path, into)


def tree_mamba1(x, dt, A, B, C, parent, initial_state, D=None, z=None, dt_bias=None,
                dt_softplus=True) -> TreeMamba1Output:
    """Verify a draft tree on a Mamba-1 (selective scan) layer.

    Args:
        x: [B, N, D] (after the conv); dt: [B, N, D] raw step sizes; A: [D, S] (negative); B, C: [B, N, S].
        parent: [B, N]; initial_state: [B, D, S] float32, never modified.
        D: [D] skip, z: [B, N, D] gate (y *= silu(z)), dt_bias: [D]; dt = softplus(dt + dt_bias).

    Returns:
        TreeMamba1Output with y [B, N, D] and the factors `commit_mamba1` needs.
    """
    return implementation("tree_mamba1", x.device)(x, dt, A, B, C, parent, initial_state, D=D, z=z, dt_bias=dt_bias,
                                          dt_softplus=dt_softplus)


def commit_mamba1(initial_state, out: TreeMamba1Output, parent, leaf, on_path=None, into=None) -> torch.Tensor:
    """Exact SSM state after the root->leaf path, [B, D, S] float32; leaf = -1 leaves a row unchanged; `into` as
    `commit_gated_delta_rule`'s."""
    return out.commit(initial_state, parent, leaf, on_path, into)


def tree_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v: q [B, Hq, N, D], k / v [B, Hkv, L, D] (Hq a multiple of Hkv), mask [B or 1,
    1, N, L] additive. Returns [B, N, Hq, D] in q's dtype."""
    return implementation("tree_attention", q.device)(q, k, v, mask, scale)
