"""Drafters behind one small interface (`Drafter`): each proposes a `DraftTree` per step.

`make_drafter(config, target, draft_model)` builds the drafter an `AssistantConfig` names, for one request.
"""

from __future__ import annotations

from torch import nn

from ..config import AssistantConfig
from .base import DraftBudget, DraftContext, Drafter, HistoryHidden, TargetHidden
from .model import ModelDrafter, check_same_vocabulary
from .ngram import NgramDrafter
from .self_spec import LayerSkipDrafter, SelfSSMDrafter
from .suffix import SuffixDrafter, clear_global_suffix_cache

__all__ = [
    "Drafter",
    "DraftBudget",
    "DraftContext",
    "HistoryHidden",
    "TargetHidden",
    "SuffixDrafter",
    "NgramDrafter",
    "ModelDrafter",
    "SelfSSMDrafter",
    "LayerSkipDrafter",
    "make_drafter",
    "clear_global_suffix_cache",
]


def check_top_k(top_k: int, model: nn.Module) -> None:
    """ValueError unless `top_k` children per node fit in `model`'s vocabulary."""
    vocab = model.config.get_text_config().vocab_size
    if top_k > vocab:
        raise ValueError(f"draft_top_k={top_k} exceeds the drafting model's vocabulary of {vocab} tokens")


def make_drafter(config: AssistantConfig, target: nn.Module, draft_model: nn.Module | None = None) -> Drafter:
    # EAGLE-3 (issue #4): imported here because hf_hybrid_spec.eagle builds on this package.
    from ..eagle.modeling import EagleDrafter

    if config.drafter == "eagle":
        from ..eagle.drafter import make_eagle_drafter

        return make_eagle_drafter(config, target, draft_model)
    if config.drafter == "hvd":
        # Hybrid Verified Decoding (issue #6): hf_hybrid_spec.hvd combines this package's drafters.
        from ..hvd.drafter import make_hvd_drafter

        return make_hvd_drafter(config, target, draft_model)
    if isinstance(draft_model, EagleDrafter):
        raise ValueError("draft_model is an EagleDrafter: pass assistant_config=AssistantConfig(drafter='eagle', ...)")
    if config.drafter != "model" and draft_model is not None:
        raise ValueError(f"draft_model was given but the assistant config asks for the {config.drafter!r} drafter")
    if config.drafter == "suffix":
        text_config = target.config.get_text_config()
        key = (getattr(target.config, "_name_or_path", ""), text_config.vocab_size)
        return SuffixDrafter(
            cache_key=key,
            max_match_length=config.max_match_length,
            max_depth=config.max_depth,
            max_spec_factor=config.max_spec_factor,
            max_spec_offset=config.max_spec_offset,
            min_token_prob=config.min_token_prob,
            use_global=config.global_cache,
            max_cached_outputs=config.max_cached_outputs,
            tree=config.tree,
        )
    if config.drafter == "ngram":
        return NgramDrafter(ngram_size=config.ngram_size, num_tokens=config.max_draft_tokens)
    if config.drafter == "model":
        if draft_model is None:
            raise ValueError("the 'model' drafter needs a draft model: pass draft_model= (or assistant_model= after enable())")
        check_same_vocabulary(target, draft_model)
        check_top_k(config.draft_top_k, draft_model)
        return ModelDrafter(draft_model, top_k=config.draft_top_k)
    check_top_k(config.draft_top_k, target)
    if config.drafter == "self_ssm":
        return SelfSSMDrafter(target, variant=config.ssm_variant, ssm_scale=config.ssm_scale, top_k=config.draft_top_k)
    if config.drafter == "layerskip":
        return LayerSkipDrafter(target, exit_layer=config.exit_layer, top_k=config.draft_top_k)
    raise ValueError(f"unknown drafter {config.drafter!r}")
