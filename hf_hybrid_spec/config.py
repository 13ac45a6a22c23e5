"""AssistantConfig: how `speculative_generate` drafts and verifies.

A dataclass validated on construction, with a JSON round trip (`save_pretrained` / `from_pretrained`) so a
tuned configuration can live in a Hub repository next to a drafter checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from . import registry

__all__ = ["AssistantConfig", "DRAFTERS", "DRAFTER_DEFAULTS", "VERIFICATIONS", "CONFIG_NAME"]

CONFIG_NAME = "assistant_config.json"

# The built-in drafters: `model` drafts with `draft_model=` (any causal LM, same tokenizer), `eagle` with an
# `hf_hybrid_spec.eagle.EagleDrafter`, `mtp` with the target checkpoint's own multi-token-prediction head
# (`hf_hybrid_spec.mtp`; Qwen3.5, Qwen3-Next), `self_ssm` / `layerskip` with the target's own SSM pathway or first
# layers, `hvd` picks per step between the suffix draft and a model draft (`hf_hybrid_spec.hvd`). `drafter=` and
# `verification=` accept every name registered in `hf_hybrid_spec.registry` (these, and any registered since).
DRAFTERS = ("suffix", "ngram", "model", "eagle", "mtp", "self_ssm", "layerskip", "hvd")
# Lossy, opt-in rules (`hf_hybrid_spec.verification.arbitrated`) keep the draft's token at some mismatches.
VERIFICATIONS = ("lossless", "cospec", "fly", "typical")
KERNEL_BACKENDS = ("auto", "triton", "torch", "naive")
# How `drafter="self_ssm"` suppresses attention; hf_hybrid_spec.models.base.SSM_VARIANTS documents each.
SSM_VARIANTS = ("zero_attention", "rescale_ssm", "skip_layer")
HVD_POLICIES = ("learned", "threshold")
BATCH_BUDGETS = ("auto", "calibrated", "fixed")
PREFILLS = ("auto", "eager", "chunked")
# The tree budget a drafter gets when the config leaves it unset: EAGLE-2's dynamic tree for "eagle" (60 nodes, depth
# 6, 10 children per expanded node), a chain of 3 for "mtp" (one MTP layer run recursively: its predictions fade with
# depth, and vLLM and SGLang draft 1-3 tokens with it), a chain of up to 8 tokens from a 24-node budget for the others
# (a cache drafter's tree is shaped by its matches, not by draft_top_k).
DRAFTER_DEFAULTS = {
    "default": dict(max_draft_tokens=24, max_depth=8, draft_top_k=1),
    "eagle": dict(max_draft_tokens=60, max_depth=6, draft_top_k=10),
    "mtp": dict(max_draft_tokens=3, max_depth=3, draft_top_k=1),
}
# Nesting allowed in `extra` (JSON from a file could otherwise nest deep enough to overflow the stack later).
MAX_EXTRA_DEPTH = 8


@dataclass
class AssistantConfig:
    """Configuration of speculative decoding.

    Tree budget (left unset, `max_draft_tokens`, `max_depth` and `draft_top_k` take the drafter's defaults,
    `DRAFTER_DEFAULTS`: 60 / 6 / 10 for "eagle", 3 / 3 / 1 for "mtp", 24 / 8 / 1 for the others;
    `replace(drafter=...)` keeps the numbers a config already holds):
        max_draft_tokens: most draft nodes verified per target forward (the root comes on top).
        max_depth: deepest draft node below the root; also bounds the tokens one forward can commit
            (max_depth + 1 with the bonus token).
        max_verify_nodes: a hard cap on the draft nodes of one verify forward, whatever `max_draft_tokens` asks
            (verification memory and time grow with the tree: a 1,000-node tree takes seconds per step on a CPU);
            a budget above it is capped, and `spec_stats.budget_capped` says so. In a batch the general step caps
            the whole forward (the likeliest nodes across rows); the pipelined step on the captured batched graphs
            caps each row (its rows are padded to one width, whose forward costs the same however few nodes fill it).

    Suffix drafter (SuffixDecoding; `drafter="suffix"`):
        max_spec_factor, max_spec_offset: a match of length m drafts at most m * factor + offset tokens.
        min_token_prob: stop extending a branch once its path probability (product of child frequencies
            over parent frequencies) falls below this.
        max_match_length: longest context suffix matched against the trees (also the depth of the trees).
        global_cache: also draft from a process-wide tree over earlier generations.
        max_cached_outputs: how many earlier generations the process-wide tree keeps (oldest evicted).
        max_cached_tokens: and how many tokens in all (outputs plus the kept tries of finished requests, oldest
            evicted first): the memory bound of the process-wide cache, at most ~100 bytes per token (see
            `docs/benchmarks.md`, "Suffix cache memory").
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

    Static shapes and CUDA graphs (`hf_hybrid_spec.engine.static`):
        compile: True verifies with a static cache and fixed tree sizes, each verify forward captured once as a CUDA
            graph and replayed (on CPU the same static code runs eagerly); False verifies eagerly (dynamic cache,
            every kernel launched from Python); "auto" (the default) is True for a model on one CUDA device, unless
            the call asks for attentions or hidden states (eager only), and False elsewhere (on a CPU eager is the
            faster path). Also turned on by `generate(..., cache_implementation="static")`.
        compile_buckets: tree sizes (root included) captured; a tree is padded to the smallest that fits and the
            draft budget is capped at the largest minus one.
        compile_drafter: with `compile`, also compile the EAGLE (or MTP) drafter's passes with Inductor (before they
            are captured on a GPU; on CPU the compiled passes run as they are; docs/benchmarks.md, "EAGLE-3 drafters").
            Costs an Inductor compile of seconds per pass (the tree expansion for the request's full budget, the accept
            pass) once per process and drafter, so it is off by default: turn it on for a server that keeps the process.
        compile_verify: with `compile`, also compile the target's pure regions inside the verify forward with
            Inductor (`hf_hybrid_spec.fusion`: the RMSNorms, gated norms, MLPs and the mixers' gate math become
            fused kernels before the forward is captured), run each layer's independent projections side by side
            (`fusion.parallel_linears`) and its attention on our tree-attention kernel (`models.tree_attention`):
            about half the verify forward's time on a GPU, and a batch's plain decode step (what the budget falls
            back to) faster than stock static+compile's (docs/compile.md, docs/benchmarks.md "Batches"). "auto"
            (the default) is True where
            `compile` resolves to True on a CUDA device and False elsewhere: on a CPU (no graphs) the compiled
            regions are not faster at these sizes (dynamo's guards run every step). Numerics are a compiled
            model's (fused reductions and another attention kernel round differently in the last bits, as stock
            static+compile's do), and the first call of a process pays a few Inductor compiles (one per module
            class, all tree sizes), as stock static+compile's first call does; False skips them.

    Batches (B > 1 left-padded prompts; `hf_hybrid_spec.engine.budget`):
        batch_budget: "auto" (the default): on CUDA, a batch-wide budget calibrated to the verify forward on the
            machine (once per process, batch size and context length): each step keeps the draft nodes, across the
            batch and by path probability, that maximize expected committed tokens per second, and none when a plain
            decode step is faster (a large batch); and what drafting steps commit per second is measured against
            plain steps, which run without the drafter while drafting does not pay (probed again after runs that
            double; drafters that follow the committed tokens alone, `Drafter.catches_up`, and EAGLE / MTP
            batches); elsewhere as "fixed". "calibrated": that budget on any device.
            "fixed": every row drafts up to `max_draft_tokens`, and a forward verifies at most `max_verify_nodes`
            (the likeliest nodes across the batch when the rows ask for more).
        budget_slack: how much more expected tokens per second than a plain decode step the budget asks of drafts
            before it verifies any (0.05: 5%), a margin for the cost model's error.
        prefill: on the static path, how the prompt goes in. "chunked": each prompt as chains through the captured
            verify forward, 64 tokens at a time (a bucket of its own, not one drafts use), from an empty state (no
            padding in the cache): replays instead of an eager forward whose kernel launches can cost more than a
            short generation's steps. "eager": the prompt in one forward of the model (a batch's left-padded), as
            stock generate runs it. "auto" (the default): chunked for prompts of at most 512 tokens and 16384 in
            the call (rows x padded length), else eager (the bounds: `engine.backend`, docs/batching.md
            "Prompts"). At batch size 1, a call
            that continues a cache or has padding, multimodal inputs or asks for the prompt's attentions prefills
            eagerly.

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
        hvd_cost_profile: a JSON file of `hf_hybrid_spec.hvd.CostProfile` to load (read only: it must exist); None
            profiles on first use (once per process, target and model drafter) and keeps the profile in memory.
            The library never writes to a path a config names (a downloaded config must not choose where files
            go): save a profile yourself with `CostProfile.save`.
    """

    drafter: str = "suffix"
    max_draft_tokens: int | None = None  # None: the drafter's default (DRAFTER_DEFAULTS)
    max_depth: int | None = None
    max_verify_nodes: int = 256
    # suffix drafter
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_match_length: int = 32
    global_cache: bool = True
    max_cached_outputs: int = 256
    max_cached_tokens: int = 2_000_000
    tree: bool = True
    # n-gram drafter
    ngram_size: int = 3
    # model drafter
    draft_top_k: int | None = None
    # self-speculative drafters
    ssm_variant: str = "zero_attention"
    ssm_scale: float = 1.5
    exit_layer: int | None = None
    # verification
    verification: str = "lossless"
    kernel_backend: str = "auto"
    extra: dict = field(default_factory=dict)
    # static shapes / CUDA graphs
    compile: bool | str = "auto"
    compile_buckets: tuple[int, ...] = (8, 16, 32, 64)
    compile_drafter: bool = False
    compile_verify: bool | str = "auto"
    # batches
    batch_budget: str = "auto"
    budget_slack: float = 0.05
    prefill: str = "auto"
    # lossy verification: read only when verification != "lossless"
    arbiter: object = None  # "cospec": a saved CoSpecArbiter (directory or Hub id) or an Arbiter instance
    fly_entropy_threshold: float = 0.3  # FLy's gate (top-3 entropy of the target, nats)
    fly_window: int = 6  # FLy's deferred window: the mismatch plus this many - 1 exactly accepted tokens
    typical_epsilon: float = 0.09  # Medusa's posterior_threshold
    typical_delta: float = 0.3  # Medusa's posterior_alpha
    typical_temperature: float = 0.7
    # Hybrid Verified Decoding: read only when drafter == "hvd"
    hvd_policy: str = "learned"
    hvd_predictor: str | None = None  # a saved PayoffPredictor (directory or Hub id)
    hvd_threshold: float = 2.0
    hvd_model_tokens: int = 24
    hvd_model_depth: int = 6
    hvd_merge: bool = True
    hvd_probe_budget: float = 0.05
    hvd_cost_profile: str | None = None

    def __post_init__(self):
        # The tree budget left unset takes the drafter's defaults, once, here: the stored config holds numbers.
        for name, value in DRAFTER_DEFAULTS.get(self.drafter, DRAFTER_DEFAULTS["default"]).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.hvd_policy == "oracle":
            self._validate_hvd()  # its own message
        for name, choices in (("drafter", registry.DRAFTERS.names()), ("verification", registry.VERIFICATIONS.names()),
                              *_CHOICES.items()):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in _POSITIVE_INTS:
            _check_int(name, getattr(self, name))
        if self.exit_layer is not None:
            _check_int("exit_layer", self.exit_layer)
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("compile", "compile_verify"):
            if not isinstance(getattr(self, name), bool) and getattr(self, name) != "auto":
                raise ValueError(f"{name} must be True, False or 'auto', got {getattr(self, name)!r}")
        for name, (low, high, low_open) in _NUMBERS.items():
            setattr(self, name, _check_number(name, getattr(self, name), low, high, low_open))
        if not self.max_spec_offset > -self.max_match_length:
            raise ValueError(f"max_spec_offset must be > -max_match_length ({-self.max_match_length}), got "
                             f"{self.max_spec_offset!r}")
        _check_json_value("extra", self.extra, dict)
        buckets = self.compile_buckets
        if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (tuple, list)) or not buckets or any(
            isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 128 for b in buckets
        ):
            raise ValueError(f"compile_buckets must be a non-empty list of integers in [2, 128], got {buckets!r}")
        self.compile_buckets = tuple(sorted(set(buckets)))
        if self.drafter == "layerskip" and self.exit_layer is None:
            raise ValueError("drafter='layerskip' needs exit_layer= (how many decoder layers draft)")
        self._validate_lossy()
        self._validate_hvd()

    def _validate_lossy(self) -> None:
        """Checks of the lossy-verification fields."""
        if self.verification == "cospec" and self.arbiter is None:
            raise ValueError("verification='cospec' needs arbiter= (a saved CoSpecArbiter's directory or Hub id, "
                             "or an hf_hybrid_spec.cospec.Arbiter)")
        if self.arbiter is not None and self.verification != "cospec":
            raise ValueError(f"arbiter= is only used with verification='cospec', not {self.verification!r}")
        if self.arbiter is not None and not isinstance(self.arbiter, (str, os.PathLike)) and not callable(
            getattr(self.arbiter, "decide", None)
        ):
            raise ValueError(f"arbiter must be a path / Hub id or an Arbiter (with .decide), got {self.arbiter!r}")
        if isinstance(self.arbiter, os.PathLike):
            self.arbiter = os.fspath(self.arbiter)

    def _validate_hvd(self) -> None:
        """Checks of the Hybrid Verified Decoding fields."""
        if self.hvd_policy == "oracle":
            raise ValueError("hvd_policy='oracle' is benchmark-only: build hf_hybrid_spec.hvd.HybridDrafter with an "
                             f"OraclePolicy (hvd_policy must be one of {HVD_POLICIES})")
        for name in ("hvd_predictor", "hvd_cost_profile"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path (str), got {type(value).__name__}"
                                 + ("; pass an in-memory predictor through hf_hybrid_spec.hvd.HybridDrafter instead"
                                    if name == "hvd_predictor" else ""))
            # Paths are kept as strings so the config stays JSON.
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
        if self.drafter == "hvd" and self.hvd_policy == "learned" and self.hvd_predictor is None:
            raise ValueError("drafter='hvd' with hvd_policy='learned' needs hvd_predictor= (a saved PayoffPredictor, "
                             "e.g. checkpoints/payoff/qwen3_5-small), or use hvd_policy='threshold'")

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        # An in-memory arbiter is written as the directory / Hub id it was saved to or loaded from.
        shallow = copy.copy(self)
        shallow.arbiter = _arbiter_reference(self.arbiter)
        return dataclasses.asdict(shallow)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> AssistantConfig:
        if not isinstance(data, dict):
            raise ValueError(f"an AssistantConfig is a JSON object of fields, got {type(data).__name__}")
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
        """Load from a directory or JSON file, or from a Hub repository (downloaded through huggingface_hub).

        A local path that does not exist raises FileNotFoundError at once; a file that is not a valid config
        raises ValueError."""
        from .hub import resolve_source

        path = resolve_source(path_or_repo_id, "assistant config")
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"assistant config: no {CONFIG_NAME} in {os.fspath(path_or_repo_id)!r}")
        elif not os.path.isfile(path):
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(path, CONFIG_NAME, **hub_kwargs)
        try:
            with open(path) as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise ValueError(f"{path} is not a valid {CONFIG_NAME} ({type(err).__name__}: {err})") from None
        return cls.from_dict(data)

    def replace(self, **changes) -> AssistantConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

# ---------------------------------------------------------------------- validation tables
# Fixed choices; drafter and verification names are checked against their registries.
_CHOICES = {"kernel_backend": KERNEL_BACKENDS, "ssm_variant": SSM_VARIANTS, "hvd_policy": HVD_POLICIES,
            "batch_budget": BATCH_BUDGETS, "prefill": PREFILLS}
_POSITIVE_INTS = ("max_draft_tokens", "max_depth", "max_verify_nodes", "max_match_length", "max_cached_outputs",
                  "max_cached_tokens", "ngram_size", "draft_top_k", "fly_window", "hvd_model_tokens", "hvd_model_depth")
_BOOLS = ("global_cache", "tree", "compile_drafter", "hvd_merge")
# name -> (low, high, low is open); every number must also be finite.
_NUMBERS = {
    "max_spec_factor": (0.0, None, False),
    "max_spec_offset": (None, None, False),  # and > -max_match_length, checked after
    "min_token_prob": (0.0, 1.0, True),
    "ssm_scale": (0.0, None, True),
    "fly_entropy_threshold": (0.0, None, False),
    "typical_epsilon": (0.0, 1.0, True),
    "typical_delta": (0.0, None, True),
    "typical_temperature": (0.0, None, True),
    "hvd_threshold": (0.0, None, False),
    "hvd_probe_budget": (0.0, 1.0, False),
    "budget_slack": (0.0, None, False),
}


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_number(name: str, value, low: float | None, high: float | None, low_open: bool) -> float:
    """`value` if it is a real number (not a bool, string or None), finite and within the bounds, else ValueError."""
    if low == 0.0 and low_open and high is None:
        wanted = "a positive number"
    elif low is not None and high is not None:
        wanted = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    elif low is not None:
        wanted = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        wanted = "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite ({wanted}), got {value!r}")
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return value


def _check_json_value(name: str, value, kind: type | None = None, depth: int = 0) -> None:
    """ValueError unless `value` (of type `kind` when given) is plain JSON nested at most MAX_EXTRA_DEPTH deep."""
    if kind is not None and not isinstance(value, kind):
        raise ValueError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    if depth > MAX_EXTRA_DEPTH:
        raise ValueError(f"{name} nests deeper than {MAX_EXTRA_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{name} keys must be strings, got {key!r}")
            _check_json_value(f"{name}[{key!r}]", item, None, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json_value(f"{name}[{i}]", item, None, depth + 1)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{name} must hold JSON values only, got {type(value).__name__}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must hold finite numbers only, got {value!r}")


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
