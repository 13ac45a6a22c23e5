"""`MtpHead`: the multi-token-prediction module that Qwen3.5 and Qwen3-Next checkpoints ship under `mtp.*`.

Architecture (the checkpoint's layout; transformers drops these weights when it loads the target):

    x      = fc(cat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))   [B, T, 2H] -> [B, T, H]
    x      = layers[0](x)        the target family's own decoder layer class, as a full-attention layer (gated
                                 attention, q/k norms, partial rotary; Qwen3-Next's and Qwen3.5-MoE's MoE MLP)
    h'     = norm(x)             -> fed back as h for the next depth (recursive MTP)
    logits = lm_head(h')         the target's head, shared (never stored twice)

`h_t` is the target's last hidden state after its final norm (`hidden_states[num_hidden_layers]`), the step sits at
position t (as vLLM and SGLang run it). The token embedding, the head and the rotary embedding are the target's;
the module holds only `fc`, the three norms and the layers. The number of layers is the config's
`mtp_num_hidden_layers` (Qwen's name; `num_nextn_predict_layers` as vLLM spells it is read too); both families ship
one, used recursively for every depth (the first layer drafts every depth when there are more).

Loading: `load_mtp_state` reads only the `mtp.*` tensors from the target checkpoint's safetensors (the shards that
the index names for them), resolved through transformers' `cached_file` (a local folder or the Hub cache). Experts
come per expert in checkpoints (`experts.{e}.gate_proj.weight`, ...), as transformers' `save_pretrained` writes
them, while the decoder layer holds them fused (`experts.gate_up_proj`, `experts.down_proj`); `_fuse_experts` /
`_split_experts` convert both ways. (transformers' own conversion machinery needs a `PreTrainedModel` whose
prefixes match the checkpoint, which this head, built from a decoder layer and not a model class, is not.)
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..forward import _cache_kwarg_for

__all__ = ["MtpHead", "MtpStore", "mtp_layer_count", "load_mtp_state", "save_mtp_state", "MTP_PREFIX"]

MTP_PREFIX = "mtp."
# Text model types whose checkpoints ship this MTP layout (Qwen3.5, its MoE, Qwen3-Next).
SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
_LAYER_COUNT_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def mtp_layer_count(target_config) -> int:
    """MTP layers the target's config declares (0 when it has none)."""
    config = target_config.get_text_config()
    for name in _LAYER_COUNT_FIELDS:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 0


@dataclass
class _Shared:
    """The target's modules the head reads (embedding, head, rotary embedding): not submodules, so they are never
    saved with the head, never trained, and never moved by `head.to(...)`."""

    embed: nn.Module
    lm_head: nn.Module
    rotary: nn.Module


class MtpStore:
    """Keys and values of the MTP layer, in the shape transformers' attention writes them ([1, kv_heads, S, d]),
    behind the one method the attention calls (`update`). `length` is where the next write goes: the drafter
    sets it back to the committed steps after drafting a tree, so tree nodes' entries are simply overwritten."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        t = key.shape[2]
        end = self.length + t
        if self.keys is None or self.keys.shape[2] < end:
            cap = max(end, 2 * (0 if self.keys is None else self.keys.shape[2]), 64)
            keys = key.new_zeros(*key.shape[:2], cap, key.shape[3])
            values = value.new_zeros(*value.shape[:2], cap, value.shape[3])
            if self.keys is not None:
                keys[:, :, : self.length] = self.keys[:, :, : self.length]
                values[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = keys, values
        self.keys[:, :, self.length : end] = key
        self.values[:, :, self.length : end] = value
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def release(self) -> None:
        self.keys = self.values = None
        self.length = 0


def _mtp_config(target_config, layers: int):
    """The target's text config with `layers` full-attention layers (what the MTP decoder layers are built from)."""
    config = copy.deepcopy(target_config.get_text_config())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * layers
    # Tree drafting passes explicit 4-D masks, which flash attention would ignore.
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        config._attn_implementation = "sdpa"
    return config


class MtpHead(nn.Module):
    """The target checkpoint's MTP module, bound to the target (see the module docstring).

    Build with `MtpHead.from_target(target)` (random weights, or `load=True` for the checkpoint's) and use as
    `speculative_generate(..., assistant_config=AssistantConfig(drafter="mtp"))`, which loads it itself when no
    `draft_model` is given.
    """

    def __init__(self, target: nn.Module, layers: int | None = None):
        super().__init__()
        tc = target.config.get_text_config()
        n = layers if layers is not None else mtp_layer_count(target.config)
        if n < 1:
            raise ValueError(f"drafter='mtp' needs a checkpoint with multi-token-prediction weights: the "
                             f"{tc.model_type} config declares none ({' / '.join(_LAYER_COUNT_FIELDS)})")
        if tc.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"drafter='mtp' knows the MTP layout of {', '.join(SUPPORTED_MODEL_TYPES)}; this target "
                             f"is {tc.model_type}")
        decoder = target.get_decoder()
        norm_cls = type(decoder.norm)
        layer_cls = type(decoder.layers[0])
        self.config = _mtp_config(target.config, n)
        h, eps = tc.hidden_size, tc.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_cls(h, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=eps)
        self.layers = nn.ModuleList(layer_cls(self.config, i) for i in range(n))
        self.norm = norm_cls(h, eps=eps)
        self._cache_kwarg = _cache_kwarg_for(layer_cls)
        self._shared = _Shared(target.get_input_embeddings(), target.get_output_embeddings(), decoder.rotary_emb)
        self._init_from(target)
        param = next(target.parameters())
        self.to(device=param.device, dtype=param.dtype)

    @torch.no_grad()
    def _init_from(self, target: nn.Module) -> None:
        """Random weights the way the target's class initializes its own (fused experts are allocated empty)."""
        init = getattr(target, "_init_weights", None)
        for module in self.modules():
            if init is not None and module is not self:
                init(module)

    @classmethod
    def from_target(cls, target: nn.Module, load: bool = False, checkpoint: str | os.PathLike | None = None,
                    layers: int | None = None) -> MtpHead:
        """A head shaped for `target`; with `load`, the `mtp.*` weights of `checkpoint` (default: the folder or Hub
        id the target was loaded from)."""
        head = cls(target, layers=layers)
        if load:
            head.load_checkpoint(checkpoint if checkpoint is not None else _target_path(target))
        return head.eval()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, target: nn.Module,
                        layers: int | None = None) -> MtpHead:
        """The head saved at `pretrained_model_name_or_path` (a checkpoint folder or Hub id holding `mtp.*` tensors,
        as `save_mtp_state` and recipes/train_mtp.py write, or one `.safetensors` MTP shard), bound to `target`
        (the head shares its embedding, output head and rotary embedding, so it is built around a loaded target).
        `layers`: MTP layers, default the count the checkpoint's config (or `target`'s) declares."""
        from ..hub import resolve_source

        source = resolve_source(pretrained_model_name_or_path, "MTP head")
        if layers is None and os.path.isdir(source):
            config_path = os.path.join(source, "config.json")
            if os.path.isfile(config_path):
                with open(config_path) as f:
                    config = json.load(f)
                layers = config.get("text_config", config).get("mtp_num_hidden_layers") or None
        return cls.from_target(target, load=True, checkpoint=source, layers=layers)

    # ------------------------------------------------------------------ the step
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self._shared.embed
        return table(input_ids.to(table.weight.device)).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, store: MtpStore | None) -> torch.Tensor:
        """One MTP step for T inputs.

        hidden: [1, T, H] the target's (or the previous depth's) hidden state of token t; embeds: [1, T, H] the
        embedding of token t + 1; positions: [1, T] (t); mask: additive float [1, 1, T, S] over the store's S keys
        after this step's are written (None: causal over T, no past). Returns h' [1, T, H] (after the final norm).
        """
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden.to(embeds.dtype))], dim=-1)
        x = self.fc(x)
        rotary = self._shared.rotary
        # Qwen3.5's multimodal rotary embedding reads [3, B, T] position ids (all three the text positions here).
        rope_positions = positions[None].expand(3, *positions.shape) if hasattr(rotary, "mrope_section") else positions
        tables = rotary(x, rope_positions)
        out = self.layers[0](x, position_embeddings=tables, attention_mask=mask, position_ids=positions,
                             **{self._cache_kwarg: store})
        if isinstance(out, tuple):
            out = out[0]
        return self.norm(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits [..., V] of h' [..., H], through the target's own head."""
        head = self._shared.lm_head
        return head(hidden.to(head.weight.dtype))

    # ------------------------------------------------------------------ checkpoint layout
    def load_checkpoint(self, checkpoint: str | os.PathLike) -> None:
        """Load the `mtp.*` weights of a target checkpoint (folder or Hub id, or an MTP `.safetensors` shard);
        ValueError naming what is off."""
        state = load_mtp_state(checkpoint)
        if not state:
            raise ValueError(f"{checkpoint} holds no '{MTP_PREFIX}*' weights: this checkpoint ships no MTP module "
                             "(train one with recipes/train_mtp.py)")
        self.load_mtp_state_dict(state)

    def load_mtp_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint-layout state dict (keys without the `mtp.` prefix, experts per expert or fused)."""
        own = self.state_dict()
        state = _fuse_experts(state, own)
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"the checkpoint's MTP weights do not fit this target's MTP module: missing "
                             f"{missing[:6]}{'...' if len(missing) > 6 else ''}, unexpected "
                             f"{unexpected[:6]}{'...' if len(unexpected) > 6 else ''}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"MTP weight {name}: checkpoint shape {tuple(tensor.shape)}, this target's "
                                 f"{tuple(own[name].shape)}")
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in the checkpoint's layout: `mtp.`-prefixed keys, experts per expert."""
        state = _split_experts({k: v.detach() for k, v in self.state_dict().items()})
        return {MTP_PREFIX + k: v.contiguous() for k, v in state.items()}


def _target_path(target: nn.Module) -> str:
    path = getattr(target.config, "_name_or_path", None) or getattr(target, "name_or_path", None)
    if not path:
        raise ValueError("drafter='mtp' loads the MTP weights from the target's checkpoint, but this target was not "
                         "loaded from one: pass draft_model=MtpHead.from_target(target, load=True, checkpoint=...)")
    return str(path)


def _checkpoint_files(checkpoint: str | os.PathLike) -> tuple[list[str], set[str] | None]:
    """The safetensors files holding `mtp.*` weights (through transformers' `cached_file`: a local folder or the
    Hub cache) and, for a sharded checkpoint, the MTP keys its index names."""
    from transformers.utils import cached_file

    path = str(checkpoint)
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index is not None:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        keys = {k for k in weight_map if k.startswith(MTP_PREFIX)}
        shards = sorted({weight_map[k] for k in keys})
        return [cached_file(path, shard) for shard in shards], keys
    single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if single is None:
        raise ValueError(f"{path} has no safetensors weights (model.safetensors or its index): the MTP drafter "
                         "reads the checkpoint's mtp.* tensors from them")
    return [single], None


def load_mtp_state(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint's `mtp.*` tensors (prefix removed), read from only the shards that hold them. `checkpoint` is
    a checkpoint folder or Hub id, or one `.safetensors` file (an MTP shard on its own, as recipes/train_mtp.py
    writes)."""
    from safetensors import safe_open

    if os.fspath(checkpoint).endswith(".safetensors"):
        files, keys = [os.fspath(checkpoint)], None
    else:
        files, keys = _checkpoint_files(checkpoint)
    state = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key.startswith(MTP_PREFIX) and (keys is None or key in keys):
                    state[key[len(MTP_PREFIX):]] = f.get_tensor(key)
    return state


def save_mtp_state(head: MtpHead, checkpoint: str | os.PathLike) -> str:
    """Write `head`'s weights into the target checkpoint folder `checkpoint` in its own layout: a `mtp.safetensors`
    shard, the index updated (created for a one-file checkpoint), and `mtp_num_hidden_layers` in config.json, so
    that vLLM, SGLang and `drafter="mtp"` read them. Returns the shard's path."""
    from safetensors.torch import save_file

    folder = os.fspath(checkpoint)
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    elif os.path.exists(os.path.join(folder, "model.safetensors")):
        index = {"metadata": {}, "weight_map": _single_file_map(os.path.join(folder, "model.safetensors"))}
    else:
        raise ValueError(f"{folder} is not a safetensors checkpoint folder (save the target there first)")
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(MTP_PREFIX)}
    state = {k: v.cpu() for k, v in head.checkpoint_state_dict().items()}
    shard = os.path.join(folder, "mtp.safetensors")
    save_file(state, shard, metadata={"format": "pt"})
    index["weight_map"].update({k: "mtp.safetensors" for k in state})
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = len(head.layers)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return shard


def _single_file_map(path: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {k: os.path.basename(path) for k in f.keys()}


_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _fuse_experts(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> the fused `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
    `experts.down_proj` [E, H, I] that the decoder layer holds; other keys unchanged."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, tensor in state.items():
        m = _EXPERT.match(key)
        if m is None or f"{m['prefix']}.gate_up_proj" not in own:
            out[key] = tensor
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = tensor
    for prefix, projs in groups.items():
        count = len(projs.get("down_proj", {}))
        if any(sorted(projs.get(p, {})) != list(range(count)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"the checkpoint's experts under {prefix} are incomplete")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(count)])
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(count)])
    return out


def _split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_fuse_experts`: fused expert tensors -> per-expert `gate_proj` / `up_proj` / `down_proj`."""
    out = {}
    for key, tensor in state.items():
        if key.endswith(".experts.gate_up_proj"):
            prefix = key[: -len(".gate_up_proj")]
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:]
        elif key.endswith(".experts.down_proj"):
            prefix = key[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[key] = tensor
    return out
