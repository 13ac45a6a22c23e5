"""Prompt-lookup (n-gram) drafter: the baseline transformers ships as `prompt_lookup_num_tokens`.

Match the last n tokens (n = ngram_size down to 1) against the earlier context and draft the tokens that
followed the first match, as one chain.
"""

from __future__ import annotations

import torch

from ..tree import DraftTree, chain_tree, empty_draft
from .base import DraftBudget, Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, ngram_size: int = 3, num_tokens: int = 8):
        self.ngram_size = ngram_size
        self.num_tokens = num_tokens

    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        seq = input_ids[0]
        length = seq.shape[0]
        want = min(self.num_tokens, budget.max_nodes, budget.max_depth)
        for n in range(min(self.ngram_size, length - 1), 0, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # every earlier n-gram, the current tail excluded
            hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten()
            for start in hits.tolist():
                follow = seq[start + n : start + n + want]
                if follow.numel() > 0:
                    # To the host (the hits were just read from the device anyway), like a cache draft.
                    return chain_tree(follow.unsqueeze(0).cpu())
        return empty_draft(1, "cpu")
