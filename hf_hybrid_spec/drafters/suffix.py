"""Suffix-tree cache drafter in the style of SuffixDecoding (arXiv 2411.04975).

Two depth-limited suffix tries with occurrence counts: one per request over prompt + output, one shared by
the process over earlier outputs. For the current context, every suffix of length m <= max_match_length
that occurred before is a match; its node's children are what followed it. From a match the drafter grows
a tree best-first by path probability (products of child count / sibling total), stops at
`min_token_prob`, and caps the size at `m * max_spec_factor + max_spec_offset`. The score of a tree is the
sum of its path probabilities, an estimate of the accepted length; the best-scoring match (over both
tries and all match lengths) is proposed.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque

import torch

from ..tree import DraftTree, empty_draft
from .base import DraftBudget, Drafter, committed_since

__all__ = ["SuffixTrie", "SuffixDrafter", "clear_global_suffix_cache", "global_suffix_cache"]


class SuffixTrie:
    """Every substring (length <= depth) of the inserted sequences, as a trie with occurrence counts.

    Nodes are integer ids (0 is the root) into flat lists, not objects: the trie of a 1,000-token prompt has tens
    of thousands of nodes, and as objects (or lists) each would be tracked by Python's cyclic garbage collector,
    whose passes over them cost ~10x the building itself. A dict of ints, a list of ints: nothing to track.

    Attributes:
        children: per node, token -> child node.
        counts: per node, occurrences of the path from the root to the node.
        totals: per node, the sum of its children's counts (occurrences that had a continuation).
    """

    ROOT = 0

    def __init__(self, depth: int):
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]
        self.counts: list[int] = [0]
        self.totals: list[int] = [0]
        self._free: list[int] = []  # ids of removed nodes, reused before the lists grow

    @property
    def num_nodes(self) -> int:
        return len(self.counts) - len(self._free)

    def extend(self, active: list[int], token: int) -> list[int]:
        """Append `token` to a sequence being inserted; `active[k]` is the node of its suffix of length k + 1.

        Returns the new active list (creates and counts nodes).
        """
        children, counts, totals, free = self.children, self.counts, self.totals, self._free
        new = []
        append = new.append
        # The hot loop of building a prompt's trie (`depth` node visits per token): no calls inside. Freed ids
        # (eviction) are reused before the lists grow.
        for node in (0, *active[: self.depth - 1]):
            kids = children[node]
            child = kids.get(token)
            if child is None:
                if free:
                    child = free.pop()
                else:
                    child = len(counts)
                    children.append({})
                    counts.append(0)
                    totals.append(0)
                kids[token] = child
            counts[child] += 1
            totals[node] += 1
            append(child)
        return new

    def follow(self, active: list[int], token: int) -> list[int]:
        """Like `extend` but read-only: the nodes of the context's suffixes that exist in the trie."""
        children = self.children
        new = []
        for node in (0, *active[: self.depth - 1]):
            child = children[node].get(token)
            if child is None:
                # If the (k+1)-gram is absent, so is every longer one (its suffix would be present).
                break
            new.append(child)
        return new

    def active_after(self, tokens: list[int]) -> list[int]:
        """The `follow` state after `tokens`: it depends on their last `depth` tokens only (suffixes are at most that
        long), so a long context costs no more than a short one."""
        active: list[int] = []
        for t in tokens[-self.depth :]:
            active = self.follow(active, t)
        return active

    def truncate(self, tokens: list[int], keep: int) -> None:
        """Undo what positions `keep`.. of an inserted sequence `tokens` added: for a request's trie (built from
        exactly `tokens`) that leaves the trie of `tokens[:keep]`; `keep = 0` removes the sequence. Each position added
        the substrings ending at it; those are taken out again (counts and totals decremented, nodes that reach zero
        released), walking only from the starts that reach position `keep` or later: O((len(tokens) - keep + depth) *
        depth), not a rebuild of the kept part."""
        children, counts, totals = self.children, self.counts, self.totals
        n = len(tokens)
        for start in range(max(0, keep - self.depth + 1), n):
            node = 0
            for pos in range(start, min(start + self.depth, n)):
                t = tokens[pos]
                child = children[node][t]
                if pos >= keep:
                    counts[child] -= 1
                    totals[node] -= 1
                    if counts[child] == 0:
                        # Nothing longer through it is left either (a longer substring occurs at most as often).
                        del children[node][t]
                        self._release(child)
                        break
                node = child

    def insert(self, tokens: list[int]) -> None:
        active: list[int] = []
        for t in tokens:
            active = self.extend(active, t)

    def remove(self, tokens: list[int]) -> None:
        """Undo `insert(tokens)`: decrement the same counts, drop nodes that reach zero."""
        self.truncate(tokens, 0)

    def copy(self) -> SuffixTrie:
        """An independent copy (benchmarks replay a call from the same state)."""
        new = SuffixTrie(self.depth)
        new.children = [dict(c) for c in self.children]
        new.counts, new.totals, new._free = list(self.counts), list(self.totals), list(self._free)
        return new

    def _release(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self.children[n].values())
            self.children[n] = {}
            self.counts[n] = self.totals[n] = 0
            self._free.append(n)


class GlobalSuffixCache:
    """Process-wide state of the suffix drafters of one model / tokenizer (thread-safe):

    - `trie`: every earlier output (the newest `max_outputs`), SuffixDecoding's global tree;
    - `finished`: the request tries of the last `MAX_FINISHED` requests (at most `MAX_FINISHED_NODES` nodes in all,
      ~270 bytes each: a 2,000-token prompt's trie holds up to ~90k), with the tokens each was built from. A
      request whose prompt starts with most of a finished request's tokens (the next call of an agent loop carries
      the earlier prompt and its output) takes that trie over instead of building its own from the first token:
      `SuffixTrie.truncate` cuts it back to the common prefix and only the rest of the prompt is inserted. The trie
      is the same either way (so are the drafts); building one costs ~10-17 us per prompt token at the default depth
      (`max_match_length + max_depth` = 40: node visits per token), ~140 ms for an 8k-token context.
    """

    MAX_FINISHED = 4
    MAX_FINISHED_NODES = 1_000_000

    def __init__(self, depth: int, max_outputs: int):
        self.trie = SuffixTrie(depth)
        self.max_outputs = max_outputs
        self.outputs: deque[list[int]] = deque()
        self.finished: deque[tuple[list[int], SuffixTrie]] = deque()
        self.lock = threading.Lock()

    def copy(self) -> GlobalSuffixCache:
        """An independent copy (its own tries, outputs and lock)."""
        with self.lock:
            new = GlobalSuffixCache(self.trie.depth, self.max_outputs)
            new.trie, new.outputs = self.trie.copy(), deque(self.outputs)
            new.finished = deque((list(tokens), trie.copy()) for tokens, trie in self.finished)
        return new

    def keep_trie(self, tokens: list[int], trie: SuffixTrie) -> None:
        """Keep a finished request's trie, built from exactly `tokens` (prompt + output); the caller gives it up."""
        with self.lock:
            self.finished.append((tokens, trie))
            # Oldest out first; a trie over the node budget on its own is not kept at all.
            while self.finished and (len(self.finished) > self.MAX_FINISHED
                                     or sum(t.num_nodes for _, t in self.finished) > self.MAX_FINISHED_NODES):
                self.finished.popleft()

    def take_trie(self, tokens: list[int]) -> tuple[SuffixTrie, int] | None:
        """The kept trie sharing the longest prefix with `tokens`, cut back to that prefix, and its length; None when
        no kept trie shares more than it would take to cut (a fresh build is cheaper). The trie leaves the cache."""
        with self.lock:
            best, best_keep = None, 0
            for i, (old, _) in enumerate(self.finished):
                keep = _common_prefix(old, tokens)
                if keep > best_keep and len(old) - keep < keep:
                    best, best_keep = i, keep
            if best is None:
                return None
            old, trie = self.finished[best]
            del self.finished[best]
        trie.truncate(old, best_keep)
        return trie, best_keep

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        with self.lock:
            self.trie.insert(tokens)
            self.outputs.append(tokens)
            while len(self.outputs) > self.max_outputs:
                self.trie.remove(self.outputs.popleft())


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search over C-speed slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_GLOBAL: dict[tuple, GlobalSuffixCache] = {}


def global_suffix_cache(key: tuple, depth: int, max_outputs: int) -> GlobalSuffixCache:
    """The shared cache for `key` (a model/tokenizer identity): outputs of different vocabularies never mix."""
    cache = _GLOBAL.get((key, depth))
    if cache is None:
        cache = _GLOBAL[(key, depth)] = GlobalSuffixCache(depth, max_outputs)
    cache.max_outputs = max_outputs
    return cache


def clear_global_suffix_cache() -> None:
    _GLOBAL.clear()


class SuffixDrafter(Drafter):
    """See the module docstring. One instance per request."""

    name = "suffix"
    respects_budget = True  # `_grow` stops at the budget's nodes and depth

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
    ):
        self.max_match_length = max_match_length
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.tree = tree
        # A match of length m can only draft depth - m tokens from a depth-limited trie.
        depth = max_match_length + max_depth
        self.local = SuffixTrie(depth)
        # The process-wide cache is looked up when a request begins, not here: a drafter built ahead of its request
        # (HVD's, or one made before `clear_global_suffix_cache()`) must learn from, and add to, the live cache.
        self._global_args = (cache_key, depth, max_cached_outputs) if use_global else None
        self.global_cache: GlobalSuffixCache | None = None
        self._local_active: list[int] = []
        self._global_active: list[int] = []
        self._seen = 0  # tokens of the request fed to the tries
        self._prompt_length = 0

    # ------------------------------------------------------------------ request lifecycle
    def begin(self, input_ids: torch.Tensor, context=None, hidden=None) -> None:
        tokens = input_ids[0].tolist()
        self._prompt_length = len(tokens)
        self.local, self._local_active, start = SuffixTrie(self.local.depth), [], 0
        if self._global_args is not None:
            self.global_cache = global_suffix_cache(*self._global_args)
            # An earlier request whose tokens this prompt repeats (an agent loop's previous call) hands over its trie.
            taken = self.global_cache.take_trie(tokens)
            if taken is not None:
                self.local, start = taken
                self._local_active = self.local.active_after(tokens[:start])
        for t in tokens[start:]:
            self._local_active = self.local.extend(self._local_active, t)
        if self.global_cache is not None:
            self._global_active = self.global_cache.trie.active_after(tokens)
        self._seen = len(tokens)

    def accept(self, input_ids, result, hidden=None) -> None:
        self._feed(committed_since(input_ids, self._seen, result))

    def end(self, input_ids: torch.Tensor) -> None:
        if self.global_cache is not None:
            tokens = input_ids[0].tolist()
            if self._seen < len(tokens):
                self._feed(tokens[self._seen :])
            self.global_cache.add(tokens[self._prompt_length :])
            self.global_cache.keep_trie(tokens, self.local)
            # The trie is the cache's now: this drafter starts from an empty one if it begins again.
            self.local, self._local_active, self._seen = SuffixTrie(self.local.depth), [], 0

    def _feed(self, tokens: list[int]) -> None:
        for t in tokens:
            self._local_active = self.local.extend(self._local_active, t)
            if self.global_cache is not None:
                self._global_active = self.global_cache.trie.follow(self._global_active, t)
        self._seen += len(tokens)

    # ------------------------------------------------------------------ drafting
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if input_ids.shape[1] != self._seen:
            # The loop always calls accept() first; resynchronize if a caller did not.
            self._feed(input_ids[0, self._seen :].tolist())
        best = None
        sources = [("request", self.local, self._local_active)]
        if self.global_cache is not None:
            sources.append(("global", self.global_cache.trie, self._global_active))
        for source, trie, active in sources:
            prev_count = None
            # Longest match first; a shorter match with the same count has the same continuations.
            for m in range(min(len(active), self.max_match_length), 0, -1):
                node = active[m - 1]
                count = trie.counts[node]
                if trie.totals[node] == 0 or count == prev_count:
                    prev_count = count
                    continue
                prev_count = count
                cand = self._grow(trie, node, m, budget)
                if cand is not None and (best is None or cand[0] > best[0]):
                    best = cand + (source, m)
        if best is None:
            return empty_draft(1, input_ids.device)
        score, tokens, parents, probs, source, m = best
        # On the host: the loop trims and lays out the tree there, and moves it to the model's device once.
        return DraftTree.from_lists(tokens, parents, probs,
                                    info={"drafter": "suffix", "source": source, "match_length": m, "score": score})

    def _grow(self, trie: SuffixTrie, node: int, match_length: int, budget: DraftBudget):
        cap = min(budget.max_nodes, int(match_length * self.max_spec_factor + self.max_spec_offset))
        if cap <= 0:
            return None
        tie = itertools.count()
        heap: list = []
        children, counts, totals = trie.children, trie.counts, trie.totals

        def push_children(parent_node: int, parent_prob: float, parent_idx: int, depth: int):
            total = totals[parent_node]
            if depth > budget.max_depth or total == 0:
                return
            items = children[parent_node].items()
            if not self.tree:
                items = [max(items, key=lambda kv: counts[kv[1]])]
            for tok, child in items:
                p = parent_prob * counts[child] / total
                if p >= self.min_token_prob:
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
        return sum(probs), tokens, parents, probs
