"""EAGLE-3 checkpoints in the layouts other projects read and write: SpecForge / SafeAILab and vLLM's `speculators`.

Both hold the same single-layer EAGLE-3 drafter as ours (`EagleDrafter`), under other names:

    ours                 SpecForge (SGLang)                       speculators (vLLM)
    fc                   fc                                       fc
    input_norm           midlayer.input_layernorm                 layers.0.input_layernorm
    hidden_norm          midlayer.hidden_norm                     layers.0.hidden_norm
    q/k/v/o_proj         midlayer.self_attn.{q,k,v,o}_proj        layers.0.self_attn.{q,k,v,o}_proj
    post_norm            midlayer.post_attention_layernorm        layers.0.post_attention_layernorm
    gate/up/down_proj    midlayer.mlp.{gate,up,down}_proj         layers.0.mlp.{gate,up,down}_proj
    norm, lm_head        norm, lm_head                            norm, lm_head
    d2t, t2d             d2t, t2d                                 d2t, t2d

Configs. SpecForge writes a Llama config (`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, and
`eagle_config.eagle_aux_hidden_state_layer_ids`, ids of the layers whose OUTPUT is read: SGLang captures the input
of layer id + 1, so our `hidden_states` index is id + 1). `speculators` writes `speculators_model_type: "eagle3"`,
the layer's Llama config under `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual` and
`eagle_aux_hidden_state_layer_ids`, ids of the layers whose INPUT is read (vLLM's convention: our index itself;
`num_hidden_layers` is the final output). Missing ids mean EAGLE-3's default [2, N // 2, N - 3] in both.

Positions: SpecForge numbers the steps from 0, speculators from 1; rotary attention depends only on position
differences, so both run unchanged. The token embedding is always the target's (SGLang and vLLM share it too), so
`embed_tokens.weight`, when a checkpoint has it, is not loaded, and exports leave it out. A drafter with
`tie_target_head` writes the target's output embedding as its `lm_head` (both layouts need a head), over the whole
vocabulary.
"""

from __future__ import annotations

import json
import os

import torch

from .configuration import EagleConfig

__all__ = ["FORMATS", "detect_format", "load_foreign", "export_drafter"]

FORMATS = ("hf_hybrid_spec", "specforge", "speculators")
_LAYER_PREFIX = {"specforge": "midlayer.", "speculators": "layers.0."}
# Our parameter -> its name inside the foreign decoder layer (others keep their name at the top level).
_IN_LAYER = {
    "input_norm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
_TOP = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
_IGNORED = ("embed_tokens.weight",)


def detect_format(config: dict) -> str:
    """Which layout a drafter's config.json describes (ValueError when none we read)."""
    if config.get("model_type") == EagleConfig.model_type:
        return "hf_hybrid_spec"
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"a speculators checkpoint of type {config['speculators_model_type']!r}: only 'eagle3' "
                             "drafters load as an EagleDrafter")
        return "speculators"
    if any("Eagle3" in a for a in config.get("architectures") or []) or "eagle_config" in config:
        return "specforge"
    raise ValueError("this config.json is not an EAGLE-3 drafter we read (ours, SpecForge's LlamaForCausalLMEagle3, or "
                     f"speculators' eagle3); model_type={config.get('model_type')!r}")


def _rope_theta(layer: dict) -> float:
    params = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"this EAGLE-3 checkpoint uses {kind!r} rotary scaling; the EagleDrafter implements plain "
                         "RoPE only")
    return float(params.get("rope_theta") or layer.get("rope_theta") or 10000.0)


def _config_from(layer: dict, fmt: str, draft_vocab: int, ids: list[int] | None, norm_before_residual: bool,
                 target_hidden: int | None, fc_inputs: int) -> EagleConfig:
    for key, bad in (("attention_bias", True), ("mlp_bias", True)):
        if layer.get(key, False) == bad:
            raise ValueError(f"this EAGLE-3 checkpoint has {key}=true; the EagleDrafter has no biases")
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"this EAGLE-3 checkpoint's MLP uses {layer['hidden_act']!r}; the EagleDrafter's is SwiGLU")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"this EAGLE-3 checkpoint has {layer['num_hidden_layers']} decoder layers; the EagleDrafter "
                         "has one")
    hidden = int(layer["hidden_size"])
    if target_hidden is not None and int(target_hidden) != hidden:
        raise ValueError(f"this EAGLE-3 checkpoint reads a target of hidden size {target_hidden} at width {hidden}; "
                         "the EagleDrafter works at the target's width")
    heads = int(layer["num_attention_heads"])
    if fc_inputs % hidden:
        raise ValueError(f"fc.weight reads {fc_inputs} features, not k x {hidden}")
    # Without ids, fc's width says how many layers: placeholders until `bind` sets EAGLE-3's default for the target.
    aux = list(range(1, 1 + fc_inputs // hidden)) if ids is None else \
        [i + 1 if fmt == "specforge" else i for i in ids]
    return EagleConfig(
        hidden_size=hidden, vocab_size=int(layer["vocab_size"]), draft_vocab_size=draft_vocab, aux_layers=aux,
        num_attention_heads=heads, num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(layer),
        max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
        norm_before_residual=norm_before_residual, aux_layers_from_target=ids is None,
        target_name_or_path=layer.get("_verifier"), training={"imported_from": fmt},
    )


def load_foreign(folder: str, config: dict, fmt: str) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """(our config, our state dict) of a SpecForge or speculators checkpoint folder whose config.json is `config`."""
    from transformers.utils import cached_file

    if fmt == "specforge":
        layer = dict(config)
        eagle = config.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        norm_before_residual = False
        target_hidden = config.get("target_hidden_size")
    else:
        layer = dict(config.get("transformer_layer_config") or {})
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        norm_before_residual = bool(config.get("norm_before_residual", False))
        target_hidden = config.get("target_hidden_size")
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        layer["_verifier"] = verifier.get("name_or_path")
    draft_vocab = int(config.get("draft_vocab_size") or layer["vocab_size"])
    weights = cached_file(folder, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if weights is None:
        raise ValueError(f"{folder} has no model.safetensors (EAGLE-3 drafters are one file)")
    from safetensors.torch import load_file

    raw = load_file(weights)
    prefix = _LAYER_PREFIX[fmt]
    inverse = {prefix + theirs: mine for mine, theirs in _IN_LAYER.items()}
    state, unknown = {}, []
    for key, tensor in raw.items():
        if key in _IGNORED:
            continue
        if key in inverse:
            state[inverse[key]] = tensor
        elif key in _TOP:
            state[key] = tensor
        else:
            unknown.append(key)
    missing = [k for k in (*_IN_LAYER, "fc.weight", "norm.weight", "lm_head.weight") if k not in state]
    if unknown or missing:
        raise ValueError(f"this {fmt} checkpoint does not hold the EAGLE-3 layout we read: unknown {unknown[:6]}, "
                         f"missing {missing[:6]}")
    ours = _config_from(layer, fmt, draft_vocab, ids, norm_before_residual, target_hidden,
                        state["fc.weight"].shape[1])
    # Checkpoints without vocabulary maps draft the first draft_vocab target ids (d2t = 0), as SGLang assumes.
    state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    if "t2d" not in state:
        t2d = torch.zeros(ours.vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + state["d2t"]] = True
        state["t2d"] = t2d
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    return ours, state


def export_drafter(drafter, save_directory: str | os.PathLike, fmt: str, target=None) -> None:
    """Write `drafter` (an `EagleDrafter`) into `save_directory` in layout `fmt` ("specforge" or "speculators").

    `target` is needed for a drafter with `tie_target_head` (its head is the target's output embedding, which both
    layouts store as `lm_head.weight`); it defaults to the target the drafter is bound to.
    """
    from safetensors.torch import save_file

    if fmt not in _LAYER_PREFIX:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    c = drafter.config
    prefix = _LAYER_PREFIX[fmt]
    own = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    state = {prefix + theirs: own[mine] for mine, theirs in _IN_LAYER.items()}
    state.update({k: own[k] for k in ("fc.weight", "norm.weight", "d2t", "t2d")})
    if c.tie_target_head:
        head = drafter._shared_head.module if drafter._shared_head is not None else None
        if target is not None:
            head = target.get_output_embeddings()
        if head is None:
            raise ValueError("this drafter's head is the target's output embedding (tie_target_head): bind it to the "
                             "target or pass target= to write the head the layout needs")
        state["lm_head.weight"] = head.weight.detach().to(own["fc.weight"].dtype).cpu().contiguous()
    else:
        state["lm_head.weight"] = own["lm_head.weight"]
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"] if fmt == "specforge" else
        ["LlamaForCausalLM"], "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": str(own["fc.weight"].dtype).replace("torch.", ""),
    }
    if fmt == "specforge":
        config = {**layer, "draft_vocab_size": c.draft_vocab_size, "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layers], "use_aux_hidden_state": True}}
        if c.norm_before_residual:
            raise ValueError("SpecForge's EAGLE-3 layer keeps the residual before hidden_norm; this drafter "
                             "(norm_before_residual=True) can only be written in the speculators layout")
    else:
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": bool(c.norm_before_residual), "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "verifier": {"name_or_path": c.target_name_or_path, "architectures": []},
            },
        }
    os.makedirs(save_directory, exist_ok=True)
    save_file(state, os.path.join(save_directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(save_directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
