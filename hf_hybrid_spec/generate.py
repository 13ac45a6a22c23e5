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
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from .cache import HybridTreeCache
from .config import AssistantConfig
from .drafters import DraftBudget, DraftContext, Drafter, HistoryHidden, TargetHidden, make_drafter
from .forward import forward_tokens, forward_tree, sdpa_without_cudnn
from .kernels import use_backend
from .models import ModelAdapter, get_adapter
from .tree import build_verify_tree
from .static import release_runner, static_runner
from .stopping import HostStopping
from .verify import VerifyResult, process_tree_logits, verify_greedy, verify_sampling
from .drafters import ModelDrafter

logger = logging.get_logger(__name__)

__all__ = ["speculative_generate", "enable", "speculative_kwargs", "hub_generate", "SpecStats",
           "SpeculativeDecoderOnlyOutput"]

_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
# Model kwargs that transformers' `generate` prepares and this loop understands.
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                       "cache_position", "output_attentions", "output_hidden_states"}
# Inputs of a multimodal prompt, for its prefill only (as stock decoding drops them after the first forward):
# transformers runs the vision encoder before decoding and passes its outputs as `mm_encoder_outputs`.
_PROMPT_INPUTS = {"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids",
                  "mm_encoder_outputs"}


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
        budget_capped: `max_draft_tokens` was above `AssistantConfig.max_verify_nodes`, which capped every tree.
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
    budget_capped: bool = False

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

    def __init__(self, input_ids, stopping_criteria, streamer, want_scores, want_logits, want_attentions=False,
                 want_hidden_states=False):
        self.input_ids = input_ids
        self.host_ids: list[int] = input_ids[0].tolist()
        self.stopping = stopping_criteria
        self.host_stopping = HostStopping.build(stopping_criteria)
        self.streamer = streamer
        self.scores = () if want_scores else None
        self.logits = () if want_logits else None
        self.attentions = () if want_attentions else None
        self.hidden_states = () if want_hidden_states else None
        self.finished = False

    def append(self, tokens: torch.Tensor, scores: torch.Tensor | None, logits: torch.Tensor | None,
               token_list: list[int] | None = None, attentions: list | None = None,
               hidden_states: list | None = None) -> int:
        """Commit `tokens` [k] (one score / logit row each, read only when asked for); stops early where a
        criterion fires. `token_list`: the same tokens on the host, when the caller has them. `attentions` /
        `hidden_states`: when asked for, one entry per token (a tuple over layers, as stock generate keeps them).
        Returns kept k.

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
            if self.attentions is not None:
                self.attentions += tuple(attentions[:kept])
            if self.hidden_states is not None:
                self.hidden_states += tuple(hidden_states[:kept])
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


def _resolve_compile(config: AssistantConfig, model: nn.Module, generation_config: GenerationConfig) -> AssistantConfig:
    """`config` with `compile` a bool: "auto" is the static path (CUDA graphs) for a model on one CUDA device, unless
    the call asks for what only the eager path returns (attentions, hidden states); the eager path elsewhere.
    `cache_implementation="static"` implies compile=True, for the drafters too (EAGLE's static storage and graphs)."""
    compile_ = config.compile
    if generation_config.cache_implementation == "static":
        compile_ = True
    elif compile_ == "auto":
        devices = {p.device for p in model.parameters()}
        eager_outputs = bool(generation_config.return_dict_in_generate) and bool(
            generation_config.output_attentions or generation_config.output_hidden_states)
        compile_ = len(devices) == 1 and next(iter(devices)).type == "cuda" and not eager_outputs
        if not compile_ and (config.compile_drafter or config.compile_verify):
            logger.info("compile='auto' runs this call eagerly: compile_drafter / compile_verify do not apply")
            return config.replace(compile=False, compile_drafter=False, compile_verify=False)
    for name, what in (("compile_drafter", "the EAGLE drafter's captured passes"),
                       ("compile_verify", "regions of the captured verify forward")):
        if getattr(config, name) and not compile_:
            raise ValueError(f"{name}=True compiles {what}: it needs compile=True or 'auto' "
                             "(or generate(..., cache_implementation='static'))")
    return config if compile_ == config.compile else config.replace(compile=compile_)


def _check_supported(model: nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict):
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError("speculative_generate needs a non-empty prompt (input_ids of shape [batch, length >= 1])")
    unsupported = {
        "num_beams > 1": generation_config.num_beams > 1,
        "num_return_sequences > 1": generation_config.num_return_sequences > 1,
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
    extra = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS | _PROMPT_INPUTS
                   and v is not None and not (isinstance(v, (dict, list, tuple)) and not v))
    if extra:
        raise NotImplementedError(f"speculative_generate does not support these model inputs: {extra}")
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise NotImplementedError("continuing from a filled cache is not supported; pass the full prompt instead")


def speculative_generate(
    model: nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
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

    Called directly (`speculative_generate(model, input_ids, generation_config=...)`, without the processor and
    criteria lists that `generate` prepares, or with a generation config whose defaults are not filled in), the call
    goes through `model.generate(..., custom_generate=speculative_generate)`, which prepares them as for any
    generation.
    """
    if logits_processor is None or stopping_criteria is None or generation_config is None or \
            generation_config.num_beams is None:
        return model.generate(
            input_ids, generation_config=generation_config, logits_processor=logits_processor,
            stopping_criteria=stopping_criteria, synced_gpus=synced_gpus or None, custom_generate=speculative_generate,
            assistant_config=assistant_config, draft_model=draft_model, drafter=drafter,
            spec_streamer=streamer if streamer is not None else spec_streamer, **model_kwargs)
    if synced_gpus:
        raise NotImplementedError("speculative_generate does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP) yet")
    config = _resolve_config(assistant_config, draft_model)
    if streamer is None:
        streamer = spec_streamer if spec_streamer is not None else _find_dropped_streamer()
    adapter = get_adapter(model)  # first: an unsupported model gets the list of supported families
    _check_supported(model, input_ids, generation_config, model_kwargs)
    config = _resolve_compile(config, model, generation_config)
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a hf_hybrid_spec.Drafter, got {type(drafter).__name__}")
    # The drafter is built inside too: HVD profiles draft and verify costs there, with the same attention backends.
    with use_backend(config.kernel_backend), sdpa_without_cudnn():
        if drafter is None:
            drafter = make_drafter(config, model, draft_model)
            if config.verification != "lossless" and isinstance(drafter, ModelDrafter):
                drafter.next_probs = True  # lossy verification reads the assistant's distributions (issue #9)
        try:
            return _run(model, adapter, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                        config, drafter, model_kwargs)
        finally:
            drafter.release()


def _hidden(outputs, layers: tuple[int, ...], index: torch.Tensor | None = None) -> TargetHidden | None:
    """The drafter's requested hidden states from a target forward, at token positions `index` (all if None)."""
    if not layers:
        return None
    # index_select, not advanced indexing: the same copy with a fraction of the host-side dispatch (every step).
    states = tuple(outputs.hidden_states[i] if index is None else outputs.hidden_states[i].index_select(1, index)
                   for i in layers)
    return TargetHidden(layers=layers, states=states)


def _prompt_outputs(out, want_attentions: bool, want_states: bool) -> tuple[list | None, list | None]:
    """The first generated token's attentions / hidden states, as stock generate keeps them: the prefill's, over the
    whole prompt (attentions [1, H, P, P] per attention layer, hidden states [1, P, D] per layer)."""
    attentions = [tuple(out.attentions)] if want_attentions else None
    states = [tuple(out.hidden_states)] if want_states else None
    return attentions, states


def _path_outputs(out, result: VerifyResult, prefix_length: int, want_attentions: bool,
                  want_states: bool) -> tuple[list | None, list | None]:
    """Per committed token, the verify forward's attentions and hidden states at the node that chose it, as a chain
    forward would have produced them: the node's row, and of its attention row the committed prefix and the node's
    own root path in order (a chain's keys), never the other branches' columns.

    Token k was chosen at node path[k] (accepted draft tokens, then the bonus token at the leaf): its attention row is
    [1, H, 1, prefix_length + k + 1], its hidden states [1, 1, D] per layer."""
    attentions = [] if want_attentions else None
    states = [] if want_states else None
    path = result.path
    if want_attentions:
        device = next((a.device for a in out.attentions if a is not None), None)
        nodes = torch.tensor(path, dtype=torch.long)
        columns = torch.cat([torch.arange(prefix_length), prefix_length + nodes]).to(device) if device else None
    for k, node in enumerate(result.score_nodes):
        if node != path[k]:
            raise RuntimeError(f"token {k} was chosen at node {node}, off the accepted path {path}")
        if want_attentions:
            keep = columns[: prefix_length + k + 1] if columns is not None else None
            attentions.append(tuple(None if a is None else a[:, :, node : node + 1].index_select(-1, keep)
                                    for a in out.attentions))
        if want_states:
            states.append(tuple(h[:, node : node + 1] for h in out.hidden_states))
    return attentions, states


def _run(model, adapter: ModelAdapter, input_ids, processors, stopping, generation_config, streamer, config,
         drafter: Drafter, model_kwargs):
    device = input_ids.device
    do_sample = bool(generation_config.do_sample)
    want_dict = bool(generation_config.return_dict_in_generate)
    want_attentions = want_dict and bool(generation_config.output_attentions)
    want_states = want_dict and bool(generation_config.output_hidden_states)
    if (want_attentions or want_states) and config.compile:
        raise NotImplementedError("output_attentions / output_hidden_states need the eager path: the static path's "
                                  "captured verify forward keeps neither; pass compile=False (and no "
                                  "cache_implementation='static')")
    rec = _Recorder(
        input_ids,
        stopping,
        streamer,
        want_dict and bool(generation_config.output_scores),
        want_dict and bool(generation_config.output_logits),
        want_attentions,
        want_states,
    )
    stats = SpecStats(prefill_tokens=input_ids.shape[1])
    # Lossy, opt-in verification; None keeps the lossless path as it is (and its module, built on transformers'
    # modeling code, unimported).
    lossy = None
    if config.verification != "lossless":
        from .cospec.verify import make_lossy_verifier

        lossy = make_lossy_verifier(config, do_sample, drafter)
    arbiter_hidden = lossy is not None and lossy.uses_target_hidden
    # Static shapes and CUDA graphs (issue #8): asked for, or implied by cache_implementation="static" (resolved into
    # config.compile by speculative_generate, before the drafter was built).
    static = config.compile
    # Multimodal RoPE (Qwen3.5's vision-language model): generate hands over [R, B, L] position ids (text row first);
    # generated tokens continue each row from the prompt's largest position, as stock decoding does.
    given_positions = model_kwargs.get("position_ids")
    offsets = None
    if given_positions is not None and given_positions.ndim == 3:
        given_positions = given_positions.to(device)
        offsets = given_positions.amax(-1) - given_positions[0].amax(-1)[None]  # [R, B]
    if static:
        # Leased to this call (`rec` lives exactly as long): a concurrent call never gets the same runner.
        # Drafters that read hidden states get the committed tokens' from the runner's history (written by the
        # commit graph); the lossy arbiter reads every tree node's, returned by the forward.
        runner = static_runner(model, generation_config.max_length + max(config.compile_buckets),
                               config.compile_buckets, arbiter_hidden, owner=rec,
                               history_layers=tuple(drafter.target_hidden_layers), fuse=config.compile_verify,
                               rope_rows=0 if offsets is None else offsets.shape[0])
        cache = runner.cache
    else:
        cache = HybridTreeCache(model.config)
    leased = runner if static else None
    try:
        # 0/1 padding mask over every token so far (generated tokens are never padding).
        mask = model_kwargs.get("attention_mask")
        full_mask = torch.ones_like(input_ids) if mask is None else mask.to(device)

        # Prefill, exactly as stock generate: positions from the padding mask (or the multimodal ones it gave).
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0) if offsets is None else given_positions
        prompt_inputs = {k: v for k, v in model_kwargs.items() if k in _PROMPT_INPUTS and v is not None}
        want_hidden = tuple(drafter.target_hidden_layers)
        out = forward_tokens(model, input_ids, cache, position_ids=positions, attention_mask=mask, logits_to_keep=1,
                             output_hidden_states=bool(want_hidden) or arbiter_hidden or want_states,
                             output_attentions=want_attentions, **prompt_inputs)
        del prompt_inputs
        prompt_hidden = _hidden(out, want_hidden)
        first_attentions, first_states = _prompt_outputs(out, want_attentions, want_states)
        logits = out.logits[:, -1].to(dtype=torch.float32, device=device)
        scores = processors(rec.input_ids, logits.clone()) if processors else logits
        if do_sample:
            first = torch.multinomial(torch.softmax(scores, dim=-1), 1).view(1)
        else:
            first = scores.argmax(dim=-1).view(1)
        if lossy is not None:
            # The first new token is arbitrated too: the model drafter is begun here (its second begin below keeps it).
            arbitrated = lossy.first_token(drafter, input_ids, DraftContext(model, cache, adapter, generation_config, offsets),
                                           prompt_hidden, scores, out, config.max_draft_tokens)
            if arbitrated is not None:
                first = arbitrated.tokens[:1]
                stats.arbiter_decisions += arbitrated.decisions
                stats.arbiter_overrides += arbitrated.overrides
        del out
        first_list = first.tolist()
        rec.append(first, scores, logits, first_list, first_attentions, first_states)
        del first_attentions, first_states
        drafter.begin(input_ids, DraftContext(model, cache, adapter, generation_config, offsets), prompt_hidden)
        del prompt_hidden
        drafter.accept(rec.input_ids, VerifyResult(path=[0], tokens=first, score_nodes=[0], token_list=first_list))
        if not static:
            runner = None
        else:
            if offsets is not None:
                runner.set_position_offsets(offsets)
            runner.capture_all(input_ids.shape[1])
            runner.set_prefix_valid(full_mask[0])
            valid_prompt = int(full_mask.sum())
            stats.static = True

        max_length = generation_config.max_length
        node_budget = min(config.max_draft_tokens, config.max_verify_nodes)
        if node_budget < config.max_draft_tokens:
            stats.budget_capped = True
            logger.warning_once(f"max_draft_tokens={config.max_draft_tokens} is above max_verify_nodes="
                                f"{config.max_verify_nodes}: every verified tree is capped at {node_budget} draft nodes")
        if runner is not None:
            node_budget = min(node_budget, runner.max_nodes - 1)
        while not rec.finished:
            ids = rec.input_ids
            length = ids.shape[1]
            if runner is None:  # the static runner keeps the prompt's padding mask itself
                full_mask = torch.cat([full_mask, torch.ones(1, length - full_mask.shape[1], dtype=full_mask.dtype,
                                                             device=device)], dim=1)
            # Tokens one forward can commit: the accepted draft depth plus the bonus token.
            remaining = max_length - length
            budget = DraftBudget(max_nodes=node_budget, max_depth=min(config.max_depth, remaining - 1))

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
                    prefix_mask=full_mask[:, :-1], output_hidden_states=bool(want_hidden) or arbiter_hidden or want_states,
                    output_attentions=want_attentions, position_offsets=offsets,
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
                step_attentions, step_states = None, None
                if want_attentions or want_states:
                    step_attentions, step_states = _path_outputs(out, result, length - 1, want_attentions,
                                                                 want_states)
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
                       raw[0, result.score_nodes] if rec.logits is not None else None, result.token_list,
                       step_attentions, step_states)
            drafter.accept(rec.input_ids, result, path_hidden)

        drafter.end(rec.input_ids)
        if runner is not None:
            stats.graph_captures = runner.captures
    finally:
        # Also when the call fails: a traceback kept alive (a REPL's sys.last_value) holds `rec`, the lease's owner.
        if leased is not None:
            release_runner(model, leased)
    if streamer is not None:
        streamer.end()
    logger.info(
        "speculative_generate: %d tokens in %d target forwards (mean accepted length %.2f)",
        rec.input_ids.shape[1] - input_ids.shape[1], stats.target_forwards, stats.mean_accepted_length,
    )
    if not want_dict:
        return rec.input_ids
    return SpeculativeDecoderOnlyOutput(
        sequences=rec.input_ids, scores=rec.scores, logits=rec.logits, attentions=rec.attentions,
        hidden_states=rec.hidden_states, spec_stats=stats, **{_CACHE_FIELD: cache}
    )


def _empty(device):
    from .tree import empty_draft

    return empty_draft(1, device)


# ---------------------------------------------------------------------- enable()
def speculative_kwargs(model: nn.Module, kwargs: dict, default: AssistantConfig | dict | str | None = None) -> dict:
    """`generate` kwargs that run `speculative_generate`, from the kwargs of a stock call: `assistant_model=` becomes
    the model drafter, `prompt_lookup_num_tokens=` (and `max_matching_ngram_size=`) the n-gram drafter,
    `assistant_config=` (else `default`, else the suffix drafter) the configuration; stop strings with `tokenizer=`
    become a stopping criterion (see `_stop_strings_with_tokenizer`). Returns a new dict."""
    kwargs = dict(kwargs)
    assistant_model = kwargs.pop("assistant_model", None)
    lookup = kwargs.pop("prompt_lookup_num_tokens", None)
    ngram = kwargs.pop("max_matching_ngram_size", None)
    cfg = kwargs.pop("assistant_config", None)
    _stop_strings_with_tokenizer(model, kwargs)
    cfg = _resolve_config(cfg if cfg is not None else default, assistant_model)
    if assistant_model is not None:
        if cfg.drafter != "model":
            cfg = cfg.replace(drafter="model")
        kwargs["draft_model"] = assistant_model
    elif lookup is not None:
        cfg = cfg.replace(drafter="ngram", max_draft_tokens=int(lookup), ngram_size=int(ngram or cfg.ngram_size))
    kwargs["custom_generate"] = speculative_generate
    kwargs["assistant_config"] = cfg
    if kwargs.get("streamer") is not None:
        kwargs["spec_streamer"] = kwargs["streamer"]
    return kwargs


def hub_generate(*args, model: nn.Module, **kwargs):
    """What the Hub `custom_generate` repository's `generate` runs (`hub/custom_generate/generate.py`): transformers
    hands it every `generate` argument with `model=` (positional inputs may come first, as a model repository's
    `custom_generate/` passes them). Runs stock `generate` with `speculative_generate` as the decoding loop; the
    speculation kwargs are those `enable` takes."""
    from transformers import GenerationMixin

    if model is None:
        raise TypeError("hub_generate needs model=")
    # None-valued arguments are the defaults transformers fills in itself; the model class's generate, not an
    # instance attribute (a model repository's custom_generate/ sets model.generate to this very function).
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return GenerationMixin.generate(model, *args, **speculative_kwargs(model, kwargs))


def _stop_strings_with_tokenizer(model: nn.Module, kwargs: dict) -> None:
    """Stop strings for a callable `custom_generate`: transformers drops `tokenizer=` on its way to one (and then
    refuses the stop strings for want of a tokenizer), so they become a `StopStringCriteria` in `stopping_criteria`
    here, while the tokenizer is still in hand. Edits `kwargs` (generate's) in place."""
    tokenizer = kwargs.pop("tokenizer", None)
    if "stop_strings" in kwargs:
        stop_strings = kwargs["stop_strings"]
    else:
        config = kwargs.get("generation_config") or model.generation_config
        stop_strings = getattr(config, "stop_strings", None)
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass tokenizer= to generate")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


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
        custom = kwargs.get("custom_generate")
        asks = any(kwargs.get(k) is not None for k in ("assistant_model", "prompt_lookup_num_tokens", "assistant_config"))
        if custom not in (None, speculative_generate):
            if asks:
                raise ValueError("assistant_model / prompt_lookup_num_tokens / assistant_config cannot be combined "
                                 "with another custom_generate")
            return original(*args, **kwargs)
        if custom is None and not asks and default is None:
            return original(*args, **kwargs)
        return original(*args, **speculative_kwargs(model, kwargs, default))

    generate.__hf_hybrid_spec_enabled__ = True
    generate.__signature__ = inspect.signature(original)
    model.generate = generate
    return model
