"""Replicas of the serving engine on Ray Serve behind one OpenAI endpoint, with session affinity (the `[cluster]`
extra: `ray[serve]`).

    hf-hybrid-spec-serve --model Qwen/Qwen3.5-0.8B --replicas 4            # one replica per GPU of this machine
    RAY_ADDRESS=ray://head:10001 hf-hybrid-spec-serve --model ... --replicas 8   # or on a Ray cluster

    from hf_hybrid_spec.serving.cluster import serve_cluster
    url = serve_cluster("Qwen/Qwen3.5-0.8B", {"drafter": "suffix"}, replicas=2)   # http://127.0.0.1:8000

Two deployments: `EngineReplica` (one continuous-batching engine each, `num_gpus=1` where the cluster has GPUs) and
`OpenAIIngress` (the server of `serving.server`, the same endpoints and answers as `hf-hybrid-spec-serve`, over an
engine client that sends each tokenized request to a replica). Which replica: Ray Serve's request-router interface,
with `AffinityRouter`: a request that extends a prompt a replica served (an agent's next call), or that carries a
session key seen before (`user`, `session_id`), goes to that replica while it has room (fewer requests than
`max_ongoing_requests`, the engine's slots by default), where the prefix store holds its committed state; any other
goes to the least loaded replica. `routing="round_robin"` / `"power_of_two"` (Ray Serve's default) for comparison.

A replica that fails is replaced by Ray Serve (its health check is the engine's); a request it held is sent once more
to another replica when nothing of it was streamed yet, else it ends with an error naming the failure. The ingress
replicas each route with their own map: with several, a session's calls meet its replica when they pass the same
ingress (one ingress replica, the default, serves thousands of requests per second; the engines are the bottleneck).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus

from .affinity import PrefixAffinity
from .clients import LocalEngine, OnOutput, sampling_defaults
from .engine import ServingConfig, SpecGenerationOutput
from .manager import ContinuousBatchingManager
from .server import DEFAULT_MAX_BODY_BYTES, create_app, load_served

logger = logging.getLogger(__name__)

__all__ = ["serve_cluster", "build_app", "ReplicaSpec", "AffinityRouter", "RoundRobinRouter", "RemoteEngine",
           "ROUTERS"]

APP_NAME = "hf_hybrid_spec"
# Requests the ingress replica holds at once (each an open HTTP request waiting on a replica).
INGRESS_MAX_ONGOING = 4096


# ---------------------------------------------------------------------- routing
def _payload(pending: PendingRequest | None) -> dict | None:
    """The request's payload (`RemoteEngine`'s call: `generate(payload)`), or None for another call."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return None
    return pending.args[0]


class AffinityRouter(RequestRouter):
    """Ray Serve request router: a request goes to the replica that holds its prefix or session
    (`affinity.PrefixAffinity`) while it has room, else to the least loaded one (Ray Serve takes the first rank
    with a replica under its `max_ongoing_requests`, the least loaded within a rank). Not FIFO (`FIFOMixin`): a
    replica found for one request goes to that request, never to an older one queued beside it, whose prefix may be
    elsewhere."""

    def initialize_state(self, block: int = 16, max_keys: int = 1 << 18, **kwargs):
        self.affinity = PrefixAffinity(block, max_keys)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        payload = _payload(pending_request)
        if payload is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        replica, _ = self.affinity.lookup(payload["ids"], payload.get("session"), by_id)
        if replica is None:
            return [candidate_replicas]
        return [[by_id[replica]], [r for r in candidate_replicas if r.replica_id.unique_id != replica]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        payload = _payload(pending_request)
        if payload is not None:
            self.affinity.record(payload["ids"], replica_id.unique_id, payload.get("session"))

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: the replicas in turn (the next one with room), blind to prefixes and load."""

    def initialize_state(self, **kwargs):
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        start = self.turn % len(ordered)
        self.turn += 1
        return [[r] for r in ordered[start:] + ordered[:start]]


# The `routing` names: a router class (None: Ray Serve's default, power of two choices).
ROUTERS = {"affinity": AffinityRouter, "round_robin": RoundRobinRouter, "power_of_two": None}


# ---------------------------------------------------------------------- the deployments
@dataclass
class ReplicaSpec:
    """What every replica loads (`server.load_served`) and how it serves (`ServingConfig`). `threads`: torch's
    intra-op threads in the replica (None: torch's default; a CPU replica given one core wants 1)."""

    model: str
    assistant_config: str | dict | None = None
    serving: ServingConfig = field(default_factory=ServingConfig)
    dtype: str = "auto"
    device: str = "auto"
    draft_model: str | None = None
    threads: int | None = None


class EngineReplica:
    """One continuous-batching engine (`ContinuousBatchingManager` on its thread) as a Ray Serve replica."""

    def __init__(self, spec: ReplicaSpec):
        import torch

        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        model, tokenizer, draft, config = load_served(spec.model, spec.assistant_config, spec.dtype, spec.device,
                                                      spec.draft_model)
        self.client = LocalEngine(ContinuousBatchingManager(model, config, spec.serving, draft_model=draft),
                                  tokenizer)
        self.client.start()
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def generate(self, payload: dict):
        """The request's outputs (`SpecGenerationOutput`, `replica` set): every step's when `payload["streaming"]`,
        else the last. A caller that goes away cancels the request (its slot is freed)."""
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        rid = self.client.submit(payload["ids"], payload["max_new_tokens"], payload["generation_config"],
                                 payload["stop"], payload["streaming"],
                                 lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.is_finished()
                output.replica = self.replica
                yield output
        finally:
            if not finished:
                self.client.cancel(rid)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is replaced."""
        problem = self.client.health()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self):
        client = getattr(self, "client", None)
        if client is not None:
            client.manager.stop(block=False)


class RemoteEngine:
    """The engine client (`clients.EngineClient`) of the ingress: each request a streaming call of a replica's
    `generate`, routed by the deployment's request router. A replica that dies before anything of a request was
    delivered gets the request sent once more (to another replica); after, the request fails naming the failure."""

    def __init__(self, replicas, eos_token_id, max_total_tokens: int, defaults: dict | None = None):
        self.replicas = replicas.options(stream=True, method_name="generate")
        self.eos_token_id, self.max_total_tokens = eos_token_id, max_total_tokens
        self.sampling_defaults = dict(defaults or {})
        self.tasks: dict[str, asyncio.Task] = {}
        self.counts = {"finished": 0, "failed": 0, "retried": 0, "tokens": 0}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()

    def submit(self, ids: list[int], max_new_tokens: int, generation_config: GenerationConfig, stop: list[str],
               streaming: bool, on_output: OnOutput, session: str | None = None) -> str:
        rid = f"req-{uuid.uuid4().hex}"
        payload = {"ids": list(ids), "max_new_tokens": max_new_tokens, "generation_config": generation_config,
                   "stop": stop, "streaming": streaming, "session": session}
        task = asyncio.get_running_loop().create_task(self._run(rid, payload, on_output))
        self.tasks[rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(rid, None))
        return rid

    async def _run(self, rid: str, payload: dict, on_output: OnOutput) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError

        for attempt in range(2):
            delivered = False
            try:
                async for output in self.replicas.remote(payload):
                    output.request_id = rid
                    if output.is_finished():
                        failed = output.status == RequestStatus.FAILED
                        self.counts["failed" if failed else "finished"] += 1
                        self.counts["tokens"] += len(output.generated_tokens)
                    delivered = True
                    on_output(output)
                return
            except (RayActorError, ActorUnavailableError) as error:
                if not delivered and attempt == 0:
                    self.counts["retried"] += 1
                    logger.warning("cluster: the replica of %s failed before answering (%s): sent again", rid,
                                   type(error).__name__)
                    continue
                reason = f"the replica serving this request failed: {type(error).__name__}"
            except Exception as error:  # noqa: BLE001  (the request fails, the ingress goes on)
                reason = f"the request failed on its replica: {error}"
            self.counts["failed"] += 1
            on_output(SpecGenerationOutput(request_id=rid, prompt_ids=payload["ids"], status=RequestStatus.FAILED,
                                           error=reason))
            return

    def cancel(self, request_id: str) -> None:
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()  # the replica's generator is cancelled with it: its request leaves the engine

    def health(self) -> str | None:
        return None

    def metrics(self) -> list[tuple[str, str, float]]:
        return [("requests_running", "gauge", len(self.tasks)),
                ("requests_finished_total", "counter", self.counts["finished"]),
                ("requests_failed_total", "counter", self.counts["failed"]),
                ("requests_retried_total", "counter", self.counts["retried"]),
                ("generated_tokens_total", "counter", self.counts["tokens"])]


@serve.ingress()
class OpenAIIngress:
    """The OpenAI server (`serving.server.create_app`) over `RemoteEngine`."""

    def __init__(self, replicas, model: str, model_name: str, eos_token_id, max_total_tokens: int,
                 api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 defaults: dict | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        if eos_token_id is None:
            eos_token_id = self.tokenizer.eos_token_id
        self.client = RemoteEngine(replicas, eos_token_id, max_total_tokens, defaults)
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes

    def __serve_build_asgi_app__(self):
        return create_app(self.client, self.tokenizer, self.model_name, api_key=self.api_key,
                          max_body_bytes=self.max_body_bytes)


def build_app(spec: ReplicaSpec, replicas: int = 1, routing: str = "affinity", served_model_name: str | None = None,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              replica_gpus: float = 0.0, replica_cpus: float = 1.0, autoscaling: dict | None = None,
              max_ongoing_requests: int | None = None, model_defaults: bool = True):
    """The Ray Serve application (bound deployments) serving `spec` on `replicas` replicas (or `autoscaling`, Ray
    Serve's `autoscaling_config`), each with `replica_gpus` GPUs and `replica_cpus` cores. A replica takes up to
    `max_ongoing_requests` requests at once (default: the engine's slots), the room affinity routing respects."""
    if routing not in ROUTERS:
        raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {routing!r}")
    if replicas < 1 and autoscaling is None:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    generation_config = _generation_config(spec.model)
    eos = generation_config.eos_token_id
    router = ROUTERS[routing]
    options = {"ray_actor_options": {"num_gpus": replica_gpus, "num_cpus": replica_cpus},
               "max_ongoing_requests": max_ongoing_requests or spec.serving.max_slots,
               "health_check_period_s": 5.0}
    if replica_cpus and spec.threads is None and not replica_gpus:  # a CPU replica: torch on the cores it was given
        spec = dataclasses.replace(spec, threads=max(1, int(replica_cpus)))
    if router is not None:
        options["request_router_config"] = RequestRouterConfig(request_router_class=router)
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(**options).bind(spec)
    # The ingress holds every request until its answer (Ray Serve's default of 5 at once would queue the rest at the
    # proxy, out of the router's sight); the replicas' `max_ongoing_requests` is the bound that matters.
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=INGRESS_MAX_ONGOING)
    return ingress.bind(engine, spec.model, served_model_name or spec.model, eos, spec.serving.max_total_tokens,
                        api_key, max_body_bytes, sampling_defaults(generation_config) if model_defaults else {})


def _generation_config(model: str) -> GenerationConfig:
    """The generation config the replicas' engines decode with (`model.generation_config` as transformers loads
    it: generation_config.json where the checkpoint has one, else made from its config), read without weights."""
    try:
        return GenerationConfig.from_pretrained(model)
    except OSError:
        from transformers import AutoConfig

        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model))


def serve_cluster(model_id: str, assistant_config: str | dict | None = None,
                  serving_config: ServingConfig | None = None, replicas: int = 1, autoscaling: dict | None = None,
                  routing: str = "affinity", host: str = "127.0.0.1", port: int = 8000,
                  served_model_name: str | None = None, api_key: str | None = None,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, dtype: str = "auto", device: str = "auto",
                  draft_model: str | None = None, replica_gpus: float | None = None, replica_cpus: float = 1.0,
                  threads: int | None = None, address: str | None = None, blocking: bool = False,
                  model_defaults: bool = True) -> str:
    """Serve `model_id` on Ray Serve (see the module docstring) and return the endpoint's base URL. Joins the Ray
    cluster at `address` (or RAY_ADDRESS; else starts a local one) unless Ray is already initialized.
    `replica_gpus`: default 1 where the cluster has GPUs, else 0 (CPU replicas). `blocking`: serve until
    interrupted (the CLI), then shut the application down. `model_defaults`: as `server.create_app`'s."""
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                 log_to_driver=False)
    if replica_gpus is None:
        replica_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    # "auto" resolves in each replica: cuda where it was given a GPU.
    spec = ReplicaSpec(model_id, assistant_config, serving_config or ServingConfig(), dtype, device, draft_model,
                       threads)
    app = build_app(spec, replicas, routing, served_model_name, api_key, max_body_bytes, replica_gpus,
                    replica_cpus, autoscaling, model_defaults=model_defaults)
    host, port = _start_serve(host, port)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{host}:{port}"
    logger.info("serving %s on %d replica(s) at %s (routing: %s)", model_id, replicas, url, routing)
    if blocking:
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            shutdown()
    return url


def _start_serve(host: str, port: int) -> tuple[str, int]:
    """Start Ray Serve with its HTTP proxy on `host`:`port`, or join the Serve already running in this Ray cluster,
    whose proxy keeps the address it started with (Ray applies HTTP options only when Serve starts: a second call in
    one process with another port would otherwise return a URL nothing listens on). Returns the proxy's address."""
    serve.start(http_options={"host": host, "port": port})
    try:  # the running Serve's HTTP options: a private attribute (where a Ray release moves it, the address asked for)
        from ray.serve.context import _get_global_client

        config = _get_global_client().http_config
        running = (str(config.host), int(config.port))
    except Exception:  # noqa: BLE001
        return host, port
    if running != (host, port):
        logger.warning("Ray Serve already runs in this cluster with its proxy on %s:%d; serving there, not on %s:%d "
                       "(Ray applies HTTP options only when Serve starts: shut it down first to move it)",
                       *running, host, port)
    return running


def shutdown() -> None:
    """Take the application down (its replicas and their engines) and Ray Serve with it."""
    serve.shutdown()
