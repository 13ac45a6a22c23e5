"""Self-speculative drafters: `self_ssm` and `layerskip`.

Greedy identity with plain `generate` on tiny configs of a parallel (falcon_h1) and three sequential
(qwen3_5_text, bamba, nemotron_h) families and on both fixtures; the drafts are the restricted model's own
greedy continuation computed from the committed cache, which they leave untouched; the restrictions equal
their weight-level definitions; clear errors; the analysis CLI and the early-exit recipe run.
"""

import copy
import json
import os
import sys

import pytest
import torch
from helpers import load_fixture

import hf_hybrid_spec as H
from hf_hybrid_spec.cache import HybridTreeCache
from hf_hybrid_spec.drafters import DraftBudget, DraftContext, LayerSkipDrafter, SelfSSMDrafter
from hf_hybrid_spec.forward import forward_tokens
from hf_hybrid_spec.models import get_adapter
from hf_hybrid_spec.testing import fixture_path, tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# family -> the self_ssm variants that apply to its layout
FAMILIES = {
    "falcon_h1": ("zero_attention", "rescale_ssm"),
    "qwen3_5_text": ("zero_attention", "skip_layer"),
    "bamba": ("zero_attention", "skip_layer"),
    "nemotron_h": ("zero_attention", "skip_layer"),
}


def _prompt(seed=0, length=11):
    return torch.randint(2, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _spec(model, ids, cfg, **kw):
    return model.generate(ids, do_sample=False, custom_generate=H.speculative_generate, assistant_config=cfg,
                          return_dict_in_generate=True, **kw)


def _configs(family):
    yield H.AssistantConfig(drafter="layerskip", exit_layer=1, max_depth=3)
    for variant in FAMILIES[family]:
        yield H.AssistantConfig(drafter="self_ssm", ssm_variant=variant, max_depth=2)
    if family in ("falcon_h1", "qwen3_5_text"):
        yield H.AssistantConfig(drafter="layerskip", exit_layer=2, max_depth=3, draft_top_k=2, max_draft_tokens=6)
        yield H.AssistantConfig(drafter="self_ssm", max_depth=2, draft_top_k=2, max_draft_tokens=5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_identity_tiny(family):
    model = tiny_model(family)
    ids = _prompt()
    ref = model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None)
    for cfg in _configs(family):
        out = _spec(model, ids, cfg, max_new_tokens=12, eos_token_id=None)
        assert torch.equal(out.sequences, ref), cfg
        # Each draft had the requested size: a chain of max_depth, or k children of the root and then k*k
        # children of the k best frontier nodes per level, within max_draft_tokens.
        k = cfg.draft_top_k
        assert max(out.spec_stats.drafted_tokens) == min(cfg.max_draft_tokens, k + (cfg.max_depth - 1) * k * k)


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_5_text"])
def test_greedy_identity_naive_kernels_and_eos(family):
    # The closed-form "torch" kernels are the CPU default that every other test runs; "naive" is the reference.
    model = tiny_model(family)
    ids = _prompt(seed=1)
    free = model.generate(ids, do_sample=False, max_new_tokens=14, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 5])
    ref = model.generate(ids, do_sample=False, max_new_tokens=14, eos_token_id=eos, pad_token_id=1)
    for cfg in (H.AssistantConfig(drafter="layerskip", exit_layer=2, max_depth=4, kernel_backend="naive"),
                H.AssistantConfig(drafter="self_ssm", max_depth=3, kernel_backend="naive")):
        out = _spec(model, ids, cfg, max_new_tokens=14, eos_token_id=eos, pad_token_id=1)
        assert torch.equal(out.sequences, ref), (family, cfg.drafter)


def _committed(cache):
    kv = [None if getattr(layer, "keys", None) is None else layer.keys.clone() for layer in cache.layers]
    rec = [{s: t.clone() for s, t in getattr(layer, "recurrent_states", {}).items() if t is not None}
           for layer in cache.layers]
    conv = [{s: t.clone() for s, t in getattr(layer, "conv_states", {}).items() if t is not None}
            for layer in cache.layers]
    return kv, rec, conv


def _assert_same_state(a, b):
    for x, y in zip(a[0], b[0]):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    for part in (1, 2):
        for x, y in zip(a[part], b[part]):
            assert x.keys() == y.keys() and all(torch.equal(x[s], y[s]) for s in x)


@pytest.mark.parametrize("family,make", [
    ("qwen3_5_text", lambda m: LayerSkipDrafter(m, exit_layer=2)),
    ("falcon_h1", lambda m: SelfSSMDrafter(m, "zero_attention")),
    ("bamba", lambda m: SelfSSMDrafter(m, "skip_layer")),
])
def test_chain_is_the_restricted_models_greedy_and_cache_is_untouched(family, make):
    model = tiny_model(family)
    drafter = make(model)
    ids = _prompt(seed=2, length=9)
    cache = HybridTreeCache(model.config)
    with torch.no_grad():
        forward_tokens(model, ids[:, :-1], cache, position_ids=torch.arange(ids.shape[1] - 1)[None])
    before = _committed(cache)
    drafter.begin(ids, DraftContext(model, cache, get_adapter(model), model.generation_config))
    draft = drafter.propose(ids, DraftBudget(max_nodes=4, max_depth=4))
    _assert_same_state(before, _committed(cache))
    assert not cache.in_tree_mode
    # The same restricted model decoding greedily from scratch, without a cache.
    seq = ids
    with torch.no_grad(), drafter.restricted():
        for _ in range(4):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert draft.tokens.tolist() == [seq[0, ids.shape[1]:].tolist()]
    assert draft.parents.tolist() == [[-1, 0, 1, 2]]


def test_restrictions_equal_their_weight_level_definitions():
    ids = _prompt(seed=3)
    # Early exit == first E layers, final norm, head.
    model = tiny_model("qwen3_5_text")
    with torch.no_grad():
        full = model(input_ids=ids, output_hidden_states=True)
        manual = model.lm_head(model.model.norm(full.hidden_states[2]))
        with get_adapter(model).early_exit(model, 2):
            early = model(input_ids=ids).logits
    torch.testing.assert_close(early, manual)
    # zero_attention on a parallel hybrid == attention output projections zeroed.
    model = tiny_model("falcon_h1")
    zeroed = copy.deepcopy(model)
    for layer in zeroed.model.layers:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
    with torch.no_grad():
        with get_adapter(model).suppress_attention(model, "zero_attention"):
            ours = model(input_ids=ids).logits
        torch.testing.assert_close(ours, zeroed(input_ids=ids).logits)
    # skip_layer on a sequential hybrid == attention layers' o_proj and MLP down projection zeroed.
    model = tiny_model("qwen3_5_text")
    zeroed = copy.deepcopy(model)
    for layer in zeroed.model.layers:
        if hasattr(layer, "self_attn"):
            torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
            torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    with torch.no_grad():
        with get_adapter(model).suppress_attention(model, "skip_layer"):
            ours = model(input_ids=ids).logits
        torch.testing.assert_close(ours, zeroed(input_ids=ids).logits)
        # Leaving the block restores the model exactly, also after an exception inside it.
        plain = model(input_ids=ids).logits
        with pytest.raises(RuntimeError, match="inside"):
            with get_adapter(model).suppress_attention(model, "skip_layer"), \
                    get_adapter(model).early_exit(model, 1):
                raise RuntimeError("inside")
        assert len(model.model.layers) == 4
        assert all("forward" not in m.__dict__ for m in model.modules() if type(m).__name__.endswith("Attention"))
        torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)


def test_clear_errors():
    llama = tiny_model("llama")
    ids = _prompt()
    with pytest.raises(ValueError, match="attention-only"):
        llama.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate,
                       assistant_config=H.AssistantConfig(drafter="self_ssm"))
    # layerskip applies to attention-only models too.
    ref = llama.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None)
    out = _spec(llama, ids, H.AssistantConfig(drafter="layerskip", exit_layer=1, max_depth=2), max_new_tokens=8,
                eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    qwen, falcon = tiny_model("qwen3_5_text"), tiny_model("falcon_h1")
    with pytest.raises(ValueError, match=r"exit_layer must be an integer in \[1, 3\]"):
        qwen.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate,
                      assistant_config=H.AssistantConfig(drafter="layerskip", exit_layer=4))
    with pytest.raises(ValueError, match="needs exit_layer"):
        H.AssistantConfig(drafter="layerskip")
    with pytest.raises(ValueError, match="exit_layer must be a positive integer"):
        H.AssistantConfig(drafter="layerskip", exit_layer=0)
    with pytest.raises(ValueError, match="ssm_variant must be one of"):
        H.AssistantConfig(drafter="self_ssm", ssm_variant="drop")
    with pytest.raises(ValueError, match="ssm_scale must be a positive"):
        H.AssistantConfig(drafter="self_ssm", ssm_scale=0.0)
    with pytest.raises(ValueError, match="'rescale_ssm' needs a parallel hybrid"):
        SelfSSMDrafter(qwen, "rescale_ssm")
    with pytest.raises(ValueError, match="'skip_layer' needs a sequential hybrid"):
        SelfSSMDrafter(falcon, "skip_layer")
    with pytest.raises(ValueError, match="different model"):
        drafter = LayerSkipDrafter(qwen, exit_layer=1)
        drafter.begin(ids, DraftContext(falcon, HybridTreeCache(falcon.config), get_adapter(falcon),
                                        falcon.generation_config))
    cfg = H.AssistantConfig(drafter="layerskip", exit_layer=3, ssm_variant="skip_layer")
    assert H.AssistantConfig.from_dict(json.loads(cfg.to_json_string())) == cfg


@pytest.mark.slow
@pytest.mark.fixture
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_fixtures_greedy_identity(name):
    model, tok = load_fixture(name)
    enc = tok('import numpy as np\n\n\ndef moving_average(x, w):\n    """Moving average of x."""\n',
              return_tensors="pt")
    ref = model.generate(**enc, do_sample=False, max_new_tokens=12, eos_token_id=None)
    configs = [H.AssistantConfig(drafter="layerskip", exit_layer=4, max_depth=3),
               H.AssistantConfig(drafter="self_ssm", ssm_variant="rescale_ssm" if name.startswith("falcon")
                                 else "skip_layer", max_depth=2, draft_top_k=2, max_draft_tokens=4)]
    for cfg in configs:
        out = _spec(model, enc.input_ids, cfg, attention_mask=enc.attention_mask, max_new_tokens=12,
                    eos_token_id=None)
        assert torch.equal(out.sequences, ref), (name, cfg.drafter, cfg.ssm_variant)


def test_analysis_cli_on_tiny_model(tmp_path, capsys):
    from hf_hybrid_spec import analysis

    with pytest.raises(SystemExit):
        analysis.main(["--help"])
    summary = analysis.main(["--model", "tiny:lfm2", "--num-prompts", "1", "--prompt-tokens", "12",
                             "--new-tokens", "8", "--ks", "1", "2", "--ppl-chunks", "2", "--ppl-tokens", "24",
                             "--exit-layers", "1", "2", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(summary))
    assert summary["gate_mismatches"] == 0
    labels = [r["label"] for r in summary["results"]]
    assert labels == ["self_ssm:zero_attention", "self_ssm:skip_layer", "layerskip:E=1", "layerskip:E=2"]
    for r in summary["results"]:
        assert all(0.0 <= a <= 1.0 for a in r["alpha"].values()) and r["ppl_ratio"] > 0
    assert summary["recommendation"]["label"] in labels
    assert (tmp_path / "analysis.png").stat().st_size > 0
    with pytest.raises(ValueError, match="held out"):
        analysis.text_set("sympy")


@pytest.mark.skipif(fixture_path("qwen3_5-small") is None, reason="needs the fixture tokenizer")
def test_early_exit_recipe_runs_and_keeps_the_tolerance(tmp_path, capsys):
    sys.path.insert(0, os.path.join(REPO, "recipes"))
    try:
        import train_early_exit
    finally:
        sys.path.pop(0)
    summary = train_early_exit.main([
        "--model", "tiny:lfm2", "--tokenizer", str(fixture_path("qwen3_5-small")), "--exit-layer", "2",
        "--max-steps", "2", "--check-every", "1", "--seq-len", "32", "--max-blocks", "4", "--max-train-files", "2",
        "--max-eval-files", "4", "--batch-size", "2", "--eval-windows", "2", "--eval-prompts", "0",
        "--lr", "0.05", "--min-agreement", "0.9", "--out", str(tmp_path),
    ])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == summary["steps"]
    assert summary["after"]["full_agreement"] >= 0.9
    assert summary["before"]["full_agreement"] == 1.0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batch_greedy_identity_tiny(family, compile_):
    """A left-padded batch of three rows of different lengths with every self-speculative config of the family: one
    restricted forward of all rows per depth (`BatchSelfSpecDrafter`; with compile=True the batch still runs on the
    eager backend, whose forwards the restriction changes), every row stock's."""
    from engine.test_batch import greedy, padded_batch

    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5], seed=4)
    ref = greedy(model, ids, mask, max_new_tokens=12, eos_token_id=None)
    for cfg in _configs(family):
        out = greedy(model, ids, mask, max_new_tokens=12, eos_token_id=None, custom_generate=H.speculative_generate,
                     assistant_config=cfg.replace(compile=compile_), return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), cfg
        assert max(out.spec_stats.drafted_tokens) > 0


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_5_text"])
def test_batched_drafts_are_each_rows_drafts_alone(family, monkeypatch):
    """Each row's drafts in the batch (left-padded, rows at different lengths in one forward per depth) are the ones
    the one-request drafter makes for that row alone: tokens and tree exactly, path probabilities to fp32 rounding."""
    from engine.test_batch import greedy, padded_batch

    from hf_hybrid_spec.drafters.self_spec import BatchSelfSpecDrafter, SelfSpecDrafter

    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5], seed=4)
    cfg = H.AssistantConfig(drafter="layerskip", exit_layer=2, max_depth=3, draft_top_k=2, max_draft_tokens=6)
    kw = dict(max_new_tokens=12, eos_token_id=None, custom_generate=H.speculative_generate, assistant_config=cfg)
    batch_log: dict = {}
    original = BatchSelfSpecDrafter.propose

    def batch_propose(self, rows, row_ids, budgets):
        out = original(self, rows, row_ids, budgets)
        for i, b in enumerate(rows):
            n = int(out.count[i])
            batch_log.setdefault(b, []).append((out.tokens[i, :n].tolist(), out.parents[i, :n].tolist(),
                                                out.values[i, :n]))
        return out

    monkeypatch.setattr(BatchSelfSpecDrafter, "propose", batch_propose)
    out = greedy(model, ids, mask, **kw)
    monkeypatch.undo()
    pads = (mask == 0).sum(-1).tolist()
    single = SelfSpecDrafter.propose
    for b in range(ids.shape[0]):
        alone_log = []

        def row_propose(self, input_ids, budget):
            draft = single(self, input_ids, budget)
            alone_log.append((draft.tokens[0].tolist(), draft.parents[0].tolist(), draft.scores[0]))
            return draft

        monkeypatch.setattr(SelfSpecDrafter, "propose", row_propose)
        alone = greedy(model, ids[b : b + 1, pads[b] :], None, **kw)
        monkeypatch.undo()
        assert torch.equal(alone[0], out[b, pads[b] :])
        steps = min(len(alone_log), len(batch_log[b]))
        assert steps >= 3
        for i in range(steps - 1):  # the last: the batch may stop a row's tree short where its budget ends
            assert batch_log[b][i][:2] == alone_log[i][:2], f"row {b} step {i}"
            torch.testing.assert_close(batch_log[b][i][2], alone_log[i][2], rtol=1e-4, atol=1e-6)
