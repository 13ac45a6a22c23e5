"""Serving engines stepped in turn (`ServingConfig(lanes=...)`, `serving.lanes.ServingLanes`): every request's greedy
output equals plain `generate` with requests spread over the lanes, steps in flight while the host works on another
lane, requests that fail, stop early or are cancelled mid-flight; the prefix store is shared; the interface is the
engine's."""

import pytest
from test_engine import Boom, drain, greedy_config, plain, prompts
from transformers.generation.continuous_batching.requests import RequestStatus

import hf_hybrid_spec as H
from hf_hybrid_spec.serving import (
    ServingConfig,
    ServingEngine,
    ServingLanes,
    ServingRequest,
    generate_batch,
    init_continuous_batching,
    make_engine,
)
from hf_hybrid_spec.testing import tiny_model


@pytest.mark.parametrize("prefill", ["eager", "chunked"])
@pytest.mark.parametrize("family,lanes", [("qwen3_5_text", 2), ("falcon_h1", 3)])
def test_lanes_match_plain_generate(family, lanes, prefill):
    model = tiny_model(family)
    inputs = prompts(9, seed=11)
    refs = [plain(model, ids, 12) for ids in inputs]
    eos = refs[4][5]  # request 4 (and any other that makes it) stops early
    out = generate_batch(model, inputs, greedy_config(eos_token_id=eos), H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=5, max_total_tokens=64, prefill=prefill, prefill_chunk=5,
                                       lanes=lanes), max_new_tokens=12)
    for i, ids in enumerate(inputs):
        assert out[f"req_{i}"].status == RequestStatus.FINISHED
        assert out[f"req_{i}"].generated_tokens == plain(model, ids, 12, eos_token_id=eos), i


def test_lanes_split_the_slots_and_sum_their_statistics():
    model = tiny_model("qwen3_5_text")
    engine = make_engine(model, H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=5, max_total_tokens=64, lanes=2), greedy_config())
    assert isinstance(engine, ServingLanes)
    assert [e.serving.max_slots for e in engine.engines] == [3, 2]
    assert all(e.prefixes is engine.prefixes for e in engine.engines)
    inputs = prompts(6, seed=12)
    for i, ids in enumerate(inputs):
        engine.add(ServingRequest(f"r{i}", ids, max_new_tokens=7))
    assert sorted(e.waiting for e in engine.engines) == [3, 3]  # the emptier lane first
    done = drain(engine)
    for i, ids in enumerate(inputs):
        assert done[f"r{i}"].generated_tokens == plain(model, ids, 7)
    stats = engine.stats
    assert stats.finished == 6 and stats.new_tokens == 42
    assert stats.steps == sum(e.stats.steps for e in engine.engines) > 0
    assert not engine.has_work and engine.running == 0


def test_a_request_with_processors_and_a_failing_one_in_lanes():
    model = tiny_model("falcon_h1")
    engine = make_engine(model, H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=4, max_total_tokens=64, lanes=2), greedy_config())
    inputs = prompts(5, seed=13)
    penalty = greedy_config(repetition_penalty=1.3)  # not greedy over raw logits: verified on the device logits
    engine.add(ServingRequest("pen", inputs[0], max_new_tokens=9, generation_config=penalty))
    engine.add(ServingRequest("boom", inputs[1], max_new_tokens=10, stopping_criteria=[Boom()]))
    for i in (2, 3, 4):
        engine.add(ServingRequest(f"ok{i}", inputs[i], max_new_tokens=9))
    assert engine.add(ServingRequest("ok4", inputs[4], max_new_tokens=9)).status == RequestStatus.FAILED  # dup id
    done = drain(engine)
    assert done["boom"].status == RequestStatus.FAILED and "boom" in done["boom"].error
    assert done["pen"].generated_tokens == plain(model, inputs[0], 9, repetition_penalty=1.3)
    for i in (2, 3, 4):
        assert done[f"ok{i}"].generated_tokens == plain(model, inputs[i], 9)


def test_cancel_and_fail_all_with_steps_in_flight():
    model = tiny_model("qwen3_5_text")
    engine = make_engine(model, H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=2, max_total_tokens=96, lanes=2), greedy_config())
    inputs = prompts(3, seed=14)
    engine.add(ServingRequest("long", inputs[0], max_new_tokens=60))
    engine.add(ServingRequest("other", inputs[1], max_new_tokens=8))
    engine.step()
    engine.step()
    assert all(x is not None for x in engine._launched)  # both lanes have a forward queued
    cancelled = engine.cancel("long")
    assert cancelled.status == RequestStatus.FAILED and cancelled.error == "cancelled"
    assert engine.cancel("nobody") is None
    engine.add(ServingRequest("next", inputs[2], max_new_tokens=6))
    done = drain(engine)
    assert done["other"].generated_tokens == plain(model, inputs[1], 8)
    assert done["next"].generated_tokens == plain(model, inputs[2], 6)
    # An engine-wide failure with steps in flight: everything fails, the caches leave their tree mode, and the
    # lanes serve the next requests exactly.
    engine.add(ServingRequest("a", inputs[0], max_new_tokens=30))
    engine.add(ServingRequest("b", inputs[1], max_new_tokens=30))
    engine.step()
    engine.step()
    failed = engine.fail_all("stopped")
    assert sorted(o.request_id for o in failed) == ["a", "b"] and all(o.error == "stopped" for o in failed)
    assert not engine.has_work and all(e.backend.cache.tree is None for e in engine.engines)
    engine.add(ServingRequest("after", inputs[2], max_new_tokens=6))
    assert drain(engine)["after"].generated_tokens == plain(model, inputs[2], 6)


def test_a_follow_up_finds_its_state_in_another_lane():
    model = tiny_model("qwen3_5_text")
    engine = make_engine(model, H.AssistantConfig(global_cache=False),
                         ServingConfig(max_slots=2, max_total_tokens=128, lanes=2), greedy_config())
    ids = prompts(1, seed=15)[0]
    engine.add(ServingRequest("t0", ids, max_new_tokens=8))
    assert engine.engines[0].holds("t0")
    first = drain(engine)["t0"]
    follow = ids + first.generated_tokens + [7, 8, 9]
    engine.add(ServingRequest("busy", prompts(2, seed=16)[1], max_new_tokens=20))  # lane 0 (both empty: the first)
    engine.add(ServingRequest("t1", follow, max_new_tokens=8))
    assert engine.engines[1].holds("t1")
    second = drain(engine)["t1"]
    assert second.generated_tokens == plain(model, follow, 8)
    assert second.reused_prefix_tokens == len(ids) + 8 - 1
    assert engine.prefixes.hits == 1


def test_lane_settings_are_checked():
    with pytest.raises(ValueError, match="lanes"):
        ServingConfig(max_slots=2, lanes=3)
    with pytest.raises(ValueError, match="lanes"):
        ServingConfig(lanes=0)
    with pytest.raises(ValueError, match="make_engine"):
        ServingEngine(tiny_model("qwen3_5_text"), H.AssistantConfig(), ServingConfig(max_slots=2, lanes=2))


def test_manager_with_lanes():
    model = tiny_model("qwen3_5_text")
    inputs = prompts(5, seed=17)
    with init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                  ServingConfig(max_slots=4, max_total_tokens=64, lanes=2), greedy_config()) as manager:
        ids = [manager.add_request(x, max_new_tokens=9) for x in inputs]
        stream = manager.add_request(inputs[0], max_new_tokens=9, streaming=True)
        seen = [list(o.generated_tokens) for o in manager.request_id_iter(stream, timeout=60)]
        results = [manager.get_result(r, timeout=60) for r in ids]
    for x, result in zip(inputs, results):
        assert result.generated_tokens == plain(model, x, 9)
    assert seen[-1] == plain(model, inputs[0], 9)
