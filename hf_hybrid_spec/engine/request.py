"""A decoding request as `generate` prepared it, and the drafter's proposal within a step's budget: what the one-row
loop (`loop`) and the batch loop (`batch`) share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..config import AssistantConfig
from ..drafters import BatchDrafter, DraftBudget, Drafter, propose_within
from ..models import ModelAdapter
from ..verification import Verifier

__all__ = ["Request", "propose"]


@dataclass
class Request:
    """One decoding call, as `generate` prepared it.

    Attributes:
        model / adapter: the target and its family's adapter. input_ids: [1, L] the prompt.
        processors / stopping / generation_config / streamer: what stock decoding would use.
        config: the resolved `AssistantConfig` (`compile` a bool). drafter: built for this request (None for a batch).
        model_kwargs: the remaining model inputs (attention mask, multimodal prompt inputs, position ids).
        batch_drafter: for a batch (input_ids [B > 1, L]), its drafter (one per row, or one with a batched form).
    """

    model: nn.Module
    adapter: ModelAdapter
    input_ids: torch.Tensor
    processors: LogitsProcessorList
    stopping: StoppingCriteriaList
    generation_config: GenerationConfig
    streamer: object
    config: AssistantConfig
    drafter: Drafter | None
    model_kwargs: dict
    batch_drafter: BatchDrafter | None = None


def propose(drafter: Drafter, ids: torch.Tensor, budget: DraftBudget, verifier: Verifier):
    """The drafter's proposal within `budget` (`drafters.propose_within`); a rule that reads the draft's own choice
    after the root (`verifier.wants_empty_drafts`) asks even where the budget leaves no depth."""
    return propose_within(drafter, ids, budget, verifier.wants_empty_drafts)
