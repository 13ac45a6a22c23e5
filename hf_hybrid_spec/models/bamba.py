"""Bamba: sequential Mamba-2 / attention hybrid with a gated RMSNorm on the SSM output."""

from .base import ModelAdapter
from .mamba2 import make_mamba2_tree_forward

ADAPTER = ModelAdapter(
    name="bamba",
    model_types=("bamba",),
    mixers={"BambaMixer": make_mamba2_tree_forward()},
    attention=("BambaAttention",),
    layer_tuple_length=2,
)
