"""Static cache and fixed-size verify forwards (CUDA graphs on GPU, the same static code eagerly on CPU)."""

import pytest
import torch
from helpers import RandomTreeDrafter, load_fixture

import hf_hybrid_spec as H
from hf_hybrid_spec.cache import commit_paths
from hf_hybrid_spec.testing import tiny_model

CUDA = torch.cuda.is_available()


def ids_of(n=12, seed=0, vocab=96):
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
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


@pytest.mark.slow
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
    from hf_hybrid_spec.engine.static import _RUNNERS

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


@pytest.mark.slow
def test_concurrent_calls_never_share_a_static_runner():
    """Two threads generating with compile=True on one model: each call gets a runner (static cache) of its own while
    the other runs; outputs equal stock greedy. Sharing one crashed or mixed the two requests' caches."""
    import threading

    model = tiny_model("qwen3_5_text")
    prompts = [ids_of(12 + i, i) for i in range(3)]
    refs = [model.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=None) for p in prompts]
    cfg = H.AssistantConfig(drafter="ngram", compile=True)
    same, errors = [], []

    def work(i):
        try:
            for _ in range(3):
                out = model.generate(prompts[i], max_new_tokens=40, do_sample=False, eos_token_id=None,
                                     custom_generate=H.speculative_generate, assistant_config=cfg)
                same.append(torch.equal(out, refs[i]))
        except Exception as err:  # reported below: a thread's exception would otherwise be lost
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and same == [True] * 9, (errors, same)
    from hf_hybrid_spec.engine.static import _RUNNERS

    assert not any(r.in_use for r in _RUNNERS[model].values())  # every lease was returned


def test_a_call_that_raises_leaves_the_runner_usable():
    """A user's stopping criterion raising mid-generation: the runner's lease ends with the call, and the next request
    reuses it (no fresh capture) with the right output."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from hf_hybrid_spec.engine.static import _RUNNERS

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > 20:
                raise RuntimeError("boom")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    model = tiny_model("qwen3_5_text")
    ids = ids_of(12, 4)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, custom_generate=H.speculative_generate,
              assistant_config=H.AssistantConfig(drafter="ngram", compile=True))
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(ids, stopping_criteria=StoppingCriteriaList([Boom()]), **kw)
    (runner,) = [r for r in _RUNNERS[model].values()]
    assert not runner.in_use
    assert torch.equal(model.generate(ids, **kw), ref)
    assert [r for r in _RUNNERS[model].values()] == [runner]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in for the capture code; a GPU runs the real graphs "
                    "(test_cuda_graphs_match_eager_and_never_recapture), and there fla's kernels, when installed, take "
                    "the CPU model's forward")
def test_capture_paths_run_on_cpu_with_stand_in_graphs(monkeypatch):
    """CI has no GPU, so the capture code (verify and commit graphs per bucket, EAGLE tree expansions per budget)
    would otherwise only run on the device. With stand-ins for the CUDA graph plumbing it runs here: every bucket
    gets its two graphs, every captured budget and accept count its graph, each step replays. (Outputs are not checked: a stand-in
    replay computes nothing.)"""
    import contextlib

    from hf_hybrid_spec.eagle import EagleDrafter
    from hf_hybrid_spec.eagle import static as ES
    from hf_hybrid_spec.engine import static as S

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    recorded = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        recorded.append(g)
        yield

    for name, value in (("Stream", Stream), ("stream", lambda s: contextlib.nullcontext()), ("CUDAGraph", Graph),
                        ("current_stream", lambda device=None: Stream()), ("graph", graph),
                        ("graph_pool_handle", lambda: object())):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(S, "resolve", lambda device: "triton")  # graph-safe commit ops: capture the commit too
    init = S.StaticRunner.__init__
    monkeypatch.setattr(S.StaticRunner, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "use_graphs": True}))
    model = tiny_model("qwen3_5_text")
    ids = ids_of(10, 5)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(drafter="ngram", compile=True))
    assert out.spec_stats.graph_captures == len(H.AssistantConfig().compile_buckets) and len(recorded) == 8
    # A verify and a commit replay per step, and per chain of the prompt (prefill="auto": one chain of 10 tokens).
    assert Graph.replays == 2 * (out.spec_stats.target_forwards + 1)

    eagle = EagleDrafter.from_target(model, draft_vocab_size=32)
    tree_init = ES.StaticEagleTree.__init__
    monkeypatch.setattr(ES.StaticEagleTree, "__init__",
                        lambda self, *a, **k: tree_init(self, *a, **{**k, "use_graphs": True}))
    before = Graph.replays
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=H.speculative_generate, draft_model=eagle,
                         assistant_config=H.AssistantConfig(drafter="eagle", draft_top_k=3, max_draft_tokens=8,
                                                            max_depth=4, compile=True))
    (tree,) = ES._TREES[eagle].values()
    # Draft budgets and accept counts (the accepts of 1 .. depth + 1 steps) each captured once.
    assert 1 <= len(tree._graphs) <= tree.MAX_GRAPHS and len(tree._advance_graphs) >= 1
    assert tree.captures == len(tree._graphs) + len(tree._advance_graphs)
    assert Graph.replays - before >= 2 * out.spec_stats.target_forwards  # plus the draft replays


def _random_draft(n, seed, vocab=96):
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    tokens = torch.randint(2, vocab, (1, n), generator=g)
    return H.DraftTree(tokens=tokens, parents=torch.tensor([parents]))


def _committed(cache, length):
    """Everything a commit may change, cut to the committed length: KV and recurrent/conv states."""
    from hf_hybrid_spec.cache.layers import kv_length as _kv_length

    out = []
    for layer in cache.layers:
        if _kv_length(layer) is not None:
            out += [layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone()]
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            out += [t.clone() for t in states.values() if t is not None]
    return out


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_static_commit_matches_the_dynamic_commit(family):
    """The runner's fixed-shape commit (what its CUDA graph replays) keeps exactly what `HybridTreeCache.commit`
    keeps, for random trees and leaves; leaf = -1 (the warm-up before capture) changes nothing committed."""
    from hf_hybrid_spec.engine.static import StaticRunner
    from hf_hybrid_spec.forward import forward_tokens, forward_tree
    from hf_hybrid_spec.tree import build_verify_tree

    model = tiny_model(family)
    ids = ids_of(11)
    prefix = ids.shape[1] - 1
    runner = StaticRunner(model, 1, 64, buckets=(8, 16))
    static = runner.cache
    for seed in range(6):
        dynamic = H.HybridTreeCache(model.config)
        static.reset()
        for cache in (dynamic, static):
            forward_tokens(model, ids[:, :-1], cache)
        draft = _random_draft(3 + 2 * seed, seed)
        tree = build_verify_tree(ids[:, -1], draft)
        before = _committed(static, prefix)
        runner.forward(tree.tokens, tree.parent, [prefix], [prefix])
        bucket = runner._active
        bucket.leaf.fill_(-1)
        runner._commit_body(bucket)
        for a, b in zip(before, _committed(static, prefix)):
            assert torch.equal(a, b)
        runner.abort()  # that commit also overwrote the tree's own slots: run the tree again
        runner.forward(tree.tokens, tree.parent, [prefix], [prefix])
        leaf = int(torch.randint(tree.num_nodes, (1,), generator=torch.Generator().manual_seed(seed)))
        path = tree.ancestors[0, leaf].nonzero().flatten().tolist()
        runner.commit([path[-1]], prefix + len(path))
        forward_tree(model, tree, dynamic, prefix_length=prefix, root_position=torch.tensor([prefix]))
        commit_paths(dynamic, [path], [prefix])
        length = prefix + len(path)
        assert static.get_seq_length() == dynamic.get_seq_length() == length
        for a, b in zip(_committed(dynamic, length), _committed(static, length)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3])
def test_both_stagings_of_a_host_tree_give_the_same_inputs(rows, monkeypatch):
    """A few rows' trees are staged from host lists, larger ones with tensor ops (`static.SMALL_STAGE`): both lay
    out the same bucket inputs (tokens and parents padded with 0 / -1, then lengths and root positions)."""
    import hf_hybrid_spec.engine.static as static

    model = tiny_model("qwen3_5_text")
    runner = static.StaticRunner(model, rows, 64, buckets=(8, 16))
    _fill_buffers(model, runner, rows)
    generator = torch.Generator().manual_seed(rows)
    tokens = torch.randint(2, 90, (rows, 11), generator=generator)
    parent = torch.tensor([-1] + [int(torch.randint(j, (1,), generator=generator)) for j in range(1, 11)])
    parent = parent.expand(rows, 11).clone()
    lengths, roots = [5 + r for r in range(rows)], [4 + r for r in range(rows)]
    staged = []
    for small in (static.SMALL_STAGE, 0):  # lists where rows x 16 fit, then tensor ops for every size
        monkeypatch.setattr(static, "SMALL_STAGE", small)
        runner.forward(tokens, parent, lengths, roots)
        staged.append(runner._active.inputs.clone())
        runner.abort()
    assert torch.equal(staged[0], staged[1])
    bucket = runner.bucket_for(11)
    assert torch.equal(bucket.tokens[:, :11], tokens) and not bucket.tokens[:, 11:].any()
    assert torch.equal(bucket.parent[:, :11], parent) and (bucket.parent[:, 11:] == -1).all()
    assert bucket.lengths.tolist() == lengths and bucket.roots.tolist() == roots


def _fill_buffers(model, runner, rows: int) -> None:
    """The runner's cache buffers made by a prompt of 4 tokens per row."""
    from hf_hybrid_spec.forward import forward_tokens

    ids = torch.full((rows, 4), 3, dtype=torch.long)
    forward_tokens(model, ids, runner.cache, position_ids=torch.arange(4).expand(rows, 4),
                   attention_mask=torch.ones_like(ids), logits_to_keep=1)


class HiddenRecorder(RandomTreeDrafter):
    """Random trees; keeps the target hidden states it is handed (prompt at begin, accepted path at each accept)."""

    target_hidden_layers = (1, 3)

    def begin(self, input_ids, context=None, hidden=None):
        self.parts = [hidden.states]

    def accept(self, input_ids, result, hidden=None):
        if hidden is not None:
            # Copies: static-path states may be views of the runner's buffers, reused by its next step.
            self.parts.append(tuple(s.clone() for s in hidden.states))

    def states(self):
        return [torch.cat([p[j] for p in self.parts], dim=1) for j in range(len(self.target_hidden_layers))]


# One device: where a GPU is there, fla is usually installed too, and transformers then routes a CPU model's stock
# generate to fla's Triton kernels, which take only CUDA tensors.
@pytest.mark.parametrize("device", ["cuda" if CUDA else "cpu"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_drafters_get_the_committed_tokens_hidden_states(family, device):
    """The hidden states a drafter is handed, eager (gathered from the verify forward) and static (the runner's
    history, written by the commit; on CUDA inside the captured commit graph), are those of a plain forward over the
    committed tokens, token for token."""
    model = tiny_model(family).to(device)
    ids = ids_of(9, 3).to(device)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    for compile_ in (False, True):
        drafter = HiddenRecorder(96, reference=ref.cpu(), seed=1)
        out = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                             custom_generate=H.speculative_generate, drafter=drafter,
                             assistant_config=H.AssistantConfig(compile=compile_, compile_buckets=(8, 16)))
        assert torch.equal(out, ref)
        got = drafter.states()
        # Every committed token but the last (the bonus token, not yet run through the target) has its states.
        n = out.shape[1] - 1
        with torch.no_grad():
            full = model(input_ids=out[:, :n], output_hidden_states=True).hidden_states
        for j, layer in enumerate(drafter.target_hidden_layers):
            assert got[j].shape == (1, n, model.config.hidden_size), (compile_, got[j].shape)
            torch.testing.assert_close(got[j], full[layer], atol=1e-4, rtol=1e-4, msg=f"compile={compile_}")


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1", "nemotron_h"])
def test_the_chunked_prefill_gives_what_the_eager_prefill_gives(family, monkeypatch):
    """`prefill="chunked"` at batch size 1: the prompt as chains through the runner's forward (three chunks here),
    from an empty state: the last logits and the drafter's hidden states of the prompt (from the chunks' forwards)
    are the eager prefill's; the next tree's logits too (the cache holds the same prompt); and a second chunked
    prefill on the kept runner gives them again."""
    import hf_hybrid_spec.engine.backend as B
    from hf_hybrid_spec.engine.batch_static import BatchStaticBackend
    from hf_hybrid_spec.tree import VerifyTree

    model = tiny_model(family)
    layers = (1, model.config.get_text_config().num_hidden_layers)
    ids = ids_of(11, seed=4)
    positions = torch.arange(11).view(1, -1)
    tree = VerifyTree(tokens=torch.tensor([[5, 9, 17]]), parent=torch.tensor([[-1, 0, 0]]))

    def run(chunked):
        backend = BatchStaticBackend(model, 1, 40, (4,), None, hidden_layers=layers)
        try:
            out = backend.prefill(ids, torch.ones_like(ids), positions, chunked=chunked)
            assert isinstance(out, B.PrefillOutputs) == chunked
            states = {i: out.hidden_states[i][:, -11:].clone() for i in layers}
            logits = out.logits[:, -1].clone()
            assert backend.valid == [11]
            after = backend.forward(tree).logits.clone()
            backend.abort()
            return logits, states, after
        finally:
            backend.release()

    eager = run(False)
    for _ in range(2):
        chunked = run(True)
        torch.testing.assert_close(chunked[0], eager[0], rtol=1e-4, atol=1e-4)
        for i in layers:
            torch.testing.assert_close(chunked[1][i], eager[1][i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunked[2], eager[2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["random-trees", "suffix", "eagle"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_one_request_with_the_chunked_prefill_matches_stock(family, name, monkeypatch):
    """Whole calls at batch size 1 with `prefill="chunked"` (chains of 4 tokens: several per prompt) give stock greedy
    decoding, on a fresh runner and on the kept one; a prompt with padding prefills eagerly and does too."""
    import hf_hybrid_spec.engine.loop as L
    from helpers import drafter_kwargs
    from hf_hybrid_spec.engine.batch_static import BatchStaticBackend

    monkeypatch.setattr(L, "PREFILL_CHUNK", 4)
    chunked = []
    spied = BatchStaticBackend.prefill_chunked
    monkeypatch.setattr(BatchStaticBackend, "prefill_chunked",
                        lambda self, ids, mask: chunked.append(ids.shape) or spied(self, ids, mask))
    model = tiny_model(family)
    ids = ids_of(13, seed=5)
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    for _ in range(2):
        if name == "random-trees":
            extra = dict(drafter=RandomTreeDrafter(96, reference=ref, max_nodes=6),
                         assistant_config=H.AssistantConfig(compile=True, prefill="chunked", compile_buckets=(8,)))
        else:
            extra = drafter_kwargs(name, model, compile=True, prefill="chunked", compile_buckets=(8,))
        out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                             custom_generate=H.speculative_generate, return_dict_in_generate=True, **extra)
        assert torch.equal(out.sequences, ref)
        assert max(out.spec_stats.drafted_tokens) <= 7  # trees stay within the config's buckets
    assert len(chunked) == 2
    mask = torch.ones_like(ids)
    mask[:, :2] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(drafter="ngram", compile=True, prefill="chunked"))
    assert torch.equal(out, ref) and len(chunked) == 2


@pytest.mark.parametrize("name", ["falcon_h1-small", "qwen3_5-small"])
def test_the_chunked_prefill_on_a_fixture_with_its_trained_eagle(name):
    """A trained model and its committed EAGLE-3 drafter, a 150-token prompt (three chains of 64 and less): the
    chunked and the eager prefill give stock greedy output and the same accepted length at every step (the drafter
    reads the prompt's hidden states from the chunks' forwards, and a wrong one would draft otherwise)."""
    from pathlib import Path

    from hf_hybrid_spec.eagle import EagleDrafter

    model, tokenizer = load_fixture(name)
    eagle = EagleDrafter.from_pretrained(Path(__file__).parents[2] / "checkpoints" / "drafters" / f"{name}-eagle3")
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 6
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :150]
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    accepted = {}
    for prefill in ("eager", "chunked"):
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, draft_model=eagle,
                             custom_generate=H.speculative_generate, return_dict_in_generate=True,
                             assistant_config=H.AssistantConfig(drafter="eagle", compile=True, prefill=prefill))
        assert torch.equal(out.sequences, ref)
        accepted[prefill] = out.spec_stats.accepted_lengths
    assert accepted["chunked"] == accepted["eager"] and max(accepted["eager"]) > 1
