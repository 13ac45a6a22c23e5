"""Prompt-lookup (n-gram) drafter: the baseline transformers ships as `prompt_lookup_num_tokens`.

Match the last n tokens (n = ngram_size down to 1) against the earlier context and draft the tokens that
followed the first match, as one chain.

The context lives on the host with an index of every n-gram's first position (kept up to date from the committed
tokens the loop hands to `accept`), so a draft is a few dict lookups: no scan of the sequence, no device work.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, chain_tree, empty_draft
from .base import DraftBudget, Drafter, committed_since


class NgramDrafter(Drafter):
    name = "ngram"
    catches_up = True  # `catch_up` indexes the tokens it has not seen

    def __init__(self, ngram_size: int = 3, num_tokens: int = 8):
        self.ngram_size = ngram_size
        self.num_tokens = num_tokens
        self._tokens: list[int] = []  # the request's committed tokens
        self._first: dict[tuple[int, ...], int] = {}  # every n-gram (n <= ngram_size) -> where it first starts

    def begin(self, input_ids: torch.Tensor, context=None, hidden=None) -> None:
        self._tokens, self._first = [], {}
        self._extend(input_ids[0].tolist())

    def accept(self, input_ids: torch.Tensor, result, hidden=None) -> None:
        self._extend(committed_since(input_ids, len(self._tokens), result))

    def catch_up(self, tokens: list[int]) -> None:
        self._extend(tokens)

    def _extend(self, tokens: list[int]) -> None:
        seq, first = self._tokens, self._first
        for t in tokens:
            seq.append(t)
            end = len(seq)
            for n in range(1, min(self.ngram_size, end) + 1):
                first.setdefault(tuple(seq[end - n : end]), end - n)

    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if len(self._tokens) != input_ids.shape[1]:
            self.begin(input_ids)  # not begun for this sequence (a caller outside the loop): index it now
        seq = self._tokens
        length = len(seq)
        want = min(self.num_tokens, budget.max_nodes, budget.max_depth)
        if want > 0:
            for n in range(min(self.ngram_size, length - 1), 0, -1):
                # The earliest earlier occurrence of the last n tokens (their own position does not count).
                start = self._first.get(tuple(seq[length - n :]))
                if start is not None and start < length - n:
                    return chain_tree(torch.tensor([seq[start + n : start + n + want]], dtype=torch.long))
        return empty_draft(1, "cpu")


def from_config(config, target, draft_model=None) -> NgramDrafter:
    """`drafter="ngram"`: prompt lookup, a chain of up to `max_draft_tokens` tokens."""
    return NgramDrafter(ngram_size=config.ngram_size, num_tokens=config.max_draft_tokens)
