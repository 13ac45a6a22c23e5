"""A decoding request as `generate` prepared it, and the drafter's proposal within a step's budget: what the one-row
loop (`loop`) and the batch loop (`batch`) share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..config import AssistantConfig
from ..drafters import DraftBudget, Drafter
from ..models import ModelAdapter
from ..tree import empty_draft
from ..verification import Verifier

__all__ = ["Request", "propose"]


@dataclass
class Request:
    """One decoding call, as `generate` prepared it.

    Attributes:
        model / adapter: the target and its family's adapter. input_ids: [1, L] the prompt.
        processors / stopping / generation_config / streamer: what stock decoding would use.
        config: the resolved `AssistantConfig` (`compile` a bool). drafter: built for this request.
        model_kwargs: the remaining model inputs (attention mask, multimodal prompt inputs, position ids).
        row_drafters: for a batch (input_ids [B > 1, L]), one drafter per row (`drafter` is the first).
    """

    model: nn.Module
    adapter: ModelAdapter
    input_ids: torch.Tensor
    processors: LogitsProcessorList
    stopping: StoppingCriteriaList
    generation_config: GenerationConfig
    streamer: object
    config: AssistantConfig
    drafter: Drafter
    model_kwargs: dict
    row_drafters: list[Drafter] | None = None


def propose(drafter: Drafter, ids: torch.Tensor, budget: DraftBudget, verifier: Verifier):
    """The drafter's proposal within `budget` (an empty draft where nothing can be drafted). A rule that reads the
    draft's own choice after the root (`verifier.wants_empty_drafts`) asks even then."""
    if budget.max_depth <= 0 and not verifier.wants_empty_drafts:
        return empty_draft(1, "cpu")
    draft = drafter.propose(ids, budget)
    if draft is None or (draft.num_nodes == 0 and draft.next_probs is None):
        return empty_draft(1, "cpu")
    if not drafter.respects_budget:  # a depth walk per step that budget-keeping drafters do not need
        draft = draft.truncate_depth(budget.max_depth)
    if draft.num_nodes > budget.max_nodes:
        draft = draft.select(torch.arange(budget.max_nodes, device=draft.tokens.device))
    return draft
