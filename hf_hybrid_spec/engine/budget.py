"""The batch-wide verification budget (Bole): how many draft nodes one batched verify forward takes, and which.

A verify forward over a batch of B rows costs T(X) for X tokens in all (B roots plus the draft nodes); a plain decode
step costs T(B). Each step the rows propose their drafts, every node valued by its drafter's estimate that it is
accepted (its path probability; a node is never worth more than its parent), and the budget keeps the n nodes of
highest value across the whole batch (global top-n: rows with likelier drafts get more nodes) where n maximizes

    expected committed tokens per second = (B + sum of the n kept values) / T(B + n)

When no n > 0 beats a plain decode step by the `slack` factor (a large, compute-bound batch, or drafts that rarely
hold), n = 0: the step is a plain decode step, so speculation never loses to autoregressive decoding by more than
the cost model's error. `calibrate` measures T on the machine (a few verify forwards on the request's own cache,
aborted); a fixed per-row budget stays available (`AssistantConfig(batch_budget="fixed")`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..tree import DraftTree

__all__ = ["VerifyCost", "BudgetChoice", "node_values", "choose_nodes", "trim_to_budget", "cached_cost",
           "DEFAULT_PRIOR"]

# The acceptance estimate of a draft node whose drafter gives no scores: DEFAULT_PRIOR ** depth.
DEFAULT_PRIOR = 0.6


@dataclass
class VerifyCost:
    """Measured seconds of one verify forward by total tokens (roots and draft nodes of every row).

    Attributes:
        tokens: increasing token counts measured (the first is the batch size: a plain decode step).
        seconds: the forward's wall time at each count.
    Between measured counts the cost is interpolated linearly, beyond the last extrapolated from the last two.
    """

    tokens: list[int]
    seconds: list[float]

    def __post_init__(self):
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise ValueError("a VerifyCost needs as many seconds as token counts, at least one")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"token counts must increase, got {self.tokens}")
        if any(not s > 0 for s in self.seconds):
            raise ValueError(f"seconds must be positive, got {self.seconds}")

    def __call__(self, tokens: int) -> float:
        xs, ys = self.tokens, self.seconds
        if len(xs) == 1 or tokens <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), ys[0])


@dataclass
class BudgetChoice:
    """One step's decision: `keep[b]` the sorted node indices row b keeps; `nodes` their count over the batch;
    `expected_tokens` the committed tokens the kept values predict (roots included)."""

    keep: list[list[int]]
    nodes: int
    expected_tokens: float


def node_values(draft: DraftTree, prior: float = DEFAULT_PRIOR) -> list[float]:
    """Row 0's node values: the drafter's scores (a node capped at its parent's value, so a kept node's parent is
    always kept), or `prior ** depth` without scores."""
    host = draft.host()
    values: list[float] = []
    for i, parent in enumerate(host.parents):
        up = 1.0 if parent < 0 else values[parent]
        own = host.scores[i] if host.scores is not None else (up * prior)
        values.append(min(max(float(own), 0.0), up))
    return values


def choose_nodes(values: list[list[float]], cost: VerifyCost | None, slack: float = 0.05,
                 max_nodes: int | None = None) -> BudgetChoice:
    """The budget's pick over the rows' node values (`node_values`, one list per row): the global top-n with the
    n of most expected tokens per second under `cost` (see the module docstring), at most `max_nodes` in all; with no
    cost model, every node up to `max_nodes`."""
    rows = len(values)
    # Highest value first; ties by depth order within a row (a parent's index is below its children's).
    ranked = sorted(((v, b, i) for b, row in enumerate(values) for i, v in enumerate(row)),
                    key=lambda item: (-item[0], item[2], item[1]))
    if max_nodes is not None:
        ranked = ranked[:max_nodes]
    best_n = len(ranked)
    expected = rows + sum(v for v, _, _ in ranked)
    if cost is not None:
        plain = rows / cost(rows)
        best_n, best_rate, total = 0, plain, float(rows)
        for n, (v, _, _) in enumerate(ranked, start=1):
            total += v
            rate = total / cost(rows + n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        if best_rate < (1.0 + slack) * plain:
            best_n = 0
        expected = rows + sum(v for v, _, _ in ranked[:best_n])
    keep: list[list[int]] = [[] for _ in range(rows)]
    for _, b, i in ranked[:best_n]:
        keep[b].append(i)
    for row in keep:
        row.sort()
    return BudgetChoice(keep=keep, nodes=best_n, expected_tokens=expected)


def trim_to_budget(draft: DraftTree, keep: list[int]) -> DraftTree:
    """`draft` reduced to the nodes `keep` (sorted, closed under parents)."""
    if len(keep) == draft.num_nodes:
        return draft
    return draft.select(torch.tensor(keep, dtype=torch.long, device=draft.tokens.device))


# Measured cost models, per (model, device, batch size, context bucket): measured once per process.
_COSTS: dict[tuple, VerifyCost] = {}
_COSTS_LOCK = threading.Lock()


def cached_cost(key: tuple, measure: Callable[[], VerifyCost]) -> VerifyCost:
    """The cost model kept under `key`, measured by `measure()` on first use."""
    with _COSTS_LOCK:
        found = _COSTS.get(key)
    if found is not None:
        return found
    cost = measure()
    with _COSTS_LOCK:
        _COSTS.setdefault(key, cost)
    return cost


def time_forward(run: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    """Median wall seconds of `run()` (synchronized on CUDA), after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
