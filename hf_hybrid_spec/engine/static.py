"""Fixed-shape tree verification, captured as CUDA graphs (one per tree-size bucket).

Eager decoding of a small model is bound by kernel launches and Python, not by the GPU: stock `generate`
with a static cache compiles its forward to get rid of that overhead, and a speculative loop has to do the
same to win. `StaticTreeRunner` runs the verify forward over a `HybridTreeCache(static_length=...)`:

- the tree is padded to a bucket size N (8/16/32/64 by default): padding nodes hang off the committed state,
  so no real node ever attends to them or follows them;
- every input of the forward lives in a preallocated device buffer (tokens, parent pointers, the committed
  length and the root position); the tree mask, positions and write positions are computed from them inside
  the captured region, so one H2D copy per step feeds the graph;
- on CUDA, the forward (model, tree kernels, stashing of the recurrent factors) is captured once per bucket and
  replayed; a different bucket at the next step replays another graph, never recompiles;
- the commit is captured too, as a second graph per bucket: it reads the accepted leaf from a device buffer,
  gathers the accepted path's keys and values into place at fixed size (the whole bucket is copied; slots past
  the path land beyond the committed length, where the next tree overwrites or the mask hides them) and runs
  one commit kernel per recurrent layer; the host only writes the leaf and the attention layers' lengths;
- drafters that read the target's hidden states (EAGLE, HVD) get those of the committed tokens the same way: the
  commit graph copies the accepted path's rows of the requested layers into a per-token history buffer, like the
  keys and values, so a step needs no gather launched from the host and the hidden states of every committed token
  stay readable for the rest of the request (HVD hands them to its model drafter only when it next drafts with it);
- with `fuse=True` (`AssistantConfig.compile_verify`, on by default on a GPU) the model's pure regions (norms, MLPs,
  gate math) run Inductor-compiled inside the forward, so the captured graph replays fused kernels
  (`hf_hybrid_spec.fusion`);
- on CPU the same buffers and code run eagerly (no capture), which is what the CPU tests exercise.
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
from ..kernels.rows import gather_rows
from ..kernels.tree import ancestor_mask
from ..models import get_adapter
from ..models.tree_attention import routed_attention, tree_attention_enabled
from ..staging import HostStaging
from ..tree import VerifyTree, tree_attention_mask

logger = logging.get_logger(__name__)

__all__ = ["StaticTreeRunner", "StaticForwardOutput", "FusedForward", "DEFAULT_BUCKETS", "static_runner",
           "release_runner", "capture_key", "capture_bucket"]

DEFAULT_BUCKETS = (8, 16, 32, 64)


@dataclass
class _CaptureCount:
    total: int = 0  # graphs captured by every runner in this process (benchmarks check it stays flat)


CAPTURES = _CaptureCount()


@dataclass
class StaticForwardOutput:
    """Outputs of one verify forward, sliced to the tree's real nodes.

    Attributes:
        logits: [1, n, V].
        hidden_states: the model's hidden states ([1, n, H] each) when the runner was built to return them.
    """

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


class _Bucket:
    """Static buffers (and, on CUDA, the graph) of one tree size."""

    def __init__(self, n: int, max_length: int, device: torch.device, mask_dtype: torch.dtype,
                 offsets: torch.Tensor | None = None):
        self.n = n
        self.offsets = offsets  # [R, 1] multimodal RoPE offsets (the runner's, shared by its buckets), or None
        # Every per-step input in one device buffer, so one copy fills it: tokens [n], parent pointers [n] and
        # [prefix_length, root_position] (committed tokens in the cache, the root's position id). The graph reads
        # the views below; `staging` is its host twin (`HostStaging`: pinned on CUDA, the copy asynchronous).
        self.inputs = torch.zeros(2 * n + 2, dtype=torch.long, device=device)
        self.staging = HostStaging(2 * n + 2, device)
        self.tokens = self.inputs[:n].view(1, n)
        self.parent = self.inputs[n : 2 * n].view(1, n)
        self.parent.fill_(-1)
        self.scalars = self.inputs[2 * n :]
        self.write_pos = torch.arange(n, device=device)
        self.leaf = torch.zeros(1, dtype=torch.long, device=device)  # the accepted node, read by the commit
        self.prefix_valid = torch.ones(max_length, dtype=torch.bool, device=device)
        self.mask_dtype = mask_dtype
        self.max_length = max_length
        self.graph = None
        self.commit_graph = None
        self.out = None
        self.pending = None
        # Ancestor mask [n, n] and depth [n] of the tree, from the last forward (the commit reuses them).
        self.anc = None
        self.depth = None

    def prepare(self):
        """Mask [1, 1, n, L], positions [1, n] and write positions from the buffers (graph-safe: no host reads)."""
        prefix = self.scalars[0]
        anc = ancestor_mask(self.parent, include_self=True)  # [1, n, n]
        depth = anc[0].sum(-1) - 1
        self.anc, self.depth = anc[0], depth
        positions = (self.scalars[1] + depth).view(1, -1)
        if self.offsets is not None:
            positions = positions[None] + self.offsets[:, :, None]  # [R, 1, n]
        self.write_pos.copy_(prefix + torch.arange(self.n, device=prefix.device))
        return tree_attention_mask(anc, self.prefix_valid, prefix, self.mask_dtype), positions


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


class StaticTreeRunner(Leased):
    """Verify forwards of fixed shape over a static `HybridTreeCache`.

    Args:
        model: the target (its mixers routed by `get_adapter`).
        cache: a `HybridTreeCache` built with `static_length`, already holding the prompt.
        buckets: tree sizes (root included) to capture; a tree is padded to the smallest that fits.
        output_hidden_states: also return every layer's hidden states for the tree's nodes (the lossy arbiter).
        history_layers: hidden-state indices (as in `outputs.hidden_states`) whose values for the committed tokens
            the runner keeps (`committed_hidden`), written by the commit; for drafters that read the target's
            hidden states.
        use_graphs: capture CUDA graphs (default: when the model is on CUDA).
        fuse: run the model's pure regions Inductor-compiled in the verify forward (`hf_hybrid_spec.fusion`), its
            independent projections side by side and its attention on the tree-attention kernel.
        rope_rows: rows of multimodal RoPE position ids (Qwen3.5's vision-language model: 4), 0 for plain positions;
            the offsets of each request are set with `set_position_offsets`.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: HybridTreeCache,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        output_hidden_states: bool = False,
        history_layers: tuple[int, ...] = (),
        use_graphs: bool | None = None,
        fuse: bool = False,
        rope_rows: int = 0,
    ):
        if not cache.is_static:
            raise ValueError("StaticTreeRunner needs a HybridTreeCache built with static_length")
        adapter = get_adapter(model)  # route the recurrent mixers (else a tree forward would run the stock one)
        # The model and its modules are held weakly: the runner pool keeps runners per model, and a runner must not
        # be what keeps a deleted model (and its static cache) alive.
        self._model = weakref.ref(model)
        self.cache = cache
        self.device = model.device
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.output_hidden_states = output_hidden_states
        self.history_layers = tuple(int(i) for i in history_layers)
        if use_graphs is None:
            # A CUDA graph lives on one device: a model split over devices (device_map) runs the static path eagerly.
            devices = {p.device for p in model.parameters()}
            use_graphs = self.device.type == "cuda" and len(devices) == 1
        self.use_graphs = use_graphs
        self.fuse = fuse
        self._fused = FusedForward(model, adapter) if fuse else None
        max_length = next(layer.max_length for layer in cache.layers if hasattr(layer, "max_length"))
        self.rope_rows = rope_rows
        self._offsets = torch.zeros(rope_rows, 1, dtype=torch.long, device=self.device) if rope_rows else None
        self._buckets = {n: _Bucket(n, max_length, self.device, model.dtype, self._offsets) for n in self.buckets}
        # [layers, 1, max_length, hidden]: the history_layers' hidden states of the committed tokens, by position.
        self.history = None
        if self.history_layers:
            hidden_size = model.config.get_text_config().hidden_size
            self.history = torch.zeros(len(self.history_layers), 1, max_length, hidden_size, dtype=model.dtype,
                                       device=self.device)
        self._pool = None
        self.captures = 0  # graphs captured so far (a budget change must not add any beyond one per bucket)
        self.static_length = max_length
        self._active: _Bucket | None = None  # the bucket of the pending tree
        # The commit graph needs graph-safe commit ops: the Triton kernels (the PyTorch commit reads the path
        # back to the host). Decided once per runner, as the backend is per call of generate.
        self._graph_commit = None

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this static runner has been deleted")
        return model

    @property
    def max_nodes(self) -> int:
        return self.buckets[-1]

    def set_prefix_valid(self, valid: torch.Tensor) -> None:
        """0/1 [P] padding mask of the prompt (generated tokens are always valid)."""
        for b in self._buckets.values():
            b.prefix_valid.fill_(True)
            b.prefix_valid[: valid.numel()].copy_(valid.bool().view(-1))

    def set_position_offsets(self, offsets: torch.Tensor) -> None:
        """[R, 1] multimodal RoPE offsets of the request (`VerifyTree.position_ids`), copied into the graphs' input."""
        if self._offsets is None or offsets.shape != self._offsets.shape:
            expected = None if self._offsets is None else tuple(self._offsets.shape)
            raise ValueError(f"this runner takes offsets of shape {expected}, got {tuple(offsets.shape)}")
        self._offsets.copy_(offsets)

    def forward(self, tree: VerifyTree, prefix_length: int, root_position: int) -> StaticForwardOutput:
        """Run `tree` (n <= max bucket nodes) and leave the cache in tree mode (commit or abort next)."""
        n = tree.num_nodes
        bucket = self._buckets[next(b for b in self.buckets if b >= n)]
        self._active = None
        # Padding nodes get token 0 and parent -1. A tree laid out on the host goes in with one copy.
        if tree.tokens.device.type == "cpu" and tree.parent.device.type == "cpu":
            pad = bucket.n - n
            values = (tree.tokens[0].tolist() + [0] * pad + tree.parent[0].tolist() + [-1] * pad
                      + [int(prefix_length), int(root_position)])
            bucket.staging.host().copy_(torch.tensor(values, dtype=torch.long))
            bucket.staging.send(bucket.inputs)
        else:
            bucket.tokens.zero_()
            bucket.tokens[:, :n].copy_(tree.tokens, non_blocking=True)
            bucket.parent.fill_(-1)
            bucket.parent[:, :n].copy_(tree.parent, non_blocking=True)
            bucket.scalars.copy_(torch.tensor([prefix_length, root_position]), non_blocking=True)
        if self.use_graphs:
            if bucket.graph is None:
                self._capture(bucket, prefix_length)
            # The graph rewrites the captured factor tensors in place: the stash from capture time stays valid.
            self.cache.begin_tree(bucket.parent, prefix_length, pending=bucket.pending, check=False)
            bucket.graph.replay()
        else:
            bucket.out = self._run(bucket, prefix_length)
        self._active = bucket
        out = bucket.out
        hidden = None
        if self.output_hidden_states:
            hidden = tuple(h[:, :n] for h in out.hidden_states)
        return StaticForwardOutput(logits=out.logits[:, :n], hidden_states=hidden)

    def committed_hidden(self, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Hidden states [1, end - start, H] of committed positions start .. end, one per history layer (views of
        the history buffer: valid until the runner's next request; committed positions are never rewritten)."""
        if self.history is None:
            raise RuntimeError("this runner keeps no hidden-state history (built without history_layers)")
        if not 0 <= start <= end <= self.static_length:
            raise ValueError(f"positions {start}..{end} outside the runner's {self.static_length} slots")
        return tuple(self.history[j, :, start:end] for j in range(len(self.history_layers)))

    def commit(self, path: list[int]) -> None:
        """Commit the pending tree's root->leaf `path` (node indices, root first, as the verifier found them).

        Replays the bucket's commit graph on CUDA (the host writes the leaf and the attention layers' lengths),
        runs the same code eagerly elsewhere.
        """
        bucket, tree = self._active, self.cache.tree
        if tree is None or bucket is None:
            raise RuntimeError("commit called without a pending tree from this runner's forward")
        if not path or path[0] != 0 or any(b <= a for a, b in zip(path, path[1:])) or path[-1] >= bucket.n:
            raise ValueError(f"path must start at the root (node 0) and go down the tree, got {path}")
        committed = tree.prefix_length + len(path)
        try:
            bucket.leaf.fill_(path[-1])
            if bucket.commit_graph is not None:
                bucket.commit_graph.replay()
            else:
                self._commit_body(bucket)
        except BaseException:
            self.cache.abort()
            raise
        finally:
            self._active = None
        self.cache.end_tree(committed)

    def abort(self) -> None:
        """Drop the pending tree (nothing committed changes)."""
        self.cache.abort()
        self._active = None

    def capture_all(self, prefix_length: int) -> None:
        """Capture every bucket now (after a prefill, so the cache's buffers exist), not at first use."""
        if not self.use_graphs:
            return
        for bucket in self._buckets.values():
            if bucket.graph is None:
                bucket.scalars.copy_(torch.tensor([prefix_length, prefix_length]))
                self._capture(bucket, prefix_length)

    # ------------------------------------------------------------------ internals
    def _commit_body(self, bucket: _Bucket) -> None:
        """Keep the path to `bucket.leaf` with fixed-shape device ops only (graph-safe, no host reads).

        leaf = -1 commits nothing: recurrent states stay bit-identical and the attention copies only touch the
        slots from the prefix on (the warm-up before capture relies on that).
        """
        leaf, n = bucket.leaf, bucket.n
        nodes = torch.arange(n, device=leaf.device)
        on_path = bucket.anc[leaf.clamp(min=0)] & (leaf >= 0).view(1, 1)  # [1, n]
        # order[p]: the path node at depth p (root first); rows past the leaf's depth pick node 0, and their
        # copies land past the new committed length.
        at_depth = on_path & (bucket.depth.view(1, n) == nodes.view(n, 1))  # [n (depth), n (node)]
        order = at_depth.to(torch.int32).argmax(-1)
        dst = bucket.write_pos
        self.cache.commit(leaf, on_path, bucket.scalars[0] + order, dst)
        if self.history is not None:
            # The path's hidden states by depth, at the positions its keys and values went to (rows past the leaf
            # land beyond the committed length, as there).
            # One launch for all layers where the Triton kernel applies (a model split over devices, eager static
            # path, has its layers' states on their own devices: the PyTorch path reads each on its own).
            states = bucket.out.hidden_states
            gather_rows(self.history, tuple(states[i] for i in self.history_layers), order, dst)

    def _run(self, bucket: _Bucket, prefix_length: int):
        """The forward itself, in tree mode; keeps the recurrent factors the adapters stash (the cache stays in tree
        mode: commit or abort next)."""
        cursor = self.cache.cursor
        self.cache.begin_tree(bucket.parent, prefix_length, check=False)
        mask, positions = bucket.prepare()
        cursor.write_pos, cursor.tree_mode = bucket.write_pos, True
        try:
            with self._fused.regions(self.model) if self._fused is not None else contextlib.nullcontext():
                out = forward_tokens(
                    self.model, bucket.tokens, self.cache, position_ids=positions, attention_mask=mask,
                    logits_to_keep=0, output_hidden_states=self.output_hidden_states or bool(self.history_layers),
                )
        except BaseException:
            self.cache.abort()
            raise
        finally:
            cursor.tree_mode = False
        bucket.pending = self.cache.pending
        return out

    def _forward_and_leave(self, bucket: _Bucket, prefix_length: int):
        """One forward of `bucket`'s tree, the cache back out of tree mode after it (nothing committed): what a
        capture records."""
        try:
            return self._run(bucket, prefix_length)
        finally:
            self.cache.end_tree()

    def _commit_and_leave(self, bucket: _Bucket, prefix_length: int) -> None:
        """The commit body over `bucket`'s captured tree (with leaf = -1 at capture: nothing changes), the cache out
        of tree mode after it."""
        self.cache.begin_tree(bucket.parent, prefix_length, pending=bucket.pending, check=False)
        try:
            self._commit_body(bucket)
        finally:
            self.cache.end_tree()

    def _capture(self, bucket: _Bucket, prefix_length: int) -> None:
        # Warm-up forwards only write tree keys beyond the committed prefix and stash factors: nothing committed
        # changes. The last call (the captured one) leaves the bucket's mask, depth and factors in the graph's pool.
        capture_bucket(self, bucket, lambda: self._forward_and_leave(bucket, prefix_length),
                       lambda: self._commit_and_leave(bucket, prefix_length))
        logger.info("captured the verify forward for trees of %d nodes", bucket.n)


def capture_bucket(runner, bucket, forward, commit) -> None:
    """Capture one bucket of a static runner (`StaticTreeRunner`, `batch_static.BatchStaticRunner`): `forward()` (one
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


def static_runner(
    model: nn.Module, static_length: int, buckets: tuple[int, ...], output_hidden_states: bool, owner=None,
    history_layers: tuple[int, ...] = (), fuse: bool = False, rope_rows: int = 0,
) -> StaticTreeRunner:
    """A runner with an empty static cache of at least `static_length` tokens for `model` (reused when it fits),
    leased to `owner` (`graphs.Leased`) when given; hand it back with `release_runner`.

    Runners are kept per (buckets, output_hidden_states, history_layers, fuse, rope_rows, `capture_key(model)`); one
    that is too
    short for a request is replaced by a longer one, and beyond `MAX_RUNNERS_PER_MODEL` settings the least recently
    used is dropped. A runner leased to a call still running (another thread) is never handed out twice: that request
    gets a runner of its own, not kept (correct, but it captures its own graphs).
    """
    history_layers = tuple(int(i) for i in history_layers)
    key = (tuple(sorted({int(b) for b in buckets})), bool(output_hidden_states), history_layers, bool(fuse),
           int(rope_rows), capture_key(model))
    with _RUNNERS_LOCK:
        runners = _RUNNERS.setdefault(model, {})
        runner = runners.get(key)
        if runner is not None and runner.in_use:
            logger.warning_once("a static runner of this model is in use by another generate call: this call builds "
                                "its own (concurrent calls with compile=True each capture their own graphs)")
            runner = StaticTreeRunner(model, HybridTreeCache(model.config, static_length=static_length), buckets,
                                      output_hidden_states=output_hidden_states, history_layers=history_layers,
                                      fuse=fuse, rope_rows=rope_rows)
        else:
            runners.pop(key, None)
            if runner is not None and runner.static_length >= static_length:
                runner.cache.reset()
            else:
                runner = None  # drop the short one before allocating the new cache
                cache = HybridTreeCache(model.config, static_length=static_length)
                runner = StaticTreeRunner(model, cache, buckets, output_hidden_states=output_hidden_states,
                                          history_layers=history_layers, fuse=fuse, rope_rows=rope_rows)
            runners[key] = runner  # most recently used last
            while len(runners) > MAX_RUNNERS_PER_MODEL:
                runners.pop(next(iter(runners)))
        if owner is not None:
            runner.lease(owner)
    return runner


def release_runner(model: nn.Module, runner: StaticTreeRunner) -> None:
    """End `runner`'s lease; a runner longer than `MAX_KEPT_LENGTH` is dropped from the pool (its static cache and
    graphs are freed once the caller lets go of it) rather than kept for later requests."""
    runner.release()
    if runner.static_length <= MAX_KEPT_LENGTH:
        return
    with _RUNNERS_LOCK:
        runners = _RUNNERS.get(model, {})
        for key in [k for k, r in runners.items() if r is runner]:
            del runners[key]
