"""Quality of predicted payoffs: mean absolute error, Spearman rank correlation, calibration (table and PNG); and the
paired speed ratio of two methods timed on the same calls, with a bootstrap interval.

Plain torch / matplotlib: the benchmark imports this on machines without datasets or scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["PayoffMetrics", "payoff_metrics", "spearman", "calibration_bins", "plot_calibration", "SpeedRatio",
           "paired_speed_ratio"]


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of a 1-D tensor, ties sharing their average rank."""
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    ranks = torch.empty(x.numel(), dtype=torch.float64)
    i = 0
    n = x.numel()
    while i < n:
        j = i
        while j + 1 < n and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(pred: torch.Tensor, target: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (NaN when either is constant or fewer than 2 values)."""
    if pred.numel() < 2:
        return math.nan
    a, b = _ranks(pred.double().flatten()), _ranks(target.double().flatten())
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denom if denom > 0 else math.nan


@dataclass
class PayoffMetrics:
    """count: labelled steps; mae: mean |predicted - realized|; spearman: rank correlation; mean_pred / mean_true:
    averages (a gap is a calibration bias); mae_constant: the MAE of always predicting the realized median (the
    baseline a useful predictor beats)."""

    count: int
    mae: float
    spearman: float
    mean_pred: float
    mean_true: float
    mae_constant: float


def payoff_metrics(pred: torch.Tensor, target: torch.Tensor) -> PayoffMetrics:
    """Metrics over the entries where `target` is known (not NaN). pred, target: [N]."""
    known = ~torch.isnan(target)
    pred, target = pred[known].double(), target[known].double()
    if target.numel() == 0:
        return PayoffMetrics(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    return PayoffMetrics(
        count=int(target.numel()),
        mae=float((pred - target).abs().mean()),
        spearman=spearman(pred, target),
        mean_pred=float(pred.mean()),
        mean_true=float(target.mean()),
        mae_constant=float((target - target.median()).abs().mean()),
    )


def calibration_bins(pred: torch.Tensor, target: torch.Tensor, bins: int = 10) -> list[tuple[float, float, int]]:
    """Equal-count bins of the predictions: (mean predicted, mean realized, count) per bin, NaN targets dropped."""
    known = ~torch.isnan(target)
    pred, target = pred[known].double(), target[known].double()
    order = torch.argsort(pred, stable=True)
    out = []
    for chunk in torch.tensor_split(order, min(bins, max(1, order.numel()))):
        if chunk.numel():
            out.append((float(pred[chunk].mean()), float(target[chunk].mean()), int(chunk.numel())))
    return out


def plot_calibration(curves: dict[str, tuple[torch.Tensor, torch.Tensor]], path: str, title: str) -> None:
    """PNG: per curve (name -> (pred, target)), mean realized against mean predicted payoff in equal-count bins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    top = 1.0
    for name, (pred, target) in curves.items():
        points = calibration_bins(pred, target)
        if not points:
            continue
        xs, ys, _ = zip(*points)
        top = max(top, max(xs), max(ys))
        m = payoff_metrics(pred, target)
        ax.plot(xs, ys, marker="o", label=f"{name} (MAE {m.mae:.2f}, rho {m.spearman:.2f})")
    ax.plot([0, top], [0, top], color="gray", linestyle="--", linewidth=1, label="perfect calibration")
    ax.set_xlabel("predicted payoff (accepted draft tokens)")
    ax.set_ylabel("realized payoff")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class SpeedRatio:
    """How much faster method A ran than method B over the same calls: total seconds of B / total seconds of A
    (> 1: A faster), with a bootstrap confidence interval over calls (`low`, `high`)."""

    ratio: float
    low: float
    high: float
    calls: int

    def __str__(self) -> str:
        return f"{self.ratio:.3f} ({self.low:.3f}-{self.high:.3f})"


def paired_speed_ratio(a_seconds: list[float], b_seconds: list[float], level: float = 0.9, resamples: int = 2000,
                       seed: int = 0) -> SpeedRatio:
    """B's seconds over A's on the same calls (call i timed for both), and the `level` percentile-bootstrap interval
    from resampling calls with replacement (pairs kept together, so what two methods share, a call's length and
    difficulty, cancels). Two methods doing identical work give an interval around 1 whose width is the noise."""
    if len(a_seconds) != len(b_seconds) or not a_seconds:
        raise ValueError("need the same, non-zero number of calls for both methods")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    a = torch.tensor(a_seconds, dtype=torch.float64)
    b = torch.tensor(b_seconds, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.numel(), (resamples, a.numel()), generator=gen)
    ratios = b[idx].sum(-1) / a[idx].sum(-1)
    tail = (1.0 - level) / 2.0
    low, high = torch.quantile(ratios, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return SpeedRatio(ratio=float(b.sum() / a.sum()), low=low, high=high, calls=a.numel())
