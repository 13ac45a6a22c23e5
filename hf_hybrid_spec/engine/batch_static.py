"""Fixed-shape verification of a batch, captured as CUDA graphs: the batched counterpart of `static.StaticTreeRunner`.

A request of R rows gets a runner with a static cache of R rows (`HybridTreeCache(static_length=...)`); row b's
committed tokens sit in its slots 0 .. length[b] - 1 (its left-padded prompt first, masked where padded), so rows at
different committed lengths need no realignment:

- each step's trees, one per row, are padded to a bucket width n (8/16/32/64 by default, padding nodes hanging off
  the committed state); every input (tokens and parents [R, n], each row's committed length and root position) is
  staged in one host buffer and copied once; the mask, positions and per-row write positions are computed from them
  inside the captured region;
- the verify forward and the commit are captured once per bucket (on CUDA) and replayed; the commit reads each row's
  accepted leaf from a device buffer (-1: the row commits nothing, its state stays bit-identical), copies each row's
  path keys and values to its own next slots and rebuilds every row's recurrent state along its own path;
- rows that finished keep their slot and get leaf -1 (no work is saved on them, but nothing is recaptured either);
  a batch of another size gets a runner of its own (kept per model and batch size, like the one-row runners).

- drafters that read the target's hidden states (EAGLE) get the verify forward's hidden states of the layers they
  name (`hidden_layers`): graph outputs of the bucket, from which the backend gathers each row's accepted path after
  the commit.

- with `fuse=True` (`AssistantConfig.compile_verify`, on by default on a GPU) the model's pure regions run
  Inductor-compiled inside the forward, its independent projections side by side and its attention on the
  tree-attention kernel (which takes the per-row mask as it is), as in the one-row runner (`static.StaticTreeRunner`).

Runs the same code eagerly without graphs (CPU), which is what the CPU tests check.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch import nn
from transformers.utils import logging

from ..cache import CommittedState, HybridTreeCache, export_committed, import_committed, zero_states
from ..cache.layers import buffers_missing
from ..drafters import BatchHidden
from ..forward import forward_tokens
from ..graphs import Leased
from ..kernels.tree import ancestor_mask
from ..models import get_adapter
from ..staging import HostStaging
from ..tree import VerifyTree, tree_attention_mask
from .backend import PrefillOutputs, VerifyOutputs, gather_paths
from .static import DEFAULT_BUCKETS, FusedForward, capture_bucket, capture_key

logger = logging.get_logger(__name__)

__all__ = ["BatchStaticRunner", "BatchStaticBackend", "batch_runner"]


class _Bucket:
    """Static buffers (and, on CUDA, the graphs) of one tree width for R rows."""

    def __init__(self, rows: int, n: int, device: torch.device, key_valid: torch.Tensor, mask_dtype: torch.dtype):
        self.rows, self.n = rows, n
        # tokens [R, n], parents [R, n], committed lengths [R], root positions [R]: one buffer, one copy per step.
        size = rows * (2 * n + 2)
        self.inputs = torch.zeros(size, dtype=torch.long, device=device)
        self.staging = HostStaging(size, device)
        self.tokens = self.inputs[: rows * n].view(rows, n)
        self.parent = self.inputs[rows * n : 2 * rows * n].view(rows, n)
        self.parent.fill_(-1)
        self.lengths = self.inputs[2 * rows * n : 2 * rows * n + rows]
        self.roots = self.inputs[2 * rows * n + rows :]
        self.write_pos = torch.zeros(rows, n, dtype=torch.long, device=device)
        self.leaf = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.leaf_staging = HostStaging(rows, device, fill=-1)
        self.key_valid = key_valid  # [R, L] the prompts' padding mask (ones past it), shared by the buckets
        self.mask_dtype = mask_dtype
        self.graph = self.commit_graph = None
        self.out = self.pending = self.anc = self.depth = None

    def prepare(self):
        """Mask [R, 1, n, L], positions [R, n] and per-row write positions from the buffers (graph-safe)."""
        anc = ancestor_mask(self.parent, include_self=True)  # [R, n, n]
        depth = anc.sum(-1) - 1
        self.anc, self.depth = anc, depth
        self.write_pos.copy_(self.lengths[:, None] + torch.arange(self.n, device=anc.device))
        mask = tree_attention_mask(anc, self.key_valid, self.lengths, self.mask_dtype)
        return mask, self.roots[:, None] + depth


class BatchStaticRunner(Leased):
    """Verify forwards of fixed shape for R rows over a static `HybridTreeCache` (see the module docstring).

    Args:
        model: the target. rows: the batch size. static_length: slots per row (prompt, new tokens, one tree).
        buckets: tree widths (root included) to capture. use_graphs: default when the model is on one CUDA device.
        hidden_layers: indices into the model's `hidden_states` output that each forward also returns (`hidden`).
        fuse: the model's pure regions Inductor-compiled in the verify forward (`hf_hybrid_spec.fusion`), its
            independent projections side by side and its attention on the tree-attention kernel.
    """

    def __init__(self, model: nn.Module, rows: int, static_length: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 use_graphs: bool | None = None, hidden_layers: tuple[int, ...] = (), fuse: bool = False):
        adapter = get_adapter(model)  # route the recurrent mixers
        self._model = weakref.ref(model)
        self.rows = rows
        self.hidden_layers = tuple(int(i) for i in hidden_layers)
        self.fuse = fuse
        self._fused = FusedForward(model, adapter) if fuse else None
        self.device = model.device
        self.static_length = static_length
        self.cache = HybridTreeCache(model.config, static_length=static_length)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if use_graphs is None:
            use_graphs = self.device.type == "cuda" and len({p.device for p in model.parameters()}) == 1
        self.use_graphs = use_graphs
        self.key_valid = torch.ones(rows, static_length, dtype=torch.bool, device=self.device)
        self._buckets = {n: _Bucket(rows, n, self.device, self.key_valid, model.dtype) for n in self.buckets}
        self._pool = None
        self._graph_commit = None
        self._active: _Bucket | None = None
        self.captures = 0
        self.step_graphs = None  # the pipelined step's select and accept passes (`engine.step_graphs`)

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this batch runner has been deleted")
        return model

    def set_prompt_mask(self, mask: torch.Tensor) -> None:
        """[R, P] 0/1 padding mask of the prompts (generated tokens are always valid)."""
        self.key_valid.fill_(True)
        self.key_valid[:, : mask.shape[1]].copy_(mask.bool())

    def forward(self, tokens: torch.Tensor, parent: torch.Tensor, lengths: list[int],
                roots: list[int]) -> torch.Tensor:
        """Run one tree per row (host tensors [R, w], root first; w <= the largest bucket) whose keys go after each
        row's `lengths[b]` committed slots, the root at position `roots[b]`. Returns the logits [R, n, V] (the
        bucket's; rows' real nodes first). The cache stays in tree mode (commit or abort next)."""
        width = tokens.shape[1]
        bucket = self._buckets[next(b for b in self.buckets if b >= width)]
        self._active = None
        n, rows = bucket.n, self.rows
        padded_tokens = torch.zeros(rows, n, dtype=torch.long)
        padded_parent = torch.full((rows, n), -1, dtype=torch.long)
        padded_tokens[:, :width] = tokens
        padded_parent[:, :width] = parent
        bucket.staging.host().copy_(torch.cat([padded_tokens.view(-1), padded_parent.view(-1),
                                               torch.tensor(lengths + roots, dtype=torch.long)]))
        bucket.staging.send(bucket.inputs)
        return self._launch(bucket)

    def forward_device(self, tokens: torch.Tensor, parent: torch.Tensor, lengths: list[int],
                       roots: list[int]) -> torch.Tensor:
        """`forward` over trees already on the device ([R, w] tokens and parents, root first; `engine.plain`): they
        are copied into the bucket's buffers on the device, only the lengths and root positions come from the host."""
        width = tokens.shape[1]
        bucket = self.bucket_for(width)
        bucket.tokens[:, :width].copy_(tokens)
        bucket.parent[:, :width].copy_(parent)
        if width < bucket.n:  # the bucket's spare nodes: lone nodes nobody commits
            bucket.tokens[:, width:].zero_()
            bucket.parent[:, width:].fill_(-1)
        return self.forward_filled(width, lengths, roots)

    def bucket_for(self, width: int) -> _Bucket:
        """The bucket that verifies trees of `width` nodes (the narrowest at least as wide)."""
        return self._buckets[next(b for b in self.buckets if b >= width)]

    def forward_filled(self, width: int, lengths: list[int], roots: list[int]) -> torch.Tensor:
        """`forward` over the trees already written into `bucket_for(width)`'s token and parent buffers
        (`engine.step_graphs`); the lengths and root positions come from the host. Returns the logits [R, n, V]."""
        bucket = self.bucket_for(width)
        self._active = None
        scalars = 2 * self.rows * bucket.n
        bucket.staging.host()[scalars:].copy_(torch.tensor(lengths + roots, dtype=torch.long))
        bucket.staging.send(bucket.inputs[scalars:], scalars)
        return self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's forward over its staged inputs: its graph replayed (captured on first use), or run."""
        if self.use_graphs:
            if bucket.graph is None:
                self._capture(bucket)
            self.cache.begin_tree(bucket.parent, 0, pending=bucket.pending, check=False)
            bucket.graph.replay()
        else:
            bucket.out = self._run(bucket)
        self._active = bucket
        return bucket.out.logits

    def commit_device(self, leaves: torch.Tensor) -> None:
        """Start the commit of each row's path to `leaves` [R] (a device tensor, -1: nothing) without a host read; the
        cache stays in tree mode until `finish_commit` (when the host knows the new lengths)."""
        bucket = self._active
        if bucket is None or self.cache.tree is None:
            raise RuntimeError("commit called without a pending tree from this runner's forward")
        try:
            if leaves is not bucket.leaf:  # (`engine.step_graphs` writes the leaves in place)
                bucket.leaf.copy_(leaves, non_blocking=True)
            if bucket.commit_graph is not None:
                bucket.commit_graph.replay()
            else:
                self._commit_body(bucket)
        except BaseException:
            self.cache.abort()
            self._active = None
            raise

    def finish_commit(self, committed_length: int) -> None:
        """End a `commit_device`: the longest row now holds `committed_length` slots."""
        self._active = None
        self.cache.end_tree(committed_length)

    def hidden(self) -> tuple[torch.Tensor, ...]:
        """The last forward's hidden states of `hidden_layers`, [R, n, H] each (the bucket's; valid until the next
        forward of that bucket)."""
        bucket = self._active
        if bucket is None or not self.hidden_layers:
            raise RuntimeError("hidden() needs a pending tree from a runner built with hidden_layers")
        return self.hidden_of(bucket)

    def hidden_of(self, bucket: _Bucket) -> tuple[torch.Tensor, ...]:
        """`bucket`'s last forward's hidden states of `hidden_layers` (graph outputs when captured)."""
        return tuple(bucket.out.hidden_states[i] for i in self.hidden_layers)

    def commit(self, leaves: list[int], committed_length: int) -> None:
        """Keep each row's root->leaf path (`leaves[b]`, -1: nothing) of the pending trees."""
        bucket = self._active
        if bucket is None or self.cache.tree is None:
            raise RuntimeError("commit called without a pending tree from this runner's forward")
        bucket.leaf_staging.host().copy_(torch.tensor(leaves, dtype=torch.long))
        bucket.leaf_staging.send(bucket.leaf)
        self.commit_device(bucket.leaf)
        self.finish_commit(committed_length)

    def abort(self) -> None:
        self.cache.abort()
        self._active = None

    def capture_all(self, prompt_length: int) -> None:
        """Capture every bucket after the prefill (the cache's buffers exist), not at first use."""
        if not self.use_graphs:
            return
        for bucket in self._buckets.values():
            if bucket.graph is None:
                bucket.lengths.fill_(prompt_length)
                bucket.roots.fill_(prompt_length)
                self._capture(bucket)

    # ------------------------------------------------------------------ internals
    def _run(self, bucket: _Bucket):
        cursor = self.cache.cursor
        self.cache.begin_tree(bucket.parent, 0, check=False)
        mask, positions = bucket.prepare()
        cursor.write_pos, cursor.tree_mode = bucket.write_pos, True
        try:
            with self._fused.regions(self.model) if self._fused is not None else contextlib.nullcontext():
                out = forward_tokens(self.model, bucket.tokens, self.cache, position_ids=positions,
                                     attention_mask=mask, logits_to_keep=0,
                                     output_hidden_states=bool(self.hidden_layers))
        except BaseException:
            self.cache.abort()
            raise
        finally:
            cursor.tree_mode = False
        bucket.pending = self.cache.pending
        return out

    def _commit_body(self, bucket: _Bucket) -> None:
        """Each row's path to its leaf, with fixed-shape device ops only (graph-safe). A row with leaf -1 commits
        nothing: its recurrent state stays as it is and its copies land past its committed slots."""
        leaf, n, rows = bucket.leaf, bucket.n, self.rows
        nodes = torch.arange(n, device=leaf.device)
        picked = bucket.anc.gather(1, leaf.clamp(min=0).view(rows, 1, 1).expand(rows, 1, n)).squeeze(1)
        on_path = picked & (leaf >= 0).view(rows, 1)  # [R, n]
        # order[b, p]: row b's path node at depth p (root first); past the leaf's depth node 0, whose copies land
        # past the row's new committed length.
        at_depth = on_path[:, None, :] & (bucket.depth[:, None, :] == nodes.view(1, n, 1))  # [R, depth, node]
        order = at_depth.to(torch.int32).argmax(-1)
        self.cache.commit(leaf, on_path, bucket.lengths[:, None] + order, bucket.write_pos)

    def _forward_and_leave(self, bucket: _Bucket):
        try:
            return self._run(bucket)
        finally:
            self.cache.end_tree()

    def _commit_and_leave(self, bucket: _Bucket) -> None:
        self.cache.begin_tree(bucket.parent, 0, pending=bucket.pending, check=False)
        try:
            self._commit_body(bucket)
        finally:
            self.cache.end_tree()

    def _capture(self, bucket: _Bucket) -> None:
        capture_bucket(self, bucket, lambda: self._forward_and_leave(bucket), lambda: self._commit_and_leave(bucket))
        logger.info("captured the batched verify forward for %d rows of %d nodes", self.rows, bucket.n)


class BatchStaticBackend:
    """The batch loop's backend on a leased `BatchStaticRunner` (the interface of `backend.BatchEagerBackend`).

    Rows that leave the batch (`select_rows`) keep their slot in the runner and get empty trees that commit nothing.
    """

    tree_device = torch.device("cpu")  # the runner stages host trees in one copy
    # Capabilities (see `backend.BatchEagerBackend`).
    queues_plain = device_drafts = prefills_chunked = True
    draft_forwards = False

    def __init__(self, model: nn.Module, rows: int, static_length: int, buckets: tuple[int, ...], owner,
                 runner: BatchStaticRunner | None = None, hidden_layers: tuple[int, ...] = (), fuse: bool = False):
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        # A runner of the caller's own (a serving engine's, kept for its lifetime), else one leased from the pool.
        self.runner = runner if runner is not None else batch_runner(model, rows, static_length, buckets, owner,
                                                                     hidden_layers=self.hidden_layers, fuse=fuse)
        if self.runner.hidden_layers != self.hidden_layers:
            raise ValueError(f"the runner returns hidden layers {self.runner.hidden_layers}, not "
                             f"{self.hidden_layers}")
        self._owns_lease = runner is None
        self.cache = self.runner.cache
        self.widths = list(self.runner.buckets)
        self.valid: list[int] = []  # committed tokens per running row (the root excepted): its next position
        self.slots = 0  # the prompt width, then the longest row's committed slots (for the cost model's context)
        self._lengths: list[int] = []  # committed slots per runner row (prompt padding included)
        self._roots: list[int] = []
        self._rows: list[int] = list(range(rows))  # runner row of each running row

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                chunked: bool = False):
        """The left-padded prompts [B, L]: one eager forward, exactly as stock generate runs them, or (`chunked`)
        `prefill_chunked`. Returns what the model's forward returns (logits [B, 1, V]; the hidden states the
        drafter reads, indexed by layer)."""
        if chunked:
            return self.prefill_chunked(input_ids, attention_mask)
        out = forward_tokens(self.model, input_ids, self.cache, position_ids=positions, attention_mask=attention_mask,
                             logits_to_keep=1, output_hidden_states=bool(self.hidden_layers))
        self.runner.set_prompt_mask(attention_mask)
        self.runner.capture_all(input_ids.shape[1])
        self.valid = attention_mask.sum(-1).tolist()
        self._lengths = [input_ids.shape[1]] * input_ids.shape[0]
        self._roots = list(self.valid)
        self.slots = input_ids.shape[1]
        return out

    def prefill_chunked(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PrefillOutputs:
        """Each row's prompt (without its left padding) as chains through the captured verify forward, the widest
        bucket's worth of tokens per forward (`PREFILL_CHUNK` or more: `engine.batch` captures a bucket that wide for
        it), every chain committed, from an empty state: a few graph replays where
        an eager forward of the model launches every kernel from Python. The cache then holds each row's tokens from
        slot 0 (no padding). A runner whose buffers do not exist yet gets them from a one-token forward first
        (`start_empty`). Returns each row's logits at its last prompt token [B, 1, V] and, for the runner's hidden
        layers, the prompt's hidden states [B, L, H] laid out left-padded as the eager forward's."""
        runner = self.runner
        rows, width = input_ids.shape
        if buffers_missing(self.cache):
            self.start_empty()
        zero_states(self.cache)  # every row an empty sequence
        runner.key_valid.fill_(True)
        # Host-side layout, once: each row's prompt left-aligned ([R, P]; row b's tokens in columns < n_b). Every row
        # takes the same columns per chunk (all start at 0 and take up to the chunk's width), so a chunk is a slice of
        # it, and the hidden states' scatter back into the left-padded layout one indexed copy per layer.
        counts = attention_mask.sum(-1).to("cpu")
        lengths = counts.tolist()
        longest = max(lengths)
        columns = torch.arange(longest)
        real = columns[None] < counts[:, None]  # [R, P]
        source = (width - counts)[:, None] + columns[None]
        prompts = input_ids.to("cpu").gather(1, source.clamp(max=width - 1)).masked_fill(~real, 0)
        chunk = max(runner.buckets)
        logits: torch.Tensor | None = None
        hidden: list[torch.Tensor] = []
        if self.hidden_layers:
            size = self.model.config.get_text_config().hidden_size
            hidden = [torch.zeros(rows, width, size, dtype=self.model.dtype, device=self.model.device)
                      for _ in self.hidden_layers]
        for start in range(0, longest, chunk):
            w = min(chunk, longest - start)
            takes = (counts - start).clamp(0, w)  # [R]
            on = real[:, start : start + w]
            tokens = prompts[:, start : start + w]
            parent = torch.where(on, torch.arange(w) - 1, -1)
            fed = [min(n, start) for n in lengths]
            out = runner.forward(tokens, parent, fed, fed)
            ending = ((counts > start) & (counts <= start + w)).nonzero().flatten()
            if len(ending):  # rows whose last prompt token is in this chunk: its logits (the buffer is replayed over)
                if logits is None:
                    logits = out.new_empty(rows, 1, out.shape[-1])
                at = (counts[ending] - start - 1).to(out.device)
                ending = ending.to(out.device)
                logits[ending, 0] = out[ending, at]
            if hidden:  # right-aligned as the padded prompt's: row b's token i at column width - n_b + i
                row, node = on.nonzero(as_tuple=True)
                column = (width - counts[row] + start + node).to(self.model.device)
                row, node = row.to(self.model.device), node.to(self.model.device)
                for states, layer in zip(hidden, runner.hidden()):
                    states[row, column] = layer[row, node]
            runner.commit(torch.where(takes > 0, takes - 1, -1).tolist(), min(longest, start + w))
        self.valid = list(lengths)
        self._lengths, self._roots = list(lengths), list(lengths)
        self._rows = list(range(rows))
        self.slots = max(lengths)
        return PrefillOutputs(logits=logits, hidden_states=dict(zip(self.hidden_layers, hidden)))

    def forward(self, tree: VerifyTree) -> VerifyOutputs:
        rows = self.runner.rows
        width = tree.num_nodes
        tokens = torch.zeros(rows, width, dtype=torch.long)
        parent = torch.full((rows, width), -1, dtype=torch.long)  # rows not running: lone nodes, nothing committed
        index = torch.tensor(self._rows, dtype=torch.long)
        tokens[index] = tree.tokens
        parent[index] = tree.parent
        logits = self.runner.forward(tokens, parent, self._lengths, self._roots)
        if self._rows != list(range(rows)):  # rows left, or joined out of slot order (serving)
            logits = logits.index_select(0, index.to(logits.device))
        return VerifyOutputs(logits=logits[:, :width])

    def commit(self, paths: list[list[int]]) -> BatchHidden | None:
        hidden = None
        if self.hidden_layers:
            # Each running row's path, gathered from the forward's hidden states (the runner's rows, bucket width n).
            states = self.runner.hidden()
            n = states[0].shape[1]
            hidden = gather_paths(states, paths, [row * n for row in self._rows], self.hidden_layers)
        leaves = [-1] * self.runner.rows
        for row, path in zip(self._rows, paths):
            leaves[row] = path[-1]
            self._lengths[row] += len(path)
            self._roots[row] += len(path)
        self.valid = [v + len(p) for v, p in zip(self.valid, paths)]
        self.slots = max(self._lengths)
        self.runner.commit(leaves, self.slots)
        return hidden

    # ---- the pipelined step (`engine.pipeline`): every runner row at once, trees and leaves on the device
    def forward_device(self, tokens: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
        """The verify forward of every runner row's tree ([R, w] on the device; rows not running get lone roots that
        commit nothing). Returns the logits [R, n, V] (the bucket's)."""
        return self.runner.forward_device(tokens, parent, self._lengths, self._roots)

    def forward_filled(self, width: int) -> torch.Tensor:
        """The verify forward of the trees already in the runner's bucket for `width` (`engine.step_graphs`)."""
        return self.runner.forward_filled(width, self._lengths, self._roots)

    def commit_device(self, leaves: torch.Tensor) -> None:
        self.runner.commit_device(leaves)

    def finish_commit(self, counts: list[int]) -> None:
        """After `commit_device`: runner row r committed `counts[r]` tokens (0: none)."""
        for row, count in enumerate(counts):
            self._lengths[row] += count
            self._roots[row] += count
        self.valid = [v + counts[row] for v, row in zip(self.valid, self._rows)]
        self.slots = max(self._lengths)
        self.runner.finish_commit(self.slots)

    def select_rows(self, rows: list[int]) -> None:
        self._rows = [self._rows[r] for r in rows]
        self.valid = [self.valid[r] for r in rows]

    # ---- slots (continuous batching): rows join a running batch between steps
    def start_empty(self) -> None:
        """Make every slot's buffers exist (a one-token forward of every row) with no row running, and capture the
        buckets; rows then join with `admit`."""
        rows = self.runner.rows
        zeros = torch.zeros(rows, 1, dtype=torch.long, device=self.model.device)
        forward_tokens(self.model, zeros, self.cache, position_ids=zeros, attention_mask=torch.ones_like(zeros),
                       logits_to_keep=1)
        self.runner.set_prompt_mask(torch.ones_like(zeros))
        self.runner.capture_all(1)
        self._rows, self.valid = [], []
        self._lengths, self._roots = [0] * rows, [0] * rows
        self.slots = 1

    def admit(self, slot: int, state: CommittedState | None) -> None:
        """Row `slot` (not running) starts a sequence from `state`, its prompt's committed state without padding, or
        from nothing (None: zero recurrent and conv states, no keys: its first tree's root is its first token); it
        runs from the next forward, last among the running rows."""
        if slot in self._rows:
            raise ValueError(f"slot {slot} is running")
        if state is None:
            zero_states(self.cache, slot)
            length = 0
        else:
            import_committed(self.cache, state, row=slot)
            length = state.length
        self.runner.key_valid[slot].fill_(True)
        self._lengths[slot] = self._roots[slot] = length
        self._rows.append(slot)
        self.valid.append(length)
        self.slots = max(self.slots, length)

    def export_row(self, row: int) -> CommittedState:
        """A copy of running row `row`'s committed state (its slot's first `valid` tokens)."""
        return export_committed(self.cache, row=self._rows[row], length=self._lengths[self._rows[row]])

    @property
    def running_slots(self) -> list[int]:
        return list(self._rows)

    def abort(self) -> None:
        self.runner.abort()

    def release(self) -> None:
        if self._owns_lease:
            self.runner.release()


# Runners per model and batch size (their graphs point at their static caches): the last few kept, most recently used
# last, as the one-row runners are; a runner leased to a running call is never handed out twice.
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
MAX_BATCH_RUNNERS_PER_MODEL = 4


def batch_runner(model: nn.Module, rows: int, static_length: int, buckets: tuple[int, ...],
                 owner=None, hidden_layers: tuple[int, ...] = (), fuse: bool = False) -> BatchStaticRunner:
    """A `BatchStaticRunner` of `rows` rows and at least `static_length` slots for `model` (returning the hidden states
    of `hidden_layers`; with the fused forward for `fuse`), its cache empty, leased to `owner` when given (hand it back
    with `runner.release()`)."""
    hidden_layers = tuple(int(i) for i in hidden_layers)
    key = (rows, tuple(sorted({int(b) for b in buckets})), hidden_layers, bool(fuse), capture_key(model))
    with _LOCK:
        runners = _RUNNERS.setdefault(model, {})
        runner = runners.get(key)
        if runner is not None and runner.in_use:
            runner = BatchStaticRunner(model, rows, static_length, buckets, hidden_layers=hidden_layers,
                                       fuse=fuse)  # this call's own, not kept
        else:
            runners.pop(key, None)
            if runner is not None and runner.static_length >= static_length:
                runner.cache.reset()
            else:
                runner = None  # drop the short one before allocating the new cache
                runner = BatchStaticRunner(model, rows, static_length, buckets, hidden_layers=hidden_layers,
                                           fuse=fuse)
            runners[key] = runner
            while len(runners) > MAX_BATCH_RUNNERS_PER_MODEL:
                runners.pop(next(iter(runners)))
        if owner is not None:
            runner.lease(owner)
    return runner
