"""`HybridDrafter`: Hybrid Verified Decoding as a `Drafter` inside `speculative_generate`.

Per step (one `propose`):

    cache = cache_drafter.propose(...)                     # SuffixDecoding draft: cheap, always made
    features = cache_features(cache, history, position)
    if policy.before_model(...) == "cache": verify cache   # the model drafter's work is skipped this step
    else:
        model = model_drafter.propose(...)                 # EAGLE-3 tree, or an assistant model's chain / tree
        merged = merge_drafts(cache, model)                # union of root paths, trimmed to the budget
        verify one of cache / model / merged               # policy.choose(...)

The model drafter begins (EAGLE: one drafter pass over the prompt) only when the policy first asks it for a draft.
`accept` hands the committed tokens to the cache drafter at once and to the model drafter lazily: the model
drafter's accepts (tokens and the target's hidden states) are buffered and handed over as ONE accept covering every
token committed since it last heard, right before it next proposes (hidden states concatenated in token order, the
result a chain of the committed tokens). So a skipped step costs the model drafter nothing, and when it runs again it
catches up in one batched step: EAGLE advances its key/value steps over all the buffered tokens in one forward, and
the assistant-model drafter feeds its cache the tokens it missed. Neither is ever out of step. `accept` also
measures what each proposed draft realized against the committed tokens (`merge.realized_payoff`), updates
the request's `History`, and, with `record=True`, appends a `StepRecord` (the features and the realized payoffs:
the training labels of the payoff predictor, see `CollectPolicy`).

Most agentic steps take a fast path: where the policy can tell from the cache draft's size alone that it wins at
any payoff (`Policy.quick_cache`, a memo), no `Step` is built and the cache draft is returned as its drafter built
it; at that step's `accept` only the model drafter's part of the `History` is updated (what the next fast path
reads), and the cache draft's realized payoff is measured in `overlap`, while the GPU runs the next verify forward
(or, outside the loop, before anything reads it). On a GPU the host's per-step work is what HVD adds to a step.

The decoding loop is untouched: verification is the loop's own, so greedy output is identical to plain greedy
decoding whatever the policy picks, and sampling stays lossless (every draft is deterministic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..drafters.base import DraftBudget, DraftContext, Drafter, TargetHidden
from ..tree import DraftTree, VerifyResult, empty_draft
from .cost import CostProfile
from .features import CACHE_FEATURES, History, cache_features, model_features, tree_shape
from .merge import MergedDraft, merge_drafts, realized_payoff
from .policy import OPTIONS, Policy, Step

logger = logging.get_logger(__name__)

_NO_MODEL = model_features(None, 0)  # the model part of the features before the model drafter runs

__all__ = ["HybridDrafter", "StepRecord"]


@dataclass
class StepRecord:
    """One HVD step, as `HybridDrafter(record=True)` saw it.

    Attributes:
        features: `FEATURE_NAMES` values at decision time (the model part is 0 when the model drafter did not run).
        option: what was verified: "cache", "model" or "merged".
        model_ran: whether the model drafter proposed.
        nodes: draft nodes of the cache draft, the model draft (0 when it did not run) and the verified tree.
        predicted: the policy's predicted payoffs (cache, model, merged), NaN where it predicted none.
        realized: accepted draft tokens each option had (cache, model, merged) against the committed tokens; NaN
            where the option was not proposed or the value is only a lower bound (an unverified draft that matched
            every committed token: its true payoff may be larger).
        accepted: draft tokens the verification accepted this step.
        position: tokens generated before this step.
    """

    features: list[float]
    option: str
    model_ran: bool
    nodes: tuple[int, int, int]
    predicted: list[float]
    realized: list[float]
    accepted: int
    position: int


@dataclass(slots=True)
class _Pending:
    """A proposed step, settled at the next `accept`."""

    cache: DraftTree
    model: DraftTree | None
    merged: MergedDraft | None
    option: str
    features: list[float] | None  # None when the policy decided without them and nothing is recorded
    predicted: list[float] | None  # None: nothing predicted (NaN in the record)
    position: int


class HybridDrafter(Drafter):
    """Cache draft, model draft or both, per step (see the module docstring). One instance per request.

    Args:
        cache_drafter: the cache drafter (a `SuffixDrafter`; any drafter whose trees carry path scores works).
        model_drafter: the model drafter (`EagleTreeDrafter`, `ModelDrafter`, ...).
        policy: a `Policy` instance (`ThresholdPolicy`, `LearnedPolicy`, ...).
        cost: the profiled `CostProfile` (policies that weigh costs need it; None for the others).
        model_tokens / model_depth: node budget and depth of the model drafter's tree (capped by the step's budget).
        cache_tokens: node budget of the cache draft (None: the step's budget). Label collection verifies merged
            trees in full with a larger step budget, and keeps the cache draft at its deployed size with this.
        allow_merge: whether the policy may verify a merged tree.
        record: keep a `StepRecord` per step in `records`.
        history_alpha / model_prior: the history's moving-average weight, and the model drafter's payoff assumed
            before it has run.
    """

    name = "hvd"
    respects_budget = True  # every tree it returns is trimmed to the step's budget in `propose`
    # In a batch, one per row: each row chooses its own draft by its own history, with the cost profile of one request
    # (the batch budget then caps what the whole batch verifies).
    per_row = True

    def __init__(self, cache_drafter: Drafter, model_drafter: Drafter, policy: Policy, cost: CostProfile | None = None,
                 model_tokens: int = 24, model_depth: int = 6, cache_tokens: int | None = None,
                 allow_merge: bool = True, record: bool = False, history_alpha: float = 0.3, model_prior: float = 1.0):
        if not isinstance(cache_drafter, Drafter) or not isinstance(model_drafter, Drafter):
            raise TypeError("cache_drafter and model_drafter must be hf_hybrid_spec Drafters")
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be an hf_hybrid_spec.hvd Policy, got {type(policy).__name__}")
        for name, value in (("model_tokens", model_tokens), ("model_depth", model_depth),
                            ("cache_tokens", 1 if cache_tokens is None else cache_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.cache_drafter = cache_drafter
        self.model_drafter = model_drafter
        self.policy = policy
        self.cost = cost
        self.model_tokens = model_tokens
        self.model_depth = model_depth
        self.cache_tokens = cache_tokens
        self.allow_merge = allow_merge
        self.record = record
        self.history_alpha = history_alpha
        self.model_prior = model_prior
        self.target_hidden_layers = tuple(model_drafter.target_hidden_layers)
        self.records: list[StepRecord] = []
        self.options: dict[str, int] = {}
        self.model_runs = 0
        self._reset()

    def _reset(self) -> None:
        self.history = History(alpha=self.history_alpha, model_prior=self.model_prior)
        self._pending: _Pending | None = None
        self._pending_cache: DraftTree | None = None  # the cache draft of a fast-path step, until its accept
        # A fast-path step accepted but not settled: (cache draft, committed tokens, accepted draft tokens).
        self._unsettled: tuple[DraftTree, list[int], int] | None = None
        self._prompt_length = 0
        self._deferred: list[tuple[VerifyResult, TargetHidden | None]] = []
        # The model drafter's begin (EAGLE: a drafter pass over the whole prompt) waits for its first draft: a
        # request served from the cache alone never pays for it.
        self._model_begin: tuple | None = None
        self._model_begun = False

    # ------------------------------------------------------------------ request lifecycle
    def begin(self, input_ids: torch.Tensor, context: DraftContext | None = None,
              hidden: TargetHidden | None = None) -> None:
        self._reset()
        self.records = []
        self.options = {o: 0 for o in OPTIONS}
        self.model_runs = 0
        self._prompt_length = input_ids.shape[1]
        self.policy.begin()
        self.cache_drafter.begin(input_ids, context, None)
        self._model_begin = (input_ids, context, hidden)

    def accept(self, input_ids: torch.Tensor, result: VerifyResult, hidden: TargetHidden | None = None) -> None:
        self.cache_drafter.accept(input_ids, result, None)
        self._deferred.append((result, hidden))
        cache, self._pending_cache = self._pending_cache, None
        if cache is not None:  # a fast-path step: its cache part waits for `overlap` (see the module docstring)
            if self._unsettled is not None:
                self._settle_cache()
            self.history.update_model(None)
            committed = result.token_list if result.token_list is not None else result.tokens.tolist()
            self._unsettled = (cache, committed, len(result.path) - 1)
            return
        pending, self._pending = self._pending, None
        if pending is not None:
            self._settle(pending, result)

    def overlap(self) -> None:
        if self._unsettled is not None:
            self._settle_cache()

    def _settle_cache(self) -> None:
        """The deferred cache part of a fast-path step's history: what its cache draft realized."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is not None:
            cache, committed, accepted = unsettled
            self.history.update_cache(realized_payoff(cache, committed), True, accepted)

    def end(self, input_ids: torch.Tensor) -> None:
        self._settle_cache()
        self._pending_cache = None
        self._deferred = []
        self.cache_drafter.end(input_ids)
        if self._model_begun:
            self.model_drafter.end(input_ids)
        self._model_begin, self._model_begun = None, False

    def release(self) -> None:
        self._pending_cache, self._unsettled, self._deferred = None, None, []
        self._model_begin, self._model_begun = None, False
        self.cache_drafter.release()
        self.model_drafter.release()

    def _catch_up_model(self, input_ids: torch.Tensor) -> None:
        """Begin the model drafter if it has not yet, then hand it the buffered accepts as one (see the module
        docstring)."""
        if not self._model_begun:
            self.model_drafter.begin(*self._model_begin)
            self._model_begin, self._model_begun = None, True
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        if len(deferred) == 1:
            result, hidden = deferred[0]
        else:
            tokens = torch.cat([r.tokens for r, _ in deferred])
            chain = list(range(tokens.shape[0] + 1))
            result = VerifyResult(path=chain, tokens=tokens, score_nodes=chain[:-1])
            # The first accept of a request (the prefill's token) carries no hidden states: the prompt's came at begin.
            parts = [h for _, h in deferred if h is not None]
            hidden = None if not parts else TargetHidden(
                layers=parts[0].layers,
                states=tuple(torch.cat([h.states[i] for h in parts], dim=1) for i in range(len(parts[0].states))),
            )
        self.model_drafter.accept(input_ids, result, hidden)

    # ------------------------------------------------------------------ drafting
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        length = input_ids.shape[1]
        cache_budget = budget if self.cache_tokens is None else DraftBudget(min(self.cache_tokens, budget.max_nodes),
                                                                             budget.max_depth)
        cache = self.cache_drafter.propose(input_ids, cache_budget)
        shape = None  # computed with the features, when a policy reads them
        if not self.cache_drafter.respects_budget or cache.num_nodes > cache_budget.max_nodes:
            shape = tree_shape(cache)
            if shape.depth > budget.max_depth or shape.num_nodes > cache_budget.max_nodes:
                cache = cache.truncate_depth(budget.max_depth)
                if cache.num_nodes > cache_budget.max_nodes:
                    cache = cache.select(torch.arange(cache_budget.max_nodes, device=cache.tokens.device))
                shape = tree_shape(cache)
        position = length - self._prompt_length
        history, prompt_length = self.history, self._prompt_length
        model_tokens = min(self.model_tokens, budget.max_nodes)
        if not self.record and self.policy.quick_cache(cache.num_nodes, history, self.cost, budget, model_tokens,
                                                       self.allow_merge, self._model_begun, length):
            # Most agentic steps: the cache draft wins whatever its features say (HVD's whole per-step cost there
            # is this branch, a fraction of a pass through the `Step` below).
            self.options["cache"] = self.options.get("cache", 0) + 1
            self._pending_cache = cache
            if cache.probs is None and cache.next_probs is None:
                return cache  # deterministic as built (a cache draft's info names its own drafter)
            return self._chosen(cache, "cache", input_ids)
        self._settle_cache()  # the policy reads the whole history from here on
        # Computed on first read (policies that can decide without them never pay for them), or for the record.
        step = Step(cache=cache, features=None, history=history, cost=self.cost, budget=budget,
                    model_tokens=model_tokens, length=length,
                    allow_merge=self.allow_merge, model_begun=self._model_begun,
                    feature_fn=lambda: cache_features(cache, history, prompt_length, position, shape) + _NO_MODEL)
        if self.record:
            step.get_features()
        model = merged = None
        option = self.policy.before_model(step)
        if option != "cache":
            model_budget = DraftBudget(max_nodes=step.model_tokens, max_depth=min(self.model_depth, budget.max_depth))
            self._catch_up_model(input_ids)
            model = self.model_drafter.propose(input_ids, model_budget).truncate_depth(model_budget.max_depth)
            if model.num_nodes > model_budget.max_nodes:
                model = model.select(torch.arange(model_budget.max_nodes, device=model.tokens.device))
            self.model_runs += 1
            merged = merge_drafts(cache, model, budget.max_nodes)
            step.model, step.merged = model, merged
            step.features = step.get_features()[:len(CACHE_FEATURES)] + model_features(model, merged.shared)
            option = self.policy.choose(step)
            if option not in step.options():
                raise ValueError(f"policy {self.policy.name!r} chose {option!r}, not one of {step.options()}")
        self.options[option] = self.options.get(option, 0) + 1
        predicted = list(self.policy.predicted) if self.policy.predicted is not None else None
        self._pending = _Pending(cache, model, merged, option, step.features, predicted, position)
        tree = {"cache": cache, "model": model, "merged": merged.tree if merged is not None else None}[option]
        return self._chosen(tree, option, input_ids)

    def _chosen(self, tree: DraftTree | None, option: str, input_ids: torch.Tensor) -> DraftTree:
        """The chosen draft's tokens, parents and scores as its drafter built them (validated there; left on its
        device, the loop moves it once), read as deterministic (no probs: the drafts HVD picks between are), its
        info naming HVD's choice."""
        if tree is None or tree.num_nodes == 0:
            return empty_draft(1, input_ids.device)
        return tree.relabeled({**(tree.info or {}), "drafter": "hvd", "option": option, "policy": self.policy.name})

    def _settle(self, pending: _Pending, result: VerifyResult) -> None:
        """Realized payoffs of the step's drafts against what was committed; history and record."""
        self._settle_cache()
        committed = result.token_list if result.token_list is not None else result.tokens.tolist()
        accepted = len(result.path) - 1
        if pending.model is None and not self.record:
            # The model drafter did not run (most steps): only the cache draft has a payoff to measure.
            self.history.update(realized_payoff(pending.cache, committed), None, True, accepted)
            return
        verified = {"cache": pending.cache, "model": pending.model,
                    "merged": pending.merged.tree if pending.merged is not None else None}

        # The merged tree's payoff is only recorded (the history reads the cache's and the model's).
        payoffs = {o: None if tree is None or (o == "merged" and not self.record) else realized_payoff(tree, committed)
                   for o, tree in verified.items()}
        self.history.update(payoffs["cache"] or 0, payoffs["model"], pending.option in ("cache", "merged"), accepted)
        if self.record:
            # An unverified draft that matched every committed token might have matched more: unknown (NaN).
            realized = [math.nan if payoffs[o] is None or (o != pending.option and payoffs[o] >= len(committed))
                        else float(payoffs[o]) for o in OPTIONS]
            nodes = (pending.cache.num_nodes, 0 if pending.model is None else pending.model.num_nodes,
                     0 if verified[pending.option] is None else verified[pending.option].num_nodes)
            self.records.append(StepRecord(features=pending.features, option=pending.option,
                                           model_ran=pending.model is not None, nodes=nodes,
                                           predicted=pending.predicted or [math.nan] * 3, realized=realized,
                                           accepted=accepted, position=pending.position))


# ---------------------------------------------------------------------- construction from an AssistantConfig
