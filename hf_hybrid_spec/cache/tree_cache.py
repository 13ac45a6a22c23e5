"""HybridTreeCache: a transformers `DynamicCache` that verifies a whole draft tree in one forward.

Outside tree mode it is exactly the `DynamicCache` transformers builds for the model's config (prefill and
any ordinary forward go through the model's own code). In tree mode (`begin_tree` .. `commit`, `end_tree`):

- attention layers append the N tree nodes after the committed prefix through the stock `update`; the
  tree attention mask (built by the generate loop) keeps each node on its own root path. `commit` keeps the
  prefix plus the accepted path's keys and values.
- linear-attention / SSM / short-conv layers never touch the committed state during verification: the
  model adapter computes the tree in closed form and `stash`es token-level factors here (no state per
  node). `commit` rebuilds the accepted path's state and conv window from those factors, exactly, through
  `hf_hybrid_spec.kernels`.

`abort` drops a tree without committing anything, so an exception during verification leaves the cache as
it was before `begin_tree`. A chain is the special case parent[i] = i - 1.

Static variant (`HybridTreeCache(config, static_length=L)`): attention layers keep keys and values in
preallocated [B, H, L, D] buffers; a tree forward writes its nodes at the positions held by a device tensor
(`StaticCursor.write_pos`) and attends over the whole buffer under its mask, so every shape and address is
fixed and the forward can be captured in a CUDA graph. Commit gathers the accepted path into place with index
copies. Recurrent states are fixed-size in both variants and always updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..kernels import commit_causal_conv1d
from ..kernels.tree import validate_parent
from .layers import (
    StaticCursor,
    StaticKVLayer,
    StaticKVMixin,
    StaticLinearKVLayer,
    has_kv,
    is_linear,
    kv_keep,
    kv_crop,
    kv_length,
)
from .state import CacheSnapshot, PendingRecurrent, TreeState

__all__ = ["HybridTreeCache", "check_paths", "commit_paths", "right_aligned_index"]


@dataclass
class _TreeBook:
    tree: TreeState
    pending: dict[int, list[PendingRecurrent]] = field(default_factory=dict)


class HybridTreeCache(DynamicCache):
    """DynamicCache plus tree verification with factorized recurrent state (see module docstring).

    Args:
        config: the model config (the text config is taken from it), as for `DynamicCache(config=...)`.
        static_length: if given, attention layers use preallocated buffers of this many tokens (prompt,
            generated tokens and one tree), for CUDA-graph capture; see `cursor`.

    Tree lifecycle: `begin_tree` -> the model's forward (adapters `stash` their factors) -> `commit(...)` (the part on
    the device: fixed shapes, no host read, so a static runner captures it in a graph) then
    `end_tree(committed_length)`, or `abort()`. `commit_paths` commits a dynamic cache from the accepted paths.
    """

    def __init__(self, config, static_length: int | None = None):
        super().__init__(config=config)
        self._book: _TreeBook | None = None
        self.cursor = StaticCursor() if static_length is not None else None
        for idx, layer in enumerate(self.layers):
            if getattr(layer, "is_sliding", False):
                raise NotImplementedError(
                    f"layer {idx} uses sliding-window attention, which tree verification does not support yet"
                )
            if static_length is None or not has_kv(layer):
                continue
            if is_linear(layer):
                self.layers[idx] = StaticLinearKVLayer(static_length, self.cursor, layer.number_of_states)
            else:
                self.layers[idx] = StaticKVLayer(static_length, self.cursor)

    @property
    def is_static(self) -> bool:
        return self.cursor is not None

    def reset(self) -> None:
        """Empty the cache for a new request, keeping every buffer (and so its address) in place."""
        self._book = None
        super().reset()

    # ------------------------------------------------------------------ tree lifecycle
    @property
    def tree(self) -> TreeState | None:
        """The tree under verification, or None outside tree mode."""
        return None if self._book is None else self._book.tree

    @property
    def in_tree_mode(self) -> bool:
        return self._book is not None

    @property
    def pending(self) -> dict[int, list[PendingRecurrent]]:
        """What the recurrent layers stashed for the pending tree, by layer (empty outside tree mode). A static runner
        keeps the stash of a captured forward and hands it back to `begin_tree`: replays rewrite its tensors."""
        return {} if self._book is None else self._book.pending

    def begin_tree(
        self, parent: torch.Tensor, prefix_length: int, num_nodes: torch.Tensor | None = None,
        pending: dict[int, list[PendingRecurrent]] | None = None, check: bool = True,
    ) -> TreeState:
        """Enter tree mode for the next forward.

        Args:
            parent: [B, N] parent pointers over the verify input (root first, parent[:, 0] = -1).
            prefix_length: committed tokens in the cache, i.e. where the tree's keys will be appended.
            num_nodes: optional [B] real node counts.
            pending: the stash of an earlier forward over the same (static) buffers, reused as it is: a CUDA graph
                replay rewrites those tensors in place instead of stashing again.
            check: validate `parent` and the layers' lengths (a static runner's device-side parents skip it).
        """
        if self._book is not None:
            raise RuntimeError("begin_tree called while another tree is pending; commit or abort it first")
        if check:
            validate_parent(parent)
            if not self.is_ready():
                raise RuntimeError("the cache is empty: run the prompt (prefill) through the model before a tree")
            for idx, layer in enumerate(self.layers):
                length = kv_length(layer)
                if length is not None and length != prefix_length:
                    raise RuntimeError(f"layer {idx} holds {length} tokens but the tree expects a prefix of "
                                       f"{prefix_length}")
        tree = TreeState(parent=parent if parent.dtype == torch.long else parent.long(), prefix_length=prefix_length,
                         num_nodes=num_nodes)
        self._book = _TreeBook(tree=tree, pending={} if pending is None else pending)
        return tree

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The committed tokens, read from the first layer with keys when `layer_idx` has none. transformers 5.25 on
        count tokens in linear-attention layers too, as its own forwards update their states; a tree commit writes
        those states directly, so their count would lag behind (transformers before 5.25 read an attention layer, as
        this does)."""
        if layer_idx < len(self.layers) and is_linear(self.layers[layer_idx]) and not has_kv(self.layers[layer_idx]):
            for layer in self.layers:
                length = kv_length(layer)
                if length is not None:
                    return length
        return super().get_seq_length(layer_idx)

    def stash(self, layer_idx: int, pending: PendingRecurrent) -> None:
        """Called by model adapters during the tree forward of a recurrent layer."""
        if self._book is None:
            raise RuntimeError("stash called outside tree mode")
        self._book.pending.setdefault(layer_idx, []).append(pending)

    def recurrent_states(self, layer_idx: int, state_idx: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The committed (conv_state [B, C, S], recurrent_state) of a linear layer, read-only in tree mode."""
        layer = self.layers[layer_idx]
        if not is_linear(layer):
            raise ValueError(f"layer {layer_idx} ({type(layer).__name__}) holds no recurrent state")
        if not layer.has_previous_state[state_idx]:
            raise RuntimeError(f"layer {layer_idx} has no committed state yet; prefill before verifying a tree")
        return layer.conv_states[state_idx], layer.recurrent_states[state_idx]

    def commit(self, leaf: torch.Tensor, on_path: torch.Tensor, src: torch.Tensor,
               dst: torch.Tensor | None = None) -> None:
        """Keep each row's accepted path of the pending tree: each attention layer keeps its key slots `src` (each
        layer as its kind does, `layers.kv_keep`), each recurrent layer rebuilds its state along `on_path`. Fixed
        shapes and no host read (what a static runner captures in a CUDA graph); `end_tree` leaves tree mode after
        (`commit_paths` does both from the paths on the host, for a dynamic cache).

        Args:
            leaf: [B] each row's last accepted node (the root is always accepted); -1 commits nothing: recurrent
                states stay bit-identical, and a static layer's copies only write slots past the committed length
                (a capture's warm-up relies on that).
            on_path: [B, N] bool, each row's accepted nodes.
            src: a dynamic cache's [B, S] slots of each row's committed tokens then its path, in order (the rows
                end right-aligned in S slots, the slots before a row's tokens filler its mask hides); a static
                cache's slots of the path's nodes in order ([n] for every row alike, or [B, n]), then filler.
            dst: a static cache's slots those go to (after each row's committed tokens; the filler's copies land
                past the committed length).
        """
        if self._book is None:
            raise RuntimeError("commit called outside tree mode")
        for idx, layer in enumerate(self.layers):
            if kv_length(layer) is not None:
                kv_keep(layer, src, dst)
            self._commit_recurrent(idx, layer, leaf, on_path)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` ([R] int64, in the order given) of every layer, outside tree mode: the rows of a
        batch that finished stop costing verification work."""
        if self._book is not None:
            raise RuntimeError("select_rows is not available in tree mode")
        for layer in self.layers:
            if kv_length(layer) is not None:
                where = rows.to(layer.keys.device)
                layer.keys = layer.keys.index_select(0, where)
                layer.values = layer.values.index_select(0, where)
            if is_linear(layer):
                for states in (layer.conv_states, layer.recurrent_states):
                    for s, t in states.items():
                        if t is not None:
                            states[s] = t.index_select(0, rows.to(t.device))

    def end_tree(self, committed_length: int | None = None) -> None:
        """Leave tree mode after `commit`: the static attention layers now hold `committed_length` tokens (None: as
        before the tree, nothing committed; a dynamic cache's layers hold what `commit` kept)."""
        if self._book is None:
            return
        length = self._book.tree.prefix_length if committed_length is None else committed_length
        for layer in self.layers:
            if isinstance(layer, StaticKVMixin) and layer.is_initialized:
                layer.length = length
        self._book = None

    def abort(self) -> None:
        """Drop the pending tree: attention layers go back to the prefix, recurrent states were never touched."""
        if self._book is None:
            return
        prefix = self._book.tree.prefix_length
        for layer in self.layers:
            if kv_length(layer) is not None:
                kv_crop(layer, prefix)
        self._book = None

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> CacheSnapshot:
        """Remember the current committed state (outside tree mode)."""
        if self._book is not None:
            raise RuntimeError("snapshot is not available in tree mode")
        kv, conv, rec = {}, {}, {}
        for idx, layer in enumerate(self.layers):
            length = kv_length(layer)
            if length is not None:
                kv[idx] = length
            if is_linear(layer):
                for s, t in layer.conv_states.items():
                    if t is not None:
                        conv[(idx, s)] = t.clone()
                for s, t in layer.recurrent_states.items():
                    if t is not None:
                        rec[(idx, s)] = t.clone()
        return CacheSnapshot(kv_lengths=kv, conv_states=conv, recurrent_states=rec)

    def restore(self, snap: CacheSnapshot) -> None:
        """Roll back to `snap`: crop attention layers, copy recurrent states back in place."""
        for idx, length in snap.kv_lengths.items():
            kv_crop(self.layers[idx], length)
        for (idx, s), t in snap.conv_states.items():
            self.layers[idx].conv_states[s].copy_(t)
        for (idx, s), t in snap.recurrent_states.items():
            self.layers[idx].recurrent_states[s].copy_(t)

    # ------------------------------------------------------------------ helpers
    def is_ready(self) -> bool:
        """Whether a prefill has gone through (some layers, e.g. MLP-only blocks, never hold state)."""
        for layer in self.layers:
            if is_linear(layer) and any(layer.has_previous_state.values()):
                return True
            if kv_length(layer):
                return True
        return False

    def _commit_recurrent(self, layer_idx: int, layer, leaf: torch.Tensor, on_path: torch.Tensor) -> None:
        """Rebuild layer `layer_idx`'s conv window and recurrent state along the accepted path, in place (compiled
        graphs that captured the buffers' addresses stay valid). The tree op's output commits its own kind."""
        parent = self._book.tree.parent
        for pending in self._book.pending.get(layer_idx, []):
            s = pending.state_idx
            dev = (pending.conv_inputs if pending.conv_inputs is not None else layer.recurrent_states[s]).device
            par, lf, mask = parent.to(dev), leaf.to(dev), on_path.to(dev)
            if pending.conv_inputs is not None:
                conv = layer.conv_states[s]
                conv.copy_(commit_causal_conv1d(conv, pending.conv_inputs, par, lf, on_path=mask))
            if pending.recurrent is not None:
                # Written in place: the Triton commits write the state buffer directly (no copy of the whole state).
                state = layer.recurrent_states[s]
                pending.recurrent.commit(state, par, lf, on_path=mask, into=state)


def right_aligned_index(paths: list[list[int]], valid: list[int], prefix: int) -> torch.Tensor:
    """[B, S'] key slots to gather so that row b's committed tokens (its last `valid[b]` of `prefix` slots, then its
    tree nodes `paths[b]`, which sit at prefix + node) end up as the last of S' = max_b(valid[b] + len(paths[b]))
    slots; the slots before them read slot 0 (filler, masked by the caller). Built on the host in a few vectorized
    ops (no per-token Python loop)."""
    kept = torch.tensor([v + len(p) for v, p in zip(valid, paths)], dtype=torch.long)
    width = int(kept.max())
    depth = max(len(p) for p in paths)
    nodes = torch.tensor([p + [0] * (depth - len(p)) for p in paths], dtype=torch.long)  # [B, K]
    counts = torch.tensor(valid, dtype=torch.long)[:, None]
    t = torch.arange(width)[None] - (width - kept)[:, None]  # position within the row's kept tokens (< 0: filler)
    from_tree = prefix + nodes.gather(1, (t - counts).clamp(0, depth - 1))
    index = torch.where(t < counts, prefix - counts + t, from_tree)
    return torch.where(t < 0, 0, index)


def check_paths(paths: list[list[int]], nodes: int) -> None:
    """Raise a ValueError unless every path starts at the root (node 0) and goes down a tree of `nodes` nodes in
    increasing node order (as every verifier returns them): a commit must never read another path."""
    for path in paths:
        if not path or path[0] != 0 or path[-1] >= nodes or any(y <= x for x, y in zip(path, path[1:])):
            raise ValueError(f"path must start at the root (node 0) and go down the tree, got {path}")


def commit_paths(cache: HybridTreeCache, paths: list[list[int]], valid: list[int]) -> int:
    """Commit a dynamic cache's pending tree from each row's accepted path and leave tree mode. Returns the number of
    key slots S' the attention layers hold after.

    Layout (what the eager backends keep): the attention layers hold S = `prefix_length` slots per row, row b's
    `valid[b]` committed tokens in the last of them (the slots before are left padding or filler, masked); the tree's
    N nodes follow. After the commit, row b's `valid[b] + len(paths[b])` tokens are again the last of
    S' = max_b(valid[b] + len(paths[b])) slots: one gather per layer right-aligns every row, so rows that accept fewer
    tokens leave no holes behind and S' never exceeds the longest row. One row with `valid` = S keeps its slots in
    place and appends its path.

    Args:
        paths: per row, the accepted nodes root first (node 0) down to the leaf, as the verifier found them.
        valid: per row, the committed tokens among the S slots before the tree.
    """
    tree = cache.tree
    if tree is None:
        raise RuntimeError("commit_paths called outside tree mode")
    if cache.is_static:
        raise NotImplementedError("commit_paths is for dynamic caches; a static runner commits on the device")
    b, n = tree.parent.shape
    if len(paths) != b or len(valid) != b:
        raise ValueError(f"commit_paths needs one path and one valid count per row ({b}), got {len(paths)} and "
                         f"{len(valid)}")
    check_paths(paths, n)
    index = right_aligned_index(paths, valid, tree.prefix_length)
    on_path = torch.zeros(b, n, dtype=torch.bool)
    for row, path in enumerate(paths):
        on_path[row, path] = True
    device = tree.parent.device
    leaf = torch.tensor([path[-1] for path in paths], dtype=torch.long)
    try:
        cache.commit(leaf.to(device, non_blocking=True), on_path.to(device, non_blocking=True),
                     index.to(device, non_blocking=True))
    finally:
        cache.end_tree()
    return index.shape[1]
