"""Serving: continuous batching with tree speculation for hybrid models (`engine`), prefix reuse across calls
(`prefix`), the transformers-shaped API on top (`manager`: `generate_batch`, `init_continuous_batching`), and an
OpenAI-compatible server (`server`, needs the `[serve]` extra)."""

from .engine import ServingConfig, ServingEngine, ServingRequest, ServingStats, SpecGenerationOutput
from .manager import ContinuousBatchingManager, generate_batch, init_continuous_batching
from .prefix import PrefixHit, PrefixStore

__all__ = ["ServingConfig", "ServingEngine", "ServingRequest", "SpecGenerationOutput", "ServingStats", "ContinuousBatchingManager",
           "generate_batch", "init_continuous_batching", "PrefixStore", "PrefixHit"]
