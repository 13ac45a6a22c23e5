"""Static cache and fixed-size verify forwards (CUDA graphs on GPU, the same static code eagerly on CPU)."""

import pytest
import torch

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import tiny_model

from conftest import load_fixture
from drafting import RandomTreeDrafter

CUDA = torch.cuda.is_available()


def ids_of(n=12, seed=0, vocab=96):
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next", "falcon_h1", "bamba", "lfm2", "llama"])
def test_static_path_matches_plain_greedy(family):
    model = tiny_model(family)
    ids = ids_of()
    ref = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    # Buckets smaller than the drafts force both padding and trimming of trees.
    cfg = H.AssistantConfig(compile=True, compile_buckets=(4, 8, 16), max_draft_tokens=24)
    out = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=H.speculative_generate, assistant_config=cfg,
                         drafter=RandomTreeDrafter(96, reference=ref, max_nodes=20))
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.static
    assert max(out.spec_stats.drafted_tokens) <= 15
    for drafter in ("suffix", "ngram"):
        out = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                             custom_generate=H.speculative_generate,
                             assistant_config=H.AssistantConfig(drafter=drafter, compile=True))
        assert torch.equal(out, ref)


def test_cache_implementation_static_turns_the_static_path_on():
    model = tiny_model("qwen3_5_text")
    ids = ids_of()
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, cache_implementation="static",
                         custom_generate=H.speculative_generate, return_dict_in_generate=True)
    assert out.spec_stats.static
    assert torch.equal(out.sequences, ref)


def test_static_path_with_sampling_processors_and_padding_mask():
    model = tiny_model("falcon_h1")
    ids = ids_of(10)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0  # left padding
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, attention_mask=mask, repetition_penalty=1.2)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(drafter="ngram", compile=True), **kw)
    assert torch.equal(out, ref)


def test_static_cache_rejects_overflow_and_config_checks():
    with pytest.raises(ValueError, match="compile_buckets"):
        H.AssistantConfig(compile_buckets=(1,))
    with pytest.raises(ValueError, match="compile_buckets"):
        H.AssistantConfig(compile_buckets=(8, 256))
    cfg = H.AssistantConfig(compile_buckets=[32, 8, 8])
    assert cfg.compile_buckets == (8, 32)
    assert H.AssistantConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.fixture
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_static_path_on_fixtures(name):
    model, tok = load_fixture(name)
    enc = tok('def moving_average(x, window):\n    """Moving average."""\n', return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=48, do_sample=False, eos_token_id=None)
    out = model.generate(**enc, max_new_tokens=48, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate, assistant_config=H.AssistantConfig(compile=True))
    assert torch.equal(out, ref)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_cuda_graphs_match_eager_and_never_recapture(family):
    model = tiny_model(family).cuda()
    ids = ids_of().cuda()
    ref = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None)
    drafter = RandomTreeDrafter(96, reference=ref.cpu(), max_nodes=30)
    out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=H.speculative_generate, drafter=drafter,
                         assistant_config=H.AssistantConfig(compile=True, max_draft_tokens=31))
    assert torch.equal(out.sequences, ref)
    # Random tree sizes hit several buckets; each is captured once, whatever the number of steps.
    assert 1 <= out.spec_stats.graph_captures <= 4 < out.spec_stats.target_forwards


def test_static_runner_is_reused_across_requests():
    model = tiny_model("qwen3_5_text")
    cfg = H.AssistantConfig(drafter="ngram", compile=True)
    for n, seed in ((12, 0), (7, 1), (15, 2)):
        ids = ids_of(n, seed)
        ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
        out = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                             custom_generate=H.speculative_generate, assistant_config=cfg)
        assert torch.equal(out, ref)
    from hf_hybrid_spec.static import _RUNNERS

    assert len(_RUNNERS[model]) == 1  # one runner (and one set of graphs on GPU) serves every request
    runner = next(iter(_RUNNERS[model].values()))

    # A drafter that reads hidden states needs another runner; switching back reuses the first one.
    ids = ids_of(9, 3)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    hidden_drafter = RandomTreeDrafter(96, reference=ref)
    hidden_drafter.target_hidden_layers = (1,)
    for drafter in (hidden_drafter, None):
        extra = {} if drafter is None else {"drafter": drafter}
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                             custom_generate=H.speculative_generate, assistant_config=cfg, **extra)
        assert torch.equal(out, ref)
    assert len(_RUNNERS[model]) == 2 and runner in _RUNNERS[model].values()
