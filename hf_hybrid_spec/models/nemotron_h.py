"""Nemotron-H: per-layer blocks of Mamba-2, attention or MLP (hybrid_override_pattern)."""

from .base import ModelAdapter
from .mamba2 import make_mamba2_tree_forward

ADAPTER = ModelAdapter(
    name="nemotron_h",
    model_types=("nemotron_h",),
    mixers={"NemotronHMamba2Mixer": make_mamba2_tree_forward()},
    attention=("NemotronHAttention",),
)
