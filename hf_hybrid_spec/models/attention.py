"""Attention-only decoders (Llama, Qwen2/3, Mistral, ...): nothing to route, the tree lives in the mask."""

from .base import ModelAdapter

ADAPTER = ModelAdapter(
    name="attention",
    model_types=("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "olmo", "olmo2", "granite", "smollm3"),
    kind="attention",
)
