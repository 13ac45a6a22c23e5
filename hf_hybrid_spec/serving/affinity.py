"""Which replica holds a request's prefix: the bookkeeping behind the cluster's affinity routing
(`serving.cluster.AffinityRouter`), without Ray.

An agent's next call extends its last one token for token (the last prompt, the reply, the new turn), and the replica
that served the last call holds its committed state in its prefix store: sent there, the follow-up prefills only its
new tokens. The map keys each request's prompt by chained hashes of its whole blocks of `block` tokens (block k's key
covers tokens 0 .. (k + 1) * block), so a request finds the replica that served the longest prompt sharing its first
blocks; an explicit session key (OpenAI's `user`, a `session_id`) goes first. Bounded: the oldest keys go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["PrefixAffinity"]


class PrefixAffinity:
    """Prompt prefixes and sessions -> the replica that served them last.

    Args:
        block: tokens per hashed block (a prompt shorter than one block is keyed by its session alone).
        max_keys: the bound on remembered keys (block hashes and sessions), least recently used dropped first.
    """

    def __init__(self, block: int = 16, max_keys: int = 1 << 18):
        if block < 1 or max_keys < 1:
            raise ValueError(f"block and max_keys must be >= 1, got {block} and {max_keys}")
        self.block, self.max_keys = block, max_keys
        self._keys: OrderedDict[object, str] = OrderedDict()

    def _blocks(self, ids: Sequence[int]) -> list[int]:
        """The chained hash of each whole block of `ids` (block k's covers every token before its end)."""
        keys, key = [], 0
        for start in range(0, len(ids) - self.block + 1, self.block):
            key = hash((key, tuple(ids[start : start + self.block])))
            keys.append(key)
        return keys

    def lookup(self, ids: Sequence[int], session: str | None = None,
               alive: Iterable[str] | None = None) -> tuple[str | None, int]:
        """The replica for a request and how many of its prompt tokens it is known to hold: the session's replica
        when `session` was seen, else the one that served the longest shared run of whole blocks (0 tokens when
        found by session alone). Replicas outside `alive` (when given) do not count. (None, 0) when none."""
        live = None if alive is None else set(alive)
        if session is not None:
            replica = self._keys.get(("session", session))
            if replica is not None and (live is None or replica in live):
                self._keys.move_to_end(("session", session))
                return replica, 0
        found, held = None, 0
        for k, key in enumerate(self._blocks(ids)):
            replica = self._keys.get(key)
            if replica is None:
                break  # a later block's key covers this one: no longer match can follow a miss
            if live is None or replica in live:
                found, held = replica, (k + 1) * self.block
        return found, held

    def record(self, ids: Sequence[int], replica: str, session: str | None = None) -> None:
        """`replica` serves the request with prompt `ids` (and `session`): it will hold that prefix."""
        keys = self._blocks(ids) + ([("session", session)] if session is not None else [])
        for key in keys:
            self._keys[key] = replica
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop every key of `replica` (it died: its prefix store went with it)."""
        for key in [k for k, r in self._keys.items() if r == replica]:
            del self._keys[key]

    def __len__(self) -> int:
        return len(self._keys)
