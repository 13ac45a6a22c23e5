"""The batch-wide verification budget (Bole): how many draft nodes one batched verify forward takes, and which.

The rows' trees run in one forward padded to the widest row, so a verify forward over R rows of width W (root
included) costs T(W) however the nodes spread over the rows; a plain decode step costs T(1). Each step every row
proposes its draft, each node valued by its drafter's estimate that it is accepted (its path probability; a node
is never worth more than its parent), and the budget picks the width W, and for each row its W - 1 likeliest
nodes (at most `max_nodes` over the batch, the likeliest across rows), that maximize

    expected committed tokens per second = (R + sum of the kept values) / T(W)

When no W > 1 beats a plain decode step by the `slack` factor (a large, compute-bound batch, or drafts that rarely
hold), nothing is drafted: the step is a plain decode step, so speculation never loses to autoregressive decoding by
more than the cost model's error. `measure_verify_cost` (engine.step) times T on the machine (a few verify forwards
on the request's own cache, aborted); a fixed per-row budget stays available (`AssistantConfig(batch_budget="fixed")`).

The pipelined step (`engine.pipeline`) ranks the nodes by value the same way but counts the expected tokens from
its own steps (`AcceptanceByWidth`): drafters' values can be far off as counts while ranking well.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..tree import DeviceDrafts, DraftBatch, DraftTree

__all__ = ["VerifyCost", "BudgetChoice", "AcceptanceByWidth", "accepted_by_width", "DeviceSelection", "node_values",
           "choose_batch", "choose_nodes", "choose_width", "select_device", "paying_width", "cached_cost",
           "time_forward", "DEFAULT_PRIOR", "PlainRuns", "DraftingPayoff"]

# The acceptance estimate of a draft node whose drafter gives no scores: DEFAULT_PRIOR ** depth.
DEFAULT_PRIOR = 0.6


@dataclass
class VerifyCost:
    """Measured seconds of one batched verify forward by its width (nodes per row, root included).

    Attributes:
        widths: increasing widths measured (a static runner's buckets, or a few sizes for the eager path).
        seconds: the forward's wall time at each width.
        padded: the widths are a static runner's buckets: a tree between two of them runs padded to the wider one
            and costs what it costs (the budget must see that a 9-node tree in a 16-wide bucket costs the 16-wide
            forward, not a share of the way from 8 to 16).
    Below the first width the cost is the first's (a static runner pads a plain step to its smallest bucket),
    between widths it is interpolated linearly (or the next width's when padded), beyond the last extrapolated from
    the last two.
    """

    widths: list[int]
    seconds: list[float]
    padded: bool = False

    def __post_init__(self):
        if len(self.widths) != len(self.seconds) or not self.widths:
            raise ValueError("a VerifyCost needs as many seconds as widths, at least one")
        if any(b <= a for a, b in zip(self.widths, self.widths[1:])):
            raise ValueError(f"widths must increase, got {self.widths}")
        if any(not s > 0 for s in self.seconds):
            raise ValueError(f"seconds must be positive, got {self.seconds}")

    def __call__(self, width: int) -> float:
        xs, ys = self.widths, self.seconds
        if len(xs) == 1 or width <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, width), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        if self.padded and width <= x1:
            return y1
        return max(y0 + (y1 - y0) * (width - x0) / (x1 - x0), ys[0])


@dataclass
class BudgetChoice:
    """One step's decision: `keep[b]` the sorted node indices row b keeps (`choose_nodes`), `width` the widest row
    (root included), `nodes` the kept count over the batch, `expected_tokens` the committed tokens their values
    predict (roots included)."""

    keep: list[list[int]]
    width: int
    nodes: int
    expected_tokens: float


def node_values(draft: DraftTree, prior: float = DEFAULT_PRIOR) -> list[float]:
    """Row 0's node values: the drafter's scores (a node capped at its parent's value, so a kept node's parent is
    always kept), or `prior ** depth` without scores (what `DraftBatch` computes for a whole batch)."""
    return DraftBatch.from_drafts([draft], prior).values[0].tolist()


def paying_width(cost: VerifyCost, rows: int, slack: float = 0.05, widths: list[int] | None = None) -> int:
    """The widest tree (root included) that could beat a plain decode step under `cost` if every draft node were
    accepted (rows * W tokens in T(W) against rows in T(1)); 1 when none could. Drafting wider is wasted work, and a
    batch where this is 1 drafts nothing at all."""
    best = 1
    for w in widths or range(2, (cost.widths[-1] if cost.widths else 1) + 1):
        if w > 1 and w / cost(w) >= (1.0 + slack) / cost(1):
            best = max(best, w)
    return best


def choose_batch(batch: DraftBatch, cost: VerifyCost | None, slack: float = 0.05, max_nodes: int | None = None,
                 widths: list[int] | None = None) -> tuple[torch.Tensor, BudgetChoice]:
    """The budget's pick over a batch's drafts (see the module docstring): the width (among `widths`, default every
    width up to the widest draft's) of most expected tokens per second under `cost`, each row its likeliest nodes
    within it, at most `max_nodes` in all, the likeliest across rows first; with no cost model, every node up to
    `max_nodes`. Returns the kept nodes as a [R, M] bool mask and the choice (its `keep` lists unfilled)."""
    rows, m = batch.tokens.shape
    valid = batch.valid
    # Within a row: highest value first, ties in index order (a parent's index is below its children's), so every
    # prefix of the ranking is closed under parents. Padding ranks last.
    values = torch.where(valid, batch.values, -1.0)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    ranked = values.gather(1, order).clamp(min=0.0)
    widest = 1 + (max(batch.counts) if rows else 0)
    if cost is None:
        width = widest
    else:
        prefix = torch.cat([torch.zeros(rows, 1), ranked.cumsum(1)], dim=1).sum(0).tolist()  # [M + 1] over rows
        candidates = sorted({min(w, widest) for w in (widths or range(1, widest + 1))} | {1})
        plain = rows / cost(1)
        width, best_rate = 1, plain
        for w in candidates[1:]:
            if max_nodes is not None and rows * (w - 1) > max_nodes:
                top = ranked[:, : w - 1].flatten()
                expected = rows + float(top.topk(min(max_nodes, top.numel())).values.sum())
            else:
                expected = rows + prefix[min(w - 1, m)]
            rate = expected / cost(w)
            if rate > best_rate:
                width, best_rate = w, rate
        if best_rate < (1.0 + slack) * plain:
            width = 1
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(m).expand(rows, m))
    keep = (rank < width - 1) & valid
    if max_nodes is not None and int(keep.sum()) > max_nodes:
        # The likeliest across rows; ties to the lower node index, then the lower row (two stable sorts on the
        # row-major candidates).
        row_of, index_of = keep.nonzero(as_tuple=True)
        by_index = torch.sort(index_of, stable=True).indices
        by_value = torch.sort(batch.values[row_of, index_of][by_index], descending=True, stable=True).indices
        chosen = by_index[by_value[:max_nodes]]
        keep = torch.zeros_like(keep)
        keep[row_of[chosen], index_of[chosen]] = True
    kept = keep.sum(1)
    choice = BudgetChoice(keep=[], width=1 + (int(kept.max()) if rows else 0), nodes=int(kept.sum()),
                          expected_tokens=rows + float(torch.where(keep, batch.values, 0.0).sum()))
    return keep, choice


def choose_nodes(values: list[list[float]], cost: VerifyCost | None, slack: float = 0.05,
                 max_nodes: int | None = None, widths: list[int] | None = None) -> BudgetChoice:
    """`choose_batch` over node values given as lists (`node_values`, one list per row; closed under parents as
    those are): the choice with each row's kept node indices in `keep`."""
    width = max((len(row) for row in values), default=0)
    counts = [len(row) for row in values]
    padded = torch.tensor([row + [0.0] * (width - len(row)) for row in values], dtype=torch.float32)
    padded = padded.view(len(values), width)
    zeros = torch.zeros(len(values), width, dtype=torch.long)
    batch = DraftBatch(tokens=zeros, parents=zeros - 1, values=padded, depth=zeros, count=torch.tensor(counts))
    keep, choice = choose_batch(batch, cost, slack, max_nodes, widths)
    choice.keep = [[i for i, k in enumerate(row) if k] for row in keep.tolist()]
    return choice


def choose_width(prefix: list[float], rows: int, cost: VerifyCost, slack: float = 0.05,
                 max_nodes: int | None = None, widths: list[int] | None = None,
                 draft_seconds: float = 0.0) -> tuple[int, bool]:
    """The pipelined step's width (root included) for `rows` running rows whose drafts are worth `prefix[k]`
    accepted tokens in all when each row verifies its best k nodes (k = 0 .. M; `AcceptanceByWidth.prefix`, or the
    sum of each row's best k node values), and whether drafting pays at all.

    A step that drafts costs `cost(w) + draft_seconds` whatever width it verifies (the drafts are made before the
    width is applied), so the width is the one above 1 of most expected tokens per second; drafting pays when that
    rate beats a plain step without drafts, `rows / cost(1)`, by `slack`. Where it does not, the width returned is
    still the best drafting one (1 when there is none), for a caller that drafts on a while longer
    (`engine.pipeline`). Beyond `max_nodes` the expected tokens are scaled down in proportion (the cap keeps the
    likeliest nodes, so this underestimates), and a row never expects more than all of its nodes."""
    m = len(prefix) - 1
    if rows == 0 or m == 0:
        return 1, False
    width, best_rate = 1, 0.0
    for w in sorted(set(widths or range(2, m + 2))):
        if w <= 1:
            continue
        expected = min(prefix[min(w - 1, m)], rows * (w - 1))
        if max_nodes is not None and rows * (w - 1) > max_nodes:
            expected *= max_nodes / (rows * (w - 1))
        rate = (rows + expected) / (cost(w) + draft_seconds)
        if rate > best_rate:
            width, best_rate = w, rate
    return width, width > 1 and best_rate >= (1.0 + slack) * rows / cost(1)


class AcceptanceByWidth:
    """Accepted draft tokens per row and step at each verify width, measured from the steps themselves.

    The drafters' path probabilities rank the nodes well but can be far off as counts: the fixture's EAGLE-3 drafter
    valued its best 7 nodes per row at about one accepted token where its full 60-node trees accepted 3.2. Greedy
    acceptance gives more than the count of one step: a row whose accepted path has draft ranks r_1 .. r_d (each
    node's rank among the row's drafts by value) would have accepted the path's prefix whose running maximum rank is
    below W - 1 at any narrower width W, since a narrower tree keeps the likeliest W - 1 nodes and the target's
    argmax does not depend on the tree. So one step at width W measures every width up to W at once.

    Args:
        widths: the widths to track (above 1). weight: how far one step moves a width's average toward itself.
    """

    def __init__(self, widths: list[int], weight: float = 0.3):
        self.widths = sorted(w for w in set(widths) if w > 1)
        self.weight = weight
        self.mean: dict[int, float] = {}  # width -> accepted draft tokens per row and step

    def observe(self, totals: list[int], rows: int, width: int) -> None:
        """One step of `rows` running rows verified at `width`: `totals[i]` the accepted draft tokens over those rows
        at `widths[i]` (`accepted_by_width`); the widths above `width` were not measured by it."""
        if rows == 0:
            return
        for w, total in zip(self.widths, totals):
            if w > width:
                break
            got = total / rows
            old = self.mean.get(w)
            self.mean[w] = got if old is None else (1.0 - self.weight) * old + self.weight * got

    def prefix(self, rows: int) -> list[float]:
        """`choose_width`'s input from the measurements: the batch's expected accepted draft tokens at width w in
        entry w - 1 (for the tracked widths; entry 0 is 0)."""
        out = [0.0] * (max(self.widths, default=1))
        for w in self.widths:
            out[w - 1] = rows * self.mean.get(w, 0.0)
        return out


class PlainRuns:
    """When a batch stops drafting for a run of plain steps, and for how many (both batch steps' rule).

    After `patience` drafting steps in a row that do not pay, a run of `first` plain steps. The drafting step after a
    run probes: if it does not pay either, the batch goes back at once for a run twice as long (up to `longest`, or
    the run's own length if it started longer); a step that pays restores the patience and the first length. A
    batch's acceptance changes as it decodes (on the fixtures it is low for the first few steps and rises), so no
    decision holds for the rest of the batch, and a drafter that never pays costs one step per run, which doubles.
    """

    def __init__(self, first: int, longest: int, patience: int):
        if first < 1 or patience < 1:
            raise ValueError(f"a plain run needs first >= 1 and patience >= 1, got {first} and {patience}")
        self.first, self.longest, self.patience = first, longest, patience
        self.length, self.wait, self.refusals = first, patience, 0

    def verdict(self, pays: bool) -> int:
        """One drafting step's verdict: the plain steps to run now (0: go on drafting)."""
        if pays:
            self.length, self.wait, self.refusals = self.first, self.patience, 0
            return 0
        self.refusals += 1
        if self.refusals < self.wait:
            return 0
        run = self.length
        self.length = min(2 * self.length, max(self.longest, self.length))
        self.wait, self.refusals = 1, 0
        return run


class DraftingPayoff:
    """Whether the general batch step's drafting pays, from what its own steps measured.

    The budget sizes each step's trees from the drafters' values, which can promise far more than the text holds (a
    suffix trie's counts on text that does not repeat: the fixtures' rows accepted 1.3-2.5 tokens per step at B > 1
    where the counts promised more), and it prices the verify forward only, not the drafter's host work. Here each
    drafting step counts what it committed per row against what it cost: the verify forward's T(width) plus what the
    step measured beyond it (the drafter, the trees' layout, the walk, the records; the median over the latest
    `window` steps, so one slow step does not decide). Drafting pays while the committed tokens per row and second
    (a moving average, `weight` for the newest step) beat a plain step's, 1 / T(1), by the `slack` factor.
    """

    def __init__(self, cost: VerifyCost, slack: float = 0.05, weight: float = 0.3, window: int = 9):
        self.cost, self.slack, self.weight, self.window = cost, slack, weight, window
        self.extras: list[float] = []  # seconds beyond the verify forward, latest steps
        self.rate: float | None = None  # committed tokens per row and second, moving average

    def observe(self, tokens: int, rows: int, width: int, seconds: float) -> None:
        """A drafting step of `rows` running rows committed `tokens` in all, verifying trees `width` wide (root
        included; 1 where the budget kept no draft), in `seconds` of wall time."""
        if rows == 0:
            return
        modeled = self.cost(width)
        self.extras = (self.extras + [min(max(seconds - modeled, 0.0), seconds)])[-self.window :]
        extra = sorted(self.extras)[len(self.extras) // 2]
        rate = tokens / rows / (modeled + extra)
        self.rate = rate if self.rate is None else (1.0 - self.weight) * self.rate + self.weight * rate

    def observe_rows(self, committed: list[int], remaining: list[int], width: int, seconds: float) -> None:
        """`observe` for a batch that ends with its slowest row (a static batch: `generate`'s): row i committed
        `committed[i]` tokens with `remaining[i]` left before the step. Only the rows furthest from done count (those
        with the most left): they decide when the call ends, so a step pays only by what it commits for them. Rows
        ahead of them would finish first anyway; what drafting commits there shortens nothing. (On the fixtures most
        rows of a batch of code prompts accept ~1 token per step while a few repeat themselves and run ahead: the
        average promised a speed-up, the call got slower.)"""
        if not committed:
            return
        top = max(remaining)
        critical = [c for c, r in zip(committed, remaining) if r == top]
        self.observe(sum(critical), len(critical), width, seconds)

    def pays(self) -> bool:
        """Whether the steps observed since the last `restart` commit more per second than plain steps would."""
        return self.rate is None or self.rate >= (1.0 + self.slack) / self.cost(1)

    def proven(self) -> bool:
        """Whether the steps observed since the last `restart` have shown that drafting pays (`pays` also gives the
        benefit of the doubt before any step)."""
        return self.rate is not None and self.pays()

    def restart(self) -> None:
        """After a run of plain steps: the next drafting step's own numbers decide (the text may have changed); what a
        step costs beyond its forward is kept."""
        self.rate = None


def accepted_by_width(ranks: torch.Tensor, running: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """On the device, for `AcceptanceByWidth.observe`: the accepted draft tokens over the running rows at each width.

    Args:
        ranks: [R, D] the running maximum of each row's accepted path's draft ranks (depth 1 on; past the path a rank
            at or above every width). running: [R] bool. limits: [K] each width minus one (its draft nodes per row).
    Returns [K] int64.
    """
    hit = (ranks.unsqueeze(-1) < limits) & running.view(-1, 1, 1)
    return hit.sum(dim=(0, 1))


@dataclass
class DeviceSelection:
    """`select_device`'s verify inputs and what the host reads of them.

    Attributes:
        tokens, parent: [R, W] each row's root then its kept draft nodes (root first; unused nodes are leaves under
            the root with its token, which nobody commits).
        count: [R] kept draft nodes per row.
        rank: [R, W] each verify node's rank among its row's drafts by value (0 the likeliest; -1 the root and the
            unused nodes): a path's ranks say at which narrower widths it would still have been verified
            (`AcceptanceByWidth`).
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    count: torch.Tensor
    rank: torch.Tensor


def select_device(drafts: DeviceDrafts, width: int, caps: torch.Tensor, roots: torch.Tensor) -> DeviceSelection:
    """The budget's pick within `width` on the device, with fixed shapes and no host read: each row's likeliest
    `width - 1` nodes no deeper than its cap (`caps` [R]; 0 for a row that drafts nothing), laid out after each row's
    root (`roots` [R]) in index order, which keeps parents before children. No cap over the batch: every row is padded
    to `width` in the forward, which costs T(width) however few nodes fill it, so a batch-wide cap would only take
    nodes away from rows at no saving (`max_verify_nodes` caps each row's tree, through the caller's widths)."""
    rows, m = drafts.tokens.shape
    device = drafts.tokens.device
    allowed = drafts.depth <= caps.unsqueeze(1)
    values = torch.where(allowed, drafts.values, -1.0)
    # Highest value first, ties in index order: every prefix of a row's ranking is closed under parents.
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(m, device=device).expand(rows, m))
    keep = (rank < width - 1) & allowed
    position = keep.long().cumsum(1)  # verify-tree index of each kept node (root at 0)
    target = torch.where(keep, position, width)  # the rest lands in a spare column, cut below
    tokens = roots.unsqueeze(1).expand(rows, width + 1).clone().scatter_(1, target, drafts.tokens)[:, :width]
    parent_index = torch.where(drafts.parents >= 0, position.gather(1, drafts.parents.clamp(min=0)), 0)
    parent = torch.zeros(rows, width + 1, dtype=torch.long, device=device).scatter_(1, target, parent_index)
    parent = torch.cat([torch.full((rows, 1), -1, dtype=torch.long, device=device), parent[:, 1:width]], dim=1)
    ranks = torch.full((rows, width + 1), -1, dtype=torch.long, device=device).scatter_(1, target, rank)[:, :width]
    return DeviceSelection(tokens=tokens, parent=parent, count=keep.sum(1), rank=ranks)


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
