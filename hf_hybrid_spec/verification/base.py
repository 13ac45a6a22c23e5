"""The verification interface: one rule decides which draft tokens the target keeps.

The loop calls, per request,

    first_token(scores, FirstToken(...))   # after the prefill: the first new token from the prompt's scores [1, V]
    verify(tree, scores, StepInputs(...))  # every step: the committed path and tokens of one verify tree

with the target's processed scores (the user's logits processors applied per node). Rules are registered by name
(`hf_hybrid_spec.registry.register_verification`) and built per request from the config: `"lossless"` is
`exact.ExactVerifier` (greedy or sampling), the lossy opt-in rules are `arbitrated.ArbitratedVerifier`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..tree import VerifyResult, VerifyTree

if TYPE_CHECKING:
    from ..drafters import DraftContext, Drafter, TargetHidden

__all__ = ["Verifier", "FirstToken", "StepInputs"]


@dataclass
class FirstToken:
    """What a rule may read to choose the first new token.

    Attributes:
        input_ids: [1, L] the prompt.
        drafter: the request's drafter, begun on the prompt (a rule may ask it for its own choice).
        context: the drafter's view of the target.
        prompt_hidden: the hidden states the drafter asked for, of the prompt.
        outputs: the prefill's model outputs (hidden states when the rule asked for them).
        max_nodes: the request's draft budget.
        row: the request's row in its batch (sampling rules draw each row's tokens apart).
    """

    input_ids: torch.Tensor
    drafter: Drafter
    context: DraftContext
    prompt_hidden: TargetHidden | None
    outputs: Any
    max_nodes: int
    row: int = 0


@dataclass
class StepInputs:
    """What a rule may read besides the tree and its scores: `length`, the committed tokens (the root is the last of
    them, padding not counted), the verify forward's hidden states (every layer's [1, N, H], when the rule asked for
    them), and the request's `row` in its batch."""

    length: int
    hidden_states: tuple[torch.Tensor, ...] | None = None
    row: int = 0


class Verifier(ABC):
    """One verification rule (see the module docstring).

    Attributes:
        uses_target_hidden: the rule reads the target's hidden states of every tree node (`StepInputs`).
        raw_greedy: picking each node's argmax of the raw logits gives the rule's path when no logits processor is
            set and no scores are returned (the loop then skips an fp32 copy of [N, V]).
        wants_empty_drafts: the rule reads the drafter's own choice after the root even where nothing can be drafted
            (the drafter is asked for a proposal at depth 0 then).
    """

    uses_target_hidden: bool = False
    raw_greedy: bool = False
    wants_empty_drafts: bool = False

    @abstractmethod
    def first_token(self, scores: torch.Tensor, inputs: FirstToken) -> VerifyResult:
        """The first new token from the prefill's processed scores [1, V] (path [0], one token)."""

    @abstractmethod
    def verify(self, tree: VerifyTree, scores: torch.Tensor, inputs: StepInputs) -> VerifyResult:
        """Verify `tree` against its nodes' processed scores [N, V]."""
