"""One verify step over rows of trees, the step every caller drives: `generate` for one request (`engine.loop`, a
batch of one) and for a batch (`engine.batch`), its plain and pipelined strategies' bookkeeping (`engine.plain`,
`engine.pipeline`) and the serving engine (`serving.engine`, each request a row with its own rule and processors;
it launches a step, runs other host work, then finishes it).

    drafts = apply_budget(drafts, cost, config, stats, widths)   # the batch-wide budget: global top-n by value
    step = launch_step(backend, drafts, roots)                   # one verify tree [R, N], every row's in one forward
    done = finish_step(backend, step, rows_verifier(rows))       # each row's accepted path (verify_batch), committed
    record_step(stats, row_stats, running, accepted, drafted)    # the statistics, once (the budget's cost: step_cost)
    running = still_running(rec, running, backend, max_length)   # rows that stopped leave the batch
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers.utils import logging

from ..kernels.tree import ancestor_mask
from ..tree import DraftBatch, VerifyResult, VerifyTree, host_tensor
from ..verification import NodeContexts, RootContexts, StepInputs, batch_choices, choices_apply, process_tree_logits
from .budget import VerifyCost, cached_cost, choose_batch, time_forward
from .outputs import SpecStats, count_arbiter
from .rows import BatchRecorder

logger = logging.get_logger(__name__)

__all__ = ["StepRows", "Choose", "LaunchedStep", "FinishedStep", "apply_budget", "batch_tree", "launch_step",
           "finish_step", "rows_verifier", "verify_batch", "plain_choice", "greedy_rows",
           "record_step", "still_running", "step_cost", "measure_verify_cost", "CALIBRATION_WIDTHS"]

# Widths (nodes per row, root included) at which the eager path's verify cost is measured; a static runner is
# measured at its buckets.
CALIBRATION_WIDTHS = (1, 2, 4, 8, 16, 32)

Choose = Callable[[torch.Tensor, list[int], torch.Tensor], torch.Tensor]
"""A plain step's rule other than the argmax: (logits [R, V] of every runner row, each row's length before the
step's token, padding included, and the step's roots [R] on the device: the last token of each row, which the host
may not have read yet) -> the chosen token of each row [R], on the device, unread."""


@dataclass
class StepRows:
    """What each verified row's rule reads besides the logits.

    Attributes:
        ids: [R] each row's committed ids [1, L_r] (its last token the root; a `drafters.RowTokens` makes them on
            demand), as its processors see them (left padding included).
        verifiers: the rule of every row (one call's), or a list with each row's (serving: each request its own).
        processors: [R] each row's logits processors (None or empty: none).
        raw_greedy: every row greedy over the raw logits (no processors, no scores kept): one argmax for the batch.
        pads: [R] each row's left padding (None: none); the rule sees a row's length without it, as it would alone.
        keys: [R] each row's index in its rule's random stream (its row in its call; None: 0 .. R - 1).
        tree_rows: the rows of the verify tree these are (None: all of them, in order).
    """

    ids: Sequence[torch.Tensor]
    verifiers: object
    processors: list
    raw_greedy: bool = False
    pads: list[int] | None = None
    keys: list[int] | None = None
    tree_rows: list[int] | None = None


def apply_budget(drafts: DraftBatch, cost: VerifyCost | None, config, stats: SpecStats,
                 widths: list[int] | None) -> DraftBatch:
    """The drafts after the batch-wide budget: every node when they fit `max_verify_nodes` and no cost model is in
    use, else the global top-n by value (`budget.choose_batch`)."""
    total = sum(drafts.counts)
    if total == 0 or (cost is None and total <= config.max_verify_nodes):
        return drafts
    if cost is None:
        stats.budget_capped = True
    keep, _ = choose_batch(drafts, cost, config.budget_slack, config.max_verify_nodes, widths)
    if int(keep.sum()) == total:  # every node kept (`keep` lies within the real nodes): nothing to select
        return drafts
    return drafts.select(keep)


def batch_tree(roots: list[int], drafts: DraftBatch, device: torch.device) -> VerifyTree:
    """One verify tree [R, N] on `device` from the rows' roots and drafts, laid out on the host: each row is its root
    and draft (draft node j at index j + 1), padded to the widest row with leaves under the root that nobody commits
    (they attend to the root only, and no real node sees them)."""
    tokens, parents = drafts.verify_inputs(roots)
    return host_or_device_tree(tokens, parents, device)


def host_or_device_tree(tokens: torch.Tensor, parent: torch.Tensor, device: torch.device) -> VerifyTree:
    """A verify tree from host tensors: kept on the host for a backend that stages it itself (the static runner),
    else moved with its ancestor mask and depths worked out on the host (no small launches on the device)."""
    if device.type == "cpu":
        return VerifyTree(tokens=tokens, parent=parent)
    ancestors = ancestor_mask(parent, include_self=True)
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return VerifyTree(tokens=move(tokens), parent=move(parent), _ancestors=move(ancestors),
                      _depth=move(ancestors.sum(-1) - 1))


def _failed_row() -> VerifyResult:
    """A row whose verification failed: it commits its root only, which nobody keeps."""
    return VerifyResult(path=[0], tokens=torch.zeros(0, dtype=torch.long), score_nodes=[0], token_list=[])


def verify_batch(tree: VerifyTree, drafts: DraftBatch, logits: torch.Tensor, rows: StepRows,
                 best: torch.Tensor | None = None, chosen: list | None = None,
                 hidden: tuple[torch.Tensor, ...] | None = None,
                 on_error: Callable[[int | None, BaseException], None] | None = None) -> list[VerifyResult]:
    """Each row's result, for every caller of a step. `logits` [R, >= N', V] are these rows' (a caller's slice, or
    padded past the widest row by a bucket).

    - Greedy over raw logits (`rows.raw_greedy`, or `best` [R, >= N] the argmax already on the host): one argmax, one
      host read, and the accepted paths of every row worked out together (`greedy_rows`).
    - Where each row's choice at a node needs that node's scores, place and context alone
      (`verification.batch_choices`: the exact rule, with any processors, each row its own seed and processors),
      every row's choices at once, walked as greedy's argmax is: one host read for the batch.
    - Otherwise (a lossy rule, drafts sampled from a draft distribution, a rule that reads the forward's `hidden`
      states [R, N, H] per layer) each row's own tree and scores through its rule.

    `chosen` (a list, not with raw greedy) gets each row's processed scores and raw logits [k, V] of the nodes that
    chose its k committed tokens, and their hidden states [k, H] per layer when `hidden` is given (else None).
    `on_error(row, error)`: a row whose processors or rule raise fails alone (it commits its root only, which nobody
    keeps; row None: the one pass over the batch raised, and the rows are verified one by one to find whose); without
    it errors propagate."""
    if best is not None:
        return greedy_rows(drafts, best)
    if rows.raw_greedy:
        return greedy_rows(drafts, logits.argmax(dim=-1).cpu())
    count = drafts.rows
    sampled = [d.probs is not None for d in drafts.drafts] if drafts.drafts is not None else [False] * count
    verifiers = rows.verifiers if isinstance(rows.verifiers, (list, tuple)) else [rows.verifiers] * count
    if hidden is None and choices_apply(verifiers, rows.processors, sampled, contexts=True):
        try:
            at_once = _verify_at_once(tree, drafts, logits, rows, verifiers, sampled, chosen)
        except BaseException as error:
            if on_error is None:
                raise
            on_error(None, error)
            at_once = None
        if at_once is not None:
            return at_once
    results = []
    host_tokens, host_parent = tree.tokens.cpu(), tree.parent.cpu()
    for row in range(count):
        ids, at = rows.ids[row], row if rows.tree_rows is None else rows.tree_rows[row]
        draft = drafts.row(row)
        n = draft.num_nodes + 1
        row_tree = VerifyTree(tokens=host_tokens[at : at + 1, :n], parent=host_parent[at : at + 1, :n], draft=draft)
        try:
            raw = logits[row : row + 1, :n].to(torch.float32)
            scores = process_tree_logits(ids, row_tree, raw, rows.processors[row])
            states = None if hidden is None else tuple(h[row : row + 1, :n] for h in hidden)
            pad = rows.pads[row] if rows.pads else 0
            result = verifiers[row].verify(row_tree, scores, StepInputs(
                ids.shape[1] - pad, states, row if rows.keys is None else rows.keys[row]))
        except BaseException as error:
            if on_error is None:
                raise
            on_error(row, error)
            results.append(_failed_row())
            continue
        if result.token_list is None:
            result.token_list = result.tokens.tolist()
        if chosen is not None:
            nodes = result.score_nodes
            at_nodes = None if states is None else tuple(s[0, nodes] for s in states)
            chosen.append((scores[nodes], raw[0, nodes], at_nodes))
        results.append(result)
    return results


def _verify_at_once(tree: VerifyTree, drafts: DraftBatch, logits: torch.Tensor, rows: StepRows, verifiers: list,
                    sampled: list[bool], chosen: list | None) -> list[VerifyResult] | None:
    """`verify_batch`'s one pass: every row's choices at every node (`batch_choices`), walked by `greedy_rows`; None
    where `batch_choices` declines the rows."""
    # The logits may be cut to the widest row's nodes (a caller's slice) or padded past them (a bucket).
    n = min(logits.shape[1], 1 + drafts.tokens.shape[1])
    count = drafts.rows
    pads = rows.pads
    # Each row's length without its padding (a `RowTokens` knows its lengths without making the views).
    held = getattr(rows.ids, "lengths", None) or [ids.shape[1] for ids in rows.ids]
    lengths = torch.tensor([n - (pads[i] if pads else 0) for i, n in enumerate(held)])
    depth = torch.cat([drafts.depth.new_zeros(count, 1), drafts.depth], dim=1)[:, :n]
    keys = torch.tensor(list(range(count)) if rows.keys is None else list(rows.keys))
    made = batch_choices(verifiers, rows.processors, logits[:, :n], lengths, depth, keys, sampled,
                         torch.tensor(pads) if pads else None, NodeContexts(rows.ids, tree, rows.tree_rows),
                         keep=chosen is not None)
    if made is None:
        return None
    choices, scores = made if chosen is not None else (made, None)
    results = greedy_rows(drafts, choices.cpu())
    if chosen is not None:  # each row's processed scores and raw logits at the nodes that chose its tokens
        for row, result in enumerate(results):
            chosen.append((scores[row, result.score_nodes], logits[row, result.score_nodes].float(), None))
    return results


# ---------------------------------------------------------------------- the verify step
@dataclass
class LaunchedStep:
    """A verify step queued on the device and not read yet (`launch_step`).

    Attributes:
        tree: the verify tree [R, N], root first in each row.
        drafts: the rows' drafts after the budget (a one-row batch's may be None: its caller verifies the tree).
        outputs: the forward's outputs (`backend.VerifyOutputs`: logits [R, >= N, V]; hidden states and attention
            weights where the backend keeps them), unread.
        best: each node's argmax [R, N] on the host, its copy queued behind the forward (`launch_step(best=...)`).
        ready: an event recorded after that copy on CUDA (None elsewhere): `finish_step` waits for this step alone.
    """

    tree: VerifyTree
    drafts: DraftBatch | None
    outputs: object
    best: torch.Tensor | None = None
    ready: object = None


@dataclass
class FinishedStep:
    """A verify step read and committed (`finish_step`).

    Attributes:
        results: each row's accepted path and tokens.
        hidden: the accepted paths' hidden states of the layers the drafter reads (`drafters.BatchHidden`), None
            where the backend keeps none.
    """

    results: list[VerifyResult]
    hidden: object = None


Verify = Callable[[LaunchedStep], list[VerifyResult]]
"""A caller's verification of a launched step: each row's result (`verify_batch` over the step's rows, or one
request's own rule)."""


def launch_step(backend, drafts: DraftBatch | None, roots: list[int] | None = None, tree: VerifyTree | None = None,
                best: torch.Tensor | None = None) -> LaunchedStep:
    """Queue the verify forward of every row's tree: `tree`, or the one `batch_tree` lays out from the rows' `roots`
    and `drafts`. The one place every caller (one request, a batch, the serving engine) reaches the verify forward.

    `best`: a host buffer (pinned on CUDA) of at least R x N elements into which the forward's argmax [R, N] is
    copied behind it, for callers whose rows are all greedy over raw logits. The cache is back out of its tree mode
    if the forward fails."""
    if tree is None:
        tree = batch_tree(roots, drafts, backend.tree_device)
    try:
        outputs = backend.forward(tree)
        ready = None
        if best is not None:
            logits = outputs.logits
            best = best.view(-1)[: logits.shape[0] * logits.shape[1]].view(logits.shape[0], -1)
            best.copy_(logits.argmax(dim=-1), non_blocking=True)
            if logits.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(logits.device))
    except BaseException:
        backend.abort()
        raise
    return LaunchedStep(tree, drafts, outputs, best, ready)


def finish_step(backend, step: LaunchedStep, verify: Verify, overlap: Callable[[], None] | None = None,
                read: Callable[[LaunchedStep, list[VerifyResult]], None] | None = None) -> FinishedStep:
    """Read a launched step and commit it: `overlap()` first (the host's work while the device runs the forward),
    then each row's result (`verify(step)`), what the caller reads off the forward before the commit moves the
    rows' slots (`read(step, results)`: attention rows, log-probabilities, a prefill chunk's last logits), and every
    row's accepted path committed. On failure (a path that is not one, too) the cache leaves its tree mode, nothing
    committed."""
    try:
        if overlap is not None:
            overlap()
        if step.ready is not None:
            step.ready.synchronize()
        results = verify(step)
        if read is not None:
            read(step, results)
        return FinishedStep(results, backend.commit([r.path for r in results]))
    except BaseException:
        backend.abort()  # (a commit that failed has left its tree mode already, or refused before starting)
        raise


def rows_verifier(rows: StepRows, chosen: list | None = None, hidden: bool = False,
                  on_error: Callable[[int | None, BaseException], None] | None = None) -> Verify:
    """A batch's verification of a launched step: `verify_batch` over `rows` (the forward's hidden states handed to
    a rule that reads them when `hidden`; the host argmax where `launch_step` copied it)."""
    return lambda step: verify_batch(step.tree, step.drafts, step.outputs.logits, rows, best=step.best, chosen=chosen,
                                     hidden=step.outputs.hidden_states if hidden else None, on_error=on_error)


def plain_choice(verifier, per_row: list, pads: list[int], kept, rec: BatchRecorder) -> Choose | None:
    """A plain step's rule for a batch that is not greedy over raw logits, where its choice at a position needs that
    position's scores, place and ids alone (`verification.batch_choices`: the exact rule with the processors it
    knows, such as `min_new_tokens` or a repetition penalty; no scores kept for the output): each row's token drawn
    (or taken) as a verify step would at the row's position. None otherwise: every step verifies."""
    if kept is not None or not choices_apply(verifier, per_row, contexts=True):
        return None
    rows, depth = torch.arange(len(per_row)), torch.zeros(len(per_row), 1, dtype=torch.long)
    padding = torch.tensor(pads)

    def choose(logits: torch.Tensor, lengths: list[int], roots: torch.Tensor) -> torch.Tensor:
        unpadded = torch.tensor([n - pad for n, pad in zip(lengths, pads)])
        # The ids a processor reads: each row's ids before its root (recorded already, unless the root is the token of
        # the step in flight, not read yet), then the root: `lengths` counts the root either way.
        contexts = RootContexts(rec.buffer, [n - 1 for n in lengths], roots)
        return batch_choices(verifier, per_row, logits[:, None], unpadded, depth, rows, False, padding,
                             contexts)[:, 0]

    return choose


def greedy_rows(drafts: DraftBatch, best: torch.Tensor) -> list[VerifyResult]:
    """Greedy acceptance of every row at once: `best` [R, >= 1 + M] the target's argmax at each verify-tree node (node
    0 the root, draft node j at j + 1). A draft node is accepted when its token is the argmax at its parent and its
    parent is accepted; each row keeps its deepest accepted node's path (the lowest index among equally deep ones:
    siblings with one token commit the same tokens) and the argmax after it. Exact for any tree: every committed token
    is the target's greedy choice after the committed ones before it.

    One pass over each row's nodes on Python lists (a row's nodes are in topological order, so a parent is decided
    before its children): the trees are host tensors of a few hundred nodes, where a dozen small tensor ops per level
    cost more than the walk (`verification.greedy_device` is the device version, for the pipelined step)."""
    parents, tokens, best_rows = drafts.parents.tolist(), drafts.tokens.tolist(), best.tolist()
    paths, news, width = [], [], 1
    for par, tok, at, count in zip(parents, tokens, best_rows, drafts.counts):
        depth = [0] * count  # 0: not accepted; else the accepted node's depth
        leaf, deepest = -1, 0
        for j in range(count):
            p = par[j]
            if p < 0:
                d = 1 if tok[j] == at[0] else 0
            else:
                d = depth[p] + 1 if depth[p] and tok[j] == at[p + 1] else 0
            if d:
                depth[j] = d
                if d > deepest:
                    leaf, deepest = j, d
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = par[node]
        path.reverse()
        new = [tok[j] for j in path] + [at[leaf + 1]]
        paths.append([0] + [j + 1 for j in path])
        news.append(new)
        width = max(width, len(new))
    # Every row's tokens in one tensor, each result a view of its row (one allocation for the batch).
    table = host_tensor([new + [0] * (width - len(new)) for new in news], np.int64).view(len(news), width)
    return [VerifyResult(path=path, tokens=table[row, : len(new)], score_nodes=path[:], token_list=new)
            for row, (path, new) in enumerate(zip(paths, news))]


def record_step(stats: SpecStats, row_stats: list[SpecStats] | None, rows: Sequence[int], accepted: Sequence[int],
                drafted: Sequence[int], results: Sequence[VerifyResult] | None = None, plain: bool = False) -> None:
    """One verify forward in the statistics: row `rows[i]` committed `accepted[i]` tokens of `drafted[i]` draft
    nodes. `stats` counts the forward once and every row's step (a batch's; one request's own); `row_stats` (a
    batch's, by row) each row's too; `results` carry a lossy rule's arbiter decisions; `plain`: no draft was
    verified."""
    stats.target_forwards += 1
    stats.plain_steps += int(plain)
    for i, b in enumerate(rows):
        own = () if row_stats is None else (row_stats[b],)
        if results is not None:
            count_arbiter(results[i], stats, *own)
        for s in (stats, *own):
            s.accepted_lengths.append(accepted[i])
            s.drafted_tokens.append(drafted[i])
        for s in own:
            s.target_forwards += 1


def still_running(rec: BatchRecorder, running: list[int], backend, max_length: int) -> list[int]:
    """The rows that go on (`BatchRecorder.still_running`); the backend drops the others (it keeps the last row that
    stopped when none goes on: the loop ends)."""
    keep = rec.still_running(running, max_length)
    if len(keep) < len(running) and keep:
        backend.select_rows(keep)
    return [running[j] for j in keep]


def step_cost(config, backend, model, key: tuple) -> VerifyCost | None:
    """The batch-wide budget's cost model: the backend's verify forward timed on first use (`measure_verify_cost`,
    kept per model, device, dtype and `key`: what else it depends on) for `batch_budget="calibrated"`, and for "auto"
    on CUDA; None for "fixed" (each row its own `max_draft_tokens`) and for "auto" elsewhere."""
    mode = config.batch_budget
    if mode == "fixed" or (mode == "auto" and model.device.type != "cuda"):
        return None
    return cached_cost((id(model), str(model.device), str(model.dtype), *key),
                       lambda: measure_verify_cost(backend, model.device))


def measure_verify_cost(backend, device: torch.device) -> VerifyCost:
    """Time verify forwards of one chain per row at the backend's widths (`backend.widths`, or CALIBRATION_WIDTHS)
    on its own cache, each aborted: nothing committed changes. Returns the cost by width (`padded` where the widths
    are the backend's buckets)."""
    count = len(backend.valid)
    widths = list(backend.widths or CALIBRATION_WIDTHS)
    seconds = []
    for width in widths:
        parent = (torch.arange(width) - 1).expand(count, width).clone()
        tree = host_or_device_tree(torch.zeros(count, width, dtype=torch.long), parent, backend.tree_device)

        def run():
            backend.forward(tree)
            backend.abort()

        seconds.append(time_forward(run, device))
    logger.info("verify cost at batch %d: %s", count,
                ", ".join(f"width {w} {s * 1e3:.2f} ms" for w, s in zip(widths, seconds)))
    return VerifyCost(widths=widths, seconds=seconds, padded=backend.widths is not None)
