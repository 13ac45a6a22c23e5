"""The decode loop: prefill, then draft -> verify -> accept -> commit -> record until a stopping criterion fires.

    out = backend.prefill(prompt)                           # exactly as stock generate runs the prompt
    first = verifier.first_token(scores)                    # the drafter begun on the prompt beforehand
    while not recorder.finished:
        draft = drafter.propose(committed, budget)           # a token tree hanging off the root (last token)
        step = launch_step(backend, tree=root + draft)       # one forward; recurrent layers solve the tree exactly
        done = finish_step(backend, step, verify)            # greedy / lossless sampling / an opt-in lossy rule, then
                                                             # keep the accepted path's KV, rebuild its recurrent state
        recorder.append(result.tokens); drafter.accept(...)  # stopping criteria, streamer, outputs; the drafter learns

`decode` runs one request (`Request`); `speculative_generate` (the API) builds the request from what transformers'
`generate` prepared. It runs on the batch's backends as a batch of one (`backend.BatchEagerBackend`, or
`batch_static.BatchStaticBackend` on a one-row runner); they and the verification rule (`verification/`) are the only
things that vary. Greedy over raw logits and the one-pass choice (`verification.verify_at_once`) verify the tree
directly; anything else (kept scores, lossy rules, sampled drafts, a rule that reads hidden states) goes through the
batch step's `step.verify_batch` as a batch of one.
"""

from __future__ import annotations

import time

import torch
from transformers.utils import logging

from ..cache import CommittedState, committed_length, export_committed
from ..config import AssistantConfig
from ..drafters import DraftBudget, DraftContext
from ..staging import device_busy
from ..tree import DraftBatch, VerifyResult, build_verify_tree
from ..verification import (FirstToken, StepInputs, Verifier, choices_apply, make_verifier, row_processors,
                            verify_at_once)
from .backend import PREFILL_CHUNK, BatchEagerBackend, chunked_prefill
from .batch_static import BatchStaticBackend
from .outputs import (
    CACHE_FIELD,
    Recorder,
    SpecStats,
    SpeculativeDecoderOnlyOutput,
    count_arbiter,
    path_attentions,
    path_outputs,
    prompt_outputs,
    target_hidden,
)
from .request import Request, propose
from .step import LaunchedStep, StepRows, finish_step, launch_step, record_step, verify_batch

logger = logging.get_logger(__name__)

__all__ = ["Request", "decode", "PROMPT_INPUTS", "continued_state", "multimodal_prompt"]

# Inputs of a multimodal prompt, for its prefill only (as stock decoding drops them after the first forward):
# transformers runs the vision encoder before decoding and passes its outputs as `mm_encoder_outputs`.
PROMPT_INPUTS = {"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids",
                 "mm_encoder_outputs"}


def decode(request: Request):
    """Run `request` to the end. Returns what stock `generate` would: the sequences [1, L + new], or with
    `return_dict_in_generate` a `SpeculativeDecoderOnlyOutput` (scores / logits / attentions / hidden states when
    asked, the cache, `spec_stats`). One row: a batch (B > 1) goes through `engine.batch.decode_batch`."""
    if request.input_ids.shape[0] != 1:
        raise ValueError(f"decode runs one row, got {request.input_ids.shape[0]}: use engine.batch.decode_batch")
    model, config, drafter, gen = request.model, request.config, request.drafter, request.generation_config
    input_ids = request.input_ids
    device = input_ids.device
    do_sample = bool(gen.do_sample)
    want_dict = bool(gen.return_dict_in_generate)
    want_attentions = want_dict and bool(gen.output_attentions)
    want_states = want_dict and bool(gen.output_hidden_states)
    if (want_attentions or want_states) and config.compile:
        raise NotImplementedError("output_attentions / output_hidden_states need the eager path: the static path's "
                                  "captured verify forward keeps neither; pass compile=False (and no "
                                  "cache_implementation='static')")
    start = time.perf_counter()
    past = continued_state(request)
    rec = Recorder(input_ids, request.stopping, request.streamer, want_dict and bool(gen.output_scores),
                   want_dict and bool(gen.output_logits), want_attentions, want_states)
    stats = SpecStats(prefill_tokens=input_ids.shape[1] - (past.length if past is not None else 0))
    verifier = make_verifier(config, do_sample, drafter)
    offsets, positions = _positions(request)
    backend = _backend(request, verifier, offsets, rec, want_attentions, want_states)
    processors = request.processors
    try:
        # ---- prefill and the first token
        mask = request.model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask.to(device)
        pads = int((mask == 0).sum())
        prompt_inputs = {k: v for k, v in request.model_kwargs.items() if k in PROMPT_INPUTS and v is not None}
        # The prompt as chains through the runner's captured forward where nothing but plain tokens goes in.
        if (backend.prefills_chunked and chunked_prefill(config.prefill, 1, input_ids.shape[1]) and past is None
                and not prompt_inputs and offsets is None and not pads and not backend.all_hidden):
            out = backend.prefill(input_ids, mask, positions, chunked=True)
        else:
            out = backend.prefill(input_ids, mask, positions, past=past, **prompt_inputs)
        del past
        del prompt_inputs
        layers = tuple(drafter.target_hidden_layers)
        prompt_hidden = target_hidden(out, layers)
        first_attentions, first_states = prompt_outputs(out, want_attentions, want_states)
        logits = out.logits[:, -1].to(dtype=torch.float32, device=device)
        scores = processors(rec.input_ids, logits.clone()) if processors else logits
        context = DraftContext(model, backend.cache, request.adapter, gen, offsets)
        drafter.begin(input_ids, context, prompt_hidden)
        # What the drafter deferred of its set-up (a suffix trie over a long prompt) while the prefill runs; the rest
        # at its first proposal.
        drafter.settle(stop=lambda b=device_busy(device): not b())
        node_budget = _node_budget(config, backend, stats)
        first = verifier.first_token(scores, FirstToken(input_ids, drafter, context, prompt_hidden, out, node_budget))
        count_arbiter(first, stats)
        del out, prompt_hidden
        rec.append(first.tokens, scores, logits, first.token_list, first_attentions, first_states)
        del first_attentions, first_states
        drafter.accept(rec.input_ids, VerifyResult(path=[0], tokens=first.tokens, score_nodes=[0],
                                                   token_list=first.token_list))
        stats.static = backend.static
        processors = row_processors(processors, 0)  # the tree's nodes are the batch now (one row of ids each)
        # Greedy over the raw logits picks the same path when nothing processes them (an fp32 copy of [N, V] spared).
        raw_greedy = verifier.raw_greedy and not processors and rec.scores is None and rec.logits is None
        # Otherwise every node's choice in one pass where the rule allows it (`verification.batch_choices`: the
        # processors over all nodes at once), unless the call keeps each step's scores.
        at_once = rec.scores is None and rec.logits is None
        stats.setup_seconds = time.perf_counter() - start

        # The step's verification and what the call reads off it before the commit (closures over the loop's
        # draft, ids and length of the step): the committed tokens' scores and logits, attentions and hidden states.
        kept_scores = kept_logits = step_attentions = step_states = None
        draft = ids = length = None

        def verify(step: LaunchedStep) -> list[VerifyResult]:
            nonlocal kept_scores, kept_logits
            tree, verified = step.tree, step.outputs
            if raw_greedy:
                return [verifier.verify(tree, verified.logits[0], StepInputs(length, verified.hidden_states))]
            if at_once and choices_apply(verifier, [processors], draft.probs is not None, contexts=True):
                return [verify_at_once(verifier, processors, ids, tree, verified.logits)]
            # The batch step's verification, for a batch of one (each committed token's scores kept).
            chosen = [] if rec.scores is not None or rec.logits is not None else None
            results = verify_batch(tree, DraftBatch.from_drafts([draft]), verified.logits,
                                   StepRows([ids], verifier, [processors]), chosen=chosen,
                                   hidden=verified.hidden_states)
            if chosen:
                kept_scores, kept_logits, _ = chosen[0]
            return results

        def read(step: LaunchedStep, results: list[VerifyResult]) -> None:
            nonlocal step_attentions, step_states
            (result,) = results
            if want_states:
                step_states = path_outputs(step.outputs, result)
            if want_attentions:  # [1, heads, 1, keys] per layer, as stock's decode steps give them
                step_attentions = [tuple(None if a is None else a[None, :, None] for a in token)
                                   for token in path_attentions(step.outputs.attentions, 0, result.path,
                                                                result.score_nodes, backend.slots,
                                                                backend.valid[0], pads)]

        # ---- draft, verify, accept, commit, record
        while not rec.finished:
            ids = rec.input_ids
            length = ids.shape[1]
            # Tokens one forward can commit: the accepted draft depth plus the bonus token.
            budget = DraftBudget(max_nodes=node_budget, max_depth=min(config.max_depth, gen.max_length - length - 1))
            t0 = time.perf_counter()
            draft = propose(drafter, ids, budget, verifier)
            t1 = time.perf_counter()
            step = launch_step(backend, None, tree=_verify_tree(draft, ids, rec, backend, device))
            kept_scores = kept_logits = step_attentions = step_states = None
            finished = finish_step(backend, step, verify, drafter.overlap,  # (the host's idle time meanwhile)
                                   read if want_states or want_attentions else None)
            del step
            (result,) = finished.results
            path_hidden = None if finished.hidden is None else finished.hidden.row(0)  # [1, len(path), H] per layer
            t2 = time.perf_counter()

            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            record_step(stats, None, [0], [int(result.tokens.shape[0])], [draft.num_nodes], [result])
            # Gather the [k, V] score / logit rows only when the caller asked for them (a vocabulary-wide copy each).
            rec.append(result.tokens, kept_scores if rec.scores is not None else None,
                       kept_logits if rec.logits is not None else None, result.token_list, step_attentions, step_states)
            drafter.accept(rec.input_ids, result, path_hidden)

        drafter.end(rec.input_ids)
        stats.graph_captures = backend.captures
    finally:
        # Also when the call fails: a traceback kept alive (a REPL's sys.last_value) holds `rec`, the lease's owner.
        backend.release()
    if request.streamer is not None:
        request.streamer.end()
    logger.info("speculative_generate: %d tokens in %d target forwards (mean accepted length %.2f)",
                rec.input_ids.shape[1] - input_ids.shape[1], stats.target_forwards, stats.mean_accepted_length)
    if not want_dict:
        return rec.input_ids
    return SpeculativeDecoderOnlyOutput(
        sequences=rec.input_ids, scores=rec.scores, logits=rec.logits, attentions=rec.attentions,
        hidden_states=rec.hidden_states, spec_stats=stats, **{CACHE_FIELD: backend.cache})


def multimodal_prompt(model_kwargs: dict) -> bool:
    """Whether a call's model inputs carry a multimodal prompt: a prompt input given (empty containers count as absent:
    multimodal models pass e.g. mm_encoder_outputs={} for text-only prompts), or multimodal RoPE positions
    [R, B, L]."""
    given = any(model_kwargs.get(k) is not None and not (isinstance(model_kwargs[k], (dict, list, tuple))
                                                         and not model_kwargs[k]) for k in PROMPT_INPUTS)
    position_ids = model_kwargs.get("position_ids")
    return given or (position_ids is not None and position_ids.ndim == 3)


def continued_state(request: Request) -> CommittedState | None:
    """The committed state a call continues from: a copy of what `past_key_values` (or `cache`) holds when it is
    filled, else None. transformers' rule: the cache holds the prompt's first tokens, and the rest of `input_ids`
    runs after them. The caller's cache is copied, never changed (the output's `past_key_values` is the loop's own);
    a static runner's cache returned by an earlier call is copied before this call leases (and resets) a runner."""
    past = None
    for name in ("past_key_values", "cache"):
        value = request.model_kwargs.get(name)
        if value is not None and hasattr(value, "layers") and committed_length(value) > 0:
            past = value
    if past is None:
        return None
    length = committed_length(past)
    prompt = request.input_ids.shape[1]
    if length >= prompt:
        raise ValueError(f"past_key_values holds {length} tokens and input_ids {prompt}: input_ids must be the whole "
                         "sequence (the cached tokens, then at least one new token), as stock generate takes it")
    if getattr(past, "in_tree_mode", False):
        raise RuntimeError("past_key_values has a pending verify tree (a call that failed midway?): it holds no "
                           "committed state to continue from")
    if request.drafter.target_hidden_layers:
        raise NotImplementedError(f"the {request.drafter.name!r} drafter reads the target's hidden states of the whole "
                                  "prompt, which a filled cache does not keep: pass the full prompt without "
                                  "past_key_values, or use a drafter that reads tokens only (suffix, ngram, model)")
    mask = request.model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise NotImplementedError("continuing from a filled cache with padding in the attention mask is not supported")
    if multimodal_prompt(request.model_kwargs):
        raise NotImplementedError("continuing from a filled cache with a multimodal prompt is not supported")
    return export_committed(past)


def _positions(request: Request) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The prompt's position ids and, for multimodal RoPE, the offsets of its rows ([R, B]).

    Multimodal RoPE (Qwen3.5's vision-language model): generate hands over [R, B, L] position ids (text row first);
    generated tokens continue each row from the prompt's largest position, as stock decoding does. Otherwise the
    positions come from the padding mask, as in stock generate."""
    input_ids = request.input_ids
    given = request.model_kwargs.get("position_ids")
    if given is not None and given.ndim == 3:
        given = given.to(input_ids.device)
        return given.amax(-1) - given[0].amax(-1)[None], given
    mask = request.model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(input_ids.device)
    return None, (mask.cumsum(-1) - 1).clamp(min=0)


def _backend(request: Request, verifier: Verifier, offsets, owner, want_attentions: bool, want_states: bool):
    """The request's backend, a batch of one: a one-row static runner when the config compiles, else the eager
    backend (whose forwards return attentions and every hidden state, when the call asks for them)."""
    config, drafter = request.config, request.drafter
    layers = tuple(drafter.target_hidden_layers)
    if config.compile:
        chunked = chunked_prefill(config.prefill, 1, request.input_ids.shape[1])
        buckets = tuple(sorted(set(config.compile_buckets) | ({PREFILL_CHUNK} if chunked else set())))
        static_length = request.generation_config.max_length + max(buckets)
        return BatchStaticBackend(request.model, 1, static_length, buckets, owner, hidden_layers=layers,
                                  fuse=config.compile_verify, all_hidden=verifier.uses_target_hidden, offsets=offsets)
    return BatchEagerBackend(request.model, layers, verifier.uses_target_hidden or want_states, want_attentions,
                             offsets)


def _node_budget(config: AssistantConfig, backend, stats: SpecStats) -> int:
    """Draft nodes per tree: the config's budget, capped by `max_verify_nodes` (said in the stats) and, on a static
    runner, by the config's widest bucket (a chunked prefill's wider chains are not for trees)."""
    budget = min(config.max_draft_tokens, config.max_verify_nodes)
    if budget < config.max_draft_tokens:
        stats.budget_capped = True
        logger.warning_once(f"max_draft_tokens={config.max_draft_tokens} is above max_verify_nodes="
                            f"{config.max_verify_nodes}: every verified tree is capped at {budget} draft nodes")
    if backend.static:
        budget = min(budget, max(config.compile_buckets) - 1)
    return budget


def _verify_tree(draft, ids: torch.Tensor, rec: Recorder, backend, device):
    """The verify tree: the root (last committed token) and the draft. A host draft (cache drafters) is laid out on the
    host, root included (known there): the static runner stages it in one copy, the eager forward gets it moved
    without waiting on the stream."""
    if draft.tokens.device.type == "cpu":
        root = torch.tensor(rec.host_ids[-1:], dtype=torch.long)
        return build_verify_tree(root, draft, device=backend.tree_device)
    return build_verify_tree(ids[:, -1], draft)
