"""Prefix reuse across calls: the committed state a finished request leaves behind, for the next request whose prompt
extends it (an agent's next turn: the last prompt, the model's reply, a tool result).

A recurrent state cannot be cut back to a shorter prefix, so an entry serves only prompts that extend its whole key
(the tokens its state has committed), by at least one token. Entries live on the model's device; the store evicts
the least recently used past its byte and entry bounds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..cache import CommittedState

__all__ = ["PrefixStore", "PrefixHit"]


@dataclass
class PrefixHit:
    """A stored state whose key is the first `length` tokens of a prompt."""

    length: int
    state: CommittedState


class PrefixStore:
    """LRU of committed states keyed by the tokens they hold.

    Args:
        max_bytes: the bound on the states' tensors (0 disables the store). max_entries: the bound on their count.
    """

    def __init__(self, max_bytes: int, max_entries: int = 64):
        if max_bytes < 0 or max_entries < 1:
            raise ValueError(f"a prefix store needs max_bytes >= 0 and max_entries >= 1, got {max_bytes}, "
                             f"{max_entries}")
        self.max_bytes, self.max_entries = int(max_bytes), int(max_entries)
        self._entries: OrderedDict[tuple[int, ...], CommittedState] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], state: CommittedState) -> bool:
        """Keep `state` (it holds `tokens`, `len(tokens) == state.length`). Returns whether it was kept (a state over
        the byte bound is not)."""
        if len(tokens) != state.length:
            raise ValueError(f"a prefix entry's key has {len(tokens)} tokens, its state {state.length}")
        size = state.nbytes
        if size > self.max_bytes or not tokens:
            return False
        key = tuple(tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = state
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
        return True

    def longest(self, prompt: list[int]) -> PrefixHit | None:
        """The entry with the longest key that is a proper prefix of `prompt` (at least one prompt token left to
        run), marked most recently used; None when there is none."""
        best: tuple[int, ...] | None = None
        n = len(prompt)
        with self._lock:
            for key in self._entries:
                k = len(key)
                if k < n and (best is None or k > len(best)) and tuple(prompt[:k]) == key:
                    best = key
            if best is None:
                self.misses += 1
                return None
            self._entries.move_to_end(best)
            self.hits += 1
            return PrefixHit(len(best), self._entries[best])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
