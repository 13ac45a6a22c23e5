"""Greedy identity: speculative output == plain greedy `generate`, token for token."""

import pytest
import torch
from helpers import RandomTreeDrafter, load_fixture

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import TINY_FAMILIES, tiny_model

FAMILIES = sorted(TINY_FAMILIES)


def prompts(vocab=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fresh = torch.randint(2, vocab, (1, 11), generator=gen)
    motif = torch.randint(2, vocab, (1, 5), generator=gen)
    repeating = torch.cat([motif, motif, motif[:, :3], motif, motif[:, :2]], dim=1)
    return {"fresh": fresh, "repeating": repeating}


def plain(model, ids, **kw):
    return model.generate(ids, do_sample=False, **kw)


def spec(model, ids, **kw):
    return model.generate(ids, do_sample=False, custom_generate=H.speculative_generate, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["fresh", "repeating"])
def test_cache_drafters_match_plain_greedy(family, kind):
    model = tiny_model(family)
    ids = prompts()[kind]
    ref = plain(model, ids, max_new_tokens=40, eos_token_id=None)
    for cfg in (H.AssistantConfig(drafter="suffix"), H.AssistantConfig(drafter="ngram", max_draft_tokens=6)):
        out = spec(model, ids, max_new_tokens=40, eos_token_id=None, assistant_config=cfg)
        assert torch.equal(out, ref), f"{family}/{kind}/{cfg.drafter}"


@pytest.mark.parametrize("family", FAMILIES)
def test_random_trees_depth_1_to_8_match_plain_greedy(family):
    model = tiny_model(family)
    for seed, kind in enumerate(["fresh", "repeating"]):
        ids = prompts(seed=seed)[kind]
        ref = plain(model, ids, max_new_tokens=48, eos_token_id=None)
        drafter = RandomTreeDrafter(96, reference=ref, seed=seed, max_nodes=24)
        out = model.generate(ids, do_sample=False, max_new_tokens=48, eos_token_id=None,
                             custom_generate=H.speculative_generate, drafter=drafter,
                             assistant_config=H.AssistantConfig(max_draft_tokens=24, max_depth=8),
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        # The reference branch makes deep acceptances happen, so the test covers committing long paths.
        assert max(out.spec_stats.accepted_lengths) >= 4


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1", "bamba"])
def test_eos_stops_at_the_same_token(family):
    model = tiny_model(family)
    ids = prompts()["fresh"]
    free = plain(model, ids, max_new_tokens=30, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 6])  # a token plain greedy emits mid-way
    ref = plain(model, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=1)
    assert ref.shape[1] < free.shape[1]
    drafter = RandomTreeDrafter(96, reference=free, seed=3)
    out = spec(model, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=1, drafter=drafter)
    assert torch.equal(out, ref)
    for cfg in ("suffix", "ngram"):
        out = spec(model, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=1,
                   assistant_config=H.AssistantConfig(drafter=cfg))
        assert torch.equal(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("target,draft", [("qwen3_5_text", "falcon_h1"), ("falcon_h1", "qwen3_5_text"),
                                          ("bamba", "llama"), ("llama", "lfm2")])
@pytest.mark.parametrize("top_k", [1, 2])
def test_model_drafter_matches_plain_greedy(target, draft, top_k):
    model = tiny_model(target)
    assistant = tiny_model(draft, seed=7)
    ids = prompts()["repeating"]
    ref = plain(model, ids, max_new_tokens=32, eos_token_id=None)
    cfg = H.AssistantConfig(drafter="model", draft_top_k=top_k, max_draft_tokens=10, max_depth=4)
    out = spec(model, ids, max_new_tokens=32, eos_token_id=None, assistant_config=cfg, draft_model=assistant)
    assert torch.equal(out, ref)


def test_self_drafting_model_accepts_everything():
    # The target drafting for itself must be accepted in full: checks the assistant's own cache rollback.
    model = tiny_model("qwen3_5_text")
    twin = tiny_model("qwen3_5_text")
    ids = prompts()["fresh"]
    ref = plain(model, ids, max_new_tokens=30, eos_token_id=None)
    cfg = H.AssistantConfig(drafter="model", max_depth=5)
    out = spec(model, ids, max_new_tokens=30, eos_token_id=None, assistant_config=cfg, draft_model=twin,
               return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.accepted_lengths[:-1] == [6] * (len(out.spec_stats.accepted_lengths) - 1)


CODE_PROMPTS = [
    'import numpy as np\n\n\ndef moving_average(x, w):\n    """Compute the moving average of x with window w."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n",
]


@pytest.mark.slow
@pytest.mark.fixture
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_fixtures_match_plain_greedy(name):
    model, tok = load_fixture(name)
    other, _ = load_fixture("falcon_h1-small" if name == "qwen3_5-small" else "qwen3_5-small")
    for prompt in CODE_PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        for eos in (None, tok.eos_token_id):
            ref = model.generate(**enc, do_sample=False, max_new_tokens=64, eos_token_id=eos)
            configs = [(H.AssistantConfig(drafter="suffix"), None), (H.AssistantConfig(drafter="ngram"), None),
                       (H.AssistantConfig(drafter="model", max_depth=4), other)]
            for cfg, draft_model in configs:
                out = model.generate(**enc, do_sample=False, max_new_tokens=64, eos_token_id=eos,
                                     custom_generate=H.speculative_generate, assistant_config=cfg,
                                     draft_model=draft_model)
                assert torch.equal(out, ref), f"{name} {cfg.drafter} eos={eos}"


def test_qwen3_5_multimodal_model_text_backbone():
    """Qwen3_5ForConditionalGeneration (model_type qwen3_5) generating text: the text backbone is routed."""
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    from hf_hybrid_spec.testing import tiny_config

    text = tiny_config("qwen3_5_text").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    cfg = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision, image_token_id=95,
                               video_token_id=94)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    ids = prompts()["repeating"]
    ref = plain(model, ids, max_new_tokens=24, eos_token_id=None)
    for drafter in ("suffix", "ngram"):
        out = spec(model, ids, max_new_tokens=24, eos_token_id=None, assistant_config=H.AssistantConfig(drafter=drafter))
        assert torch.equal(out, ref)
