"""Shared contract of the tree causal conv ops (the short depthwise conv in front of linear-attention and
Mamba layers): input validation."""

from __future__ import annotations

from ..tree import validate_parent

ACTIVATIONS = (None, "silu", "swish")


def check_conv_inputs(x, weight, bias, parent, conv_state, activation) -> tuple[int, int, int, int]:
    if x.ndim != 3:
        raise ValueError(f"x must be [B, N, C], got {tuple(x.shape)}")
    bsz, n, c = x.shape
    if weight.ndim != 2 or weight.shape[0] != c:
        raise ValueError(f"weight must be [C, W] with C={c}, got {tuple(weight.shape)}")
    width = weight.shape[1]
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"bias must be [C] = ({c},), got {tuple(bias.shape)}")
    if conv_state.ndim != 3 or conv_state.shape[:2] != (bsz, c) or conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state must be [B, C, S] with B={bsz}, C={c}, S >= W-1={width - 1}, got {tuple(conv_state.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    validate_parent(parent, n)
    return bsz, n, c, width
