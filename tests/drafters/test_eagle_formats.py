"""EAGLE-3 interop: drafters written in SpecForge's and speculators' layouts load and draft exactly what the same
weights draft in ours; exports reload identically; a tied-head drafter writes its head out."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_hybrid_spec as H
from hf_hybrid_spec.eagle import EagleDrafter
from hf_hybrid_spec.testing import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3_5_text")


def _drafter(target, tie=False, seed=0):
    torch.manual_seed(seed)
    d = EagleDrafter.from_target(target, aux_layers=[1, 2, 3], draft_vocab_size=96 if tie else 64,
                                 tie_target_head=tie)
    if not tie:
        d.set_vocab_maps(torch.randperm(96)[:64])
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return d.eval()


def _same_outputs(a: EagleDrafter, b: EagleDrafter, target) -> None:
    torch.manual_seed(5)
    feats = [torch.randn(1, 7, 64) for _ in a.config.aux_layers]
    ids = torch.randint(3, 96, (1, 7))
    ha, la = a(a.fuse(feats), input_ids=ids)
    hb, lb = b(b.fuse(feats), input_ids=ids)
    torch.testing.assert_close(ha, hb, rtol=0, atol=0)
    # Compare over target ids: a tied drafter's head covers the whole vocabulary, an exported one the same rows.
    ta = torch.full((1, 7, 96), float("-inf")).index_copy(-1, a.draft_to_target, la)
    tb = torch.full((1, 7, 96), float("-inf")).index_copy(-1, b.draft_to_target, lb)
    torch.testing.assert_close(ta, tb, rtol=0, atol=0)


def _spec_run(target, drafter):
    ids = torch.tensor([[5, 9, 17, 33, 4, 8, 12, 40]])
    return target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                           custom_generate=H.speculative_generate, draft_model=drafter, return_dict_in_generate=True,
                           assistant_config=H.AssistantConfig(drafter="eagle", max_draft_tokens=12, max_depth=4,
                                                              draft_top_k=3, compile=False, global_cache=False))


@pytest.mark.parametrize("fmt,layer_key", [("specforge", "midlayer.self_attn.q_proj.weight"),
                                           ("speculators", "layers.0.self_attn.q_proj.weight")])
def test_export_reload_and_draft_identically(tmp_path, target, fmt, layer_key):
    ours = _drafter(target)
    ours.save_pretrained(tmp_path, format=fmt)
    keys = set(load_file(os.path.join(tmp_path, "model.safetensors")))
    assert layer_key in keys and "fc.weight" in keys and "d2t" in keys and not any(k.startswith("q_proj") for k in keys)
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    ids = (config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] if fmt == "specforge"
           else config["eagle_aux_hidden_state_layer_ids"])
    # SGLang's ids name the layer whose output is read, vLLM's the layer whose input is read.
    assert ids == ([0, 1, 2] if fmt == "specforge" else [1, 2, 3])
    back = EagleDrafter.from_pretrained(tmp_path).bind(target)
    assert back.config.aux_layers == [1, 2, 3]
    _same_outputs(ours, back, target)
    a, b = _spec_run(target, ours), _spec_run(target, back)
    assert torch.equal(a.sequences, b.sequences)
    assert a.spec_stats.accepted_lengths == b.spec_stats.accepted_lengths  # the same drafts, step by step
    assert a.spec_stats.drafted_tokens == b.spec_stats.drafted_tokens


def test_hand_written_specforge_checkpoint(tmp_path, target):
    """A checkpoint laid out from SpecForge's documented names (not by our exporter) loads onto the same weights."""
    ours = _drafter(target, seed=2)
    sd = ours.state_dict()
    layer = {"input_layernorm": "input_norm", "hidden_norm": "hidden_norm", "post_attention_layernorm": "post_norm",
             "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
             "self_attn.o_proj": "o_proj", "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
             "mlp.down_proj": "down_proj"}
    tensors = {f"midlayer.{theirs}.weight": sd[f"{mine}.weight"] for theirs, mine in layer.items()}
    tensors.update({"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"],
                    "lm_head.weight": sd["lm_head.weight"], "d2t": sd["d2t"], "t2d": sd["t2d"],
                    "embed_tokens.weight": torch.randn(96, 64)})  # SpecForge keeps a copy; the target's is used
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp_path, "model.safetensors"))
    c = ours.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": 96,
              "draft_vocab_size": 64, "hidden_act": "silu", "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    back = EagleDrafter.from_pretrained(tmp_path).bind(target)
    _same_outputs(ours, back, target)


def test_tied_head_writes_the_target_head(tmp_path, target):
    tied = _drafter(target, tie=True)
    tied.save_pretrained(tmp_path, format="speculators")
    head = load_file(os.path.join(tmp_path, "model.safetensors"))["lm_head.weight"]
    assert torch.equal(head, target.get_output_embeddings().weight.detach())
    back = EagleDrafter.from_pretrained(tmp_path).bind(target)
    assert not back.config.tie_target_head and back.config.draft_vocab_size == 96
    _same_outputs(tied, back, target)
    unbound = EagleDrafter(tied.config)
    with pytest.raises(ValueError, match="tie_target_head"):
        unbound.save_pretrained(tmp_path / "x", format="specforge")


def test_default_layers_and_norm_before_residual(tmp_path):
    target = tiny_model("llama", num_hidden_layers=8)
    d = EagleDrafter.from_target(target, aux_layers=[2, 4, 5], draft_vocab_size=96, tie_target_head=False)
    d.config.norm_before_residual = True
    d.save_pretrained(tmp_path, format="speculators")
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    del config["eagle_aux_hidden_state_layer_ids"]  # EAGLE-3's default: [2, N // 2, N - 3]
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    back = EagleDrafter.from_pretrained(tmp_path)
    assert back.config.norm_before_residual
    back.bind(target)
    assert back.config.aux_layers == [2, 4, 5]
    _same_outputs(d, back, target)
    with pytest.raises(ValueError, match="speculators layout"):
        d.save_pretrained(tmp_path / "sf", format="specforge")


def test_refusals(tmp_path, target):
    ours = _drafter(target)
    ours.save_pretrained(tmp_path, format="specforge")
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        base = json.load(f)
    for change, match in ((dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rotary scaling"),
                          (dict(num_hidden_layers=2), "decoder layers"), (dict(attention_bias=True), "biases"),
                          (dict(architectures=["LlamaForCausalLM"], eagle_config=None, model_type="llama"),
                           "not an EAGLE-3")):
        config = {k: v for k, v in {**base, **change}.items() if v is not None}
        with open(path, "w") as f:
            json.dump(config, f)
        with pytest.raises(ValueError, match=match):
            EagleDrafter.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="format must be"):
        ours.save_pretrained(tmp_path / "y", format="onnx")
