"""`NativeSuffixTrie`: `SuffixTrie`'s structure and results in C (`suffix_trie.c`), behind the same methods.

`suffix.new_trie(depth)` gives the C trie where it could be built (`hf_hybrid_spec._native`) and the Python one
otherwise; the drafts are the same either way (tests check them node for node). The C trie costs a small fraction of
the Python one per token fed (docs/benchmarks.md, "Suffix tries per committed token") and grows a draft in one call;
each call pays a fixed ctypes toll, so callers feed tokens in batches (`extend_many`, `follow_many`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path

from .._native import load

logger = logging.getLogger(__name__)

__all__ = ["DraftCandidate", "NativeSuffixTrie", "native_available", "native_depth"]

_SOURCE = Path(__file__).with_name("suffix_trie.c")
_MAX_DEPTH = 4096  # the C functions keep a depth-long list on the stack
_lib = None
_tried = False


@dataclass
class DraftCandidate:
    """A trie's best draft for a context: `tokens[i]` below `parents[i]` (-1: the root), path probability `probs[i]`;
    `score` (the sum of the probabilities) estimates its accepted length; `match_length` is the matched suffix's."""

    score: float
    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match_length: int


def _library():
    global _lib, _tried
    if not _tried:
        lib = load(_SOURCE)
        if lib is not None:
            i64, p = ctypes.c_int64, ctypes.c_void_p
            d = ctypes.c_double
            signatures = {
                "trie_new": (p, [i64]),
                "trie_free": (None, [p]),
                "trie_copy": (p, [p]),
                "trie_new_seq": (i64, [p]),
                "trie_extend": (i64, [p, i64, p, i64, p, i64]),
                "trie_follow": (i64, [p, p, i64, p, i64]),
                "trie_truncate": (i64, [p, i64, i64]),
                "trie_count": (i64, [p, i64]),
                "trie_total": (i64, [p, i64, i64]),
                "trie_children": (i64, [p, i64, i64, p, p, i64]),
                "trie_occurrence_after": (i64, [p, i64, i64, i64, p]),
                "trie_seq_len": (i64, [p, i64]),
                "trie_seq_read": (i64, [p, i64, p]),
                "trie_num_nodes": (i64, [p]),
                "trie_num_tokens": (i64, [p]),
                "trie_next_seq": (i64, [p]),
                "trie_nbytes": (i64, [p]),
                "trie_best_draft": (i64, [p, p, i64, i64, d, d, i64, i64, d, i64, p, p, p, p, p, p, p, p]),
            }
            for name, (restype, argtypes) in signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        _lib, _tried = lib, True
    return _lib


def native_available() -> bool:
    """Whether `suffix.new_trie` gives the C trie (a compiler was found and `HF_HYBRID_SPEC_NATIVE` does not say 0)."""
    return _library() is not None


def native_depth(depth: int) -> bool:
    """Whether a trie of `depth` can be the C one (built here, and the depth within what its stack lists hold)."""
    return 0 < depth <= _MAX_DEPTH and _library() is not None


def _addr(buf: array) -> int:
    return buf.buffer_info()[0]


class NativeSuffixTrie:
    """See `SuffixTrie` (the same methods, references and results); memory held by C, freed with the object.

    An active list (the context's suffix nodes) is an `array("q")` here (a list for `SuffixTrie`): callers only pass it
    back, index it and take its length; either kind is accepted."""

    ROOT = 0
    FEED_CHUNK = 256  # tokens `SuffixDrafter.settle` feeds between two checks of its deadline (cheap ones in C)

    def __init__(self, depth: int, _handle: int | None = None):
        lib = _library()
        if lib is None:
            raise RuntimeError("the native suffix trie is not available (no C compiler, or HF_HYBRID_SPEC_NATIVE=0)")
        self._lib = lib
        self.depth = depth
        self._h = _handle if _handle is not None else lib.trie_new(depth)
        if not self._h:
            raise MemoryError("could not allocate a suffix trie")
        self._active = array("q", bytes(8 * depth))  # the active list in and out of C (never resized)
        self._active_addr = _addr(self._active)
        self._out: tuple[tuple[array, ...], tuple[int, ...]] | None = None  # best_draft's buffers and addresses
        # The scratch above is the trie's: the process-wide trie is read by several requests' threads, and a thread
        # may switch between a C call and the read of its results (an uncontended lock is cheap beside the call).
        self._scratch = threading.Lock()

    def __del__(self):
        handle, self._h = getattr(self, "_h", None), None
        if handle:
            self._lib.trie_free(handle)

    # ------------------------------------------------------------------ building
    def _load_active(self, active) -> int:
        n = min(len(active), self.depth)
        if n == len(active) and isinstance(active, array) and active.typecode == "q":
            self._active[:n] = active  # (a copy at C speed: the usual case, an active list this class returned)
        else:
            self._active[:n] = array("q", active[:n])
        return n

    def _check(self, n: int) -> int:
        if n == -1:
            raise MemoryError("suffix trie: out of memory")
        if n < 0:
            raise ValueError("suffix trie: a negative token, or an active list that is not this trie's")
        return n

    def extend_many(self, active, tokens, seq: int = 0) -> array:
        """`extend` for each of `tokens` in turn; returns the final active list."""
        toks = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
        with self._scratch:
            n = self._load_active(active)
            n = self._check(self._lib.trie_extend(self._h, seq, _addr(toks), len(toks), self._active_addr, n))
            return self._active[:n]

    def extend(self, active, token: int, seq: int = 0) -> array:
        return self.extend_many(active, (token,), seq)

    def follow_many(self, active, tokens) -> array:
        """`follow` for each of `tokens` in turn; returns the final active list."""
        toks = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
        with self._scratch:
            n = self._load_active(active)
            n = self._lib.trie_follow(self._h, _addr(toks), len(toks), self._active_addr, n)
            return self._active[:n]

    def follow(self, active, token: int) -> array:
        return self.follow_many(active, (token,))

    def active_after(self, tokens) -> array:
        return self.follow_many([], list(tokens[-self.depth :]))

    def insert(self, tokens) -> int:
        seq = self._check(self._lib.trie_new_seq(self._h))
        self.extend_many([], tokens, seq)
        return seq

    def truncate(self, seq: int, keep: int) -> None:
        self._lib.trie_truncate(self._h, seq, keep)

    def remove(self, seq: int) -> None:
        self.truncate(seq, 0)

    # ------------------------------------------------------------------ reading
    def count(self, ref: int) -> int:
        return self._lib.trie_count(self._h, ref)

    def total(self, ref: int, depth: int) -> int:
        return self._lib.trie_total(self._h, ref, depth)

    def children(self, ref: int, depth: int) -> list[tuple[int, int]]:
        n = self._lib.trie_children(self._h, ref, depth, None, None, 0)
        if n == 0:
            return []
        toks, kids = array("i", bytes(4 * n)), array("q", bytes(8 * n))
        self._lib.trie_children(self._h, ref, depth, _addr(toks), _addr(kids), n)
        return list(zip(toks.tolist(), kids.tolist()))

    def occurrence_after(self, ref: int, depth: int, limit: int) -> list[int]:
        if limit <= 0:
            return []
        out = array("i", bytes(4 * min(limit, self.depth)))
        n = self._lib.trie_occurrence_after(self._h, ref, depth, min(limit, self.depth), _addr(out))
        return out[:n].tolist()

    def sequence(self, seq: int = 0) -> array:
        """A copy of sequence `seq`'s tokens."""
        out = array("i", bytes(4 * self._lib.trie_seq_len(self._h, seq)))
        if out:
            self._lib.trie_seq_read(self._h, seq, _addr(out))
        return out

    def sequence_length(self, seq: int = 0) -> int:
        return self._lib.trie_seq_len(self._h, seq)

    def best_draft(self, active, max_match_length: int, spec_factor: float, spec_offset: float,
                   max_nodes: int, max_depth: int, min_token_prob: float, tree: bool) -> DraftCandidate | None:
        """See `SuffixTrie.best_draft`."""
        top = max(1, min(max_match_length, len(active)))
        room = max(0, min(max_nodes, max(int(m * spec_factor + spec_offset) for m in (1, top))))
        if room == 0 or not active:
            return None
        with self._scratch:
            if self._out is None or len(self._out[0][0]) < room:
                size = max(room, 64)
                # Out: tokens, parents, probs; scratch of the same three; the score and the match length.
                buffers = (array("i", bytes(4 * size)), array("q", bytes(8 * size)), array("d", bytes(8 * size)),
                           array("i", bytes(4 * size)), array("q", bytes(8 * size)), array("d", bytes(8 * size)),
                           array("d", [0.0]), array("q", [0]))
                self._out = (buffers, tuple(_addr(b) for b in buffers))  # (never resized: addresses stay valid)
            (toks, parents, probs, _, _, _, score, match), addresses = self._out
            n = self._load_active(active)
            n = self._check(self._lib.trie_best_draft(
                self._h, self._active_addr, n, max_match_length, spec_factor, spec_offset, min(max_nodes, room),
                max_depth, min_token_prob, int(bool(tree)), *addresses))
            if n == 0:
                return None
            return DraftCandidate(score[0], toks[:n].tolist(), parents[:n].tolist(), probs[:n].tolist(), match[0])

    # ------------------------------------------------------------------ size
    @property
    def num_nodes(self) -> int:
        return self._lib.trie_num_nodes(self._h)

    @property
    def num_tokens(self) -> int:
        return self._lib.trie_num_tokens(self._h)

    def nbytes(self) -> int:
        return self._lib.trie_nbytes(self._h)

    def copy(self) -> NativeSuffixTrie:
        handle = self._lib.trie_copy(self._h)
        if not handle:
            raise MemoryError("could not copy a suffix trie")
        return NativeSuffixTrie(self.depth, handle)
