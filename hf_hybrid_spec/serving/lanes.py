"""Serving engines stepped in turn, so that the host's work for one runs while the device computes the other's forward.

A speculative serving step is host work (each request's drafts), a verify forward, then host work again (records,
stopping criteria, the drafters' accepts); the device idles through both host parts (docs/benchmarks.md, "Serving
agentic sessions"). With `ServingConfig(lanes=2)` the slots are split between two engines, each
with its own batched cache and captured forward, and a step of lane A is

    A.finish(A's launched step)      # read its forward, commit, record: while the device runs B's forward
    A.launch()                       # draft and queue A's next forward behind B's

so the device runs A's, B's, A's forward back to back whenever the host keeps up. A small model's verify forward
costs about the same at half the rows (it is bound by its launches and latency, not its arithmetic), so this pays
where the host's share of a step is large, and costs where it is not (continuous batching without speculation).

Requests join the lane with the fewest requests; the prefix store is shared, so a follow-up call finds its last
call's state in whichever lane it lands.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from transformers import GenerationConfig

from ..config import AssistantConfig
from .engine import ServingConfig, ServingEngine, ServingRequest, ServingStats, SpecGenerationOutput, _Launched

__all__ = ["ServingLanes", "make_engine"]


def make_engine(model: nn.Module, assistant_config: AssistantConfig | None = None,
                serving_config: ServingConfig | None = None, generation_config: GenerationConfig | None = None,
                draft_model: nn.Module | None = None) -> ServingEngine | ServingLanes:
    """A `ServingEngine`, or `ServingLanes` for `serving_config.lanes` > 1 (the same interface)."""
    serving = serving_config or ServingConfig()
    if serving.lanes > 1:
        return ServingLanes(model, assistant_config, serving, generation_config, draft_model)
    return ServingEngine(model, assistant_config, serving, generation_config, draft_model)


class ServingLanes:
    """`serving_config.lanes` `ServingEngine`s over `model`, `max_slots` split between them, stepped in turn (see the
    module docstring). The interface of `ServingEngine`: `add`, `cancel`, `step`, `fail_all`, `has_work`,
    `running`, `stats` (summed), `prefixes`, `generation_config`."""

    def __init__(self, model: nn.Module, assistant_config: AssistantConfig | None = None,
                 serving_config: ServingConfig | None = None, generation_config: GenerationConfig | None = None,
                 draft_model: nn.Module | None = None):
        serving = serving_config or ServingConfig()
        count = serving.lanes
        sizes = [serving.max_slots // count + (i < serving.max_slots % count) for i in range(count)]
        self.engines: list[ServingEngine] = []
        for size in sizes:
            engine = ServingEngine(model, assistant_config, dataclasses.replace(serving, max_slots=size, lanes=1),
                                   generation_config, draft_model)
            if self.engines:  # one prefix store for every lane
                engine.prefixes = self.engines[0].prefixes
            self.engines.append(engine)
        self.serving = serving
        self._launched: list[_Launched | None] = [None] * count
        self._turn = 0
        self._held: list[SpecGenerationOutput] = []  # outputs of steps finished outside `step` (a cancel)

    def release(self) -> None:
        """Each lane's runner back to the model's pool (`ServingEngine.release`)."""
        for engine in self.engines:
            engine.release()

    @property
    def prefixes(self):
        return self.engines[0].prefixes

    @property
    def generation_config(self) -> GenerationConfig:
        return self.engines[0].generation_config

    @property
    def has_work(self) -> bool:
        return bool(self._held) or any(e.has_work for e in self.engines) or any(x is not None for x in self._launched)

    @property
    def running(self) -> int:
        return sum(e.running for e in self.engines)

    @property
    def stats(self) -> ServingStats:
        total = ServingStats()
        for field in dataclasses.fields(ServingStats):
            setattr(total, field.name, sum(getattr(e.stats, field.name) for e in self.engines))
        return total

    def add(self, request: ServingRequest) -> SpecGenerationOutput:
        """Queue `request` in the lane with the fewest requests (see `ServingEngine.add`)."""
        if any(e.holds(request.request_id) for e in self.engines):
            output = SpecGenerationOutput(request_id=request.request_id, prompt_ids=list(request.input_ids))
            return ServingEngine._fail_output(output, f"request id {request.request_id!r} is already in use")
        lane = min(self.engines, key=lambda e: e.waiting + e.running)
        return lane.add(request)

    def cancel(self, request_id: str) -> SpecGenerationOutput | None:
        """Drop a waiting or running request (see `ServingEngine.cancel`); its lane's step in flight is finished
        first (its outputs come with the next `step`)."""
        for i, engine in enumerate(self.engines):
            if engine.holds(request_id):
                if self._launched[i] is not None:
                    self._held += engine.finish(self._launched[i])
                    self._launched[i] = None
                return engine.cancel(request_id)
        return None

    def step(self) -> list[SpecGenerationOutput]:
        """One lane's turn: finish its step in flight (the device meanwhile runs the other lanes'), then launch its
        next. Returns the outputs that changed."""
        updates, self._held = self._held, []
        i = self._turn
        self._turn = (i + 1) % len(self.engines)
        engine = self.engines[i]
        if self._launched[i] is not None:
            launched, self._launched[i] = self._launched[i], None
            updates += engine.finish(launched)
        more, self._launched[i] = engine.launch()
        return updates + more

    def fail_all(self, error: str) -> list[SpecGenerationOutput]:
        """Fail every waiting and running request of every lane (their steps in flight dropped unread)."""
        outputs, self._held = self._held, []
        for i, engine in enumerate(self.engines):
            if self._launched[i] is not None:
                engine.abandon(self._launched[i])
                self._launched[i] = None
            outputs += engine.fail_all(error)
        return outputs
