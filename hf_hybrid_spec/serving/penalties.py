"""OpenAI's `presence_penalty` and `frequency_penalty` as a logits processor (transformers has none).

The semantics are OpenAI's and vLLM's: for every token j, `score[j] -= frequency * c[j] + presence * (c[j] > 0)`,
where c[j] counts j among the tokens generated so far (the prompt does not count). As a processor it reads the ids it
is given, so tree verification applies it to every node with that node's context and speculation stays exact; it
takes every node's context at once (`call_aligned`), so a batch's nodes are penalized in one pass
(`verification.batch_choices`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

__all__ = ["OccurrencePenaltyLogitsProcessor"]


class OccurrencePenaltyLogitsProcessor(LogitsProcessor):
    """Args:
        presence: subtracted from the score of every token generated at least once (OpenAI's range: -2 to 2).
        frequency: subtracted once per time a token was generated.
        prompt_length: the ids before this position are the prompt (not counted).
    """

    def __init__(self, presence: float, frequency: float, prompt_length: int):
        if prompt_length < 0:
            raise ValueError(f"prompt_length must be >= 0, got {prompt_length}")
        self.presence, self.frequency, self.prompt_length = float(presence), float(frequency), int(prompt_length)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] (the prompt first), scores [B, V] -> the penalized scores [B, V]."""
        vocab = scores.shape[-1]
        generated = input_ids[:, self.prompt_length :].to(scores.device).clamp(max=vocab)  # past the vocab: dropped
        counts = torch.zeros(scores.shape[0], vocab + 1, dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, generated, torch.ones(generated.shape, dtype=scores.dtype, device=scores.device))
        counts = counts[:, :vocab]
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)

    def call_aligned(self, ids: torch.Tensor, lengths: torch.Tensor, scores: torch.Tensor,
                     prompt_length: torch.Tensor | None = None) -> torch.Tensor:
        """`__call__` for many contexts at once: ids [M, W] each context right-aligned (anything before it), lengths
        [M] their lengths, scores [M, V] -> the penalized scores [M, V], each row as `__call__` gives it (with
        `prompt_length` [M], each context's own prompt length in place of this processor's)."""
        vocab, width = scores.shape[-1], ids.shape[1]
        position = torch.arange(width, device=ids.device)[None, :]
        prompt = self.prompt_length if prompt_length is None else prompt_length.to(ids.device)
        generated = position >= (width - lengths + prompt)[:, None]
        tokens = torch.where(generated, ids.clamp(min=0, max=vocab), vocab).to(scores.device)
        counts = torch.zeros(scores.shape[0], vocab + 1, dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, tokens, generated.to(scores.device, scores.dtype))
        counts = counts[:, :vocab]
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)

    def group_key(self) -> tuple:
        """What requests' processors must share to be applied together (`verification.batch_choices`): the penalties;
        each request's prompt length is its own (`call_group`)."""
        return (self.presence, self.frequency)

    @staticmethod
    def call_group(processors: list, ids: torch.Tensor, lengths: torch.Tensor, scores: torch.Tensor,
                   nodes: int) -> torch.Tensor:
        """`call_aligned` for the nodes of several requests (`nodes` consecutive contexts each, in the order of
        `processors`, one per request with the same `group_key`), each with its own prompt length."""
        prompt = torch.tensor([p.prompt_length for p in processors]).repeat_interleave(nodes)
        return processors[0].call_aligned(ids, lengths, scores, prompt)
