"""The OpenAI-compatible server (`hf_hybrid_spec.serving.server`): the real `openai` client against localhost gets the
text plain `generate` gives, streaming and not, for completions and chat; bad requests get a 400 naming the
problem; the CLI has --help."""

import contextlib
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import tiny_target_with_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import hf_hybrid_spec as H  # noqa: E402
from hf_hybrid_spec.serving import ServingConfig, init_continuous_batching  # noqa: E402
from hf_hybrid_spec.serving.server import create_app  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@contextlib.contextmanager
def serving(manager, tokenizer, **app_kwargs):
    """The app on a free localhost port, in a thread: yields its base URL; stopped (and the manager with it) after."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(manager, tokenizer, "tiny", **app_kwargs), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
    assert not manager.is_running()  # the app's lifespan stopped the manager


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("served")
    tiny_target_with_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


@pytest.fixture(scope="module")
def served(target):
    """(client, model, tokenizer, manager): a tiny target and tokenizer served on a free localhost port."""
    model, tokenizer = target
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=256))
    with serving(manager, tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        client.url = url
        yield client, model, tokenizer, manager


def post(url: str, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a POST with the standard library (a body the openai client would not send)."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post_chunked(url: str, path: str, pieces: list[bytes]) -> tuple[int, dict]:
    """(status, JSON answer) of a POST whose body is sent in chunks, with no Content-Length."""
    import http.client
    import json
    import urllib.parse

    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
    try:
        connection.request("POST", path, body=iter(pieces), headers={"content-type": "application/json"},
                           encode_chunked=True)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def get(url: str, path: str, headers: dict | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers or {}), timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def plain_text(model, tokenizer, ids, max_new_tokens):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


PROMPTS = ["def parse(path):\n    with open(path) as f:\n", "import json\n\nclass Encoder:\n"]


def test_presence_and_frequency_penalties_are_applied_to_the_generated_tokens(served):
    """`presence_penalty` / `frequency_penalty` as OpenAI's API takes them: the reply is plain generate's under the
    same penalties over the generated tokens (`serving.penalties`)."""
    from transformers import LogitsProcessorList

    from hf_hybrid_spec.serving.penalties import OccurrencePenaltyLogitsProcessor

    client, model, tokenizer, _ = served
    ids = tokenizer(PROMPTS[0]).input_ids
    procs = LogitsProcessorList([OccurrencePenaltyLogitsProcessor(1.2, 0.6, len(ids))])
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         logits_processor=procs)
    expected = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                      presence_penalty=1.2, frequency_penalty=0.6)
    assert reply.choices[0].text == expected


def test_completions_match_generate(served):
    client, model, tokenizer, _ = served
    for prompt in PROMPTS:
        text, new = plain_text(model, tokenizer, tokenizer(prompt).input_ids, 20)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert out.choices[0].text == text
        assert out.usage.completion_tokens == len(new)
        assert out.choices[0].finish_reason in ("stop", "length")
        pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                                                         temperature=0, stream=True)]
        assert "".join(pieces) == text


def test_chat_completions_match_generate(served):
    client, model, tokenizer, _ = served
    messages = [{"role": "user", "content": "write a parser"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    text, _ = plain_text(model, tokenizer, list(ids), 16)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None


def test_stop_strings_are_cut(served):
    client, model, tokenizer, _ = served
    prompt = PROMPTS[0]
    text, _ = plain_text(model, tokenizer, tokenizer(prompt).input_ids, 24)
    stop = text.strip()[2:4] if len(text.strip()) >= 4 else None
    if not stop:
        pytest.skip("the tiny model's reply is too short to hold a stop string")
    expected = text[: text.find(stop)]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                                                     temperature=0, stop=[stop], stream=True)]
    assert "".join(pieces) == expected


def test_sampling_requests_run(served):
    client, _, _, _ = served
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0.7, top_p=0.9)
    assert out.usage.completion_tokens >= 1


def test_a_seed_makes_a_sampled_reply_repeat(served):
    client, _, _, _ = served

    def reply(seed):
        return client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=1.2,
                                         seed=seed, extra_body={"return_token_ids": True}).choices[0].token_ids

    first = reply(11)
    assert reply(11) == first and reply(12) != first


def test_bad_requests_get_a_400_naming_the_problem(served):
    client, _, _, _ = served
    cases = [dict(model="tiny", prompt="x", max_tokens=4, n=2),
             dict(model="tiny", prompt="x", max_tokens=4, echo=True),
             dict(model="tiny", prompt="x" * 10, max_tokens=1000)]
    for case, word in zip(cases, ["n > 1", "echo", "max_total_tokens"]):
        with pytest.raises(openai.BadRequestError, match=word):
            client.completions.create(**case)
    with pytest.raises(openai.NotFoundError, match="not served"):  # an unknown model is a 404, as OpenAI's
        client.completions.create(model="other", prompt="x", max_tokens=4)
    # The server still answers afterwards.
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).usage.total_tokens > 0
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "hf_hybrid_spec.serving.cli", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--assistant-config" in out.stdout and "--max-slots" in out.stdout


def test_a_client_that_leaves_a_stream_frees_its_slot(served):
    """Closing a stream early cancels its request: both slots are free again long before 200 tokens could come."""
    client, model, tokenizer, manager = served
    cancelled = manager.engine.stats.failed
    for _ in range(2):  # as many streams as slots, each left after its first chunk
        stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200, temperature=0,
                                           stream=True)
        next(iter(stream))
        stream.close()
    deadline = time.time() + 10
    while (manager.engine.running or manager.engine.stats.failed < cancelled + 2) and time.time() < deadline:
        time.sleep(0.05)
    assert manager.engine.running == 0 and manager.engine.stats.failed == cancelled + 2
    text, _ = plain_text(model, tokenizer, tokenizer(PROMPTS[1]).input_ids, 12)
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert out.choices[0].text == text


@pytest.mark.parametrize("field,value,words", [
    ("max_tokens", "abc", "max_tokens"), ("max_tokens", [4], "max_tokens"), ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 2.7, "max_tokens"), ("temperature", "hot", "temperature"), ("temperature", float("nan"), "finite"),
    ("temperature", 3.0, "temperature"), ("n", "two", "n"), ("stop", 5, "stop"), ("stop", ["\n", 3], "stop"),
    ("stop", {"a": 1}, "stop"), ("stop", [""], "non-empty"), ("stop", "", "non-empty"),
    ("prompt", [True, False], "prompt"),
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", "high", "frequency_penalty"),
    ("stream", "yes", "stream"), ("top_p", 0, "top_p"),
])
def test_a_bad_value_gets_a_400_naming_its_field(served, field, value, words):
    client, _, _, manager = served
    failed = manager.engine.stats.failed
    status, answer = post(client.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                          field: value})
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and words in answer["error"]["message"]
    assert manager.engine.stats.failed == failed  # refused before the engine saw it


def test_malformed_json_and_a_large_body_get_openai_errors(served):
    client, _, _, _ = served
    status, answer = post(client.url, "/v1/completions", None, raw=b'{"prompt": "x", ')
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    # The client is still sending when the server decides: it must read the 413, not a connection reset.
    for _ in range(3):
        status, answer = post(client.url, "/v1/completions", {"model": "tiny", "prompt": "x" * (2 << 20)})
        assert status == 413 and "larger than" in answer["error"]["message"]
    # A body without a Content-Length (chunked) is refused as soon as it passes the limit.
    status, answer = post_chunked(client.url, "/v1/completions", [b'{"prompt": "'] + [b"x" * 65536] * 48 + [b'"}'])
    assert status == 413 and "larger than" in answer["error"]["message"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).usage.total_tokens > 0


def test_health_models_metrics_and_openai_defaults(served):
    client, model, tokenizer, _ = served
    assert get(client.url, "/health") == (200, '{"status":"ok"}')
    assert client.models.retrieve("tiny").id == "tiny"
    assert get(client.url, "/v1/models/other")[0] == 404
    status, text = get(client.url, "/metrics")
    assert status == 200 and "hf_hybrid_spec_requests_running 0" in text and "hf_hybrid_spec_verify_steps_total" in text
    # An omitted max_tokens is OpenAI's 16 for completions.
    ids = tokenizer(PROMPTS[0]).input_ids
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], temperature=0)
    assert out.choices[0].text == plain_text(model, tokenizer, ids, 16)[0]
    # stream_options.include_usage: a last chunk with the usage and no choices.
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens or \
        chunks[-1].usage.completion_tokens <= 5
    assert all(c.id == chunks[0].id for c in chunks)


def test_an_api_key_is_required_when_set(target):
    model, tokenizer = target
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=128))
    with serving(manager, tokenizer, api_key="s3cret") as url:
        denied = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            denied.completions.create(model="tiny", prompt="x", max_tokens=2)
        allowed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert allowed.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        assert get(url, "/health")[0] == 200  # health checks carry no key


def test_a_short_request_among_long_ones_is_not_queued_behind_them(target):
    """More running requests than the server's threads: none of them holds a thread while it waits, so a short
    request is answered while the long ones still run."""
    model, tokenizer = target
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=16, max_total_tokens=256))
    with serving(manager, tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        done = []

        def long_request(i):
            # (greedy: these prompts run all 200 tokens on this model, as the stream test above relies on too)
            client.completions.create(model="tiny", prompt=PROMPTS[i % 2], max_tokens=200, temperature=0)
            done.append(i)

        threads = [threading.Thread(target=long_request, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while manager.engine.running < 12 and time.time() < deadline:
            time.sleep(0.02)
        assert manager.engine.running >= 12
        out = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens >= 1 and len(done) == 0  # answered while every long one still ran
        for t in threads:
            t.join(300)
        assert len(done) == 12


def test_cli_refuses_a_bad_model_or_config_with_a_message(tmp_path, capsys):
    from hf_hybrid_spec.serving.cli import main

    tiny_target_with_tokenizer(tmp_path / "target")
    for argv, words in ((["--model", str(tmp_path / "missing")], "missing"),
                        (["--model", str(tmp_path / "target"), "--assistant-config", '{"drafter": "eagle"}'],
                         "eagle"),
                        (["--model", str(tmp_path / "target"), "--assistant-config", "{not json"], "JSON")):
        with pytest.raises(SystemExit) as exit:
            main(argv + ["--device", "cpu"])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and words in err and "Traceback" not in err


def test_token_ids_and_cached_tokens(served):
    """vLLM's `return_token_ids`: the reply's token ids (plain generate's) and the prompt's, streamed chunk by chunk
    too; a follow-up that extends the call token for token reports the prompt tokens taken from the prefix store
    (`usage.prompt_tokens_details.cached_tokens`); `user` is taken (a cluster's session key)."""
    client, model, tokenizer, _ = served
    ids = tokenizer(PROMPTS[1]).input_ids
    _, expected = plain_text(model, tokenizer, ids, 12)
    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, user="agent-1",
                                      extra_body={"return_token_ids": True})
    assert reply.choices[0].token_ids == expected and reply.choices[0].prompt_token_ids == ids
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert [t for c in chunks for t in (c.token_ids or [])] == expected
    assert chunks[0].prompt_token_ids == ids and all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    follow = ids + expected + tokenizer("\n    return").input_ids
    again = client.completions.create(model="tiny", prompt=follow, max_tokens=4, temperature=0, user="agent-1")
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert not hasattr(again.choices[0], "token_ids") or again.choices[0].token_ids is None


def test_vllm_sampling_extensions(served):
    """vLLM's sampling fields (`extra_body`): a repetition penalty at temperature 0 gives plain generate's reply under
    it; top_k=1 and min_p=1 sample the argmax only (greedy's reply); stop_token_ids end the reply at the first one
    ("stop"), also with ignore_eos, and min_tokens holds them back as plain generate's min_new_tokens does."""
    client, model, tokenizer, _ = served
    ids = tokenizer(PROMPTS[0]).input_ids

    def reply(**extra):
        temperature = extra.pop("temperature", 0)
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=temperature,
                                        extra_body={"return_token_ids": True, **extra})
        return out.choices[0].token_ids, out.choices[0].finish_reason

    def plain(**settings):
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id, **settings)
        return out[0, len(ids):].tolist()

    greedy = plain()
    assert plain(repetition_penalty=1.3) != greedy  # (the penalty changes this reply: the check below can fail)
    assert reply(repetition_penalty=1.3)[0] == plain(repetition_penalty=1.3)
    assert reply(temperature=1.0, top_k=1)[0] == greedy
    assert reply(temperature=1.0, min_p=1.0)[0] == greedy
    stop_id = greedy[2]
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    tokens, reason = reply(stop_token_ids=[stop_id])
    assert tokens == greedy[: greedy.index(stop_id) + 1] and reason == "stop"
    tokens, _ = reply(stop_token_ids=[stop_id], min_tokens=8)
    assert tokens == plain(eos_token_id=eos + [stop_id], min_new_tokens=8) and len(tokens) >= 8
    tokens, reason = reply(ignore_eos=True, stop_token_ids=[stop_id])  # (stop ids stop even with ignore_eos)
    assert tokens == greedy[: greedy.index(stop_id) + 1] and reason == "stop"


def test_ignore_eos_runs_past_the_models_eos(target):
    """A server whose eos is a token the greedy reply makes early: that reply stops there ("stop"), and with vLLM's
    `ignore_eos` runs to max_tokens ("length") as plain generate without eos does."""
    from transformers import GenerationConfig

    model, tokenizer = target
    ids = tokenizer(PROMPTS[0]).input_ids
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    greedy = out[0, len(ids):].tolist()
    eos = greedy[3]
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=256),
                                       GenerationConfig(do_sample=False, eos_token_id=eos,
                                                        pad_token_id=tokenizer.pad_token_id))
    with serving(manager, tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        for extra, expected, reason in (({}, greedy[: greedy.index(eos) + 1], "stop"),
                                        ({"ignore_eos": True}, greedy, "length")):
            answer = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                               extra_body={"return_token_ids": True, **extra})
            assert answer.choices[0].token_ids == expected and answer.choices[0].finish_reason == reason


@pytest.mark.parametrize("field,value", [("top_k", -2), ("top_k", 1.5), ("min_p", 1.5), ("repetition_penalty", 0),
                                         ("min_tokens", -1), ("min_tokens", 20), ("stop_token_ids", ["a"]),
                                         ("ignore_eos", "yes")])
def test_a_bad_vllm_sampling_value_gets_a_400_naming_its_field(served, field, value):
    client, _, _, _ = served
    status, answer = post(client.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4,
                                                          field: value})
    assert status == 400 and field in answer["error"]["message"], answer


def test_omitted_sampling_settings_come_from_the_models_generation_config(target):
    """As vLLM's `--generation-config auto`: a request that omits temperature / top_p / top_k / min_p /
    repetition_penalty gets the model generation config's value, one that sets it its own. Here the model's config
    asks for top_k=1 and a repetition penalty: an omitted temperature samples (OpenAI's 1.0) from the argmax only."""
    from transformers import GenerationConfig

    from hf_hybrid_spec.serving.clients import sampling_defaults

    model, tokenizer = target
    ids = tokenizer(PROMPTS[0]).input_ids
    config = GenerationConfig(do_sample=True, top_k=1, repetition_penalty=1.3, pad_token_id=tokenizer.pad_token_id)
    assert sampling_defaults(config) == {"top_k": 1, "repetition_penalty": 1.3}

    def plain(**settings):
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=None, **settings)
        return out[0, len(ids):].tolist()

    penalized = plain(repetition_penalty=1.3)
    assert penalized != plain()
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=256), config)
    with serving(manager, tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def reply(**fields):
            answer = client.completions.create(model="tiny", prompt=ids, max_tokens=12,
                                               extra_body={"return_token_ids": True, **fields})
            return answer.choices[0].token_ids

        assert reply() == penalized  # sampled at temperature 1 from top_k=1: the penalized argmax
        assert reply(temperature=0) == penalized  # greedy, the model's penalty still on
        assert reply(temperature=0, repetition_penalty=1.0) == plain()  # the request's own value wins
    # `--generation-config vllm`: OpenAI's defaults instead (no penalty)
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=256), config)
    with serving(manager, tokenizer, model_defaults=False) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert reply(temperature=0) == plain()


def test_logprobs_are_the_targets_raw_log_probabilities(served):
    """OpenAI's `logprobs` (completions: the count of alternatives; chat: `logprobs` / `top_logprobs`), whole and
    streamed: each generated token's log-softmax of the target's raw logits given the tokens before it (vLLM's
    default), its alternatives the likeliest there, greedy's token the likeliest; a stop string keeps only the
    tokens of the text it leaves."""
    client, model, tokenizer, _ = served
    ids = tokenizer(PROMPTS[0]).input_ids
    _, new = plain_text(model, tokenizer, ids, 8)
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1 : len(ids) - 1 + len(new)].float()
    expected = torch.log_softmax(logits, dim=-1)
    top = expected.topk(3, dim=-1)

    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=3)
    got = reply.choices[0].logprobs
    assert got.tokens == [tokenizer.decode([t]) for t in new]
    assert torch.allclose(torch.tensor(got.token_logprobs), expected.gather(1, torch.tensor(new)[:, None])[:, 0],
                          atol=1e-4)
    for k, alternatives in enumerate(got.top_logprobs):  # (a dict by text: tokens that decode alike share a key)
        assert 1 <= len(alternatives) <= 4
        assert max(alternatives.values()) == pytest.approx(float(top.values[k, 0]), abs=1e-4)
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)  # greedy's: top
    streamed = [c.choices[0] for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if c.choices]
    pieces = [item for c in streamed if c.logprobs for item in c.logprobs.content]
    assert [(p.token, round(p.logprob, 4)) for p in pieces] == [(c.token, round(c.logprob, 4)) for c in content]
    # Without asking: none. A stop string: the tokens of the text before it.
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0).choices[0].logprobs is None
    text = tokenizer.decode(new, skip_special_tokens=True)
    stop = text[len(tokenizer.decode(new[:3])):][:2]
    if stop.strip():
        cut = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                        stop=[stop]).choices[0]
        assert all(offset < len(cut.text) for offset in cut.logprobs.text_offset)
    status, answer = post(client.url, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "top_logprobs": 2,
                                                               "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "top_logprobs" in answer["error"]["message"]
