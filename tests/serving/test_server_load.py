"""The server under a bounded load on 127.0.0.1 (the `openai` client, 200 requests at 32 concurrent): streams, stop
sequences, cancellations mid-stream, sampling, malformed bodies, and one request in 20 whose drafter fails. Every
well-formed request is answered, greedy answers are plain `generate`'s, nothing is lost or left behind, and the engine
serves on afterwards."""

import concurrent.futures
import random

import pytest
from test_server import PROMPTS, plain_text, post, serving, target  # noqa: F401  (target: a fixture)

openai = pytest.importorskip("openai")

import hf_hybrid_spec as H  # noqa: E402
import hf_hybrid_spec.serving.engine as engine_module  # noqa: E402
from hf_hybrid_spec.serving import ServingConfig, init_continuous_batching  # noqa: E402

REQUESTS, CONCURRENT, NEW = 200, 32, 12
# A prompt that starts with this text gets a drafter that fails at its first proposal (the injected fault).
FAULT = "# fault\n"


@pytest.mark.slow
def test_200_requests_at_32_concurrent_lose_nothing(target, monkeypatch):
    model, tokenizer = target
    fault_ids = tokenizer(FAULT).input_ids
    real = engine_module.make_drafter

    class Router(H.SuffixDrafter):
        """The suffix drafter, unless the request's prompt starts with the fault marker."""

        def __init__(self):
            super().__init__(use_global=False)
            self.faulty = False

        def begin(self, input_ids, context=None, hidden=None):
            self.faulty = input_ids[0, : len(fault_ids)].tolist() == fault_ids
            return super().begin(input_ids, context, hidden)

        def propose(self, input_ids, budget):
            if self.faulty:
                raise RuntimeError("injected drafter fault")
            return super().propose(input_ids, budget)

    monkeypatch.setattr(engine_module, "make_drafter", lambda config, target, draft_model=None: Router())
    references = {p: plain_text(model, tokenizer, tokenizer(p).input_ids, NEW)[0] for p in PROMPTS}
    manager = init_continuous_batching(model, H.AssistantConfig(global_cache=False),
                                       ServingConfig(max_slots=16, max_total_tokens=128))
    rng = random.Random(0)
    kinds = [rng.choice(["greedy"] * 6 + ["stream"] * 3 + ["stop", "sample", "cancel", "malformed"])
             for _ in range(REQUESTS)]
    for i in range(0, REQUESTS, 20):  # one request in 20 fails in its drafter
        kinds[i] = "fault"
    with serving(manager, tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

        def run(i: int):
            kind, prompt = kinds[i], PROMPTS[i % len(PROMPTS)]
            kw = dict(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
            if kind == "greedy":
                return kind, client.completions.create(**kw).choices[0].text, references[prompt]
            if kind == "stream":
                text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
                return kind, text, references[prompt]
            if kind == "stop":
                stop = references[prompt][3:5] or "\n"
                expected = references[prompt][: references[prompt].find(stop)] if stop in references[prompt] \
                    else references[prompt]
                return kind, client.completions.create(stop=[stop], **kw).choices[0].text, expected
            if kind == "sample":
                out = client.completions.create(**{**kw, "temperature": 0.8, "top_p": 0.9})
                return kind, out.usage.completion_tokens >= 1, True
            if kind == "cancel":
                stream = client.completions.create(stream=True, **{**kw, "max_tokens": 60})
                first = next(iter(stream)).choices[0].text
                stream.close()
                return kind, references[prompt].startswith(first), True
            if kind == "malformed":
                status, answer = post(url, "/v1/completions", {**kw, "max_tokens": "many"})
                return kind, (status, "max_tokens" in answer["error"]["message"]), (400, True)
            try:
                client.completions.create(**{**kw, "prompt": FAULT + prompt})
            except openai.BadRequestError as err:
                return kind, "injected drafter fault" in str(err), True
            return kind, "answered without its fault", True

        with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
            results = list(pool.map(run, range(REQUESTS)))
        wrong = [(i, kind, got, want) for i, (kind, got, want) in enumerate(results) if got != want]
        assert not wrong, wrong[:5]
        assert sum(kind == "greedy" for kind, _, _ in results) > 50
        # The engine serves on, and holds nothing of the load: no running or waiting request, no unclaimed result,
        # stream, listener or abandoned id (the manager's per-request state is back to empty).
        after = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
        assert after.choices[0].text == references[PROMPTS[0]]
        assert manager.engine.running == 0 and manager.engine.waiting == 0
        assert not manager._finished and not manager._streams and not manager._listeners
        assert not manager._abandoned
        assert manager.engine.stats.failed >= REQUESTS // 20
