"""The decode loop for a batch of B > 1 left-padded prompts: per-row trees, acceptance and commits in one forward.

    out = backend.prefill(input_ids, attention_mask)       # the padded prompts, exactly as stock generate runs them
    while rows are running:
        drafts = drafter.propose(running, ...)              # one BatchDrafter: per-row drafters, or one batched one
        drafts = apply_budget(drafts, cost)                 # the batch-wide budget: global top-n by path value
        verified = backend.forward(batch tree)              # every row's tree in one forward, padded to the widest
        results = per-row verification                      # greedy: one argmax and one host read for the batch
        backend.commit(paths)                               # each row keeps its own path; rows right-aligned again
        rows that stopped leave the batch (no more verify work)

The drafter is a `drafters.BatchDrafter`: one drafter per row behind `PerRowDrafters` (suffix tries, n-gram indexes,
assistant caches, a list of the caller's own), or a drafter with a batched form (EAGLE: one tree expansion for all
rows per step; with it, greedy decoding runs the pipelined step of `engine.pipeline`, which keeps all of the above
on the device and reads each step once). On the static path with greedy decoding, a step where no row drafts, and a
batch where no draft could pay, run plain decode steps without the tree machinery (`engine.plain`); and where the
drafts do not pay for their steps as measured (committed tokens per second of the rows furthest from done, which
decide when the call ends, against a plain step's, `budget.DraftingPayoff`: the drafters' values can promise far
more than the text holds, and the budget prices the forward, not the drafter's host work), the batch decodes runs of
plain steps without the drafter between probes (`budget.PlainRuns`, as the pipelined step does), for drafters that
catch up on tokens alone (`catches_up`).

Rows follow stock `generate`'s batch semantics: each row's tokens are what it would generate alone from its
(left-padded) prompt; with an EOS criterion, a row that stops is padded with `pad_token_id` until the longest row
ends; without one, stock keeps decoding stopped rows until every row has stopped, and so does this loop (their extra
tokens are real generations, cut at the length where the last row stopped).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from ..drafters import BatchHidden, DraftBudget, DraftContext, PerRowDrafters, RowTokens
from ..kernels.tree import ancestor_mask
from ..staging import device_busy
from ..tree import DraftBatch, VerifyResult, VerifyTree, empty_draft
from ..verification import (FirstToken, NodeContexts, RootContexts, StepInputs, batch_choices, choices_apply,
                            device_choice, make_verifier, process_tree_logits, row_processors)
from .backend import PREFILL_CHUNK, BatchEagerBackend, chunked_prefill
from .batch_static import BatchStaticBackend
from .budget import DraftingPayoff, PlainRuns, VerifyCost, cached_cost, choose_batch, paying_width, time_forward
from .outputs import CACHE_FIELD, BatchOutputs, SpecStats, SpeculativeDecoderOnlyOutput, count_arbiter, path_attentions
from .pipeline import LONGEST_PLAIN_RUN, PATIENCE, PLAIN_RUN, PipelineInputs, pipelines, run_pipelined
from .plain import Choose, plain_step, plain_steps, runs_plain
from .request import Request
from .rows import BatchRecorder

logger = logging.get_logger(__name__)

__all__ = ["decode_batch", "measure_verify_cost", "batch_tree", "verify_rows", "greedy_rows", "apply_budget",
           "batch_buckets"]

# Widths (nodes per row, root included) at which the eager path's verify cost is measured; a static runner is
# measured at its buckets.
CALIBRATION_WIDTHS = (1, 2, 4, 8, 16, 32)
# Widths the batched static runner captures besides the config's buckets.
NARROW_BUCKETS = (1, 2, 4)


def decode_batch(request: Request):
    """Run a batch request (`request.input_ids` [B, L], `request.batch_drafter` its drafter) to the end. Returns
    what stock `generate` returns for a batch: sequences [B, L + new] (stopped rows padded), or with
    `return_dict_in_generate` a `SpeculativeDecoderOnlyOutput` with `spec_stats` (per row in `spec_stats.rows`)."""
    start = time.perf_counter()
    model, config, gen = request.model, request.config, request.generation_config
    drafter = request.batch_drafter
    input_ids = request.input_ids
    device = input_ids.device
    rows, prompt_length = input_ids.shape
    mask = request.model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(device)
    pads = (mask == 0).sum(-1).tolist()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    verifier = _batch_verifier(config, bool(gen.do_sample), drafter)
    if verifier.wants_empty_drafts and isinstance(drafter, PerRowDrafters):
        drafter.ask_empty = True  # the rule reads the draft's own choice after the root (`propose_within`)
    pad = getattr(gen, "_pad_token_tensor", None)
    pad = gen.pad_token_id if pad is None else int(pad)
    rec = BatchRecorder(input_ids, request.stopping, _has_eos_criterion(request.stopping), pad, gen.max_length)
    row_stats = [SpecStats(prefill_tokens=prompt_length - pads[b]) for b in range(rows)]
    stats = SpecStats(prefill_tokens=int(mask.sum()), rows=row_stats)
    layers = tuple(drafter.target_hidden_layers)
    processors = request.processors
    # output_scores / output_logits / output_hidden_states / output_attentions: each row's, from every step's
    # verification (no plain fast paths; hidden states and attentions from the eager backend, whose forwards return
    # them all).
    want_states = bool(gen.return_dict_in_generate and gen.output_hidden_states)
    want_attentions = bool(gen.return_dict_in_generate and gen.output_attentions)
    if (want_states or want_attentions) and config.compile:
        raise NotImplementedError("output_attentions / output_hidden_states need the eager path: the static path's "
                                  "captured forward returns neither; pass AssistantConfig(compile=False) or leave "
                                  "compile='auto'")
    kept = None
    if gen.return_dict_in_generate and (gen.output_scores or gen.output_logits or want_states or want_attentions):
        kept = BatchOutputs(rows, bool(gen.output_scores), bool(gen.output_logits), want_states, want_attentions)
    raw_greedy = verifier.raw_greedy and not processors and kept is None
    node_budget = min(config.max_draft_tokens, config.max_verify_nodes)
    stats.budget_capped = node_budget < config.max_draft_tokens
    all_hidden = verifier.uses_target_hidden or want_states
    backend = _backend(request, layers, node_budget, all_hidden, want_attentions)
    if backend.widths:
        node_budget = min(node_budget, max(backend.widths) - 1)
    try:
        # ---- prefill, the first token of every row, the drafter begun on the rows
        if chunked_prefill(config.prefill, rows, prompt_length) and backend.prefills_chunked:
            out = backend.prefill(input_ids, mask, positions, chunked=True)  # the prompts through the captured forward
        else:
            out = backend.prefill(input_ids, mask, positions)
        logits = out.logits[:, -1].to(dtype=torch.float32)
        prefilled = device_busy(device)  # the prefill is queued, not read: the drafter's set-up may run meanwhile
        scores = processors(input_ids, logits.clone()) if processors else logits
        draft_forward = partial(_draft_forward, backend) if backend.draft_forwards else None
        context = DraftContext(model, backend.cache, request.adapter, gen, None, draft_forward)
        hidden = None
        if layers:
            hidden = BatchHidden(layers, tuple(out.hidden_states[i] for i in layers), pads,
                                 [prompt_length - p for p in pads])
        drafter.begin([input_ids[b : b + 1, pads[b] :] for b in range(rows)], context, hidden)
        drafter.idle(prefilled)  # what it deferred of its set-up (suffix tries over prompts) while the prefill runs
        # Each row's first token as the row alone would get it (an arbitrated rule asks the row's own drafter).
        firsts = [verifier.first_token(scores[b : b + 1], FirstToken(input_ids[b : b + 1, pads[b] :], _row_drafter(
            drafter, b), context, None, _row_outputs(out, b, verifier), node_budget, b)) for b in range(rows)]
        rec.append(list(range(rows)), [first.token_list for first in firsts])
        for b, first in enumerate(firsts):
            count_arbiter(first, stats, row_stats[b])
            if kept is not None:
                kept.add(b, scores[b : b + 1], logits[b : b + 1], 1)
        if want_states:
            kept.prompt_states = tuple(out.hidden_states)
        if want_attentions:
            kept.prompt_attentions = tuple(out.attentions)
        everyone = list(range(rows))
        drafter.accept(everyone, _row_tokens(rec, everyone, pads),
                       [VerifyResult(path=[0], tokens=f.tokens, score_nodes=[0], token_list=f.token_list)
                        for f in firsts], None)
        del out, logits, scores, firsts, hidden
        per_row = [row_processors(processors, b) for b in range(rows)]
        # Plain steps choose by the argmax (greedy over raw logits) or by the rule's choice at each row's position
        # (sampling, or greedy, with context-free processors); otherwise a batch verifies every step.
        choose = None if raw_greedy else _plain_choice(verifier, per_row, pads, kept, rec)
        choosable = raw_greedy or choose is not None
        # The same rule on the device, for the pipelined step (sampling, context-free processors).
        choice = None if raw_greedy or kept is not None else device_choice(verifier, processors)
        cost = _cost_model(config, backend, model, rows)
        if cost is not None:  # the widest tree that could pay even if every draft node were accepted
            node_budget = min(node_budget, paying_width(cost, rows, config.budget_slack, backend.widths) - 1)
        running = _still_running(everyone, rec, backend, gen.max_length)
        stats.setup_seconds = time.perf_counter() - start
        if node_budget == 0 and runs_plain(backend, choosable):
            # No draft can pay for its verification at this batch size: plain decode steps (`engine.plain`).
            plain_steps(backend, rec, running, gen.max_length, stats, row_stats, choose=choose)
            running = []
        elif pipelines(drafter, backend, raw_greedy or choice is not None, node_budget):
            # Drafting, verification and the commit on the device, one read per step (`engine.pipeline`).
            run_pipelined(drafter, backend, rec, running, PipelineInputs(
                config, gen.max_length, cost, node_budget, stats, row_stats, choice, getattr(verifier, "seed", None),
                choose, pads))
            running = []

        # ---- draft, budget, verify, commit, record
        # Steps where no row drafts run as plain steps on the static path, unless the drafter reads the verify
        # forward's hidden states (a plain step returns none).
        fast_plain = runs_plain(backend, choosable) and not layers
        # Drafting against plain steps as measured, where a plain run can leave the drafter out (see the docstring).
        payoff = runs = None
        if fast_plain and cost is not None and node_budget > 0 and drafter.catches_up:
            payoff = DraftingPayoff(cost, config.budget_slack)
            runs = PlainRuns(PLAIN_RUN, LONGEST_PLAIN_RUN, PATIENCE)

        def overlap() -> None:
            """The host's idle time while the device runs a step's forward: the drafter's deferred bookkeeping."""
            drafter.overlap()
            drafter.idle(device_busy(device))

        while running:
            limit = rec.limit(gen.max_length)
            t0 = time.perf_counter()
            if payoff is not None:
                # Until drafting has paid for its steps, the drafter's deferred bookkeeping (a row's suffix trie over
                # its prompt and what plain runs committed) gets a plain step's time per step and the host's idle
                # time: a batch whose drafts do not pay must not pay for their bookkeeping either.
                drafter.limit_host(None if payoff.proven() else cost(1))
            if node_budget > 0:
                budgets = [DraftBudget(max_nodes=node_budget, max_depth=min(config.max_depth, limit - rec.lengths[b] - 1))
                           for b in running]
                drafts = drafter.propose(running, _row_tokens(rec, running, pads), budgets)
            else:
                drafts = DraftBatch.from_drafts([empty_draft(1)] * len(running))
            drafts = apply_budget(drafts, cost, config, stats, backend.widths)
            t1 = time.perf_counter()
            attentions = None  # each row's attention rows, when asked for (the verify step below)
            if fast_plain and not any(drafts.counts):
                # No row drafts: a plain step without the tree machinery (`engine.plain`).
                news, on_device = plain_step(backend, [rec.host[b][-1] for b in running], overlap, choose,
                                             None if choose is None else rec.lengths[:rows])
                results = [VerifyResult(path=[0], tokens=on_device[i : i + 1], score_nodes=[0], token_list=[t])
                           for i, t in enumerate(news)]
                hidden = None
            else:
                tree = batch_tree([rec.host[b][-1] for b in running], drafts, backend.tree_device)
                verified = backend.forward(tree)
                try:
                    overlap()
                    chosen = [] if kept is not None else None
                    results = verify_rows(tree, drafts, verified.logits, _row_tokens(rec, running), verifier,
                                          [per_row[b] for b in running], raw_greedy, chosen,
                                          [pads[b] for b in running], verified.hidden_states if all_hidden else None,
                                          running)
                except BaseException:
                    backend.abort()
                    raise
                if want_attentions:  # each row's, before the commit moves the rows' committed slots
                    attentions = [path_attentions(verified.attentions, i, r.path, r.score_nodes, backend.slots,
                                                  backend.valid[i], pads[b])
                                  for i, (b, r) in enumerate(zip(running, results))]
                del verified
                hidden = backend.commit([r.path for r in results])
            before = [rec.lengths[b] for b in running]
            rec.append(running, [r.token_list for r in results])
            if kept is not None:
                for i, b in enumerate(running):
                    row_scores, row_logits, row_states = chosen[i]
                    kept.add(b, row_scores, row_logits, rec.lengths[b] - before[i], row_states,
                             None if attentions is None else attentions[i])
            t2 = time.perf_counter()
            stats.target_forwards += 1
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            stats.plain_steps += int(not any(drafts.counts))
            for b, drafted, result in zip(running, drafts.counts, results):
                count_arbiter(result, stats, row_stats[b])
                accepted = len(result.token_list)
                for s in (stats, row_stats[b]):
                    s.accepted_lengths.append(accepted)
                    s.drafted_tokens.append(drafted)
                row_stats[b].target_forwards += 1
            drafter.accept(running, _row_tokens(rec, running, pads), results, hidden)
            running = _still_running(running, rec, backend, gen.max_length)
            if payoff is not None:
                payoff.observe_rows([len(r.token_list) for r in results], [limit - n for n in before],
                                    1 + max(drafts.counts, default=0), time.perf_counter() - t0)
                length = runs.verdict(payoff.pays())
                if length and running:
                    logger.debug("batch of %d: drafts do not pay for their steps (%.0f tokens per row and second "
                                 "against %.0f plain): %d plain steps", len(running), payoff.rate,
                                 1.0 / cost(1), length)
                    running = _plain_run(drafter, backend, rec, running, gen.max_length, stats, row_stats, length,
                                         choose)
                    payoff.restart()
        drafter.end(_row_tokens(rec, list(range(rows)), pads))
    finally:
        backend.release()
    length = max(rec.lengths) if rec.truncate else min(rec.limit(gen.max_length), max(rec.lengths))
    sequences = rec.sequences(length)
    logger.info("speculative_generate: batch of %d, %d target forwards (mean accepted length %.2f per row)", rows,
                stats.target_forwards, stats.mean_accepted_length)
    if not gen.return_dict_in_generate:
        return sequences
    scores, logits, states, attentions = (kept.outputs(length - prompt_length, pad) if kept is not None
                                          else (None, None, None, None))
    # The batch's cache is not returned: its rows sit at different lengths (right-aligned by the eager backend, with
    # finished rows removed), so it is no cache stock generate could continue from.
    return SpeculativeDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, hidden_states=states,
                                        attentions=attentions, spec_stats=stats, **{CACHE_FIELD: None})


def _plain_choice(verifier, per_row: list, pads: list[int], kept, rec: BatchRecorder) -> Choose | None:
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
        # The ids a repetition penalty reads: what the host has recorded, and each row's root (the step in flight's
        # token, not read yet).
        contexts = RootContexts(rec.buffer, list(rec.lengths), roots)
        return batch_choices(verifier, per_row, logits[:, None], unpadded, depth, rows, False, padding,
                             contexts)[:, 0]

    return choose


def _plain_run(drafter, backend, rec: BatchRecorder, running: list[int], max_length: int, stats: SpecStats,
               row_stats: list[SpecStats], length: int, choose: Choose | None = None) -> list[int]:
    """`length` plain steps without the drafter (`engine.plain`); the drafter catches up on each step's tokens while
    the device runs the next. Returns the rows that still run."""
    spent = [0.0]

    def catch_up(rows: list[int], tokens: list[int]) -> None:
        # Queued only, for a drafter that defers its bookkeeping (`limit_host`): settling here, while the device
        # computes the step in flight, held the next step's launch until that step ended, and even bounded to half a
        # plain step it cost more than the rows it caught up won back (both measured on a GPU).
        t0 = time.perf_counter()
        drafter.catch_up(rows, [[t] for t in tokens])
        spent[0] += time.perf_counter() - t0

    run = plain_steps(backend, rec, running, max_length, stats, row_stats, max_steps=length, recorded=catch_up,
                      choose=choose)
    stats.draft_seconds += spent[0]
    return run.running


def _backend(request: Request, layers: tuple[int, ...], node_budget: int, all_hidden: bool = False,
             attentions: bool = False):
    """The static batched runner (CUDA graphs) when the config compiles, else the eager batched backend; both return
    the hidden states of `layers` for drafters that read them (EAGLE). A rule that reads the target's hidden states
    (`all_hidden`: a CoSpec arbiter over them) runs on the eager backend, whose forwards return them all, and so do
    the attention weights (`attentions`)."""
    config, model = request.config, request.model
    if not config.compile or request.batch_drafter.drafts_on_target or all_hidden or attentions:
        # A drafter that restricts the target's own forward needs forwards the model runs as it is at the call.
        return BatchEagerBackend(model, layers, all_hidden, attentions)
    buckets = batch_buckets(config.compile_buckets, node_budget)
    if chunked_prefill(config.prefill, *request.input_ids.shape):  # the prompts' chains: a bucket of their width
        buckets = tuple(sorted(set(buckets) | {PREFILL_CHUNK}))
    static_length = request.generation_config.max_length + max(buckets)
    return BatchStaticBackend(model, request.input_ids.shape[0], static_length, buckets, owner=request,
                              hidden_layers=layers, fuse=config.compile_verify)


def _batch_verifier(config, do_sample: bool, drafter):
    """The batch's rule, built as one request's with the first row's drafter (an arbitrated rule turns its next-token
    distributions on, or refuses a drafter without them) and every other row's drafter set alike: each row is decided
    as it would be alone. A named batched drafter reports no distributions (None: as a drafter without them)."""
    first = _row_drafter(drafter, 0)
    verifier = make_verifier(config, do_sample, first)
    if isinstance(drafter, PerRowDrafters) and hasattr(first, "next_probs"):
        for row in drafter.drafters[1:]:
            if hasattr(row, "next_probs"):
                row.next_probs = first.next_probs
    return verifier


def _row_outputs(out, row: int, verifier) -> CausalLMOutputWithPast | None:
    """Row `row`'s part of the prefill's outputs, for a rule that reads the target's hidden states (else None): its
    hidden states [1, L, H] per layer (left-padded, its last position its last prompt token)."""
    if not verifier.uses_target_hidden:
        return None
    return CausalLMOutputWithPast(hidden_states=tuple(h[row : row + 1] for h in out.hidden_states))


def _row_drafter(drafter, row: int):
    """Row `row`'s own drafter (one per row), or None for a batched drafter."""
    return drafter.drafters[row] if isinstance(drafter, PerRowDrafters) else None


def _draft_forward(backend, roots: list[int], drafts: DraftBatch) -> torch.Tensor:
    """`DraftContext.draft_forward` on the eager backend: the running rows' trees through the target as it is (a
    drafter may have restricted it), then the cache back to its committed state. Returns the logits [R, N, V]."""
    try:
        return backend.forward(batch_tree(roots, drafts, backend.tree_device)).logits
    finally:
        backend.abort()


def batch_buckets(compile_buckets: tuple[int, ...], node_budget: int) -> tuple[int, ...]:
    """The tree widths (root included) a batched static runner captures: the configured buckets up to the first that
    holds a full row (`node_budget` drafts and the root; no larger tree can come), plus narrow ones: with many rows a
    step of width 8 costs 8 tokens per row, where the budget often wants one (a plain decode step) or two."""
    needed = next((b for b in compile_buckets if b >= node_budget + 1), max(compile_buckets))
    return tuple(sorted({b for b in compile_buckets if b <= needed} | set(NARROW_BUCKETS)))


def _row_tokens(rec: BatchRecorder, rows: list[int], pads: list[int] | None = None) -> RowTokens:
    """Rows `rows`' committed tokens, without their left padding when `pads` is given (each a view made on demand)."""
    starts = [0] * len(rows) if pads is None else [pads[b] for b in rows]
    return RowTokens(lambda i: rec.ids(rows[i], starts[i]), [rec.lengths[b] - s for b, s in zip(rows, starts)])


def _has_eos_criterion(stopping) -> bool:
    """Whether stock generate pads stopped rows: it does when an EOS criterion is among the stopping criteria."""
    return any(hasattr(c, "eos_token_id") for c in stopping)


def _still_running(running: list[int], rec: BatchRecorder, backend, max_length: int) -> list[int]:
    """The rows that go on (`BatchRecorder.still_running`); the backend drops the others."""
    keep = rec.still_running(running, max_length)
    if len(keep) < len(running) and keep:
        backend.select_rows(keep)
    return [running[j] for j in keep]


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
    return _host_or_device_tree(tokens, parents, device)


def _host_or_device_tree(tokens: torch.Tensor, parent: torch.Tensor, device: torch.device) -> VerifyTree:
    """A verify tree from host tensors: kept on the host for a backend that stages it itself (the static runner),
    else moved with its ancestor mask and depths worked out on the host (no small launches on the device)."""
    if device.type == "cpu":
        return VerifyTree(tokens=tokens, parent=parent)
    ancestors = ancestor_mask(parent, include_self=True)
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return VerifyTree(tokens=move(tokens), parent=move(parent), _ancestors=move(ancestors),
                      _depth=move(ancestors.sum(-1) - 1))


def verify_rows(tree: VerifyTree, drafts: DraftBatch, logits: torch.Tensor, row_ids: Sequence[torch.Tensor],
                verifier, processors: list, raw_greedy: bool, chosen: list | None = None,
                pads: list[int] | None = None, hidden: tuple[torch.Tensor, ...] | None = None,
                batch_rows: Sequence[int] | None = None) -> list[VerifyResult]:
    """Each row's result. Greedy over raw logits: one argmax over [R, N, V], one host read, and the accepted paths
    of every row worked out together (`greedy_rows`); else the row's own tree and scores through the rule (its
    processors see the row's ids, as stock generate's do; the rule sees the row's length without its `pads`, as it
    would alone, and the forward's `hidden` states [R, N, H] per layer, for a rule that reads them). `chosen` (a list,
    not with `raw_greedy`) gets each row's processed scores and raw logits [k, V] of the nodes that chose its k
    committed tokens, and their hidden states [k, H] per layer when `hidden` is given (else None). `batch_rows`: each
    row's index in its batch, for the rule (default: its place in `row_ids`).

    Where the rule's choice at a node needs that node's scores, place and context alone (`verification.batch_choices`:
    the exact rule, with any processors), every row's choices are made at once and walked as greedy's argmax is: one
    host read for the batch (`chosen` from the same pass)."""
    if raw_greedy:
        return greedy_rows(drafts, logits.argmax(dim=-1).cpu())
    sampled = drafts.drafts is not None and any(d.probs is not None for d in drafts.drafts)
    if hidden is None and choices_apply(verifier, processors, sampled, contexts=True):
        # The logits may be cut to the widest row's nodes (a caller's slice) or padded past them (a bucket).
        n = min(logits.shape[1], 1 + drafts.tokens.shape[1])
        lengths = torch.tensor([ids.shape[1] - (pads[i] if pads else 0) for i, ids in enumerate(row_ids)])
        depth = torch.cat([drafts.depth.new_zeros(drafts.rows, 1), drafts.depth], dim=1)[:, :n]
        rows = torch.tensor(list(range(len(row_ids))) if batch_rows is None else list(batch_rows))
        made = batch_choices(verifier, processors, logits[:, :n], lengths, depth, rows, sampled,
                             torch.tensor(pads) if pads else None, NodeContexts(row_ids, tree), keep=chosen is not None)
        choices, scores = made if chosen is not None else (made, None)
        results = greedy_rows(drafts, choices.cpu())
        if chosen is not None:  # each row's processed scores and raw logits at the nodes that chose its tokens
            for row, result in enumerate(results):
                chosen.append((scores[row, result.score_nodes], logits[row, result.score_nodes].float(), None))
        return results
    results = []
    host_tokens, host_parent = tree.tokens.cpu(), tree.parent.cpu()
    for row, (ids, row_procs) in enumerate(zip(row_ids, processors)):
        draft = drafts.row(row)
        n = draft.num_nodes + 1
        row_tree = VerifyTree(tokens=host_tokens[row : row + 1, :n], parent=host_parent[row : row + 1, :n], draft=draft)
        raw = logits[row : row + 1, :n].to(torch.float32)
        scores = process_tree_logits(ids, row_tree, raw, row_procs)
        states = None if hidden is None else tuple(h[row : row + 1, :n] for h in hidden)
        result = verifier.verify(row_tree, scores, StepInputs(ids.shape[1] - (pads[row] if pads else 0), states,
                                                              row if batch_rows is None else batch_rows[row]))
        if result.token_list is None:
            result.token_list = result.tokens.tolist()
        if chosen is not None:
            nodes = result.score_nodes
            at_nodes = None if states is None else tuple(s[0, nodes] for s in states)
            chosen.append((scores[nodes], raw[0, nodes], at_nodes))
        results.append(result)
    return results


def greedy_rows(drafts: DraftBatch, best: torch.Tensor) -> list[VerifyResult]:
    """Greedy acceptance of every row at once: `best` [R, >= 1 + M] the target's argmax at each verify-tree node (node
    0 the root, draft node j at j + 1). A draft node is accepted when its token is the argmax at its parent and its
    parent is accepted; each row keeps its deepest accepted node's path (the lowest index among equally deep ones:
    siblings with one token commit the same tokens) and the argmax after it. Exact for any tree: every committed token
    is the target's greedy choice after the committed ones before it.

    One pass over each row's nodes on Python lists (a row's nodes are in topological order, so a parent is decided
    before its children): the trees are host tensors of a few hundred nodes, where a dozen small tensor ops per level
    cost more than the walk (`engine.pipeline`'s `greedy_device` is the device version)."""
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
    table = torch.tensor([new + [0] * (width - len(new)) for new in news], dtype=torch.long)
    return [VerifyResult(path=path, tokens=table[row, : len(new)], score_nodes=path[:], token_list=new)
            for row, (path, new) in enumerate(zip(paths, news))]


# ---------------------------------------------------------------------- the verify cost model
def _cost_model(config, backend, model, rows: int) -> VerifyCost | None:
    """The cost model the budget uses: measured on first use (per model, device, batch size and context) for
    `batch_budget="calibrated"`, and for "auto" on CUDA; none for "fixed" (each row its own `max_draft_tokens`)."""
    mode = config.batch_budget
    if mode == "fixed" or (mode == "auto" and model.device.type != "cuda"):
        return None
    context = 1 << max(backend.slots - 1, 1).bit_length()  # the context length, to the next power of two
    key = (id(model), str(model.device), str(model.dtype), rows, context, type(backend).__name__)
    return cached_cost(key, lambda: measure_verify_cost(backend, model.device))


def measure_verify_cost(backend, device: torch.device) -> VerifyCost:
    """Time verify forwards of one chain per row at the backend's widths (`backend.widths`, or CALIBRATION_WIDTHS)
    on its own cache, each aborted: nothing committed changes. Returns the cost by width (`padded` where the widths
    are the backend's buckets)."""
    rows = len(backend.valid)
    widths = list(backend.widths or CALIBRATION_WIDTHS)
    seconds = []
    for width in widths:
        parent = (torch.arange(width) - 1).expand(rows, width).clone()
        tree = _host_or_device_tree(torch.zeros(rows, width, dtype=torch.long), parent, backend.tree_device)

        def run():
            backend.forward(tree)
            backend.abort()

        seconds.append(time_forward(run, device))
    logger.info("verify cost at batch %d: %s", rows,
                ", ".join(f"width {w} {s * 1e3:.2f} ms" for w, s in zip(widths, seconds)))
    return VerifyCost(widths=widths, seconds=seconds, padded=backend.widths is not None)
