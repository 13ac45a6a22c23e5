"""Model adapters: route a hybrid layer's forward to tree verification, without forking model files.

An adapter names the recurrent mixer classes of one model family and gives the tree forward of each. `install`
wraps those modules' `forward` (instance attribute, like accelerate's hooks): the wrapper calls the family's
tree forward only when the cache passed in is a `HybridTreeCache` in tree mode, and the stock forward
otherwise, so prefill, plain `generate` and training see unchanged behaviour. Attention layers need no
routing: the tree is expressed through their 4D mask and position ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cache import HybridTreeCache

__all__ = ["ModelAdapter", "TreeForward", "find_mixer_cache", "ROUTED_FLAG"]

# (module, hidden_states [B, N, D], cache in tree mode) -> output [B, N, D]
TreeForward = Callable[[nn.Module, torch.Tensor, HybridTreeCache], torch.Tensor]

ROUTED_FLAG = "__hf_hybrid_spec_routed__"


def find_mixer_cache(args: tuple, kwargs: dict):
    """The cache argument of a mixer call, whatever transformers version named it."""
    for name in ("cache", "cache_params", "past_key_values"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    for a in args:
        if isinstance(a, HybridTreeCache):
            return a
    return None


@dataclass
class ModelAdapter:
    """How one model family runs a draft tree.

    Attributes:
        name: family name shown to users ("qwen3_5", "falcon_h1", ...).
        model_types: `config.model_type` values of the text model this adapter serves.
        mixers: class name of each recurrent mixer module -> its tree forward.
        kind: "sequential" (recurrent and attention layers alternate), "parallel" (both in every layer), or
            "attention" (no recurrent layer); used by the self-speculative drafters.
    """

    name: str
    model_types: tuple[str, ...]
    mixers: dict[str, TreeForward] = field(default_factory=dict)
    kind: str = "sequential"

    def mixer_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if type(m).__name__ in self.mixers]

    def install(self, model: nn.Module) -> None:
        """Route every recurrent mixer of `model` (idempotent)."""
        for module in self.mixer_modules(model):
            if getattr(module.forward, ROUTED_FLAG, False):
                continue
            module.forward = self._routed(module, module.forward, self.mixers[type(module).__name__])

    @staticmethod
    def _routed(module: nn.Module, original: Callable, tree_forward: TreeForward) -> Callable:
        @functools.wraps(original)
        def forward(*args, **kwargs):
            cache = find_mixer_cache(args, kwargs)
            if isinstance(cache, HybridTreeCache) and cache.in_tree_mode:
                hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                return tree_forward(module, hidden_states, cache)
            return original(*args, **kwargs)

        setattr(forward, ROUTED_FLAG, True)
        return forward
