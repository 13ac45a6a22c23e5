"""Rollouts for policy-gradient training: an arbiter that samples its decisions and records them.

    policy = SamplingArbiter(arbiter, generator)
    policy.reset()
    out = target.generate(..., assistant_config=AssistantConfig(verification="cospec", arbiter=policy, ...))
    policy.decisions     # one Decision per mismatch, in order: inputs, action, log-prob under the sampling policy

The trainer later recomputes log pi(action | inputs) with gradients from the stored inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .arbiters import Arbiter, Mismatch
from .modeling import CoSpecArbiter

__all__ = ["Decision", "SamplingArbiter", "decision_log_probs"]


@dataclass
class Decision:
    """One sampled arbitration.

    Attributes:
        features: [F] the arbiter's scalar inputs.
        hidden: [H] the target hidden state input, or None.
        accept: the sampled action (True: the draft's token was kept).
        log_prob: log pi(accept | inputs) under the policy that sampled it.
        position: sequence index of the decided token (decisions at or past the end of the kept output did not
            change it, and a trainer may mask them).
    """

    features: torch.Tensor
    hidden: torch.Tensor | None
    accept: bool
    log_prob: float
    position: int


class SamplingArbiter(Arbiter):
    """Samples accept ~ Bernoulli(sigmoid(arbiter log-odds)) and records every decision."""

    needs_draft_probs = True

    def __init__(self, arbiter: CoSpecArbiter, generator: torch.Generator | None = None):
        self.arbiter = arbiter
        self.generator = generator
        self.decisions: list[Decision] = []

    @property
    def uses_target_hidden(self) -> bool:
        return self.arbiter.uses_target_hidden

    def reset(self) -> None:
        self.decisions = []

    @torch.no_grad()
    def decide(self, mismatch: Mismatch) -> bool:
        features, hidden = self.arbiter.inputs(mismatch)
        logit = self.arbiter(features[None], None if hidden is None else hidden[None])[0].float().cpu()
        accept = bool(torch.rand((), generator=self.generator) < torch.sigmoid(logit))
        log_prob = float(F.logsigmoid(logit if accept else -logit))
        self.decisions.append(Decision(features.cpu(), None if hidden is None else hidden.cpu(), accept, log_prob,
                                       mismatch.position))
        return accept


def decision_log_probs(arbiter: CoSpecArbiter, decisions: list[Decision]) -> torch.Tensor:
    """[D] log pi(action | inputs) under `arbiter`, with gradients."""
    device = arbiter.head.weight.device
    features = torch.stack([d.features for d in decisions]).to(device)
    hidden = None
    if arbiter.uses_target_hidden:
        hidden = torch.stack([d.hidden for d in decisions]).to(device)
    logits = arbiter(features, hidden)
    sign = torch.tensor([1.0 if d.accept else -1.0 for d in decisions], device=device)
    return F.logsigmoid(sign * logits)
