"""`BatchMtpDrafter`: MTP chains and trees for every row of a batch from one expansion per step.

One `MtpDrafter` per row runs one expansion and one accept pass per row and step, eagerly. Here the rows share one
`BatchMtpStore` of R rows, as EAGLE's batch drafter shares a `StaticEagleTree` (`drafters.batch_hidden` holds the
loop's side): the MTP layer's keys and values of every row in one [R, kv_heads, slots, head_dim] buffer, each row's
committed steps at slots 0 .. its step count, and the draft tree's nodes after the committed part, so every pass has
the same shapes at every step (the step counts are device tensors). On CUDA with `compile=True` the expansion (per
draft budget) and the accept pass (per count) are captured once and replayed; the pipelined batch step
(`engine.pipeline`) then keeps drafting and verification on the device. The passes are not Inductor-compiled here
(`compile_drafter` applies to one request's `StaticMtp`).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ..drafters.batch_hidden import BatchHiddenStepDrafter
from ..drafters.expansion import TreeCandidates, grow_tree
from ..drafters.staged_rows import StagedRows
from ..graphs import GraphPasses, Leased
from ..staging import HostStaging
from ..tree import additive_mask
from .modeling import MtpHead

__all__ = ["BatchMtpDrafter", "BatchMtpStore", "from_config"]


class _RowSlots:
    """The cache object the MTP layer's attention writes through, for R rows: `update` scatters this pass's keys and
    values to `write_at` ([R, T] slots, set by the pass first) and returns the whole buffers, which the pass's mask
    restricts to what each query may see."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.write_at: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        rows, heads, count, dim = key.shape
        index = self.write_at.view(rows, 1, count, 1).expand(rows, heads, count, dim)
        self.keys.scatter_(2, index, key)
        self.values.scatter_(2, index, value)
        return self.keys, self.values


class BatchMtpStore(StagedRows, GraphPasses, Leased):
    """Keys, values and captured passes of one MtpHead for R rows.

    Args:
        head: the MtpHead (built for its target). top_k: children per expanded node. max_depth: the deepest draft.
        capacity: committed steps a row holds (a request's max_length is enough). rows: R.
        use_graphs: capture CUDA graphs (default: when the head is on CUDA).
    """

    MAX_GRAPHS = 4  # draft budgets captured; others (a batch's last few steps) run eagerly
    PASSES = "batched MTP head"
    LABEL = "the MTP head's batch storage"
    MAX_ADVANCE = 16  # steps per accept pass with fixed shapes (a graph per count); longer ones (prompts) run eagerly

    def __init__(self, head: MtpHead, top_k: int, max_depth: int, capacity: int, rows: int,
                 use_graphs: bool | None = None):
        c = head.config
        weight = head.fc.weight
        self.head, self.top_k, self.max_depth, self.capacity, self.rows = head, top_k, max_depth, capacity, rows
        self.device, self.dtype = weight.device, weight.dtype
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        # An accept pass writes up to MAX_ADVANCE - 1 padding steps past a row's committed ones; the tree after that.
        self.committed = capacity + self.MAX_ADVANCE
        self.tree = max(max_depth - 1, 0) * top_k
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        size = (rows, heads, self.committed + self.tree, head_dim)
        self.slots = _RowSlots(torch.zeros(size, dtype=self.dtype, device=self.device),
                               torch.zeros(size, dtype=self.dtype, device=self.device))
        self.columns = torch.arange(self.committed + self.tree, device=self.device)
        # Each row's committed steps, its newest step's output and log-probabilities (the next tree's root), and an
        # accept pass's inputs: target hidden states, the tokens after them, each row's count.
        self.steps = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.counts = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(rows, c.hidden_size, dtype=self.dtype, device=self.device)
        self.logp = torch.zeros(rows, c.vocab_size, dtype=torch.float32, device=self.device)
        self.adv_features = torch.zeros(rows, self.MAX_ADVANCE, c.hidden_size, dtype=self.dtype, device=self.device)
        self.adv_tokens = torch.zeros(rows, self.MAX_ADVANCE, dtype=torch.long, device=self.device)
        # Host twin of a pass's integers (steps, counts, tokens): one copy per host-staged accept pass.
        self._row_ints = HostStaging(rows * (2 + self.MAX_ADVANCE), self.device)
        self._row_ints_device = torch.zeros(rows * (2 + self.MAX_ADVANCE), dtype=torch.long, device=self.device)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None

    # ------------------------------------------------------------------ the passes (fixed shapes)
    def _advance(self, count: int, hidden: torch.Tensor | None = None,
                 tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's steps `steps .. steps + count` (the staged inputs, or `hidden` [R, count, H] and `tokens`
        [R, count]); returns each row's step `counts[r] - 1` (hidden [R, H], logp [R, V])."""
        head, rows = self.head, self.rows
        hidden = self.adv_features[:, :count] if hidden is None else hidden
        tokens = self.adv_tokens[:, :count] if tokens is None else tokens
        positions = self.steps.unsqueeze(1) + torch.arange(count, device=self.device)  # [R, count]
        self.slots.write_at = positions
        # Causal over each row's committed steps: step i sees the slots up to its own (later ones are stale padding
        # or the tree, masked).
        allowed = self.columns.view(1, 1, -1) <= positions.unsqueeze(-1)  # [R, count, slots]
        out = head(hidden, head.embed(tokens), positions, additive_mask(allowed, self.dtype).unsqueeze(1), self.slots)
        last = (self.counts - 1).clamp(min=0).view(rows, 1, 1).expand(rows, 1, out.shape[-1])
        newest = out.gather(1, last).squeeze(1)
        return newest, torch.log_softmax(head.logits(newest).float(), dim=-1)

    def _expand(self, max_nodes: int, max_depth: int) -> TreeCandidates:
        k, head, rows, start = self.top_k, self.head, self.rows, self.committed
        slots = self.columns.shape[0]
        prefix = self.columns.view(1, -1) < self.steps.view(-1, 1)  # [R, slots]: each row's committed steps

        def step(depth: int, hidden: torch.Tensor, tokens: torch.Tensor,
                 own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            expanded = own.shape[2] - k
            # This depth's nodes go after the nodes expanded before them, in the tree part of the buffers.
            self.slots.write_at = (start + expanded + torch.arange(k, device=self.device)).expand(rows, k)
            allowed = prefix.unsqueeze(1).expand(rows, k, slots).clone()
            allowed[:, :, start : start + expanded + k] = own
            positions = (self.steps + depth - 1).unsqueeze(1).expand(rows, k)  # depth d sits at steps + d - 1
            out = head(hidden, head.embed(tokens), positions, additive_mask(allowed, self.dtype).unsqueeze(1),
                       self.slots)
            return out, torch.log_softmax(head.logits(out).float(), dim=-1)

        return grow_tree(step, k, max_nodes, max_depth, self.hidden, self.logp)

    # ------------------------------------------------------------------ the drafter's calls
    def draft_rows(self, max_nodes: int, max_depth: int) -> TreeCandidates:
        """Every row's tree off its newest committed step: `TreeCandidates` of [R, C] tensors."""
        depth = min(max_depth, self.max_depth)
        return self._run(("expand", max_nodes, depth), lambda: self._expand(max_nodes, depth))

    def _advance_pass(self, count: int) -> None:
        def run():
            self._unstage()
            self._keep_newest(*self._advance(count))

        self._run(("advance", count), run)


_LOCK = threading.Lock()


def batch_mtp_store(head: MtpHead, top_k: int, max_depth: int, capacity: int, rows: int, owner) -> BatchMtpStore:
    """The BatchMtpStore kept on `head` for (top-k, depth, rows), replaced by a larger one when `capacity` exceeds it,
    leased to `owner`; one leased to a request still running gets a store of its own (not kept)."""
    key = (top_k, max_depth, rows, str(head.fc.weight.device), str(head.fc.weight.dtype))
    with _LOCK:
        kept = head.__dict__.setdefault("_batch_mtp", {})
        store = kept.get(key)
        if store is not None and store.in_use:
            store = BatchMtpStore(head, top_k, max_depth, capacity, rows)
        elif store is None or store.capacity < capacity:
            kept.pop(key, None)
            store = None  # drop the short one (and its graphs) before allocating
            store = kept[key] = BatchMtpStore(head, top_k, max_depth, capacity, rows)
        store.lease(owner)
    return store


class BatchMtpDrafter(BatchHiddenStepDrafter):
    """MTP chains (`top_k=1`) or EAGLE-2 trees for the R rows of a batch from the target's MTP head.

    Args:
        head: the `MtpHead` (built for `target`). target: the target model. rows: the batch size R.
        top_k: children per expanded node, and nodes expanded per depth. max_depth: the expansion's depth.
        static: keep the storage between requests and capture its passes as CUDA graphs on the GPU.
    """

    name = "mtp"
    label = "MTP"

    def __init__(self, head: MtpHead, target: nn.Module, rows: int, top_k: int = 1, max_depth: int = 3,
                 static: bool = False):
        if not isinstance(head, MtpHead):
            raise TypeError(f"the 'mtp' drafter needs an MtpHead as draft_model, got {type(head).__name__}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        if head._shared.embed is not target.get_input_embeddings():
            raise ValueError("this MtpHead was built for a different model than the one generating: build it with "
                             "MtpHead.from_target(target, load=True)")
        tc = target.config.get_text_config()
        # The last hidden state, after the final norm.
        super().__init__(rows, min(top_k, tc.vocab_size), max_depth, (tc.num_hidden_layers,))
        self.head, self.static = head, static

    def timing_key(self) -> tuple:
        return (self.name, id(self.head), self.top_k, self.max_depth, self.static)

    def _open_store(self, capacity: int) -> BatchMtpStore:
        if self.static:
            return batch_mtp_store(self.head, self.top_k, self.max_depth, capacity, self.rows, owner=self)
        return BatchMtpStore(self.head, self.top_k, self.max_depth, capacity, self.rows, use_graphs=False)

    def _features(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return states[0]


def from_config(config, target: nn.Module, draft_model: nn.Module | None, rows: int) -> BatchMtpDrafter:
    """The batch drafter `AssistantConfig(drafter="mtp")` names for a batch of `rows`: `draft_model` an `MtpHead`, or
    None for the target checkpoint's own head (`mtp.drafter.resolve_head`)."""
    from .drafter import resolve_head

    static = config.compile is True  # speculative_generate resolves "auto" before it builds the drafter
    return BatchMtpDrafter(resolve_head(target, draft_model), target, rows, top_k=config.draft_top_k,
                           max_depth=config.max_depth, static=static)
