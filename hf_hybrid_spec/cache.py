"""HybridTreeCache: a transformers `DynamicCache` that verifies a whole draft tree in one forward.

Outside tree mode it is exactly the `DynamicCache` transformers builds for the model's config (prefill and
any ordinary forward go through the model's own code). In tree mode (`begin_tree` .. `commit`):

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
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from .kernels import (
    TreeGatedDeltaOutput,
    TreeMamba1Output,
    TreeMamba2Output,
    commit_causal_conv1d,
    commit_gated_delta_rule,
    commit_mamba1,
    commit_mamba2,
)
from .kernels.tree import validate_parent

__all__ = ["HybridTreeCache", "TreeState", "PendingRecurrent", "CacheSnapshot", "StaticCursor"]


@dataclass
class TreeState:
    """The tree being verified by the current forward.

    Attributes:
        parent: [B, N] int64 parent pointers over the verify input (node 0 is the root, the last committed
            token; its parent is -1).
        prefix_length: committed tokens already in the attention layers before this tree.
        num_nodes: optional [B] real node count per row (rows padded with dummy leaves).
    """

    parent: torch.Tensor
    prefix_length: int
    num_nodes: torch.Tensor | None = None
    _copies: dict = field(default_factory=dict, repr=False)

    def parent_on(self, device: torch.device) -> torch.Tensor:
        """`parent` on `device`, copied once per device (a model split over devices has layers on several)."""
        if self.parent.device == device:
            return self.parent
        if device not in self._copies:
            self._copies[device] = self.parent.to(device)
        return self._copies[device]


@dataclass
class PendingRecurrent:
    """What one recurrent layer computed for the current tree, to be committed once the leaf is known.

    Attributes:
        conv_inputs: [B, N, C] inputs of the short causal conv (before it), or None if the layer has none.
        gated_delta: factors of a gated-delta layer, or None.
        mamba2: factors of a Mamba-2 layer, or None.
        mamba1: factors of a Mamba-1 layer, or None.
        state_idx: which of the layer's conv/recurrent states these belong to.
    """

    conv_inputs: torch.Tensor | None = None
    gated_delta: TreeGatedDeltaOutput | None = None
    mamba2: TreeMamba2Output | None = None
    mamba1: TreeMamba1Output | None = None
    state_idx: int = 0


@dataclass
class CacheSnapshot:
    """A point to roll an ordinary (non-tree) cache back to: token counts of attention layers and copies of
    recurrent states. Used by drafters that decode a few tokens autoregressively and then undo them."""

    kv_lengths: dict[int, int]
    conv_states: dict[tuple[int, int], torch.Tensor]
    recurrent_states: dict[tuple[int, int], torch.Tensor]


class StaticCursor:
    """Where the next tree's keys go, shared by every static attention layer of a cache.

    `write_pos` is a device tensor [N] (prefix_length + arange(N)) owned by the caller; while `tree_mode` is
    set, static layers write there and return their whole buffers. A CUDA graph captured with a given
    `write_pos` keeps reading that tensor, so the caller updates it in place between replays.
    """

    def __init__(self):
        self.write_pos: torch.Tensor | None = None
        self.tree_mode = False


class StaticKVMixin:
    """Keys and values of one attention layer in preallocated buffers [B, H, max_length, D]."""

    is_sliding = False
    is_compileable = True

    def _init_static(self, max_length: int, cursor: StaticCursor) -> None:
        self.max_length = max_length
        self.cursor = cursor
        self.length = 0
        self.keys = None
        self.values = None
        self.is_initialized = False

    def _kv_lazy_init(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.keys = torch.zeros(b, h, self.max_length, d, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(b, h, self.max_length, value_states.shape[-1], dtype=value_states.dtype,
                                  device=value_states.device)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._kv_lazy_init(key_states, value_states)
        if self.cursor.tree_mode:
            # Tree nodes: scatter to the cursor's positions, attend over the full buffer (the mask hides the rest).
            write_pos = self.cursor.write_pos
            if write_pos.device != self.keys.device:  # a layer on another GPU than the runner (device_map)
                write_pos = write_pos.to(self.keys.device)
            self.keys.index_copy_(2, write_pos, key_states)
            self.values.index_copy_(2, write_pos, value_states)
            return self.keys, self.values
        t = key_states.shape[-2]
        if self.length + t > self.max_length:
            raise RuntimeError(f"static cache of {self.max_length} tokens is full ({self.length} + {t})")
        self.keys[:, :, self.length : self.length + t] = key_states
        self.values[:, :, self.length : self.length + t] = value_states
        self.length += t
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.max_length

    def reset(self) -> None:
        self.length = 0


class StaticKVLayer(StaticKVMixin, CacheLayerMixin):
    def __init__(self, max_length: int, cursor: StaticCursor):
        CacheLayerMixin.__init__(self)
        self._init_static(max_length, cursor)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._kv_lazy_init(key_states, value_states)


class StaticLinearKVLayer(StaticKVMixin, LinearAttentionLayer, CacheLayerMixin):
    """A layer holding both a recurrent state and attention KV (Falcon-H1's parallel hybrid layers); like
    transformers' LinearAttentionAndFullAttentionLayer it is both kinds of layer."""

    def __init__(self, max_length: int, cursor: StaticCursor, number_of_states: int = 1):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        CacheLayerMixin.__init__(self)
        self._init_static(max_length, cursor)

    def reset(self) -> None:
        StaticKVMixin.reset(self)
        LinearAttentionLayer.reset(self)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # transformers initializes the recurrent side with keyword states and the attention side through update().
        if args and not kwargs:
            self._kv_lazy_init(*args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)


def _kv_length(layer) -> int | None:
    """Committed tokens of an attention layer, None for layers without KV (or not yet filled)."""
    if isinstance(layer, StaticKVMixin):
        return layer.length if layer.is_initialized else None
    if _has_kv(layer) and layer.keys is not None and layer.keys.numel() > 0:
        return layer.keys.shape[-2]
    return None


def _kv_crop(layer, length: int) -> None:
    if isinstance(layer, StaticKVMixin):
        layer.length = length
    else:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def _kv_commit(layer, prefix: int, path: torch.Tensor) -> None:
    """Keep the prefix and the tree nodes `path` (indices into the tree, [k] on the layer's device)."""
    src = prefix + path
    if isinstance(layer, StaticKVMixin):
        dst = torch.arange(prefix, prefix + path.numel(), device=path.device)
        # index_select copies first, so overlapping source and destination ranges are safe.
        layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
        layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        layer.length = prefix + path.numel()
        return
    idx = torch.cat([torch.arange(prefix, device=path.device), src])
    layer.keys = layer.keys.index_select(-2, idx)
    layer.values = layer.values.index_select(-2, idx)


@dataclass
class _TreeBook:
    tree: TreeState
    pending: dict[int, list[PendingRecurrent]] = field(default_factory=dict)


def _is_linear(layer) -> bool:
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def _has_kv(layer) -> bool:
    # transformers' DummyLayer (layers without a cache, e.g. Nemotron-H MLP blocks) has the attributes but
    # never stores anything.
    return hasattr(layer, "keys") and hasattr(layer, "values") and type(layer).__name__ != "DummyLayer"


class HybridTreeCache(DynamicCache):
    """DynamicCache plus tree verification with factorized recurrent state (see module docstring).

    Args:
        config: the model config (the text config is taken from it), as for `DynamicCache(config=...)`.
        static_length: if given, attention layers use preallocated buffers of this many tokens (prompt,
            generated tokens and one tree), for CUDA-graph capture; see `cursor`.
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
            if static_length is None or not _has_kv(layer):
                continue
            if _is_linear(layer):
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

    def begin_tree(
        self, parent: torch.Tensor, prefix_length: int, num_nodes: torch.Tensor | None = None
    ) -> TreeState:
        """Enter tree mode for the next forward.

        Args:
            parent: [B, N] parent pointers over the verify input (root first, parent[:, 0] = -1).
            prefix_length: committed tokens in the cache, i.e. where the tree's keys will be appended.
            num_nodes: optional [B] real node counts.
        """
        if self._book is not None:
            raise RuntimeError("begin_tree called while another tree is pending; commit or abort it first")
        validate_parent(parent)
        if not self.is_ready():
            raise RuntimeError("the cache is empty: run the prompt (prefill) through the model before a tree")
        for idx, layer in enumerate(self.layers):
            length = _kv_length(layer)
            if length is not None and length != prefix_length:
                raise RuntimeError(f"layer {idx} holds {length} tokens but the tree expects a prefix of {prefix_length}")
        tree = TreeState(parent=parent.long(), prefix_length=prefix_length, num_nodes=num_nodes)
        self._book = _TreeBook(tree=tree)
        return tree

    def stash(self, layer_idx: int, pending: PendingRecurrent) -> None:
        """Called by model adapters during the tree forward of a recurrent layer."""
        if self._book is None:
            raise RuntimeError("stash called outside tree mode")
        self._book.pending.setdefault(layer_idx, []).append(pending)

    def recurrent_states(self, layer_idx: int, state_idx: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The committed (conv_state [B, C, S], recurrent_state) of a linear layer, read-only in tree mode."""
        layer = self.layers[layer_idx]
        if not _is_linear(layer):
            raise ValueError(f"layer {layer_idx} ({type(layer).__name__}) holds no recurrent state")
        if not layer.has_previous_state[state_idx]:
            raise RuntimeError(f"layer {layer_idx} has no committed state yet; prefill before verifying a tree")
        return layer.conv_states[state_idx], layer.recurrent_states[state_idx]

    def commit(self, leaf: torch.Tensor, path: list[int] | None = None) -> None:
        """Keep the root->leaf path of the pending tree and leave tree mode.

        leaf: [B] int64, the last accepted node per row (>= 0: the root itself is always committed).
        path: optional, row 0's accepted nodes root first (node 0) down to `leaf`, as the verifier found them;
            given, the commit reads nothing back from the device (no parent walk on the host).
        """
        if self._book is None:
            raise RuntimeError("commit called outside tree mode")
        book = self._book
        parent = book.tree.parent
        leaf = leaf.to(device=parent.device, dtype=torch.long)
        if parent.shape[0] != 1:
            raise NotImplementedError("committing trees with batch size > 1 is not supported yet")
        if path is None:
            if int(leaf.min()) < 0:
                raise ValueError("leaf must be >= 0: the root of a verify tree is always accepted")
            path = self._path(parent[0], int(leaf[0]))
        else:
            if not path or path[0] != 0 or any(b <= a for a, b in zip(path, path[1:])):
                raise ValueError(f"path must start at the root (node 0) and go down the tree, got {path}")
            path = torch.tensor(path, dtype=torch.long, device=parent.device)
        on_path = torch.zeros(parent.shape, dtype=torch.bool, device=parent.device)
        on_path[0, path] = True
        try:
            for idx, layer in enumerate(self.layers):
                if _kv_length(layer) is not None:
                    _kv_commit(layer, book.tree.prefix_length, path.to(layer.keys.device))
                for pending in book.pending.get(idx, []):
                    self._commit_recurrent(layer, pending, parent, leaf, on_path)
        finally:
            self._book = None

    def abort(self) -> None:
        """Drop the pending tree: attention layers go back to the prefix, recurrent states were never touched."""
        if self._book is None:
            return
        prefix = self._book.tree.prefix_length
        for layer in self.layers:
            if _kv_length(layer) is not None:
                _kv_crop(layer, prefix)
        self._book = None

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> CacheSnapshot:
        """Remember the current committed state (outside tree mode)."""
        if self._book is not None:
            raise RuntimeError("snapshot is not available in tree mode")
        kv, conv, rec = {}, {}, {}
        for idx, layer in enumerate(self.layers):
            length = _kv_length(layer)
            if length is not None:
                kv[idx] = length
            if _is_linear(layer):
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
            _kv_crop(self.layers[idx], length)
        for (idx, s), t in snap.conv_states.items():
            self.layers[idx].conv_states[s].copy_(t)
        for (idx, s), t in snap.recurrent_states.items():
            self.layers[idx].recurrent_states[s].copy_(t)

    # ------------------------------------------------------------------ helpers
    def is_ready(self) -> bool:
        """Whether a prefill has gone through (some layers, e.g. MLP-only blocks, never hold state)."""
        for layer in self.layers:
            if _is_linear(layer) and any(layer.has_previous_state.values()):
                return True
            if _kv_length(layer):
                return True
        return False

    @staticmethod
    def _path(parent_row: torch.Tensor, leaf: int) -> torch.Tensor:
        nodes = []
        par = parent_row.tolist()
        cur = leaf
        while cur >= 0:
            nodes.append(cur)
            cur = par[cur]
        return torch.tensor(nodes[::-1], dtype=torch.long, device=parent_row.device)

    @staticmethod
    def _commit_recurrent(layer, pending: PendingRecurrent, parent, leaf, on_path) -> None:
        s = pending.state_idx
        dev = (pending.conv_inputs if pending.conv_inputs is not None else layer.recurrent_states[s]).device
        parent, leaf, on_path = parent.to(dev), leaf.to(dev), on_path.to(dev)
        if pending.conv_inputs is not None:
            conv = layer.conv_states[s]
            new_conv = commit_causal_conv1d(conv, pending.conv_inputs, parent, leaf, on_path=on_path)
            # In place, so compiled graphs that captured the buffer's address stay valid.
            conv.copy_(new_conv)
        if pending.gated_delta is not None or pending.mamba2 is not None or pending.mamba1 is not None:
            state = layer.recurrent_states[s]
            if pending.gated_delta is not None:
                new_state = commit_gated_delta_rule(state, pending.gated_delta, parent, leaf, on_path=on_path)
            elif pending.mamba2 is not None:
                new_state = commit_mamba2(state, pending.mamba2, parent, leaf, on_path=on_path)
            else:
                new_state = commit_mamba1(state, pending.mamba1, parent, leaf, on_path=on_path)
            state.copy_(new_state.to(state.dtype))
