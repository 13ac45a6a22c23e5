"""Model-family adapters and their registry.

`get_adapter(model)` returns the adapter of a supported model and installs its routing (idempotent); any other
model gets a ValueError that lists the supported families.
"""

from __future__ import annotations

from torch import nn

from . import attention, bamba, falcon_h1, granitemoehybrid, jamba, lfm2, nemotron_h, qwen3_5, qwen3_next
from .base import ModelAdapter
from .gated_deltanet import SUPPORTED_CONV_ACTIVATIONS
from .tree_attention import TREE_ATTENTION

__all__ = ["ModelAdapter", "get_adapter", "ADAPTERS", "supported_model_types"]

ADAPTERS: tuple[ModelAdapter, ...] = (
    qwen3_5.ADAPTER,
    qwen3_next.ADAPTER,
    falcon_h1.ADAPTER,
    bamba.ADAPTER,
    nemotron_h.ADAPTER,
    granitemoehybrid.ADAPTER,
    lfm2.ADAPTER,
    jamba.ADAPTER,
    attention.ADAPTER,
)
_BY_TYPE = {t: a for a in ADAPTERS for t in a.model_types}

# 4D tree masks need an attention kernel that takes an arbitrary additive mask.
# (TREE_ATTENTION: sdpa layers while the fused verify forward routes them to our kernel.)
TREE_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", None, TREE_ATTENTION)


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def _model_types(model: nn.Module) -> list[str]:
    config = model.config
    types = [getattr(config, "model_type", None)]
    get_text = getattr(config, "get_text_config", None)
    if get_text is not None:
        types.append(getattr(get_text(), "model_type", None))
    return [t for t in types if t]


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for `model`, with its mixers routed. Raises ValueError for unsupported models."""
    types = _model_types(model)
    adapter = next((_BY_TYPE[t] for t in types if t in _BY_TYPE), None)
    if adapter is None:
        families = ", ".join(f"{a.name} ({'/'.join(a.model_types)})" for a in ADAPTERS)
        raise ValueError(
            f"hf_hybrid_spec does not support model type {types[0] if types else type(model).__name__!r} yet. "
            f"Supported families: {families}."
        )
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in TREE_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"speculative tree verification needs an attention implementation that accepts a 4D mask "
            f"(sdpa or eager); this model uses {impl!r}. Load it with attn_implementation='sdpa'."
        )
    if adapter.mixers and not adapter.mixer_modules(model):
        raise ValueError(
            f"{type(model).__name__} is registered as {adapter.name} but none of its modules is one of "
            f"{sorted(adapter.mixers)}; this transformers version may have renamed them."
        )
    _check_conv_activations(model, adapter)
    adapter.install(model)
    return adapter


def _check_conv_activations(model: nn.Module, adapter: ModelAdapter) -> None:
    """ValueError, naming the first layer, where a recurrent mixer's short conv uses an activation the tree ops do not
    compute (they compute silu or none): refused when the model is enabled, not at its first verify."""
    mixers = set(adapter.mixer_modules(model))
    for name, module in model.named_modules():
        activation = getattr(module, "activation", None)
        if module in mixers and isinstance(activation, str) and activation not in SUPPORTED_CONV_ACTIVATIONS:
            raise ValueError(f"{name} ({type(module).__name__}) applies a {activation!r} activation after its "
                             f"convolution; tree verification computes {' / '.join(SUPPORTED_CONV_ACTIVATIONS)} only")
