"""The arbiter's view of a mismatch: a fixed vector of scalar features, each scaled to about [-2, 2].

| name | meaning |
| --- | --- |
| `target_logp_target`, `target_logp_draft` | log p(t), log p(d) under the target (clamped at -20, / 10) |
| `draft_logq_target`, `draft_logq_draft` | log q(t), log q(d) under the draft |
| `target_entropy`, `draft_entropy` | H(p), H(q) over log(V) |
| `depth` | depth of the decision in the draft tree (/ 8) |
| `draft_continues` | 1 if the draft tree goes on below d (keeping d continues verification) |
| `agreement_below` | tokens the target accepts exactly right after d (/ 8): FLy's window evidence |

The order is part of a trained arbiter's config (`CoSpecArbiterConfig.features`), so new features are only ever
appended.
"""

from __future__ import annotations

import math

import torch

from .arbiters import Mismatch, entropy

__all__ = ["FEATURE_NAMES", "mismatch_features"]

FEATURE_NAMES = (
    "target_logp_target",
    "target_logp_draft",
    "draft_logq_target",
    "draft_logq_draft",
    "target_entropy",
    "draft_entropy",
    "depth",
    "draft_continues",
    "agreement_below",
)

_LOGP_FLOOR = -20.0


def _logp(probs: torch.Tensor, token: int) -> float:
    return max(math.log(max(float(probs[token]), 1e-30)), _LOGP_FLOOR) / 10.0


def mismatch_features(m: Mismatch, names: tuple[str, ...] = FEATURE_NAMES) -> torch.Tensor:
    """[F] float32 features of `m`, in the order of `names` (a subset of FEATURE_NAMES)."""
    if m.draft_probs is None:
        raise ValueError(
            "the CoSpec arbiter needs the draft's next-token distributions: use the model drafter "
            "(drafter='model' with draft_model=), or a drafter that fills DraftTree.next_probs"
        )
    p = m.target_probs()
    q = m.draft_probs.float()
    log_v = math.log(p.shape[-1])
    values = {
        "target_logp_target": _logp(p, m.target_token),
        "target_logp_draft": _logp(p, m.draft_token),
        "draft_logq_target": _logp(q, m.target_token),
        "draft_logq_draft": _logp(q, m.draft_token),
        "target_entropy": float(entropy(p)) / log_v,
        "draft_entropy": float(entropy(q)) / log_v,
        "depth": min(m.depth / 8.0, 2.0),
        "draft_continues": float(m.draft_continues),
        "agreement_below": min(m.agreement_below / 8.0, 2.0),
    }
    return torch.tensor([values[n] for n in names], dtype=torch.float32)
