"""The continuous-batching API in the shape of transformers' own (`generate_batch`, `init_continuous_batching` and a
manager with `start`, `add_request`, `get_result`, `request_id_iter`, `cancel_request`, `stop`), on the serving
engine (`serving.engine.ServingEngine`: tree speculation, prefix reuse).

    results = generate_batch(model, [ids_0, ids_1, ...], max_new_tokens=64)     # {request_id: output}

    manager = init_continuous_batching(model, AssistantConfig())
    manager.start()
    rid = manager.add_request(prompt_ids, max_new_tokens=64)
    output = manager.get_result(rid, timeout=60)           # transformers' GenerationOutput (+ spec_stats)
    manager.stop()

The manager runs the engine on one background thread; callers on any thread add requests and read results. Outputs
are transformers' `GenerationOutput` (`status`, `generated_tokens`, `error`, `lifespan`, `timestamps`).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from torch import nn
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.utils import logging

from ..config import AssistantConfig
from .engine import ServingConfig, ServingRequest, SpecGenerationOutput
from .lanes import make_engine

logger = logging.get_logger(__name__)

__all__ = ["ContinuousBatchingManager", "init_continuous_batching", "generate_batch", "GENERATE_BATCH_SLOTS",
           "GENERATE_BATCH_TOKENS"]

# `generate_batch`'s slots when the caller gives no ServingConfig: an offline call hands over all its prompts at
# once, and a batch decodes them together as batched `generate` would (the engine's own default, 8, is sized for a
# server's arrivals), up to GENERATE_BATCH_SLOTS and GENERATE_BATCH_TOKENS tokens of slots in all (the attention
# layers' KV is allocated for every slot's full length: long requests get fewer slots, never fewer than the
# engine's default); transformers' `generate_batch` likewise sizes its batch to the memory it finds.
GENERATE_BATCH_SLOTS = 64
GENERATE_BATCH_TOKENS = 1 << 18

_IDS = itertools.count()


class ContinuousBatchingManager:
    """Requests in, results out, the engine on a background thread (see the module docstring).

    Args: those of `ServingEngine` (`model`, `assistant_config`, `serving_config`, `generation_config`,
    `draft_model`); `serving_config.lanes` > 1 runs `ServingLanes`.
    """

    def __init__(self, model: nn.Module, assistant_config: AssistantConfig | None = None,
                 serving_config: ServingConfig | None = None, generation_config: GenerationConfig | None = None,
                 draft_model: nn.Module | None = None):
        self.engine = make_engine(model, assistant_config, serving_config, generation_config, draft_model)
        self._inbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._finished: OrderedDict[str, SpecGenerationOutput] = OrderedDict()
        self._streams: dict[str, queue.Queue] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # The loop ran and ended (stopped, or the engine failed): a request added now is answered at once.
        self._ended = False
        # Streams whose reader left before the end (a client that disconnected): their last output is dropped.
        self._abandoned: set[str] = set()
        # Requests whose outputs go to a callback (`add_request(on_output=...)`), until the finished one.
        self._listeners: dict[str, Callable[[SpecGenerationOutput], None]] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Run the loop on a background thread; after a stop or an engine failure, a new run on the same engine."""
        if self.is_running():
            return
        self._stop.clear()
        with self._cond:
            self._ended, self.error = False, None
        self._thread = threading.Thread(target=self._run, name="hf_hybrid_spec-serving", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the loop; requests still waiting or running fail with error "stopped"."""
        self._stop.set()
        self._inbox.put(None)
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ requests
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False,
                    generation_config: GenerationConfig | None = None, stopping_criteria=None,
                    on_output: Callable[[SpecGenerationOutput], None] | None = None) -> str:
        """Queue a request (see `ServingRequest`). Returns its id (`req_<n>` unless given).

        `on_output`: called on the engine's thread with each of the request's outputs (every step's with
        `streaming`, else the finished one), in place of `get_result` / `request_id_iter`; it must not block (an
        asyncio server hands the output to its loop with `call_soon_threadsafe`)."""
        request_id = f"req_{next(_IDS)}" if request_id is None else str(request_id)
        if on_output is not None:
            with self._cond:
                self._listeners[request_id] = on_output
        elif streaming:
            with self._cond:
                self._streams[request_id] = queue.Queue()
        ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise ValueError("add_request takes one prompt; use add_requests for several")
            ids = ids[0]
        request = ServingRequest(request_id, ids, max_new_tokens, generation_config, list(stopping_criteria or []),
                                 record_timestamps, streaming)
        with self._cond:
            if not self._ended:
                self._inbox.put(("add", request))
                return request_id
        self._deliver([_stopped(request, self._end_reason())])
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, generation_config: GenerationConfig | None = None) -> list[str]:
        return [self.add_request(ids, None, max_new_tokens, streaming, record_timestamps, generation_config)
                for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Cancel a waiting or running request: its slot is freed, its result FAILED with error "cancelled"."""
        self._inbox.put(("cancel", request_id))

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> SpecGenerationOutput | None:
        """The next finished (or failed) request's output, or `request_id`'s; None when none comes within `timeout`
        seconds. Streaming requests deliver through `request_id_iter` instead."""
        with self._cond:
            found = self._cond.wait_for(lambda: (request_id in self._finished) if request_id is not None
                                        else bool(self._finished), timeout)
            if not found:
                return None
            if request_id is None:
                return self._finished.popitem(last=False)[1]
            return self._finished.pop(request_id)

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[SpecGenerationOutput]:
        """A streaming request's outputs as its tokens come (each with every token so far), ending with the finished
        or failed one."""
        with self._cond:
            stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"request {request_id!r} was not added with streaming=True")
        finished = False
        try:
            while True:
                output = stream.get(timeout=timeout)
                finished = output.is_finished()
                yield output
                if finished:
                    return
        finally:
            with self._cond:
                self._streams.pop(request_id, None)
                if not finished:  # the reader left early: the request's last output has nobody to go to
                    self._abandoned.add(request_id)

    def __iter__(self) -> Iterator[SpecGenerationOutput]:
        """Finished outputs as they come, while the manager runs."""
        while self.is_running() or self._finished:
            output = self.get_result(timeout=0.1)
            if output is not None:
                yield output

    # ------------------------------------------------------------------ the loop
    def _deliver(self, outputs: list[SpecGenerationOutput]) -> None:
        with self._cond:
            for output in outputs:
                listener = self._listeners.get(output.request_id)
                if listener is not None:
                    if output.is_finished():
                        del self._listeners[output.request_id]
                    try:
                        listener(output)
                    except Exception as error:  # the caller's callback: logged, the loop goes on
                        logger.warning("serving: on_output of %s failed: %r", output.request_id, error)
                    continue
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                elif output.request_id in self._abandoned:
                    if output.is_finished():
                        self._abandoned.discard(output.request_id)
                elif output.is_finished():
                    self._finished[output.request_id] = output
            self._cond.notify_all()

    def _take(self, block: bool) -> bool:
        """Move what callers sent into the engine. Returns False once a stop was asked."""
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return not self._stop.is_set()
        while True:
            if item is None:
                return False
            kind, value = item
            if kind == "add" and self._stop.is_set():
                self._deliver([_stopped(value)])
            elif kind == "add":
                output = self.engine.add(value)
                if output.status == RequestStatus.FAILED:
                    self._deliver([output])
            else:
                cancelled = self.engine.cancel(value)
                if cancelled is not None:
                    self._deliver([cancelled])
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return not self._stop.is_set()

    def _run(self) -> None:
        try:
            while self._take(block=not self.engine.has_work):
                if self.engine.has_work:
                    self._deliver(self.engine.step())
        except BaseException as error:  # the engine itself failed: every request fails, the loop ends
            logger.error("serving loop failed: %r", error)
            self.error = error
        finally:
            with self._cond:
                self._ended = True  # from here on add_request answers at once
            reason = self._end_reason()
            self._deliver(self.engine.fail_all(reason))
            # Requests still in the inbox never reached the engine.
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[0] == "add":
                    self._deliver([_stopped(item[1], reason)])

    def _end_reason(self) -> str:
        return "stopped" if self.error is None else f"engine failed: {self.error!r}"


def _stopped(request: ServingRequest, reason: str = "stopped") -> SpecGenerationOutput:
    """The output of a request that never reached the engine: the manager stopped (or its engine failed) first."""
    return SpecGenerationOutput(request_id=request.request_id, prompt_ids=list(request.input_ids),
                                status=RequestStatus.FAILED, error=reason)


def init_continuous_batching(model: nn.Module, assistant_config: AssistantConfig | None = None,
                             serving_config: ServingConfig | None = None,
                             generation_config: GenerationConfig | None = None,
                             draft_model: nn.Module | None = None) -> ContinuousBatchingManager:
    """A `ContinuousBatchingManager` for `model` (call `start()`, or use it as a context manager)."""
    return ContinuousBatchingManager(model, assistant_config, serving_config, generation_config, draft_model)


def generate_batch(model: nn.Module, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   assistant_config: AssistantConfig | None = None, serving_config: ServingConfig | None = None,
                   max_new_tokens: int | None = None, record_timestamps: bool = False, progress_bar: bool = False,
                   draft_model: nn.Module | None = None) -> dict[str, SpecGenerationOutput]:
    """Generate for every prompt of `inputs` with continuous batching and speculation, on the calling thread.
    Returns {request id: output} (ids `req_0`, `req_1`, ... in input order), as transformers' `generate_batch`.
    Without `serving_config`, up to `GENERATE_BATCH_SLOTS` prompts decode at once (fewer for long requests: see
    `GENERATE_BATCH_TOKENS`; the rest join as slots free), each slot sized for the longest prompt and its new
    tokens. Where every prompt has a slot, the engine keeps no prefix store (no later request could read it)."""
    from tqdm.auto import tqdm

    if not inputs:
        return {}
    longest = max(len(ids) for ids in inputs)
    if serving_config is None:
        gen = generation_config or model.generation_config
        new = max_new_tokens if max_new_tokens is not None else (gen.max_new_tokens or 0)
        total = max(longest + max(new, 1), 2)
        slots = min(len(inputs), GENERATE_BATCH_SLOTS,
                    max(ServingConfig.max_slots, GENERATE_BATCH_TOKENS // total))
        serving_config = ServingConfig(max_slots=slots, max_total_tokens=total)
    if len(inputs) <= serving_config.max_slots and serving_config.lanes == 1 and serving_config.prefix_cache_bytes:
        # Every prompt joins at the first step and the engine ends with the call: a state stored as a request leaves
        # could never be read (each would cost its slot's KV and recurrent states copied out, for nothing).
        serving_config = dataclasses.replace(serving_config, prefix_cache_bytes=0)
    engine = make_engine(model, assistant_config, serving_config, generation_config, draft_model)
    results: dict[str, SpecGenerationOutput] = {}
    for i, ids in enumerate(inputs):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        output = engine.add(ServingRequest(f"req_{i}", ids, max_new_tokens, record_timestamps=record_timestamps))
        if output.is_finished():
            results[output.request_id] = output
    try:
        with tqdm(total=len(inputs), disable=not progress_bar, desc=f"Solving {len(inputs)} requests",
                  unit="request") as bar:
            bar.update(len(results))
            while engine.has_work:
                for output in engine.step():
                    if output.is_finished():
                        results[output.request_id] = output
                        bar.update(1)
    finally:
        engine.release()  # its runner (and captured graphs) back to the model's pool, for the next call
    return {f"req_{i}": results[f"req_{i}"] for i in range(len(inputs))}
