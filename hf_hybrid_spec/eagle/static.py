"""Fixed-shape EAGLE drafting: the drafter's keys and values in preallocated storage, tree expansion as CUDA graphs.

Eager, one EAGLE-2 tree is ~750 small ops (five drafter layers, masks, top-k, sort): on a GPU their launches take many
times a graph-replayed verify, which made the EAGLE drafter lose everywhere there. `StaticEagleTree` keeps the committed
steps' keys and values in a [1, kv_heads, capacity, head_dim] buffer, so `tree.expand_tree` sees the same shapes at
every step (the committed length is a device scalar and a mask), and on CUDA captures it once per draft budget and
replays it. The accept pass (the drafter's steps for the tokens the target just committed, 1 .. depth + 1 of them) is
fixed-shape too, one graph per count (eager it was ~30 launches per step, the largest part of an EAGLE step). On CPU the
same code runs eagerly (what the tests exercise).

Graph replay removes the launch cost but not the kernels: one EAGLE-2 expansion is ~780 aten ops (~450 kernels, each a
few microseconds on the GPU even when replayed), more than the verify forward it feeds. With `fuse=True`
(`AssistantConfig(compile=True, compile_drafter=True)`) the expansion and the accept pass are compiled by Inductor
(`torch.compile(fullgraph=True)`, which fuses the elementwise ops of the small drafter layer, the masks and the score
arithmetic) before they are captured, and the graphs replay the fused kernels (docs/benchmarks.md, "EAGLE-3 drafters").
Each compile costs seconds of the host's time, once per process: the expansion is compiled for the first draft budget
only (a request's full budget; the shorter ones of its last steps replay unfused graphs), the accept pass twice (one
step, and a dynamic count). Any compile error falls back to the unfused graph with a warning (drafting never decides
what is committed). Without graphs (CPU) the compiled passes run as they are (also faster there).

With `rows=R` the storage holds R rows of a batch (`eagle.batch.BatchEagleDrafter`): one expansion grows every
row's tree, one accept pass takes every row's committed steps (each row its own count, padded to the longest; a
row's padding steps land past its committed ones, masked, and are overwritten by its next accept), so a batch costs
the launches of one request.

One `StaticEagleTree` per (EagleDrafter, top-k, rows, device) is kept and reused by later requests (their graphs
point at its buffers); a request longer than its capacity replaces it.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers.utils import logging

from ..drafters.base import DraftBudget
from ..drafters.staged_rows import StagedRows
from ..graphs import Leased, capture
from ..staging import HostStaging
from .modeling import EagleDrafter
from .tree import TreeCandidates, expand_tree

logger = logging.get_logger(__name__)

__all__ = ["StaticEagleTree", "static_eagle_tree"]


class StaticEagleTree(StagedRows, Leased):
    """Static storage and captured tree expansions for one EagleDrafter (bound to its target).

    Args:
        model: the bound EagleDrafter.
        top_k: children per expanded node (fixed: it sets the shapes).
        capacity: committed drafter steps the buffers hold (the longest request's max_length is enough).
        use_graphs: capture CUDA graphs (default: when the drafter is on CUDA).
        fuse: compile the expansion and the accept pass with Inductor (captured afterwards with graphs; on CPU the
            compiled passes run as they are).
        rows: batch rows held side by side (1: one request, `advance` / `draft`; more: `advance_rows` / `draft_rows`).
    """

    MAX_GRAPHS = 4  # draft budgets captured; others (a request's last few steps, mostly) run eagerly
    MAX_FUSED = 1  # draft budgets whose expansion is compiled before capture (one Inductor compile each)
    MAX_ADVANCE = 16  # steps per accept run with fixed shapes (and a graph per count); longer ones (begin, HVD's
    # buffered accepts) go through `write` and the caller's eager pass
    LABEL = "the EAGLE drafter's static cache"
    MAX_KEPT_CAPACITY = 16_384  # storage longer than this (one huge request) is not kept for later requests

    def __init__(self, model: EagleDrafter, top_k: int, capacity: int, use_graphs: bool | None = None,
                 fuse: bool = False, rows: int = 1):
        c = model.config
        weight = model.fc.weight
        self.model, self.top_k, self.capacity, self.rows = model, top_k, capacity, rows
        self.device, self.dtype = weight.device, weight.dtype
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.fuse = fuse
        # Compiled lazily: int arguments are specialized (the expansion recompiles per budget, guarded), the accept
        # pass's count is dynamic (one compile serves counts 2 .. MAX_ADVANCE).
        self._fused_expand = self._fused_advance = None
        self._fused_budgets: set[tuple[int, int]] = set()
        # A batch's accept pass writes up to MAX_ADVANCE - 1 padding steps past a row's committed ones.
        self.slots = capacity + (self.MAX_ADVANCE if rows > 1 else 0)
        self.keys = torch.zeros(rows, c.num_key_value_heads, self.slots, c.head_dim, dtype=self.dtype,
                                device=self.device)
        self.values = torch.zeros_like(self.keys)
        # Inputs of a draft, written before each run / replay: each row's committed steps, and its newest step's
        # output and log-probabilities (rows: written by the accept pass itself).
        self.steps = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(rows, c.hidden_size, dtype=self.dtype, device=self.device)
        self.logp = torch.zeros(rows, c.draft_vocab_size, dtype=torch.float32, device=self.device)
        # Inputs of an accept pass: fused target features, the tokens after them, and (rows) each row's count.
        self.adv_features = torch.zeros(rows, self.MAX_ADVANCE, c.hidden_size, dtype=self.dtype, device=self.device)
        self.adv_tokens = torch.zeros(rows, self.MAX_ADVANCE, dtype=torch.long, device=self.device)
        self.counts = torch.zeros(rows, dtype=torch.long, device=self.device)
        # Host twin of the rows' per-pass integers (steps, counts, tokens): one copy per accept pass.
        self._row_ints = HostStaging(rows * (2 + self.MAX_ADVANCE), self.device)
        self._row_ints_device = torch.zeros(rows * (2 + self.MAX_ADVANCE), dtype=torch.long, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, TreeCandidates]] = {}
        self._advance_graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pool = None
        self.captures = 0

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store steps start .. start + T ([1, kv, T, d] each); returns the keys and values of steps 0 .. start + T."""
        end = start + keys.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"the EAGLE drafter's static cache holds {self.capacity} steps, {end} needed")
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]

    def advance(self, steps: int, features: torch.Tensor,
                tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Committed steps `steps .. steps + count` of one request: fused target features [1, count, H] and the target
        tokens after them [1, count]. Writes their keys and values and returns the newest step's (hidden [1, H], logp
        [draft_vocab]); on CUDA these are the graph's output buffers, valid until the next `advance`. None when
        count > MAX_ADVANCE (the caller runs those eagerly)."""
        count = features.shape[1]
        if count > self.MAX_ADVANCE:
            return None
        if steps + count > self.capacity:
            raise RuntimeError(f"the EAGLE drafter's static cache holds {self.capacity} steps, {steps + count} needed")
        self.adv_features[:, :count].copy_(features)
        self.adv_tokens[:, :count].copy_(tokens)
        self.steps.fill_(steps)
        hidden, logp = self._advance_pass(count)
        return hidden, logp[0]

    def _advance_pass(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The accept pass over the staged inputs: replayed from its graph (captured on first use of `count`), or run."""
        if not self.use_graphs:
            return self._run_pass("advance", (count,), graph=False)
        entry = self._advance_graphs.get(count)
        if entry is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                # The warm-up calls write the same keys and values the replay below writes: nothing else changes
                # (a batch's pass re-reads its staged steps at every call).
                entry = self._run_pass("advance", (count,), graph=True)
            except RuntimeError as err:
                logger.warning("capturing the EAGLE accept pass failed (%s); drafting eagerly instead", err)
                self.use_graphs = False
                return self._run_pass("advance", (count,), graph=False)
            self._advance_graphs[count] = entry
            self.captures += 1
        graph, out = entry
        graph.replay()
        return out

    def _advance(self, count: int, features: torch.Tensor | None = None,
                 tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's steps `steps .. steps + count` from the staged features and tokens (or those given, [R, count,
        H] and [R, count]). Returns each row's newest step's (hidden [R, H], logp [R, draft_vocab]): step
        `count - 1` for one request, step `counts[r] - 1` of row r in a batch."""
        model, device, rows = self.model, self.device, self.rows
        features = self.adv_features[:, :count] if features is None else features
        tokens = self.adv_tokens[:, :count] if tokens is None else tokens
        positions = self.steps.unsqueeze(1) + torch.arange(count, device=device)  # [R, count]
        tables = model.rotary_tables(positions, self.dtype)
        step = model.project(features, model.embed(tokens), tables=tables)
        index = positions.view(rows, 1, count, 1).expand_as(step.key)
        self.keys.scatter_(2, index, step.key)
        self.values.scatter_(2, index, step.value)
        # Causal over everything committed: new step i sees the slots up to its own (the rest of the buffer is
        # stale or empty and masked).
        mask = torch.arange(self.slots, device=device).view(1, 1, -1) <= positions.unsqueeze(-1)  # [R, count, slots]
        out = model.finish(step.residual, model.attend(step.query, self.keys, self.values, mask.unsqueeze(1)))
        if rows == 1:
            hidden = out[:, -1]
        else:
            last = (self.counts - 1).clamp(min=0).view(rows, 1, 1).expand(rows, 1, out.shape[-1])
            hidden = out.gather(1, last).squeeze(1)
        return hidden, torch.log_softmax(model.logits(hidden).float(), dim=-1)

    def draft(self, steps: int, hidden: torch.Tensor, logp: torch.Tensor, budget: DraftBudget) -> TreeCandidates:
        """A tree off the newest of `steps` committed steps of one request (hidden [1, H], logp [draft_vocab])."""
        self.hidden.copy_(hidden)
        self.logp.copy_(logp)
        self.steps.fill_(steps)
        cands = self._draft((budget.max_nodes, budget.max_depth))
        return TreeCandidates(tokens=cands.tokens[0], parents=cands.parents[0], scores=cands.scores[0],
                              keep=cands.keep[0])

    def draft_rows(self, max_nodes: int, max_depth: int) -> TreeCandidates:
        """Every row's tree off its newest committed step (`hidden`, `logp` and `steps` as the last `advance_rows`
        left them): `TreeCandidates` of [R, C] tensors."""
        return self._draft((max_nodes, max_depth))

    def _draft(self, key: tuple[int, int]) -> TreeCandidates:
        if not self.use_graphs:
            return self._run_pass("expand", key, graph=False)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.MAX_GRAPHS:
                return self._expand(*key)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                entry = self._run_pass("expand", key, graph=True)
            except RuntimeError as err:
                # Drafting only decides what gets verified, never what is committed: run it eagerly from now on
                # rather than fail the request.
                logger.warning("capturing the EAGLE tree expansion failed (%s); drafting eagerly instead", err)
                self.use_graphs = False
                return self._expand(*key)
            self._graphs[key] = entry
            self.captures += 1
            logger.info("captured the EAGLE tree expansion for %d nodes, depth %d", *key)
        graph, out = entry
        graph.replay()
        return out

    def _run_pass(self, which: str, args: tuple, graph: bool):
        """Run the `which` pass ("expand" / "advance") on `args`, or with `graph` capture it and return (graph,
        output). The compiled pass when fusing (the expansion for its first `MAX_FUSED` budgets), else the plain
        one; a compile that fails warns and falls back to the plain pass from then on. A batch's accept pass ends
        with `_keep_newest`, outside the compiled part (it only copies)."""
        plain = self._expand if which == "expand" else self._advance

        def run(fn):
            if which == "advance" and self.rows > 1:
                # A batch's pass reads its staged integers first (each replay anew) and ends by keeping each row's
                # newest step; both outside the compiled part (they only copy).
                inner = fn

                def fn(*a):
                    self._unstage()
                    return self._keep_newest(*inner(*a))

            return capture(lambda: fn(*args), self._pool, self.device) if graph else fn(*args)

        if self.fuse and (which == "advance" or args in self._fused_budgets
                          or len(self._fused_budgets) < self.MAX_FUSED):
            try:
                out = run(self._fused(which))
            except Exception as err:  # noqa: BLE001 - Dynamo / Inductor / Triton raise many types
                logger.warning("compiling the EAGLE %s pass failed (%s: %s); running it unfused", which,
                               type(err).__name__, err)
                self.fuse = False
            else:
                if which == "expand":
                    self._fused_budgets.add(args)
                return out
        return run(plain)

    def _fused(self, which: str):
        if which == "expand":
            if self._fused_expand is None:
                self._fused_expand = torch.compile(self._expand, fullgraph=True, dynamic=False)
            return self._fused_expand
        if self._fused_advance is None:
            self._fused_advance = torch.compile(self._advance, fullgraph=True, dynamic=True)
        return self._fused_advance

    def _expand(self, max_nodes: int, max_depth: int) -> TreeCandidates:
        positions = self.steps.unsqueeze(1) + torch.arange(max(max_depth - 1, 0), device=self.device)  # [R, D - 1]
        tables = self.model.rotary_tables(positions, self.dtype)
        prefix = torch.arange(self.slots, device=self.device).unsqueeze(0) < self.steps.unsqueeze(1)  # [R, slots]
        return expand_tree(self.model, self.top_k, max_nodes, max_depth, self.hidden, self.logp, self.keys,
                           self.values, prefix, tables)

    def release(self) -> None:
        """End the lease and let go of the drafter: kept in the pool between requests, the storage must not keep a
        deleted EagleDrafter alive (`static_eagle_tree` hands it the drafter again with the next lease)."""
        super().release()
        self.model = None


# Per EagleDrafter (weakly), the static trees of the (top-k, device) settings in use. A tree holds its drafter only
# while leased (`StaticEagleTree.release`), so the pool never keeps a drafter alive.
_TREES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TREES_LOCK = threading.Lock()
MAX_KEPT_SETTINGS = 6


def static_eagle_tree(model: EagleDrafter, top_k: int, capacity: int, owner=None, fuse: bool = False,
                      rows: int = 1) -> StaticEagleTree:
    """The kept StaticEagleTree for this drafter, top-k and number of rows, replaced by a larger one when `capacity`
    exceeds it, and leased to `owner` when given. One leased to a request still running (another thread) is never
    handed out twice: that request gets storage of its own, not kept. Per drafter the last `MAX_KEPT_SETTINGS`
    settings are kept (a server's batch sizes), most recently used last."""
    # The graphs read the bound target's embedding table (and tied head) too: a drafter rebound to another target
    # gets new ones.
    weight = model.fc.weight
    key = (top_k, rows, str(weight.device), str(weight.dtype), weight.data_ptr(), model.shared_weight_ptrs(), fuse)
    with _TREES_LOCK:
        trees = _TREES.setdefault(model, {})
        tree = trees.get(key)
        if tree is not None and tree.in_use:
            tree = StaticEagleTree(model, top_k, capacity, fuse=fuse, rows=rows)
        else:
            trees.pop(key, None)
            if tree is None or tree.capacity < capacity:
                tree = None  # drop the short one (and its graphs) before allocating
                tree = StaticEagleTree(model, top_k, capacity, fuse=fuse, rows=rows)
            if tree.capacity <= StaticEagleTree.MAX_KEPT_CAPACITY:
                trees[key] = tree
            while len(trees) > MAX_KEPT_SETTINGS:
                trees.pop(next(iter(trees)))
        tree.model = model
        if owner is not None:
            tree.lease(owner)
    return tree
