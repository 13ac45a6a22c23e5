"""Every candidate generator transformers ships, asked for by its stock `generate` kwarg after `enable(model)`: it runs
verified through our cache (greedy identity with plain generate) or raises a ValueError saying why, on several
families (the table in docs/drafters.md, "The stock kwargs")."""

import pytest
import torch
from torch import nn

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = ("qwen3_5_text", "falcon_h1", "lfm2", "nemotron_h")
KW = dict(max_new_tokens=14, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module", params=FAMILIES)
def enabled(request):
    model = H.enable(tiny_model(request.param))
    ids = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(3))
    return request.param, model, ids, model.generate(ids, **KW)


@pytest.mark.parametrize("kind", ["prompt_lookup", "early_exit", "assistant_model"])
def test_working_generators_are_exact(enabled, kind):
    family, model, ids, ref = enabled
    kwargs = {"prompt_lookup": dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=2),
              "early_exit": dict(assistant_early_exit=1),
              "assistant_model": dict(assistant_model=tiny_model(family, seed=1))}[kind]
    out = model.generate(ids, return_dict_in_generate=True, **kwargs, **KW)
    assert torch.equal(out.sequences, ref), (family, kind)
    assert hasattr(out, "spec_stats")  # it ran speculative_generate, not plain decoding


def test_num_assistant_tokens_sets_the_chain_depth(enabled):
    family, model, ids, ref = enabled
    out = model.generate(ids, assistant_model=model, num_assistant_tokens=2, return_dict_in_generate=True, **KW)
    assert torch.equal(out.sequences, ref)
    # The model drafts for itself: every chain of 2 is accepted, plus the bonus token.
    assert max(out.spec_stats.accepted_lengths) == 3


def test_use_mtp_needs_mtp_weights(enabled):
    family, model, ids, _ = enabled
    if family == "qwen3_5_text":
        pytest.skip("MTP on Qwen3.5 / Qwen3-Next checkpoints with mtp.* weights: tests/drafters/test_mtp.py")
    with pytest.raises(ValueError, match="multi-token-prediction weights"):
        model.generate(ids, use_mtp=True, **KW)


@pytest.mark.parametrize("kwargs,match", [
    (dict(speculation_type="dflash"), "DFlash"),
    (dict(assistant_tokenizer="tok", tokenizer="tok"), "another tokenizer"),
    (dict(prompt_lookup_num_tokens=3, use_mtp=True), "pass one of them"),
], ids=["dflash", "other_tokenizer", "two_drafters"])
def test_refused_generators_say_why(enabled, kwargs, match):
    _, model, ids, _ = enabled
    with pytest.raises(ValueError, match=match):
        model.generate(ids, **kwargs, **KW)


def test_gemma4_assistant_refused(enabled):
    _, model, ids, _ = enabled
    assistant = type("Gemma4AssistantForCausalLM", (nn.Module,), {})()
    with pytest.raises(ValueError, match="Gemma 4"):
        model.generate(ids, assistant_model=assistant, **KW)


def test_plain_calls_stay_stock(enabled):
    _, model, ids, ref = enabled
    out = model.generate(ids, use_mtp=False, return_dict_in_generate=True, **KW)
    assert torch.equal(out.sequences, ref) and not hasattr(out, "spec_stats")


def test_stock_prompt_lookup_drifts_where_enable_stays_exact():
    """examples/stock_prompt_lookup.py on a tiny Qwen3.5: after enable() the stock kwargs are plain greedy on every
    prompt, on every transformers we support. Stock 5.25 runs prompt lookup on Qwen3.5 without rolling back the
    recurrent state (transformers issue #49036), and its output drifts; earlier versions refuse it."""
    import importlib.util
    import sys
    from pathlib import Path

    import transformers

    # The example by its path: examples/ on sys.path would shadow tests/drafters with examples/drafters.py for every
    # test after this one.
    path = Path(__file__).resolve().parents[2] / "examples" / "stock_prompt_lookup.py"
    spec = importlib.util.spec_from_file_location("stock_prompt_lookup", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    compare = example.compare

    gen = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(3, 96, (6,), generator=gen).tolist() * 8)[:50] for _ in range(6)]
    rows = compare(tiny_model("qwen3_5_text", vocab_size=96), prompts, new_tokens=32, lookup=8)
    assert [r.enabled for r in rows] == ["identical"] * len(rows)
    stock = [r.stock for r in rows]
    if transformers.__version__.startswith("5.25."):
        assert any(s.startswith("differs") for s in stock), stock
    else:  # refused (up to 5.24), or a later release: shown, not pinned
        print("stock prompt lookup:", stock)
