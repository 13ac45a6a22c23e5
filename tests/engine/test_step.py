"""One verify step for every caller (`engine.step`): generate at B = 1 and B > 1 and the serving engine reach the
verify forward through `step.launch_step` alone; generate's batch loop, whatever its decoding mode, the serving
engine and one request's general verification verify through `step.verify_batch`; a row whose processors raise
fails alone where the caller asks for it; and every static caller (one request, a batch, the serving engine) runs
its verify forward on the one runner (`static.StaticRunner`)."""

import sys
from contextlib import contextmanager

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import hf_hybrid_spec as H
import hf_hybrid_spec.engine.step as step
from hf_hybrid_spec.serving import ServingConfig, ServingEngine, ServingRequest
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DraftBatch, DraftTree
from hf_hybrid_spec.verification import ExactVerifier

V = 32
PAD = 1


@contextmanager
def calls_of(function):
    """Count the calls of `function` (by its code object: every module's binding of it counts) in this thread."""
    code, calls, before = function.__code__, [], sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(1)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(before)


@contextmanager
def callers_of(*functions):
    """The names of the functions that call any of `functions` (by their code objects), in this thread."""
    codes, callers, before = {f.__code__ for f in functions}, [], sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            callers.append(frame.f_back.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield callers
    finally:
        sys.setprofile(before)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "static"])
def test_every_caller_reaches_the_verify_forward_through_the_one_step(compile):
    """generate at B = 1 and at B > 1 (greedy and sampling) and the serving engine: every verify forward of either
    backend is launched by `step.launch_step`, and generate's tokens are plain generate's."""
    from hf_hybrid_spec.engine import BatchEagerBackend, BatchStaticBackend

    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[PAD, PAD, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3]])
    forwards = (BatchEagerBackend.forward, BatchStaticBackend.forward)
    for batch in (ids[1:], ids):
        for sample in (False, True):
            kw = dict(attention_mask=(batch != PAD).long(), pad_token_id=PAD, max_new_tokens=8, eos_token_id=None,
                      do_sample=sample, top_k=6 if sample else None)
            with callers_of(*forwards) as callers:
                got = model.generate(batch, custom_generate=H.speculative_generate,
                                     assistant_config=H.AssistantConfig(compile=compile), **kw)
            assert callers and set(callers) == {"launch_step"}, (batch.shape, sample, callers)
            if not sample:
                assert torch.equal(got, model.generate(batch, **kw))
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False, compile=compile), ServingConfig(max_slots=2),
                           GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD))
    for i, prompt in enumerate([[2, 5, 3, 2, 5, 3, 2], [4, 6, 4, 6, 4]]):
        engine.add(ServingRequest(f"r{i}", prompt, max_new_tokens=6))
    with callers_of(*forwards) as callers:
        while engine.has_work:
            engine.step()
    assert callers and set(callers) == {"launch_step"}, callers


@pytest.mark.parametrize("mode", ["greedy", "sampling", "penalty"])
def test_a_batch_verifies_through_the_one_step(mode):
    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[PAD, PAD, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3]])
    kw = dict(attention_mask=(ids != PAD).long(), pad_token_id=PAD, max_new_tokens=8, eos_token_id=None,
              do_sample=mode == "sampling", top_k=6 if mode == "sampling" else None,
              repetition_penalty=1.3 if mode == "penalty" else None)
    with calls_of(step.verify_batch) as calls:
        got = model.generate(ids, custom_generate=H.speculative_generate,
                             assistant_config=H.AssistantConfig(compile=False), **kw)
    assert calls
    if mode != "sampling":
        assert torch.equal(got, model.generate(ids, **kw))


def test_the_serving_engine_verifies_through_the_one_step():
    model = tiny_model("qwen3_5_text", vocab_size=V)
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=2),
                           GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD))
    for i, prompt in enumerate([[2, 5, 3, 2, 5, 3, 2], [4, 6, 4, 6, 4]]):
        engine.add(ServingRequest(f"r{i}", prompt, max_new_tokens=6))
    with calls_of(step.verify_batch) as calls:
        while engine.has_work:
            engine.step()
    assert calls


class Raises(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise RuntimeError("this row's processor")


def test_a_row_whose_processors_raise_fails_alone_where_the_caller_asks():
    """`on_error`: the one pass raises (row None), then row by row only the raising row fails (its root only);
    without it the error propagates."""
    draft = DraftTree(tokens=torch.tensor([[3, 4]]), parents=torch.tensor([[-1, 0]]))
    drafts = DraftBatch.from_drafts([draft, draft])
    tree = step.batch_tree([2, 2], drafts, torch.device("cpu"))
    logits = torch.randn(2, 3, V)
    ids = [torch.tensor([[5, 2]]), torch.tensor([[6, 2]])]
    rows = step.StepRows(ids, ExactVerifier(False), [None, LogitsProcessorList([Raises()])])
    blamed = []
    results = step.verify_batch(tree, drafts, logits, rows, on_error=lambda row, error: blamed.append(row))
    assert blamed == [None, 1]
    alone = step.verify_batch(tree, drafts, logits, step.StepRows(ids[:1], ExactVerifier(False), [None]))
    alone_drafts = DraftBatch.from_drafts([draft])
    assert results[0].token_list == step.greedy_rows(alone_drafts, logits[:1].argmax(-1))[0].token_list
    assert results[0].token_list == alone[0].token_list
    assert results[1].path == [0] and results[1].token_list == []
    with pytest.raises(RuntimeError, match="this row's processor"):
        step.verify_batch(tree, drafts, logits, rows)


def test_one_request_that_keeps_its_scores_verifies_through_the_one_step():
    """A single request whose call keeps each step's scores (the general verification) takes the batch step's
    verification as a batch of one: plain generate's tokens and scores."""
    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5, 3, 7, 2]])
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True,
              output_scores=True, repetition_penalty=1.2)
    with calls_of(step.verify_batch) as calls:
        got = model.generate(ids, custom_generate=H.speculative_generate,
                             assistant_config=H.AssistantConfig(compile=False), **kw)
    assert calls
    expected = model.generate(ids, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    for ours, stock in zip(got.scores, expected.scores):
        torch.testing.assert_close(ours, stock)


def test_every_static_caller_verifies_on_the_one_runner():
    """One request, a batch and the serving engine reach the verify forward through the same runner class
    (`static.StaticRunner`: a request is a runner of one row), with plain generate's tokens."""
    from hf_hybrid_spec.engine.static import StaticRunner

    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[PAD, PAD, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3]])
    kw = dict(pad_token_id=PAD, max_new_tokens=8, eos_token_id=None, do_sample=False)
    config = H.AssistantConfig(compile=True)
    for batch in (ids[1:], ids):
        mask = (batch != PAD).long()
        with calls_of(StaticRunner._launch) as calls:
            got = model.generate(batch, attention_mask=mask, custom_generate=H.speculative_generate,
                                 assistant_config=config, **kw)
        assert calls and torch.equal(got, model.generate(batch, attention_mask=mask, **kw))
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False), ServingConfig(max_slots=2),
                           GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD))
    engine.add(ServingRequest("r0", [2, 5, 3, 2, 5, 3, 2], max_new_tokens=6))
    with calls_of(StaticRunner._launch) as calls:
        while engine.has_work:
            engine.step()
    assert calls


def test_the_serving_engine_budgets_with_the_steps_cost_model():
    """`batch_budget="calibrated"`: the serving engine times its verify forward once (`step.step_cost`) and budgets
    with it; the answers stay plain generate's."""
    model = tiny_model("qwen3_5_text", vocab_size=V)
    engine = ServingEngine(model, H.AssistantConfig(global_cache=False, batch_budget="calibrated"),
                           ServingConfig(max_slots=2),
                           GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD))
    prompts = [[2, 5, 3, 2, 5, 3, 2], [4, 6, 4, 6, 4]]
    for i, prompt in enumerate(prompts):
        engine.add(ServingRequest(f"r{i}", prompt, max_new_tokens=6))
    outputs = {}
    while engine.has_work:
        for output in engine.step():
            outputs[output.request_id] = output
    assert engine._cost is not None and engine._cost.widths
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=PAD)
        assert outputs[f"r{i}"].generated_tokens == plain[0, len(prompt):].tolist()


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_path_that_is_not_one_is_refused_and_the_backend_goes_on(static):
    """A rule that returns a path off the tree (a custom verification) gets a clear error from either backend's
    commit, nothing committed and the cache out of tree mode; the next step commits as a fresh backend's would."""
    from hf_hybrid_spec.engine import BatchEagerBackend, BatchStaticBackend
    from hf_hybrid_spec.tree import VerifyResult

    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[2, 5, 3, 7, 2]])
    draft = DraftBatch.from_drafts([DraftTree(tokens=torch.tensor([[5, 3]]), parents=torch.tensor([[-1, 0]]))])
    rows = step.StepRows([ids], ExactVerifier(False), [None], raw_greedy=True)

    def backend():
        made = BatchStaticBackend(model, 1, 64, (8,), None) if static else BatchEagerBackend(model, ())
        made.prefill(ids, torch.ones_like(ids), torch.arange(5)[None])
        return made

    def good_step(made):
        """One step committed as the rule finds it, then the next tree's logits (a copy: a runner's are its own)."""
        done = step.finish_step(made, step.launch_step(made, draft, [2]), step.rows_verifier(rows)).results[0]
        after = made.forward(step.batch_tree([done.token_list[-1]], draft, made.tree_device)).logits.clone()
        made.abort()
        made.release()
        return done.path, list(made.valid), after

    tried = backend()
    for bad in ([0, 2, 1], [1, 2], [0, 5]):
        launched = step.launch_step(tried, draft, [2])
        with pytest.raises(ValueError, match="path must start at the root"):
            step.finish_step(tried, launched, lambda s: [VerifyResult(path=bad, tokens=torch.zeros(0),
                                                                      score_nodes=[], token_list=[])])
        assert tried.cache.tree is None and tried.valid == [5]
    path, valid, after = good_step(tried)
    fresh_path, fresh_valid, fresh_after = good_step(backend())
    assert path == fresh_path and valid == fresh_valid
    torch.testing.assert_close(after, fresh_after)
