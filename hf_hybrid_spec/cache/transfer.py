"""Moving a committed state between caches: what a call continues from, what a serving slot is filled with, what the
prefix store keeps.

    state = export_committed(cache)             # clones: one row's KV [1, H, L, D] per attention layer, conv and
                                                # recurrent states per recurrent layer
    import_committed(other_cache, state)        # a fresh (or reset) B = 1 cache now holds the same L tokens
    import_committed(batched_cache, state, row=r)  # row r of a static batched cache (a serving slot)

Works between transformers' `DynamicCache` and both variants of `HybridTreeCache` (dynamic and static layers) built
for the same config: the layer kinds may differ (a static cache's attention layers keep preallocated buffers), the
layer count and the tensors' shapes past the batch and length dimensions may not. Imports copy into a cache's
existing buffers where it has them (a captured CUDA graph keeps reading their addresses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layers import StaticKVMixin, is_linear, kv_length

__all__ = ["CommittedState", "export_committed", "import_committed", "committed_length", "zero_states"]


@dataclass
class CommittedState:
    """One row's committed state, detached from any cache.

    Attributes:
        length: committed tokens (the attention layers' key count).
        kv: layer index -> (keys, values), each [1, H, length, D].
        conv / recurrent: (layer index, state index) -> the state, batch dimension 1.
    """

    length: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    conv: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    recurrent: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.kv.values() for t in pair] + list(self.conv.values()) + \
            list(self.recurrent.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device | str) -> CommittedState:
        move = lambda t: t.to(device)  # noqa: E731
        return CommittedState(self.length, {i: (move(k), move(v)) for i, (k, v) in self.kv.items()},
                              {i: move(t) for i, t in self.conv.items()},
                              {i: move(t) for i, t in self.recurrent.items()})


def committed_length(cache) -> int:
    """Tokens a cache holds (0 for an empty one): its attention layers' length, or 0 when none is filled."""
    lengths = {kv_length(layer) for layer in cache.layers} - {None}
    if len(lengths) > 1:
        raise ValueError(f"the cache's attention layers hold different lengths {sorted(lengths)}: not a committed "
                         "state a call can continue from")
    return lengths.pop() if lengths else 0


def export_committed(cache, row: int = 0, length: int | None = None, start: int = 0) -> CommittedState:
    """Copies of row `row`'s first `length` committed tokens (default: all) of `cache`, outside tree mode. A static
    batched cache's rows hold different lengths (its layers know only the longest): give the row's `length`; its
    recurrent states are the row's whole committed state, so `length` must be all the row holds. `start`: the row's
    tokens begin there (a left-padded batch's row: its padding before them is not exported)."""
    if getattr(cache, "in_tree_mode", False):
        raise RuntimeError("export_committed: the cache has a pending tree")
    length = committed_length(cache) if length is None else length
    state = CommittedState(length)
    for idx, layer in enumerate(cache.layers):
        if kv_length(layer) is not None:
            held = layer.keys.shape[-2] if isinstance(layer, StaticKVMixin) else kv_length(layer)
            if not (0 <= start and 0 <= length and start + length <= held):
                raise ValueError(f"export_committed: tokens {start}..{start + length} outside layer {idx}'s {held}")
            state.kv[idx] = (layer.keys[row : row + 1, :, start : start + length].clone(),
                             layer.values[row : row + 1, :, start : start + length].clone())
        if is_linear(layer):
            for s, t in layer.conv_states.items():
                if t is not None and layer.has_previous_state.get(s, False):
                    state.conv[(idx, s)] = t[row : row + 1].clone()
            for s, t in layer.recurrent_states.items():
                if t is not None and layer.has_previous_state.get(s, False):
                    state.recurrent[(idx, s)] = t[row : row + 1].clone()
    return state


def import_committed(cache, state: CommittedState, row: int | None = None) -> None:
    """Make `cache` hold `state`: a B = 1 cache that is empty (fresh or reset), or with `row`, row `row` of a static
    batched cache whose buffers exist (filled by a prefill of every row); its other rows are untouched. Recurrent
    states and static buffers are copied in place."""
    if len(cache.layers) < max([i for i in state.kv] + [i for i, _ in state.conv] + [i for i, _ in state.recurrent]
                               + [-1]) + 1:
        raise ValueError("import_committed: the state has more layers than the cache (another model's?)")
    for idx, (keys, values) in state.kv.items():
        layer = cache.layers[idx]
        keys, values = keys.to(_device(layer, keys)), values.to(_device(layer, values))
        if isinstance(layer, StaticKVMixin):
            if not layer.is_initialized:
                if row is not None:
                    raise RuntimeError("import_committed into a row: the batched cache has no buffers yet")
                layer._kv_lazy_init(keys, values)
            if state.length > layer.max_length:
                raise ValueError(f"the state holds {state.length} tokens, the static cache {layer.max_length}")
            target = slice(None) if row is None else slice(row, row + 1)
            layer.keys[target, :, : state.length] = keys
            layer.values[target, :, : state.length] = values
            if row is None:
                layer.length = state.length
        else:
            if row is not None:
                raise NotImplementedError("import_committed into a row needs a static cache")
            if kv_length(layer):
                raise RuntimeError(f"import_committed: layer {idx} is not empty")
            layer.update(keys.clone(), values.clone(), {})
    for kind, states in (("conv", state.conv), ("recurrent", state.recurrent)):
        for (idx, s), value in states.items():
            layer = cache.layers[idx]
            if not is_linear(layer):
                raise ValueError(f"import_committed: layer {idx} of the cache holds no recurrent state")
            held = getattr(layer, f"{kind}_states")
            current = held.get(s)
            value = value.to(_device(layer, value) if current is None else current.device)
            if current is not None and (row is not None or current.shape == value.shape):
                (current if row is None else current[row : row + 1]).copy_(value)
            elif row is not None:
                raise RuntimeError("import_committed into a row: the batched cache has no recurrent state yet")
            else:
                held[s] = value.clone()
                # transformers (5.x) keeps per-state initialization flags next to the states; mark them.
                flag = getattr(layer, f"is_{kind}_states_initialized", None)
                if isinstance(flag, dict):
                    flag[s] = True
                sizes = getattr(layer, "conv_kernel_size", None)
                if kind == "conv" and isinstance(sizes, dict):
                    sizes[s] = value.shape[-1]
                if getattr(layer, "device", None) is None:
                    layer.device, layer.dtype = value.device, value.dtype
            layer.has_previous_state[s] = True


def zero_states(cache, row: int | None = None) -> None:
    """Row `row`'s (None: every row's) recurrent and conv states to zeros, an empty sequence's, marked as present: a
    sequence that starts from nothing (a chunked prefill, a serving slot without a stored prefix) runs its first
    tokens as a tree over them (a reset cache marks them as not there, which only a plain forward handles)."""
    for layer in cache.layers:
        for s in getattr(layer, "has_previous_state", {}):
            for states in (layer.conv_states, layer.recurrent_states):
                t = states.get(s)
                if t is not None:
                    (t if row is None else t[row]).zero_()
                    layer.has_previous_state[s] = True


def _device(layer, fallback: torch.Tensor) -> torch.device:
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.numel() > 0:
        return keys.device
    for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
        for t in states.values():
            if t is not None:
                return t.device
    return fallback.device
