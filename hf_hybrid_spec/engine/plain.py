"""Plain greedy decode steps of a batch on the batched static runner: what a batch runs once drafting does not pay.

The budget's promise is that speculation never loses to autoregressive decoding, so the step it falls back to must
cost what a plain decode step costs. The pipelined and general batch steps can verify a tree of width 1, but they
carry the tree machinery (selection, masks, the walk or its device version, per-node bookkeeping) around a one-token
forward, which made a width-1 step slower than stock's compiled decode step (docs/batching.md, "Plain steps"). Here
one step is

    forward_device(roots)            # each row's last token alone: the runner's narrowest captured graph
    argmax -> commit_device          # every running row keeps its root; rows that stopped commit nothing
    read the step before's tokens    # the one wait; stopping criteria and records on the host

about a dozen launches around the captured forward. The host knows every row's new length without reading it (one
token per running row) and the roots stay on the device, so each step is queued before the previous one is read,
and the host's bookkeeping runs while the device computes. The token is the argmax of the target's own logits, as
stock greedy takes it, or what a `Choose` rule makes of them (sampling, processors: `verification.batch_choices` at
each row's position, the same choice a verify step would make there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .outputs import SpecStats
from .rows import BatchRecorder
from .step import Choose, record_step, still_running

__all__ = ["Choose", "PlainRun", "plain_step", "plain_steps", "queue_plain_step", "runs_plain"]


@dataclass
class PlainRun:
    """What a bounded run of plain steps (`plain_steps(max_steps=...)`) leaves for a drafter to catch up on.

    Attributes:
        running: the rows that still run after it.
        counts: [R] host ints, the tokens each row committed in the run (a row that stopped: up to its stop).
        tokens: [R, C] on the device, C >= every count: column i holds the token step i committed (each row's
            first `counts[r]` are its own; the rest is padding).
        hidden: per layer of `hidden_layers`, [R, C, H] on the device: column i the hidden state of the token
            step i took as its input (each row's last committed token before it), which a hidden-state drafter
            pairs with `tokens[:, i]`, as it pairs a verified path's states with its committed tokens.
    """

    running: list[int]
    counts: list[int]
    tokens: torch.Tensor
    hidden: tuple[torch.Tensor, ...]


def runs_plain(backend, choosable: bool) -> bool:
    """Whether a batch's plain steps can run here: the batched static runner, and a rule a plain step can apply
    (`choosable`: greedy over raw logits, or a `Choose`)."""
    return backend.queues_plain and choosable


def plain_step(backend, roots: list[int], overlap=None, choose: Choose | None = None,
               lengths: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """One plain step of the backend's running rows (`backend.running_slots`) whose roots are `roots` (in running
    order), for the general batch step when the budget kept no draft: returns each running row's new token, as a list
    and as a device tensor [rows running]. `overlap()` (optional) runs on the host while the device computes.
    `choose` (None: the argmax) is given `lengths`, every runner row's length before the step."""
    new = queue_plain_step(backend, roots, choose, lengths)
    if overlap is not None:
        overlap()
    return new.tolist(), new


def queue_plain_step(backend, roots: list[int] | torch.Tensor, choose: Choose | None = None,
                     lengths: list[int] | None = None, hold: torch.Tensor | None = None) -> torch.Tensor:
    """`plain_step` queued, not read: each running row's new token [rows running] on the device (the serving
    engine reads it in the second half of its step). `roots` are host ints, or the step before's tokens still on the
    device ([rows running], the same rows): then nothing is copied from the host, and the step is queued while the
    device still computes the one before (the serving engine's plain runs); `hold` ([rows running] bool on the
    device, optional) marks rows whose root is not committed after all (the host counts it committed: the caller
    takes it back, `BatchStaticBackend.retract`)."""
    runner = backend.runner
    rows, device = runner.rows, runner.device
    slots = backend.running_slots
    index = backend.running_index(device)  # (kept on the device: a list copied here would wait for the forward)
    if isinstance(roots, torch.Tensor):
        root = torch.zeros(rows, dtype=torch.long, device=device).index_copy_(0, index, roots)
        kept = torch.zeros_like(roots) if hold is None else -hold.long()  # 0: commit the root; -1: nothing
        leaf = torch.full((rows,), -1, dtype=torch.long, device=device).index_copy_(0, index, kept)
    else:
        # The roots, then the leaves (0: commit the root; -1: not running).
        staged = torch.zeros(2, rows, dtype=torch.long)
        staged[1].fill_(-1)
        staged[0, slots] = torch.tensor(roots, dtype=torch.long)
        staged[1, slots] = 0
        staged = staged.to(device, non_blocking=True)
        root, leaf = staged[0], staged[1]
    parent = torch.full((rows, 1), -1, dtype=torch.long, device=device)
    best = _queue(backend, root, parent, leaf, slots, choose=choose, lengths=lengths)
    return best.index_select(0, index)


def plain_steps(backend, rec: BatchRecorder, running: list[int], max_length: int, stats: SpecStats,
                row_stats: list[SpecStats], max_steps: int | None = None, columns: int = 0,
                recorded: Callable[[list[int], list[int]], None] | None = None,
                choose: Choose | None = None) -> PlainRun:
    """Step the batch without drafts until no row runs, or for `max_steps` steps at most. `running` are the running
    rows, which index the runner's rows (a `generate` batch: row b is runner row b); the cache holds every row's
    committed tokens but its last, which is the next step's root (`rec.host[b][-1]`). A bounded run also keeps what
    each step committed and, where the runner keeps hidden states, the input token's states (`PlainRun`, `columns`
    wide, at least `max_steps`), for the pipelined step's drafter to catch up on before it drafts again.

    Each step is queued before the host has read the one before it: a plain step commits exactly one token per
    running row, so the host knows every row's next length without reading anything, and the next step's roots are
    the last step's argmax on the device. The host's bookkeeping (records, stopping criteria, statistics) of step t
    then runs while the device computes step t + 1, and so does `recorded(rows, tokens)` (optional) after each step's
    records: the rows it recorded a token for and those tokens (a drafter's catch-up on them, no device read). A row
    that stops at step t has had step t + 1 computed too; that token lands past its end (its slot is never read
    again) and is not recorded. `choose` (None: the argmax) gets each row's length as the host knows it ahead: its
    recorded length, plus one for the step in flight."""
    runner = backend.runner
    rows, device = runner.rows, runner.device
    pinned = device.type == "cuda"
    new_host = [torch.zeros(rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]  # one per step in flight
    roots = torch.tensor([rec.host[b][-1] for b in range(rows)], dtype=torch.long).to(device)
    parent = torch.full((rows, 1), -1, dtype=torch.long, device=device)
    kept = None
    if max_steps is not None:
        width = max(columns, max_steps)
        kept = PlainRun(running=running, counts=[0] * rows,
                        tokens=torch.zeros(rows, width, dtype=torch.long, device=device), hidden=())
    leaves = on = None
    pending = None  # the step in flight: (buffer, event, the rows it ran)
    step = 0
    since = time.perf_counter()  # when the last step was recorded: a step's time is the wall time between records
    while running or pending is not None:
        launched = None
        if (running and (max_steps is None or step < max_steps)
                and _room(rec, running, max_length, ahead=pending is not None)):
            if on is None:  # the running rows changed: each running row commits its root (leaf 0), the rest nothing
                flags = torch.zeros(rows, dtype=torch.long)
                flags[running] = 1
                on = flags.to(device)
                leaves = on - 1
            lengths = None if choose is None else [n + int(pending is not None) for n in rec.lengths[:rows]]
            best = _queue(backend, roots, parent, leaves, running, kept, step, choose, lengths)
            roots = torch.where(on.bool(), best, roots)
            if kept is not None:
                kept.tokens[:, step].copy_(roots)
            buffer = new_host[step % 2]
            buffer.copy_(roots, non_blocking=True)
            event = torch.cuda.Event() if pinned else None
            if event is not None:
                event.record()
            launched = (buffer, event, list(running))
            step += 1
        if pending is None and launched is None:
            break  # nothing in flight and nothing worth queueing: a bounded run's last step is recorded
        if pending is not None:
            before = len(running)
            rows_recorded, running = _record(pending, rec, running, max_length, backend, stats, row_stats, since)
            if recorded is not None and rows_recorded:
                recorded(rows_recorded, [rec.host[b][-1] for b in rows_recorded])
            since = time.perf_counter()
            if kept is not None:
                for b in rows_recorded:
                    kept.counts[b] += 1
            if len(running) < before:
                on = None
        pending = launched
    if kept is None:
        return PlainRun(running=running, counts=[], tokens=roots.new_zeros(rows, 0), hidden=())
    kept.running = running
    return kept


def _queue(backend, roots: torch.Tensor, parent: torch.Tensor, leaves: torch.Tensor, slots: list[int],
           kept: PlainRun | None = None, column: int = 0, choose: Choose | None = None,
           lengths: list[int] | None = None) -> torch.Tensor:
    """Queue one plain step on the device: the width-1 forward of `roots` [R] (`parent` [R, 1] all -1), its argmax
    (or `choose(logits, lengths, roots)`), and the commit of each row whose leaf (`leaves` [R]) is 0 (-1: nothing);
    the host's lengths advance by one for the runner rows `slots` (those with leaf 0) without reading anything. With
    `kept` (a bounded run) and a runner that keeps hidden states, the forward's states go to column `column` of
    `kept.hidden`. Returns the argmax [R], not yet read."""
    try:
        logits = backend.forward_device(roots.unsqueeze(1), parent)
        best = logits[:, 0].argmax(dim=-1) if choose is None else choose(logits[:, 0], lengths, roots)
        if kept is not None and backend.runner.hidden_layers:
            states = backend.runner.hidden()
            if not kept.hidden:  # allocated at the first step, when the states' sizes are known
                width = kept.tokens.shape[1]
                kept.hidden = tuple(h.new_zeros(h.shape[0], width, h.shape[-1]) for h in states)
            for buffer, h in zip(kept.hidden, states):
                buffer[:, column].copy_(h[:, 0])
        backend.commit_device(leaves)
    except BaseException:
        backend.abort()
        raise
    counts = [0] * roots.shape[0]
    for slot in slots:
        counts[slot] = 1
    backend.finish_commit(counts)  # host bookkeeping only: the device's commit is queued
    return best


def _room(rec: BatchRecorder, running: list[int], max_length: int, ahead: bool) -> bool:
    """Whether a step is worth queueing: some running row is below the length limit even after the step in flight
    (`ahead`) commits its token. (A row may still stop on a criterion; then the queued step is simply not recorded.)"""
    limit = rec.limit(max_length)
    return any(rec.lengths[b] + int(ahead) < limit for b in running)


def _record(pending, rec: BatchRecorder, running: list[int], max_length: int, backend, stats: SpecStats,
            row_stats: list[SpecStats], since: float) -> tuple[list[int], list[int]]:
    """Read a finished step's tokens and record them for the rows that were running when it was queued and still
    are; return those rows, and the rows that go on. `since`: when the step before it was recorded."""
    buffer, event, ran = pending
    if event is not None:
        event.synchronize()
    new = buffer.tolist()
    alive = set(running)
    recorded = [b for b in ran if b in alive]
    rec.append(recorded, [[new[b]] for b in recorded])
    stats.verify_seconds += time.perf_counter() - since
    record_step(stats, row_stats, recorded, [1] * len(recorded), [0] * len(recorded), plain=True)
    return recorded, still_running(rec, running, backend, max_length)
