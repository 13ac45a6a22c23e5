"""compile_verify: the target's pure regions Inductor-compiled inside the static verify forward (`fusion`)."""

import pytest
import torch
from helpers import RandomTreeDrafter

import hf_hybrid_spec as H
from hf_hybrid_spec import fusion
from hf_hybrid_spec.testing import TINY_FAMILIES, tiny_model

CUDA = torch.cuda.is_available()
FAMILIES = sorted(TINY_FAMILIES)


def ids_of(n=12, seed=0, vocab=96):
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def test_fused_regions_run_the_pure_modules_compiled_in_this_thread_only(monkeypatch):
    model = tiny_model("qwen3_5_text")
    modules = fusion.fusable_modules(model)
    names = {type(m).__name__ for m in modules}
    # Every decoder layer's norms and MLP, the mixers' gated norm; never a mixer or attention module.
    assert names == {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP"}
    assert len([m for m in modules if type(m).__name__ == "Qwen3_5MLP"]) == model.config.num_hidden_layers
    ran = []

    def fake_class_forward(cls):
        def forward(module, *args, **kwargs):
            ran.append(module)
            return cls.forward(module, *args, **kwargs)

        return forward

    monkeypatch.setattr(fusion, "_class_forward", fake_class_forward)
    norm = next(m for m in modules if type(m).__name__ == "Qwen3_5RMSNorm")
    x = torch.randn(1, 3, model.config.hidden_size)
    seen_elsewhere = []
    with pytest.raises(RuntimeError, match="boom"), fusion.fused_regions(model, modules):
        norm(x)
        assert ran == [norm]
        # Another thread calling the model meanwhile runs it as it is.
        import threading

        worker = threading.Thread(target=lambda: seen_elsewhere.append(norm(x)))
        worker.start()
        worker.join()
        assert ran == [norm] and len(seen_elsewhere) == 1
        raise RuntimeError("boom")
    norm(x)
    assert ran == [norm]  # back to its own forward after the block, even when the block raised
    # A module wrapped by someone else after it was routed keeps their wrapper, in and after the block.
    def wrapper(*args, **kwargs):
        return type(modules[0]).forward(modules[0], *args, **kwargs)

    modules[0].forward = wrapper
    with fusion.fused_regions(model, modules):
        assert modules[0].forward is wrapper
    assert modules[0].forward is wrapper


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_verify_matches_plain_greedy(family):
    """fp32 on the CPU, every family (the fused verify forward is the default wherever the forward is captured on a
    GPU): the fused regions round within ~1e-7 of eager, far below any margin between these tiny models' top two
    logits, so the output is stock greedy's (the static path and every bucket exercised)."""
    model = tiny_model(family)
    ids = ids_of()
    ref = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    cfg = H.AssistantConfig(compile=True, compile_verify=True, compile_buckets=(4, 8, 16), max_draft_tokens=15)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=H.speculative_generate, assistant_config=cfg,
                         drafter=RandomTreeDrafter(96, reference=ref, max_nodes=14))
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.static
    # The runner was built to fuse; outside its forwards the model runs as it is (no override left active).
    from hf_hybrid_spec.engine.static import _RUNNERS

    assert any(r.fuse for r in _RUNNERS[model].values())
    assert torch.equal(model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None), ref)


def test_compile_verify_with_an_eagle_drafter_matches_plain_greedy():
    """A drafter that reads the target's hidden states (the runner keeps their history, written by the commit)."""
    from hf_hybrid_spec.eagle import EagleDrafter

    model = tiny_model("qwen3_5_text")
    ids = ids_of(10, 3)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    eagle = EagleDrafter.from_target(model, draft_vocab_size=32)
    cfg = H.AssistantConfig(drafter="eagle", draft_top_k=3, max_draft_tokens=8, max_depth=4, compile=True,
                            compile_verify=True)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate, draft_model=eagle, assistant_config=cfg)
    assert torch.equal(out, ref)


def test_fusable_functions_run_compiled_only_inside_fused_regions(monkeypatch):
    calls = []
    real_compile = torch.compile

    def counting_compile(fn, **kwargs):
        calls.append(fn.__name__)
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)

    @fusion.fusable
    def gate(x):
        return x.sigmoid() * 2

    x = torch.randn(3, 5)
    assert torch.equal(gate(x), x.sigmoid() * 2) and calls == []  # outside: as written, nothing compiled
    model = torch.nn.Linear(2, 2)
    with fusion.fused_regions(model):
        for n in (3, 7):  # one compile serves every size (dynamic shapes)
            y = torch.randn(n, 5)
            torch.testing.assert_close(gate(y), y.sigmoid() * 2)
    assert calls == ["gate"]


def test_a_region_whose_compile_fails_runs_eagerly_with_a_warning(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)

    @fusion.fusable
    def gate(x):
        return x * 3

    x = torch.randn(4)
    with fusion.fused_regions(torch.nn.Linear(2, 2)):
        assert torch.equal(gate(x), x * 3)
        assert torch.equal(gate(x), x * 3)  # stays eager, warned once
    assert sum("compiling" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records) == 1


def test_compile_verify_needs_compile():
    model = tiny_model("qwen3_5_text")
    with pytest.raises(ValueError, match="compile_verify=True .* needs compile=True"):
        model.generate(ids_of(), max_new_tokens=4, custom_generate=H.speculative_generate,
                       assistant_config=H.AssistantConfig(compile=False, compile_verify=True))
    with pytest.raises(ValueError, match="compile_verify must be True, False or 'auto'"):
        H.AssistantConfig(compile_verify="yes")


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_compile_verify_on_a_batch_matches_plain_greedy(family):
    """The batched static runner's fused forward (rows at different committed lengths, per-row masks), with per-row
    drafters and with EAGLE's batched drafter (which reads the forward's hidden states): stock batched greedy."""
    from engine.test_batch import greedy, padded_batch

    from hf_hybrid_spec.eagle import EagleDrafter
    from hf_hybrid_spec.engine.static import _RUNNERS as BATCH_RUNNERS

    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5], seed=5)
    kw = dict(max_new_tokens=16, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    cfg = H.AssistantConfig(compile=True, compile_verify=True, compile_buckets=(4, 8, 16), max_draft_tokens=12,
                            global_cache=False)
    assert torch.equal(greedy(model, ids, mask, custom_generate=H.speculative_generate, assistant_config=cfg, **kw), ref)
    eagle = EagleDrafter.from_target(model, draft_vocab_size=32)
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, draft_model=eagle,
                 assistant_config=cfg.replace(drafter="eagle", draft_top_k=3, max_depth=4), **kw)
    assert torch.equal(out, ref)
    assert any(r.fuse for r in BATCH_RUNNERS[model].values())


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_compile_verify_under_cuda_graphs_matches_plain_greedy(family):
    """The compiled regions captured in the verify graphs (fp32, so bits of rounding cannot flip a token of these
    tiny models): stock greedy's output, and no graph captured twice."""
    model = tiny_model(family).cuda()
    ids = ids_of().cuda()
    ref = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=H.speculative_generate,
                         drafter=RandomTreeDrafter(96, reference=ref.cpu(), max_nodes=30),
                         assistant_config=H.AssistantConfig(compile=True, compile_verify=True, max_draft_tokens=31))
    assert torch.equal(out.sequences, ref)
    assert 1 <= out.spec_stats.graph_captures <= 4 < out.spec_stats.target_forwards


def test_parallel_linears_are_the_projections_in_order():
    linears = [torch.nn.Linear(16, n) for n in (32, 8, 4)]
    x = torch.randn(2, 5, 16)
    expected = [lin(x) for lin in linears]
    for out in (fusion.parallel_linears(x, *linears), _in_regions(lambda: fusion.parallel_linears(x, *linears))):
        assert len(out) == 3 and all(torch.equal(a, b) for a, b in zip(out, expected))


def _in_regions(fn):
    with fusion.fused_regions(torch.nn.Linear(1, 1)):
        return fn()


@pytest.mark.parametrize("family,mlp,forward", [("qwen3_5_text", "Qwen3_5MLP", "gated_silu_mlp"),
                                                ("falcon_h1", "FalconH1MLP", "multiplied_gated_silu_mlp")])
def test_adapters_run_their_mlps_with_parallel_projections_in_fused_regions(family, mlp, forward):
    from hf_hybrid_spec.models import get_adapter
    from hf_hybrid_spec.models import mlp as mlps

    model = tiny_model(family)
    forwards = get_adapter(model).fused_forwards(model)
    modules = [m for m in model.modules() if type(m).__name__ == mlp]
    assert modules and set(forwards) == set(modules)
    assert all(f is getattr(mlps, forward) for f in forwards.values())
    x = torch.randn(1, 3, model.config.hidden_size)
    calls = []

    def spied(function):
        def run(module, *args, **kwargs):
            calls.append(module)
            return function(module, *args, **kwargs)

        return run

    with torch.no_grad():
        ref = modules[0](x)
        with fusion.fused_regions(model, fusion.fusable_modules(model), {m: spied(f) for m, f in forwards.items()}):
            out = modules[0](x)
    assert calls == [modules[0]]  # the module ran its adapter's forward (and only inside the block)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # Another activation than silu: the MLP keeps its compiled class forward.
    modules[0].act_fn = torch.nn.GELU()
    assert modules[0] not in get_adapter(model).fused_forwards(model)


@pytest.mark.skipif(not CUDA, reason="streams need a GPU")
def test_parallel_linears_on_side_streams_eagerly_and_in_a_captured_graph(monkeypatch):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(256, n, bias=False).cuda() for n in (1024, 512, 16, 16)]
    x = torch.randn(9, 256, device="cuda")
    expected = [lin(x) for lin in linears]
    with fusion.fused_regions(torch.nn.Linear(1, 1)):
        eager = fusion.parallel_linears(x, *linears)
        assert all(torch.equal(a, b) for a, b in zip(eager, expected))
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fusion.parallel_linears(static_x, *linears)
    static_x.copy_(2 * x)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.allclose(a, 2 * b, rtol=1e-5, atol=1e-5) for a, b in zip(captured, expected))
    # Regions entered with parallel=False (a runner built after set_parallel(False)) keep every projection in order,
    # whatever the process-wide setting is when it captures.
    def no_side_streams(*args):
        raise AssertionError("a side stream was used with parallel=False")

    monkeypatch.setattr(fusion, "_streams", no_side_streams)
    with fusion.fused_regions(torch.nn.Linear(1, 1), parallel=False):
        assert all(torch.equal(a, b) for a, b in zip(fusion.parallel_linears(x, *linears), expected))
