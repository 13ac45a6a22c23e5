"""`speculative_generate`: the decoding loop behind `model.generate(custom_generate=...)`, and `enable`.

transformers prepares everything (generation config, logits processors, stopping criteria, attention mask,
max length) and then calls `speculative_generate(model, input_ids, ...)` in place of its own loop. This module
checks what the call asks for, resolves the configuration, builds the drafter (`drafters.make_drafter`, through the
registry) and hands the request to the engine (`engine.decode`: draft -> verify -> accept -> commit -> record).

Outputs have the format of stock `generate` (a tensor, or a `GenerateDecoderOnlyOutput` with scores / logits /
attentions / hidden states when asked) plus `spec_stats`.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.utils import logging

from .config import AssistantConfig
from .drafters import BatchDrafter, Drafter, PerRowDrafters, make_batch_drafter, make_drafter
from .engine import PROMPT_INPUTS, Request, SpecStats, SpeculativeDecoderOnlyOutput, decode, decode_batch
from .engine.loop import multimodal_prompt
from .forward import sdpa_without_cudnn
from .kernels import use_backend
from .models import get_adapter
from .registry import DRAFTERS

logger = logging.get_logger(__name__)

__all__ = ["speculative_generate", "enable", "speculative_kwargs", "hub_generate", "SpecStats",
           "SpeculativeDecoderOnlyOutput"]

# Model kwargs that transformers' `generate` prepares and the loop understands (besides the multimodal prompt inputs).
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                       "cache_position", "output_attentions", "output_hidden_states"}


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
    if isinstance(assistant_config, (str, os.PathLike)):
        return _config_from_string(os.fspath(assistant_config))
    raise TypeError("assistant_config must be an AssistantConfig, a dict, a drafter's name or a path / Hub id, got "
                    f"{type(assistant_config).__name__}")


def _config_from_string(text: str) -> AssistantConfig:
    """`assistant_config="suffix"` is the suffix drafter's default configuration (a registered drafter's name that is
    not an existing local path); any other string a local path or a Hub repository id ("org/name"), loaded by
    `AssistantConfig.from_pretrained`. A bare word that is neither is refused at once, before any network call."""
    if not os.path.exists(text) and "/" not in text and "\\" not in text:
        if text in DRAFTERS:
            return AssistantConfig(drafter=text)
        raise FileNotFoundError(f"assistant config: {text!r} is neither an existing local path nor a Hub repository "
                                f"id (org/name) nor a drafter's name ({', '.join(DRAFTERS.names())})")
    return AssistantConfig.from_pretrained(text)


def _resolve_compile(config: AssistantConfig, model: nn.Module, generation_config: GenerationConfig) -> AssistantConfig:
    """`config` with `compile` and `compile_verify` bools: compile "auto" is the static path (CUDA graphs) for a model
    on one CUDA device, unless the call asks for what only the eager path returns (attentions, hidden states); the
    eager path elsewhere. `cache_implementation="static"` implies compile=True, for the drafters too (EAGLE's static
    storage and graphs). compile_verify "auto" fuses the verify forward wherever it is captured on a CUDA device."""
    compile_ = config.compile
    devices = {p.device for p in model.parameters()}
    on_cuda = len(devices) == 1 and next(iter(devices)).type == "cuda"
    if generation_config.cache_implementation == "static":
        compile_ = True
    elif compile_ == "auto":
        eager_outputs = bool(generation_config.return_dict_in_generate) and bool(
            generation_config.output_attentions or generation_config.output_hidden_states)
        compile_ = on_cuda and not eager_outputs
        if not compile_ and (config.compile_drafter or config.compile_verify is True):
            logger.info("compile='auto' runs this call eagerly: compile_drafter / compile_verify do not apply")
            return config.replace(compile=False, compile_drafter=False, compile_verify=False)
    for name, what in (("compile_drafter", "the EAGLE drafter's captured passes"),
                       ("compile_verify", "regions of the captured verify forward")):
        if getattr(config, name) is True and not compile_:
            raise ValueError(f"{name}=True compiles {what}: it needs compile=True or 'auto' "
                             "(or generate(..., cache_implementation='static'))")
    verify = compile_ and on_cuda if config.compile_verify == "auto" else config.compile_verify
    if compile_ == config.compile and verify == config.compile_verify:
        return config
    return config.replace(compile=compile_, compile_verify=verify)


def _check_supported(model: nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict):
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError("speculative_generate needs a non-empty prompt (input_ids of shape [batch, length >= 1])")
    unsupported = {
        "num_beams > 1": generation_config.num_beams > 1,
        # (with sampling, stock generate has already repeated each prompt num_return_sequences times: each copy is a
        # row of the batch, sampled on its own)
        "num_return_sequences > 1 without sampling": generation_config.num_return_sequences > 1
        and not generation_config.do_sample,
        "guidance_scale (classifier-free guidance: a second forward per step)":
        generation_config.guidance_scale not in (None, 1, 1.0),
        "penalty_alpha (contrastive search)": generation_config.penalty_alpha is not None,
        "dola_layers": getattr(generation_config, "dola_layers", None) is not None,
        "assistant_early_exit (use AssistantConfig instead)": getattr(generation_config, "assistant_early_exit", None)
        is not None,
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise NotImplementedError(f"speculative_generate does not support: {', '.join(bad)}")
    if input_ids.shape[0] > 1:
        _check_batch(input_ids, generation_config, model_kwargs)
    if generation_config.max_length is not None and generation_config.max_length <= input_ids.shape[1]:
        raise ValueError(
            f"nothing to generate: max_length={generation_config.max_length} <= prompt length {input_ids.shape[1]} "
            "(max_new_tokens must be >= 1)"
        )
    # Empty containers count as absent: multimodal models pass e.g. mm_encoder_outputs={} for text-only prompts.
    extra = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS | PROMPT_INPUTS
                   and v is not None and not (isinstance(v, (dict, list, tuple)) and not v))
    if extra:
        raise NotImplementedError(f"speculative_generate does not support these model inputs: {extra}")
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and input_ids.shape[0] > 1 and cache.get_seq_length() > 0:
            raise NotImplementedError("continuing from a filled cache supports batch size 1 for now")


def _check_batch(input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict) -> None:
    """What a batch (B > 1) needs: left padding described by the attention mask, and only what the batched loop
    supports (`engine.batch`)."""
    rows, length = input_ids.shape
    mask = model_kwargs.get("attention_mask")
    pad = generation_config.pad_token_id
    if mask is None:
        if pad is not None and bool((input_ids == pad).any()):
            raise ValueError("the batch holds padding (pad_token_id) but no attention_mask: pass the tokenizer's "
                             "attention_mask (tokenizer(texts, padding=True, padding_side='left', ...))")
    else:
        if tuple(mask.shape) != (rows, length):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {(rows, length)}: they must "
                             "match")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("the batch is not left-padded (a row has padding after a token): speculative decoding "
                             "of a batch needs padding_side='left', as stock generate does for decoder-only models")
        if bool((mask.sum(-1) == 0).any()):
            raise ValueError("a row of the batch is empty (its attention_mask is all zeros)")
    unsupported = {"multimodal inputs": multimodal_prompt(model_kwargs)}
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise NotImplementedError(f"speculative_generate at batch size > 1 does not support: {', '.join(bad)}")


def _check_batch_drafter(drafter) -> None:
    """The drafters a batch runs with: per-row drafters or a named one (`drafter`: a single instance given, or None)."""
    if drafter is not None:
        raise ValueError("drafter= is one drafter instance, and a batch needs one per row: pass a list of them "
                         "(drafter=[d_0, ..., d_B-1]) or name a registered drafter in assistant_config")


def _check_per_row(drafter: Drafter, rows: int) -> None:
    if rows > 1 and not drafter.per_row:
        raise NotImplementedError(f"the {drafter.name!r} drafter does not run as one instance per row of a batch (it "
                                  "drafts on the target's own cache); name it in assistant_config, whose batched form "
                                  "drafts every row")


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
    drafter: Drafter | list[Drafter] | BatchDrafter | None = None,
    spec_streamer=None,
    **model_kwargs,
):
    """Speculative decoding loop for `model.generate(..., custom_generate=speculative_generate)`.

    Args:
        assistant_config: an `AssistantConfig`, a dict, a drafter's name ("suffix", "ngram", ...: its defaults),
            or a path / Hub id for `AssistantConfig.from_pretrained`;
            default: the suffix drafter, or the model drafter when `draft_model` is given.
        draft_model: a causal LM with the target's tokenizer, for `drafter="model"`.
        drafter: a `Drafter` instance of your own; it replaces the drafter `assistant_config` names. For a batch,
            a list of them, one per row, or one `BatchDrafter` that drafts for every row.
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
    rows = input_ids.shape[0]
    config = _resolve_compile(config, model, generation_config)
    batch_given = drafter if isinstance(drafter, BatchDrafter) else None
    if batch_given is not None:
        if rows == 1:
            raise ValueError("drafter= is a BatchDrafter, which drafts for the rows of a batch; at batch size 1 pass "
                             "a Drafter")
        drafter = None
    given = list(drafter) if isinstance(drafter, (list, tuple)) else ([] if drafter is None else [drafter])
    bad = [type(d).__name__ for d in given if not isinstance(d, Drafter)]
    if bad:
        raise TypeError(f"drafter must be a hf_hybrid_spec.Drafter (or one per row, or a BatchDrafter for a batch), "
                        f"got {bad[0]}")
    if isinstance(drafter, (list, tuple)) and len(given) != rows:
        raise ValueError(f"drafter= lists {len(given)} drafters for a batch of {rows} rows: give one per row")
    if rows > 1:
        if streamer is not None:
            raise NotImplementedError("speculative_generate at batch size > 1 does not support a streamer (stock "
                                      "streamers take one sequence)")
        _check_batch_drafter(drafter if not given or len(given) != rows else None)
    # The drafter is built inside too: HVD profiles draft and verify costs there, with the same attention backends.
    with use_backend(config.kernel_backend), sdpa_without_cudnn():
        drafters = given
        batch_drafter = batch_given
        try:
            if rows > 1 and not given and batch_drafter is None:
                # One drafter for every row where the drafter has a batched form (EAGLE).
                batch_drafter = make_batch_drafter(config, model, draft_model, rows)
            if batch_drafter is None:
                # A batch's per-row drafters draft eagerly (one static store per row would capture graphs per row).
                row_config = config if rows == 1 else config.replace(compile=False, compile_drafter=False)
                while len(drafters) < rows:
                    drafters.append(make_drafter(row_config, model, draft_model))
                    _check_per_row(drafters[-1], rows)
                for d in drafters:
                    _check_per_row(d, rows)
                if rows > 1:
                    batch_drafter = PerRowDrafters(drafters)
            request = Request(model, adapter, input_ids, logits_processor, stopping_criteria, generation_config,
                              streamer, config, drafters[0] if rows == 1 else None, model_kwargs,
                              batch_drafter=batch_drafter)
            return decode_batch(request) if rows > 1 else decode(request)
        finally:
            for d in drafters:
                d.release()
            if batch_drafter is not None and not drafters:
                batch_drafter.release()


# ---------------------------------------------------------------------- enable()
# Stock `generate` kwargs that ask for assisted decoding; what `speculative_kwargs` makes of each is the table in
# docs/drafters.md, "The stock kwargs".
STOCK_SPECULATION_KWARGS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_config", "use_mtp",
                            "assistant_early_exit", "speculation_type", "assistant_tokenizer")


def speculative_kwargs(model: nn.Module, kwargs: dict, default: AssistantConfig | dict | str | None = None) -> dict:
    """`generate` kwargs that run `speculative_generate`, from the kwargs of a stock call: `assistant_model=` becomes
    the model drafter (`num_assistant_tokens=` its chain depth), `prompt_lookup_num_tokens=` (and
    `max_matching_ngram_size=`) the n-gram drafter, `use_mtp=True` the checkpoint's MTP head, `assistant_early_exit=E`
    the first E layers with the model's own head (layerskip), `assistant_config=` (else `default`, else the suffix
    drafter) the configuration; stop strings with `tokenizer=` become a stopping criterion (see
    `_stop_strings_with_tokenizer`). Candidate generators that cannot verify through our cache raise a ValueError
    saying why. Returns a new dict."""
    kwargs = dict(kwargs)
    assistant_model = kwargs.pop("assistant_model", None)
    lookup = kwargs.pop("prompt_lookup_num_tokens", None)
    ngram = kwargs.pop("max_matching_ngram_size", None)
    use_mtp = kwargs.pop("use_mtp", None)
    early_exit = kwargs.pop("assistant_early_exit", None)
    assistant_tokens = kwargs.pop("num_assistant_tokens", None)
    _refuse_stock_generators(kwargs, assistant_model)
    cfg = kwargs.pop("assistant_config", None)
    _stop_strings_with_tokenizer(model, kwargs)
    given = cfg if cfg is not None else default
    cfg = _resolve_config(given, assistant_model)
    asked = [name for name, value in (("assistant_model", assistant_model), ("prompt_lookup_num_tokens", lookup),
                                      ("use_mtp", use_mtp or None), ("assistant_early_exit", early_exit))
             if value is not None]
    if len(asked) > 1:
        raise ValueError(f"{' and '.join(asked)} each choose a drafter: pass one of them")
    if assistant_model is not None:
        if cfg.drafter != "model":
            cfg = cfg.replace(drafter="model")
        if assistant_tokens is not None:
            cfg = cfg.replace(max_depth=int(assistant_tokens),
                              max_draft_tokens=max(cfg.max_draft_tokens, int(assistant_tokens)))
        kwargs["draft_model"] = assistant_model
    elif lookup is not None:
        cfg = cfg.replace(drafter="ngram", max_draft_tokens=int(lookup), ngram_size=int(ngram or cfg.ngram_size))
    elif use_mtp:
        # Without a configuration of the caller's, the MTP drafter's own budget (a chain of 3), not the suffix one's.
        cfg = cfg.replace(drafter="mtp") if given is not None else AssistantConfig(drafter="mtp")
    elif early_exit is not None:
        cfg = cfg.replace(drafter="layerskip", exit_layer=int(early_exit))
    kwargs["custom_generate"] = speculative_generate
    kwargs["assistant_config"] = cfg
    if kwargs.get("streamer") is not None:
        kwargs["spec_streamer"] = kwargs["streamer"]
    return kwargs


def _refuse_stock_generators(kwargs: dict, assistant_model: nn.Module | None) -> None:
    """ValueError for the stock candidate generators whose drafts cannot be verified through our cache, naming why
    and what to use instead."""
    kind = kwargs.pop("speculation_type", None)
    if kind is not None:
        raise ValueError(f"speculation_type={kind!r} (transformers' DFlash block drafter) is not supported on hybrid "
                         "models here: its draft model keeps a KV cache filled from the target's hidden states that "
                         "transformers crops after rejections, and we have no DFlash drafter yet; use "
                         "AssistantConfig(drafter='eagle') with an EAGLE-3 drafter, or use_mtp=True")
    if kwargs.pop("assistant_tokenizer", None) is not None:
        raise ValueError("assistant_tokenizer= (universal assisted decoding: a draft model with another tokenizer) is "
                         "not supported: verification needs the draft tokens as ids of the target's vocabulary; use "
                         "a draft model that shares the target's tokenizer")
    name = type(assistant_model).__name__ if assistant_model is not None else ""
    if name.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant")):
        raise ValueError(f"{name} drafts from the shared key/value states of a Gemma 3n / Gemma 4 target, which "
                         "hybrid models do not produce")


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
        model.generate(**inputs, use_mtp=True)                         # the checkpoint's MTP head
        model.generate(**inputs, assistant_early_exit=4)               # first 4 layers + the model's head
        model.generate(**inputs, assistant_config=AssistantConfig(...))

    all run `speculative_generate` (stock `generate` refuses them on stateful models before any custom callable
    runs; docs/drafters.md, "The stock kwargs", lists every stock candidate generator). Plain calls without those
    kwargs are untouched. `model.generate_batch(...)` and `model.init_continuous_batching(...)` (which stock refuses
    on hybrids) run our continuous batching with speculation (docs/serving.md). Only this model instance is changed;
    `assistant_config` sets its default configuration. Returns the model.
    """
    get_adapter(model)  # fail now, not at the first generate, for unsupported models
    if getattr(model.generate, "__hf_hybrid_spec_enabled__", False):
        return model
    default = assistant_config
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        custom = kwargs.get("custom_generate")
        asks = any(kwargs.get(k) not in (None, False) for k in STOCK_SPECULATION_KWARGS)
        if custom not in (None, speculative_generate):
            if asks:
                raise ValueError(f"the speculation kwargs ({', '.join(STOCK_SPECULATION_KWARGS)}) cannot be "
                                 "combined with another custom_generate")
            return original(*args, **kwargs)
        if custom is None and not asks and default is None:
            return original(*args, **kwargs)
        return original(*args, **speculative_kwargs(model, kwargs, default))

    generate.__hf_hybrid_spec_enabled__ = True
    generate.__signature__ = inspect.signature(original)
    model.generate = generate
    _enable_continuous_batching(model, default)
    return model


def _enable_continuous_batching(model: nn.Module, default) -> None:
    """`model.generate_batch` and `model.init_continuous_batching` (transformers' continuous-batching entry points,
    which refuse hybrid models) run our serving engine (`serving.manager`), with `default` as the assistant config.
    Takes their arguments; `continuous_batching_config` is transformers' own and is refused (pass
    `serving_config=ServingConfig(...)`); `persistent_manager`, `warmup` and `workload_hints` have nothing to do
    here and are accepted."""

    def refuse(config) -> None:
        if config is not None:
            raise ValueError("continuous_batching_config configures transformers' own manager; hf_hybrid_spec's takes "
                             "serving_config=hf_hybrid_spec.ServingConfig(max_slots=..., max_total_tokens=...)")

    def generate_batch(inputs, generation_config=None, continuous_batching_config=None, record_timestamps=False,
                       progress_bar=False, persistent_manager=False, warmup=True, max_new_tokens=None,
                       serving_config=None, assistant_config=None, draft_model=None):
        from .serving import generate_batch as ours

        refuse(continuous_batching_config)
        return ours(model, inputs, generation_config, assistant_config if assistant_config is not None else default,
                    serving_config, max_new_tokens, record_timestamps, progress_bar, draft_model)

    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 serving_config=None, assistant_config=None, draft_model=None):
        from .serving import init_continuous_batching as ours

        refuse(continuous_batching_config)
        return ours(model, assistant_config if assistant_config is not None else default, serving_config,
                    generation_config, draft_model)

    model.generate_batch = generate_batch
    model.init_continuous_batching = init_continuous_batching
