"""The drafter interface: propose a token tree, hear what was accepted.

One drafter object serves one `generate` call (one request). The generate loop calls

    begin(input_ids)                 # the prompt, [1, L]
    propose(input_ids, budget)       # committed tokens so far, root last -> DraftTree hanging off the root
    accept(input_ids, result)        # after verification: input_ids now ends with the new root
    end(input_ids)                   # the request is over

Only `propose` is required. A drafter never sees or touches the target's cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..tree import DraftTree
from ..verify import VerifyResult

__all__ = ["Drafter", "DraftBudget"]


@dataclass
class DraftBudget:
    """Limits for one proposal.

    Attributes:
        max_nodes: most draft nodes (the root excluded).
        max_depth: deepest node below the root (further tokens could not be committed anyway).
    """

    max_nodes: int
    max_depth: int


class Drafter(ABC):
    name: str = "drafter"

    def begin(self, input_ids: torch.Tensor) -> None:
        """A new request starts with prompt `input_ids` [1, L]."""

    @abstractmethod
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        """Draft continuations of `input_ids` [1, L] (its last token is the root)."""

    def accept(self, input_ids: torch.Tensor, result: VerifyResult) -> None:
        """The target committed `result.tokens`; `input_ids` [1, L'] is the whole committed sequence."""

    def end(self, input_ids: torch.Tensor) -> None:
        """The request finished with `input_ids` [1, L]."""
