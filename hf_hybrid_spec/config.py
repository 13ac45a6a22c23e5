"""AssistantConfig: how `speculative_generate` drafts and verifies.

A dataclass validated on construction, with a JSON round trip (`save_pretrained` / `from_pretrained`) so a
tuned configuration can live in a Hub repository next to a drafter checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field

__all__ = ["AssistantConfig", "DRAFTERS", "VERIFICATIONS", "CONFIG_NAME"]

CONFIG_NAME = "assistant_config.json"

# Drafters `speculative_generate` knows; `model` drafts with `draft_model=` (any causal LM, same tokenizer).
DRAFTERS = ("suffix", "ngram", "model")
# EAGLE-3 drafter (issue #4): `draft_model=` an `hf_hybrid_spec.eagle.EagleDrafter` trained for the target.
DRAFTERS = DRAFTERS + ("eagle",)
VERIFICATIONS = ("lossless",)
# Lossy, opt-in verification (issue #9, hf_hybrid_spec.cospec): an arbiter may keep the draft's token at a mismatch.
VERIFICATIONS = VERIFICATIONS + ("cospec", "fly", "typical")
KERNEL_BACKENDS = ("auto", "triton", "torch", "naive")
# Self-speculative drafters (issue #5): the target's own SSM pathway or first layers.
DRAFTERS = DRAFTERS + ("self_ssm", "layerskip")
# How `drafter="self_ssm"` suppresses attention; hf_hybrid_spec.models.base.SSM_VARIANTS documents each.
SSM_VARIANTS = ("zero_attention", "rescale_ssm", "skip_layer")
# Hybrid Verified Decoding (issue #6, hf_hybrid_spec.hvd): per step, the cache draft, the model draft or both.
DRAFTERS = DRAFTERS + ("hvd",)
HVD_POLICIES = ("learned", "threshold")


@dataclass
class AssistantConfig:
    """Configuration of speculative decoding.

    Tree budget:
        max_draft_tokens: most draft nodes verified per target forward (the root comes on top).
        max_depth: deepest draft node below the root; also bounds the tokens one forward can commit
            (max_depth + 1 with the bonus token).

    Suffix drafter (SuffixDecoding; `drafter="suffix"`):
        max_spec_factor, max_spec_offset: a match of length m drafts at most m * factor + offset tokens.
        min_token_prob: stop extending a branch once its path probability (product of child frequencies
            over parent frequencies) falls below this.
        max_match_length: longest context suffix matched against the trees (also the depth of the trees).
        global_cache: also draft from a process-wide tree over earlier generations.
        max_cached_outputs: how many earlier generations the process-wide tree keeps (oldest evicted).
        tree: emit branching trees; False keeps only the most probable chain.

    N-gram drafter (prompt lookup; `drafter="ngram"`):
        ngram_size: longest n-gram matched against the context (shorter ones are tried after it).
        (drafts `max_draft_tokens` tokens as one chain)

    Model drafter (`drafter="model"`, with `draft_model=` passed to generate):
        draft_top_k: children expanded per drafted node; 1 drafts a chain, k > 1 a tree (EAGLE-2 style,
            best `max_draft_tokens` nodes by path probability).

    Self-speculative drafters (the target's own weights, no extra parameters; `draft_top_k` and the tree
    budget apply as for the model drafter: a chain of `max_depth` tokens, or a top-k tree):
        ssm_variant: `drafter="self_ssm"`: "zero_attention" (attention modules output zeros), "rescale_ssm"
            (parallel hybrids: also multiply the SSM branch by `ssm_scale`) or "skip_layer" (sequential
            hybrids: layers holding attention pass the residual through, MLP skipped).
        ssm_scale: the SSM branch multiplier of "rescale_ssm".
        exit_layer: `drafter="layerskip"`: draft with the first `exit_layer` decoder layers, then the final
            norm and head (required there; 1 <= exit_layer < number of layers, checked against the model).

    EAGLE-3 drafter (`drafter="eagle"`, with `draft_model=EagleDrafter.from_pretrained(...)`): an EAGLE-2
    dynamic tree; `max_draft_tokens` is the tree size (60 in EAGLE-2), `max_depth` its depth and
    `draft_top_k` the children per expanded node (1 drafts a chain).

    Verification:
        verification: "lossless" (greedy: identical to plain greedy; sampling: exactly the target's
            distribution).
        kernel_backend: "auto" (Triton on CUDA, closed-form PyTorch on CPU), "triton", "torch" or "naive".

    Static shapes and CUDA graphs (`hf_hybrid_spec.static`):
        compile: verify with a static cache and fixed tree sizes, each verify forward captured once as a CUDA graph
            and replayed (on CPU the same static code runs eagerly). Also turned on by
            `generate(..., cache_implementation="static")`.
        compile_buckets: tree sizes (root included) captured; a tree is padded to the smallest that fits and the
            draft budget is capped at the largest minus one.
        compile_drafter: with `compile`, also compile the EAGLE drafter's passes with Inductor (before they are
            captured on a GPU: a 60-node tree drafts in 1.25 ms instead of 2.0 on the H200; on CPU the compiled
            passes run as they are, ~20-30% less drafting time). Costs ~20 s of compiling per pass (the tree
            expansion for the request's full budget, the accept pass) once per process and drafter, so it is off by
            default: turn it on for a server that keeps the process.
        compile_verify: with `compile`, also compile the target's pure regions inside the verify forward with
            Inductor (`hf_hybrid_spec.fusion`: the RMSNorms, gated norms, MLPs and the mixers' gate math become
            fused kernels before the forward is captured), run each layer's independent projections side by side
            (`fusion.parallel_linears`) and its attention on our tree-attention kernel (`models.tree_attention`):
            the 8-node verify of a 2B Qwen3.5 shape went from 4.9 to 2.5 ms on an H200 (2.7x its weight-read
            floor), qwen3_5-small's from 1.25 to 0.56. Numerics are a compiled model's (fused reductions and another
            attention kernel round differently in the last bits, as stock static+compile's do), and it costs a few
            Inductor compiles per process (one per module class, all tree sizes): opt-in. It pays on a GPU; on a
            CPU (no graphs) the compiled regions are not faster at these sizes (dynamo's guards run every step).

    Lossy verification (opt-in, greedy only; `hf_hybrid_spec.cospec`): where the draft's own choice differs from
    the target's, an arbiter decides which token is kept (`spec_stats.arbiter_overrides` counts the draft's):
        verification="cospec": a learned arbiter, `arbiter=` the directory / Hub id of a saved `CoSpecArbiter`
            (or any `hf_hybrid_spec.cospec.Arbiter` instance); needs `drafter="model"`.
        verification="fly": FLy's training-free gate: keep the draft's token where the target's top-3 entropy is
            >= `fly_entropy_threshold` and the target then accepts the next `fly_window - 1` draft tokens.
        verification="typical": Medusa's typical acceptance: keep it where the target's probability of it (at
            `typical_temperature`) exceeds min(`typical_epsilon`, `typical_delta` * exp(-entropy)).

    Hybrid Verified Decoding (`drafter="hvd"`, with `draft_model=` an `EagleDrafter` or an assistant causal LM;
    `hf_hybrid_spec.hvd`): each step the suffix drafter (the settings above) proposes a cache draft, and a policy
    verifies it, the model drafter's draft (`draft_top_k` as for "eagle" / "model"), or one tree merging both
    (trimmed to `max_draft_tokens`); the model drafter is skipped on steps where the cache draft wins anyway:
        hvd_policy: "learned" (a payoff predictor and the profiled cost per step pick the option with the most
            tokens per second) or "threshold" (SuffixDecoding's gate: the cache draft iff its score >= `hvd_threshold`).
        hvd_predictor: "learned": the directory / Hub id of a saved `hf_hybrid_spec.hvd.PayoffPredictor`.
        hvd_threshold: "threshold": the score (sum of the cache draft's path probabilities) that selects it.
        hvd_model_tokens / hvd_model_depth: nodes and depth of the model drafter's tree (at most `max_draft_tokens`
            and `max_depth`, which bound the cache draft and the verified tree).
        hvd_merge: whether the learned policy may verify one merged tree.
        hvd_probe_budget: "learned": the share of decoding time that runs of the model drafter against the policy's
            prediction (probes, which keep its recent-payoff estimate current) may take; 0 never probes.
        hvd_cost_profile: a JSON file of `hf_hybrid_spec.hvd.CostProfile`: loaded when it exists, else written after
            profiling; None profiles on first use (once per process, target and model drafter).
    """

    drafter: str = "suffix"
    max_draft_tokens: int = 24
    max_depth: int = 8
    # suffix drafter
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_match_length: int = 32
    global_cache: bool = True
    max_cached_outputs: int = 256
    tree: bool = True
    # n-gram drafter
    ngram_size: int = 3
    # model drafter
    draft_top_k: int = 1
    # self-speculative drafters
    ssm_variant: str = "zero_attention"
    ssm_scale: float = 1.5
    exit_layer: int | None = None
    # verification
    verification: str = "lossless"
    kernel_backend: str = "auto"
    extra: dict = field(default_factory=dict)
    # static shapes / CUDA graphs (issue #8)
    compile: bool = False
    compile_buckets: tuple[int, ...] = (8, 16, 32, 64)
    compile_drafter: bool = False
    compile_verify: bool = False
    # lossy verification (issue #9): read only when verification != "lossless"
    arbiter: object = None  # "cospec": a saved CoSpecArbiter (directory or Hub id) or an Arbiter instance
    fly_entropy_threshold: float = 0.3  # FLy's gate (top-3 entropy of the target, nats)
    fly_window: int = 6  # FLy's deferred window: the mismatch plus this many - 1 exactly accepted tokens
    typical_epsilon: float = 0.09  # Medusa's posterior_threshold
    typical_delta: float = 0.3  # Medusa's posterior_alpha
    typical_temperature: float = 0.7
    # Hybrid Verified Decoding (issue #6): read only when drafter == "hvd"
    hvd_policy: str = "learned"
    hvd_predictor: str | None = None  # a saved PayoffPredictor (directory or Hub id)
    hvd_threshold: float = 2.0
    hvd_model_tokens: int = 24
    hvd_model_depth: int = 6
    hvd_merge: bool = True
    hvd_probe_budget: float = 0.05
    hvd_cost_profile: str | None = None

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS}, got {self.verification!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        for name in ("max_draft_tokens", "max_depth", "max_match_length", "ngram_size", "draft_top_k",
                     "max_cached_outputs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in (0, 1], got {self.min_token_prob!r}")
        if self.max_spec_factor < 0 or self.max_spec_offset < -self.max_match_length:
            raise ValueError("max_spec_factor must be >= 0 and max_spec_offset > -max_match_length")
        for name in ("global_cache", "tree"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.extra, dict):
            raise ValueError("extra must be a dict")
        for name in ("compile", "compile_drafter", "compile_verify"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        buckets = tuple(self.compile_buckets)
        if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 128 for b in buckets):
            raise ValueError(f"compile_buckets must be integers in [2, 128], got {self.compile_buckets!r}")
        self.compile_buckets = tuple(sorted(set(buckets)))
        if self.ssm_variant not in SSM_VARIANTS:
            raise ValueError(f"ssm_variant must be one of {SSM_VARIANTS}, got {self.ssm_variant!r}")
        if isinstance(self.ssm_scale, bool) or not isinstance(self.ssm_scale, (int, float)) or not self.ssm_scale > 0:
            raise ValueError(f"ssm_scale must be a positive number, got {self.ssm_scale!r}")
        if self.exit_layer is not None and (
            isinstance(self.exit_layer, bool) or not isinstance(self.exit_layer, int) or self.exit_layer < 1
        ):
            raise ValueError(f"exit_layer must be a positive integer, got {self.exit_layer!r}")
        if self.drafter == "layerskip" and self.exit_layer is None:
            raise ValueError("drafter='layerskip' needs exit_layer= (how many decoder layers draft)")
        self._validate_lossy()
        self._validate_hvd()

    def _validate_lossy(self) -> None:
        """Checks of the lossy-verification fields (issue #9)."""
        if self.verification == "cospec" and self.arbiter is None:
            raise ValueError("verification='cospec' needs arbiter= (a saved CoSpecArbiter's directory or Hub id, "
                             "or an hf_hybrid_spec.cospec.Arbiter)")
        if self.arbiter is not None and self.verification != "cospec":
            raise ValueError(f"arbiter= is only used with verification='cospec', not {self.verification!r}")
        if self.arbiter is not None and not isinstance(self.arbiter, (str, os.PathLike)) and not callable(
            getattr(self.arbiter, "decide", None)
        ):
            raise ValueError(f"arbiter must be a path / Hub id or an Arbiter (with .decide), got {self.arbiter!r}")
        if isinstance(self.fly_window, bool) or not isinstance(self.fly_window, int) or self.fly_window < 1:
            raise ValueError(f"fly_window must be a positive integer, got {self.fly_window!r}")
        if not self.fly_entropy_threshold >= 0:
            raise ValueError(f"fly_entropy_threshold must be >= 0, got {self.fly_entropy_threshold!r}")
        if not 0 < self.typical_epsilon <= 1 or not self.typical_delta > 0 or not self.typical_temperature > 0:
            raise ValueError("typical acceptance needs 0 < typical_epsilon <= 1, typical_delta > 0 and "
                             "typical_temperature > 0")

    def _validate_hvd(self) -> None:
        """Checks of the Hybrid Verified Decoding fields (issue #6)."""
        if self.hvd_policy not in HVD_POLICIES:
            hint = (" (the oracle is benchmark-only: build hf_hybrid_spec.hvd.HybridDrafter with an OraclePolicy)"
                    if self.hvd_policy == "oracle" else "")
            raise ValueError(f"hvd_policy must be one of {HVD_POLICIES}, got {self.hvd_policy!r}{hint}")
        if self.hvd_predictor is not None and not isinstance(self.hvd_predictor, (str, os.PathLike)):
            raise ValueError(f"hvd_predictor must be a directory or Hub id (str), got {type(self.hvd_predictor).__name__}"
                             "; pass an in-memory predictor through hf_hybrid_spec.hvd.HybridDrafter instead")
        if self.drafter == "hvd" and self.hvd_policy == "learned" and self.hvd_predictor is None:
            raise ValueError("drafter='hvd' with hvd_policy='learned' needs hvd_predictor= (a saved PayoffPredictor, "
                             "e.g. examples/payoff/qwen3_5-small), or use hvd_policy='threshold'")
        if isinstance(self.hvd_threshold, bool) or not isinstance(self.hvd_threshold, (int, float)) or \
                not self.hvd_threshold >= 0:
            raise ValueError(f"hvd_threshold must be a number >= 0, got {self.hvd_threshold!r}")
        for name in ("hvd_model_tokens", "hvd_model_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.hvd_probe_budget, bool) or not isinstance(self.hvd_probe_budget, (int, float)) or \
                not 0.0 <= self.hvd_probe_budget <= 1.0:
            raise ValueError(f"hvd_probe_budget must be a number in [0, 1], got {self.hvd_probe_budget!r}")
        if not isinstance(self.hvd_merge, bool):
            raise ValueError(f"hvd_merge must be a bool, got {self.hvd_merge!r}")
        if self.hvd_cost_profile is not None and not isinstance(self.hvd_cost_profile, (str, os.PathLike)):
            raise ValueError(f"hvd_cost_profile must be a path, got {self.hvd_cost_profile!r}")
        # Paths are kept as strings so the config stays JSON.
        for name in ("hvd_predictor", "hvd_cost_profile"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        # An in-memory arbiter (issue #9) is written as the directory / Hub id it was saved to or loaded from.
        shallow = copy.copy(self)
        shallow.arbiter = _arbiter_reference(self.arbiter)
        return dataclasses.asdict(shallow)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> AssistantConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown AssistantConfig fields: {unknown}")
        return cls(**data)

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write `assistant_config.json` into `save_directory` (created if needed); returns the file path."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w") as f:
            f.write(self.to_json_string())
        return path

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, **hub_kwargs) -> AssistantConfig:
        """Load from a directory or JSON file, or from a Hub repository (downloaded through huggingface_hub)."""
        path = os.fspath(path_or_repo_id)
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
        elif not os.path.isfile(path):
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(path, CONFIG_NAME, **hub_kwargs)
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def replace(self, **changes) -> AssistantConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _arbiter_reference(arbiter) -> str | None:
    """The JSON form of `AssistantConfig.arbiter`: a path / Hub id (a saved arbiter's `name_or_path`)."""
    if arbiter is None or isinstance(arbiter, str):
        return arbiter
    if isinstance(arbiter, os.PathLike):
        return os.fspath(arbiter)
    reference = getattr(arbiter, "name_or_path", None)
    if not reference:
        raise ValueError(
            f"cannot serialize the in-memory arbiter {arbiter!r}: save it (arbiter.save_pretrained(dir)) and pass "
            "the directory as arbiter="
        )
    return reference
