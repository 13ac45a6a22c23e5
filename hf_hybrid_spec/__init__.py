"""hf_hybrid_spec: exact speculative decoding (chains and trees) for hybrid models in transformers.

    from hf_hybrid_spec import AssistantConfig, speculative_generate
    out = model.generate(**inputs, custom_generate=speculative_generate,
                         assistant_config=AssistantConfig(drafter="suffix"), return_dict_in_generate=True)
    out.sequences   # identical to plain greedy generate
    out.spec_stats  # target forwards, accepted lengths, drafted tokens

Layers (imports point one way): kernels -> cache -> models (adapters) -> drafters -> verify -> generate.
"""

from .cache import HybridTreeCache
from .config import AssistantConfig
from .drafters import Drafter, DraftBudget, ModelDrafter, NgramDrafter, SuffixDrafter, clear_global_suffix_cache
from .generate import SpeculativeDecoderOnlyOutput, SpecStats, enable, speculative_generate
from .models import get_adapter, supported_model_types
from .tree import DraftTree, VerifyTree
# Self-speculative drafters (issue #5).
from .drafters import LayerSkipDrafter, SelfSSMDrafter

__version__ = "0.1.0"

__all__ = [
    "AssistantConfig",
    "speculative_generate",
    "enable",
    "SpecStats",
    "SpeculativeDecoderOnlyOutput",
    "HybridTreeCache",
    "DraftTree",
    "VerifyTree",
    "Drafter",
    "DraftBudget",
    "SuffixDrafter",
    "NgramDrafter",
    "ModelDrafter",
    "clear_global_suffix_cache",
    "get_adapter",
    "supported_model_types",
    "SelfSSMDrafter",
    "LayerSkipDrafter",
]
