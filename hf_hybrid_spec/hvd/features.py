"""Per-step features of Hybrid Verified Decoding: what is known about the cache draft (and the model draft) before
verification.

Two groups, in the fixed order of `FEATURE_NAMES`:

- `CACHE_FEATURES`: known once the cache (suffix) drafter has proposed, before the model drafter runs: the cache
  draft's match length, score, size and shape, branch counts and probabilities, source (this request or the
  process-wide cache of earlier outputs), the position in the output, and the recent history of the request
  (realized payoffs of cache and model drafts, whether the last verified tree held the cache draft, the last
  accepted length).
- `MODEL_FEATURES`: known once the model drafter has proposed: its own confidence (sum of its path
  probabilities, its top-1 probability, its deepest best path) and how much of it the cache draft shares.

Counts and lengths enter as log1p so a handful of long matches does not dominate an MLP's input scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..tree import DraftTree

__all__ = ["CACHE_FEATURES", "MODEL_FEATURES", "FEATURE_NAMES", "History", "TreeShape", "cache_features",
           "model_features", "tree_shape", "as_tensor"]

CACHE_FEATURES = (
    "cache_has_draft",        # 1 if the cache drafter proposed anything
    "cache_match_length",     # log1p(tokens of context matched in the suffix tree)
    "cache_score",            # sum of the draft's path probabilities (SuffixDecoding's score)
    "cache_num_nodes",        # log1p(draft nodes)
    "cache_depth",            # log1p(deepest node)
    "cache_num_leaves",       # log1p(leaves = branches of the tree)
    "cache_root_branches",    # log1p(children of the root)
    "cache_top1_prob",        # highest probability among the root's children
    "cache_best_leaf_prob",   # highest path probability among the deepest nodes
    "cache_mean_prob",        # score / nodes
    "cache_global",           # 1 if the match came from the process-wide cache of earlier outputs
    "output_position",        # log1p(tokens generated so far in this request)
    "prompt_length",          # log1p(prompt tokens)
    "cache_payoff_last",      # realized payoff (accepted tokens) of the previous step's cache draft
    "cache_payoff_ema",       # its exponential moving average (alpha = History.alpha)
    "cache_hit_ema",          # EMA of 1[the cache draft had a payoff >= 1]
    "last_from_cache",        # 1 if the previous verified tree held the cache draft
    "last_accepted",          # log1p(accepted draft tokens of the previous step)
    "model_payoff_ema",       # EMA of the model draft's realized payoff (steps where it ran)
)
MODEL_FEATURES = (
    "model_ran",              # 1 if the model drafter proposed this step (0: the model features are all 0)
    "model_expected",         # sum of its path probabilities (its own expected accepted length)
    "model_top1_prob",        # its probability of its first token
    "model_best_leaf_prob",   # highest path probability among its deepest nodes
    "model_num_nodes",        # log1p(draft nodes)
    "shared_nodes",           # log1p(nodes the cache draft and the model draft have in common)
)
FEATURE_NAMES = CACHE_FEATURES + MODEL_FEATURES


@dataclass
class TreeShape:
    """Shape statistics of one draft (batch size 1)."""

    num_nodes: int = 0
    depth: int = 0
    leaves: int = 0
    root_branches: int = 0
    top1_prob: float = 0.0
    best_leaf_prob: float = 0.0
    score: float = 0.0


def tree_shape(tree: DraftTree | None) -> TreeShape:
    """Counts and probabilities of a draft; a draft without scores counts every node as probability 1. One pass over
    the parent list on the host (HVD reads this every step)."""
    if tree is None or tree.num_nodes == 0:
        return TreeShape()
    host = tree.host()
    parents = host.parents
    probs = host.scores if host.scores is not None else [1.0] * len(parents)
    depth: list[int] = []
    has_child = [False] * len(parents)
    for p in parents:
        if p >= 0:
            depth.append(depth[p] + 1)
            has_child[p] = True
        else:
            depth.append(1)
    max_depth = max(depth)
    return TreeShape(
        num_nodes=len(parents),
        depth=max_depth,
        leaves=has_child.count(False),
        root_branches=sum(1 for p in parents if p < 0),
        top1_prob=max(q for q, p in zip(probs, parents) if p < 0),
        best_leaf_prob=max(q for q, d in zip(probs, depth) if d == max_depth),
        score=float(sum(probs)),
    )


@dataclass
class History:
    """What a request's earlier steps realized, updated after every verification.

    Attributes:
        alpha: weight of the newest step in the moving averages.
        cache_payoff_last: realized payoff of the previous step's cache draft (0 when there was none).
        cache_payoff_ema / cache_hit_ema / model_payoff_ema: moving averages (see `CACHE_FEATURES`);
            `model_payoff_ema` starts at `model_prior`.
        last_from_cache: whether the previous verified tree held the cache draft.
        last_accepted: accepted draft tokens of the previous step.
        steps_since_model: steps since the model drafter last proposed (not a predictor input: policies read it).
    """

    alpha: float = 0.3
    model_prior: float = 1.0
    cache_payoff_last: float = 0.0
    cache_payoff_ema: float = 0.0
    cache_hit_ema: float = 0.0
    model_payoff_ema: float | None = None
    last_from_cache: bool = False
    last_accepted: int = 0
    steps_since_model: int = 0

    def __post_init__(self):
        if self.model_payoff_ema is None:
            self.model_payoff_ema = self.model_prior

    def update(self, cache_payoff: int | None, model_payoff: int | None, verified_cache: bool, accepted: int):
        """One step: the payoffs of the drafts that were proposed (None: not proposed), whether the verified tree
        held the cache draft, and how many draft tokens were accepted. `update_model` then `update_cache`."""
        self.update_model(model_payoff)
        self.update_cache(cache_payoff, verified_cache, accepted)

    def update_model(self, model_payoff: int | None) -> None:
        """The model drafter's part of a step (None: it did not propose)."""
        if model_payoff is not None:
            self.model_payoff_ema = (1 - self.alpha) * self.model_payoff_ema + self.alpha * float(model_payoff)
            self.steps_since_model = 0
        else:
            self.steps_since_model += 1

    def update_cache(self, cache_payoff: int | None, verified_cache: bool, accepted: int) -> None:
        """The rest of a step: the cache draft's payoff, what was verified and accepted. HVD may defer this part
        of a step (its fast path reads only the model part) to the host's idle time of the next step."""
        a = self.alpha
        c = 0.0 if cache_payoff is None else float(cache_payoff)
        self.cache_payoff_last = c
        self.cache_payoff_ema = (1 - a) * self.cache_payoff_ema + a * c
        self.cache_hit_ema = (1 - a) * self.cache_hit_ema + a * float(c >= 1)
        self.last_from_cache = verified_cache
        self.last_accepted = accepted


def _log1p(x: float) -> float:
    return math.log1p(max(0.0, float(x)))


def cache_features(tree: DraftTree | None, history: History, prompt_length: int, generated: int,
                   shape: TreeShape | None = None) -> list[float]:
    """The `CACHE_FEATURES` of one step, in order. `tree` is the cache draft (None or empty: no draft); `shape` its
    `tree_shape` when the caller has it already."""
    shape = tree_shape(tree) if shape is None else shape
    info = (tree.info or {}) if tree is not None else {}
    return [
        float(shape.num_nodes > 0),
        _log1p(info.get("match_length", 0)),
        shape.score,
        _log1p(shape.num_nodes),
        _log1p(shape.depth),
        _log1p(shape.leaves),
        _log1p(shape.root_branches),
        shape.top1_prob,
        shape.best_leaf_prob,
        shape.score / max(1, shape.num_nodes),
        float(info.get("source") == "global"),
        _log1p(generated),
        _log1p(prompt_length),
        history.cache_payoff_last,
        history.cache_payoff_ema,
        history.cache_hit_ema,
        float(history.last_from_cache),
        _log1p(history.last_accepted),
        float(history.model_payoff_ema),
    ]


def model_features(tree: DraftTree | None, shared_nodes: int) -> list[float]:
    """The `MODEL_FEATURES` of one step, in order (all 0 when the model drafter did not run: `tree` None)."""
    if tree is None:
        return [0.0] * len(MODEL_FEATURES)
    shape = tree_shape(tree)
    return [1.0, shape.score, shape.top1_prob, shape.best_leaf_prob, _log1p(shape.num_nodes), _log1p(shared_nodes)]


def as_tensor(values: list[float]) -> torch.Tensor:
    """[F] float32 feature vector."""
    return torch.tensor(values, dtype=torch.float32)
