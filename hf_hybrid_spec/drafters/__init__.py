"""Drafters behind one small interface (`Drafter`): each proposes a `DraftTree` per step.

`make_drafter(config, target, draft_model)` builds the drafter an `AssistantConfig` names, for one request, through
the registry (`hf_hybrid_spec.registry.DRAFTERS`): the built-in ones here (suffix, ngram, model, self_ssm,
layerskip), EAGLE-3 in `hf_hybrid_spec.eagle`, Hybrid Verified Decoding in `hf_hybrid_spec.hvd`, and any registered
since.
"""

from __future__ import annotations

from torch import nn

from ..config import AssistantConfig
from ..registry import DRAFTERS
from .base import DraftBudget, DraftContext, Drafter, TargetHidden, check_top_k, propose_within
from .batch import BatchDrafter, BatchHidden, PerRowDrafters, RowTokens
from .model import ModelDrafter, check_same_vocabulary
from .ngram import NgramDrafter
from .self_spec import LayerSkipDrafter, SelfSSMDrafter
from .suffix import SuffixDrafter, clear_global_suffix_cache

__all__ = [
    "Drafter",
    "BatchDrafter",
    "BatchHidden",
    "PerRowDrafters",
    "RowTokens",
    "propose_within",
    "DraftBudget",
    "DraftContext",
    "TargetHidden",
    "SuffixDrafter",
    "NgramDrafter",
    "ModelDrafter",
    "SelfSSMDrafter",
    "LayerSkipDrafter",
    "make_drafter",
    "make_batch_drafter",
    "check_top_k",
    "check_same_vocabulary",
    "clear_global_suffix_cache",
]


def make_drafter(config: AssistantConfig, target: nn.Module, draft_model: nn.Module | None = None) -> Drafter:
    """The drafter `config.drafter` names, for one request on `target`."""
    name = config.drafter
    if draft_model is not None and not DRAFTERS.takes_draft_model(name):
        hint = (" (an EagleDrafter drafts with drafter='eagle')"
                if getattr(getattr(draft_model, "config", None), "model_type", None) == "hf_hybrid_spec_eagle3" else "")
        raise ValueError(f"draft_model was given but the assistant config asks for the {name!r} drafter, which "
                         f"takes none{hint}")
    drafter = DRAFTERS.get(name)(config, target, draft_model)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"the factory of drafter {name!r} returned {type(drafter).__name__}, not a Drafter")
    return drafter


def make_batch_drafter(config: AssistantConfig, target: nn.Module, draft_model: nn.Module | None,
                       rows: int) -> BatchDrafter | None:
    """The batched form of the drafter `config.drafter` names, for a batch of `rows` on `target` (one drafter for
    every row), or None where it has none (the batch then gets one `make_drafter` per row)."""
    factory = DRAFTERS.get_batch(config.drafter)
    if factory is None:
        return None
    drafter = factory(config, target, draft_model, rows)
    if not isinstance(drafter, BatchDrafter):
        raise TypeError(f"the batch factory of drafter {config.drafter!r} returned {type(drafter).__name__}, not a "
                        "BatchDrafter")
    return drafter
