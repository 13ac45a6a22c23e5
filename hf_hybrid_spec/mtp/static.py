"""Fixed-shape MTP drafting: the head's keys and values in preallocated storage, its passes as CUDA graphs.

Eager, one MTP draft is a few hundred small ops per depth (the family's decoder layer with gated attention and q/k
norms, the norms, the head, top-k) launched from Python: on a GPU more time per step than the graph-replayed verify
forward it feeds (docs/benchmarks.md, "MTP head"). `StaticMtp` keeps the committed steps' keys and values in a
[1, kv_heads, capacity + tree, head_dim] buffer (committed steps at 0 .. capacity, the draft tree's nodes after
them), so every pass has the same shapes at every step: the committed length is a device scalar and a mask. On CUDA
the tree expansion is captured once per draft budget and the accept pass (the head's steps for the 1 .. depth + 1
tokens the target just committed) once per count, then replayed. On CPU the same code runs eagerly (what the tests
exercise). The prompt's steps at `begin` run eagerly on the same storage.

With `fuse=True` (`AssistantConfig(compile=True, compile_drafter=True)`) both passes are compiled by Inductor
(`torch.compile(fullgraph=True)`) before they are captured, as EAGLE's are: the accept pass once with a dynamic
count, the expansion for the first draft budget only (a request's full budget; the smaller ones of its last steps
replay plain graphs: compiling every budget cost seconds each inside the first requests). A compile that
fails warns and the plain pass runs from then on (drafting never decides what is committed).

One `StaticMtp` per (head, top-k, depth, fuse) is kept on the head and reused by later requests (their graphs point
at its buffers); a longer request replaces it, and a request that finds it leased to another one (a thread) gets
storage of its own.
"""

from __future__ import annotations

import threading

import torch
from transformers.utils import logging

from ..drafters.base import DraftBudget
from ..drafters.expansion import TreeCandidates, grow_row_tree
from ..graphs import GraphPasses, Leased
from ..tree import additive_mask
from .modeling import MtpHead

logger = logging.get_logger(__name__)

__all__ = ["StaticMtp", "static_mtp"]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [T, S] (True = may attend) -> additive mask [1, 1, T, S] in `dtype` (eager and sdpa attention)."""
    return additive_mask(allowed, dtype)[None, None]


class _Slots:
    """The cache object the MTP layer's attention writes through: `update` puts this pass's keys and values at
    `write_at` (a device index tensor the pass sets first) and returns the whole buffers, which the pass's mask
    restricts to what each query may see."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.write_at: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        self.keys.index_copy_(2, self.write_at, key)
        self.values.index_copy_(2, self.write_at, value)
        return self.keys, self.values


class StaticMtp(GraphPasses, Leased):
    """Static storage and captured passes for one MtpHead.

    Args:
        head: the MtpHead (built for its target).
        top_k: children per expanded node (fixed: it sets the shapes).
        max_depth: the deepest draft (sets the tree part of the buffers).
        capacity: committed steps the buffers hold (a request's max_length is enough).
        use_graphs: capture CUDA graphs (default: when the head is on CUDA).
        fuse: compile the passes with Inductor (then capture them; on CPU the compiled passes run as they are).
    """

    MAX_GRAPHS = 4  # draft budgets captured; others (a request's last few steps, mostly) run eagerly
    PASSES = "MTP head"
    MAX_ADVANCE = 16  # tokens per accept with a captured pass; longer runs (begin) are eager on the same storage
    MAX_FUSED = 1  # draft budgets whose expansion is compiled (one Inductor compile each)

    def __init__(self, head: MtpHead, top_k: int, max_depth: int, capacity: int, use_graphs: bool | None = None,
                 fuse: bool = False):
        c = head.config
        weight = head.fc.weight
        self.head, self.top_k, self.max_depth, self.capacity = head, top_k, max_depth, capacity
        self.device, self.dtype = weight.device, weight.dtype
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.tree = max(max_depth - 1, 0) * top_k
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        size = (1, heads, capacity + self.tree, head_dim)
        self.slots = _Slots(torch.zeros(size, dtype=self.dtype, device=self.device),
                            torch.zeros(size, dtype=self.dtype, device=self.device))
        self.columns = torch.arange(capacity + self.tree, device=self.device)
        # Inputs of a pass, written before each run / replay.
        self.steps = torch.zeros(1, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(1, c.hidden_size, dtype=self.dtype, device=self.device)
        self.logp = torch.zeros(c.vocab_size, dtype=torch.float32, device=self.device)
        self.adv_hidden = torch.zeros(1, self.MAX_ADVANCE, c.hidden_size, dtype=self.dtype, device=self.device)
        self.adv_tokens = torch.zeros(1, self.MAX_ADVANCE, dtype=torch.long, device=self.device)
        self._graphs: dict = {}
        self._pool = None
        self.fuse = fuse
        self._compiled: dict[str, object] = {}
        self._fused_budgets: set[tuple[int, int]] = set()

    # ------------------------------------------------------------------ the passes (fixed shapes)
    def _advance(self, count: int, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps `steps .. steps + count` from target hidden states [1, count, H] and the tokens after them."""
        positions = self.steps + torch.arange(count, device=self.device)  # [count]
        self.slots.write_at = positions
        # Causal over everything committed: step i sees the slots up to its own (the rest is stale or the tree).
        allowed = self.columns.view(1, -1) <= positions.view(-1, 1)
        out = self.head(hidden, self.head.embed(tokens), positions.view(1, -1), additive(allowed, self.dtype),
                        self.slots)
        last = out[:, -1]
        return last, torch.log_softmax(self.head.logits(last[0]).float(), dim=-1)

    def _expand(self, max_nodes: int, max_depth: int) -> TreeCandidates:
        k, head, c0 = self.top_k, self.head, self.capacity
        committed = (self.columns < self.steps).expand(k, -1)

        def step(depth: int, hidden: torch.Tensor, tokens: torch.Tensor,
                 own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            expanded = own.shape[1] - k
            # This depth's nodes go after the nodes expanded before them, in the tree part of the buffers.
            self.slots.write_at = c0 + expanded + torch.arange(k, device=self.device)
            allowed = committed.clone()
            allowed[:, c0 : c0 + expanded + k] = own
            positions = (self.steps + depth - 1).expand(1, k)
            out = head(hidden.unsqueeze(0), head.embed(tokens.unsqueeze(0)), positions, additive(allowed, self.dtype),
                       self.slots)[0]
            return out, torch.log_softmax(head.logits(out).float(), dim=-1)

        return grow_row_tree(step, k, max_nodes, max_depth, self.hidden, self.logp)

    # ------------------------------------------------------------------ running or replaying them
    def advance(self, steps: int, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed steps `steps .. steps + count`: target hidden states [1, count, H] and the tokens after them
        [1, count]. Writes their keys and values and returns the newest step's (hidden [1, H], logp [V]); on CUDA
        these are a graph's output buffers, valid until the next `advance`."""
        count = hidden.shape[1]
        if steps + count > self.capacity:
            raise RuntimeError(f"the MTP head's static cache holds {self.capacity} steps, {steps + count} needed")
        self.steps.fill_(steps)
        if count > self.MAX_ADVANCE:
            return self._advance(count, hidden.to(self.dtype), tokens)
        self.adv_hidden[:, :count].copy_(hidden)
        self.adv_tokens[:, :count].copy_(tokens)
        advance = self._pass("advance")
        return self._run(("advance", count), lambda: advance(count, self.adv_hidden[:, :count],
                                                             self.adv_tokens[:, :count]))

    def draft(self, steps: int, hidden: torch.Tensor, logp: torch.Tensor, budget: DraftBudget) -> TreeCandidates:
        """A tree off the newest of `steps` committed steps (hidden [1, H], logp [V])."""
        self.hidden.copy_(hidden)
        self.logp.copy_(logp)
        self.steps.fill_(steps)
        depth = min(budget.max_depth, self.max_depth)
        expand = self._pass("expand", (budget.max_nodes, depth))
        return self._run(("expand", budget.max_nodes, depth), lambda: expand(budget.max_nodes, depth))

    def _pass(self, which: str, budget: tuple[int, int] | None = None):
        """The plain pass, or with `fuse` its Inductor-compiled form (made on first use; int arguments are
        specialized for the expansion, dynamic for the accept pass's count). Only the first `MAX_FUSED` budgets'
        expansions are compiled."""
        plain = self._expand if which == "expand" else self._advance
        if not self.fuse:
            return plain
        if budget is not None and budget not in self._fused_budgets:
            if len(self._fused_budgets) >= self.MAX_FUSED:
                return plain
            self._fused_budgets.add(budget)
        compiled = self._compiled.get(which)
        if compiled is None:
            compiled = torch.compile(plain, fullgraph=True, dynamic=which == "advance")
            self._compiled[which] = compiled

        def run(*args):
            if not self.fuse:
                return plain(*args)
            try:
                return compiled(*args)
            except Exception as err:  # noqa: BLE001 - Dynamo / Inductor / Triton raise many types
                logger.warning("compiling the MTP %s pass failed (%s: %s); running it unfused", which,
                               type(err).__name__, err)
                self.fuse = False
                return plain(*args)

        return run


_LOCK = threading.Lock()


def static_mtp(head: MtpHead, top_k: int, max_depth: int, capacity: int, owner=None, fuse: bool = False) -> StaticMtp:
    """The StaticMtp kept on `head` for (top-k, depth, fuse), replaced by a larger one when `capacity` exceeds it,
    leased to `owner`; one leased to a request still running is never handed out twice (that request gets its own)."""
    key = (top_k, max_depth, str(head.fc.weight.device), str(head.fc.weight.dtype), fuse)
    with _LOCK:
        kept = head.__dict__.setdefault("_static_mtp", {})
        store = kept.get(key)
        if store is not None and store.in_use:
            store = StaticMtp(head, top_k, max_depth, capacity, fuse=fuse)
        elif store is None or store.capacity < capacity:
            kept.pop(key, None)
            store = StaticMtp(head, top_k, max_depth, capacity, fuse=fuse)
            kept[key] = store
        if owner is not None:
            store.lease(owner)
    return store
