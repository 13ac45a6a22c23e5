"""The OpenAI-compatible server (`hf_hybrid_spec.serving.server`): the real `openai` client against localhost gets the
text plain `generate` gives, streaming and not, for completions and chat; bad requests get a 400 naming the
problem; the CLI has --help."""

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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, model, tokenizer, manager): a tiny target and tokenizer served on a free localhost port."""
    import uvicorn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("served")
    tiny_target_with_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=2, max_total_tokens=256))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(manager, tokenizer, "tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, model, tokenizer, manager
    server.should_exit = True
    thread.join(30)
    assert not manager.is_running()  # the app's lifespan stopped the manager


def plain_text(model, tokenizer, ids, max_new_tokens):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


PROMPTS = ["def parse(path):\n    with open(path) as f:\n", "import json\n\nclass Encoder:\n"]


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


def test_bad_requests_get_a_400_naming_the_problem(served):
    client, _, _, _ = served
    cases = [dict(model="tiny", prompt="x", max_tokens=4, n=2),
             dict(model="tiny", prompt="x", max_tokens=4, logprobs=2),
             dict(model="other", prompt="x", max_tokens=4),
             dict(model="tiny", prompt="x" * 10, max_tokens=1000)]
    for case, word in zip(cases, ["n > 1", "logprobs", "not served", "max_total_tokens"]):
        with pytest.raises(openai.BadRequestError, match=word):
            client.completions.create(**case)
    # The server still answers afterwards.
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).usage.total_tokens > 0
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "hf_hybrid_spec.serving.server", "--help"], capture_output=True,
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
