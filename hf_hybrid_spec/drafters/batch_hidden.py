"""Batch drafters that step a small model over the target's hidden states (EAGLE-3 heads, MTP heads), every row of a
batch from one store of R rows.

One per-row drafter per row would run one expansion per row and step (B times the launches: on a GPU each 60-node
EAGLE expansion is ~450 kernels). Here the rows share one store of R rows: each step one expansion grows every row's
tree (`drafters.expansion.grow_tree` with a leading R), one accept pass takes every row's committed steps, and the
trees come back to the host in one read, or stay on the device for the pipelined step (`engine.pipeline`).

Alignment is `drafters.hidden_steps`' (one drafter step per committed token but the root), per row: `begin` runs the
prompts' steps (each row's prompt without its padding, left-aligned in the storage) and keeps each prompt's last
feature pending; the first `accept` pairs it with the first token; every later `accept` takes the accepted path's
hidden states from the verify forward. Rows that have stopped keep their storage and commit nothing.

A subclass supplies the store (`_open_store`) and how the target's hidden states become the model's input features
(`_features`). The store's interface, for R rows:

    advance_rows(steps, counts, features [R, C, H], tokens [R, C])   # host-staged accept pass (any C)
    advance_rows_device(counts [R], features [R, C, H], tokens [R, C])  # from device tensors (C <= MAX_ADVANCE)
    draft_rows(max_nodes, max_depth) -> TreeCandidates [R, ...]      # every row's tree off its newest step
    release()
"""

from __future__ import annotations

import torch

from ..tree import DeviceDrafts, DraftBatch, VerifyResult, empty_draft
from .base import DraftBudget, DraftContext
from .batch import BatchDrafter, BatchHidden, RowTokens
from .expansion import host_batch, kept_candidates

__all__ = ["BatchHiddenStepDrafter"]


class BatchHiddenStepDrafter(BatchDrafter):
    """The shared body of the batched hidden-state drafters (see the module docstring).

    Args:
        rows: the batch size R. top_k: children per expanded node, and nodes expanded per depth. max_depth: the
            expansion's depth (rows whose budget allows less get their trees cut on the host, so one captured
            expansion serves every step). target_hidden_layers: the target's `hidden_states` entries it reads.
    """

    label = "hidden-state"
    supports_device = True

    def __init__(self, rows: int, top_k: int, max_depth: int, target_hidden_layers: tuple[int, ...]):
        self.rows = rows
        self.top_k = top_k
        self.max_depth = max_depth
        self.target_hidden_layers = tuple(target_hidden_layers)
        self.store = None
        self.steps = [0] * rows  # committed drafter steps per row (its committed tokens but the root)
        self.pending: torch.Tensor | None = None  # [R, H] each prompt's last feature, until the first accept

    # ------------------------------------------------------------------ what a subclass supplies
    def _open_store(self, capacity: int):
        """A store of `self.rows` rows holding `capacity` committed steps (see the module docstring)."""
        raise NotImplementedError

    def _features(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The model's input features [R, T, H] from the target's hidden states of `target_hidden_layers`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the batch loop's calls
    def begin(self, prompts: list[torch.Tensor], context: DraftContext, hidden: BatchHidden | None) -> None:
        self.release()
        if hidden is None:
            raise RuntimeError(f"the {self.label} drafter got no target hidden states of the prompts; it must run "
                               "inside speculative_generate, which provides the layers in target_hidden_layers")
        rows = self.rows
        capacity = max(context.generation_config.max_length, max(p.shape[1] for p in prompts))
        self.store = self._open_store(capacity)
        with torch.no_grad():
            features = self._features(hidden.states)  # [R, L, H], left-padded
            width, size = features.shape[1], features.shape[2]
            # Each row's prompt moved to the front: its step t at slot t.
            index = torch.tensor([[start + min(j, count - 1) for j in range(width)]
                                  for start, count in zip(hidden.start, hidden.count)], dtype=torch.long)
            aligned = features.gather(1, index.to(features.device).unsqueeze(-1).expand(rows, width, size))
            counts = [count - 1 for count in hidden.count]  # steps (h_t, x_{t+1}) for t < P - 1
            if max(counts) > 0:
                tokens = torch.zeros(rows, max(counts), dtype=torch.long)
                for b, prompt in enumerate(prompts):
                    tokens[b, : counts[b]] = prompt[0, 1:].cpu()
                self.store.advance_rows([0] * rows, counts, aligned[:, : max(counts)], tokens)
            last = torch.tensor([count - 1 for count in hidden.count], device=features.device)
            self.pending = aligned[torch.arange(rows, device=features.device), last]
        self.steps = counts

    @torch.no_grad()
    def accept(self, rows: list[int], ids: RowTokens, results: list[VerifyResult],
               hidden: BatchHidden | None) -> None:
        if self.store is None:
            raise RuntimeError(f"the {self.label} drafter's accept() came before begin()")
        news = []
        for i, (b, result) in enumerate(zip(rows, results)):
            new, seen = result.token_list, self.steps[b] + 1
            if new is None or seen + len(new) != ids.lengths[i]:  # a stopping criterion cut the run short
                new = ids[i][0, seen:].tolist()
            news.append(new)
        counts = [0] * self.rows
        if hidden is None:  # the first token after the prompt: paired with each prompt's pending last feature
            if self.pending is None:
                raise RuntimeError(f"the {self.label} drafter got no target hidden states at accept(); it must run "
                                   "inside speculative_generate, which provides the layers in target_hidden_layers")
            features, self.pending = self.pending.unsqueeze(1), None
            width = 1
        else:
            if tuple(hidden.layers) != self.target_hidden_layers:
                raise RuntimeError(f"expected target hidden states {self.target_hidden_layers}, got {hidden.layers}")
            fused = self._features(hidden.states)  # [running, C, H]
            width = fused.shape[1]
            if rows == list(range(self.rows)):
                features = fused
            else:
                features = fused.new_zeros(self.rows, width, fused.shape[2])
                features.index_copy_(0, torch.tensor(rows, device=fused.device), fused)
        table = [[0] * width for _ in range(self.rows)]
        for i, (b, new) in enumerate(zip(rows, news)):
            count = min(len(new), width if hidden is None else hidden.count[i])
            counts[b] = count
            table[b][:count] = new[:count]
        self.store.advance_rows(self.steps, counts, features, torch.tensor(table, dtype=torch.long))
        self.steps = [s + c for s, c in zip(self.steps, counts)]

    @torch.no_grad()
    def propose(self, rows: list[int], ids: RowTokens, budgets: list[DraftBudget]) -> DraftBatch:
        if self.store is None:
            raise RuntimeError(f"the {self.label} drafter's propose() came before begin()")
        for b, length in zip(rows, ids.lengths):
            if self.steps[b] != length - 1:
                raise RuntimeError(f"the {self.label} drafter holds {self.steps[b]} steps for row {b}'s {length} "
                                   "committed tokens; it is out of step with the target")
        nodes = max(budget.max_nodes for budget in budgets)
        if nodes <= 0 or max(budget.max_depth for budget in budgets) <= 0:
            return DraftBatch.from_drafts([empty_draft(1) for _ in rows])
        drafts = host_batch(self.store.draft_rows(nodes, self.max_depth), self.top_k)
        if rows != list(range(self.rows)):
            index = torch.tensor(rows, dtype=torch.long)
            drafts = DraftBatch(tokens=drafts.tokens[index], parents=drafts.parents[index],
                                values=drafts.values[index], depth=drafts.depth[index], count=drafts.count[index])
        # Rows whose budget is smaller than the expansion's (their last few tokens, or fewer nodes): cut on the host.
        depths = torch.tensor([budget.max_depth for budget in budgets]).view(-1, 1)
        limits = torch.tensor([budget.max_nodes for budget in budgets]).view(-1, 1)
        keep = (drafts.depth <= depths) & (torch.arange(drafts.tokens.shape[1]) < limits)
        return drafts if bool(keep.all()) else drafts.select(keep)

    # ------------------------------------------------------------------ on the device (`engine.pipeline`)
    @torch.no_grad()
    def propose_device(self, max_nodes: int) -> DeviceDrafts:
        """Every row's tree of `max_nodes` nodes and the drafter's full depth, left on the device (no host read)."""
        if self.store is None:
            raise RuntimeError(f"the {self.label} drafter's propose_device() came before begin()")
        return kept_candidates(self.store.draft_rows(max_nodes, self.max_depth), self.top_k)

    @torch.no_grad()
    def accept_device(self, counts: torch.Tensor, tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...]) -> None:
        """Every row's committed steps from device tensors: `counts` [R] new tokens per row (0: none), `tokens` [R, C]
        the new tokens, `hidden` the target's hidden states of the rows' accepted paths ([R, C, H] per layer, node d
        of the path at d). No host read; the host's step counts follow with `advance_host`."""
        if self.store is None:
            raise RuntimeError(f"the {self.label} drafter's accept_device() came before begin()")
        if self.pending is not None:
            raise RuntimeError("the first token after the prompt goes through accept()")
        self.store.advance_rows_device(counts, self._features(hidden), tokens)

    def advance_host(self, counts: list[int]) -> None:
        """The host's step counts after an `accept_device` whose counts were `counts` (read back with the results)."""
        self.steps = [s + c for s, c in zip(self.steps, counts)]

    def end(self, ids: list[torch.Tensor]) -> None:
        self.release()

    def release(self) -> None:
        if self.store is not None:
            self.store.release()
        self.store, self.pending = None, None
