"""Hybrid Verified Decoding (issue #6; arXiv 2606.01019): per step, verify the cache draft, the model draft or both.

    from hf_hybrid_spec import AssistantConfig, speculative_generate
    from hf_hybrid_spec.eagle import EagleDrafter

    cfg = AssistantConfig(drafter="hvd", hvd_policy="learned", hvd_predictor="examples/payoff/qwen3_5-small",
                          max_draft_tokens=48, max_depth=6, draft_top_k=8, hvd_model_tokens=32)
    out = target.generate(**inputs, do_sample=False, custom_generate=speculative_generate, assistant_config=cfg,
                          draft_model=EagleDrafter.from_pretrained("examples/drafters/qwen3_5-small-eagle3"))

- `features`: what is known about a step before verification (`CACHE_FEATURES`, `MODEL_FEATURES`, `History`).
- `merge`: merging two drafts into one tree; the payoff a draft realizes against the committed tokens.
- `cost`: `CostProfile` (seconds of drafting and of verifying a tree of N nodes), `profile_costs`.
- `modeling`: the payoff predictor (`PayoffPredictorConfig`, `PayoffPredictor`: a Hub model).
- `policy`: `ThresholdPolicy` (SuffixDecoding's gate), `LearnedPolicy` (HVD), `OraclePolicy` / `ReplayPolicy`
  (benchmark only), `CollectPolicy` (label collection).
- `drafter`: `HybridDrafter`, the `Drafter` that runs a policy inside `speculative_generate`; `StepRecord`.
- `workloads`: the agentic workload suite (multi-call sessions, code edits, tool-call transcripts, plain code).
- `metrics`: MAE, Spearman rank correlation and calibration of predicted payoffs.
- `bench`: `python -m hf_hybrid_spec.hvd.bench`, the benchmark of suffix / model / threshold / HVD / oracle.
"""

from .cost import CostProfile, profile_costs
from .drafter import HybridDrafter, StepRecord, make_hvd_drafter
from .features import CACHE_FEATURES, FEATURE_NAMES, MODEL_FEATURES, History
from .merge import MergedDraft, merge_drafts, realized_payoff
from .modeling import HEADS, PayoffPredictor, PayoffPredictorConfig
from .policy import CollectPolicy, LearnedPolicy, OraclePolicy, Policy, ReplayPolicy, ThresholdPolicy

__all__ = [
    "HybridDrafter",
    "StepRecord",
    "make_hvd_drafter",
    "CostProfile",
    "profile_costs",
    "PayoffPredictor",
    "PayoffPredictorConfig",
    "HEADS",
    "Policy",
    "ThresholdPolicy",
    "LearnedPolicy",
    "OraclePolicy",
    "ReplayPolicy",
    "CollectPolicy",
    "merge_drafts",
    "MergedDraft",
    "realized_payoff",
    "FEATURE_NAMES",
    "CACHE_FEATURES",
    "MODEL_FEATURES",
    "History",
]
