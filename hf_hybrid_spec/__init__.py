"""hf_hybrid_spec: exact speculative decoding (chains and trees) for hybrid models in transformers.

    from hf_hybrid_spec import AssistantConfig, speculative_generate
    out = model.generate(**inputs, custom_generate=speculative_generate,
                         assistant_config=AssistantConfig(drafter="suffix"), return_dict_in_generate=True)
    out.sequences   # identical to plain greedy generate
    out.spec_stats  # target forwards, accepted lengths, drafted tokens

Layers (imports point one way): kernels -> cache -> models (adapters) -> drafters -> verification -> engine ->
generate (the API). docs/design.md draws them.

The names below are imported on first use (PEP 562): `import hf_hybrid_spec` itself costs almost nothing, and
only what a program touches pulls in transformers' generation and modeling code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "AssistantConfig": "config",
    "speculative_generate": "generate",
    "enable": "generate",
    "SpecStats": "generate",
    "SpeculativeDecoderOnlyOutput": "generate",
    "HybridTreeCache": "cache",
    "DraftTree": "tree",
    "VerifyTree": "tree",
    "Drafter": "drafters",
    "DraftBudget": "drafters",
    "SuffixDrafter": "drafters",
    "NgramDrafter": "drafters",
    "ModelDrafter": "drafters",
    "SelfSSMDrafter": "drafters",
    "LayerSkipDrafter": "drafters",
    "clear_global_suffix_cache": "drafters",
    "get_adapter": "models",
    "supported_model_types": "models",
    "generate_batch": "serving",
    "init_continuous_batching": "serving",
    "ServingConfig": "serving",
}

__all__ = [
    "AssistantConfig", "DraftBudget", "DraftTree", "Drafter", "HybridTreeCache", "LayerSkipDrafter", "ModelDrafter",
    "NgramDrafter", "SelfSSMDrafter", "SpecStats", "SpeculativeDecoderOnlyOutput", "SuffixDrafter", "VerifyTree",
    "clear_global_suffix_cache", "enable", "get_adapter", "speculative_generate", "supported_model_types",
    "generate_batch", "init_continuous_batching", "ServingConfig",
]

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .cache import HybridTreeCache
    from .config import AssistantConfig
    from .drafters import (
        DraftBudget,
        Drafter,
        LayerSkipDrafter,
        ModelDrafter,
        NgramDrafter,
        SelfSSMDrafter,
        SuffixDrafter,
        clear_global_suffix_cache,
    )
    from .generate import SpecStats, SpeculativeDecoderOnlyOutput, enable, speculative_generate
    from .models import get_adapter, supported_model_types
    from .serving import ServingConfig, generate_batch, init_continuous_batching
    from .tree import DraftTree, VerifyTree


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
