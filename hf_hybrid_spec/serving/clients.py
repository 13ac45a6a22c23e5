"""What the OpenAI server (`serving.server.create_app`) serves from: an engine client. `LocalEngine` runs the
continuous-batching manager in this process; `serving.cluster` has one that sends each request to a replica on Ray
Serve. The server parses, tokenizes, streams and shapes the answers; the client takes a tokenized request and hands
its outputs (`SpecGenerationOutput`) to a callback.

    client.submit(ids, max_new_tokens, gen, stop, streaming, on_output, session=None) -> request id
    client.cancel(request_id); client.health() -> None or why not; client.metrics() -> [(name, kind, value)]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StopStringCriteria

from .engine import SpecGenerationOutput
from .manager import ContinuousBatchingManager

__all__ = ["EngineClient", "LocalEngine", "sampling_defaults", "SAMPLING_DEFAULTS"]

# The sampling settings a model's generation config may recommend: a request that omits one gets the model's value
# (vLLM's `--generation-config auto`, its default), else OpenAI's default.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: GenerationConfig | None) -> dict:
    """The values of `SAMPLING_DEFAULTS` the model's generation config sets (those different from transformers'
    defaults, as vLLM reads them): e.g. Qwen3.5's {"temperature": 0.6, "top_k": 20, "top_p": 0.95}."""
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()
    return {k: given[k] for k in SAMPLING_DEFAULTS if given.get(k) is not None}


OnOutput = Callable[[SpecGenerationOutput], None]


class EngineClient(Protocol):
    """The engine behind a server. `eos_token_id`: the generation config's (an int, a list or None);
    `max_total_tokens`: the longest request (prompt and new tokens); `sampling_defaults`: the model's recommended
    sampling settings (`sampling_defaults`), for requests that omit them."""

    eos_token_id: int | list[int] | None
    max_total_tokens: int
    sampling_defaults: dict

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, ids: list[int], max_new_tokens: int, generation_config: GenerationConfig, stop: list[str],
               streaming: bool, on_output: OnOutput, session: str | None = None) -> str:
        """Queue a request. `on_output` gets its outputs (every step's with `streaming`, else the finished one; a
        failed request's output has status FAILED and `error`), on any thread: it must not block. `stop`: stop
        strings (the request ends at the first one generated). `session`: the caller's session key, for a client
        that routes by it (ignored here)."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def health(self) -> str | None:
        """None when requests are served, else why not."""
        ...

    def metrics(self) -> list[tuple[str, str, float]]:
        """(name, Prometheus kind, value) rows for `/metrics`."""
        ...


class LocalEngine:
    """The continuous-batching manager in this process behind the server (started and stopped by the app's
    lifespan). `tokenizer`: for the stop strings' criteria."""

    def __init__(self, manager: ContinuousBatchingManager, tokenizer):
        self.manager, self.tokenizer = manager, tokenizer
        self.eos_token_id = manager.engine.generation_config.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = tokenizer.eos_token_id
        self.max_total_tokens = manager.engine.serving.max_total_tokens
        self.sampling_defaults = sampling_defaults(manager.engine.generation_config)

    def start(self) -> None:
        self.manager.start()

    def stop(self) -> None:
        self.manager.stop(timeout=30)

    def submit(self, ids: list[int], max_new_tokens: int, generation_config: GenerationConfig, stop: list[str],
               streaming: bool, on_output: OnOutput, session: str | None = None) -> str:
        criteria = [StopStringCriteria(tokenizer=self.tokenizer, stop_strings=stop)] if stop else []
        return self.manager.add_request(ids, max_new_tokens=max_new_tokens, generation_config=generation_config,
                                        stopping_criteria=criteria, streaming=streaming, on_output=on_output)

    def cancel(self, request_id: str) -> None:
        self.manager.cancel_request(request_id)

    def health(self) -> str | None:
        if self.manager.is_running():
            return None
        return "the engine is not running" + (f": {self.manager.error!r}" if self.manager.error else "")

    def metrics(self) -> list[tuple[str, str, float]]:
        engine = self.manager.engine
        stats = engine.stats
        return [("requests_running", "gauge", engine.running),
                ("requests_waiting", "gauge", getattr(engine, "waiting", 0)),
                ("requests_finished_total", "counter", stats.finished),
                ("requests_failed_total", "counter", stats.failed),
                ("generated_tokens_total", "counter", stats.new_tokens),
                ("verify_steps_total", "counter", stats.steps),
                ("mean_accepted_length", "gauge", round(stats.new_tokens / stats.steps, 4) if stats.steps else 0.0)]
