"""Cache layers of the static (CUDA-graph) variant, and helpers over transformers' layer kinds.

Attention layers of a static cache keep keys and values in preallocated [B, H, L, D] buffers; a tree forward writes
its nodes at the positions held by a device tensor (`StaticCursor.write_pos`) and attends over the whole buffer
under its mask, so every shape and address is fixed and the forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

__all__ = ["StaticCursor", "StaticKVMixin", "StaticKVLayer", "StaticLinearKVLayer", "buffers_missing", "kv_length",
           "kv_crop", "kv_keep", "is_linear", "has_kv", "scatter_slots", "gather_slots"]


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
            if write_pos.ndim == 2:  # [B, N]: each row's own slots (the batched runner's rows differ in length)
                scatter_slots(self.keys, write_pos, key_states)
                scatter_slots(self.values, write_pos, value_states)
            else:
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

    def keep(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys and values of slots `src` to slots `dst` in place (the buffers' addresses, which captured
        graphs hold, never change): [n] each for every row alike, or [B, n] each row its own. The reads are copies
        made first, so overlapping source and destination slots are safe."""
        if src.ndim == 2:
            scatter_slots(self.keys, dst, gather_slots(self.keys, src))
            scatter_slots(self.values, dst, gather_slots(self.values, src))
        else:
            self.keys.index_copy_(2, dst, self.keys.index_select(2, src))
            self.values.index_copy_(2, dst, self.values.index_select(2, src))

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


def kv_length(layer) -> int | None:
    """Committed tokens of an attention layer, None for layers without KV (or not yet filled)."""
    if isinstance(layer, StaticKVMixin):
        return layer.length if layer.is_initialized else None
    if has_kv(layer) and layer.keys is not None and layer.keys.numel() > 0:
        return layer.keys.shape[-2]
    return None


def buffers_missing(cache) -> bool:
    """Whether a static cache's attention buffers do not exist yet (they are made by the first forward through it, so
    a sequence started from nothing, as trees, needs a one-token forward first)."""
    return any(isinstance(layer, StaticKVMixin) and not layer.is_initialized for layer in cache.layers)


def kv_crop(layer, length: int) -> None:
    """Keep the first `length` tokens of an attention layer."""
    if isinstance(layer, StaticKVMixin):
        layer.length = length
    else:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def kv_keep(layer, src: torch.Tensor, dst: torch.Tensor | None) -> None:
    """Keep the key slots `src` of an attention layer: a static layer copies them to `dst` in place
    (`StaticKVMixin.keep`); a dynamic one becomes them ([B, S] each row's slots in order: the rows' tokens
    right-aligned, `dst` unused)."""
    src = src.to(layer.keys.device)
    if isinstance(layer, StaticKVMixin):
        layer.keep(src, dst.to(layer.keys.device))
        return
    layer.keys = gather_slots(layer.keys, src)
    layer.values = gather_slots(layer.values, src)


def is_linear(layer) -> bool:
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def has_kv(layer) -> bool:
    # transformers' DummyLayer (layers without a cache, e.g. Nemotron-H MLP blocks) has the attributes but
    # never stores anything.
    return hasattr(layer, "keys") and hasattr(layer, "values") and type(layer).__name__ != "DummyLayer"


def scatter_slots(buffer: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """buffer [B, H, L, D] with buffer[b, :, slots[b, j]] = values[b, :, j] (slots [B, N], values [B, H, N, D])."""
    b, h, n, d = values.shape
    buffer.scatter_(2, slots[:, None, :, None].expand(b, h, n, d), values)


def gather_slots(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] with out[b, :, j] = buffer[b, :, slots[b, j]] (slots [B, N])."""
    b, h, _, d = buffer.shape
    return buffer.gather(2, slots[:, None, :, None].expand(b, h, slots.shape[1], d))
