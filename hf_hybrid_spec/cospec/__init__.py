"""CoSpec and training-free relatives: lossy, opt-in verification that may keep the draft's token (issue #9).

    from hf_hybrid_spec import AssistantConfig
    AssistantConfig(drafter="model", verification="cospec", arbiter="path/or/hub-id")   # learned arbiter
    AssistantConfig(drafter="model", verification="fly")       # FLy: entropy gate + deferred window
    AssistantConfig(drafter="model", verification="typical")   # Medusa typical acceptance

Modules: `arbiters` (the `Mismatch` an arbiter sees; constant, FLy and typical rules), `features` (the learned
arbiter's inputs), `modeling` (`CoSpecArbiterConfig` / `CoSpecArbiter`, a Hub-ready model), `verify` (arbitrated
greedy verification and the generate-loop hook), `rollout` (sampled decisions for RL training).
"""

from .arbiters import Arbiter, ConstantArbiter, FlyGate, Mismatch, TypicalAcceptance
from .features import FEATURE_NAMES, mismatch_features
from .modeling import CoSpecArbiter, CoSpecArbiterConfig
from .rollout import Decision, SamplingArbiter, decision_log_probs
from .verify import ArbitratedResult, LossyVerifier, load_arbiter, make_lossy_verifier, verify_arbitrated

__all__ = [
    "Arbiter",
    "ConstantArbiter",
    "FlyGate",
    "TypicalAcceptance",
    "Mismatch",
    "FEATURE_NAMES",
    "mismatch_features",
    "CoSpecArbiter",
    "CoSpecArbiterConfig",
    "SamplingArbiter",
    "Decision",
    "decision_log_probs",
    "ArbitratedResult",
    "LossyVerifier",
    "load_arbiter",
    "make_lossy_verifier",
    "verify_arbitrated",
]
