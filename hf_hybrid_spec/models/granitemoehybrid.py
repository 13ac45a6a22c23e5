"""GraniteMoeHybrid (Granite 4.0): Mamba-2 and attention layers with MoE feed-forwards."""

from .base import ModelAdapter
from .mamba2 import make_mamba2_tree_forward

ADAPTER = ModelAdapter(
    name="granitemoehybrid",
    model_types=("granitemoehybrid",),
    mixers={"GraniteMoeHybridMambaLayer": make_mamba2_tree_forward()},
    attention=("GraniteMoeHybridAttention",),
)
