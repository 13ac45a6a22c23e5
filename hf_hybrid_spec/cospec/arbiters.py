"""Arbiters: who decides, at a draft/target mismatch, which token is kept.

Lossy verification (`AssistantConfig(verification="cospec" | "fly" | "typical")`) walks the draft tree like
greedy verification, but wherever the draft's own choice `d` differs from the target's choice `t` it asks an
arbiter. Keeping `d` is an *override* (the output is no longer the target's greedy output); keeping `t` is what
lossless verification does. The arbiter sees a `Mismatch`: both distributions, both tokens, the depth, how far
the target keeps agreeing with the draft below `d`, and optionally the target's hidden state at the node.

Arbiters here:

- `ConstantArbiter(accept)`: always keep the draft's token (then the output is exactly the draft model's own
  greedy output) or never (exactly lossless greedy). Used by the tests and as bounds.
- `FlyGate`: FLy (Li et al., 2025, training-free): keep `d` when the target is uncertain (its top-3 entropy is
  at least a threshold) and the target then agrees with the draft for the next `window - 1` tokens (the deferred
  window: the target "self-corrects" after a real error, so agreement after `d` says `d` was a valid variant).
- `TypicalAcceptance`: Medusa's typical acceptance: keep `d` when the target gives it probability above
  `min(epsilon, delta * exp(-H(p)))`, with p the target's distribution at `temperature`.
- `CoSpecArbiter` (in `modeling.py`): a small learned policy (RL-trained, `recipes/train_cospec.py`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["Mismatch", "Arbiter", "ConstantArbiter", "FlyGate", "TypicalAcceptance", "entropy", "top_k_entropy"]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of distributions [..., V] -> [...]."""
    return -(probs * probs.clamp(min=1e-30).log()).sum(-1)


def top_k_entropy(logits: torch.Tensor, k: int) -> torch.Tensor:
    """FLy's gate statistic: -sum over the k most probable tokens of p log p (not renormalized). [..., V] -> [...]."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1).values
    return -(top.exp() * top).sum(-1)


@dataclass
class Mismatch:
    """One point where the draft's choice differs from the target's.

    Attributes:
        node: index of the verify-tree node whose next token is being decided (0 = the root).
        depth: that node's depth below the root (0 for the root).
        position: index in the full sequence (prompt included) of the token being decided.
        draft_token / target_token: the draft model's choice and the target's (processed) argmax; they differ.
        target_logits: [V] fp32 processed target scores at the node.
        draft_probs: [V] fp32 draft distribution at the node, or None when the drafter does not report one.
        draft_continues: the draft tree has a node for `draft_token` here, so keeping it continues verification
            below it; False when keeping it ends this step (a leaf, or a pruned branch).
        agreement_below: how many tokens the target accepts under exact matching right after `draft_token`
            (0 when `draft_continues` is False): the "deferred window" evidence.
        target_hidden: [H] the target's last hidden state at the node, when the arbiter asked for it.
    """

    node: int
    depth: int
    position: int
    draft_token: int
    target_token: int
    target_logits: torch.Tensor
    draft_probs: torch.Tensor | None
    draft_continues: bool
    agreement_below: int
    target_hidden: torch.Tensor | None = None

    def target_probs(self, temperature: float = 1.0) -> torch.Tensor:
        """[V] softmax of the target scores at `temperature`."""
        return torch.softmax(self.target_logits / temperature, dim=-1)


class Arbiter(ABC):
    """Decides each mismatch: True keeps the draft's token, False the target's."""

    # Whether `Mismatch.target_hidden` must be filled (costs `output_hidden_states` in the verify forward).
    uses_target_hidden: bool = False
    # Whether `Mismatch.draft_probs` must be present (a drafter that reports `next_probs`, e.g. the model drafter).
    needs_draft_probs: bool = False

    @abstractmethod
    def decide(self, mismatch: Mismatch) -> bool:
        """True: keep the draft's token (an override); False: keep the target's."""


class ConstantArbiter(Arbiter):
    """Always keeps the draft's token (`accept=True`) or always the target's (`accept=False`)."""

    def __init__(self, accept: bool):
        self.accept = bool(accept)

    def decide(self, mismatch: Mismatch) -> bool:
        return self.accept

    def __repr__(self) -> str:
        return f"ConstantArbiter(accept={self.accept})"


class FlyGate(Arbiter):
    """FLy's two-tier rule: entropy gate on the target, then a deferred window of exact agreement.

    Args:
        entropy_threshold: keep `d` only where the target's top-`top_k` entropy (nats) is at least this (FLy: 0.3).
        window: FLy's window length W: the mismatch plus W - 1 following tokens the target must accept exactly
            (FLy: 6). Mismatches closer than that to the end of the draft are never kept.
        top_k: tokens in the entropy statistic (FLy: 3).
    """

    def __init__(self, entropy_threshold: float = 0.3, window: int = 6, top_k: int = 3):
        if entropy_threshold < 0 or window < 1 or top_k < 1:
            raise ValueError("FlyGate needs entropy_threshold >= 0, window >= 1 and top_k >= 1")
        self.entropy_threshold = entropy_threshold
        self.window = window
        self.top_k = top_k

    def decide(self, mismatch: Mismatch) -> bool:
        if not mismatch.draft_continues or mismatch.agreement_below < self.window - 1:
            return False
        return bool(top_k_entropy(mismatch.target_logits, self.top_k) >= self.entropy_threshold)

    def __repr__(self) -> str:
        return f"FlyGate(entropy_threshold={self.entropy_threshold}, window={self.window}, top_k={self.top_k})"


class TypicalAcceptance(Arbiter):
    """Medusa's typical acceptance: p(d) > min(epsilon, delta * exp(-H(p))), p at `temperature`.

    Args:
        epsilon: the hard threshold (Medusa's `posterior_threshold`, 0.09).
        delta: the entropy-scaled threshold factor (Medusa's `posterior_alpha`, 0.3).
        temperature: temperature of p (Medusa's default sampling temperature for typical acceptance, 0.7).
    """

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3, temperature: float = 0.7):
        if not 0 < epsilon <= 1 or not delta > 0 or not temperature > 0:
            raise ValueError("TypicalAcceptance needs 0 < epsilon <= 1, delta > 0 and temperature > 0")
        self.epsilon = epsilon
        self.delta = delta
        self.temperature = temperature

    def decide(self, mismatch: Mismatch) -> bool:
        p = mismatch.target_probs(self.temperature)
        threshold = min(self.epsilon, self.delta * math.exp(-float(entropy(p))))
        return bool(p[mismatch.draft_token] > threshold)

    def __repr__(self) -> str:
        return f"TypicalAcceptance(epsilon={self.epsilon}, delta={self.delta}, temperature={self.temperature})"
