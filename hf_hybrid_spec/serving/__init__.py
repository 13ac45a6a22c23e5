"""Serving: continuous batching with tree speculation for hybrid models (`engine`), prefix reuse across calls
(`prefix`), engines stepped in turn (`lanes`), the transformers-shaped API on top (`manager`: `generate_batch`,
`init_continuous_batching`), and an OpenAI-compatible server (`server`, needs the `[serve]` extra)."""

from .engine import ServingConfig, ServingEngine, ServingRequest, ServingStats, SpecGenerationOutput
from .lanes import ServingLanes, make_engine
from .manager import ContinuousBatchingManager, generate_batch, init_continuous_batching
from .prefix import PrefixHit, PrefixStore

__all__ = ["ServingConfig", "ServingEngine", "ServingLanes", "make_engine", "ServingRequest", "SpecGenerationOutput",
           "ServingStats", "ContinuousBatchingManager", "generate_batch", "init_continuous_batching", "PrefixStore",
           "PrefixHit"]
