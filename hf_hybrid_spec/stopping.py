"""Stock stopping criteria evaluated on the host, token by token.

Stock `generate` calls its `StoppingCriteriaList` once per token on device tensors: for a speculative step that
commits k tokens that is k calls of a handful of tiny kernels each, and a device read of the verdicts. The
criteria transformers builds from a generation config only look at the sequence length, the last token or the
clock, all of which the loop knows on the host. `HostStopping` reproduces exactly those (`MaxLengthCriteria`,
`EosTokenCriteria`, `MaxTimeCriteria`, matched by exact type, so a subclass with its own `__call__` is never
second-guessed); any other criterion in the list (stop strings, user criteria) sends the loop back to calling
the list itself.
"""

from __future__ import annotations

import time

from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["HostStopping"]


class HostStopping:
    """Host verdicts of a stopping-criteria list made only of length, EOS and time criteria.

    Build with `HostStopping.build(criteria)`, which returns None when the list holds anything else.
    """

    def __init__(self, max_lengths: list[MaxLengthCriteria], eos: set[int], deadlines: list[MaxTimeCriteria]):
        self.max_lengths = max_lengths
        self.eos = eos
        self.deadlines = deadlines

    @classmethod
    def build(cls, criteria: StoppingCriteriaList | None) -> HostStopping | None:
        max_lengths, eos, deadlines = [], set(), []
        for c in criteria or ():
            kind = type(c)
            if kind is MaxLengthCriteria:
                max_lengths.append(c)
            elif kind is EosTokenCriteria:
                eos.update(int(t) for t in c.eos_token_id.reshape(-1).tolist())
            elif kind is MaxTimeCriteria:
                deadlines.append(c)
            else:
                return None
        return cls(max_lengths, eos, deadlines)

    def stops(self, length: int, token: int) -> bool:
        """Whether generation stops once the sequence has `length` tokens, the last being `token`."""
        if token in self.eos:
            return True
        for c in self.max_lengths:
            if length >= c.max_length:
                return True
            if c.max_position_embeddings is not None and length > c.max_position_embeddings:
                logger.warning_once(  # as the stock criterion does
                    f"generation has exceeded the model's maximum length ({c.max_position_embeddings}); expect "
                    "degraded outputs past it."
                )
        if self.deadlines:
            now = time.time()
            return any(now - c.initial_timestamp > c.max_time for c in self.deadlines)
        return False
