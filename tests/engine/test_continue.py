"""Continuing from a filled cache (multi-turn chat with `past_key_values`, as the transformers docs show it): greedy
identity with stock generate continued from its own cache and with a plain call on the whole sequence, for every
family, both paths, every token-reading drafter; the caller's cache is never changed; what cannot continue says why."""

import copy

import pytest
import torch
from helpers import drafter_kwargs

import hf_hybrid_spec as H
from hf_hybrid_spec.cache import HybridTreeCache, committed_length, export_committed, import_committed
from hf_hybrid_spec.testing import TINY_FAMILIES, tiny_model

PAD = 1


def prompt(n, seed=0, period=5, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (period,), generator=g).repeat(n // period + 1)[:n][None]


def greedy(model, ids, **kw):
    # An explicit mask: a generated token equal to pad_token_id would otherwise count as padding.
    kw.setdefault("attention_mask", torch.ones_like(ids))
    return model.generate(ids, do_sample=False, pad_token_id=PAD, eos_token_id=None, **kw)


def spec(model, ids, cfg=None, **kw):
    cfg = cfg or H.AssistantConfig(global_cache=False, compile=False)
    return greedy(model, ids, custom_generate=H.speculative_generate, assistant_config=cfg, **kw)


def turn_two(ids, out_sequences, seed=1):
    """The second turn's input: the first turn's whole sequence, then a user message."""
    return torch.cat([out_sequences, prompt(7, seed=seed)], dim=1)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_continuation_matches_stock_and_full_prompt(family, compile_):
    model = tiny_model(family)
    cfg = H.AssistantConfig(global_cache=False, compile=compile_)
    ids = prompt(12)
    first = spec(model, ids, cfg, max_new_tokens=9, return_dict_in_generate=True)
    assert first.past_key_values is not None
    ids2 = turn_two(ids, first.sequences)
    # Stock: its own first turn's cache, continued.
    stock_first = greedy(model, ids, max_new_tokens=9, return_dict_in_generate=True)
    assert torch.equal(stock_first.sequences, first.sequences)
    stock_past = copy.deepcopy(stock_first.past_key_values)  # stock generate extends the cache it is given
    stock = greedy(model, ids2, past_key_values=stock_first.past_key_values, max_new_tokens=11)
    full = greedy(model, ids2, max_new_tokens=11)
    assert torch.equal(stock, full)
    ours = spec(model, ids2, cfg, past_key_values=first.past_key_values, max_new_tokens=11,
                return_dict_in_generate=True)
    assert torch.equal(ours.sequences, full)
    assert ours.spec_stats.prefill_tokens == ids2.shape[1] - committed_length(first.past_key_values) or compile_
    # A third turn from the second's cache, and from stock's DynamicCache.
    ids3 = turn_two(ids2, ours.sequences, seed=2)
    full3 = greedy(model, ids3, max_new_tokens=6)
    assert torch.equal(spec(model, ids3, cfg, past_key_values=ours.past_key_values, max_new_tokens=6), full3)
    stock2 = greedy(model, ids2, past_key_values=stock_past, max_new_tokens=11,
                    return_dict_in_generate=True)
    assert torch.equal(spec(model, ids3, cfg, past_key_values=stock2.past_key_values, max_new_tokens=6), full3)


@pytest.mark.parametrize("name", ["suffix", "ngram", "model"])
def test_continuation_with_every_token_drafter(name):
    model = tiny_model("qwen3_5_text")
    ids = prompt(14)
    kw = drafter_kwargs(name, model)
    first = greedy(model, ids, max_new_tokens=8, return_dict_in_generate=True)
    ids2 = turn_two(ids, first.sequences)
    full = greedy(model, ids2, max_new_tokens=12)
    out = greedy(model, ids2, custom_generate=H.speculative_generate, past_key_values=first.past_key_values,
                 max_new_tokens=12, **kw)
    assert torch.equal(out, full)


def test_the_callers_cache_is_not_changed():
    model = tiny_model("qwen3_5_text")
    ids = prompt(12)
    first = greedy(model, ids, max_new_tokens=5, return_dict_in_generate=True)
    before = export_committed(first.past_key_values)
    ids2 = turn_two(ids, first.sequences)
    spec(model, ids2, past_key_values=first.past_key_values, max_new_tokens=6)
    after = export_committed(first.past_key_values)
    assert after.length == before.length
    for key in before.kv:
        assert torch.equal(before.kv[key][0], after.kv[key][0]) and torch.equal(before.kv[key][1], after.kv[key][1])
    for key in before.recurrent:
        assert torch.equal(before.recurrent[key], after.recurrent[key])
    for key in before.conv:
        assert torch.equal(before.conv[key], after.conv[key])


def test_transfer_round_trip_between_cache_kinds():
    model = tiny_model("falcon_h1")  # parallel hybrid layers: recurrent state and KV in one layer
    ids = prompt(10)
    dyn = HybridTreeCache(model.config)
    model(input_ids=ids, past_key_values=dyn, use_cache=True)
    state = export_committed(dyn)
    static = HybridTreeCache(model.config, static_length=32)
    import_committed(static, state)
    again = export_committed(static)
    assert again.length == 10 and state.kv.keys() == again.kv.keys() and state.conv.keys() == again.conv.keys()
    for key in state.kv:
        assert torch.equal(state.kv[key][0], again.kv[key][0])
    for key in state.recurrent:
        assert torch.equal(state.recurrent[key], again.recurrent[key])
    with pytest.raises(ValueError, match="outside"):
        export_committed(dyn, length=11)


def test_what_cannot_continue_says_why():
    model = tiny_model("qwen3_5_text")
    ids = prompt(12)
    first = greedy(model, ids, max_new_tokens=5, return_dict_in_generate=True)
    past = first.past_key_values
    with pytest.raises(ValueError, match="whole sequence"):
        spec(model, first.sequences[:, :10], past_key_values=past, max_new_tokens=4)
    ids2 = turn_two(ids, first.sequences)
    with pytest.raises(NotImplementedError, match="batch size 1"):
        spec(model, ids2.repeat(2, 1), past_key_values=past, max_new_tokens=4)
    mask = torch.ones_like(ids2)
    mask[0, 0] = 0
    with pytest.raises(NotImplementedError, match="padding"):
        spec(model, ids2, past_key_values=past, attention_mask=mask, max_new_tokens=4)
    # The refused calls changed nothing: the cache still continues exactly.
    full = greedy(model, ids2, max_new_tokens=6)
    assert torch.equal(spec(model, ids2, past_key_values=past, max_new_tokens=6), full)
