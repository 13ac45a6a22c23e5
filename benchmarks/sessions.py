"""Running workload sessions: timed `generate` calls, and step records turned into labelled rows.

Shared by the benchmark (`hvd.bench`) and the predictor's training recipe (`recipes/train_payoff.py`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from workloads import Session

from hf_hybrid_spec.generate import SpecStats, speculative_generate
from hf_hybrid_spec.hvd.drafter import StepRecord

__all__ = ["CallRun", "timed_generate", "record_rows", "LABEL_COLUMNS"]

# Label columns of `record_rows`, in `modeling.HEADS` order.
LABEL_COLUMNS = ("payoff_cache", "payoff_model", "payoff_merged")


@dataclass
class CallRun:
    """One `generate` call: sequences [1, L + new], new tokens, wall seconds, and the speculation stats (None for
    stock generate)."""

    sequences: torch.Tensor
    new_tokens: int
    seconds: float
    stats: SpecStats | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model: nn.Module, ids: torch.Tensor, gen_kwargs: dict, **spec) -> CallRun:
    """Greedy `generate` of prompt `ids` [1, L]: stock when `spec` is empty, else `speculative_generate` with `spec`
    (assistant_config=, draft_model=, drafter=)."""
    device = ids.device
    _sync(device)
    start = time.perf_counter()
    if spec:
        out = model.generate(ids, do_sample=False, custom_generate=speculative_generate, return_dict_in_generate=True,
                             **spec, **gen_kwargs)
        sequences, stats = out.sequences, out.spec_stats
    else:
        sequences, stats = model.generate(ids, do_sample=False, **gen_kwargs), None
    _sync(device)
    return CallRun(sequences=sequences, new_tokens=sequences.shape[1] - ids.shape[1],
                   seconds=time.perf_counter() - start, stats=stats)


def record_rows(records: list[StepRecord], session: Session, call: int) -> list[dict]:
    """One row per step: `features` (FEATURE_NAMES order), the realized payoffs (NaN: unknown) and where it came
    from; the format of the predictor's training data."""
    rows = []
    for r in records:
        row = {"features": [float(x) for x in r.features], "session": session.id, "workload": session.workload,
               "call": call, "position": r.position, "option": r.option}
        for name, value in zip(LABEL_COLUMNS, r.realized):
            row[name] = float(value) if not math.isnan(value) else math.nan
        rows.append(row)
    return rows
