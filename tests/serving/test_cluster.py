"""Replicas on Ray Serve (`hf_hybrid_spec.serving.cluster`): two CPU replicas of a tiny model behind the OpenAI
endpoint, on a local Ray instance this module starts and stops. Greedy answers are plain `generate`'s; an agent
session's follow-ups land on the replica that holds its prefix (by prompt prefix, or by the `user` key) under
concurrent load; a replica killed mid-load loses no request (those it held go to the other one once) and the other
keeps serving. The routing map itself (`serving.affinity`): tests/serving/test_affinity.py, without Ray."""

import json
import socket
import threading
import time
import urllib.request

import pytest
import torch
from helpers import tiny_target_with_tokenizer


# ---------------------------------------------------------------------- two replicas on a local Ray instance
ray = pytest.importorskip("ray", reason="the [cluster] extra (ray[serve]) is not installed")
pytest.importorskip("ray.serve", reason="the [cluster] extra (ray[serve]) is not installed")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a local Ray instance and two replicas: about a minute


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(client, url, model): two CPU replicas (one core, 6 slots each) of a tiny target, affinity routing. Six
    slots: one replica has room for every session of the affinity test at once, so no follow-up finds its replica
    full (where it would rightly go to the other)."""
    from transformers import AutoModelForCausalLM

    from hf_hybrid_spec.serving import ServingConfig
    from hf_hybrid_spec.serving.cluster import serve_cluster, shutdown

    path = str(tmp_path_factory.mktemp("cluster"))
    tiny_target_with_tokenizer(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        url = serve_cluster(path, {"drafter": "suffix", "global_cache": False},
                            ServingConfig(max_slots=6, max_total_tokens=512), replicas=2, port=port,
                            dtype="float32", device="cpu", replica_cpus=1)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, url, model
    finally:
        shutdown()
        ray.shutdown()


def plain(model, ids: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def complete(client, ids: list[int], new: int, **extra):
    return client.completions.create(model=None, prompt=ids, max_tokens=new, temperature=0,
                                     extra_body={"return_token_ids": True, **extra})


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        lines = answer.read().decode().splitlines()
    return {line.split()[0].removeprefix("hf_hybrid_spec_"): float(line.split()[1]) for line in lines
            if line and not line.startswith("#")}


PROMPTS = [[(7 * i + 3 * j) % 300 + 2 for j in range(n)] for i, n in enumerate((9, 23, 40, 61))]


def test_greedy_answers_are_plain_generate(cluster):
    client, _, model = cluster
    answers = {}

    def ask(i):
        answers[i] = complete(client, PROMPTS[i], 16)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in enumerate(PROMPTS):
        assert answers[i].choices[0].token_ids == plain(model, ids, 16)
        assert answers[i].choices[0].prompt_token_ids == ids
    # the chat and streaming endpoints answer through the replicas too
    stream = client.completions.create(model=None, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    streamed = [t for chunk in stream for t in (chunk.choices[0].token_ids or [] if chunk.choices else [])]
    assert streamed == plain(model, PROMPTS[1], 16)


def test_follow_ups_land_on_the_replica_holding_their_prefix(cluster):
    """Six agent sessions at once, three calls each, every follow-up extending the last prompt and reply token for
    token (three keyed by the prompt alone, three also by `user`): every call of a session is served by the
    replica of its first, which reuses the prefix, and the answers are plain generate's."""
    client, _, model = cluster
    seen: dict[int, list] = {s: [] for s in range(6)}
    errors = []

    def session(s: int):
        try:
            ids = [(11 * s + 5 * j) % 290 + 3 for j in range(48)]
            for call in range(3):
                extra = {"user": f"agent-{s}"} if s % 2 else {}
                reply = complete(client, ids, 12, **extra)
                seen[s].append((reply.system_fingerprint, reply.usage.prompt_tokens_details.cached_tokens,
                                ids, reply.choices[0].token_ids))
                ids = ids + reply.choices[0].token_ids + [(s + call + k) % 200 + 20 for k in range(17)]
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=session, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s, calls in seen.items():
        replicas = {replica for replica, _, _, _ in calls}
        assert len(replicas) == 1, f"session {s} moved between replicas: {[c[0] for c in calls]}"
        assert all(cached > 0 for _, cached, _, _ in calls[1:]), [c[1] for c in calls]
    for s in (0, 3):
        for _, _, ids, new in seen[s]:
            assert new == plain(model, ids, 12)


def test_a_replica_killed_mid_load_loses_no_request(cluster):
    """Twelve requests in flight (long enough to be caught there), then one replica's actor is killed: every request
    is answered with plain generate's tokens (those it held sent once more, to the other replica), the cluster keeps
    serving, and Ray Serve starts a replica in place of the dead one."""
    client, url, model = cluster
    NEW = 256
    prompts = [[(13 * i + j) % 280 + 4 for j in range(20 + 3 * i)] for i in range(12)]
    answers, errors = {}, []
    before = metrics(url)

    def ask(i):
        try:
            answers[i] = complete(client, prompts[i], NEW)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while metrics(url)["requests_running"] < 6 and time.time() < deadline:
        pass
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
    assert len(names) == 2, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i, ids in enumerate(prompts):
        assert answers[i].choices[0].token_ids == plain(model, ids, NEW)
    after = metrics(url)
    assert after["requests_retried_total"] > before["requests_retried_total"]  # the kill hit requests in flight
    assert after["requests_failed_total"] == before["requests_failed_total"]
    # the survivor (and then the replacement) serves what comes next
    for ids in PROMPTS[:2]:
        assert complete(client, ids, 8).choices[0].token_ids == plain(model, ids, 8)
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        assert answer.status == 200 and json.loads(answer.read()) == {"status": "ok"}
    # Ray Serve replaces the dead replica
    deadline, alive = time.time() + 120, []
    while time.time() < deadline:
        alive = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
        if len(alive) == 2 and names[0] not in alive:
            break
        time.sleep(0.5)
    assert len(alive) == 2 and names[0] not in alive, alive


def test_the_url_is_where_serve_listens(cluster, monkeypatch):
    """`serve_cluster`'s URL is the running Serve proxy's address: Ray applies HTTP options only when Serve starts,
    so a second call with another port joins the proxy that runs (and says so) instead of returning a dead URL."""
    from types import SimpleNamespace

    from ray.serve.context import _get_global_client

    from hf_hybrid_spec.serving import cluster as C

    _, url, _ = cluster
    config = _get_global_client().http_config  # the attribute `_start_serve` reads, on this Ray
    assert f"http://{config.host}:{config.port}" == url
    started = []
    monkeypatch.setattr(C.serve, "start", lambda http_options: started.append(http_options))
    assert C._start_serve(config.host, config.port + 1) == (config.host, config.port)
    assert started == [{"host": config.host, "port": config.port + 1}]
    monkeypatch.setattr("ray.serve.context._get_global_client", lambda: SimpleNamespace(http_config=None))
    assert C._start_serve("127.0.0.1", 9) == ("127.0.0.1", 9)  # where Ray moves the attribute: the address asked for
