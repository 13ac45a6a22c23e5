"""Hybrid Verified Decoding (arXiv 2606.01019): per step, verify the cache draft, the model draft or both.

    from hf_hybrid_spec import AssistantConfig, speculative_generate
    from hf_hybrid_spec.eagle import EagleDrafter

    cfg = AssistantConfig(drafter="hvd", hvd_policy="learned", hvd_predictor="checkpoints/payoff/qwen3_5-small",
                          max_draft_tokens=48, max_depth=6, draft_top_k=8, hvd_model_tokens=32)
    out = target.generate(**inputs, do_sample=False, custom_generate=speculative_generate, assistant_config=cfg,
                          draft_model=EagleDrafter.from_pretrained("checkpoints/drafters/qwen3_5-small-eagle3"))

- `features`: what is known about a step before verification (`CACHE_FEATURES`, `MODEL_FEATURES`, `History`).
- `merge`: merging two drafts into one tree; the payoff a draft realizes against the committed tokens.
- `cost`: `CostProfile` (seconds of drafting and of verifying a tree of N nodes); `profiling.profile_costs` measures
  one through the decoding loop.
- `modeling`: the payoff predictor (`PayoffPredictorConfig`, `PayoffPredictor`: a Hub model).
- `policy`: `ThresholdPolicy` (SuffixDecoding's gate), `LearnedPolicy` (HVD), `OraclePolicy` / `ReplayPolicy`
  (benchmark only), `CollectPolicy` (label collection).
- `drafter`: `HybridDrafter`, the `Drafter` that runs a policy inside `speculative_generate`; `StepRecord`.
- `factory`: the drafter `AssistantConfig(drafter="hvd")` builds (registered as "hvd").
- `metrics`: MAE, Spearman rank correlation and calibration of predicted payoffs.

The agentic workload suite and the benchmark of suffix / model / threshold / HVD / oracle are in `benchmarks/`
(`workloads.py`, `hvd_bench.py`). Names are imported on first use.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "HybridDrafter": "drafter", "StepRecord": "drafter", "make_hvd_drafter": "factory", "CostProfile": "cost",
    "profile_costs": "profiling", "PayoffPredictor": "modeling", "PayoffPredictorConfig": "modeling",
    "HEADS": "modeling", "Policy": "policy", "ThresholdPolicy": "policy", "LearnedPolicy": "policy",
    "OraclePolicy": "policy", "ReplayPolicy": "policy", "CollectPolicy": "policy", "merge_drafts": "merge",
    "MergedDraft": "merge", "realized_payoff": "merge", "FEATURE_NAMES": "features", "CACHE_FEATURES": "features",
    "MODEL_FEATURES": "features", "History": "features",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
