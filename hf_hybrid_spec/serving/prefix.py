"""Prefix reuse across calls: the committed state a finished request leaves behind, for the next request whose prompt
extends it (an agent's next turn: the last prompt, the model's reply, a tool result).

A recurrent state cannot be cut back to a shorter prefix, so an entry serves only prompts that extend its whole key
(the tokens its state has committed), by at least one token. Entries live on the model's device; the store evicts
the least recently used past its byte and entry bounds. An entry may also carry the finished request's drafter state
(`Drafter.handoff`, e.g. the suffix drafter's trie over the same tokens): the first request that extends the key
takes it (`Drafter.adopt`) instead of building its own from the whole prompt.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..cache import CommittedState

__all__ = ["PrefixStore", "PrefixHit"]


@dataclass
class PrefixHit:
    """A stored state whose key is the first `length` tokens of a prompt, and the drafter state stored with it (None
    when there was none, or an earlier hit took it)."""

    length: int
    state: CommittedState
    carry: Any = None


def _carry_bytes(carry) -> int:
    """A drafter carry's size: its `nbytes()` (SuffixTrie) or `nbytes` attribute, else 0."""
    size = getattr(carry, "nbytes", 0)
    return int(size() if callable(size) else size)


class PrefixStore:
    """LRU of committed states keyed by the tokens they hold.

    Args:
        max_bytes: the bound on the states' tensors and their drafter carries (0 disables the store).
        max_entries: the bound on their count.
    """

    def __init__(self, max_bytes: int, max_entries: int = 64):
        if max_bytes < 0 or max_entries < 1:
            raise ValueError(f"a prefix store needs max_bytes >= 0 and max_entries >= 1, got {max_bytes}, "
                             f"{max_entries}")
        self.max_bytes, self.max_entries = int(max_bytes), int(max_entries)
        self._entries: OrderedDict[tuple[int, ...], PrefixHit] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], state: CommittedState, carry: Any = None) -> bool:
        """Keep `state` (it holds `tokens`, `len(tokens) == state.length`) and `carry` (a drafter's `handoff` over at
        least those tokens). Returns whether it was kept (an entry over the byte bound is not)."""
        if len(tokens) != state.length:
            raise ValueError(f"a prefix entry's key has {len(tokens)} tokens, its state {state.length}")
        entry = PrefixHit(len(tokens), state, carry)
        size = self._size(entry)
        if size > self.max_bytes or not tokens:
            return False
        key = tuple(tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= self._size(old)
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= self._size(dropped)
        return True

    @staticmethod
    def _size(entry: PrefixHit) -> int:
        return entry.state.nbytes + _carry_bytes(entry.carry)

    def longest(self, prompt: list[int]) -> PrefixHit | None:
        """The entry with the longest key that is a proper prefix of `prompt` (at least one prompt token left to
        run), marked most recently used; None when there is none. The hit takes the entry's carry (a drafter state
        is adopted once: the adopter changes it); the state stays for later hits."""
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
            entry = self._entries[best]
            hit = PrefixHit(entry.length, entry.state, entry.carry)
            if entry.carry is not None:
                self._bytes -= _carry_bytes(entry.carry)
                entry.carry = None
            return hit

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
