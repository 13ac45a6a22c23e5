"""The drafter interface: propose a token tree, hear what was accepted.

One drafter object serves one `generate` call (one request). The generate loop calls

    begin(input_ids, context, hidden)    # the prompt [1, L]; what the drafter may read about the target
    propose(input_ids, budget)           # committed tokens so far, root last -> DraftTree hanging off the root
    overlap()                            # the target's verify forward is launched, its result not yet read
    accept(input_ids, result, hidden)    # after verification: input_ids now ends with the new root
    end(input_ids)                       # the request is over
    release()                            # always last, also after a failed request: drop what it held

Only `propose` is required. `overlap` is where a drafter may do bookkeeping it deferred from an earlier `accept`:
on a GPU the host would otherwise sit waiting for the verify forward there (callers other than the loop may never
call it, so deferred work must also be done before anything reads it). A drafter that sets
`target_hidden_layers` receives the target's hidden states of those layers for every token the target ran (the
prompt at `begin`, the accepted path at `accept`), taken from the verify forward itself: no second target pass. Drafters that draft with the target's own
weights (self-speculation) may run tree-mode forwards on `context.cache` between steps, and must `abort()`
them: the committed state is the loop's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..tree import DraftTree, VerifyResult, empty_draft

if TYPE_CHECKING:
    from torch import nn
    from transformers import GenerationConfig

    from ..cache import HybridTreeCache
    from ..models import ModelAdapter

__all__ = ["Drafter", "DraftBudget", "DraftContext", "TargetHidden", "check_top_k", "committed_since",
           "propose_within"]


@dataclass
class DraftContext:
    """What a drafter may read about the target for one request.

    Attributes:
        target: the target model.
        cache: the target's cache, holding the committed state whenever the drafter is called.
        adapter: the target family's adapter (mixer routing, layer kinds).
        generation_config: the request's generation config.
        position_offsets: [R, B] multimodal RoPE offsets of the request (`VerifyTree.position_ids`), None for text
            models: a drafter that runs the target's own forward passes them on.
        draft_forward: in a batch on the eager backend, `(roots, drafts) -> logits [R, N, V]`: one tree forward of
            the running rows (row i its root `roots[i]` and the draft nodes of `drafts` row i, node j at index j + 1)
            on the committed cache, which is left as it was (`engine.batch`; for `BatchDrafter.drafts_on_target`).
    """

    target: nn.Module
    cache: HybridTreeCache
    adapter: ModelAdapter
    generation_config: GenerationConfig
    position_offsets: torch.Tensor | None = None
    draft_forward: Callable | None = None


@dataclass
class TargetHidden:
    """Target hidden states for the tokens the target just ran.

    Attributes:
        layers: the indices into the model's `hidden_states` output (0 = embeddings) that were asked for.
        states: one [1, T, H] tensor per index, for the T tokens in order (prompt tokens at `begin`, the
            accepted path root..leaf at `accept`).
    """

    layers: tuple[int, ...]
    states: tuple[torch.Tensor, ...]


@dataclass
class DraftBudget:
    """Limits for one proposal.

    Attributes:
        max_nodes: most draft nodes (the root excluded).
        max_depth: deepest node below the root (further tokens could not be committed anyway).
    """

    max_nodes: int
    max_depth: int


def check_top_k(top_k: int, model: nn.Module) -> None:
    """ValueError unless `top_k` children per node fit in `model`'s vocabulary."""
    vocab = model.config.get_text_config().vocab_size
    if top_k > vocab:
        raise ValueError(f"draft_top_k={top_k} exceeds the drafting model's vocabulary of {vocab} tokens")


def committed_since(input_ids: torch.Tensor, seen: int, result: VerifyResult) -> list[int]:
    """The committed tokens past the first `seen` of `input_ids` [1, L], as a list: the verifier's host copy when it
    has one and it covers exactly those (no device read), else read from `input_ids` (a stopping criterion cut the
    accepted run short, or the verifier kept no host copy)."""
    new = result.token_list
    if new is None or seen + len(new) != input_ids.shape[1]:
        new = input_ids[0, seen:].tolist()
    return new


class Drafter(ABC):
    name: str = "drafter"
    # Indices into the target's `hidden_states` output this drafter wants (empty: none, and no cost).
    target_hidden_layers: tuple[int, ...] = ()
    # True when `propose` never exceeds the budget it is given (nodes and depth): callers may then skip their own
    # trimming pass (the loop's and HVD's, on every step). A promise about a class's own `propose`: a subclass that
    # overrides `propose` makes none until it sets this itself (`__init_subclass__`).
    respects_budget: bool = False
    # False for a drafter that cannot serve one row of a batch as its own request (it reads or runs the target's
    # cache, which holds every row: the self-speculative drafters): batched generate then refuses it by name.
    per_row: bool = True
    # True for a drafter that follows the committed tokens alone: after steps it drafted nothing for (a batch's run of
    # plain steps, `engine.batch`), `catch_up` with their tokens brings it level, with no verify result to read.
    # A batch whose drafting stops paying runs such plain runs only with drafters that say so.
    catches_up: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "propose" in cls.__dict__ and "respects_budget" not in cls.__dict__:
            cls.respects_budget = False

    def begin(self, input_ids: torch.Tensor, context: DraftContext, hidden: TargetHidden | None = None) -> None:
        """A new request starts with prompt `input_ids` [1, L]."""

    @abstractmethod
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        """Draft continuations of `input_ids` [1, L] (its last token is the root)."""

    def overlap(self) -> None:
        """The target's forward over this step's draft has been launched and its result is not read yet: on an
        asynchronous device the host is idle until then. For deferred bookkeeping (see the module docstring)."""

    def accept(self, input_ids: torch.Tensor, result: VerifyResult, hidden: TargetHidden | None = None) -> None:
        """The target committed `result.tokens`; `input_ids` [1, L'] is the whole committed sequence."""

    @property
    def ready(self) -> bool:
        """Whether `propose` could draft without first catching up on bookkeeping it deferred (`settle`)."""
        return True

    def settle(self, stop: Callable[[], bool] | None = None) -> bool:
        """Do deferred bookkeeping now, with `stop` (checked now and then) until it returns True; returns `ready`.
        A batch calls it in the host's idle time (`PerRowDrafters.idle`); `propose` must not rely on it."""
        return True

    def catch_up(self, tokens: list[int]) -> None:
        """Only for a drafter that `catches_up`: `tokens` (host ints, in order) were committed right after the last
        tokens it saw (by `begin`, `accept` or `catch_up`), by steps it was not asked to draft for. Default: nothing
        (a `propose` that reads what it has not seen from its `input_ids` needs nothing more)."""

    def end(self, input_ids: torch.Tensor) -> None:
        """The request finished with `input_ids` [1, L]."""

    def handoff(self, input_ids: torch.Tensor) -> object | None:
        """In place of `end`: the request finished with `input_ids` [1, L], and what a later request whose prompt
        extends these tokens may start from (`adopt`), given up by this drafter; None when it has nothing to hand on
        (the default, which is `end`). The serving engine keeps it beside the prefix store's state (its size counted
        through an `nbytes()` method where it has one)."""
        self.end(input_ids)
        return None

    def adopt(self, state: object) -> None:
        """Before `begin`: `state` is an earlier request's `handoff`, over tokens the coming prompt starts with (the
        drafter checks that before it relies on it). Default: ignored."""

    def prefeed(self, tokens: list[int]) -> None:
        """Before `begin`: `tokens` are the coming prompt's first tokens, a prefix that grows from call to call (a
        chunked prefill's chunks, while the device runs their forward), and a drafter may do `begin`'s work over
        them ahead of time. `begin` still gets the whole prompt. Default: ignored."""

    def release(self) -> None:
        """Drop what this request holds (leased static storage, caches), without learning from it: called after
        `end`, and in its place when the request failed (the drafter's state may then be half-updated)."""


def propose_within(drafter: Drafter, ids: torch.Tensor, budget: DraftBudget, ask_empty: bool = False) -> DraftTree:
    """`drafter`'s proposal for `ids` [1, L] cut to `budget` (an empty draft where nothing can be drafted). With
    `ask_empty` the drafter is asked even where the budget leaves no depth (a rule that reads the draft's own choice
    after the root)."""
    if budget.max_depth <= 0 and not ask_empty:
        return empty_draft(1, "cpu")
    draft = drafter.propose(ids, budget)
    if draft is None or (draft.num_nodes == 0 and draft.next_probs is None):
        return empty_draft(1, "cpu")
    if not drafter.respects_budget:  # a depth walk per step that budget-keeping drafters do not need
        draft = draft.truncate_depth(budget.max_depth)
    if draft.num_nodes > budget.max_nodes:
        draft = draft.select(torch.arange(budget.max_nodes, device=draft.tokens.device))
    return draft
