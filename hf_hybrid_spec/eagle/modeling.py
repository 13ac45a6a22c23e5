"""`EagleDrafter`: the EAGLE-3 draft model as a Hugging Face `PreTrainedModel`.

    fused  = fc(cat(target hidden states at aux_layers))              [B, T, k*H] -> [B, T, H]
    x      = cat(input_norm(embed(token)), hidden_norm(fused or own)) [B, T, 2H]
    h      = fused + attn(x)            attention over the drafter's own keys/values (RoPE)
    h      = h + mlp(post_norm(h))      -> the drafter's hidden state, fed back in place of `fused` one step later
    logits = lm_head(norm(h))           over the draft vocabulary; draft id d is target id d + d2t[d]
                                        (tie_target_head: the target's output embedding over the whole vocabulary)

The token embedding is the target's (shared, never stored in the checkpoint): `bind(target)` checks that the
target matches and hands the drafter its embedding module. `d2t` ([draft_vocab] int64 offsets) and `t2d`
([vocab] bool) follow EAGLE-3's checkpoint convention and are saved as buffers.

Attention is exposed in pieces (`project` -> queries/keys/values, `attend`, `finish`) so that the caller picks
the attention pattern: causal over committed tokens (`forward`), a draft tree (`EagleTreeDrafter`) or the
training-time-test pattern of `training.ttt_loss`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from ..hub import LocalFirstMixin, files_as_umask
from .configuration import EagleConfig, attention_layer_flags

logger = logging.get_logger(__name__)

__all__ = ["EagleDrafter", "EagleStep", "write_model_card"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] of integer positions [B, T] (half-split layout, as Llama), in `dtype`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1)[:, None].to(dtype), torch.cat([sin, sin], dim=-1)[:, None].to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, h, T, d] with the (cos, sin) tables of `rotary` (broadcast over heads)."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@dataclass
class EagleStep:
    """Queries, keys and values of one drafter step, and the residual they sit on.

    Attributes:
        query: [B, heads, T, head_dim] (rotated).
        key, value: [B, kv_heads, T, head_dim] (key rotated).
        residual: [B, T, H], the step's hidden input (target features or the drafter's own previous output).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    residual: torch.Tensor


@dataclass
class _SharedEmbedding:
    """The target's token embedding (or, with `tie_target_head`, its output embedding). A plain holder, not a
    submodule: it is never saved with the drafter, never trained, and never moved by `drafter.to(...)` (it stays
    wherever the target is)."""

    module: nn.Module


class EagleDrafter(LocalFirstMixin, PreTrainedModel):
    """EAGLE-3 draft model for a hybrid (or attention-only) target. See the module docstring."""

    config_class = EagleConfig
    base_model_prefix = "eagle"
    main_input_name = "hidden_states"

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        h, qd, kvd = config.hidden_size, config.num_attention_heads * config.head_dim, \
            config.num_key_value_heads * config.head_dim
        self.fc = nn.Linear(len(config.aux_layers) * h, h, bias=False)
        self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, qd, bias=False)
        self.k_proj = nn.Linear(2 * h, kvd, bias=False)
        self.v_proj = nn.Linear(2 * h, kvd, bias=False)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.post_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # With tie_target_head the head is the bound target's output embedding (`_shared_head`), not a parameter.
        self.lm_head = None if config.tie_target_head else nn.Linear(h, config.draft_vocab_size, bias=False)
        # Identity maps until `set_vocab_maps`: the draft vocabulary is the first draft_vocab_size target ids.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self._shared: _SharedEmbedding | None = None
        self._shared_head: _SharedEmbedding | None = None
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    # ------------------------------------------------------------------ vocabulary maps
    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] int64: the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocab_maps(self, target_ids: torch.Tensor) -> None:
        """Set the draft vocabulary to `target_ids` ([draft_vocab] distinct target ids, any order; stored sorted)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten().unique(sorted=True)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} distinct target ids, got {ids.numel()}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"target ids must lie in [0, {self.config.vocab_size})")
        ids = ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    # ------------------------------------------------------------------ binding to a target
    def check_target(self, target: nn.Module) -> None:
        """Raise ValueError unless `target` has this drafter's hidden size, vocabulary and enough layers."""
        tc = target.config.get_text_config()
        c = self.config
        if tc.hidden_size != c.hidden_size:
            raise ValueError(f"this EAGLE drafter was built for hidden size {c.hidden_size}, but the target "
                             f"({tc.model_type}) has hidden size {tc.hidden_size}")
        if tc.vocab_size != c.vocab_size:
            raise ValueError(f"this EAGLE drafter was built for a vocabulary of {c.vocab_size} tokens, but the "
                             f"target has {tc.vocab_size}: it needs the target's tokenizer")
        if max(c.aux_layers) > tc.num_hidden_layers:
            raise ValueError(f"aux_layers {c.aux_layers} need hidden_states indices up to {max(c.aux_layers)}, "
                             f"but the target has only {tc.num_hidden_layers} layers")
        if c.target_model_type is not None and c.target_model_type != tc.model_type:
            logger.warning("this EAGLE drafter was trained for a %s target; using it with a %s target",
                           c.target_model_type, tc.model_type)
        if c.target_num_hidden_layers is not None and c.target_num_hidden_layers != tc.num_hidden_layers:
            raise ValueError(f"this EAGLE drafter was trained on a {c.target_num_hidden_layers}-layer target; "
                             f"this target has {tc.num_hidden_layers} layers")

    def bind(self, target: nn.Module) -> EagleDrafter:
        """Check `target` (see `check_target`) and share its token embedding. Returns self."""
        if self.config.aux_layers_from_target:
            n = target.config.get_text_config().num_hidden_layers
            self.config.aux_layers = sorted({2, n // 2, n - 3})
            self.config.aux_layers_from_target = False
            if len(self.config.aux_layers) * self.config.hidden_size != self.fc.in_features:
                raise ValueError(f"this drafter's fc reads {self.fc.in_features // self.config.hidden_size} target "
                                 f"layers; EAGLE-3's default for a {n}-layer target is {self.config.aux_layers}")
        self.check_target(target)
        self._shared = _SharedEmbedding(target.get_input_embeddings())
        if self.config.tie_target_head:
            head = target.get_output_embeddings()
            shape = (self.config.vocab_size, self.config.hidden_size)
            if head is None or tuple(head.weight.shape) != shape:
                raise ValueError(f"tie_target_head needs the target's output embedding of shape {shape}, got "
                                 f"{None if head is None else tuple(head.weight.shape)}")
            self._shared_head = _SharedEmbedding(head)
        return self

    def shared_weight_ptrs(self) -> tuple[int, ...]:
        """Addresses of the bound target's weights the drafter reads (embedding; output embedding when tied):
        captured drafting graphs read them, so they key the graphs."""
        ptrs = (self.embed_table_ptr(),)
        if self._shared_head is not None:
            ptrs += (self._shared_head.module.weight.data_ptr(),)
        return ptrs

    def embed_table_ptr(self) -> int:
        """Address of the bound target's embedding weights (identifies what captured drafting graphs read)."""
        if self._shared is None:
            raise RuntimeError("this EagleDrafter is not bound to a target: call drafter.bind(target) first")
        return self._shared.module.weight.data_ptr()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target token embeddings [B, T, H] of target ids [B, T], in the drafter's dtype and device."""
        if self._shared is None:
            raise RuntimeError("this EagleDrafter is not bound to a target: call drafter.bind(target) first")
        table = self._shared.module
        out = table(input_ids.to(table.weight.device))
        return out.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    # ------------------------------------------------------------------ the layer, in pieces
    def fuse(self, aux_states: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """Target hidden states at `aux_layers` (each [B, T, H], in that order) -> fused features [B, T, H]."""
        if len(aux_states) != len(self.config.aux_layers):
            raise ValueError(f"expected {len(self.config.aux_layers)} hidden states, got {len(aux_states)}")
        w = self.fc.weight
        return self.fc(torch.cat([s.to(device=w.device, dtype=w.dtype) for s in aux_states], dim=-1))

    def project(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor | None = None,
                tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> EagleStep:
        """hidden, embeds: [B, T, H]; positions: [B, T] -> the step's rotated queries, keys and values.

        `tables`: the positions' (cos, sin) from `rotary_tables`, when the caller has them (tree drafting computes
        every depth's at once); else they are computed from `positions`, once for queries and keys.
        """
        c = self.config
        b, t, h = hidden.shape
        x = torch.cat([self.input_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = tables if tables is not None else self.rotary_tables(positions, q.dtype)
        residual = x[..., h:] if c.norm_before_residual else hidden
        return EagleStep(rotate(q, cos, sin), rotate(k, cos, sin), v, residual)

    def rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, 1, T, head_dim] of positions [B, T] for this drafter's heads."""
        return rotary(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of query [B, h, T, d] over key/value [B, kv, S, d]; mask: bool [T, S] or [B, 1, T, S]
        (True = may attend) or None for causal with T == S. Returns [B, h, T, d]."""
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Attention output [B, h, T, d] on top of `residual` [B, T, H], then the MLP -> hidden [B, T, H]."""
        b, _, t, _ = attn.shape
        h = residual + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        x = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of drafter hidden states [..., H]."""
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden))
        if self._shared_head is None:
            raise RuntimeError("this EagleDrafter reads the target's output embedding (tie_target_head): call "
                               "drafter.bind(target) first")
        x = self.norm(hidden)
        # Detached: the target is frozen, and no gradient should reach (or be stored for) its weights.
        weight = self._shared_head.module.weight.detach().to(device=x.device, dtype=x.dtype)
        return F.linear(x, weight)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        """Causal forward over T steps without a cache (tests, single-step training).

        hidden_states: [B, T, H] fused target features; input_ids [B, T] (the NEXT token of each position) or
        inputs_embeds [B, T, H]. Returns (hidden [B, T, H], logits [B, T, draft_vocab]).
        """
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids)
        b, t, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=hidden_states.device).expand(b, t)
        step = self.project(hidden_states, inputs_embeds, position_ids)
        hidden = self.finish(step.residual, self.attend(step.query, step.key, step.value, None))
        return hidden, self.logits(hidden)

    # ------------------------------------------------------------------ Hub format
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a drafter saved by `save_pretrained` in any layout of `formats.FORMATS`: ours, SpecForge's
        (`LlamaForCausalLMEagle3`, `midlayer.*`) or speculators' (`eagle3`, `layers.0.*`)."""
        from transformers.utils import cached_file

        from ..hub import resolve_source
        from .formats import detect_format, load_foreign

        source = resolve_source(pretrained_model_name_or_path, cls.__name__)
        path = cached_file(source, "config.json", _raise_exceptions_for_missing_entries=False)
        if path is None:
            return super().from_pretrained(source, *args, **kwargs)
        with open(path) as f:
            raw = json.load(f)
        fmt = detect_format(raw)
        if fmt == "hf_hybrid_spec":
            return super().from_pretrained(source, *args, **kwargs)
        config, state = load_foreign(source, raw, fmt)
        drafter = cls(config)
        own = drafter.state_dict()
        drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype is not None and dtype != "auto":
            drafter = drafter.to(dtype)
        return drafter.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, *args, format: str = "hf_hybrid_spec",
                        target: nn.Module | None = None, **kwargs):
        """Save config, weights (safetensors: no embedding, maps included) and a generated model card.

        `format`: "hf_hybrid_spec" (ours), or "specforge" / "speculators" for SGLang / vLLM (`formats`; `target`
        supplies the head a `tie_target_head` drafter writes out there).
        """
        if format != "hf_hybrid_spec":
            from .formats import export_drafter

            return export_drafter(self, save_directory, format, target=target)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_model_card(self.config, os.path.join(save_directory, "README.md"))
            files_as_umask(save_directory)
        return result

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                    token: str | bool | None = None, revision: str | None = None, create_pr: bool = False,
                    **kwargs):
        """Upload `save_pretrained`'s folder (with this drafter's own model card) to the Hub repository `repo_id`.

        transformers' `push_to_hub` replaces README.md with a generic card; this one keeps the generated card.
        """
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, **kwargs)
            return api.upload_folder(repo_id=repo_id, folder_path=tmp, revision=revision, create_pr=create_pr,
                                     commit_message=commit_message or "Upload EAGLE-3 drafter")

    @classmethod
    def from_target(cls, target: nn.Module, aux_layers: list[int] | None = None, draft_vocab_size: int = 2048,
                    intermediate_size: int | None = None, init_head_from_target: bool = True,
                    tie_target_head: bool = False,
                    **overrides) -> EagleDrafter:
        """A fresh drafter shaped for `target` (attention heads and widths from its config), bound to it.

        With `init_head_from_target`, the draft head starts as the target's output-embedding rows of the draft
        vocabulary (identity maps until `set_vocab_maps`; call `init_head_from(target)` again after it).
        With `tie_target_head` the head is the target's output embedding itself (whole vocabulary, not stored).
        """
        from .configuration import default_aux_layers

        tc = target.config.get_text_config()
        heads = getattr(tc, "num_attention_heads", 8)
        config = EagleConfig(
            hidden_size=tc.hidden_size,
            vocab_size=tc.vocab_size,
            draft_vocab_size=tc.vocab_size if tie_target_head else min(draft_vocab_size, tc.vocab_size),
            tie_target_head=tie_target_head,
            aux_layers=aux_layers if aux_layers is not None else default_aux_layers(tc),
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
            intermediate_size=intermediate_size or getattr(tc, "intermediate_size", 4 * tc.hidden_size),
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            target_model_type=tc.model_type,
            target_name_or_path=getattr(target.config, "_name_or_path", None) or None,
            target_num_hidden_layers=tc.num_hidden_layers,
            target_attention_layers=attention_layer_flags(tc),
            **overrides,
        )
        drafter = cls(config).to(device=target.device)
        drafter.bind(target)
        if init_head_from_target and not tie_target_head:
            drafter.init_head_from(target)
        return drafter

    @torch.no_grad()
    def init_head_from(self, target: nn.Module) -> None:
        """Copy the target's output-embedding rows of the draft vocabulary into the draft head (a warm start:
        the drafter then only has to learn hidden states that the target's own head reads well). Nothing to do
        with `tie_target_head` (the head is the target's)."""
        if self.lm_head is None:
            return
        weight = target.get_output_embeddings().weight
        rows = weight[self.draft_to_target.to(weight.device)]
        self.lm_head.weight.copy_(rows.to(self.lm_head.weight))


def _layer_kind(flags: list[bool] | None, index: int) -> str:
    if index == 0:
        return "token embeddings"
    if not flags or index > len(flags):
        return f"output of layer {index - 1}"
    kind = "full attention" if flags[index - 1] else "linear attention / SSM"
    return f"output of layer {index - 1} ({kind})"


def _bullets(record: dict, indent: str = "") -> list[str]:
    """Markdown bullets of a training record; nested records (an earlier run) become sub-bullets."""
    lines = []
    for key, value in record.items():
        label = key.replace("_", " ")
        if isinstance(value, dict):
            lines.append(f"{indent}- {label}:")
            lines += _bullets(value, indent + "  ")
        else:
            lines.append(f"{indent}- {label}: {value}")
    return lines


def write_model_card(config: EagleConfig, path: str | os.PathLike) -> None:
    """Write a Hub model card (README.md with YAML metadata) naming the target, the aux layers and the data."""
    flags = config.target_attention_layers
    target = config.target_name_or_path or "unknown"
    layers = "\n".join(f"  - `hidden_states[{i}]`: {_layer_kind(flags, i)}"
                       for i in config.aux_layers)
    training = config.training
    data = training.get("data", "not recorded")
    facts = _bullets({k: v for k, v in training.items() if k != "data"})
    if getattr(config, "tie_target_head", False):
        head = (f"the target's own output embedding (frozen, not stored here) reads its hidden state over all "
                f"{config.vocab_size} tokens")
    else:
        head = (f"a head predicts {config.draft_vocab_size} of the target's {config.vocab_size} tokens\n(`d2t` / "
                f"`t2d` maps in the checkpoint)")
    # Hub metadata takes repository ids only, not local paths.
    name = config.target_name_or_path or ""
    is_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.exists(name)
    base = f"base_model: {name}\n" if is_hub_id else ""
    card = f"""---
library_name: hf_hybrid_spec
tags:
- speculative-decoding
- eagle3
- hf_hybrid_spec
{base}---

# EAGLE-3 drafter for `{target}`

A draft model for exact speculative decoding with `hf_hybrid_spec` (greedy output identical to the
target's, sampling lossless).
Architecture EAGLE-3: the target's hidden states at {len(config.aux_layers)} depths are fused by
`fc: {len(config.aux_layers)}H -> H` (H = {config.hidden_size}), one decoder layer ({config.num_attention_heads}
heads, {config.num_key_value_heads} key/value heads, MLP width {config.intermediate_size}) runs over the drafter's
own keys and values, and {head}. The token embedding is the target's and is not stored here.

## Target

- model: `{target}` (`{config.target_model_type}`, {config.target_num_hidden_layers} layers)
- layers read (`aux_layers`, indices into the target's `hidden_states`):
{layers}

## Training data

{data}

{chr(10).join(facts) if facts else "- no training record"}

## Use

```python
from transformers import AutoModelForCausalLM
from hf_hybrid_spec import AssistantConfig, speculative_generate
from hf_hybrid_spec.eagle import EagleDrafter

target = AutoModelForCausalLM.from_pretrained("{target}", attn_implementation="sdpa")
drafter = EagleDrafter.from_pretrained("<this repository>")
out = target.generate(**inputs, do_sample=False, custom_generate=speculative_generate, draft_model=drafter,
                      assistant_config=AssistantConfig(drafter="eagle", max_draft_tokens=60, max_depth=6,
                                                       draft_top_k=10))
```
"""
    with open(path, "w") as f:
        f.write(card)
