"""The decode loop for a batch of B > 1 left-padded prompts: per-row trees, acceptance and commits in one forward.

    out = backend.prefill(input_ids, attention_mask)       # the padded prompts, exactly as stock generate runs them
    while rows are running:
        drafts = drafter.propose(running, ...)              # one BatchDrafter: per-row drafters, or one batched one
        drafts = apply_budget(drafts, cost)                 # the batch-wide budget: global top-n by path value
        step = launch_step(backend, drafts, roots)          # every row's tree in one forward, padded to the widest
        finish_step(backend, step, rows_verifier(rows))     # each row's path (greedy: one argmax, one host read);
                                                            # each row keeps its own path; rows right-aligned again
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
from functools import partial

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from ..drafters import BatchHidden, DraftBudget, DraftContext, PerRowDrafters, RowTokens
from ..staging import device_busy
from ..tree import DraftBatch, VerifyResult, empty_draft
from ..verification import FirstToken, device_choice, make_verifier, row_processors
from .backend import PREFILL_CHUNK, BatchEagerBackend, chunked_prefill
from .batch_static import BatchStaticBackend
from .budget import DraftingPayoff, PlainRuns, VerifyCost, paying_width
from .outputs import CACHE_FIELD, BatchOutputs, SpecStats, SpeculativeDecoderOnlyOutput, count_arbiter, path_attentions
from .pipeline import LONGEST_PLAIN_RUN, PATIENCE, PLAIN_RUN, PipelineInputs, pipelines, run_pipelined
from .plain import Choose, plain_step, plain_steps, runs_plain
from .request import Request
from .rows import BatchRecorder
from .step import (StepRows, apply_budget, batch_tree, finish_step, launch_step, plain_choice, record_step,
                   rows_verifier, step_cost, still_running)

logger = logging.get_logger(__name__)

__all__ = ["decode_batch", "batch_buckets"]

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
        choose = None if raw_greedy else plain_choice(verifier, per_row, pads, kept, rec)
        choosable = raw_greedy or choose is not None
        # The same rule on the device, for the pipelined step (sampling, context-free processors).
        choice = None if raw_greedy or kept is not None else device_choice(verifier, processors)
        cost = _cost_model(config, backend, model, rows)
        if cost is not None:  # the widest tree that could pay even if every draft node were accepted
            node_budget = min(node_budget, paying_width(cost, rows, config.budget_slack, backend.widths) - 1)
        running = still_running(rec, everyone, backend, gen.max_length)
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
                budgets = [DraftBudget(max_nodes=node_budget,
                                       max_depth=min(config.max_depth, limit - rec.lengths[b] - 1)) for b in running]
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
                step = launch_step(backend, drafts, [rec.host[b][-1] for b in running])
                chosen = [] if kept is not None else None
                step_rows = StepRows(_row_tokens(rec, running), verifier, [per_row[b] for b in running],
                                     raw_greedy, [pads[b] for b in running], running)

                def read(step, results):  # each row's attention rows, before the commit moves its committed slots
                    nonlocal attentions
                    attentions = [path_attentions(step.outputs.attentions, i, r.path, r.score_nodes, backend.slots,
                                                  backend.valid[i], pads[b])
                                  for i, (b, r) in enumerate(zip(running, results))]

                finished = finish_step(backend, step, rows_verifier(step_rows, chosen, all_hidden), overlap,
                                       read if want_attentions else None)
                del step
                results, hidden = finished.results, finished.hidden
            before = [rec.lengths[b] for b in running]
            rec.append(running, [r.token_list for r in results])
            if kept is not None:
                for i, b in enumerate(running):
                    row_scores, row_logits, row_states = chosen[i]
                    kept.add(b, row_scores, row_logits, rec.lengths[b] - before[i], row_states,
                             None if attentions is None else attentions[i])
            t2 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            accepted = [len(r.token_list) for r in results]
            record_step(stats, row_stats, running, accepted, drafts.counts, results, plain=not any(drafts.counts))
            drafter.accept(running, _row_tokens(rec, running, pads), results, hidden)
            running = still_running(rec, running, backend, gen.max_length)
            if payoff is not None:
                payoff.observe_rows(accepted, [limit - n for n in before],
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


# ---------------------------------------------------------------------- the verify cost model
def _cost_model(config, backend, model, rows: int) -> VerifyCost | None:
    """The budget's cost model (`step.step_cost`), per batch size and context length (to the next power of two)."""
    context = 1 << max(backend.slots - 1, 1).bit_length()
    return step_cost(config, backend, model, (rows, context, type(backend).__name__))
