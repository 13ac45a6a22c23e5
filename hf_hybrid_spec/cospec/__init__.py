"""CoSpec and training-free relatives: lossy, opt-in verification that may keep the draft's token.

    from hf_hybrid_spec import AssistantConfig
    AssistantConfig(drafter="model", verification="cospec", arbiter="path/or/hub-id")   # learned arbiter
    AssistantConfig(drafter="model", verification="fly")       # FLy: entropy gate + deferred window
    AssistantConfig(drafter="model", verification="typical")   # Medusa typical acceptance

Modules: `arbiters` (the `Mismatch` an arbiter sees; constant, FLy and typical rules), `features` (the learned
arbiter's inputs), `modeling` (`CoSpecArbiterConfig` / `CoSpecArbiter`, a Hub-ready model), `rollout` (sampled
decisions for RL training). The verification rule that consults an arbiter is `hf_hybrid_spec.verification.arbitrated`.
Names are imported on first use.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "Arbiter": "arbiters", "ConstantArbiter": "arbiters", "FlyGate": "arbiters", "Mismatch": "arbiters",
    "TypicalAcceptance": "arbiters", "FEATURE_NAMES": "features", "mismatch_features": "features",
    "CoSpecArbiter": "modeling", "CoSpecArbiterConfig": "modeling", "Decision": "rollout",
    "SamplingArbiter": "rollout", "decision_log_probs": "rollout",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

