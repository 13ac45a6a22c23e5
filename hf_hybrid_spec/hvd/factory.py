"""Building the HVD drafter a config names (`AssistantConfig(drafter="hvd")`), its model drafter and cost profile.

The registry's factory for "hvd" (`from_config`): it may profile costs through the decoding loop
(`profiling.profile_costs`), so it sits above the loop, where nothing below imports it.
"""

from __future__ import annotations

import os

from torch import nn
from transformers.utils import logging

from ..drafters.base import Drafter
from .cost import CostProfile, cached_profile, profile_key
from .drafter import HybridDrafter
from .policy import LearnedPolicy, ThresholdPolicy
from .profiling import profile_costs

logger = logging.get_logger(__name__)

__all__ = ["from_config", "make_hvd_drafter", "make_model_drafter", "make_cost_profile"]


def make_model_drafter(config, target: nn.Module, draft_model) -> Drafter:
    """The model drafter for `drafter="hvd"`: an `EagleTreeDrafter` for an `EagleDrafter`, a `ModelDrafter` for any
    other causal LM with the target's vocabulary, or a `Drafter` instance as it is."""
    from ..drafters import ModelDrafter, check_same_vocabulary, check_top_k
    from ..eagle import EagleDrafter
    from ..eagle.drafter import from_config as eagle_from_config

    if draft_model is None:
        raise ValueError("drafter='hvd' needs a model drafter: pass draft_model= an EagleDrafter "
                         "(EagleDrafter.from_pretrained(...)) or an assistant causal LM with the target's tokenizer; "
                         "for cache drafts alone use drafter='suffix'")
    if isinstance(draft_model, Drafter):
        return draft_model
    if isinstance(draft_model, EagleDrafter):
        return eagle_from_config(config, target, draft_model)
    if not isinstance(draft_model, nn.Module):
        raise TypeError("draft_model must be an EagleDrafter, a causal LM or a Drafter, got "
                        f"{type(draft_model).__name__}")
    check_same_vocabulary(target, draft_model)
    check_top_k(config.draft_top_k, draft_model)
    return ModelDrafter(draft_model, top_k=config.draft_top_k)


def make_cost_profile(config, target: nn.Module, draft_model) -> CostProfile:
    """`config.hvd_cost_profile` loaded when it names a file (read only: FileNotFoundError when it does not exist);
    otherwise profiled on this machine, once per process for a target / device / dtype / model drafter, and kept in
    memory. Nothing is written: a config (maybe downloaded) never chooses where the library writes."""
    from ..drafters import make_drafter

    path = config.hvd_cost_profile
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"hvd_cost_profile: no such file: {path!r} (leave it None to profile this "
                                    "machine; save a profile with CostProfile.save)")
        return CostProfile.load(path)
    probe = make_model_drafter(config, target, draft_model)
    key = (profile_key(target, probe), config.hvd_model_tokens, config.hvd_model_depth, config.max_depth,
           config.max_draft_tokens, config.compile, config.compile_verify)

    def measure() -> CostProfile:
        logger.info("HVD: profiling draft and verify costs on this machine (once per process)")
        cache = make_drafter(config.replace(drafter="suffix", global_cache=False), target)
        return profile_costs(target, cache, probe, model_tokens=config.hvd_model_tokens,
                             model_depth=min(config.hvd_model_depth, config.max_depth), max_depth=config.max_depth,
                             tree_sizes=tuple(sorted({1, 2, 4, 8, 16, 32, 64, config.max_draft_tokens + 1})),
                             compile=config.compile, compile_verify=config.compile_verify)

    return cached_profile(key, measure)


def make_hvd_drafter(config, target: nn.Module, draft_model) -> HybridDrafter:
    """The drafter `AssistantConfig(drafter="hvd")` names (policies "threshold" and "learned")."""
    from ..drafters import make_drafter
    from .modeling import load_predictor

    model_drafter = make_model_drafter(config, target, draft_model)
    if config.hvd_policy == "threshold":
        policy, cost = ThresholdPolicy(config.hvd_threshold), None
    else:
        policy = LearnedPolicy(load_predictor(os.fspath(config.hvd_predictor)),
                               probe_budget=float(config.hvd_probe_budget))
        cost = make_cost_profile(config, target, draft_model)
    cache_drafter = make_drafter(config.replace(drafter="suffix"), target)
    return HybridDrafter(cache_drafter, model_drafter, policy, cost,
                         model_tokens=config.hvd_model_tokens, model_depth=config.hvd_model_depth,
                         allow_merge=config.hvd_merge)


from_config = make_hvd_drafter
