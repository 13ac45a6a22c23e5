"""The pipelined batch step: drafting, selection, verification, acceptance and the commit stay on the device, and the
host reads each step's committed tokens once, while the device already drafts the next step.

The general batch step (`engine.batch`) reads every row's draft back to the host, budgets and lays out the trees
there, and reads the verify forward's argmax back to walk them: two waits per step, with the device idle while the
host works. For a drafter that drafts every row at once on the device (`supports_device`: EAGLE's batched expansion)
with the captured batched runner and a rule that chooses on the device (greedy, or sampling by the keyed draw, with
context-free processors: `verification.DeviceChoice`), one step here is

    select_device(drafts, width)         # each row's likeliest nodes within the width, laid out as verify trees
    forward_device -> greedy_device      # the verify forward, every node's choice, every row's accepted path
    commit_device(leaves)                # each row's path kept (KV copies, recurrent states rebuilt)
    drafter.accept_device(...)           # the drafter's steps for the committed tokens, from the path's hidden states
    drafts = drafter.propose_device()    # the next step's trees, queued before the host has read anything
    read the committed tokens            # the one wait; stopping criteria, records and statistics on the host

so the host's bookkeeping for step t runs while the device drafts for step t + 1. The small ops around the forward
and the commit (the selection, the acceptance, the ranks and the packing) are two captured passes per width
(`engine.step_graphs`), so a step launches a handful of graphs, not a hundred ops. The width (nodes per row, root
included) is chosen on the host before each step (`budget.choose_width`) from what the batch's own steps measured:
the tokens accepted at each width (`budget.AcceptanceByWidth`: one step at width W measures every narrower width) and
what a drafting step costs beyond its verify forward (its wall time). The drafts are made before the width is known,
so a drafting step verifies the width of most expected tokens per second with that cost counted at every width; once
drafting does not beat plain steps for a few steps in a row, the batch runs a bounded run of plain steps without the
drafter (`engine.plain`), the drafter catches up on their tokens from the hidden states they kept, and the widest
trees are verified again (runs double while the probes do not pay). Rows that stop keep their runner row and commit
nothing. Every committed token is the rule's choice at its position (`verification.greedy_device` over the argmax or
`DeviceChoice`'s draws), as in the general step: the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..config import AssistantConfig
from ..drafters import BatchDrafter
from ..verification import DeviceChoice
from .budget import AcceptanceByWidth, PlainRuns, VerifyCost, choose_width, time_forward
from .outputs import SpecStats
from .plain import Choose, plain_steps
from .rows import BatchRecorder
from .step import record_step, still_running
from .step_graphs import step_graphs

logger = logging.get_logger(__name__)

__all__ = ["PipelineInputs", "pipelines", "run_pipelined"]

# Steps in a row that must find drafting not paying before the batch runs plain steps (one step's estimate is noisy).
PATIENCE = 3
# Plain steps in the first run of plain steps, rounded up to a multiple of the accept pass's width; each run after a
# probe that did not pay is twice the one before, up to the longest. The drafter then catches up on the run's tokens
# and the widest trees are verified again: a batch's acceptance changes as it decodes (on the fixtures it is low for
# the first few steps and rises), so a decision made early must not hold for the rest of the batch. The first run is
# short: a probe that does not pay costs one drafting step, a run that outlasts a low start costs a plain step for
# every token the drafter would have accepted.
PLAIN_RUN = 8
LONGEST_PLAIN_RUN = 128
# Every this many steps a drafting batch verifies its widest trees, which measures every width (`AcceptanceByWidth`).
PROBE_EVERY = 16
# Drafting steps whose cost beyond the verify forward the budget's estimate is the median of.
EXTRA_WINDOW = 9
# Measured seconds of one batched draft, per (drafter's `timing_key`, device, rows, nodes): timed once per process.
_DRAFT_SECONDS: dict[tuple, float] = {}


@dataclass
class PipelineInputs:
    """What the pipelined loop needs besides the drafter and the backend.

    Attributes:
        config: the resolved AssistantConfig. max_length: the generation's. cost: the verify cost model (None: every
            step at the widest tree the budget allows). node_budget: draft nodes per row at most. stats / row_stats:
            the batch's and each row's statistics, appended to. choice: the rule's choice at every node on the device
            (None: greedy over raw logits); seed: a sampling call's; choose: the same rule for plain steps (None: the
            argmax); pads: each row's left padding (None: none).
    """

    config: AssistantConfig
    max_length: int
    cost: VerifyCost | None
    node_budget: int
    stats: SpecStats
    row_stats: list[SpecStats]
    choice: DeviceChoice | None = None
    seed: int | None = None
    choose: Choose | None = None
    pads: list[int] | None = None


def pipelines(drafter: BatchDrafter, backend, on_device: bool, node_budget: int) -> bool:
    """Whether a batch runs the pipelined step: a drafter with device drafting, the batched static runner, a rule
    that chooses on the device (`on_device`: greedy over raw logits, or a `DeviceChoice`), and drafts at all."""
    return getattr(drafter, "supports_device", False) and backend.device_drafts and on_device and node_budget > 0


def run_pipelined(drafter: BatchDrafter, backend, rec: BatchRecorder, running: list[int],
                  inputs: PipelineInputs) -> None:
    """Step the batch until no row runs (see the module docstring); `running` are the rows that still run."""
    runner = backend.runner
    rows, device = runner.rows, runner.device
    config, stats = inputs.config, inputs.stats
    nodes = inputs.node_budget
    path = drafter.max_depth + 1  # the longest accepted path (root included): the accept pass's width
    widest = min(nodes + 1, max(backend.widths))
    pinned = device.type == "cuda"
    # What the host reads each step, in one pinned buffer: each row's committed count, its kept draft nodes and its
    # committed tokens.
    results = torch.zeros(rows, 2 + path, dtype=torch.long, pin_memory=pinned)
    drafts = drafter.propose_device(nodes)
    draft_seconds = 0.0
    if inputs.cost is not None:
        identity = drafter.timing_key()
        key = None if identity is None else (identity, str(device), rows, nodes)
        if key is not None and key in _DRAFT_SECONDS:
            draft_seconds = _DRAFT_SECONDS[key]
        else:
            draft_seconds = time_forward(lambda: drafter.propose_device(nodes), device)
            if key is not None:
                _DRAFT_SECONDS[key] = draft_seconds
    widths = sorted({w for w in backend.widths if w <= widest} | {widest})
    # The budget's inputs are measured as the batch runs. Accepted tokens per width: every step at width W measures
    # every width up to W (`AcceptanceByWidth`); the first step, and every `PROBE_EVERY`-th drafting step after it,
    # verifies the widest tree so that the wide widths' numbers stay current. A drafting step's cost beyond the verify
    # forward (the drafter, the selection and the acceptance on the device, the host's bookkeeping) is the median over
    # the latest drafting steps' wall times (a median: one slow step, a first call's warm-up or the host preempted,
    # must not stop drafting). Once `PATIENCE` steps in a row find that drafting does not beat plain steps, the batch
    # runs `PLAIN_RUN` plain steps, the drafter catches up on them, and the next step verifies the widest trees again
    # with fresh measurements; a probe that does not pay sends the batch back at once, for a run twice as long.
    measured = AcceptanceByWidth(widths)
    limits = torch.tensor([w - 1 for w in measured.widths], dtype=torch.long)
    # The step's select and accept passes (`engine.step_graphs`), captured per width on CUDA; each row's root
    # (its last committed token) lives there.
    graphs = step_graphs(runner, drafts, path, limits)
    graphs.set_choice(inputs.choice, inputs.seed, inputs.pads or [0] * rows)
    graphs.roots.copy_(torch.tensor([rec.host[b][-1] for b in range(rows)], dtype=torch.long))
    _load_seen(graphs, rec, inputs.choice)
    totals_host = torch.zeros(len(measured.widths), dtype=torch.long, pin_memory=pinned)  # and the step's totals
    extras = [draft_seconds]  # seconds beyond the verify forward, per drafting step (the timed draft first)
    extra = draft_seconds
    steps = 0
    runs = PlainRuns(-(-PLAIN_RUN // path) * path, LONGEST_PLAIN_RUN, PATIENCE)
    width, probe = widest, True
    while running:
        if inputs.cost is not None and not probe:
            choice, pays = choose_width(measured.prefix(len(running)), len(running), inputs.cost, config.budget_slack,
                                        None, widths, extra)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("batch step %d: %d rows, accepted per row by width %s, drafting step %.3f ms beyond T, "
                             "T(1) %.3f ms -> width %d, %s", steps, len(running),
                             {w: round(v, 2) for w, v in measured.mean.items()}, extra * 1e3, inputs.cost(1) * 1e3,
                             choice, "pays" if pays else "does not pay")
            run_length = runs.verdict(pays)
            if run_length:
                logger.debug("batch of %d: drafting does not pay (verify and drafter cost against the accepted "
                             "tokens): %d plain steps", len(running), run_length)
                running = _plain_run(drafter, backend, rec, running, inputs, run_length, path)
                if not running:
                    return
                graphs.roots.copy_(torch.tensor([rec.host[b][-1] for b in range(rows)], dtype=torch.long))
                _load_seen(graphs, rec, inputs.choice)
                drafts = drafter.propose_device(nodes)
                measured = AcceptanceByWidth(widths)  # what the batch accepted before the run is out of date
                probe = True
                continue
            width = widest if steps % PROBE_EVERY == 0 else choice
        elif probe:
            width = widest
        probe = False
        t0 = time.perf_counter()
        limit = rec.limit(inputs.max_length)
        on = set(running)
        caps = [min(config.max_depth, limit - rec.lengths[b] - 1) if b in on else 0 for b in range(rows)]
        graphs.set_rows(caps, [b in on for b in range(rows)])
        try:
            graphs.load(drafts)
            graphs.select(width)
            backend.forward_filled(width)
            accepted = graphs.accept(width)
            graphs.remember(accepted, width)
            backend.commit_device(runner.bucket_for(width).leaf)
        except BaseException:
            backend.abort()
            raise
        totals_host.copy_(accepted.totals, non_blocking=True)
        results.copy_(accepted.results, non_blocking=True)
        done = torch.cuda.Event() if pinned else None
        if done is not None:
            done.record()
        # Queued behind the results: the drafter takes the committed steps and drafts the next trees.
        drafter.accept_device(accepted.length, accepted.news, accepted.hidden or None)
        drafts = drafter.propose_device(nodes)
        if done is not None:
            done.synchronize()
        counts, drafted = results[:, 0].tolist(), results[:, 1].tolist()
        table = results[:, 2:].tolist()
        measured.observe(totals_host.tolist(), len(running), width)
        rec.append(running, [table[b][: counts[b]] for b in running])
        backend.finish_commit(counts)
        drafter.advance_host(counts)
        seconds = time.perf_counter() - t0
        over = 0.0
        if inputs.cost is not None:  # what this step cost beyond its verify forward
            over = min(max(seconds - inputs.cost(width), 0.0), seconds)
            extras = (extras + [over])[-EXTRA_WINDOW:]
            extra = sorted(extras)[len(extras) // 2]
        steps += 1
        stats.draft_seconds += over  # the drafter's and the step's own work beyond the verify forward's
        stats.verify_seconds += seconds - over
        record_step(stats, inputs.row_stats, running, [counts[b] for b in running], [drafted[b] for b in running])
        running = still_running(rec, running, backend, inputs.max_length)


def _load_seen(graphs, rec: BatchRecorder, choice) -> None:
    """Each row's tokens seen so far into the step's buffers, where the rule reads the ids (the repetition penalty):
    from the recorder, at the start and after a run of plain steps (which the step's passes did not see)."""
    if choice is not None and choice.ignored_prompt is not None:
        graphs.set_seen(rec.buffer, rec.lengths, choice.ignored_prompt)


def _plain_run(drafter: BatchDrafter, backend, rec: BatchRecorder, running: list[int], inputs: PipelineInputs,
               length: int, path: int) -> list[int]:
    """`length` plain steps (`engine.plain`, no drafter), then the drafter's catch-up on what they committed: its
    accept pass over the run's tokens and the hidden states of their inputs, `path` columns at a time (the width the
    drafting steps' pass has, so no new pass is captured). Returns the rows that still run."""
    run = plain_steps(backend, rec, running, inputs.max_length, inputs.stats, inputs.row_stats, max_steps=length,
                      columns=length, choose=inputs.choose)
    if not run.running:
        return []
    t0 = time.perf_counter()
    for start in range(0, max(run.counts), path):
        chunk = [min(max(count - start, 0), path) for count in run.counts]
        hidden = tuple(h[:, start : start + path] for h in run.hidden) if drafter.target_hidden_layers else None
        counts = torch.tensor(chunk, dtype=torch.long).to(run.tokens.device, non_blocking=True)
        drafter.accept_device(counts, run.tokens[:, start : start + path], hidden)
        drafter.advance_host(chunk)
    inputs.stats.draft_seconds += time.perf_counter() - t0
    return run.running

