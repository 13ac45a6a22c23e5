"""Drafting for every row of a batch: the batch loop's view of its drafters.

The batch loop (`engine.batch`) talks to one `BatchDrafter` for all B rows:

    begin(prompts, context, hidden)          # each row's prompt [1, P_b] (no padding); the prompts' hidden states
    propose(rows, ids, budgets)              # the running rows' committed tokens -> their drafts as one DraftBatch
    overlap()                                # the verify forward is launched, its result not yet read
    accept(rows, ids, results, hidden)       # after verification: each running row's result and path hidden states
    end(ids) / release()

`PerRowDrafters` runs one `Drafter` per row behind it (suffix tries, n-gram indexes, assistant caches: per-row state
that has no batched form, or a list of the user's own drafters). A drafter with a batched form (EAGLE's head drafts
every row's tree in one expansion, `eagle.batch`) implements `BatchDrafter` itself and is built through the registry's
batch factory (`registry.DRAFTERS.register(..., batch_factory=...)`), so one expansion per step serves the whole
batch instead of one per row.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from ..tree import DraftBatch, VerifyResult, empty_draft
from .base import DraftBudget, DraftContext, Drafter, TargetHidden, propose_within

__all__ = ["BatchHidden", "BatchDrafter", "PerRowDrafters", "RowTokens"]


@dataclass
class BatchHidden:
    """The target's hidden states of what each row of a batch just ran.

    Attributes:
        layers: the indices into the model's `hidden_states` output that were asked for.
        states: one [R, T, H] tensor per index; row i's tokens are `states[j][i, start[i] : start[i] + count[i]]`
            (its left-padded prompt at `begin`, its accepted path root..leaf at `accept`).
        start: [R] first position of each row's tokens. count: [R] how many tokens each row ran.
    """

    layers: tuple[int, ...]
    states: tuple[torch.Tensor, ...]
    start: list[int]
    count: list[int]

    def row(self, i: int) -> TargetHidden:
        """Row i's hidden states as one request's `TargetHidden` ([1, count[i], H] views)."""
        a, b = self.start[i], self.start[i] + self.count[i]
        return TargetHidden(self.layers, tuple(s[i : i + 1, a:b] for s in self.states))


class RowTokens(Sequence):
    """The running rows' committed tokens: item i is row i's [1, L_i] tensor, made when first asked for (a drafter
    that needs only their lengths makes none: at B = 64 one view per row and step is a measurable part of a step).

    Args:
        read: i -> row i's tokens. lengths: [R] each row's committed length.
    """

    def __init__(self, read: Callable[[int], torch.Tensor], lengths: list[int]):
        self._read, self.lengths = read, lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._read(j) for j in range(len(self))[i]]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return self._read(i % len(self))


class BatchDrafter(ABC):
    """Drafts for the rows of one batch request (see the module docstring). Rows are named by their index in the
    batch (0 .. B-1); `rows` lists the running ones, and `ids[i]` (a `RowTokens`) is row `rows[i]`'s committed tokens
    [1, L] (its last token the root)."""

    name: str = "drafter"
    # Indices into the target's `hidden_states` output the drafter reads (empty: none, and no cost).
    target_hidden_layers: tuple[int, ...] = ()
    # A drafter that drafts every row on the device sets this and has `max_depth` (its trees' depth) and
    # `propose_device(max_nodes) -> tree.DeviceDrafts` (every row's tree, left on the device),
    # `accept_device(counts, tokens, hidden)` (each row's committed count [R], tokens [R, C] and path hidden states
    # [R, C, H] per layer, all device tensors) and `advance_host(counts)` (the same counts, read back later): greedy
    # batches on the static path then run the pipelined step (`engine.pipeline`), which never reads drafts back.
    supports_device: bool = False
    # A drafter that drafts with the target's own forwards (`DraftContext.draft_forward`, under a restriction of the
    # model that captured graphs would not see) sets this: its batches run on the eager backend.
    drafts_on_target: bool = False
    # A drafter that can be left out of steps (a run of plain steps) and brought level after them by `catch_up` sets
    # this: a batch whose drafting stops paying then runs plain steps without it (`engine.batch`).
    catches_up: bool = False

    def begin(self, prompts: list[torch.Tensor], context: DraftContext, hidden: BatchHidden | None) -> None:
        """The batch starts: `prompts[b]` is row b's prompt [1, P_b] without its padding."""

    def timing_key(self) -> Hashable | None:
        """For a drafter with device drafting: what one draft's cost depends on besides the device, the rows and the
        nodes (its weights and settings, e.g. compiled or not). The pipelined step times a draft once per process
        for each key and reuses it across calls; None (the default) times it at every call."""
        return None

    @abstractmethod
    def propose(self, rows: list[int], ids: RowTokens, budgets: list[DraftBudget]) -> DraftBatch:
        """The running rows' drafts (row i of the batch for row `rows[i]`), each within its row's budget."""

    def overlap(self) -> None:
        """The target's verify forward is launched and its result not read yet (see `Drafter.overlap`)."""

    def accept(self, rows: list[int], ids: RowTokens, results: list[VerifyResult],
               hidden: BatchHidden | None) -> None:
        """The running rows committed `results[i]`; `ids[i]` is row `rows[i]`'s whole committed sequence, and
        `hidden` their path's hidden states (None for the first token after the prompt)."""

    def catch_up(self, rows: list[int], tokens: list[list[int]]) -> None:
        """For a drafter that `catches_up`: row `rows[i]` committed `tokens[i]` (host ints) right after the last tokens
        the drafter saw, in steps it drafted nothing for."""

    def idle(self, busy: Callable[[], bool]) -> None:
        """The host has nothing to do while `busy()` (the device computes a step it launched): deferred bookkeeping
        may run until it returns False."""

    def limit_host(self, seconds: float | None) -> None:
        """From now on, the host time `propose` may spend on bookkeeping it deferred before drafting, per call (rows
        not caught up within it draft nothing this step); None: no limit (every row drafts from all it saw)."""

    def end(self, ids: list[torch.Tensor]) -> None:
        """The batch finished; `ids[b]` is row b's committed tokens."""

    def release(self) -> None:
        """Drop what the batch holds; called after `end`, and in its place when the request failed."""


class PerRowDrafters(BatchDrafter):
    """One `Drafter` per row, each fed its own row as a request of its own.

    Args:
        drafters: one per batch row. ask_empty: ask for drafts even where the budget leaves no depth
            (`propose_within`; a rule that reads the draft's own choice after the root).
    """

    def __init__(self, drafters: list[Drafter], ask_empty: bool = False):
        self.drafters = list(drafters)
        self.name = self.drafters[0].name
        self.target_hidden_layers = tuple(self.drafters[0].target_hidden_layers)
        self.ask_empty = ask_empty
        self.catches_up = all(drafter.catches_up for drafter in self.drafters)
        self.host_limit: float | None = None  # `limit_host`

    def begin(self, prompts: list[torch.Tensor], context: DraftContext, hidden: BatchHidden | None) -> None:
        for b, (drafter, prompt) in enumerate(zip(self.drafters, prompts)):
            drafter.begin(prompt, context, None if hidden is None else hidden.row(b))

    def propose(self, rows: list[int], ids: RowTokens, budgets: list[DraftBudget]) -> DraftBatch:
        late: set[int] = set()
        if self.host_limit is not None and not self.ask_empty:
            # A row whose drafter still has deferred bookkeeping (a suffix trie not yet over its whole prompt) settles
            # within what is left of the limit, or drafts nothing this step: its bookkeeping waits for idle time.
            deadline = time.perf_counter() + self.host_limit
            stop = lambda: time.perf_counter() > deadline  # noqa: E731
            late = {b for b in rows if not self.drafters[b].ready and not self.drafters[b].settle(stop)}
        return DraftBatch.from_drafts([
            empty_draft(1) if b in late else propose_within(self.drafters[b], row_ids, budget, self.ask_empty)
            for b, row_ids, budget in zip(rows, ids, budgets)])

    def idle(self, busy: Callable[[], bool]) -> None:
        stop = lambda: not busy()  # noqa: E731
        for drafter in self.drafters:
            if drafter.ready:
                continue
            if stop() or not drafter.settle(stop):
                return

    def limit_host(self, seconds: float | None) -> None:
        self.host_limit = seconds

    def overlap(self) -> None:
        for drafter in self.drafters:
            drafter.overlap()

    def accept(self, rows: list[int], ids: RowTokens, results: list[VerifyResult],
               hidden: BatchHidden | None) -> None:
        for i, (b, row_ids, result) in enumerate(zip(rows, ids, results)):
            self.drafters[b].accept(row_ids, result, None if hidden is None else hidden.row(i))

    def catch_up(self, rows: list[int], tokens: list[list[int]]) -> None:
        for b, new in zip(rows, tokens):
            self.drafters[b].catch_up(new)

    def end(self, ids: list[torch.Tensor]) -> None:
        for drafter, row_ids in zip(self.drafters, ids):
            drafter.end(row_ids)

    def release(self) -> None:
        for drafter in self.drafters:
            drafter.release()
