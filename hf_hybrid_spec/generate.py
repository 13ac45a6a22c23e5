"""`speculative_generate`: the decoding loop behind `model.generate(custom_generate=...)`, and `enable`.

transformers prepares everything (generation config, logits processors, stopping criteria, attention mask,
max length) and then calls `speculative_generate(model, input_ids, ...)` in place of its own loop. Each step:

    draft = drafter.propose(committed tokens)         # a token tree hanging off the root (last token)
    logits = target(root + draft, tree mask)          # one forward; recurrent layers solve the tree in closed form
    path, tokens = verify(draft, logits)              # greedy or lossless sampling, with the user's processors
    cache.commit(path leaf)                           # keep the accepted path's KV, rebuild its recurrent state

Outputs have the format of stock `generate` (a tensor, or a `GenerateDecoderOnlyOutput` with scores/logits
when asked) plus `spec_stats`.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from .cache import HybridTreeCache
from .config import AssistantConfig
from .drafters import DraftBudget, DraftContext, Drafter, HistoryHidden, TargetHidden, make_drafter
from .forward import forward_tokens, forward_tree, sdpa_without_cudnn
from .kernels import use_backend
from .models import ModelAdapter, get_adapter
from .tree import build_verify_tree
from .static import static_runner
from .stopping import HostStopping
from .verify import VerifyResult, process_tree_logits, verify_greedy, verify_sampling
from .cospec.verify import make_lossy_verifier  # lossy, opt-in verification (issue #9)
from .drafters import ModelDrafter

logger = logging.get_logger(__name__)

__all__ = ["speculative_generate", "enable", "SpecStats", "SpeculativeDecoderOnlyOutput"]

_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
# Model kwargs that transformers' `generate` prepares and this loop understands.
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                       "cache_position"}


@dataclass
class SpecStats:
    """What speculation did during one `generate` call.

    Attributes:
        target_forwards: verification forwards of the target (the prefill is not counted).
        accepted_lengths: per verification forward, tokens committed (accepted draft tokens + the bonus token).
        drafted_tokens: per verification forward, draft nodes verified.
        prefill_tokens: prompt tokens run through the target before the first step.
        draft_seconds / verify_seconds: wall time spent drafting and in target forward + verification.
        arbiter_decisions / arbiter_overrides: lossy verification only (issue #9): draft/target mismatches an
            arbiter ruled on, and how many of them kept the draft's token.
        static / graph_captures: whether the static cache verified the trees, and how many CUDA graphs it
            captured (one per tree-size bucket used, never more).
    """

    target_forwards: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    drafted_tokens: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    arbiter_decisions: int = 0
    arbiter_overrides: int = 0
    static: bool = False  # verified with the static cache (issue #8)
    graph_captures: int = 0  # CUDA graphs captured (at most one per tree-size bucket)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward, bonus included (1.0 means no speedup from drafts)."""
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens."""
        accepted = sum(self.accepted_lengths) - len(self.accepted_lengths)
        return accepted / max(1, sum(self.drafted_tokens))


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the speculation statistics."""

    spec_stats: SpecStats | None = None


class _Recorder:
    """Collects committed tokens, scores and logits; applies stopping criteria token by token.

    Keeps the committed ids twice: `input_ids` on the model's device (what the caller gets back) and `host_ids`, a
    Python list, so that stopping checks, drafters and streamers never read the device.
    """

    def __init__(self, input_ids, stopping_criteria, streamer, want_scores, want_logits):
        self.input_ids = input_ids
        self.host_ids: list[int] = input_ids[0].tolist()
        self.stopping = stopping_criteria
        self.host_stopping = HostStopping.build(stopping_criteria)
        self.streamer = streamer
        self.scores = () if want_scores else None
        self.logits = () if want_logits else None
        self.finished = False

    def append(self, tokens: torch.Tensor, scores: torch.Tensor | None, logits: torch.Tensor | None,
               token_list: list[int] | None = None) -> int:
        """Commit `tokens` [k] (one score / logit row each, read only when asked for); stops early where a
        criterion fires. `token_list`: the same tokens on the host, when the caller has them. Returns kept k.

        The criteria see each prefix exactly as stock generate would (input ids and scores up to that token).
        Length / EOS / time criteria are decided on the host; any other list is called on the device and its
        verdicts are read back in one host sync per step, not one per token.
        """
        k = tokens.shape[0]
        length = self.input_ids.shape[1]
        if token_list is None:
            token_list = tokens.tolist()
        # One concatenation per step; each criterion sees a prefix of it (a view).
        full = torch.cat([self.input_ids, tokens.view(1, k).to(self.input_ids.device)], dim=-1)
        if self.host_stopping is not None:
            stops = [self.host_stopping.stops(length + j + 1, token_list[j]) for j in range(k)]
        else:
            verdicts = []
            for j in range(k):
                seen = None if self.scores is None else self.scores + tuple(scores[i : i + 1] for i in range(j + 1))
                verdicts.append(self.stopping(full[:, : length + j + 1], seen).any())
            stops = torch.stack(verdicts).tolist() if verdicts else []
        kept = next((j + 1 for j, stop in enumerate(stops) if stop), k)
        self.finished = bool(stops[kept - 1])
        if kept:
            self.input_ids = full if kept == k else full[:, : length + kept].clone()
            self.host_ids.extend(token_list[:kept])
            if self.scores is not None:
                self.scores += tuple(scores[i : i + 1] for i in range(kept))
            if self.logits is not None:
                self.logits += tuple(logits[i : i + 1] for i in range(kept))
        if self.streamer is not None and kept:
            self.streamer.put(torch.tensor([token_list[:kept]], dtype=torch.long))
        return kept


def _find_dropped_streamer():
    """transformers (5.17 through 5.24) does not forward `streamer=` to a callable `custom_generate`; it is still a
    local of the `generate` frame that called us. Returns it, or None."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "generate" and code.co_filename.replace("\\", "/").endswith("generation/utils.py"):
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None


def _resolve_config(assistant_config, draft_model) -> AssistantConfig:
    if assistant_config is None:
        return AssistantConfig(drafter="model" if draft_model is not None else "suffix")
    if isinstance(assistant_config, AssistantConfig):
        return assistant_config
    if isinstance(assistant_config, dict):
        return AssistantConfig.from_dict(assistant_config)
    if isinstance(assistant_config, str):
        return AssistantConfig.from_pretrained(assistant_config)
    raise TypeError(f"assistant_config must be an AssistantConfig, a dict or a path, got {type(assistant_config).__name__}")


def _check_supported(model: nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict):
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError("speculative_generate needs a non-empty prompt (input_ids of shape [batch, length >= 1])")
    unsupported = {
        "num_beams > 1": generation_config.num_beams > 1,
        "num_return_sequences > 1": generation_config.num_return_sequences > 1,
        "output_attentions": generation_config.output_attentions,
        "output_hidden_states": generation_config.output_hidden_states,
        "penalty_alpha (contrastive search)": generation_config.penalty_alpha is not None,
        "dola_layers": getattr(generation_config, "dola_layers", None) is not None,
        "assistant_early_exit (use AssistantConfig instead)": getattr(generation_config, "assistant_early_exit", None)
        is not None,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise NotImplementedError(f"speculative_generate does not support: {', '.join(bad)}")
    if input_ids.shape[0] != 1:
        raise NotImplementedError(
            f"speculative_generate supports batch size 1 for now, got {input_ids.shape[0]} sequences"
        )
    if generation_config.max_length is not None and generation_config.max_length <= input_ids.shape[1]:
        raise ValueError(
            f"nothing to generate: max_length={generation_config.max_length} <= prompt length {input_ids.shape[1]} "
            "(max_new_tokens must be >= 1)"
        )
    # Empty containers count as absent: multimodal models pass e.g. mm_encoder_outputs={} for text-only prompts.
    extra = sorted(k for k, v in model_kwargs.items()
                   if k not in _KNOWN_MODEL_KWARGS and v is not None and not (isinstance(v, (dict, list, tuple)) and not v))
    if extra:
        raise NotImplementedError(f"speculative_generate does not support these model inputs: {extra}")
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise NotImplementedError("continuing from a filled cache is not supported; pass the full prompt instead")


def speculative_generate(
    model: nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    assistant_config: AssistantConfig | dict | str | None = None,
    draft_model: nn.Module | None = None,
    drafter: Drafter | None = None,
    spec_streamer=None,
    **model_kwargs,
):
    """Speculative decoding loop for `model.generate(..., custom_generate=speculative_generate)`.

    Args:
        assistant_config: an `AssistantConfig` (or a dict / a path for `AssistantConfig.from_pretrained`);
            default: the suffix drafter, or the model drafter when `draft_model` is given.
        draft_model: a causal LM with the target's tokenizer, for `drafter="model"`.
        drafter: a `Drafter` instance of your own; it replaces the drafter `assistant_config` names.
        spec_streamer: the streamer, when called through `enable()` (transformers drops `streamer=` on its way
            to a callable `custom_generate`; it is also recovered from the caller otherwise).

    Returns:
        Like stock `generate`: `sequences` [1, L + new] or, with `return_dict_in_generate=True`, a
        `SpeculativeDecoderOnlyOutput` (scores / logits when asked, the cache, and `spec_stats`).
    """
    if synced_gpus:
        raise NotImplementedError("speculative_generate does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP) yet")
    config = _resolve_config(assistant_config, draft_model)
    if streamer is None:
        streamer = spec_streamer if spec_streamer is not None else _find_dropped_streamer()
    _check_supported(model, input_ids, generation_config, model_kwargs)
    if generation_config.cache_implementation == "static" and not config.compile:
        # Implied by the static cache, for the drafters too (EAGLE's static storage and graphs), not just the verify.
        config = config.replace(compile=True)
    for name, what in (("compile_drafter", "the EAGLE drafter's captured passes"),
                       ("compile_verify", "regions of the captured verify forward")):
        if getattr(config, name) and not config.compile:
            raise ValueError(f"{name}=True compiles {what}: it needs compile=True "
                             "(or generate(..., cache_implementation='static'))")
    adapter = get_adapter(model)
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a hf_hybrid_spec.Drafter, got {type(drafter).__name__}")
    # The drafter is built inside too: HVD profiles draft and verify costs there, with the same attention backends.
    with use_backend(config.kernel_backend), sdpa_without_cudnn():
        if drafter is None:
            drafter = make_drafter(config, model, draft_model)
            if config.verification != "lossless" and isinstance(drafter, ModelDrafter):
                drafter.next_probs = True  # lossy verification reads the assistant's distributions (issue #9)
        return _run(model, adapter, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                    config, drafter, model_kwargs)


def _hidden(outputs, layers: tuple[int, ...], index: torch.Tensor | None = None) -> TargetHidden | None:
    """The drafter's requested hidden states from a target forward, at token positions `index` (all if None)."""
    if not layers:
        return None
    # index_select, not advanced indexing: the same copy with a fraction of the host-side dispatch (every step).
    states = tuple(outputs.hidden_states[i] if index is None else outputs.hidden_states[i].index_select(1, index)
                   for i in layers)
    return TargetHidden(layers=layers, states=states)


def _run(model, adapter: ModelAdapter, input_ids, processors, stopping, generation_config, streamer, config,
         drafter: Drafter, model_kwargs):
    device = input_ids.device
    do_sample = bool(generation_config.do_sample)
    want_dict = bool(generation_config.return_dict_in_generate)
    rec = _Recorder(
        input_ids,
        stopping,
        streamer,
        want_dict and bool(generation_config.output_scores),
        want_dict and bool(generation_config.output_logits),
    )
    stats = SpecStats(prefill_tokens=input_ids.shape[1])
    # Lossy, opt-in verification (issue #9); None keeps the lossless path as it is.
    lossy = make_lossy_verifier(config, do_sample, drafter)
    arbiter_hidden = lossy is not None and lossy.uses_target_hidden
    # Static shapes and CUDA graphs (issue #8): asked for, or implied by cache_implementation="static" (resolved into
    # config.compile by speculative_generate, before the drafter was built).
    static = config.compile
    if static:
        # Leased to this call (`rec` lives exactly as long): a concurrent call never gets the same runner.
        # Drafters that read hidden states get the committed tokens' from the runner's history (written by the
        # commit graph); the lossy arbiter reads every tree node's, returned by the forward.
        runner = static_runner(model, generation_config.max_length + max(config.compile_buckets),
                               config.compile_buckets, arbiter_hidden, owner=rec,
                               history_layers=tuple(drafter.target_hidden_layers), fuse=config.compile_verify)
        cache = runner.cache
    else:
        cache = HybridTreeCache(model.config)
    # 0/1 padding mask over every token so far (generated tokens are never padding).
    mask = model_kwargs.get("attention_mask")
    full_mask = torch.ones_like(input_ids) if mask is None else mask.to(device)

    # Prefill, exactly as stock generate: positions from the padding mask.
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    want_hidden = tuple(drafter.target_hidden_layers)
    out = forward_tokens(model, input_ids, cache, position_ids=positions, attention_mask=mask, logits_to_keep=1,
                         output_hidden_states=bool(want_hidden) or arbiter_hidden)
    prompt_hidden = _hidden(out, want_hidden)
    logits = out.logits[:, -1].to(dtype=torch.float32, device=device)
    scores = processors(rec.input_ids, logits.clone()) if processors else logits
    if do_sample:
        first = torch.multinomial(torch.softmax(scores, dim=-1), 1).view(1)
    else:
        first = scores.argmax(dim=-1).view(1)
    if lossy is not None:
        # The first new token is arbitrated too: the model drafter is begun here (its second begin below keeps it).
        arbitrated = lossy.first_token(drafter, input_ids, DraftContext(model, cache, adapter, generation_config),
                                       prompt_hidden, scores, out, config.max_draft_tokens)
        if arbitrated is not None:
            first = arbitrated.tokens[:1]
            stats.arbiter_decisions += arbitrated.decisions
            stats.arbiter_overrides += arbitrated.overrides
    del out
    first_list = first.tolist()
    rec.append(first, scores, logits, first_list)
    drafter.begin(input_ids, DraftContext(model, cache, adapter, generation_config), prompt_hidden)
    del prompt_hidden
    drafter.accept(rec.input_ids, VerifyResult(path=[0], tokens=first, score_nodes=[0], token_list=first_list))
    if not static:
        runner = None
    else:
        runner.capture_all(input_ids.shape[1])
        runner.set_prefix_valid(full_mask[0])
        valid_prompt = int(full_mask.sum())
        stats.static = True

    max_length = generation_config.max_length
    while not rec.finished:
        ids = rec.input_ids
        length = ids.shape[1]
        if runner is None:  # the static runner keeps the prompt's padding mask itself
            full_mask = torch.cat([full_mask, torch.ones(1, length - full_mask.shape[1], dtype=full_mask.dtype,
                                                         device=device)], dim=1)
        # Tokens one forward can commit: the accepted draft depth plus the bonus token.
        remaining = max_length - length
        max_nodes = config.max_draft_tokens if runner is None else min(config.max_draft_tokens, runner.max_nodes - 1)
        budget = DraftBudget(max_nodes=max_nodes, max_depth=min(config.max_depth, remaining - 1))

        t0 = time.perf_counter()
        # Lossy verification arbitrates the token after the root even when nothing can be drafted (issue #9).
        draft = drafter.propose(ids, budget) if budget.max_depth > 0 or lossy is not None else None
        if draft is None or (draft.num_nodes == 0 and draft.next_probs is None):
            draft = _empty("cpu")
        else:
            if not drafter.respects_budget:  # a depth walk per step that budget-keeping drafters do not need
                draft = draft.truncate_depth(budget.max_depth)
            if draft.num_nodes > budget.max_nodes:
                draft = draft.select(torch.arange(budget.max_nodes, device=draft.tokens.device))
        t1 = time.perf_counter()

        if draft.tokens.device.type == "cpu":
            # A host draft (cache drafters) is laid out on the host, root included (known there); the static runner
            # stages it into its buffers in one copy, the eager forward gets it moved without waiting on the stream.
            root = torch.tensor(rec.host_ids[-1:], dtype=torch.long)
            tree = build_verify_tree(root, draft, device=root.device if runner is not None else device)
        else:
            tree = build_verify_tree(ids[:, -1], draft)
        if runner is None:
            out = forward_tree(
                model, tree, cache, prefix_length=length - 1, root_position=full_mask[:, :-1].sum(-1),
                prefix_mask=full_mask[:, :-1], output_hidden_states=bool(want_hidden) or arbiter_hidden,
            )
        else:
            out = runner.forward(tree, length - 1, valid_prompt + length - 1 - input_ids.shape[1])
        try:
            drafter.overlap()  # (the host's idle time while a GPU runs the forward)
            if lossy is None and not do_sample and not processors and rec.scores is None and rec.logits is None:
                # Plain greedy: the argmax of the logits as they are (an fp32 copy of [N, V] changes nothing).
                raw = out.logits
                scores = raw[0]
            else:
                raw = out.logits.to(dtype=torch.float32, device=device)
                scores = process_tree_logits(ids, tree, raw, processors)
            if lossy is None:
                result = verify_sampling(tree, scores) if do_sample else verify_greedy(tree, scores)
            else:
                result = lossy.verify(tree, scores, length, out)
            # The accepted path's hidden states, for drafters that read them (no index copy for the others).
            path_hidden = None
            if want_hidden and runner is None:
                path_hidden = _hidden(out, want_hidden, torch.tensor(result.path).to(raw.device, non_blocking=True))
            del out
        except BaseException:
            cache.abort() if runner is None else runner.abort()
            raise
        if runner is None:
            cache.commit(torch.tensor([result.leaf]).to(device, non_blocking=True), path=result.path)
        else:
            runner.commit(result.path)  # one graph replay on CUDA
            if want_hidden:  # sliced from the runner's history when the drafter first reads it
                path_hidden = HistoryHidden(want_hidden, runner.committed_hidden, length - 1,
                                            length - 1 + len(result.path))
        t2 = time.perf_counter()

        stats.target_forwards += 1
        stats.accepted_lengths.append(int(result.tokens.shape[0]))
        stats.drafted_tokens.append(draft.num_nodes)
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        if lossy is not None:
            stats.arbiter_decisions += result.decisions
            stats.arbiter_overrides += result.overrides
        # Gather the [k, V] score / logit rows only when the caller asked for them (a vocabulary-wide copy each).
        rec.append(result.tokens, scores[result.score_nodes] if rec.scores is not None else None,
                   raw[0, result.score_nodes] if rec.logits is not None else None, result.token_list)
        drafter.accept(rec.input_ids, result, path_hidden)

    drafter.end(rec.input_ids)
    if runner is not None:
        stats.graph_captures = runner.captures
        runner.release()
    if streamer is not None:
        streamer.end()
    logger.info(
        "speculative_generate: %d tokens in %d target forwards (mean accepted length %.2f)",
        rec.input_ids.shape[1] - input_ids.shape[1], stats.target_forwards, stats.mean_accepted_length,
    )
    if not want_dict:
        return rec.input_ids
    return SpeculativeDecoderOnlyOutput(
        sequences=rec.input_ids, scores=rec.scores, logits=rec.logits, spec_stats=stats, **{_CACHE_FIELD: cache}
    )


def _empty(device):
    from .tree import empty_draft

    return empty_draft(1, device)


# ---------------------------------------------------------------------- enable()
def enable(model: nn.Module, assistant_config: AssistantConfig | None = None) -> nn.Module:
    """Make the stock speculative kwargs work on `model` (a hybrid or attention-only model we support).

    After `enable(model)`:

        model.generate(**inputs, assistant_model=drafter_model)        # model drafter
        model.generate(**inputs, prompt_lookup_num_tokens=10)          # n-gram drafter
        model.generate(**inputs, assistant_config=AssistantConfig(...))

    all run `speculative_generate` (stock `generate` refuses the first two on stateful models before any
    custom callable runs). Plain calls without those kwargs are untouched. Only this model instance is
    changed; `assistant_config` sets its default configuration. Returns the model.
    """
    get_adapter(model)  # fail now, not at the first generate, for unsupported models
    if getattr(model.generate, "__hf_hybrid_spec_enabled__", False):
        return model
    default = assistant_config
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        assistant_model = kwargs.pop("assistant_model", None)
        lookup = kwargs.pop("prompt_lookup_num_tokens", None)
        cfg = kwargs.pop("assistant_config", None)
        if kwargs.get("custom_generate") not in (None, speculative_generate):
            if assistant_model is not None or lookup is not None or cfg is not None:
                raise ValueError("assistant_model / prompt_lookup_num_tokens / assistant_config cannot be combined "
                                 "with another custom_generate")
            return original(*args, **kwargs)
        if assistant_model is None and lookup is None and cfg is None and default is None:
            return original(*args, **kwargs)
        cfg = _resolve_config(cfg if cfg is not None else default, assistant_model)
        if assistant_model is not None:
            if cfg.drafter != "model":
                cfg = cfg.replace(drafter="model")
        elif lookup is not None:
            ngram = kwargs.pop("max_matching_ngram_size", None) or cfg.ngram_size
            cfg = cfg.replace(drafter="ngram", max_draft_tokens=int(lookup), ngram_size=int(ngram))
        kwargs["custom_generate"] = speculative_generate
        kwargs["assistant_config"] = cfg
        if assistant_model is not None:
            kwargs["draft_model"] = assistant_model
        if kwargs.get("streamer") is not None:
            kwargs["spec_streamer"] = kwargs["streamer"]
        return original(*args, **kwargs)

    generate.__hf_hybrid_spec_enabled__ = True
    generate.__signature__ = inspect.signature(original)
    model.generate = generate
    return model
