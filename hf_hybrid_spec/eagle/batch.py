"""`BatchEagleDrafter`: EAGLE-2 trees for every row of a batch from one expansion per step.

One `EagleTreeDrafter` per row would run one expansion per row and step (B times the launches: on a GPU each
60-node expansion is ~450 kernels). Here the rows share one `StaticEagleTree` of R rows: each step one expansion
grows every row's tree (`tree.expand_tree` with a leading R), one accept pass takes every row's committed steps, and
the trees come back to the host in one read. On CUDA with `static=True` both passes are captured graphs, as for one
request.

Alignment is `drafters.hidden_steps`' (one drafter step per committed token but the root), per row: `begin` runs the
prompts' steps (each row's prompt without its padding, left-aligned in the storage) and keeps each prompt's last
hidden state pending; the first `accept` pairs it with the first token; every later `accept` takes the accepted
path's hidden states from the verify forward. Rows that have stopped keep their storage and commit nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from ..drafters.base import DraftBudget, DraftContext
from ..drafters.batch import BatchDrafter, BatchHidden, RowTokens
from ..drafters.expansion import host_batch, kept_candidates
from ..tree import DeviceDrafts, DraftBatch, VerifyResult, empty_draft
from .modeling import EagleDrafter
from .static import StaticEagleTree, static_eagle_tree

__all__ = ["BatchEagleDrafter", "from_config"]


class BatchEagleDrafter(BatchDrafter):
    """EAGLE-2 trees (chains for `top_k=1`) for the R rows of a batch from a bound `EagleDrafter`.

    Args:
        model: the EagleDrafter (bound to `target` here; its aux layers become `target_hidden_layers`).
        target: the target model. rows: the batch size R.
        top_k: children per expanded node, and nodes expanded per depth. max_depth: the expansion's depth (rows
            whose budget allows less get their trees cut on the host, so one captured expansion serves every step).
        static: capture the passes as CUDA graphs on the GPU (the kept `StaticEagleTree` of this drafter and R).
        fuse: with `static`, compile the passes with Inductor before capturing them.
    """

    name = "eagle"

    def __init__(self, model: EagleDrafter, target: nn.Module, rows: int, top_k: int = 10, max_depth: int = 6,
                 static: bool = False, fuse: bool = False):
        if not isinstance(model, EagleDrafter):
            raise TypeError(f"the 'eagle' drafter needs an EagleDrafter as draft_model, got {type(model).__name__}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        self.model = model.bind(target)
        self.rows = rows
        self.top_k = min(top_k, model.config.draft_vocab_size)
        self.max_depth = max_depth
        self.target_hidden_layers = tuple(model.config.aux_layers)
        self.static, self.fuse = static, fuse
        self.store: StaticEagleTree | None = None
        self.steps = [0] * rows  # committed drafter steps per row (its committed tokens but the root)
        self.pending: torch.Tensor | None = None  # [R, H] each prompt's last fused feature, until the first accept

    def begin(self, prompts: list[torch.Tensor], context: DraftContext, hidden: BatchHidden | None) -> None:
        self.release()
        if hidden is None:
            raise RuntimeError("the EAGLE drafter got no target hidden states of the prompts; it must run inside "
                               "speculative_generate, which provides the layers in target_hidden_layers")
        rows = self.rows
        capacity = max(context.generation_config.max_length, max(p.shape[1] for p in prompts))
        if self.static:
            self.store = static_eagle_tree(self.model, self.top_k, capacity, owner=self, fuse=self.fuse, rows=rows)
        else:
            self.store = StaticEagleTree(self.model, self.top_k, capacity, use_graphs=False, rows=rows)
        with torch.no_grad():
            fused = self.model.fuse(hidden.states)  # [R, L, H], left-padded
            width, size = fused.shape[1], fused.shape[2]
            # Each row's prompt moved to the front: its step t at slot t.
            index = torch.tensor([[start + min(j, count - 1) for j in range(width)]
                                  for start, count in zip(hidden.start, hidden.count)], dtype=torch.long)
            aligned = fused.gather(1, index.to(fused.device).unsqueeze(-1).expand(rows, width, size))
            counts = [count - 1 for count in hidden.count]  # steps (h_t, x_{t+1}) for t < P - 1
            if max(counts) > 0:
                tokens = torch.zeros(rows, max(counts), dtype=torch.long)
                for b, prompt in enumerate(prompts):
                    tokens[b, : counts[b]] = prompt[0, 1:].cpu()
                self.store.advance_rows([0] * rows, counts, aligned[:, : max(counts)], tokens)
            last = torch.tensor([count - 1 for count in hidden.count], device=fused.device)
            self.pending = aligned[torch.arange(rows, device=fused.device), last]
        self.steps = counts

    @torch.no_grad()
    def accept(self, rows: list[int], ids: RowTokens, results: list[VerifyResult],
               hidden: BatchHidden | None) -> None:
        if self.store is None:
            raise RuntimeError("the EAGLE drafter's accept() came before begin()")
        news = []
        for i, (b, result) in enumerate(zip(rows, results)):
            new, seen = result.token_list, self.steps[b] + 1
            if new is None or seen + len(new) != ids.lengths[i]:  # a stopping criterion cut the run short
                new = ids[i][0, seen:].tolist()
            news.append(new)
        counts = [0] * self.rows
        if hidden is None:  # the first token after the prompt: paired with each prompt's pending last feature
            if self.pending is None:
                raise RuntimeError("the EAGLE drafter got no target hidden states at accept(); it must run inside "
                                   "speculative_generate, which provides the layers in target_hidden_layers")
            features, self.pending = self.pending.unsqueeze(1), None
            width = 1
        else:
            if tuple(hidden.layers) != self.target_hidden_layers:
                raise RuntimeError(f"expected target hidden states {self.target_hidden_layers}, got {hidden.layers}")
            fused = self.model.fuse(hidden.states)  # [running, C, H]
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
            raise RuntimeError("the EAGLE drafter's propose() came before begin()")
        for b, length in zip(rows, ids.lengths):
            if self.steps[b] != length - 1:
                raise RuntimeError(f"the EAGLE drafter holds {self.steps[b]} steps for row {b}'s {length} committed "
                                   "tokens; it is out of step with the target")
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
    supports_device = True

    @torch.no_grad()
    def propose_device(self, max_nodes: int) -> DeviceDrafts:
        """Every row's tree of `max_nodes` nodes and the drafter's full depth, left on the device (no host read)."""
        if self.store is None:
            raise RuntimeError("the EAGLE drafter's propose_device() came before begin()")
        return kept_candidates(self.store.draft_rows(max_nodes, self.max_depth), self.top_k)

    @torch.no_grad()
    def accept_device(self, counts: torch.Tensor, tokens: torch.Tensor, hidden: tuple[torch.Tensor, ...]) -> None:
        """Every row's committed steps from device tensors: `counts` [R] new tokens per row (0: none), `tokens` [R, C]
        the new tokens, `hidden` the target's hidden states of the rows' accepted paths ([R, C, H] per layer, node d
        of the path at d). No host read; the host's step counts follow with `advance_host`."""
        if self.store is None:
            raise RuntimeError("the EAGLE drafter's accept_device() came before begin()")
        if self.pending is not None:
            raise RuntimeError("the first token after the prompt goes through accept()")
        self.store.advance_rows_device(counts, self.model.fuse(hidden), tokens)

    def advance_host(self, counts: list[int]) -> None:
        """The host's step counts after an `accept_device` whose counts were `counts` (read back with the results)."""
        self.steps = [s + c for s, c in zip(self.steps, counts)]

    def end(self, ids: list[torch.Tensor]) -> None:
        self.release()

    def release(self) -> None:
        if self.store is not None and self.static:
            self.store.release()
        self.store, self.pending = None, None


def from_config(config, target: nn.Module, draft_model: nn.Module | None, rows: int) -> BatchEagleDrafter:
    """The batch drafter `AssistantConfig(drafter="eagle")` names for a batch of `rows`: `draft_model` must be an
    `EagleDrafter`."""
    if draft_model is None:
        raise ValueError("the 'eagle' drafter needs draft_model=EagleDrafter.from_pretrained(...)")
    static = config.compile is True  # speculative_generate resolves "auto" before it builds the drafter
    return BatchEagleDrafter(draft_model, target, rows, top_k=config.draft_top_k, max_depth=config.max_depth,
                             static=static, fuse=static and config.compile_drafter)
