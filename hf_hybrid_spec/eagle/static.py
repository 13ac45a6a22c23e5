"""Fixed-shape EAGLE drafting: the drafter's keys and values in preallocated storage, tree expansion as CUDA graphs.

Eager, one EAGLE-2 tree is ~750 small ops (five drafter layers, masks, top-k, sort): on the H200 that is tens of
milliseconds of launches against a 2-3 ms graph-replayed verify, which made the EAGLE drafter lose everywhere on the
GPU. `StaticEagleTree` keeps the committed steps' keys and values in a [1, kv_heads, capacity, head_dim] buffer, so
`tree.expand_tree` sees the same shapes at every step (the committed length is a device scalar and a mask), and on
CUDA captures it once per draft budget and replays it. On CPU the same code runs eagerly (what the tests exercise).

One `StaticEagleTree` per (EagleDrafter, top-k, device) is kept and reused by later requests (their graphs point at
its buffers); a request longer than its capacity replaces it.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers.utils import logging

from ..drafters.base import DraftBudget
from ..graphs import Leased, capture
from .modeling import EagleDrafter
from .tree import TreeCandidates, expand_tree

logger = logging.get_logger(__name__)

__all__ = ["StaticEagleTree", "static_eagle_tree"]


class StaticEagleTree(Leased):
    """Static storage and captured tree expansions for one EagleDrafter (bound to its target).

    Args:
        model: the bound EagleDrafter.
        top_k: children per expanded node (fixed: it sets the shapes).
        capacity: committed drafter steps the buffers hold (the longest request's max_length is enough).
        use_graphs: capture CUDA graphs (default: when the drafter is on CUDA).
    """

    MAX_GRAPHS = 4  # draft budgets captured; others (a request's last few steps, mostly) run eagerly

    def __init__(self, model: EagleDrafter, top_k: int, capacity: int, use_graphs: bool | None = None):
        c = model.config
        weight = model.fc.weight
        self.model, self.top_k, self.capacity = model, top_k, capacity
        self.device, self.dtype = weight.device, weight.dtype
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.keys = torch.zeros(1, c.num_key_value_heads, capacity, c.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        # Inputs of a draft, written before each run / replay.
        self.steps = torch.zeros(1, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(1, c.hidden_size, dtype=self.dtype, device=self.device)
        self.logp = torch.zeros(c.draft_vocab_size, dtype=torch.float32, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, TreeCandidates]] = {}
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

    def draft(self, steps: int, hidden: torch.Tensor, logp: torch.Tensor, budget: DraftBudget) -> TreeCandidates:
        """A tree off the newest of `steps` committed steps (hidden [1, H], logp [draft_vocab])."""
        self.hidden.copy_(hidden)
        self.logp.copy_(logp)
        self.steps.fill_(steps)
        key = (budget.max_nodes, budget.max_depth)
        if not self.use_graphs:
            return self._expand(*key)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.MAX_GRAPHS:
                return self._expand(*key)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                entry = capture(lambda: self._expand(*key), self._pool, self.device)
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

    def _expand(self, max_nodes: int, max_depth: int) -> TreeCandidates:
        positions = self.steps + torch.arange(max(max_depth - 1, 0), device=self.device)
        tables = self.model.rotary_tables(positions.view(1, -1), self.dtype)
        prefix = torch.arange(self.capacity, device=self.device) < self.steps
        return expand_tree(self.model, self.top_k, max_nodes, max_depth, self.hidden, self.logp, self.keys,
                           self.values, prefix, tables)


# Per EagleDrafter (weakly), the static trees of the (top-k, device) settings in use.
_TREES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TREES_LOCK = threading.Lock()


def static_eagle_tree(model: EagleDrafter, top_k: int, capacity: int, owner=None) -> StaticEagleTree:
    """The kept StaticEagleTree for this drafter and top-k, replaced by a larger one when `capacity` exceeds it, and
    leased to `owner` when given. One leased to a request still running (another thread) is never handed out twice:
    that request gets storage of its own, not kept."""
    # The graphs read the bound target's embedding table too: a drafter rebound to another target gets new ones.
    key = (top_k, str(model.fc.weight.device), model.embed_table_ptr())
    with _TREES_LOCK:
        trees = _TREES.setdefault(model, {})
        tree = trees.get(key)
        if tree is not None and tree.in_use:
            tree = StaticEagleTree(model, top_k, capacity)
        elif tree is None or tree.capacity < capacity:
            trees.pop(key, None)  # drop the short one (and its graphs) before allocating
            tree = trees[key] = StaticEagleTree(model, top_k, capacity)
        if owner is not None:
            tree.lease(owner)
    return tree
