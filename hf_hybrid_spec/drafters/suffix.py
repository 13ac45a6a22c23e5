"""Suffix-tree cache drafter in the style of SuffixDecoding (arXiv 2411.04975).

Two depth-limited suffix tries with occurrence counts: one per request over prompt + output, one shared by
the process over earlier outputs. For the current context, every suffix of length m <= max_match_length
that occurred before is a match; its node's children are what followed it. From a match the drafter grows
a tree best-first by path probability (products of child count / sibling total), stops at
`min_token_prob`, and caps the size at `m * max_spec_factor + max_spec_offset`. The score of a tree is the
sum of its path probabilities, an estimate of the accepted length; the best-scoring match (over both
tries and all match lengths) is proposed.

`new_trie` gives the C trie of `suffix_native` (the same nodes and drafts, ~10-25x cheaper per token) where a C compiler
could build it, else `SuffixTrie` below.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from array import array
from collections import deque
from collections.abc import Callable

import torch

from ..tree import DraftTree, empty_draft
from .base import DraftBudget, Drafter, committed_since
from .suffix_native import DraftCandidate, NativeSuffixTrie, native_depth

__all__ = ["SuffixTrie", "NativeSuffixTrie", "SuffixDrafter", "GlobalSuffixCache", "clear_global_suffix_cache",
           "global_suffix_cache", "new_trie", "SUFFIX_TRIES", "from_config"]


class SuffixTrie:
    """Every substring (length <= depth) of the inserted sequences, with occurrence counts, stored compactly.

    A node is a reference (an int). Substrings that occurred at least twice are *explicit* nodes, ids >= 0 (0 is the
    root) into flat typed arrays; a substring that occurred once is *implicit*: a negative reference to the position
    of its last token in the sequence it occurred in (`_implicit`), and everything below it is that sequence's own
    continuation, stored nowhere else. Text that does not repeat (most of a prompt) therefore costs its tokens
    (4 bytes each) and little more, where a trie of node objects costs ~280 bytes per substring and `depth` substrings
    per token. Nothing here is tracked by Python's cyclic garbage collector (typed arrays, and dicts of ints only for
    nodes with several children), whose passes over millions of objects cost more than building the trie.

    Explicit node n: `_count[n]` occurrences, `_total[n]` of them with a continuation (the sum of its children's
    counts), its child as `_kid_token[n]` / `_kid[n]` when it has one (`_NONE` / `_MANY` otherwise; `_many[n]` maps
    token -> child for several). Sequences live in `_seqs` (id -> array of tokens): the request trie has one (id 0),
    growing with the request; the process-wide trie one per cached output, removed when the output is evicted.
    """

    ROOT = 0
    _NONE, _MANY = -1, -2
    # Tokens `SuffixDrafter.settle` feeds between two checks of its deadline: few, since a check that comes late holds
    # the host past the device's idle time (the Python trie's cost per token: docs/benchmarks.md, "Suffix tries per
    # committed token").
    FEED_CHUNK = 8

    def __init__(self, depth: int):
        self.depth = depth
        self._count = array("i", [0])
        self._total = array("i", [0])
        self._kid_token = array("i", [self._NONE])
        self._kid = array("q", [0])
        self._many: dict[int, dict[int, int]] = {}
        self._free: list[int] = []  # ids of released explicit nodes, reused before the arrays grow
        self._seqs: dict[int, array] = {}
        self._next_seq = 0

    # ------------------------------------------------------------------ references
    @staticmethod
    def _implicit(seq: int, pos: int) -> int:
        return -((seq << 32) | pos) - 1

    @staticmethod
    def _where(ref: int) -> tuple[int, int]:
        code = -ref - 1
        return code >> 32, code & 0xFFFFFFFF

    def count(self, ref: int) -> int:
        """Occurrences of the substring `ref` stands for."""
        return self._count[ref] if ref >= 0 else 1

    def total(self, ref: int, depth: int) -> int:
        """Occurrences of `ref` (a node at `depth`, its substring's length) with a continuation in the trie."""
        if ref >= 0:
            return self._total[ref]
        if depth >= self.depth:
            return 0
        seq, pos = self._where(ref)
        return 1 if pos + 1 < len(self._seqs.get(seq, ())) else 0

    def children(self, ref: int, depth: int) -> list[tuple[int, int]]:
        """(token, child) pairs of `ref`, a node at `depth`."""
        # Reads tolerate a concurrent writer (the process-wide trie gains and evicts outputs while other requests draft
        # from it, unlocked): a stale reference reads as a node without children, never as an error.
        if ref >= 0:
            kt = self._kid_token[ref]
            if kt == self._MANY:
                return list(self._many.get(ref, {}).items())
            return [] if kt == self._NONE else [(kt, self._kid[ref])]
        if depth >= self.depth:
            return []
        seq, pos = self._where(ref)
        tokens = self._seqs.get(seq, ())
        return [(tokens[pos + 1], ref - 1)] if pos + 1 < len(tokens) else []  # ref - 1 is (seq, pos + 1)

    def occurrence_after(self, ref: int, depth: int, limit: int) -> list[int]:
        """For an implicit `ref` (a substring of length `depth` that occurred once): the tokens that followed its one
        occurrence, at most `limit`, within the trie's depth and its sequence. Its whole subtree is that chain, each
        node its parent's only child."""
        seq, pos = self._where(ref)
        tokens = self._seqs.get(seq, ())  # (gone once evicted: no continuation, as `children` reads it)
        n = min(limit, self.depth - depth, len(tokens) - 1 - pos)
        return list(tokens[pos + 1 : pos + 1 + n]) if n > 0 else []

    def _child(self, node: int, token: int) -> int | None:
        """The child of explicit `node` for `token`, or None."""
        kt = self._kid_token[node]
        if kt == token:
            return self._kid[node]
        if kt == self._MANY:
            return self._many.get(node, {}).get(token)
        return None

    def _del_child(self, node: int, token: int) -> None:
        kt = self._kid_token[node]
        if kt == token:
            self._kid_token[node] = self._NONE
            return
        many = self._many[node]
        del many[token]
        if len(many) == 1:
            (kt, child), = many.items()
            del self._many[node]
            self._kid_token[node], self._kid[node] = kt, child

    # ------------------------------------------------------------------ building
    def extend(self, active: list[int], token: int, seq: int = 0) -> list[int]:
        """Append `token` to sequence `seq` (created empty if new); `active[k]` is the node of the sequence's suffix of
        length k + 1 before it. Returns the new active list (creates and counts nodes)."""
        tokens = self._seqs.get(seq)
        if tokens is None:
            tokens = self._seqs[seq] = array("i")
            self._next_seq = max(self._next_seq, seq + 1)
        tokens.append(token)
        here = self._implicit(seq, len(tokens) - 1)
        count, total, kid_token, kid = self._count, self._total, self._kid_token, self._kid
        new = []
        append = new.append
        # The hot loop of building a prompt's trie (up to `depth` node visits per token). An implicit active node is
        # this sequence's suffix ending at the previous token (it occurred once: here), so its child is implicit too;
        # and every longer suffix occurred at most as often, so the active nodes after the first implicit one are
        # implicit as well: their children are all `here`, appended at once.
        # A node's child set and a new node's allocation are written inline (calls per token were a fifth of the
        # time): one child in `_kid_token` / `_kid`, several in `_many`; released ids in `_free` reused first.
        NONE, MANY, many = self._NONE, self._MANY, self._many
        free, max_depth = self._free, self.depth
        nodes = (0, *active[: max_depth - 1])
        for depth, node in enumerate(nodes, start=1):
            if node < 0:
                new.extend([here] * (len(nodes) - depth + 1))
                break
            kt = kid_token[node]
            if kt == token:
                child = kid[node]
            elif kt == MANY:
                child = many[node].get(token)
            else:
                child = None
            if child is None:
                child = here
                if kt == NONE:
                    kid_token[node], kid[node] = token, here
                elif kt == MANY:
                    many[node][token] = here
                else:
                    many[node] = {kt: kid[node], token: here}
                    kid_token[node] = MANY
            elif child >= 0:
                count[child] += 1
            else:
                # The substring occurred once before: it becomes an explicit node, that occurrence's continuation its
                # (implicit) child.
                code = -child - 1
                old_seq, old_pos = code >> 32, code & 0xFFFFFFFF
                if free:
                    child = free.pop()
                    count[child], total[child], kid_token[child] = 2, 0, NONE
                else:
                    child = len(count)
                    count.append(2)
                    total.append(0)
                    kid_token.append(NONE)
                    kid.append(0)
                old = self._seqs[old_seq]
                if depth < max_depth and old_pos + 1 < len(old):
                    kid_token[child] = old[old_pos + 1]
                    kid[child] = -((old_seq << 32) | (old_pos + 1)) - 1  # _implicit(old_seq, old_pos + 1)
                    total[child] = 1
                if kt == token:
                    kid[node] = child
                else:
                    many[node][token] = child
            total[node] += 1
            append(child)
        return new

    def extend_many(self, active: list[int], tokens, seq: int = 0) -> list[int]:
        """`extend` for each of `tokens` in turn; returns the final active list."""
        for t in tokens:
            active = self.extend(active, t, seq)
        return active

    def follow_many(self, active: list[int], tokens) -> list[int]:
        """`follow` for each of `tokens` in turn; returns the final active list."""
        for t in tokens:
            active = self.follow(active, t)
        return active

    def follow(self, active: list[int], token: int) -> list[int]:
        """Like `extend` but read-only: the nodes of the context's suffixes that exist in the trie."""
        # An active list is explicit nodes, then implicit ones that are all one reference (a suffix that occurred
        # once, and every longer one, end at the same position of the same sequence): the first implicit node's
        # continuation decides the whole tail. Reads tolerate a concurrent writer (see `children`).
        new: list[int] = []
        append = new.append
        kid_token, kid, many, MANY = self._kid_token, self._kid, self._many, self._MANY
        nodes = (0, *active[: self.depth - 1])
        for depth, node in enumerate(nodes, start=1):
            if node < 0:
                code = -node - 1
                tokens = self._seqs.get(code >> 32, ())
                pos = code & 0xFFFFFFFF
                if pos + 1 < len(tokens) and tokens[pos + 1] == token:
                    new.extend([node - 1] * (len(nodes) - depth + 1))  # node - 1 is (seq, pos + 1)
                break
            kt = kid_token[node]
            if kt == token:
                child = kid[node]
            elif kt == MANY:
                child = many.get(node, {}).get(token)
            else:
                child = None
            if child is None:
                # If the (k+1)-gram is absent, so is every longer one (its suffix would be present).
                break
            append(child)
        return new

    def active_after(self, tokens) -> list[int]:
        """The `follow` state after `tokens`: it depends on their last `depth` tokens only (suffixes are at most that
        long), so a long context costs no more than a short one."""
        return self.follow_many([], list(tokens[-self.depth :]))

    def insert(self, tokens) -> int:
        """Insert a new sequence; returns its id (for `remove`)."""
        seq = self._next_seq
        self._next_seq += 1
        self._seqs[seq] = array("i")
        self.extend_many([], tokens, seq)
        return seq

    def sequence(self, seq: int = 0) -> array:
        """The tokens of sequence `seq` (the trie's own array: do not modify)."""
        return self._seqs.get(seq, array("i"))

    def sequence_length(self, seq: int = 0) -> int:
        return len(self._seqs.get(seq, ()))

    def truncate(self, seq: int, keep: int) -> None:
        """Cut sequence `seq` back to its first `keep` tokens (`keep = 0` removes it): what its later positions added
        is taken out (counts and totals decremented, nodes that reach zero released), walking only from the starts
        that reach position `keep` or later: O((len - keep + depth) * depth), not a rebuild of the kept part."""
        tokens = self._seqs.get(seq)
        if tokens is None:
            return
        count, total = self._count, self._total
        n = len(tokens)
        for start in range(max(0, keep - self.depth + 1), n):
            node = 0
            for pos in range(start, min(start + self.depth, n)):
                if node < 0:
                    break  # below an implicit node lies only this occurrence, stored nowhere
                t = tokens[pos]
                child = self._child(node, t)
                if pos >= keep:
                    total[node] -= 1
                    if child < 0 or count[child] == 1:
                        # The last occurrence goes: nothing longer through it is left either.
                        self._del_child(node, t)
                        if child >= 0:
                            self._release(child)
                        break
                    count[child] -= 1
                node = child
        if keep == 0:
            del self._seqs[seq]
        else:
            del tokens[keep:]

    def remove(self, seq: int) -> None:
        """Undo `insert`: the sequence and everything only it held go."""
        self.truncate(seq, 0)

    def _release(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            kt = self._kid_token[n]
            if kt == self._MANY:
                stack.extend(c for c in self._many.pop(n).values() if c >= 0)
            elif kt != self._NONE and self._kid[n] >= 0:
                stack.append(self._kid[n])
            self._count[n] = self._total[n] = 0
            self._kid_token[n] = self._NONE
            self._free.append(n)

    # ------------------------------------------------------------------ drafting
    def best_draft(self, active: list[int], max_match_length: int, spec_factor: float, spec_offset: float,
                   max_nodes: int, max_depth: int, min_token_prob: float, tree: bool) -> DraftCandidate | None:
        """The best draft from the matches of the context whose suffix nodes are `active` (`extend` / `follow`), or
        None: for each match length m <= `max_match_length` (longest first) the best-first tree from its node, of at
        most min(`max_nodes`, int(m * `spec_factor` + `spec_offset`)) nodes, `max_depth` deep, each path probability
        >= `min_token_prob` (`tree=False`: the most frequent child only); the highest score wins, the longer match
        among equals."""
        best = None
        prev_count = None
        counts = self._count  # (`count` inlined: this loop runs for every row at every step)
        for m in range(min(len(active), max_match_length), 0, -1):
            node = active[m - 1]
            count = counts[node] if node >= 0 else 1
            # A shorter match with the same count has the same continuations. (The count first: a run of suffixes
            # that occurred once, the usual case, skips the continuation check.)
            if count == prev_count:
                continue
            prev_count = count
            if self.total(node, m) == 0:
                continue
            cap = min(max_nodes, int(m * spec_factor + spec_offset))
            if cap <= 0:
                continue
            if node < 0:
                cand = self._grow_chain(node, m, max_depth, min_token_prob, cap)
            else:
                cand = self._grow_tree(node, m, max_depth, min_token_prob, tree, cap)
            if cand is not None and (best is None or cand.score > best.score):
                best = cand
        return best

    def _grow_chain(self, node: int, match_length: int, max_depth: int, min_token_prob: float,
                    cap: int) -> DraftCandidate | None:
        """`_grow_tree` from an implicit node, the usual longest match: a substring that occurred once continues as
        its one occurrence's sequence, each node a single child of probability 1, so the tree is that chain."""
        if min_token_prob > 1.0:
            return None
        tokens = self.occurrence_after(node, match_length, min(cap, max_depth))
        if not tokens:
            return None
        n = len(tokens)
        return DraftCandidate(float(n), tokens, list(range(-1, n - 1)), [1.0] * n, match_length)

    def _grow_tree(self, node: int, match_length: int, max_depth: int, min_token_prob: float, tree: bool,
                   cap: int) -> DraftCandidate | None:
        """Best-first by path probability (products of child count / sibling total), ties to the earlier push."""
        tie = itertools.count()
        heap: list = []
        count = self.count

        def push_children(parent_node: int, parent_prob: float, parent_idx: int, depth: int):
            # `depth`: the children's depth below the draft's root; the parent's in the trie is match_length + it - 1.
            if depth > max_depth:
                return
            trie_depth = match_length + depth - 1
            total = self.total(parent_node, trie_depth)
            if total == 0:
                return
            items = self.children(parent_node, trie_depth)
            if not items:
                return
            if not tree:
                items = [max(items, key=lambda kv: count(kv[1]))]
            for tok, child in items:
                p = parent_prob * count(child) / total
                if p >= min_token_prob:
                    heapq.heappush(heap, (-p, next(tie), tok, child, parent_idx, depth))

        push_children(node, 1.0, -1, 1)
        tokens, parents, probs = [], [], []
        while heap and len(tokens) < cap:
            neg_p, _, tok, child, parent_idx, depth = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent_idx)
            probs.append(-neg_p)
            push_children(child, -neg_p, len(tokens) - 1, depth + 1)
        if not tokens:
            return None
        score = 0.0
        for p in probs:  # in order, unrounded between terms: the C trie's sum (Python 3.12's `sum` compensates)
            score += p
        return DraftCandidate(score, tokens, parents, probs, match_length)

    # ------------------------------------------------------------------ size
    @property
    def num_nodes(self) -> int:
        """Explicit nodes held (the root included)."""
        return len(self._count) - len(self._free)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self._seqs.values())

    def nbytes(self) -> int:
        """An estimate of the memory the trie holds: its arrays and sequences, and ~100 bytes per entry of the
        several-children dicts (a dict slot and its int objects)."""
        arrays = (self._count, self._total, self._kid_token, self._kid, *self._seqs.values())
        entries = sum(len(d) for d in self._many.values())
        return sum(a.itemsize * len(a) for a in arrays) + 100 * entries + 240 * len(self._many)

    def copy(self) -> SuffixTrie:
        """An independent copy (benchmarks replay a call from the same state)."""
        new = SuffixTrie(self.depth)
        new._count, new._total = array("i", self._count), array("i", self._total)
        new._kid_token, new._kid = array("i", self._kid_token), array("q", self._kid)
        new._many = {n: dict(d) for n, d in self._many.items()}
        new._free = list(self._free)
        new._seqs = {k: array("i", v) for k, v in self._seqs.items()}
        new._next_seq = self._next_seq
        return new


SUFFIX_TRIES = (SuffixTrie, NativeSuffixTrie)  # what `new_trie` gives: the same methods and results


def new_trie(depth: int) -> SuffixTrie | NativeSuffixTrie:
    """A suffix trie of `depth`: the C one where it could be built, else `SuffixTrie` (the same drafts)."""
    return NativeSuffixTrie(depth) if native_depth(depth) else SuffixTrie(depth)


class GlobalSuffixCache:
    """Process-wide state of the suffix drafters of one model / tokenizer (thread-safe):

    - `trie`: earlier outputs, SuffixDecoding's global tree;
    - `finished`: the request tries of the last `MAX_FINISHED` requests. A request whose prompt starts with most of a
      finished request's tokens (the next call of an agent loop carries the earlier prompt and its output) takes that
      trie over instead of building its own from the first token: `SuffixTrie.truncate` cuts it back to the common
      prefix and only the rest of the prompt is inserted. The trie is the same either way (so are the drafts);
      building one visits `max_match_length + max_depth` nodes (40 by default) per prompt token.

    Bounded by `max_outputs` outputs and by `max_tokens` tokens in all (outputs and kept tries): the oldest go first
    (kept tries before outputs), and a trie over the budget on its own is not kept at all. Memory is about
    proportional to the tokens held (`SuffixTrie`: docs/benchmarks.md measures the bytes per cached token).
    """

    MAX_FINISHED = 4

    def __init__(self, depth: int, max_outputs: int, max_tokens: int = 2_000_000):
        self.trie = new_trie(depth)
        self.max_outputs = max_outputs
        self.max_tokens = max_tokens
        self.outputs: deque[tuple[int, int]] = deque()  # (sequence id in `trie`, tokens), oldest first
        self.output_tokens = 0
        self.finished: deque[SuffixTrie] = deque()  # each built from exactly its sequence 0
        self.lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return self.output_tokens + sum(t.num_tokens for t in self.finished)

    def nbytes(self) -> int:
        with self.lock:
            return self.trie.nbytes() + sum(t.nbytes() for t in self.finished)

    def copy(self) -> GlobalSuffixCache:
        """An independent copy (its own tries, outputs and lock)."""
        with self.lock:
            new = GlobalSuffixCache(self.trie.depth, self.max_outputs, self.max_tokens)
            new.trie, new.outputs, new.output_tokens = self.trie.copy(), deque(self.outputs), self.output_tokens
            new.finished = deque(trie.copy() for trie in self.finished)
        return new

    def keep_trie(self, trie: SuffixTrie) -> None:
        """Keep a finished request's trie (built from its sequence 0, prompt + output); the caller gives it up."""
        with self.lock:
            self.finished.append(trie)
            self._evict()

    def take_trie(self, tokens: list[int]) -> tuple[SuffixTrie, int] | None:
        """The kept trie sharing the longest prefix with `tokens`, cut back to that prefix, and its length; None when
        no kept trie shares more than it would take to cut (a fresh build is cheaper). The trie leaves the cache."""
        wanted = array("i", tokens)
        with self.lock:
            best, best_keep = None, 0
            for i, trie in enumerate(self.finished):
                old = trie.sequence(0)
                keep = _common_prefix(old, wanted)
                if keep > best_keep and len(old) - keep < keep:
                    best, best_keep = i, keep
            if best is None:
                return None
            trie = self.finished[best]
            del self.finished[best]
        trie.truncate(0, best_keep)
        return trie, best_keep

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        with self.lock:
            self.outputs.append((self.trie.insert(tokens), len(tokens)))
            self.output_tokens += len(tokens)
            self._evict()

    def _evict(self) -> None:
        while self.finished and (len(self.finished) > self.MAX_FINISHED or self.num_tokens > self.max_tokens):
            self.finished.popleft()
        while self.outputs and (len(self.outputs) > self.max_outputs or self.output_tokens > self.max_tokens):
            seq, n = self.outputs.popleft()
            self.trie.remove(seq)
            self.output_tokens -= n


def _common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token arrays (binary search over C-speed slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_GLOBAL: dict[tuple, GlobalSuffixCache] = {}
_GLOBAL_LOCK = threading.Lock()


def global_suffix_cache(key: tuple, depth: int, max_outputs: int, max_tokens: int = 2_000_000) -> GlobalSuffixCache:
    """The shared cache for `key` (a model/tokenizer identity): outputs of different vocabularies never mix. The
    bounds are the latest caller's."""
    with _GLOBAL_LOCK:
        cache = _GLOBAL.get((key, depth))
        if cache is None:
            cache = _GLOBAL[(key, depth)] = GlobalSuffixCache(depth, max_outputs, max_tokens)
    with cache.lock:
        cache.max_outputs, cache.max_tokens = max_outputs, max_tokens
        cache._evict()
    return cache


def clear_global_suffix_cache() -> None:
    with _GLOBAL_LOCK:
        _GLOBAL.clear()


class SuffixDrafter(Drafter):
    """See the module docstring. One instance per request."""

    name = "suffix"
    respects_budget = True  # `best_draft` stops at the budget's nodes and depth
    catches_up = True  # the tries take the tokens they did not see (`catch_up`; `propose` resynchronizes)

    def __init__(
        self,
        cache_key: tuple = ("default",),
        max_match_length: int = 32,
        max_depth: int = 8,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        use_global: bool = True,
        max_cached_outputs: int = 256,
        tree: bool = True,
        max_cached_tokens: int = 2_000_000,
    ):
        self.max_match_length = max_match_length
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.tree = tree
        # A match of length m can only draft depth - m tokens from a depth-limited trie.
        depth = max_match_length + max_depth
        self.local = new_trie(depth)
        # The process-wide cache is looked up when a request begins, not here: a drafter built ahead of its request
        # (HVD's, or one made before `clear_global_suffix_cache()`) must learn from, and add to, the live cache.
        self._global_args = (cache_key, depth, max_cached_outputs, max_cached_tokens) if use_global else None
        self.global_cache: GlobalSuffixCache | None = None
        self._local_active: list[int] = []
        self._global_active: list[int] = []
        self._seen = 0  # tokens of the request received (fed to the tries, or pending)
        # Tokens received but not yet in the request's trie (`settle` feeds them): a batch may leave a row's
        # bookkeeping to the host's idle time (`PerRowDrafters.limit_host`); `propose` always settles first.
        self._pending: list[int] = []
        self._prompt_length = 0
        self._ahead = False  # `local` holds tokens of the coming prompt (adopted or prefed) before `begin`

    # ------------------------------------------------------------------ request lifecycle
    def begin(self, input_ids: torch.Tensor, context=None, hidden=None) -> None:
        tokens = input_ids[0].tolist()
        self._prompt_length = len(tokens)
        start = 0
        if self._global_args is not None:
            self.global_cache = global_suffix_cache(*self._global_args)
        if self._ahead:  # a trie adopted or prefed over the prompt's first tokens (checked: they must be its start)
            self._ahead = False
            start = _common_prefix(self.local.sequence(0), array("i", tokens))
            if start < self.local.sequence_length(0):
                self.local.truncate(0, start)
                self._local_active = self.local.active_after(tokens[:start])
        else:
            self.local, self._local_active = new_trie(self.local.depth), []
            if self.global_cache is not None:
                # An earlier request whose tokens this prompt repeats (an agent loop's previous call) hands over its
                # trie.
                taken = self.global_cache.take_trie(tokens)
                if taken is not None:
                    self.local, start = taken
                    self._local_active = self.local.active_after(tokens[:start])
        self._pending = tokens[start:]  # the request trie's prompt tokens: `settle`, or the first `propose`
        if self.global_cache is not None:
            self._global_active = self.global_cache.trie.active_after(tokens)
        self._seen = len(tokens)

    def adopt(self, state) -> None:
        """Start from `state`, an earlier request's trie (`handoff`), instead of an empty one."""
        if isinstance(state, SUFFIX_TRIES) and state.depth == self.local.depth:
            self.local, self._ahead = state, True
            self._local_active = state.active_after(state.sequence(0))

    def prefeed(self, tokens: list[int]) -> None:
        """Extend the trie with the tokens of `tokens` past those it holds (`begin` checks that they agree)."""
        self.settle()
        if not self._ahead:
            self.local, self._local_active, self._ahead = new_trie(self.local.depth), [], True
        held = self.local.sequence_length(0)
        self._local_active = self.local.extend_many(self._local_active, tokens[held:])

    def accept(self, input_ids, result, hidden=None) -> None:
        self._feed(committed_since(input_ids, self._seen, result))

    def catch_up(self, tokens: list[int]) -> None:
        self._feed(tokens)

    def end(self, input_ids: torch.Tensor) -> None:
        if self.global_cache is not None:
            self._finish(input_ids)
            self.global_cache.keep_trie(self._give_up())

    def handoff(self, input_ids: torch.Tensor) -> SuffixTrie:
        """The request's trie over `input_ids` (prompt and output; its output also joins the process-wide trie, as
        `end` does); this drafter starts from an empty one if it begins again."""
        self._finish(input_ids)
        return self._give_up()

    def _finish(self, input_ids: torch.Tensor) -> None:
        """The request's last tokens into its trie, its output into the process-wide trie."""
        tokens = input_ids[0].tolist()
        if self._seen < len(tokens):
            self._feed(tokens[self._seen :])
        self.settle()
        if self.global_cache is not None:
            self.global_cache.add(tokens[self._prompt_length :])

    def _give_up(self) -> SuffixTrie:
        """The request trie, now the caller's: this drafter starts from an empty one if it begins again."""
        trie, self.local, self._local_active, self._seen = self.local, new_trie(self.local.depth), [], 0
        self._pending = []
        return trie

    def _feed(self, tokens: list[int]) -> None:
        """Tokens committed after those seen: the process-wide trie's context follows them now (cheap, read-only);
        the request trie takes them when `settle` runs (at the latest, the next `propose`)."""
        if self.global_cache is not None:
            self._global_active = self.global_cache.trie.follow_many(self._global_active, tokens)
        self._pending.extend(tokens)
        self._seen += len(tokens)

    @property
    def ready(self) -> bool:
        """Whether the request trie holds every token seen (`propose` would not have to `settle` first)."""
        return not self._pending

    def settle(self, stop: Callable[[], bool] | None = None) -> bool:
        """Extend the request trie with the pending tokens, in order; with `stop`, checked every few tokens, only
        until it returns True. Returns whether none is left."""
        pending = self._pending
        if not pending:
            return True
        extend, active, done = self.local.extend_many, self._local_active, 0
        step = len(pending) if stop is None else self.local.FEED_CHUNK
        while done < len(pending):
            active = extend(active, pending[done : done + step])
            done = min(done + step, len(pending))
            if stop is not None and done < len(pending) and stop():
                break
        self._local_active = active
        del pending[:done]
        return not pending

    # ------------------------------------------------------------------ drafting
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if input_ids.shape[1] != self._seen:
            # The loop always calls accept() first; resynchronize if a caller did not.
            self._feed(input_ids[0, self._seen :].tolist())
        self.settle()
        best, best_source = None, None
        sources = [("request", self.local, self._local_active)]
        if self.global_cache is not None:
            sources.append(("global", self.global_cache.trie, self._global_active))
        for source, trie, active in sources:
            cand = trie.best_draft(active, self.max_match_length, self.max_spec_factor, self.max_spec_offset,
                                   budget.max_nodes, budget.max_depth, self.min_token_prob, self.tree)
            if cand is not None and (best is None or cand.score > best.score):
                best, best_source = cand, source
        if best is None:
            return empty_draft(1, input_ids.device)
        # On the host: the loop trims and lays out the tree there, and moves it to the model's device once.
        return DraftTree.from_lists(best.tokens, best.parents, best.probs,
                                    info={"drafter": "suffix", "source": best_source, "match_length": best.match_length,
                                          "score": best.score})


def from_config(config, target, draft_model=None) -> SuffixDrafter:
    """`drafter="suffix"`: the process-wide cache is shared by the model's name and vocabulary."""
    text_config = target.config.get_text_config()
    key = (getattr(target.config, "_name_or_path", ""), text_config.vocab_size)
    return SuffixDrafter(
        cache_key=key,
        max_match_length=config.max_match_length,
        max_depth=config.max_depth,
        max_spec_factor=config.max_spec_factor,
        max_spec_offset=config.max_spec_offset,
        min_token_prob=config.min_token_prob,
        use_global=config.global_cache,
        max_cached_outputs=config.max_cached_outputs,
        max_cached_tokens=config.max_cached_tokens,
        tree=config.tree,
    )
