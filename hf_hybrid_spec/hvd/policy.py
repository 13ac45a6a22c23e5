"""Policies of Hybrid Verified Decoding: which draft the target verifies at each step.

Each step the cache drafter proposes first. A policy then decides in two stages:

1. `before_model(step)`: "cache" verifies the cache draft without running the model drafter (its work is skipped;
   it catches up on the accepted tokens later), None runs the model drafter;
2. `choose(step)`: with both drafts in hand, "cache", "model" or "merged" (one tree holding both).

Policies (one instance per request):

- `ThresholdPolicy`: SuffixDecoding's gate: the cache draft if its score >= a fixed threshold, else the model draft.
- `LearnedPolicy`: HVD: a `PayoffPredictor` predicts each option's payoff (accepted draft tokens); with the
  profiled `CostProfile` the option with the most committed tokens per second wins (where the cache draft wins even
  at payoff 0, the prediction and the features are skipped: no prediction could change that; `quick_cache` decides
  that from a memo per cache draft size, before HVD builds a `Step`). Stage 1 skips the
  model drafter when the cache draft (no draft at all counts, with payoff 0) beats what the model drafter has
  recently delivered (its payoff EMA) at the model's cost; after `probe_interval` skipped steps the model drafter
  runs anyway, so that its EMA follows the text, but only as often as `probe_budget` allows: a probe may cost at most
  that share of the skipped steps' time (on a GPU an eager EAGLE draft can cost 20 graph-replayed steps: probing
  every 16 steps there would spend more time probing than decoding), and only where a model draft accepted to its
  full depth could beat the cache draft's predicted rate (elsewhere the probe could not change a choice).
- `OraclePolicy` (benchmarks only): knows the target's greedy continuation, so it knows each option's realized
  payoff before verification (`realized_payoff` against the reference); it drafts both every step and picks the
  option with the most realized tokens per profiled second of that option (model drafting is charged only to the
  options that use it). `ReplayPolicy` replays its decisions, running only the drafters they need: that is the
  timed oracle.
- `CollectPolicy` (label collection): mostly the merged tree, so one verification realizes the payoff of the cache
  draft, of the model draft and of the merge (greedy: exactly each one's longest greedy-matching root path); on a
  random share of steps the cache draft or the model draft alone, so that the history features (whether the last
  tree held the cache draft, the last accepted length) vary as they do under a deciding policy.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from ..drafters.base import DraftBudget
from ..tree import DraftTree
from .cost import CostProfile
from .features import FEATURE_NAMES, History, as_tensor
from .merge import MergedDraft, realized_payoff

__all__ = ["OPTIONS", "Step", "Policy", "ThresholdPolicy", "LearnedPolicy", "OraclePolicy", "ReplayPolicy",
           "CollectPolicy"]

OPTIONS = ("cache", "model", "merged")
_SCORE = FEATURE_NAMES.index("cache_score")


@dataclass
class Step:
    """What a policy may read at one step.

    Attributes:
        cache: the cache draft (possibly empty).
        features: `FEATURE_NAMES` values; the `MODEL_FEATURES` part is 0 until the model drafter has run. None until
            first read through `get_features()`, when `feature_fn` is given: a policy that can decide without them
            (see `LearnedPolicy.before_model`) leaves them uncomputed.
        history: the request's realized payoffs so far.
        cost: the profiled cost model (None when the drafter was given none).
        budget: the verified tree's limits (merged trees are trimmed to `budget.max_nodes`).
        model_tokens: the model drafter's node budget.
        length: committed tokens, root included.
        model / merged: the model draft and the merge of both (after stage 1, when the model drafter ran).
        allow_merge: whether "merged" may be chosen.
        model_begun: whether the model drafter has begun this request (its first draft also pays its begin, e.g.
            EAGLE's pass over the prompt).
    """

    cache: DraftTree
    features: list[float] | None
    history: History
    cost: CostProfile | None
    budget: DraftBudget
    model_tokens: int
    length: int
    model: DraftTree | None = None
    merged: MergedDraft | None = None
    allow_merge: bool = True
    model_begun: bool = True
    feature_fn: Callable[[], list[float]] | None = None

    def get_features(self) -> list[float]:
        """`features`, computed by `feature_fn` on first use."""
        if self.features is None:
            self.features = self.feature_fn()
        return self.features

    def nodes(self, option: str) -> int:
        """Draft nodes the option verifies."""
        if option == "cache":
            return self.cache.num_nodes
        if option == "model":
            return self.model.num_nodes
        return self.merged.tree.num_nodes

    def options(self) -> tuple[str, ...]:
        return OPTIONS if self.allow_merge else OPTIONS[:2]


class Policy(ABC):
    """See the module docstring. `predicted` holds the last step's predicted payoffs (cache, model, merged) for the
    step records, or None where nothing was predicted (policies that predict nothing, `quick_cache` steps)."""

    name = "policy"
    predicted: list[float] | None = None

    def begin(self) -> None:
        """A request starts."""

    def quick_cache(self, nodes: int, history: History, cost: CostProfile | None, budget: DraftBudget,
                    model_tokens: int, allow_merge: bool, model_begun: bool, length: int) -> bool:
        """True where `before_model` would verify the cache draft whatever its features say, decided from the
        cache draft's size alone: HVD then skips building the `Step` (its per-step fast path; a few microseconds
        count there, see `LearnedPolicy`). The arguments are the `Step` fields of that name (`nodes`: the cache
        draft's). False (the default): ask `before_model`."""
        return False

    @abstractmethod
    def before_model(self, step: Step) -> str | None:
        """"cache" to verify the cache draft without running the model drafter, None to run it."""

    @abstractmethod
    def choose(self, step: Step) -> str:
        """One of `step.options()`, once the model drafter has run."""


class ThresholdPolicy(Policy):
    """The cache draft when its score (sum of path probabilities) reaches `threshold`, else the model draft."""

    name = "threshold"

    def __init__(self, threshold: float):
        if not threshold >= 0:
            raise ValueError(f"the threshold must be >= 0, got {threshold!r}")
        self.threshold = threshold

    def before_model(self, step: Step) -> str | None:
        score = step.get_features()[_SCORE]
        return "cache" if step.cache.num_nodes and score >= self.threshold else None

    def choose(self, step: Step) -> str:
        return "model"


def _rate(payoff: float, seconds: float) -> float:
    """Committed tokens (accepted + the bonus token) per second."""
    return (payoff + 1.0) / seconds


def _cost(step: Step, policy: str) -> CostProfile:
    if step.cost is None:
        raise ValueError(f"the {policy!r} policy weighs payoffs against costs: give the HybridDrafter a CostProfile")
    return step.cost


class LearnedPolicy(Policy):
    """HVD: predicted payoff per profiled second (see the module docstring).

    Args:
        predictor: a `PayoffPredictor`.
        probe_interval: run the model drafter after at least this many steps without it, whatever the prediction...
        probe_budget: ...and only once the skipped steps' profiled time is at least the model draft's cost divided
            by this share (0 never probes), and never while the cache draft's predicted rate beats what even a
            full-depth model draft or merged tree could reach...
        probe_recheck: ...which, once it declined a due probe, is asked again only after this many more steps
            (asking needs the cache payoff predicted: on a long request the cache draft serves well, asking every
            step put the features and the prediction back on every step once a probe was due).
    """

    name = "learned"

    def __init__(self, predictor, probe_interval: int = 16, probe_budget: float = 0.05, probe_recheck: int = 4):
        for name, value in (("probe_interval", probe_interval), ("probe_recheck", probe_recheck)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= probe_budget <= 1.0:
            raise ValueError(f"probe_budget must be in [0, 1], got {probe_budget!r}")
        self.predictor = predictor
        self.probe_interval = probe_interval
        self.probe_budget = probe_budget
        self.probe_recheck = probe_recheck
        self._declined_at: int | None = None  # steps without the model drafter when a due probe was last declined
        # `quick_cache` memo of one request (its cost profile and merge setting are fixed): (cache nodes, model
        # payoff EMA, model overhead, model tokens, max nodes) -> whether the cache draft wins at payoff 0. The EMA
        # only moves when the model drafter runs, so a request asks a handful of keys (one per cache draft size) for
        # long stretches.
        self._wins_at_zero: dict[tuple, bool] = {}

    def begin(self) -> None:
        self._wins_at_zero.clear()
        self._declined_at = None

    def _probe_may_be_due(self, skipped: int) -> bool:
        """Whether a probe may be due after `skipped` steps without the model drafter (before its budget check)."""
        if skipped < self.probe_interval or self.probe_budget == 0.0:
            return False
        declined = self._declined_at
        # (skipped < declined: the model drafter ran since that decline)
        return declined is None or skipped < declined or skipped >= declined + self.probe_recheck

    def _probe_due(self, cost: CostProfile, skipped: int, nodes: int, overhead: float) -> bool:
        """Whether a probe is due after `skipped` steps without the model drafter, at a cache draft of `nodes`
        nodes, the model drafter's draft costing `overhead` seconds more than profiled
        (`CostProfile.model_overhead`)."""
        if not self._probe_may_be_due(skipped):
            return False
        probe = cost.model_draft_seconds + overhead
        return probe <= self.probe_budget * skipped * cost.step(nodes, False)

    @staticmethod
    def _cache_wins_at_zero(cost: CostProfile, nodes: int, model_tokens: int, max_nodes: int, allow_merge: bool,
                            model_payoff: float, overhead: float) -> bool:
        """Whether a cache draft of `nodes` nodes with payoff 0 out-rates the model draft and the merged tree, both
        credited with the model drafter's recent payoff (see the comment in `before_model`)."""
        best = _rate(model_payoff, cost.step(model_tokens, True) + overhead)
        if allow_merge:
            best = max(best, _rate(model_payoff, cost.step(min(max_nodes, nodes + model_tokens), True) + overhead))
        return _rate(0.0, cost.step(nodes, False)) >= best

    def quick_cache(self, nodes: int, history: History, cost: CostProfile | None, budget: DraftBudget,
                    model_tokens: int, allow_merge: bool, model_begun: bool, length: int) -> bool:
        # (Every step of most agentic requests comes here: kept to a few lookups.)
        if cost is None:
            return False
        if not model_begun and cost.model_begin_seconds_per_token > 0.0:
            return False  # (the begin's cost grows with the context: not worth a memo key)
        skipped = history.steps_since_model
        overhead = cost.model_overhead(model_begun, skipped, length)  # (one of three values once per_token is 0)
        if skipped >= self.probe_interval and self._probe_due(cost, skipped, nodes, overhead):
            return False  # (`before_model` weighs the probe; until its budget fills, the memo decides, as there)
        key = (nodes, history.model_payoff_ema, overhead, model_tokens, budget.max_nodes)
        wins = self._wins_at_zero.get(key)
        if wins is None:
            if len(self._wins_at_zero) >= 1024:
                self._wins_at_zero.clear()
            wins = self._wins_at_zero[key] = self._cache_wins_at_zero(
                cost, nodes, model_tokens, budget.max_nodes, allow_merge, float(history.model_payoff_ema), overhead)
        if wins:
            self.predicted = None
        return wins

    def before_model(self, step: Step) -> str | None:
        cost = _cost(step, self.name)
        # What running the model drafter adds to its draft: its begin until it has begun, and its accept of what
        # was committed since it last drafted.
        overhead = cost.model_overhead(step.model_begun, step.history.steps_since_model, step.length)
        probe = self._probe_due(cost, step.history.steps_since_model, step.cache.num_nodes, overhead)
        # What the model drafter would bring, judged by what it delivered recently.
        model_payoff = float(step.history.model_payoff_ema)
        cache_seconds = cost.step(step.cache.num_nodes, False)
        model_seconds = cost.step(step.model_tokens, True) + overhead
        model_rate = _rate(model_payoff, model_seconds)
        merged_seconds = math.inf
        if step.allow_merge:
            nodes = min(step.budget.max_nodes, step.cache.num_nodes + step.model_tokens)
            merged_seconds = cost.step(nodes, True) + overhead
        if not probe and self._cache_wins_at_zero(cost, step.cache.num_nodes, step.model_tokens, step.budget.max_nodes,
                                                  step.allow_merge, model_payoff, overhead):
            # The cache draft wins even at payoff 0, so no prediction (clamped at 0 below) can change the choice:
            # the cache rate only grows with its payoff, and a merged tree earns (max(cache, model) + 1) / merged
            # seconds, which is the model-payoff term while the cache payoff is the smaller, and below the cache
            # draft's own rate once it is the larger (the merged step costs at least (model + 1) x the cache step
            # here, so more than the cache step). On agentic sessions this is most steps: skipping the predictor
            # and the features there is HVD's decision cost on the host.
            self.predicted = [math.nan] * 3
            return "cache"
        if step.cache.num_nodes:
            predict = getattr(self.predictor, "predict_cache", None)
            features = step.get_features()
            cache_payoff = float(predict(features) if predict is not None
                                 else self.predictor.predict(as_tensor(features))[0])
            # A payoff counts accepted tokens: never below 0, whatever the regression says.
            cache_payoff = max(cache_payoff, 0.0)
        else:
            cache_payoff = 0.0
        self.predicted = [cache_payoff, math.nan, math.nan]
        cache_rate = _rate(cache_payoff, cache_seconds)
        if probe:
            # A probe refreshes what the model drafter is worth, which only matters where it could win. Skip it
            # while even a model draft (or merged tree) accepted to its full depth would lose to the cache draft's
            # predicted rate: the probe stays due, and runs on the first step asked (every `probe_recheck`) where
            # the cache draft looks weak. (Without this, on sessions the cache draft serves well, every probe was
            # pure cost: 2-3% on the CPU.)
            ceiling = _rate(float(min(step.model_tokens, step.budget.max_depth)), model_seconds)
            if step.allow_merge:
                ceiling = max(ceiling, _rate(float(step.budget.max_depth), merged_seconds))
            if cache_rate >= ceiling:
                self._declined_at = step.history.steps_since_model
                return "cache"
            return None
        best = model_rate
        if step.allow_merge:
            best = max(best, _rate(max(cache_payoff, model_payoff), merged_seconds))
        return "cache" if cache_rate >= best else None

    def choose(self, step: Step) -> str:
        predict = getattr(self.predictor, "predict_one", None)
        features = step.get_features()
        cache_payoff, model_payoff, merged_payoff = (predict(features) if predict is not None
                                                     else self.predictor.predict(as_tensor(features)).tolist())
        # A merged tree accepts at least what either part accepts.
        merged_payoff = max(merged_payoff, cache_payoff, model_payoff)
        self.predicted = [cache_payoff, model_payoff, merged_payoff]
        payoff = dict(zip(OPTIONS, self.predicted))
        # The model drafter has run: its time is spent whichever tree is verified.
        cost = _cost(step, self.name)
        rates = {o: _rate(payoff[o], cost.step(step.nodes(o), True)) for o in step.options()}
        return max(rates, key=lambda o: (rates[o], -OPTIONS.index(o)))


class OraclePolicy(Policy):
    """Hindsight choice (benchmarks only). `reference`: the target's greedy output for the request, prompt included
    (a list of token ids). `decisions` collects the choices, for `ReplayPolicy`."""

    name = "oracle"

    def __init__(self, reference: list[int]):
        self.reference = list(reference)
        self.decisions: list[str] = []
        self._model_used = False
        self._skipped = 0  # the replay's steps since its model drafter last drafted

    def begin(self) -> None:
        self.decisions = []
        self._model_used = False
        self._skipped = 0

    def before_model(self, step: Step) -> str | None:
        return None

    def choose(self, step: Step) -> str:
        future = self.reference[step.length : step.length + step.budget.max_depth + 1]
        trees = {"cache": step.cache, "model": step.model, "merged": step.merged.tree}
        realized = {o: realized_payoff(trees[o], future) for o in step.options()}
        self.predicted = [float(realized.get(o, float("nan"))) for o in OPTIONS]
        # Knowing the payoffs, it would not have run the model drafter (nor begun it) for a cache-only step. Its
        # recording pass runs the model drafter every step, so what the replay's model drafter will have to catch up
        # (its begin, the steps it sat out) is the oracle's own count.
        cost = _cost(step, self.name)
        overhead = cost.model_overhead(self._model_used, self._skipped, step.length)
        rates = {o: _rate(realized[o], cost.step(step.nodes(o), o != "cache") + (overhead if o != "cache" else 0.0))
                 for o in step.options()}
        choice = max(rates, key=lambda o: (rates[o], -OPTIONS.index(o)))
        self.decisions.append(choice)
        self._model_used = self._model_used or choice != "cache"
        self._skipped = self._skipped + 1 if choice == "cache" else 0
        return choice


class ReplayPolicy(Policy):
    """Replays recorded decisions (an `OraclePolicy`'s), running the model drafter only where they need it. Steps
    past the recording (the trajectory diverged) verify the merged tree and are counted in `diverged`."""

    name = "replay"

    def __init__(self, decisions: list[str]):
        bad = [d for d in decisions if d not in OPTIONS]
        if bad:
            raise ValueError(f"decisions must be among {OPTIONS}, got {bad[:3]}")
        self.decisions = list(decisions)
        self.index = 0
        self.diverged = 0

    def begin(self) -> None:
        self.index = 0
        self.diverged = 0

    def _next(self) -> str:
        if self.index < len(self.decisions):
            return self.decisions[self.index]
        return "merged"

    def before_model(self, step: Step) -> str | None:
        if self._next() == "cache":
            self.index += 1
            return "cache"
        return None

    def choose(self, step: Step) -> str:
        decision = self._next()
        if self.index >= len(self.decisions):
            self.diverged += 1
        self.index += 1
        return decision if decision in step.options() else "model"


class CollectPolicy(Policy):
    """Label collection: always run the model drafter; verify the merged tree on a `merged_share` of the steps, else
    the cache draft or the model draft alone (each half of the time; the model draft when there is no cache draft).

    Args:
        merged_share: share of the steps that verify the merged tree (1.0: all).
        seed: of the random choices (a request's choices are reproducible).
    """

    name = "collect"

    def __init__(self, merged_share: float = 0.6, seed: int = 0):
        if not 0.0 <= merged_share <= 1.0:
            raise ValueError(f"merged_share must be in [0, 1], got {merged_share!r}")
        self.merged_share = merged_share
        self.seed = seed
        self.rng = random.Random(seed)

    def begin(self) -> None:
        self.rng = random.Random(self.seed)

    def before_model(self, step: Step) -> str | None:
        return None

    def choose(self, step: Step) -> str:
        if "merged" in step.options() and self.rng.random() < self.merged_share:
            return "merged"
        if step.cache.num_nodes == 0:
            return "model"
        return "cache" if self.rng.random() < 0.5 else "model"
