"""One model object, many calls: concurrent callers see exact outputs, the process-wide state stays bounded, and
nothing the package keeps holds a model alive or outlives what its captures depend on."""

import gc
import os
import threading
import weakref
from pathlib import Path

import pytest
import torch
from helpers import BUILTIN_DRAFTERS, drafter_kwargs, load_fixture

import hf_hybrid_spec as H
from hf_hybrid_spec.engine import static
from hf_hybrid_spec.testing import FIXTURES, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[2]
PROMPT = ("def moving_average(values, window):\n    total = sum(values[:window])\n    out = [total / window]\n"
          "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n")


def greedy(model, ids, n, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, **kwargs)


def fixture_drafter_kwargs(name, target_name, target, compile):
    """The drafter `name` on a fixture: its trained EAGLE drafter for eagle / hvd, the other fixture as the
    assistant model."""
    draft = None
    if name in ("eagle", "hvd"):
        from hf_hybrid_spec.eagle import EagleDrafter

        draft = EagleDrafter.from_pretrained(REPO / "checkpoints" / "drafters" / f"{target_name}-eagle3").eval()
    elif name == "model":
        draft = load_fixture(next(f for f in FIXTURES if f != target_name))[0]
    return drafter_kwargs(name, target, compile=compile, draft_model=draft)


# ---------------------------------------------------------------------- concurrent calls
@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("name", FIXTURES)
def test_every_drafter_beside_plain_generate_and_every_other_drafter(name, compile):
    """Plain generate and every built-in drafter, each in its own thread on the same model object, all started
    together and run twice over: every output is the plain greedy one."""
    model, tok = load_fixture(name)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ref = greedy(model, ids, 16)
    jobs = {"plain": {}}
    jobs.update({d: fixture_drafter_kwargs(d, name, model, compile) for d in BUILTIN_DRAFTERS})
    start = threading.Barrier(len(jobs))
    outcomes: dict[str, list] = {job: [] for job in jobs}

    def run(job, kwargs):
        try:
            start.wait(30)
            for _ in range(2):
                out = greedy(model, ids, 16, **({"custom_generate": H.speculative_generate} if kwargs else {}),
                             **kwargs)
                outcomes[job].append(torch.equal(out, ref))
        except Exception as err:  # reported with its job below
            outcomes[job].append(err)

    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(v == [True, True] for v in outcomes.values()), outcomes


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_self_speculation_changes_nothing_another_thread_sees(family):
    """While a self-speculative call is inside its restricted forward, a forward of the same model in another thread
    computes the full model (deterministically: the other thread runs exactly inside that window)."""
    model = tiny_model(family)
    adapter = H.get_adapter(model)
    ids = torch.randint(2, 90, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        for restricted in (lambda: adapter.suppress_attention(model, "zero_attention"),
                           lambda: adapter.early_exit(model, 1)):
            with restricted():
                inside = model(ids).logits
                seen = []
                worker = threading.Thread(target=lambda: seen.append(model(ids).logits))
                worker.start()
                worker.join()
            assert not torch.allclose(inside, full)  # the restriction does change this thread's forward
            assert torch.equal(seen[0], full)
            assert torch.equal(model(ids).logits, full)  # and nothing of it is left after the block


# ---------------------------------------------------------------------- the suffix cache's memory
def test_the_suffix_cache_stays_within_its_token_budget_over_many_calls():
    """1,000 calls with varied prompts: the process-wide cache holds at most its token budget, its size estimate
    per token stays small, and the process's memory stops growing once the budget is full."""
    from hf_hybrid_spec.tree import VerifyResult

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("reads the resident set size from /proc")

    def rss_bytes():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    H.clear_global_suffix_cache()
    g = torch.Generator().manual_seed(0)
    corpus = torch.randint(2, 500, (20_000,), generator=g).tolist()
    budget = 6_000
    sizes = []
    for call in range(1000):
        at = int(torch.randint(0, len(corpus) - 120, (1,), generator=g))
        prompt = torch.tensor([corpus[at : at + 80]])
        output = corpus[at + 80 : at + 120]
        drafter = H.SuffixDrafter(cache_key=("budget-test",), max_match_length=8, max_depth=4,
                                  max_cached_tokens=budget)
        drafter.begin(prompt)
        full = torch.cat([prompt, torch.tensor([output])], dim=1)
        drafter.accept(full, VerifyResult(path=[0], tokens=torch.tensor(output), score_nodes=[0], token_list=output))
        drafter.end(full)
        cache = drafter.global_cache
        assert cache.num_tokens <= budget
        if call in (300, 999):
            gc.collect()
            sizes.append((cache.nbytes(), rss_bytes()))
    assert sizes[-1][0] <= 200 * budget  # bytes per cached token, estimated
    assert sizes[-1][1] - sizes[0][1] < 16 * 2**20  # resident memory flat past the budget (allocator noise aside)
    H.clear_global_suffix_cache()


# ---------------------------------------------------------------------- static runner lifetimes
def test_a_deleted_model_is_freed_with_its_runners():
    model = tiny_model("qwen3_5_text")
    ids = torch.randint(2, 90, (1, 8), generator=torch.Generator().manual_seed(1))
    out = greedy(model, ids, 6, custom_generate=H.speculative_generate,
                 assistant_config=H.AssistantConfig(compile=True, global_cache=False))
    assert len(static._RUNNERS[model]) == 1
    del out
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_dtype_change_gets_a_new_runner():
    model = tiny_model("falcon_h1")
    ids = torch.randint(2, 90, (1, 8), generator=torch.Generator().manual_seed(2))
    cfg = H.AssistantConfig(compile=True, global_cache=False)
    greedy(model, ids, 6, custom_generate=H.speculative_generate, assistant_config=cfg)
    model.to(torch.bfloat16)
    ref = greedy(model, ids, 6)
    out = greedy(model, ids, 6, custom_generate=H.speculative_generate, assistant_config=cfg)
    assert torch.equal(out, ref)
    assert len(static._RUNNERS[model]) == 2  # keyed apart: the fp32 one is not reused


def test_a_huge_request_does_not_keep_its_static_cache(monkeypatch):
    monkeypatch.setattr(static, "MAX_KEPT_LENGTH", 256)
    model = tiny_model("qwen3_5_text")
    ids = torch.randint(2, 90, (1, 8), generator=torch.Generator().manual_seed(3))
    cfg = H.AssistantConfig(compile=True, global_cache=False)
    greedy(model, ids, 4, custom_generate=H.speculative_generate, assistant_config=cfg)
    kept = list(static._RUNNERS[model].values())
    assert len(kept) == 1 and kept[0].static_length < 256
    # A request past the bound runs with a static cache of its own length, which is not kept afterwards...
    out = model.generate(ids, max_new_tokens=300, min_new_tokens=300, do_sample=False,
                         custom_generate=H.speculative_generate, assistant_config=cfg, return_dict_in_generate=True)
    assert out.sequences.shape[1] == 8 + 300
    assert list(static._RUNNERS[model].values()) == [] or all(r.static_length <= 256
                                                              for r in static._RUNNERS[model].values())
    # ...and the next short request gets a short one again.
    greedy(model, ids, 4, custom_generate=H.speculative_generate, assistant_config=cfg)
    assert all(r.static_length < 256 for r in static._RUNNERS[model].values())


def test_kept_eagle_storage_does_not_keep_its_drafter_alive():
    from hf_hybrid_spec.eagle import EagleDrafter
    from hf_hybrid_spec.eagle import static as eagle_static

    model = tiny_model("qwen3_5_text")
    eagle = EagleDrafter.from_target(model, draft_vocab_size=32)
    ids = torch.randint(2, 90, (1, 8), generator=torch.Generator().manual_seed(4))
    cfg = H.AssistantConfig(drafter="eagle", draft_top_k=2, max_draft_tokens=6, max_depth=3, compile=True)
    greedy(model, ids, 6, custom_generate=H.speculative_generate, assistant_config=cfg, draft_model=eagle)
    assert len(eagle_static._TREES[eagle]) == 1
    ref = weakref.ref(eagle)
    del eagle
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------------- local paths that do not exist
@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test (a Hub lookup would otherwise retry for seconds)."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.parametrize("loader", ["config", "eagle", "arbiter", "predictor", "generate"])
def test_a_missing_local_path_fails_at_once(loader, tmp_path, no_network):
    from hf_hybrid_spec.cospec import CoSpecArbiter
    from hf_hybrid_spec.eagle import EagleDrafter
    from hf_hybrid_spec.hvd import PayoffPredictor

    model = tiny_model("llama")
    load = {
        "config": H.AssistantConfig.from_pretrained,
        "eagle": EagleDrafter.from_pretrained,
        "arbiter": CoSpecArbiter.from_pretrained,
        "predictor": PayoffPredictor.from_pretrained,
        "generate": lambda p: greedy(model, torch.tensor([[3, 4]]), 2, custom_generate=H.speculative_generate,
                                     assistant_config=p),
    }[loader]
    for path in (str(tmp_path / "missing"), "./a/typo/path", "a typo path", os.path.join("..", "nope")):
        with pytest.raises(FileNotFoundError, match="no such file or directory|neither an existing local path"):
            load(path)


def test_a_drafter_name_as_assistant_config_is_that_drafter(no_network):
    model = tiny_model("qwen3_5_text")
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]])
    ref = greedy(model, ids, 12)
    import toy_drafter  # noqa: F401  (registers "toy": a chain repeating the last token)

    for name in ("suffix", "ngram", "toy"):
        out = greedy(model, ids, 12, custom_generate=H.speculative_generate, assistant_config=name,
                     return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
    assert sum(out.spec_stats.drafted_tokens) > 0  # the named drafter ran
    H.enable(model)
    assert torch.equal(greedy(model, ids, 12, assistant_config="ngram"), ref)
    # A bare word that names no drafter is refused at once, naming the drafters (no Hub lookup).
    with pytest.raises(FileNotFoundError, match="nor a drafter's name .*suffix.*ngram"):
        greedy(model, ids, 4, custom_generate=H.speculative_generate, assistant_config="sufix")
