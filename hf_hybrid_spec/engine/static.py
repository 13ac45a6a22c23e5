"""Fixed-shape tree verification of R rows, captured as CUDA graphs (one per tree-width bucket): `StaticRunner`, the one
runner of every static path (a request is a batch of one, a `generate` batch of R rows, a serving engine's slots).

Eager decoding of a small model is bound by kernel launches and Python, not by the GPU: stock `generate` with a
static cache compiles its forward to get rid of that overhead, and a speculative loop has to do the same to win. The
runner verifies over a `HybridTreeCache(static_length=...)` of R rows; row b's committed tokens sit in its slots
0 .. length[b] - 1 (a left-padded prompt first, masked where padded), so rows at different lengths need no
realignment:

- each step's trees, one per row, are padded to a bucket width n (8/16/32/64 by default, padding nodes hanging off the
  committed state, so no real node ever attends to them or follows them); every input (tokens and parents [R, n],
  each row's committed length and root position) is staged in one host buffer and copied once; the tree mask,
  positions and per-row write positions are computed from them inside the captured region;
- on CUDA, the forward (model, tree kernels, stashing of the recurrent factors) is captured once per bucket and
  replayed; a different bucket at the next step replays another graph, never recompiles;
- the commit is captured too, as a second graph per bucket: it reads each row's accepted leaf from a device buffer
  (-1: the row commits nothing, its state stays bit-identical), copies each row's path keys and values to its own
  next slots at fixed size (the whole bucket is copied; slots past the path land beyond the committed length, where
  the next tree overwrites or the mask hides them) and runs one commit kernel per recurrent layer; the host only
  writes the leaves;
- drafters that read the target's hidden states get the forward's states of the layers they name (`hidden_layers`,
  graph outputs of the bucket, from which the backend gathers each row's accepted path);
- with `fuse=True` (`AssistantConfig.compile_verify`, on by default on a GPU) the model's pure regions (norms, MLPs,
  gate math) run Inductor-compiled inside the forward, its independent projections side by side and its attention
  on the tree-attention kernel, so the captured graph replays fused kernels (`hf_hybrid_spec.fusion`);
- on CPU the same buffers and code run eagerly (no capture), which is what the CPU tests exercise.

Runners outlive one call (their graphs point at their static caches): `static_runner` leases one from a pool per model
and settings, `release_runner` hands it back.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from ..cache import HybridTreeCache
from ..forward import forward_tokens
from ..fusion import fusable_modules, fused_regions, parallel_enabled
from ..graphs import Leased, capture
from ..kernels.backend import resolve
from ..kernels.tree import ancestor_mask
from ..models import get_adapter
from ..models.tree_attention import routed_attention, tree_attention_enabled
from ..staging import HostStaging
from ..tree import tree_attention_mask

logger = logging.get_logger(__name__)

__all__ = ["StaticRunner", "FusedForward", "DEFAULT_BUCKETS", "static_runner", "release_runner", "capture_key",
           "capture_bucket"]

DEFAULT_BUCKETS = (8, 16, 32, 64)
# Trees of at most this many padded nodes (rows x bucket) are staged from host lists, larger ones with tensor ops.
SMALL_STAGE = 128


@dataclass
class _CaptureCount:
    total: int = 0  # graphs captured by every runner in this process (benchmarks check it stays flat)


CAPTURES = _CaptureCount()


class FusedForward:
    """What a static runner's fused verify forward switches on (`compile_verify`), held weakly like the model: the
    model's pure modules Inductor-compiled (`fusion`), with independent projections side by side (the MLPs through
    their adapter's forward, `models.mlp`, as set when the runner was built: `fusion.set_parallel`), and the attention
    layers on our tree-attention kernel (`models.tree_attention`)."""

    def __init__(self, model: nn.Module, adapter):
        self.modules = weakref.WeakSet(fusable_modules(model))
        self.parallel = parallel_enabled()
        self.forwards = weakref.WeakKeyDictionary(adapter.fused_forwards(model) if self.parallel else {})
        self.attention = weakref.WeakSet(adapter.attention_modules(model) if tree_attention_enabled() else [])

    @contextlib.contextmanager
    def regions(self, model: nn.Module):
        """Within this block the forward of `model` runs fused."""
        with fused_regions(model, list(self.modules), dict(self.forwards), parallel=self.parallel), \
                routed_attention(list(self.attention)):
            yield


class _Bucket:
    """Static buffers (and, on CUDA, the graphs) of one tree width for R rows."""

    def __init__(self, rows: int, n: int, device: torch.device, key_valid: torch.Tensor, mask_dtype: torch.dtype,
                 offsets: torch.Tensor | None):
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
        self.offsets = offsets  # [P, R] multimodal RoPE offsets (the runner's, shared), or None
        self.mask_dtype = mask_dtype
        self.graph = self.commit_graph = None
        self.out = self.pending = self.anc = self.depth = None

    def prepare(self):
        """Mask [R, 1, n, L], positions [R, n] ([P, R, n] with RoPE offsets) and per-row write positions from the
        buffers (graph-safe: no host reads)."""
        anc = ancestor_mask(self.parent, include_self=True)  # [R, n, n]
        depth = anc.sum(-1) - 1
        self.anc, self.depth = anc, depth
        self.write_pos.copy_(self.lengths[:, None] + torch.arange(self.n, device=anc.device))
        mask = tree_attention_mask(anc, self.key_valid, self.lengths, self.mask_dtype)
        positions = self.roots[:, None] + depth
        if self.offsets is not None:
            positions = positions[None] + self.offsets[:, :, None]
        return mask, positions


class StaticRunner(Leased):
    """Verify forwards of fixed shape for R rows over a static `HybridTreeCache` (see the module docstring).

    Args:
        model: the target (its mixers routed by `get_adapter`). rows: R. static_length: slots per row (prompt, new
            tokens, one tree). buckets: tree widths (root included) to capture; a tree is padded to the narrowest that
            holds it.
        use_graphs: capture CUDA graphs (default: when the model is on one CUDA device; a model split over devices
            runs the static path eagerly).
        hidden_layers: indices into the model's `hidden_states` output that each forward also keeps (`hidden`).
        fuse: the model's pure regions Inductor-compiled in the verify forward (`hf_hybrid_spec.fusion`), its
            independent projections side by side and its attention on the tree-attention kernel.
        all_hidden: each forward keeps every layer's hidden states (`all_hidden_states`: a rule that reads them).
        rope_rows: rows of multimodal RoPE position ids (Qwen3.5's vision-language model: 4), 0 for plain positions;
            each request's offsets are set with `set_position_offsets`.
    """

    def __init__(self, model: nn.Module, rows: int, static_length: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 use_graphs: bool | None = None, hidden_layers: tuple[int, ...] = (), fuse: bool = False,
                 all_hidden: bool = False, rope_rows: int = 0):
        adapter = get_adapter(model)  # route the recurrent mixers (else a tree forward would run the stock one)
        # The model and its modules are held weakly: the pool keeps runners per model, and a runner must not be what
        # keeps a deleted model (and its static cache) alive.
        self._model = weakref.ref(model)
        self.rows = rows
        self.hidden_layers = tuple(int(i) for i in hidden_layers)
        self.all_hidden = all_hidden
        self.fuse = fuse
        self._fused = FusedForward(model, adapter) if fuse else None
        self.device = model.device
        self.static_length = static_length
        self.cache = HybridTreeCache(model.config, static_length=static_length)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if use_graphs is None:
            use_graphs = self.device.type == "cuda" and len({p.device for p in model.parameters()}) == 1
        self.use_graphs = use_graphs
        self.rope_rows = rope_rows
        self._offsets = torch.zeros(rope_rows, rows, dtype=torch.long, device=self.device) if rope_rows else None
        self.key_valid = torch.ones(rows, static_length, dtype=torch.bool, device=self.device)
        self._buckets = {n: _Bucket(rows, n, self.device, self.key_valid, model.dtype, self._offsets)
                         for n in self.buckets}
        self._pool = None
        # The commit graph needs graph-safe commit ops: the Triton kernels (the PyTorch commit reads the path back to
        # the host). Decided once per runner, as the kernel backend is per call of generate.
        self._graph_commit = None
        self._active: _Bucket | None = None  # the bucket of the pending trees
        self.captures = 0  # graphs captured so far (never more than two per bucket)
        self.step_graphs = None  # the pipelined step's select and accept passes (`engine.step_graphs`)

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this static runner has been deleted")
        return model

    @property
    def max_nodes(self) -> int:
        return self.buckets[-1]

    def set_prompt_mask(self, mask: torch.Tensor) -> None:
        """[R, P] 0/1 padding mask of the prompts (generated tokens are always valid)."""
        self.key_valid.fill_(True)
        self.key_valid[:, : mask.shape[1]].copy_(mask.bool())

    def set_position_offsets(self, offsets: torch.Tensor) -> None:
        """[P, R] multimodal RoPE offsets of the rows (`VerifyTree.position_ids`), copied into the graphs' input."""
        if self._offsets is None or offsets.shape != self._offsets.shape:
            expected = None if self._offsets is None else tuple(self._offsets.shape)
            raise ValueError(f"this runner takes offsets of shape {expected}, got {tuple(offsets.shape)}")
        self._offsets.copy_(offsets)

    def forward(self, tokens: torch.Tensor, parent: torch.Tensor, lengths: list[int],
                roots: list[int]) -> torch.Tensor:
        """Run one tree per row (host tensors [R, w], root first; w <= the largest bucket) whose keys go after each
        row's `lengths[b]` committed slots, the root at position `roots[b]`. Returns the logits [R, n, V] (the
        bucket's; rows' real nodes first). The cache stays in tree mode (commit or abort next)."""
        width = tokens.shape[1]
        bucket = self.bucket_for(width)
        self._active = None
        n, rows = bucket.n, self.rows
        if rows * n <= SMALL_STAGE:
            # A few rows (one request): one tensor made from host lists costs a few tensor ops less than the padding
            # below, and a request's step is short enough for them to show.
            pad, values = n - width, []
            for row in tokens.tolist():
                values += row + [0] * pad
            for row in parent.tolist():
                values += row + [-1] * pad
            staged = torch.tensor(values + lengths + roots, dtype=torch.long)
        else:
            padded_tokens = torch.zeros(rows, n, dtype=torch.long)
            padded_parent = torch.full((rows, n), -1, dtype=torch.long)
            padded_tokens[:, :width] = tokens
            padded_parent[:, :width] = parent
            staged = torch.cat([padded_tokens.view(-1), padded_parent.view(-1),
                                torch.tensor(lengths + roots, dtype=torch.long)])
        bucket.staging.host().copy_(staged)
        bucket.staging.send(bucket.inputs)
        return self._launch(bucket)

    def forward_device(self, tokens: torch.Tensor, parent: torch.Tensor, lengths: list[int],
                       roots: list[int]) -> torch.Tensor:
        """`forward` over trees already on the device ([R, w] tokens and parents, root first: `engine.plain`, a
        drafter that drafts on the device): copied into the bucket's buffers on the device, only the lengths and root
        positions come from the host."""
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
            # The graph rewrites the captured factor tensors in place: the stash from capture time stays valid.
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

    def all_hidden_states(self) -> tuple[torch.Tensor, ...]:
        """The last forward's hidden states of every layer, [R, n, H] each (a runner built with `all_hidden`)."""
        bucket = self._active
        if bucket is None or not self.all_hidden:
            raise RuntimeError("all_hidden_states() needs a pending tree from a runner built with all_hidden")
        return tuple(bucket.out.hidden_states)

    def commit(self, leaves: list[int], committed_length: int) -> None:
        """Keep each row's root->leaf path (`leaves[b]`, -1: nothing) of the pending trees; the longest row then holds
        `committed_length` slots. One graph replay on CUDA (the host writes the leaves)."""
        bucket = self._active
        if bucket is None or self.cache.tree is None:
            raise RuntimeError("commit called without a pending tree from this runner's forward")
        if self.rows == 1:  # one request: its leaf written on the device, no host buffer to stage and wait for
            bucket.leaf.fill_(leaves[0])
        else:
            bucket.leaf_staging.host().copy_(torch.tensor(leaves, dtype=torch.long))
            bucket.leaf_staging.send(bucket.leaf)
        self.commit_device(bucket.leaf)
        self.finish_commit(committed_length)

    def abort(self) -> None:
        """Drop the pending trees (nothing committed changes)."""
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
        """The forward itself, in tree mode; keeps the recurrent factors the adapters stash (the cache stays in tree
        mode: commit or abort next)."""
        cursor = self.cache.cursor
        self.cache.begin_tree(bucket.parent, 0, check=False)
        mask, positions = bucket.prepare()
        cursor.write_pos, cursor.tree_mode = bucket.write_pos, True
        try:
            with self._fused.regions(self.model) if self._fused is not None else contextlib.nullcontext():
                out = forward_tokens(self.model, bucket.tokens, self.cache, position_ids=positions,
                                     attention_mask=mask, logits_to_keep=0,
                                     output_hidden_states=bool(self.hidden_layers) or self.all_hidden)
        except BaseException:
            self.cache.abort()
            raise
        finally:
            cursor.tree_mode = False
        bucket.pending = self.cache.pending
        return out

    def _commit_body(self, bucket: _Bucket) -> None:
        """Each row's path to its leaf, with fixed-shape device ops only (graph-safe, no host reads). A row with leaf
        -1 commits nothing: its recurrent state stays as it is and its copies land past its committed slots (the
        warm-up before capture relies on that)."""
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
        """One forward of `bucket`'s trees, the cache back out of tree mode after it (nothing committed): what a
        capture records."""
        try:
            return self._run(bucket)
        finally:
            self.cache.end_tree()

    def _commit_and_leave(self, bucket: _Bucket) -> None:
        """The commit body over `bucket`'s captured trees (with every leaf -1 at capture: nothing changes), the cache
        out of tree mode after it."""
        self.cache.begin_tree(bucket.parent, 0, pending=bucket.pending, check=False)
        try:
            self._commit_body(bucket)
        finally:
            self.cache.end_tree()

    def _capture(self, bucket: _Bucket) -> None:
        # Warm-up forwards only write tree keys beyond the committed slots and stash factors: nothing committed
        # changes. The last call (the captured one) leaves the bucket's mask, depth and factors in the graph's pool.
        capture_bucket(self, bucket, lambda: self._forward_and_leave(bucket), lambda: self._commit_and_leave(bucket))
        logger.info("captured the verify forward for %d row(s) of %d nodes", self.rows, bucket.n)


def capture_bucket(runner, bucket, forward, commit) -> None:
    """Capture one bucket of a static runner (`StaticRunner`; the serving engine's too): `forward()` (one
    verify forward that leaves the cache out of tree mode) into `bucket.graph` / `bucket.out`, and, where the commit
    ops are graph-safe (the Triton kernels; the PyTorch commit reads the path back to the host), `commit()` into
    `bucket.commit_graph`, warmed up and captured with every leaf at -1 (commits nothing: recurrent states stay as
    they are, attention copies only write slots past the committed ones), so Triton compiles outside the capture."""
    if runner._pool is None:
        runner._pool = torch.cuda.graph_pool_handle()
    bucket.graph, bucket.out = capture(forward, runner._pool, runner.device)
    runner.captures += 1
    CAPTURES.total += 1
    if runner._graph_commit is None:  # decided once per runner, as the kernel backend is per call of generate
        runner._graph_commit = resolve(runner.device) == "triton"
    if runner._graph_commit:
        bucket.leaf.fill_(-1)
        bucket.commit_graph, _ = capture(commit, runner._pool, runner.device, warmups=1)


# Runners outlive one `generate` call: their graphs point at the static cache's buffers, so the cache is reset
# and reused by the next request instead of rebuilt (which would mean capturing again). Keyed weakly by model (a
# runner holds its model weakly too, so a deleted model is freed with its runners), then by everything the captures
# depend on. Per model, the runners of the last few settings, most recently used last. A server that alternates
# drafters (one reads the target's hidden states, one does not) keeps both sets of graphs instead of recapturing every
# bucket on each switch; each runner holds a static cache, so the count is bounded, and a runner longer than
# MAX_KEPT_LENGTH (one huge request) is dropped when its call ends instead of being kept. Eight: every drafter that
# reads hidden states (EAGLE's layers, MTP's last one) is a setting of its own, twice with the fused verify, and with
# four a process alternating suffix, EAGLE and MTP recaptured every bucket on every call (the end-to-end benchmark
# does alternate them).
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RUNNERS_LOCK = threading.Lock()
MAX_RUNNERS_PER_MODEL = 8
MAX_KEPT_LENGTH = 16_384


def capture_key(model: nn.Module) -> tuple:
    """What a captured forward of `model` depends on besides the runner's own settings: the device, the dtype and the
    address of every weight (`model.to(...)` or a reload allocates new ones, which old graphs would still read), the
    attention implementation, and the kernel backend in effect (which kernels a capture records)."""
    params = [p for p in model.parameters()]
    weights = hash(tuple((p.data_ptr(), p.dtype) for p in params))
    attention = getattr(model.config, "_attn_implementation", None)
    return (str(model.device), str(model.dtype), len(params), weights, attention, resolve(model.device))


def static_runner(model: nn.Module, rows: int, static_length: int, buckets: tuple[int, ...], owner=None,
                  hidden_layers: tuple[int, ...] = (), fuse: bool = False, all_hidden: bool = False,
                  rope_rows: int = 0) -> StaticRunner:
    """A `StaticRunner` of `rows` rows with an empty static cache of at least `static_length` slots per row for `model`
    (reused when it fits), leased to `owner` (`graphs.Leased`) when given; hand it back with `release_runner`.

    Runners are kept per (rows, buckets, the hidden states they keep, fuse, rope_rows, `capture_key(model)`, inference
    mode or not); one that is too short for a call is replaced by a longer one, and beyond `MAX_RUNNERS_PER_MODEL`
    settings the least recently used is dropped. A runner leased to a call still running (another thread) is never
    handed out twice: that call gets a runner of its own, not kept (correct, but it captures its own graphs)."""
    hidden_layers = tuple(int(i) for i in hidden_layers)
    settings = dict(hidden_layers=hidden_layers, fuse=bool(fuse), all_hidden=bool(all_hidden),
                    rope_rows=int(rope_rows))
    # (a runner whose cache was filled under inference mode, a serving engine's, cannot be updated outside it)
    key = (int(rows), tuple(sorted({int(b) for b in buckets})), *settings.values(), capture_key(model),
           torch.is_inference_mode_enabled())
    with _RUNNERS_LOCK:
        runners = _RUNNERS.setdefault(model, {})
        runner = runners.get(key)
        if runner is not None and runner.in_use:
            logger.warning_once("a static runner of this model is in use by another generate call or serving "
                                "engine: this one builds its own (concurrent users of one model each capture their "
                                "own graphs)")
            runner = StaticRunner(model, rows, static_length, buckets, **settings)
        else:
            runners.pop(key, None)
            if runner is not None and runner.static_length >= static_length:
                runner.cache.reset()
            else:
                runner = None  # drop the short one before allocating the new cache
                runner = StaticRunner(model, rows, static_length, buckets, **settings)
            runners[key] = runner  # most recently used last
            while len(runners) > MAX_RUNNERS_PER_MODEL:
                runners.pop(next(iter(runners)))
        if owner is not None:
            runner.lease(owner)
    return runner


def release_runner(model: nn.Module, runner: StaticRunner) -> None:
    """End `runner`'s lease; a runner longer than `MAX_KEPT_LENGTH` is dropped from the pool (its static cache and
    graphs are freed once the caller lets go of it) rather than kept for later calls."""
    runner.release()
    if runner.static_length <= MAX_KEPT_LENGTH:
        return
    with _RUNNERS_LOCK:
        runners = _RUNNERS.get(model, {})
        for key in [k for k, r in runners.items() if r is runner]:
            del runners[key]
