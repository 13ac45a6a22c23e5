"""Continuous batching with speculation (`hf_hybrid_spec.serving`): every request's greedy output equals plain
`generate` on its own prompt, with requests joining and leaving between steps, finishing at different times, under
concurrent arrivals, with prefix reuse on and off; sampling follows the target's law; failures and cancellations stay
with their request; memory stays bounded over 1,000 requests."""

import random
import threading
import time

import pytest
import torch
from helpers import chi2_pvalue, drafter_kwargs, load_fixture, target_joint
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria
from transformers.generation.continuous_batching.requests import RequestStatus
from verification.test_sampling import V

import hf_hybrid_spec as H
from hf_hybrid_spec.serving import (
    PrefixStore,
    ServingConfig,
    ServingEngine,
    ServingRequest,
    generate_batch,
    init_continuous_batching,
)
from hf_hybrid_spec.serving.penalties import OccurrencePenaltyLogitsProcessor
from hf_hybrid_spec.testing import TINY_FAMILIES, tiny_model

PAD = 1


def prompts(count, seed=0, vocab=96):
    """Prompts of different lengths, each repeating a short random pattern (cache drafters match them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (4 + i % 3,), generator=g).repeat(8)[: 6 + 5 * (i % 4)].tolist()
            for i in range(count)]


def plain(model, ids, max_new_tokens, eos_token_id=None, **kw):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=PAD,
                         **kw)
    return out[0, len(ids):].tolist()


def drain(engine) -> dict:
    """Step `engine` until it has no work; every output it reported, by request id (the last one of each)."""
    outputs = {}
    while engine.has_work:
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs


def greedy_config(**kw):
    return GenerationConfig(**{"do_sample": False, "eos_token_id": None, "pad_token_id": PAD, **kw})


@pytest.mark.parametrize("prefill", ["eager", "chunked"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_generate_batch_matches_plain_generate_for_every_family(family, prefill):
    model = tiny_model(family)
    inputs = prompts(7)
    # Fewer slots than requests: requests join as others leave, in a slot order that is not the batch order. (The
    # engine runs one code path: the batched static runner, with CUDA graphs on a GPU, eagerly here.) Chunked
    # prefills of 5 tokens: prompts of 6-21 tokens go in over 2-5 steps, beside the other requests' trees.
    out = generate_batch(model, inputs, greedy_config(), H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=3, max_total_tokens=64, prefill=prefill, prefill_chunk=5),
                         max_new_tokens=11)
    assert list(out) == [f"req_{i}" for i in range(7)]
    for i, ids in enumerate(inputs):
        result = out[f"req_{i}"]
        assert result.status == RequestStatus.FINISHED and result.error is None
        assert result.generated_tokens == plain(model, ids, 11), i
        assert result.prompt_ids == ids


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_the_fused_verify_forward_on_request(family):
    """compile_verify=True gives the engine's runner the fused verify forward anywhere ("auto" only where it captures
    graphs on a GPU, `test_runner_modes`): plain generate's tokens still, with chunked prefills beside the other
    requests' trees."""
    model = tiny_model(family)
    inputs = prompts(5, seed=2)
    config = ServingConfig(max_slots=3, max_total_tokens=64, prefill_chunk=5)
    engines = []
    for verify in ("auto", True):
        engine = ServingEngine(model, H.AssistantConfig(global_cache=False, compile_verify=verify), config,
                               greedy_config())
        for i, ids in enumerate(inputs):
            engine.add(ServingRequest(request_id=f"r{i}", input_ids=ids, max_new_tokens=9))
        outputs = drain(engine)
        for i, ids in enumerate(inputs):
            assert outputs[f"r{i}"].generated_tokens == plain(model, ids, 9), (verify, i)
        engines.append(engine)
    assert [e.backend.runner.fuse for e in engines] == [False, True]


def test_runner_modes():
    """The engine's runner: CUDA graphs under compile "auto" / True on a GPU only; the fused verify forward under
    compile_verify "auto" wherever graphs are captured, under True anywhere, never under False."""
    from hf_hybrid_spec.serving.engine import RunnerModes, runner_modes

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    config = H.AssistantConfig()
    assert runner_modes(config, cuda) == RunnerModes(graphs=True, fuse=True)
    assert runner_modes(config, cpu) == RunnerModes(graphs=False, fuse=False)
    assert runner_modes(config.replace(compile=True), cuda) == RunnerModes(graphs=True, fuse=True)
    assert runner_modes(config.replace(compile=True), cpu) == RunnerModes(graphs=False, fuse=False)
    assert runner_modes(config.replace(compile=False), cuda) == RunnerModes(graphs=False, fuse=False)
    assert runner_modes(config.replace(compile_verify=False), cuda) == RunnerModes(graphs=True, fuse=False)
    assert runner_modes(config.replace(compile_verify=True), cpu) == RunnerModes(graphs=False, fuse=True)


@pytest.mark.parametrize("name", ["suffix", "ngram", "model"])
def test_every_token_drafter_and_early_eos(name):
    model = tiny_model("qwen3_5_text")
    inputs = prompts(6, seed=1)
    refs = [plain(model, ids, 14) for ids in inputs]
    eos = refs[2][3]  # request 2 (and any other that makes it) stops early
    kw = drafter_kwargs(name, model)
    out = generate_batch(model, inputs, greedy_config(eos_token_id=eos), kw["assistant_config"],
                         ServingConfig(max_slots=4, max_total_tokens=64), max_new_tokens=14,
                         draft_model=kw.get("draft_model"))
    for i, ids in enumerate(inputs):
        assert out[f"req_{i}"].generated_tokens == plain(model, ids, 14, eos_token_id=eos), i
    assert len(out["req_2"].generated_tokens) == 4


def test_requests_with_their_own_lengths_and_settings():
    model = tiny_model("falcon_h1")
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=2, max_total_tokens=64),
                           greedy_config())
    inputs = prompts(5, seed=2)
    lengths = [3, 17, 1, 9, 12]
    for i, (ids, n) in enumerate(zip(inputs, lengths)):
        assert engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=n)).status == RequestStatus.PENDING
    done = drain(engine)
    for i, (ids, n) in enumerate(zip(inputs, lengths)):
        assert done[f"r{i}"].generated_tokens == plain(model, ids, n)
        assert done[f"r{i}"].spec_stats.target_forwards <= n
    assert engine.running == 0 and engine.backend.running_slots == []


@pytest.mark.parametrize("prefill", ["eager", "chunked"])
@pytest.mark.parametrize("reuse", [True, False], ids=["prefix-reuse", "no-reuse"])
def test_agent_turns_reuse_the_last_calls_state(reuse, prefill, adopted):
    """A session's next prompt is its last prompt, the reply and a tool result: with the prefix store its prefill runs
    only the new tokens, and the output is still plain generate's on the whole prompt."""
    model = tiny_model("qwen3_5_text")
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                           ServingConfig(max_slots=2, max_total_tokens=160, prefix_cache_bytes=(1 << 26) if reuse else 0,
                                         prefill=prefill, prefill_chunk=4), greedy_config())
    sessions = prompts(2, seed=3)
    g = random.Random(0)
    last_lengths: list[int] = []  # each session's last prompt and reply
    for turn in range(3):
        for s, ids in enumerate(sessions):
            engine.add(ServingRequest(f"s{s}t{turn}", ids, max_new_tokens=8))
        outputs = drain(engine)
        for s, ids in enumerate(sessions):
            result = outputs[f"s{s}t{turn}"]
            assert result.generated_tokens == plain(model, ids, 8), (turn, s)
            if reuse and turn > 0:
                # Everything but the new tool tokens came from the store (the reply's last token is not committed).
                assert result.reused_prefix_tokens == last_lengths[s] - 1
                assert result.spec_stats.prefill_tokens == len(ids) - result.reused_prefix_tokens
            else:
                assert result.reused_prefix_tokens == 0
        last_lengths = [len(ids) + 8 for ids in sessions]
        sessions = [ids + outputs[f"s{s}t{turn}"].generated_tokens + [g.randrange(3, 96) for _ in range(5)]
                    for s, ids in enumerate(sessions)]
    if reuse:
        assert engine.prefixes.hits == 4
        # Each follow-up's drafter started from the trie its session's last call handed off (not a rebuild).
        assert adopted == [True] * 4


@pytest.fixture
def adopted(monkeypatch):
    """The tries suffix drafters adopt, as a list of `isinstance(state, SUFFIX_TRIES)` per call."""
    from hf_hybrid_spec.drafters.suffix import SUFFIX_TRIES, SuffixDrafter

    calls, adopt = [], SuffixDrafter.adopt

    def spy(self, state):
        calls.append(isinstance(state, SUFFIX_TRIES))
        adopt(self, state)

    monkeypatch.setattr(SuffixDrafter, "adopt", spy)
    return calls


@pytest.mark.fixture
@pytest.mark.parametrize("prefill", ["eager", "chunked"])
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_fixture_sessions_match_plain_generate(name, prefill):
    """Two agent turns of three code prompts on a trained fixture, two slots, prefix reuse on: every reply is plain
    greedy's on its whole prompt, and the second turn reuses the first's state."""
    model, tokenizer = load_fixture(name)
    texts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef list_files(path):\n"]
    sessions = [tokenizer(t).input_ids for t in texts]
    engine = ServingEngine(model, H.AssistantConfig(), ServingConfig(max_slots=2, max_total_tokens=256,
                                                                     prefill=prefill, prefill_chunk=16),
                           greedy_config(eos_token_id=tokenizer.eos_token_id))
    accepted = []
    for turn in range(2):
        for s, ids in enumerate(sessions):
            engine.add(ServingRequest(f"{s}/{turn}", ids, max_new_tokens=32))
        outputs = drain(engine)
        for s, ids in enumerate(sessions):
            result = outputs[f"{s}/{turn}"]
            assert result.generated_tokens == plain(model, ids, 32, eos_token_id=tokenizer.eos_token_id), (s, turn)
            assert (result.reused_prefix_tokens > 0) == (turn > 0)
            accepted.append(result.spec_stats.mean_accepted_length)
        sessions = [ids + outputs[f"{s}/{turn}"].generated_tokens + tokenizer("\n# test it\n").input_ids
                    for s, ids in enumerate(sessions)]
    assert max(accepted) > 1.0  # the fixtures repeat themselves more than real models do


def test_prefix_store_bounds_and_lookup():
    from hf_hybrid_spec.cache import CommittedState

    def state(n, width=4):
        return CommittedState(n, kv={0: (torch.zeros(1, 1, n, width), torch.zeros(1, 1, n, width))})

    store = PrefixStore(max_bytes=state(10).nbytes * 2, max_entries=3)
    assert store.put([1, 2, 3], state(3)) and store.put([1, 2, 3, 4, 5], state(5))
    hit = store.longest([1, 2, 3, 4, 5, 6])
    assert hit.length == 5
    assert store.longest([1, 2, 3, 4, 5]).length == 3  # a key equal to the prompt leaves nothing to run: not used
    assert store.longest([9, 1, 2, 3]) is None
    # A drafter's carry counts toward the bytes and goes to the first hit only; the state stays for later hits.
    carry = type("Carry", (), {"nbytes": lambda self: 7})()
    before = store.nbytes
    assert store.put([5, 6, 7], state(3), carry) and store.nbytes == before + state(3).nbytes + 7
    assert store.longest([5, 6, 7, 8]).carry is carry and store.nbytes == before + state(3).nbytes
    assert store.longest([5, 6, 7, 8]).carry is None
    assert not store.put(list(range(30)), state(30))  # over the byte bound on its own
    for n in range(6, 12):
        store.put(list(range(n)), state(n))
    assert len(store) <= 3 and store.nbytes <= store.max_bytes
    with pytest.raises(ValueError, match="key has"):
        store.put([1, 2], state(3))


class Boom(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] > 14:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_failing_request_fails_alone():
    model = tiny_model("qwen3_5_text")
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=3, max_total_tokens=48),
                           greedy_config())
    inputs = prompts(4, seed=4)
    bad = [engine.add(ServingRequest("empty", [], max_new_tokens=4)),
           engine.add(ServingRequest("vocab", [5, 96, 7], max_new_tokens=4)),
           engine.add(ServingRequest("long", [5] * 40, max_new_tokens=20))]
    assert [b.status for b in bad] == [RequestStatus.FAILED] * 3
    assert "empty" in bad[0].error and "vocabulary" in bad[1].error and "max_total_tokens" in bad[2].error
    engine.add(ServingRequest("ok0", inputs[0], max_new_tokens=10))
    engine.add(ServingRequest("boom", inputs[1], max_new_tokens=10, stopping_criteria=[Boom()]))
    engine.add(ServingRequest("ok2", inputs[2], max_new_tokens=10))
    engine.add(ServingRequest("ok3", inputs[3], max_new_tokens=10))
    assert engine.add(ServingRequest("ok3", inputs[3], max_new_tokens=10)).status == RequestStatus.FAILED  # dup id
    done = drain(engine)
    assert done["boom"].status == RequestStatus.FAILED and "boom" in done["boom"].error
    for i in (0, 2, 3):
        assert done[f"ok{i}"].status == RequestStatus.FINISHED
        assert done[f"ok{i}"].generated_tokens == plain(model, inputs[i], 10)


def test_cancel_frees_the_slot():
    model = tiny_model("qwen3_5_text")
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=1, max_total_tokens=96),
                           greedy_config())
    inputs = prompts(2, seed=5)
    engine.add(ServingRequest("long", inputs[0], max_new_tokens=60))
    engine.add(ServingRequest("next", inputs[1], max_new_tokens=6))
    engine.step()
    assert engine.running == 1
    cancelled = engine.cancel("long")
    assert cancelled.status == RequestStatus.FAILED and cancelled.error == "cancelled"
    assert engine.cancel("nobody") is None
    done = drain(engine)
    assert done["next"].generated_tokens == plain(model, inputs[1], 6)


def test_manager_under_concurrent_arrivals_and_streams():
    model = tiny_model("qwen3_5_text")
    inputs = prompts(8, seed=6)
    refs = [plain(model, ids, 9) for ids in inputs]
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=3, max_total_tokens=64), greedy_config())
    ids_by_index = {}
    with manager:
        def client(indices, delay):
            for i in indices:
                time.sleep(delay)
                ids_by_index[i] = manager.add_request(inputs[i], max_new_tokens=9)

        threads = [threading.Thread(target=client, args=([0, 2, 4, 6], 0.003)),
                   threading.Thread(target=client, args=([1, 3, 5], 0.005))]
        for t in threads:
            t.start()
        stream_id = manager.add_request(inputs[7], max_new_tokens=9, streaming=True)
        seen = [list(o.generated_tokens) for o in manager.request_id_iter(stream_id, timeout=60)]
        for t in threads:
            t.join()
        results = {i: manager.get_result(rid, timeout=60) for i, rid in ids_by_index.items()}
    assert not manager.is_running()
    for i, result in results.items():
        assert result.status == RequestStatus.FINISHED and result.generated_tokens == refs[i], i
    assert seen[-1] == refs[7] and len(seen) >= 2
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))  # every update extends the last
    with pytest.raises(KeyError, match="streaming"):
        next(manager.request_id_iter("req_unknown"))


def test_stop_fails_what_is_left():
    model = tiny_model("qwen3_5_text")
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=1, max_total_tokens=128), greedy_config())
    manager.start()
    rid = manager.add_request(prompts(1)[0], max_new_tokens=100)
    manager.stop(timeout=30)
    result = manager.get_result(rid, timeout=10)
    assert result is not None and result.is_finished()
    assert result.status == RequestStatus.FINISHED or result.error == "stopped"


def test_sampling_follows_the_targets_law():
    """Each request's first two sampled tokens follow the target's joint law for its prompt (chi-square at a fixed
    seed, p > 1e-3, the suffix drafter proposing on repetitive prompts), and the harness rejects a sharper law."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    model = tiny_model("qwen3_5_text", vocab_size=V, seed=3)
    inputs = [[2, 5, 3, 2, 5, 3, 2, 5], [4, 6, 4, 6, 4]]
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(4)])
    joints = [target_joint(model, torch.tensor([p]), processors) for p in inputs]
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=4, top_p=1.0, eos_token_id=None, pad_token_id=PAD)
    torch.manual_seed(1234)
    batch = [inputs[i % 2] for i in range(600)]
    out = generate_batch(model, batch, gen, H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=16, max_total_tokens=16), max_new_tokens=2)
    counts = [torch.zeros(V * V) for _ in inputs]
    for i in range(len(batch)):
        a, c = out[f"req_{i}"].generated_tokens
        counts[i % 2][a * V + c] += 1
    for count, joint in zip(counts, joints):
        assert chi2_pvalue(count, joint) > 1e-3
        sharper = torch.softmax(2.0 * torch.log(joint + 1e-12), dim=0)
        assert chi2_pvalue(count, sharper) < 1e-3


def test_a_seeded_request_samples_the_same_reply_wherever_it_runs():
    """A request's own seed (vLLM's `seed`): the same reply with speculation on or off, alone or beside others, in
    any slot, now or later; another seed gives another reply. Its draws stay the target's law (the keyed draw of
    `verification.noise`, tested in test_sampling_follows_the_targets_law without a seed)."""
    model = tiny_model("qwen3_5_text")
    inputs = prompts(4, seed=21)

    def run(requests, speculation=True):
        engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                               ServingConfig(max_slots=3, max_total_tokens=64, speculation=speculation))
        for name, ids, seed in requests:
            gen = GenerationConfig(do_sample=True, temperature=1.3, top_k=0, eos_token_id=None, pad_token_id=PAD)
            gen.seed = seed
            engine.add(ServingRequest(name, ids, max_new_tokens=12, generation_config=gen))
        return {name: out.generated_tokens for name, out in drain(engine).items()}

    alone = run([("a", inputs[0], 7)])["a"]
    beside = run([("x", inputs[1], None), ("y", inputs[2], 3), ("a", inputs[0], 7), ("z", inputs[3], None)])
    assert beside["a"] == alone
    assert run([("a", inputs[0], 7), ("b", inputs[0], 7)], speculation=False) == {"a": alone, "b": alone}
    assert run([("a", inputs[0], 8)])["a"] != alone
    bad = GenerationConfig(do_sample=True)
    bad.seed = -1
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=1))
    assert "seed" in engine.add(ServingRequest("bad", inputs[0], 4, generation_config=bad)).error


def test_steps_where_nobody_drafts_are_plain_steps(monkeypatch):
    """A step where no request drafts (speculation off here) runs as a plain decode step (`engine.plain`: the
    root's forward, the token chosen and committed on the device), for greedy requests and sampling ones (the keyed
    draw the verify step would make there), with plain generate's greedy replies. Processors that read the ids (a
    repetition penalty, n-grams, OpenAI's presence / frequency penalties), each request its own beside the others, get
    each request's ids and its root there too, steps queued ahead of their read included: plain generate's greedy
    replies, and a sampling request's the draws the verify step makes."""
    from hf_hybrid_spec.serving import engine as engine_module

    calls, ahead = [], []
    real = engine_module.queue_plain_step
    monkeypatch.setattr(engine_module, "queue_plain_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_ahead = ServingEngine._queue_ahead
    monkeypatch.setattr(ServingEngine, "_queue_ahead",
                        lambda self, launched: real_ahead(self, launched) or ahead.append(self._ahead is not None))
    model = tiny_model("qwen3_5_text", vocab_size=V)  # (a small vocabulary: replies that repeat a token)
    inputs = prompts(5, seed=23, vocab=V)

    def run(settings: list[dict], speculation: bool) -> dict:
        calls.clear()
        engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                               ServingConfig(max_slots=5, max_total_tokens=64, speculation=speculation))
        for i, (ids, kw) in enumerate(zip(inputs, settings)):
            gen = GenerationConfig(**{"do_sample": False, "eos_token_id": None, "pad_token_id": PAD, **kw})
            gen.seed = 5
            engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=10, generation_config=gen))
        return {name: out.generated_tokens for name, out in drain(engine).items()}

    greedy = run([{}, {}, {}], speculation=False)
    assert len(calls) >= 9 and greedy == {f"r{i}": plain(model, ids, 10) for i, ids in enumerate(inputs[:3])}
    sampling = [{"do_sample": True, "temperature": 1.2, "top_k": 0}, {}, {"do_sample": True, "top_p": 0.9}]
    sampled = run(sampling, speculation=False)
    assert len(calls) >= 9
    assert run(sampling, speculation=True) == sampled  # the verify step draws the same tokens
    occurrence = {"presence_penalty": 0.8, "frequency_penalty": 0.5}
    settings = [{"no_repeat_ngram_size": 2}, occurrence, {},
                {"do_sample": True, "temperature": 1.2, "top_k": 0, "repetition_penalty": 1.3},
                {"repetition_penalty": 1.5}]
    ahead.clear()
    penalized = run(settings, speculation=False)
    assert len(calls) >= 9 and sum(ahead) >= 5  # (steps queued ahead of the last one's read among them)
    counts = LogitsProcessorList([OccurrencePenaltyLogitsProcessor(0.8, 0.5, len(inputs[1]))])
    for i, kw in [(0, settings[0]), (1, dict(logits_processor=counts)), (2, {}), (4, settings[4])]:
        expected = plain(model, inputs[i], 10, **kw)
        assert penalized[f"r{i}"] == expected, i
        assert not kw or expected != plain(model, inputs[i], 10), f"request {i}'s setting changed nothing"
    monkeypatch.setattr(ServingEngine, "_launch_plain", lambda *a, **k: None)  # every step verifies
    assert run(settings, speculation=False) == penalized and not calls


@pytest.mark.parametrize("prefill", ["eager", "chunked"])
def test_logprobs_of_accepted_drafts_are_the_targets(prefill):
    """A request's `logprobs` (its config's, as the server sets it) when drafts are accepted (the target drafting
    for itself: every draft node is taken): each token's is the log-softmax of the target's raw logits after the
    tokens before it, at the tree node it was chosen from, with the likeliest alternatives there."""
    model = tiny_model("qwen3_5_text")
    inputs = prompts(2, seed=31)
    engine = ServingEngine(model, H.AssistantConfig(drafter="model", max_draft_tokens=4, max_depth=4,
                                                    global_cache=False),
                           ServingConfig(max_slots=2, max_total_tokens=64, prefill=prefill), greedy_config(),
                           draft_model=model)
    for i, ids in enumerate(inputs):
        gen = greedy_config()
        gen.logprobs = 3 if i == 0 else None
        engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=10, generation_config=gen))
    done = drain(engine)
    assert done["r0"].spec_stats.mean_accepted_length > 1.5 and done["r1"].logprobs is None
    ids, new = inputs[0], done["r0"].generated_tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1 : len(ids) - 1 + len(new)].float()
    expected = torch.log_softmax(logits, dim=-1)
    entries = done["r0"].logprobs
    assert [e.token for e in entries] == new
    chosen = expected.gather(1, torch.tensor(new)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in entries]), chosen, atol=1e-4)
    top = expected.topk(3, dim=-1)
    assert [[t for t, _ in e.top] for e in entries] == top.indices.tolist()


def test_plain_steps_give_logprobs_as_the_verify_step_does(monkeypatch):
    """Requests that ask for `logprobs` (greedy and sampling, beside one that does not) take the plain steps too,
    queued ahead included: each token's log-probability under the target's raw logits and the likeliest alternatives
    are those the verify step gives, and greedy's are the target's own."""
    from hf_hybrid_spec.serving import engine as engine_module

    calls = []
    real = engine_module.queue_plain_step
    monkeypatch.setattr(engine_module, "queue_plain_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("qwen3_5_text")
    inputs = prompts(4, seed=37)
    settings = [dict(logprobs=3), dict(logprobs=0, do_sample=True, temperature=1.2, top_k=0),
                dict(repetition_penalty=1.3), dict(logprobs=2, repetition_penalty=1.3)]

    def run():
        calls.clear()
        engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                               ServingConfig(max_slots=4, max_total_tokens=64, speculation=False))
        for i, (ids, kw) in enumerate(zip(inputs, settings)):
            gen = greedy_config(**{k: v for k, v in kw.items() if k != "logprobs"})
            gen.logprobs, gen.seed = kw.get("logprobs"), 3
            engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=10, generation_config=gen))
        return drain(engine)

    plain_steps = run()
    assert len(calls) >= 9 and plain_steps["r2"].logprobs is None
    monkeypatch.setattr(ServingEngine, "_launch_plain", lambda *a, **k: None)  # every step verifies
    verified = run()
    assert not calls
    for name in ("r0", "r1", "r3"):
        got, want = plain_steps[name], verified[name]
        assert got.generated_tokens == want.generated_tokens and len(got.logprobs) == len(want.generated_tokens)
        assert [e.token for e in got.logprobs] == got.generated_tokens
        assert torch.allclose(torch.tensor([e.logprob for e in got.logprobs]),
                              torch.tensor([e.logprob for e in want.logprobs]), atol=1e-5), name
        assert [[t for t, _ in e.top] for e in got.logprobs] == [[t for t, _ in e.top] for e in want.logprobs]
    ids, new = inputs[0], plain_steps["r0"].generated_tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1 : len(ids) - 1 + len(new)].float()
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(new)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in plain_steps["r0"].logprobs]), expected, atol=1e-4)


def test_a_thousand_requests_stay_bounded():
    model = tiny_model("qwen3_5_text")
    config = ServingConfig(max_slots=8, max_total_tokens=32, prefix_cache_bytes=1 << 18, prefix_cache_entries=16)
    engine = ServingEngine(model, H.AssistantConfig(), config, greedy_config())
    g = torch.Generator().manual_seed(7)
    for i in range(1000):
        engine.add(ServingRequest(f"r{i}", torch.randint(3, 96, (6,), generator=g).tolist(), max_new_tokens=3))
    finished = 0
    while engine.has_work:
        finished += sum(o.status == RequestStatus.FINISHED for o in engine.step())
    assert finished == 1000
    assert len(engine.prefixes) <= 16 and engine.prefixes.nbytes <= 1 << 18
    assert engine.running == 0 and not engine._ids and engine.backend.running_slots == []


def test_unsupported_drafters_and_rules_say_so():
    model = tiny_model("qwen3_5_text")
    with pytest.raises(NotImplementedError, match="verification"):
        ServingEngine(model, H.AssistantConfig(verification="typical"))
    with pytest.raises(NotImplementedError, match="self_ssm"):
        ServingEngine(model, H.AssistantConfig(drafter="self_ssm"))
    with pytest.raises(ValueError, match="max_slots"):
        ServingConfig(max_slots=0)
    with pytest.raises(ValueError, match="prefill"):
        ServingConfig(prefill="lazy")


def test_enable_makes_transformers_continuous_batching_entry_points_work():
    """Stock `generate_batch` fails on hybrids (transformers 5.24: "Invalid layer type"; 5.17 already sizing its
    cache on this CPU); after `enable` it runs ours, as does `init_continuous_batching`, with transformers'
    arguments."""
    inputs = prompts(3, seed=8)
    with pytest.raises(ValueError):  # (a model of its own: a failed stock manager leaves its attention switched)
        tiny_model("qwen3_5_text").generate_batch(inputs, generation_config=greedy_config(max_new_tokens=4))
    model = tiny_model("qwen3_5_text")
    H.enable(model, H.AssistantConfig(global_cache=False))
    try:
        out = model.generate_batch(inputs, generation_config=greedy_config(max_new_tokens=7), progress_bar=False)
        assert [out[f"req_{i}"].generated_tokens for i in range(3)] == [plain(model, ids, 7) for ids in inputs]
        with pytest.raises(ValueError, match="serving_config"):
            model.generate_batch(inputs, continuous_batching_config=object())
        manager = model.init_continuous_batching(generation_config=greedy_config(),
                                                 serving_config=ServingConfig(max_slots=2, max_total_tokens=64))
        with manager:
            rid = manager.add_request(inputs[0], max_new_tokens=5)
            assert manager.get_result(rid, timeout=60).generated_tokens == plain(model, inputs[0], 5)
    finally:
        for name in ("generate", "generate_batch", "init_continuous_batching"):
            del model.__dict__[name]


@pytest.mark.parametrize("prefill", ["eager", "chunked"])
def test_per_request_processors_match_plain_generate(prefill):
    """Requests with every processor stock `generate` builds from a generation config, each its own, beside a plain
    greedy one in one engine: each reply is plain generate's with the request's settings, and each setting changed
    its reply (the engine once built only the penalties and the sampling warpers, and dropped the rest silently)."""
    model = tiny_model("qwen3_5_text")
    inputs = prompts(8, seed=9)
    free = [plain(model, ids, 10) for ids in inputs]  # each prompt's reply without settings
    cases = {
        "ngram": dict(no_repeat_ngram_size=2),
        "min_new": dict(min_new_tokens=10, eos_token_id=free[1][1]),  # its eos: its second token without settings
        "penalty": dict(repetition_penalty=1.5),  # its eos is its second token
        "bad_words": dict(bad_words_ids=[[free[3][0]], [free[3][1], free[3][2]]]),
        "suppress": dict(suppress_tokens=free[4][:3]),
        "begin_suppress": dict(begin_suppress_tokens=[free[5][0]]),
        "bias": dict(sequence_bias={(free[6][0],): -50.0}),
    }
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                           ServingConfig(max_slots=8, max_total_tokens=64, prefill=prefill), greedy_config())
    for (name, settings), ids in zip(cases.items(), inputs):
        engine.add(ServingRequest(name, ids, max_new_tokens=10, generation_config=greedy_config(**settings)))
    engine.add(ServingRequest("plain", inputs[7], max_new_tokens=10))
    done = drain(engine)
    for (name, settings), ids, before in zip(cases.items(), inputs, free):
        expected = plain(model, ids, 10, **settings)
        assert done[name].generated_tokens == expected, name
        assert expected != before, f"{name} changed nothing: the test cannot fail"
    assert len(done["min_new"].generated_tokens) == 10
    assert done["plain"].generated_tokens == free[7]


def test_generate_batch_decodes_every_prompt_at_once_by_default(monkeypatch):
    """Without a ServingConfig, generate_batch gives every prompt a slot (up to GENERATE_BATCH_SLOTS), as batched
    generate would batch them (it once ran 8 at a time, the engine's server default, so 32 prompts ran in 4 waves)."""
    from hf_hybrid_spec.serving import manager

    model = tiny_model("qwen3_5_text")
    seen = []
    real = manager.make_engine

    engines = []

    def spy(model, assistant_config, serving_config, *args):
        seen.append(serving_config.max_slots)
        engines.append(real(model, assistant_config, serving_config, *args))
        return engines[-1]

    monkeypatch.setattr(manager, "make_engine", spy)
    inputs = prompts(10, seed=12)
    out = generate_batch(model, inputs, greedy_config(), H.AssistantConfig(global_cache=False), max_new_tokens=3)
    assert seen == [10]
    assert [out[f"req_{i}"].generated_tokens for i in range(10)] == [plain(model, ids, 3) for ids in inputs]
    # Every prompt had a slot from the first step: no request's state is stored as it leaves (nobody could read it).
    assert engines[0].prefixes is None
    # The next call of the same sizes runs on the same runner (the model's pool: graphs captured once on a GPU).
    again = generate_batch(model, inputs, greedy_config(), H.AssistantConfig(global_cache=False), max_new_tokens=3)
    assert engines[1]._runner is engines[0]._runner and again["req_3"].generated_tokens == out["req_3"].generated_tokens
    seen.clear()
    monkeypatch.setattr(manager, "GENERATE_BATCH_SLOTS", 4)
    out = generate_batch(model, inputs[:6], greedy_config(), H.AssistantConfig(global_cache=False), max_new_tokens=3)
    assert seen == [4] and len(out) == 6
    # Prompts that wait for a slot may extend a state stored by one that left: the store stays.
    assert engines[-1].prefixes is not None and len(engines[-1].prefixes) > 0
    # Long requests get fewer slots (never fewer than the engine's default): the tokens of all slots are bounded.
    monkeypatch.setattr(manager, "GENERATE_BATCH_SLOTS", 64)
    monkeypatch.setattr(manager, "GENERATE_BATCH_TOKENS", 9 * max(len(ids) for ids in inputs) + 9 * 3)
    generate_batch(model, inputs, greedy_config(), H.AssistantConfig(global_cache=False), max_new_tokens=3)
    assert seen[-1] == 9


def test_settings_the_engine_cannot_honour_are_refused_by_name():
    model = tiny_model("qwen3_5_text")
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                           ServingConfig(max_slots=2, max_total_tokens=64), greedy_config())
    ids = prompts(1)[0]
    out = engine.add(ServingRequest("cfg", ids, 4, generation_config=greedy_config(guidance_scale=2.0)))
    assert out.status == RequestStatus.FAILED and "guidance_scale" in out.error
    out = engine.add(ServingRequest("strings", ids, 4, generation_config=greedy_config(stop_strings=["x"])))
    assert out.status == RequestStatus.FAILED and "StopStringCriteria" in out.error
    # max_time is honoured: a request with no time left stops after its first token.
    engine.add(ServingRequest("timed", ids, 20, generation_config=greedy_config(max_time=0.0)))
    done = drain(engine)
    assert 1 <= len(done["timed"].generated_tokens) < 20 and done["timed"].status == RequestStatus.FINISHED


@pytest.mark.parametrize("prefill", ["eager", "chunked"])
def test_outputs_made_at_admission_reach_the_caller_beside_running_requests(prefill):
    """A request that ends at its first token, or fails at admission, while others run: step() returns it (it once
    returned only the running requests' outputs, and such a request was never answered)."""
    model = tiny_model("qwen3_5_text")
    inputs = prompts(4, seed=5)
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                           ServingConfig(max_slots=4, max_total_tokens=64, prefill=prefill, prefill_chunk=5),
                           greedy_config())
    for i in range(2):
        engine.add(ServingRequest(request_id=f"long{i}", input_ids=inputs[i], max_new_tokens=24))
    seen = {o.request_id: o for o in engine.step()}
    engine.add(ServingRequest(request_id="short", input_ids=inputs[2], max_new_tokens=1))
    engine.add(ServingRequest(request_id="bad", input_ids=inputs[3], max_new_tokens=4,
                              generation_config=GenerationConfig(do_sample=True, min_p=5.0, pad_token_id=PAD)))
    while engine.has_work and not {"short", "bad"} <= set(seen):
        seen.update({o.request_id: o for o in engine.step()})
    assert engine.has_work  # the long requests still run: the two were answered beside them
    assert seen["short"].status == RequestStatus.FINISHED and seen["short"].generated_tokens == plain(
        model, inputs[2], 1)
    assert seen["bad"].status == RequestStatus.FAILED and "min_p" in seen["bad"].error
    seen.update(drain(engine))
    for i in range(2):
        assert seen[f"long{i}"].generated_tokens == plain(model, inputs[i], 24)


def test_generate_batch_with_a_row_that_ends_at_its_first_token():
    model = tiny_model("falcon_h1")
    inputs = prompts(4, seed=6)
    eos = plain(model, inputs[1], 1)[0]  # row 1 ends at its first token; the others run on (or end at eos too)
    out = generate_batch(model, inputs, greedy_config(eos_token_id=eos), H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=4, max_total_tokens=64, prefill="eager"), max_new_tokens=12)
    for i, ids in enumerate(inputs):
        assert out[f"req_{i}"].generated_tokens == plain(model, ids, 12, eos_token_id=eos), i


class _UserSignal(BaseException):
    """A user's own BaseException subclass (not an Exception): still that request's failure alone."""


class _FailingSuffix(H.SuffixDrafter):
    """The suffix drafter, failing in one hook."""

    def __init__(self, hook: str, error: type = RuntimeError):
        super().__init__(use_global=False)
        self.hook, self.error = hook, error

    def _maybe(self, hook):
        if hook == self.hook:
            raise self.error(f"{hook} failed")

    def overlap(self):
        self._maybe("overlap")
        return super().overlap()

    def handoff(self, input_ids):
        self._maybe("handoff")
        return super().handoff(input_ids)

    def release(self):
        super().release()
        self._maybe("release")


class _SignalCriterion(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] > 12:
            raise _UserSignal("stop right here")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("hook", ["overlap", "handoff", "release", "criterion"])
def test_a_requests_hook_that_raises_fails_that_request_alone(hook, monkeypatch):
    """Every per-request hook runs under that request's error handling: its drafter's overlap / handoff / release,
    a stopping criterion raising a BaseException subclass; the others finish exactly, and the engine serves on."""
    import hf_hybrid_spec.serving.engine as engine_module

    model = tiny_model("qwen3_5_text")
    inputs = prompts(4, seed=9)
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                           ServingConfig(max_slots=4, max_total_tokens=64), greedy_config())
    real, built = engine_module.make_drafter, []

    def drafter_for(config, target, draft_model=None):  # the third request's ("bad") drafter fails in `hook`
        built.append(1)
        if len(built) == 3 and hook != "criterion":
            return _FailingSuffix(hook)
        return real(config, target, draft_model)

    monkeypatch.setattr(engine_module, "make_drafter", drafter_for)
    for i in (0, 1):
        engine.add(ServingRequest(f"ok{i}", inputs[i], max_new_tokens=12))
    criteria = [_SignalCriterion()] if hook == "criterion" else []
    engine.add(ServingRequest("bad", inputs[2], max_new_tokens=12, stopping_criteria=criteria))
    done = drain(engine)
    for i in (0, 1):
        assert done[f"ok{i}"].status == RequestStatus.FINISHED
        assert done[f"ok{i}"].generated_tokens == plain(model, inputs[i], 12)
    if hook in ("overlap", "criterion"):  # it failed mid-request: FAILED with its message
        assert done["bad"].status == RequestStatus.FAILED
        assert ("overlap failed" if hook == "overlap" else "stop right here") in done["bad"].error
    else:  # it failed as it left: its tokens stand
        assert done["bad"].status == RequestStatus.FINISHED
        assert done["bad"].generated_tokens == plain(model, inputs[2], 12)
    engine.add(ServingRequest("after", inputs[3], max_new_tokens=6))
    assert drain(engine)["after"].generated_tokens == plain(model, inputs[3], 6)


def test_a_manager_whose_engine_failed_answers_at_once_and_restarts():
    model = tiny_model("qwen3_5_text")
    inputs = prompts(2, seed=10)
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=64), greedy_config())
    real_step = manager.engine.step
    calls = {"n": 0}

    def broken_step():  # the engine itself fails (as on a device error) at its second step
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_step()

    manager.engine.step = broken_step
    manager.start()
    first = manager.add_request(inputs[0], max_new_tokens=20)
    result = manager.get_result(first, timeout=60)
    assert result.status == RequestStatus.FAILED and "device lost" in result.error
    manager.join(timeout=30)
    assert not manager.is_running()
    # Added after the loop ended: answered at once with the reason, not left waiting.
    late = manager.add_request(inputs[1], max_new_tokens=4)
    result = manager.get_result(late, timeout=5)
    assert result is not None and result.status == RequestStatus.FAILED and "device lost" in result.error
    # Restarted, the manager serves again.
    manager.engine.step = real_step
    manager.start()
    again = manager.add_request(inputs[1], max_new_tokens=6)
    assert manager.get_result(again, timeout=60).generated_tokens == plain(model, inputs[1], 6)
    manager.stop(timeout=30)


def test_a_stream_left_early_leaves_nothing_behind():
    model = tiny_model("qwen3_5_text")
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=96), greedy_config())
    with manager:
        for i in range(4):
            rid = manager.add_request(prompts(1, seed=i)[0], max_new_tokens=40, streaming=True)
            stream = manager.request_id_iter(rid, timeout=60)
            next(stream)
            manager.cancel_request(rid)
            stream.close()  # the client went away before the end
        done = manager.add_request(prompts(1, seed=9)[0], max_new_tokens=4)
        assert manager.get_result(done, timeout=60).status == RequestStatus.FINISHED
        deadline = time.time() + 10
        while manager.engine.has_work and time.time() < deadline:
            time.sleep(0.01)
    assert not manager._finished and not manager._streams and not manager._abandoned


def test_requests_with_different_sampling_settings_choose_together_as_one_by_one(monkeypatch):
    """A step's decoding requests choose their tokens in one pass (`batch_choices`: each its own seed, temperature,
    top-k / top-p, or greedy) with the tokens each would choose verified alone; with a repetition penalty (which
    reads each node's ids) too, the same tokens as row by row."""
    import hf_hybrid_spec.engine.step as step_module
    from hf_hybrid_spec.verification import batch_choices

    model = tiny_model("qwen3_5_text", vocab_size=V, seed=3)
    inputs = [[2, 5, 3, 2, 5, 3, 2, 5], [4, 6, 4, 6, 4], [3, 2, 5, 3, 2, 5], [6, 4, 6, 4, 6, 4, 6]]
    settings = [dict(do_sample=True, temperature=0.7, top_k=5), dict(do_sample=False),
                dict(do_sample=True, temperature=1.2, top_p=0.8), dict(do_sample=True, min_p=0.1)]

    def serve(extra: dict | None = None) -> list[list[int]]:
        torch.manual_seed(21)  # each request's seed is drawn when it is admitted, in order
        engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=4,
                               max_total_tokens=48), greedy_config())
        for i, (ids, kw) in enumerate(zip(inputs, settings)):
            gen = greedy_config(**{**kw, **(extra or {})})
            engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=20, generation_config=gen))
        out = drain(engine)
        return [out[f"r{i}"].generated_tokens for i in range(len(inputs))]

    used = []
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: used.append(a) or batch_choices(*a, **k))
    together = serve()
    assert used and len(used[0][0]) > 1  # several requests chose in one pass
    assert together[1] == plain(model, inputs[1], 20)
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: None)
    assert serve() == together
    chosen = []
    monkeypatch.setattr(step_module, "batch_choices",
                        lambda *a, **k: chosen.append(batch_choices(*a, **k)) or chosen[-1])
    penalized = serve(dict(repetition_penalty=1.3))
    assert any(c is not None for c in chosen)  # the penalized requests chose in one pass too
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: None)
    assert serve(dict(repetition_penalty=1.3)) == penalized


def test_presence_and_frequency_penalties_count_the_generated_tokens_exactly():
    """OpenAI's presence / frequency penalties (`serving.penalties`): the processor subtracts them by the counts of the
    generated tokens only; requests carrying them (beside one without) get plain generate's tokens under the same
    processor, with speculation's trees verified node by node."""
    scores = torch.zeros(2, 6)
    ids = torch.tensor([[4, 4, 1, 1, 1, 2], [4, 0, 0, 5, 3, 3]])
    out = OccurrencePenaltyLogitsProcessor(0.5, 0.25, prompt_length=2)(ids, scores)
    expected = torch.zeros(2, 6)
    expected[0, 1] -= 0.5 + 3 * 0.25
    expected[0, 2] -= 0.5 + 0.25
    expected[1, 0] -= 0.5 + 0.25  # the first 0 is in the prompt
    expected[1, 5] -= 0.5 + 0.25
    expected[1, 3] -= 0.5 + 2 * 0.25
    assert torch.equal(out, expected)

    model = tiny_model("qwen3_5_text", vocab_size=V, seed=3)
    inputs = [[2, 5, 3, 2, 5, 3, 2, 5], [4, 6, 4, 6, 4], [3, 2, 5, 3, 2, 5]]
    penalties = [(1.5, 0.0), (0.0, 0.8), (0.0, 0.0)]
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=3,
                           max_total_tokens=48), greedy_config())
    for i, (ids, (presence, frequency)) in enumerate(zip(inputs, penalties)):
        gen = greedy_config(presence_penalty=presence, frequency_penalty=frequency)
        engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=16, generation_config=gen))
    out = drain(engine)
    for i, (ids, (presence, frequency)) in enumerate(zip(inputs, penalties)):
        procs = LogitsProcessorList([OccurrencePenaltyLogitsProcessor(presence, frequency, len(ids))])
        assert out[f"r{i}"].generated_tokens == plain(model, ids, 16, logits_processor=procs), i
    assert out["r0"].generated_tokens != plain(model, inputs[0], 16)  # the penalty changed the reply


@pytest.mark.parametrize("processors", [{}, {"no_repeat_ngram_size": 2, "presence_penalty": 0.5}])
def test_a_step_queued_ahead_for_a_request_gone_is_not_queued_again(processors):
    """With one slot, a plain step queued ahead past a request's eos is read after the request left and the next
    one took its slot: nothing more is queued for the request gone (a step queued for it committed into the new
    request's row, step after step, until the forward ran past the slot's end). An agent's turns, each after the
    last one stopped on its eos, get plain generate's replies and reuse the stored state."""
    model = tiny_model("falcon_h1", vocab_size=12)
    ids = [6, 4, 6, 4, 6, 4, 6, 4, 6, 4]
    occurrence = processors.get("presence_penalty", 0.0)
    free = plain(model, ids, 12, **{k: v for k, v in processors.items() if k != "presence_penalty"})
    eos = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # the first turn stops there
    gen = greedy_config(eos_token_id=eos, **processors)
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                           ServingConfig(max_slots=1, max_total_tokens=64, speculation=False,
                                         prefix_cache_bytes=1 << 20))
    prompt = ids
    for turn, extra in enumerate(([], [5], [5, 6, 7])):
        prompt = prompt + extra
        engine.add(ServingRequest(f"t{turn}", prompt, max_new_tokens=12, generation_config=gen))
        out = drain(engine)[f"t{turn}"]
        assert out.error is None, turn
        counts = LogitsProcessorList([OccurrencePenaltyLogitsProcessor(occurrence, 0.0, len(prompt))])
        kw = {k: v for k, v in processors.items() if k != "presence_penalty"}
        expected = plain(model, prompt, 12, eos_token_id=eos, **kw, **({"logits_processor": counts}
                                                                       if occurrence else {}))
        assert out.generated_tokens == expected, turn
        assert turn == 0 or out.reused_prefix_tokens > 0
        prompt = prompt + out.generated_tokens


class _WrongChain(H.drafters.Drafter):
    """A chain of token 2 (never in `prompts`), recording the committed length at each proposal."""

    name = "wrong-chain"

    def __init__(self):
        self.lengths = []

    def propose(self, input_ids, budget):
        self.lengths.append(input_ids.shape[1])
        n = min(budget.max_nodes, budget.max_depth, 4)
        return H.tree.DraftTree.from_lists([2] * n, list(range(-1, n - 1)))


def test_drafts_that_do_not_pay_give_way_to_runs_of_plain_steps(monkeypatch):
    """Where the engine has a cost model (a GPU; here a flat one), drafting steps that commit no more per second than
    a plain step would start runs of plain steps without the drafters, as `generate`'s batch loop runs them
    (`PATIENCE` steps, then runs that double, one probe between); a request that starts decoding ends a run (its first
    step drafts); every reply is plain generate's."""
    from hf_hybrid_spec.engine.budget import VerifyCost
    from hf_hybrid_spec.engine.pipeline import PATIENCE, PLAIN_RUN
    from hf_hybrid_spec.registry import register_drafter
    from hf_hybrid_spec.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "step_cost",
                        lambda *a: VerifyCost(widths=[1, 2, 4, 8, 16, 32, 64], seconds=[1.0] * 6 + [1.01]))
    made = []
    register_drafter("test-wrong-chain", lambda *a: made.append(_WrongChain()) or made[-1], replace=True)
    model = tiny_model("qwen3_5_text")
    inputs = prompts(3, seed=31)
    engine = ServingEngine(model, H.AssistantConfig(drafter="test-wrong-chain"),
                           ServingConfig(max_slots=2, max_total_tokens=96, prefill="eager"), greedy_config())
    lengths = [48, 9, 20]  # the third waits for the second's slot and joins inside a plain run
    for i, (ids, n) in enumerate(zip(inputs, lengths)):
        engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=n))
    done = drain(engine)
    for i, (ids, n) in enumerate(zip(inputs, lengths)):
        assert done[f"r{i}"].generated_tokens == plain(model, ids, n), i
    stats = engine.stats
    assert stats.plain_steps >= 2 * PLAIN_RUN and stats.steps - stats.plain_steps <= 4 * PATIENCE
    first, _, third = made[1:]  # (made[0]: the engine's probe of the drafter's kind)
    assert first.lengths[:PATIENCE] == [len(inputs[0]) + 1 + k for k in range(PATIENCE)]
    assert len(first.lengths) < lengths[0] // 2
    assert third.lengths[0] == len(inputs[2]) + 1  # its first step drafted, though a run was on when it joined


def test_plain_steps_queued_ahead_of_their_read(monkeypatch):
    """Inside plain runs (here speculation off), a plain step is queued before the last one's tokens are read, its
    roots still on the device. Requests that stop on their eos with a step queued past it, that join as others leave,
    and that sample with their seeds get the replies that steps read one by one give; greedy ones plain generate's.
    With a prefix store the step ahead holds an eos root back, so a request that stopped on its eos leaves its state,
    and an agent's next turn reuses it and gets plain generate's reply."""
    queued = []
    real = ServingEngine._queue_ahead

    def spy(self, launched):
        real(self, launched)
        queued.append(self._ahead is not None)

    model = tiny_model("falcon_h1")
    inputs = prompts(5, seed=41)
    lengths = [5, 7, 30, 26, 22]
    new = plain(model, inputs[4], lengths[4])
    eos = next(t for i, t in enumerate(new) if i >= 6 and t not in new[:i])  # request 4 stops there

    def run(store: int, ahead: bool):
        queued.clear()
        monkeypatch.setattr(ServingEngine, "_queue_ahead", spy if ahead else lambda self, launched: None)
        engine = ServingEngine(model, H.AssistantConfig(global_cache=False),
                               ServingConfig(max_slots=3, max_total_tokens=64, speculation=False,
                                             prefix_cache_bytes=store))
        for i, (ids, n) in enumerate(zip(inputs, lengths)):
            sampling = {"do_sample": True, "temperature": 1.3, "top_k": 0} if i % 2 else {}
            gen = greedy_config(eos_token_id=eos, **sampling)
            gen.seed = 11 + i
            engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=n, generation_config=gen))
        return {name: out.generated_tokens for name, out in drain(engine).items()}, engine

    one_by_one, _ = run(0, ahead=False)
    for store in (0, 1 << 20):
        replies, engine = run(store, ahead=True)
        assert sum(queued) >= 10 and replies == one_by_one, store
    for i in (0, 2, 4):
        assert replies[f"r{i}"] == plain(model, inputs[i], lengths[i], eos_token_id=eos), i
    assert len(replies["r4"]) < lengths[4]
    follow = inputs[4] + replies["r4"] + [5, 6, 7]  # request 4's next turn
    engine.add(ServingRequest("next", follow, max_new_tokens=6, generation_config=greedy_config(eos_token_id=eos)))
    out = drain(engine)["next"]
    assert out.reused_prefix_tokens == len(inputs[4]) + len(replies["r4"]) - 1  # all but its eos, the root
    assert out.generated_tokens == plain(model, follow, 6, eos_token_id=eos)
