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
from .base import DraftBudget, Drafter

__all__ = ["SuffixTrie", "SuffixDrafter", "clear_global_suffix_cache", "global_suffix_cache"]


class _Node:
    __slots__ = ("children", "count", "total")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of the path from the root to this node
        self.total = 0  # sum of the children's counts: occurrences that had a continuation


class SuffixTrie:
    """Every substring (length <= depth) of the inserted sequences, as a trie with occurrence counts."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 1

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append `token` to a sequence being inserted; `active[k]` is the node of its suffix of length k + 1.

        Returns the new active list (creates and counts nodes).
        """
        new = []
        for node in itertools.chain((self.root,), active[: self.depth - 1]):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            node.total += 1
            new.append(child)
        return new

    def follow(self, active: list[_Node], token: int) -> list[_Node]:
        """Like `extend` but read-only: the nodes of the context's suffixes that exist in the trie."""
        new = []
        for node in itertools.chain((self.root,), active[: self.depth - 1]):
            child = node.children.get(token)
            if child is None:
                # If the (k+1)-gram is absent, so is every longer one (its suffix would be present).
                break
            new.append(child)
        return new

    def insert(self, tokens: list[int]) -> None:
        active: list[_Node] = []
        for t in tokens:
            active = self.extend(active, t)

    def remove(self, tokens: list[int]) -> None:
        """Undo `insert(tokens)`: decrement the same counts, drop nodes that reach zero."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.depth]:
                child = node.children[t]
                child.count -= 1
                node.total -= 1
                if child.count == 0:
                    del node.children[t]
                    self.num_nodes -= self._size(child)
                    break
                node = child

    def _size(self, node: _Node) -> int:
        return 1 + sum(self._size(c) for c in node.children.values())


class GlobalSuffixCache:
    """Process-wide trie over earlier outputs, keeping the newest `max_outputs` (thread-safe)."""

    def __init__(self, depth: int, max_outputs: int):
        self.trie = SuffixTrie(depth)
        self.max_outputs = max_outputs
        self.outputs: deque[list[int]] = deque()
        self.lock = threading.Lock()

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        with self.lock:
            self.trie.insert(tokens)
            self.outputs.append(tokens)
            while len(self.outputs) > self.max_outputs:
                self.trie.remove(self.outputs.popleft())


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
        self._local_active: list[_Node] = []
        self._global_active: list[_Node] = []
        self._seen = 0  # tokens of the request fed to the tries
        self._prompt_length = 0

    # ------------------------------------------------------------------ request lifecycle
    def begin(self, input_ids: torch.Tensor, context=None, hidden=None) -> None:
        if self._global_args is not None:
            self.global_cache = global_suffix_cache(*self._global_args)
        self._prompt_length = input_ids.shape[1]
        self._feed(input_ids[0].tolist())

    def accept(self, input_ids, result, hidden=None) -> None:
        self._feed(input_ids[0, self._seen :].tolist())

    def end(self, input_ids: torch.Tensor) -> None:
        if self.global_cache is not None:
            self.global_cache.add(input_ids[0, self._prompt_length :].tolist())

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
        for source, active in (("request", self._local_active), ("global", self._global_active)):
            prev_count = None
            # Longest match first; a shorter match with the same count has the same continuations.
            for m in range(min(len(active), self.max_match_length), 0, -1):
                node = active[m - 1]
                if node.total == 0 or node.count == prev_count:
                    prev_count = node.count
                    continue
                prev_count = node.count
                cand = self._grow(node, m, budget)
                if cand is not None and (best is None or cand[0] > best[0]):
                    best = cand + (source, m)
        if best is None:
            return empty_draft(1, input_ids.device)
        score, tokens, parents, probs, source, m = best
        dev = input_ids.device
        return DraftTree(
            tokens=torch.tensor([tokens], dtype=torch.long, device=dev),
            parents=torch.tensor([parents], dtype=torch.long, device=dev),
            scores=torch.tensor([probs], dtype=torch.float32, device=dev),
            info={"drafter": "suffix", "source": source, "match_length": m, "score": score},
        )

    def _grow(self, node: _Node, match_length: int, budget: DraftBudget):
        cap = min(budget.max_nodes, int(match_length * self.max_spec_factor + self.max_spec_offset))
        if cap <= 0:
            return None
        tie = itertools.count()
        heap: list = []

        def push_children(parent_node: _Node, parent_prob: float, parent_idx: int, depth: int):
            if depth > budget.max_depth or parent_node.total == 0:
                return
            items = parent_node.children.items()
            if not self.tree:
                items = [max(items, key=lambda kv: kv[1].count)]
            for tok, child in items:
                p = parent_prob * child.count / parent_node.total
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
