"""Continuous batching with tree speculation for hybrid models: requests join and leave a running batch between
steps.

    engine = ServingEngine(model, AssistantConfig(), ServingConfig(max_slots=16))
    engine.add(ServingRequest("a", prompt_ids, max_new_tokens=128))
    while engine.has_work:
        for update in engine.step():     # GenerationOutput per request that changed (transformers' type)
            ...

Each request owns a slot of one static batched cache (`engine.static.StaticRunner`): the attention layers'
KV buffers and the recurrent and conv states are indexed by slot (mamba's `state_batch_indices`), so a request joins
by writing its prompt's committed state into a free slot and leaves by freeing it; nothing else moves. A step is one
verify forward over every slot (captured as CUDA graphs per tree width on a GPU; free slots commit nothing), with each
running request's draft tree, acceptance and commit its own, under the batch-wide budget (`engine.budget`). Where
drafting does not pay for its steps as measured, the engine runs plain steps without the drafters (`_judge`), each
queued before the last one is read where nothing can change between them (`_queue_ahead`).

A joining request's prompt runs on a staging cache (its prefill; requests joining together without a stored prefix
share one left-padded forward), starting from the longest stored prefix (`PrefixStore`: the state an earlier request
left behind when the new prompt extends it), and its committed state is copied into the slot; or, with
`ServingConfig(prefill="chunked")`, inside the steps, a chain of prompt tokens per step in its own row. Requests fail
alone: bad input at `add`, an error of its drafter, processors or stopping
criteria during a step free only its slot; an error of the forward itself fails every running request.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria
from transformers.utils import logging

from ..cache import HybridTreeCache, export_committed, import_committed
from ..config import AssistantConfig
from ..drafters import DraftBudget, DraftContext, Drafter, RowTokens, make_drafter
from ..engine.batch import batch_buckets
from ..engine.batch_static import BatchStaticBackend
from ..engine.budget import DraftingPayoff, PlainRuns
from ..engine.outputs import SpecStats
from ..engine.pipeline import LONGEST_PLAIN_RUN, PATIENCE, PLAIN_RUN
from ..engine.plain import queue_plain_step, runs_plain
from ..engine.request import propose
from ..engine.rows import BatchRecorder
from ..engine.static import DEFAULT_BUCKETS, StaticRunner, release_runner, static_runner
from ..engine.step import (LaunchedStep, StepRows, apply_budget, finish_step, launch_step, record_step, step_cost,
                           verify_batch)
from ..forward import forward_tokens
from ..models import get_adapter
from ..tree import DraftBatch, DraftTree, VerifyResult, empty_draft
from ..verification import FirstToken, RootContexts, batch_choices, choices_apply, make_verifier, row_processors
from ..verification.noise import to_device
from .penalties import OccurrencePenaltyLogitsProcessor
from .prefix import PrefixHit, PrefixStore

logger = logging.get_logger(__name__)

__all__ = ["ServingConfig", "ServingEngine", "ServingRequest", "ServingStats", "SpecGenerationOutput", "TokenLogprob"]


@dataclass
class ServingConfig:
    """Sizes of a serving engine.

    Attributes:
        max_slots: requests decoded at once (slots of the batched cache); more wait in line.
        max_total_tokens: the longest request (prompt and new tokens) a slot holds.
        prefix_cache_bytes: the bound on the prefix store's states (0: no prefix reuse).
        prefix_cache_entries: the bound on the prefix store's entries.
        speculation: False runs every step as a plain decode step (continuous batching alone: a baseline).
        batch_prefill: requests that join together and extend no stored prefix share one (left-padded) prefill.
        prefill: "chunked" (the default): a joining request's prompt runs inside the steps, up to `prefill_chunk`
            tokens per step as a chain in the request's row of the captured verify forward, beside the other
            requests' trees (no forward of its own: the running requests never wait for it); "eager": it runs in a
            forward of its own (with `batch_prefill`, shared with those joining at the same time) before it decodes
            and the running requests wait (slower in both time to first token and time per output token:
            docs/benchmarks.md, "Serving agentic sessions").
        lanes: engines the slots are split between, stepped in turn so that one's host work runs while the device
            computes another's forward (`serving.lanes.ServingLanes`, built by `make_engine`; 1: one engine).
    """

    max_slots: int = 8
    max_total_tokens: int = 2048
    prefix_cache_bytes: int = 1 << 30
    prefix_cache_entries: int = 64
    speculation: bool = True
    batch_prefill: bool = True
    prefill: str = "chunked"
    prefill_chunk: int = 64
    lanes: int = 1

    def __post_init__(self):
        if self.max_slots < 1 or self.max_total_tokens < 2:
            raise ValueError(f"ServingConfig needs max_slots >= 1 and max_total_tokens >= 2, got {self.max_slots}, "
                             f"{self.max_total_tokens}")
        if not 1 <= self.lanes <= self.max_slots:
            raise ValueError(f"ServingConfig needs 1 <= lanes <= max_slots, got lanes={self.lanes}, max_slots="
                             f"{self.max_slots}")
        if self.prefill not in ("eager", "chunked") or self.prefill_chunk < 2:
            raise ValueError(f"ServingConfig needs prefill 'eager' or 'chunked' and prefill_chunk >= 2, got "
                             f"{self.prefill!r}, {self.prefill_chunk}")


@dataclass
class ServingRequest:
    """One request.

    Attributes:
        request_id: unique among the engine's requests.
        input_ids: the prompt's token ids (non-empty).
        max_new_tokens: new tokens at most (None: the generation config's).
        generation_config: per-request settings (sampling, temperature, top-k / top-p, eos); None: the engine's.
        stopping_criteria: more criteria of the request's own, called as stock generate calls them ([1, L] ids).
        record_timestamps: keep each new token's time in `GenerationOutput.timestamps`.
        streaming: report every step's new tokens, not only the finished request.
    """

    request_id: str
    input_ids: list[int]
    max_new_tokens: int | None = None
    generation_config: GenerationConfig | None = None
    stopping_criteria: list[StoppingCriteria] = field(default_factory=list)
    record_timestamps: bool = False
    streaming: bool = False


@dataclass
class SpecGenerationOutput(GenerationOutput):
    """transformers' continuous-batching result with the request's speculation statistics (`spec_stats`), how
    many prompt tokens came from the prefix store (`reused_prefix_tokens`), in a cluster the replica that served
    it (`replica`, set by `serving.cluster`) and, when the request asks for them (its generation config's
    `logprobs`), each generated token's log-probability (`logprobs`, one `TokenLogprob` per generated token)."""

    spec_stats: SpecStats | None = None
    reused_prefix_tokens: int = 0
    replica: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target's raw logits (before any processor or temperature, as
    vLLM's default `raw_logprobs`), and the `top` most likely tokens there, [(token id, log-probability)], most
    likely first (as many as the request asked for)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class ServingStats:
    """Counters of an engine's life (bounded: no per-step lists).

    Attributes:
        steps: speculative steps (one verify forward each). plain_steps: those where no request drafted.
            admitted / finished / failed: requests.
        new_tokens: tokens generated. drafted_nodes: draft nodes verified.
        prefill_seconds: prompts' forwards (and the state copies into slots). begin_seconds: drafters begun on
            prompts and first tokens. draft_seconds: proposals and the budget. verify_seconds: verify forwards,
            verification and commits. record_seconds: per-request bookkeeping after a step (tokens, stopping
            criteria, drafters' accepts, leaving requests).
    """

    steps: int = 0
    plain_steps: int = 0
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    new_tokens: int = 0
    drafted_nodes: int = 0
    prefill_seconds: float = 0.0
    begin_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    record_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / max(self.steps, 1)


class _NoDrafts(Drafter):
    """The drafter of an engine with speculation off: every step a plain decode step, nothing kept."""

    name = "none"

    def propose(self, input_ids, budget):
        return None


class _Active:
    """A request in a slot: its drafter, rule, processors, committed tokens and output."""

    def __init__(self, request: ServingRequest, output: SpecGenerationOutput, gen: GenerationConfig, drafter,
                 verifier, processors: LogitsProcessorList, stopping: StoppingCriteriaList, limit: int, device):
        self.request, self.output, self.gen = request, output, gen
        self.drafter, self.verifier, self.processors = drafter, verifier, processors
        self.limit = limit  # the sequence's length limit (prompt + max new tokens)
        # The request's tokens stay on the host (a step's append is then no device work per request, and token
        # drafters read them without a device read), unless a processor reads them beside the scores on the device
        # (all but the warpers, which read no ids, and the occurrence penalty, which moves them).
        on_device = any(not (_warper(p) or isinstance(p, OccurrencePenaltyLogitsProcessor)) for p in processors)
        self.rec = BatchRecorder(torch.tensor([request.input_ids], dtype=torch.long,
                                              device=device if on_device else "cpu"), stopping, True,
                                 gen.pad_token_id, limit)
        self.row_processors = row_processors(processors, 0)
        self.raw_greedy = verifier.raw_greedy and not processors
        eos = gen.eos_token_id
        self.eos: tuple[int, ...] = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        # Log-probabilities of the generated tokens with this many alternatives each (None: not asked for).
        self.logprobs: int | None = getattr(gen, "logprobs", None)
        if self.logprobs is not None:
            output.logprobs = []
        self.cached: list[int] = []  # the tokens the slot's cache has committed (for the prefix store)
        self.pending: list[int] | None = None  # chunked prefill: prompt tokens not in the cache yet
        self.stats = SpecStats(prefill_tokens=len(request.input_ids))

    def ids(self) -> torch.Tensor:
        return self.rec.ids(0)

    @property
    def length(self) -> int:
        return self.rec.lengths[0]

    @property
    def finished(self) -> bool:
        return self.rec.finished[0] or self.length >= self.limit


@dataclass
class _Launched:
    """A step whose verify forward is queued and not read yet (`ServingEngine.launch`; `finish` reads it).

    Attributes:
        slots / actives: the running slots and their requests, in the forward's row order. decoding: the rows that
            decode (the others run a prefill chunk). drafts: each row's draft (a chunk's chain for prefilling rows).
        step: the verify step (`engine.step.launch_step`: its tree, drafts as one batch, the forward's logits
            [rows, n, V], the runner's buffer valid until this engine's next forward, and the argmax [rows, n] on the
            host when every decoding row is greedy over raw logits); None for a plain step
            (`ServingEngine._launch_plain`), whose `tokens` on the host (once `ready`, an event, None on the CPU, has
            fired) are each running request's token, already committed. failed: (slot, error) of requests that
            failed while drafting. launch_seconds: the forward's launch. started: when the step's drafting began.
            judged: every request decoded and drafted this step, so what it committed and cost tells whether
            drafting pays (`ServingEngine._judge`). device_tokens: a plain step's tokens [rows] on the device (the
            roots of a plain step queued ahead of their read, `ServingEngine._queue_ahead`). holds: a step queued
            ahead that held back the roots that are their request's eos. logprobs: a plain step's log-probabilities
            for the requests that ask for them (`_PlainLogprobs`).
    """

    slots: list[int]
    actives: list[_Active]
    decoding: list[int]
    drafts: list[DraftTree]
    step: LaunchedStep | None
    failed: list
    launch_seconds: float
    tokens: torch.Tensor | None = None
    ready: object | None = None
    started: float = 0.0
    judged: bool = False
    device_tokens: torch.Tensor | None = None
    holds: bool = False
    logprobs: _PlainLogprobs | None = None


@dataclass
class _PlainLogprobs:
    """A plain step's log-probabilities, for the requests that ask for them (rows `rows` of the step, in order): each
    one's token under the log-softmax of its raw logits (`chosen` [k]) and the `top` likeliest tokens there
    (`values` / `ids` [k, top]), on the host once the step's tokens are (copies queued behind the step: `finish`
    reads them after the step's event, without waiting for a step queued ahead of it)."""

    rows: list[int]
    chosen: torch.Tensor
    values: torch.Tensor | None
    ids: torch.Tensor | None

    def read(self, actives: list[_Active]) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """Each row's log-probability and alternatives (one host read), cut to its own request's count."""
        chosen = self.chosen.tolist()
        values = [[]] * len(self.rows) if self.values is None else self.values.tolist()
        ids = [[]] * len(self.rows) if self.ids is None else self.ids.tolist()
        out = {}
        for row, c, i, v in zip(self.rows, chosen, ids, values):
            top = actives[row].logprobs
            out[row] = (c, list(zip(i[:top], v[:top])))
        return out


@dataclass(frozen=True)
class RunnerModes:
    """How an engine's runner runs its forward: captured as CUDA graphs, and with the fused verify forward."""

    graphs: bool
    fuse: bool


def runner_modes(config: AssistantConfig, device: torch.device) -> RunnerModes:
    """The runner's modes on `device`. compile "auto" or True captures graphs on a GPU (the engine's graphs are CUDA
    graphs: eager elsewhere). compile_verify "auto" fuses where the runner captures graphs, as `generate`'s static
    paths do: it cut time to first token and per output token at every measured rate (docs/benchmarks.md, "Serving
    agentic sessions"); on a CPU the compiled regions are not faster. compile_verify=True fuses anywhere."""
    graphs = device.type == "cuda" and config.compile in (True, "auto")
    fuse = config.compile_verify is True or (config.compile_verify == "auto" and graphs)
    return RunnerModes(graphs=graphs, fuse=fuse)


class ServingEngine:
    """Continuous batching of `ServingRequest`s on `model` with tree speculation (see the module docstring).

    Args:
        model: a supported hybrid (or attention-only) causal LM on one device.
        assistant_config: the speculation settings (drafter, budget, `compile`: "auto" captures CUDA graphs on a
            GPU); drafters that read the target's hidden states (EAGLE, MTP) or draft on its own cache
            (self-speculation) are not supported here yet.
        serving_config: slots, lengths, prefix store.
        generation_config: the requests' defaults (default: the model's).
        draft_model: for `drafter="model"`.
    """

    def __init__(self, model: nn.Module, assistant_config: AssistantConfig | None = None,
                 serving_config: ServingConfig | None = None, generation_config: GenerationConfig | None = None,
                 draft_model: nn.Module | None = None):
        self.model = model
        self.adapter = get_adapter(model)
        config = assistant_config or AssistantConfig()
        if config.verification != "lossless":
            raise NotImplementedError(f"verification={config.verification!r} is not supported by the serving engine")
        devices = {p.device for p in model.parameters()}
        if len(devices) != 1:
            raise NotImplementedError("the serving engine runs a model on one device")
        self.device = next(iter(devices))
        modes = runner_modes(config, self.device)
        self.config = config.replace(compile=False, compile_drafter=False, compile_verify=False)
        self.draft_model = draft_model
        probe = make_drafter(self.config, model, draft_model)
        try:
            if probe.target_hidden_layers or not probe.per_row:
                raise NotImplementedError(f"the {probe.name!r} drafter is not supported by the serving engine yet (it "
                                          "reads the target's hidden states or drafts on its cache); use suffix, "
                                          "ngram or model")
        finally:
            probe.release()
        self.serving = serving_config or ServingConfig()
        if self.serving.lanes > 1:
            raise ValueError("a ServingEngine is one lane: build ServingConfig(lanes > 1) with "
                             "hf_hybrid_spec.serving.make_engine (or ServingLanes)")
        head = model.get_output_embeddings()
        self.vocab_size = head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size
        self.generation_config = generation_config or model.generation_config
        self.node_budget = min(self.config.max_draft_tokens, self.config.max_verify_nodes)
        buckets = batch_buckets(self.config.compile_buckets or DEFAULT_BUCKETS, self.node_budget)
        self.node_budget = min(self.node_budget, max(buckets) - 1) if self.serving.speculation else 0
        if self.serving.prefill == "chunked":  # a prompt chunk per step needs its own width
            buckets = tuple(sorted(set(buckets) | {self.serving.prefill_chunk}))
        self.max_width = max(buckets)
        slots = self.serving.max_slots
        static_length = self.serving.max_total_tokens + self.max_width
        if modes.graphs == (self.device.type == "cuda"):
            # The model's pooled runner of these sizes (`static.static_runner`), leased for the engine's life: an
            # engine made per call (`generate_batch`) reuses the graphs the last one captured.
            with torch.inference_mode():  # (the engine's steps run in it: its runners are pooled apart)
                runner = static_runner(model, slots, static_length, buckets, owner=self, fuse=modes.fuse)
        else:  # (compile=False on a GPU: a runner of its own without graphs)
            runner = StaticRunner(model, slots, static_length, buckets, use_graphs=False, fuse=modes.fuse)
        self._runner = runner
        self.backend = BatchStaticBackend(model, slots, runner.static_length, buckets, owner=None, runner=runner)
        # A launched step's argmax, read back by `finish` (one step in flight per engine), and plain steps' tokens (two:
        # a plain step may be queued ahead of the last one's read, `_queue_ahead`).
        pinned = self.device.type == "cuda"
        self._best_host = torch.zeros(slots * self.max_width, dtype=torch.long, pin_memory=pinned)
        self._plain_host = [torch.zeros(slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._plain_turn = 0
        self._ahead: _Launched | None = None  # a plain step queued ahead of the last one's read (`_queue_ahead`)
        self._eos: tuple | None = None  # (the running requests, their eos tokens on the device): `_eos_table`
        with torch.inference_mode():
            self.backend.start_empty()
        self.prefixes = PrefixStore(self.serving.prefix_cache_bytes, self.serving.prefix_cache_entries) \
            if self.serving.prefix_cache_bytes > 0 else None
        self._waiting: list[tuple[ServingRequest, SpecGenerationOutput]] = []
        self._active: dict[int, _Active] = {}  # slot -> request
        self._ids: set[str] = set()
        self._cost = None
        # Whether drafting pays for its steps as measured, and the runs of plain steps without the drafters when it
        # does not (`_judge`); built with the cost model, so only where there is one (a GPU, or a calibrated budget).
        self._payoff: DraftingPayoff | None = None
        self._runs: PlainRuns | None = None
        self._plain_left = 0  # steps left in the current run of plain steps
        self.stats = ServingStats()

    def release(self) -> None:
        """Hand the engine's runner back to the model's pool (the engine serves nothing after: `generate_batch` at
        its end; an engine dropped without it hands it back when it is collected)."""
        release_runner(self.model, self._runner)

    # ------------------------------------------------------------------ requests
    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    def holds(self, request_id: str) -> bool:
        """Whether a request of that id waits or runs here."""
        return request_id in self._ids

    def add(self, request: ServingRequest) -> SpecGenerationOutput:
        """Queue `request`. Returns its output: PENDING, or FAILED with `error` set when the request is invalid (it
        never reaches a slot)."""
        output = SpecGenerationOutput(request_id=request.request_id, prompt_ids=list(request.input_ids))
        problem = self._check(request)
        if problem is not None:
            output.status, output.error = RequestStatus.FAILED, problem
            return output
        self._ids.add(request.request_id)
        self._waiting.append((request, output))
        return output

    def cancel(self, request_id: str) -> SpecGenerationOutput | None:
        """Drop a waiting or running request (its slot is freed). Returns its output, FAILED with error
        "cancelled", or None when no such request is in the engine."""
        for i, (request, output) in enumerate(self._waiting):
            if request.request_id == request_id:
                del self._waiting[i]
                self._ids.discard(request_id)
                return self._fail_output(output, "cancelled")
        for slot, active in list(self._active.items()):
            if active.request.request_id == request_id:
                self._leave([slot], failed="cancelled")
                return active.output
        return None

    def fail_all(self, error: str) -> list[SpecGenerationOutput]:
        """Fail every waiting and running request (an engine-wide error)."""
        outputs = [self._fail_output(o, error) for _, o in self._waiting]
        self._waiting.clear()
        outputs += [a.output for a in self._active.values()]
        self._ahead = None  # (a plain step queued ahead: its requests are gone)
        self._leave(list(self._active), failed=error)
        self._ids.clear()
        return outputs

    def _check(self, request: ServingRequest) -> str | None:
        ids = request.input_ids
        vocab = self.vocab_size
        if request.request_id in self._ids:
            return f"request id {request.request_id!r} is already in use"
        if not ids:
            return "the prompt is empty"
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            return f"the prompt holds token ids outside the vocabulary [0, {vocab})"
        new = self._max_new(request)
        if new is None or new < 1:
            return f"max_new_tokens must be >= 1, got {new}"
        if len(ids) + new > self.serving.max_total_tokens:
            return (f"the prompt ({len(ids)} tokens) and max_new_tokens ({new}) exceed the engine's max_total_tokens "
                    f"({self.serving.max_total_tokens})")
        gen = self._gen(request)
        if gen.num_beams not in (None, 1) or (gen.num_return_sequences or 1) > 1:
            return "beam search and num_return_sequences > 1 are not supported"
        eos = [] if gen.eos_token_id is None else ([gen.eos_token_id] if isinstance(gen.eos_token_id, int)
                                                  else list(gen.eos_token_id))
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in eos):
            return f"eos_token_id holds token ids outside the vocabulary [0, {vocab})"
        seed = getattr(gen, "seed", None)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63):
            return f"seed must be an integer in [0, 2**63), got {seed!r}"
        logprobs = getattr(gen, "logprobs", None)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= vocab):
            return f"logprobs must be an integer in [0, {vocab}], got {logprobs!r}"
        if gen.guidance_scale not in (None, 1, 1.0):
            return "guidance_scale (classifier-free guidance, a second forward per step) is not supported"
        if gen.stop_strings:
            return ("stop_strings need a tokenizer, which the engine does not hold: pass a StopStringCriteria in the "
                    "request's stopping_criteria (the OpenAI server's `stop` does this)")
        return None

    def _max_new(self, request: ServingRequest) -> int | None:
        """New tokens at most: the request's, else its generation config's `max_new_tokens`, else what its
        `max_length` leaves after the prompt."""
        if request.max_new_tokens is not None:
            return request.max_new_tokens
        gen = self._gen(request)
        if gen.max_new_tokens is not None:
            return gen.max_new_tokens
        return None if gen.max_length is None else gen.max_length - len(request.input_ids)

    def _gen(self, request: ServingRequest) -> GenerationConfig:
        return request.generation_config if request.generation_config is not None else self.generation_config

    # ------------------------------------------------------------------ the step
    def step(self) -> list[SpecGenerationOutput]:
        """Admit waiting requests into free slots, then one speculative step of every running request. Returns the
        outputs that changed: finished or failed ones, and streaming ones with new tokens."""
        updates, launched = self.launch()
        # Admission's outputs (a request that failed or finished at its first token) beside the step's.
        return updates if launched is None else updates + self.finish(launched)

    @torch.inference_mode()
    def launch(self) -> tuple[list[SpecGenerationOutput], _Launched | None]:
        """The first half of `step`: admit waiting requests, draft for every running one, and queue the verify
        forward without reading it (and, where every decoding request is greedy over raw logits, its argmax's copy to
        the host). Returns the outputs that changed on admission, and the step to `finish` (None: nothing runs). A
        `ServingLanes` runs another engine's host work while the device computes this forward."""
        updates: list[SpecGenerationOutput] = []
        self._admit(updates)
        if self._ahead is not None:  # a plain step queued ahead of the last one's read (`_queue_ahead`)
            launched, self._ahead = self._ahead, None
            return updates, launched
        if not self._active:
            return updates, None
        slots = self.backend.running_slots
        actives = [self._active[s] for s in slots]
        decoding = [row for row, a in enumerate(actives) if a.pending is None]
        t0 = time.perf_counter()
        failed = []
        # Inside a run of plain steps (drafting did not pay for its steps: `_judge`) no request drafts.
        in_run = self._plain_left > 0 and bool(decoding)
        self._plain_left -= int(in_run)
        drafts = [empty_draft(1)] * len(decoding) if in_run else []
        for row in [] if in_run else decoding:
            slot, a = slots[row], actives[row]
            try:
                depth = min(self.config.max_depth, a.limit - a.length - 1)
                drafts.append(propose(a.drafter, a.ids(), DraftBudget(max_nodes=self.node_budget, max_depth=depth),
                                      a.verifier) if self.node_budget > 0 else empty_draft(1))
            except BaseException as error:  # this request's drafter: it fails alone
                _raise_engine_exit(error)
                failed.append((slot, f"drafter failed: {error!r}"))
                drafts.append(empty_draft(1))
        if in_run and len(decoding) == len(actives):  # straight to the plain step, no empty trees laid out
            launched = self._launch_plain(slots, actives, drafts, [a.rec.host[0][-1] for a in actives], failed, t0,
                                          time.perf_counter())
            if launched is not None:
                return updates, launched
        budgeted = apply_budget(DraftBatch.from_drafts(drafts), self._cost_model(), self.config, SpecStats(),
                                self.backend.widths)
        if len(decoding) == len(actives):
            rows, drafts = budgeted, budgeted.drafts
        else:
            # Rows still prefilling (chunked): their next prompt tokens as a chain, all committed.
            chunk = self.serving.prefill_chunk
            kept = iter(budgeted.drafts)
            drafts = [next(kept) if a.pending is None else _chain(a.pending[1:chunk]) for a in actives]
            rows = DraftBatch.from_drafts(drafts)
        roots = [a.rec.host[0][-1] if a.pending is None else a.pending[0] for a in actives]
        t1 = time.perf_counter()
        # A step that drafted for every request, prefill chunks aside, is judged by what it commits and costs.
        judged = not in_run and bool(decoding) and len(decoding) == len(actives) and self.node_budget > 0
        if len(decoding) == len(actives) and not any(rows.counts):
            # No request drafts this step: a plain decode step, without the tree machinery (`engine.plain`).
            launched = self._launch_plain(slots, actives, drafts, roots, failed, t0, t1)
            if launched is not None:
                launched.judged = judged
                return updates, launched
        # Where every decoding request is greedy over raw logits, the argmax's copy to the host is queued right
        # behind the forward: `finish` waits for this step alone, not for a forward queued after it.
        greedy = bool(decoding) and all(actives[row].raw_greedy for row in decoding)
        try:
            step = launch_step(self.backend, rows, roots, best=self._best_host if greedy else None)
        except Exception as error:
            logger.error("serving: the verify forward failed (%r); failing the running requests", error)
            return updates + self.fail_all(f"forward failed: {error!r}"), None
        self.stats.draft_seconds += t1 - t0
        return updates, _Launched(slots, actives, decoding, drafts, step, failed, time.perf_counter() - t1,
                                  started=t0, judged=judged)

    def _launch_plain(self, slots, actives, drafts, roots, failed, t0, t1,
                      hold: torch.Tensor | None = None) -> _Launched | None:
        """Queue a plain step of every running request (each decodes, none drafts): the forward of its root alone,
        its token chosen on the device (the argmax, or its rule's keyed draw over its processed scores where
        `verification.batch_choices` makes it: the token the verify step would choose there) and committed, and the
        tokens' copy to the host (processors that read the ids get each request's ids and its root; a request that
        asks for `logprobs` its token's and the likeliest alternatives under the raw logits). None where a request's
        rule needs the verify step (a lossy one), or the plain step failed (nothing committed: the verify step runs
        instead). `roots` on the device are the tokens of the plain step before, not read yet (a step queued ahead,
        `_queue_ahead`): every request one token further than the host has recorded; `hold` [rows] (bool, on the
        device) the roots not to commit."""
        ahead = isinstance(roots, torch.Tensor)
        if not runs_plain(self.backend, True):
            return None
        choose = None
        if not all(a.raw_greedy for a in actives):
            if not _root_rules_apply(actives):
                return None
            # Each root's position + 1 (no padding in a slot).
            known = [a.length + int(ahead) for a in actives]
            at = self.backend.running_index(self.device)  # (`slots`, in order)

            def choose(logits: torch.Tensor, _lengths, runner_roots: torch.Tensor) -> torch.Tensor:
                # Every runner row's token [R]: the running ones' by their rules; the free slots commit nothing,
                # whatever they hold. The root is the token of the step before where that is not read yet (a step
                # queued ahead).
                out = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
                out[at] = _root_choices(actives, logits[at], known, runner_roots.index_select(0, at))
                return out

        logprobs = None
        wanting = [row for row, a in enumerate(actives) if a.logprobs is not None]
        if wanting:  # the log-probabilities of the chosen tokens, from the forward's raw logits before they go
            rule, top = choose, max(actives[row].logprobs for row in wanting)
            at_wanting = to_device(torch.tensor([slots[row] for row in wanting]), self.device)  # their runner rows

            def choose(logits: torch.Tensor, lengths, runner_roots: torch.Tensor) -> torch.Tensor:
                nonlocal logprobs
                best = logits.argmax(dim=-1) if rule is None else rule(logits, lengths, runner_roots)
                logp = torch.log_softmax(logits[at_wanting].to(torch.float32), dim=-1)
                values, ids = logp.topk(top, dim=-1) if top else (None, None)
                logprobs = _PlainLogprobs(wanting, _queued_to_host(logp.gather(1, best[at_wanting][:, None])[:, 0]),
                                          _queued_to_host(values), _queued_to_host(ids))
                return best

        try:
            new = queue_plain_step(self.backend, roots, choose, hold=hold)
        except Exception as error:  # a request's processors: the verify step finds whose (`_verify`)
            logger.debug("serving: the plain step failed (%r); verifying instead", error)
            return None
        # Two host buffers in turn: a step queued ahead copies its tokens beside those of the step before, not read yet.
        self._plain_turn ^= 1
        tokens = self._plain_host[self._plain_turn][: len(actives)]
        tokens.copy_(new, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.stats.draft_seconds += t1 - t0
        return _Launched(slots, actives, list(range(len(actives))), drafts, None, failed, time.perf_counter() - t1,
                         tokens, ready, started=t0, device_tokens=new, logprobs=logprobs)

    def _queue_ahead(self, launched: _Launched) -> None:
        """Queue the next plain step before `launched`'s (a plain step's) tokens are read, its roots being those
        tokens on the device, so that the host's records of this step run while the device computes the next (as
        `engine.plain.plain_steps` runs `generate`'s plain runs). Only where the next step is a plain step of the
        same requests for sure: inside a run of plain steps (or with speculation off), no request waiting for a slot,
        and each request short of its length limit after this step. A request that stops at this step had the next
        step run for it too: that token never reaches its output, and a request that takes the slot starts afresh.
        With a prefix store, a root that is one of its request's eos tokens is held back on the device (not
        committed), so a request that stops on its eos leaves its state as it would without the step ahead, and it
        is stored (`_leave`); one that stops on another criterion (a stop string) leaves none."""
        actives = launched.actives
        if (self._ahead is not None or self._waiting
                or self.backend.running_slots != launched.slots  # (requests left after it was queued)
                # (or left, and others took their slots: a step for them would commit into the new requests' rows)
                or any(self._active.get(slot) is not a for slot, a in zip(launched.slots, actives))
                or not (self._plain_left > 0 or self.node_budget == 0)
                or any(a.length + 1 >= a.limit for a in actives)):
            return
        hold = None
        if self.prefixes is not None and any(a.eos for a in actives):
            hold = (launched.device_tokens[:, None] == self._eos_table(actives)).any(dim=-1)
        t0 = time.perf_counter()
        ahead = self._launch_plain(launched.slots, actives, launched.drafts, launched.device_tokens, [], t0, t0,
                                   hold=hold)
        if ahead is not None:
            ahead.holds = hold is not None
            self._plain_left = max(self._plain_left - 1, 0)
            self._ahead = ahead

    def _eos_table(self, actives: list[_Active]) -> torch.Tensor:
        """The requests' eos tokens [rows, E] on the device (-1 beyond a request's own), kept while they run."""
        held = None if self._eos is None else self._eos[0]
        if held is None or len(held) != len(actives) or any(x is not y for x, y in zip(held, actives)):
            width = max(len(a.eos) for a in actives)
            table = torch.tensor([list(a.eos) + [-1] * (width - len(a.eos)) for a in actives], dtype=torch.long)
            if self.device.type == "cuda":  # pinned: the copy is queued behind the step in flight, not waited for
                table = table.pin_memory()
            self._eos = (list(actives), table.to(self.device, non_blocking=True))
        return self._eos[1]

    @torch.inference_mode()
    def finish(self, launched: _Launched) -> list[SpecGenerationOutput]:
        """The second half of `step`: read the launched step's verification, commit every request's path, record its
        tokens, and let finished requests leave. Returns the outputs that changed."""
        t1 = time.perf_counter()
        slots, actives, decoding, drafts = launched.slots, launched.actives, launched.decoding, launched.drafts
        failed, updates = launched.failed, []
        chunk = self.serving.prefill_chunk
        # A step queued ahead (`_queue_ahead`) may hold requests that left after it was queued: nothing of theirs is
        # recorded (their slots are free or taken by new requests, which it did not run).
        gone = {slot for slot, a in zip(slots, actives) if self._active.get(slot) is not a}

        def overlap() -> None:  # the host's work while the device runs the forward
            for row in decoding:
                if slots[row] in gone:
                    continue
                try:
                    actives[row].drafter.overlap()
                except BaseException as error:  # its drafter: it fails alone
                    _raise_engine_exit(error)
                    failed.append((slots[row], f"drafter failed: {error!r}"))
            for row, a in enumerate(actives):
                if a.pending is not None:  # its drafter's begin, a chunk at a time
                    try:
                        a.drafter.prefeed(a.request.input_ids[: len(a.cached) + drafts[row].num_nodes + 1])
                    except BaseException as error:
                        _raise_engine_exit(error)
                        failed.append((slots[row], f"drafter failed: {error!r}"))

        last = {}  # a request whose prompt's last chunk went in: its logits at its last prompt token

        def read(step: LaunchedStep, results: list[VerifyResult]) -> None:
            logits = step.outputs.logits
            last.update({row: logits[row : row + 1, drafts[row].num_nodes].to(torch.float32)
                         for row, a in enumerate(actives) if a.pending is not None and len(a.pending) <= chunk})

        queued = 0.0  # the launch of a step queued ahead: that step's time (its `launch_seconds`), not this one's
        if launched.step is None:  # a plain step, committed on the device already
            self._queue_ahead(launched)
            if self._ahead is not None:
                queued = self._ahead.launch_seconds
            overlap()
            if launched.ready is not None:
                launched.ready.synchronize()
            results = [VerifyResult(path=[0], tokens=torch.zeros(0), score_nodes=[0], token_list=[token])
                       for token in launched.tokens.tolist()]
            plain_logprobs = {} if launched.logprobs is None else launched.logprobs.read(actives)
        else:
            verify = partial(self._verify, actives=actives, failed=failed, slots=slots, decoding=decoding)
            results = finish_step(self.backend, launched.step, verify, overlap, read).results
        t2 = time.perf_counter()
        self.stats.steps += 1
        self.stats.verify_seconds += launched.launch_seconds + t2 - t1 - queued
        now = t2
        done = []
        bad = dict(failed)
        committed, remaining = [], []  # decoding requests' tokens this step, and what they had left before it
        starting = []  # (slot, request, logits [1, V]) of the requests whose prompts' last chunks went in
        for row, (slot, a, draft, result) in enumerate(zip(slots, actives, drafts, results)):
            if slot in bad or slot in gone:
                continue
            if a.pending is not None:  # a prefill chunk went in
                k = draft.num_nodes + 1
                a.cached.extend(a.pending[:k])
                a.pending = a.pending[k:] or None
                if a.pending is None:
                    starting.append((slot, a, last[row]))
                continue
            a.cached.extend([a.rec.host[0][-1]] + [draft.host().tokens[j - 1] for j in result.path[1:]])
            try:
                before = a.length
                a.rec.append([0], [result.token_list])
                a.drafter.accept(a.ids(), result, None)
            except BaseException as error:  # the request's stopping criteria or drafter
                _raise_engine_exit(error)
                bad[slot] = f"failed after a step: {error!r}"
                continue
            new = a.rec.host[0][before : a.length]
            committed.append(len(result.token_list))
            remaining.append(a.limit - before)
            a.output.generated_tokens.extend(new)
            if a.logprobs is not None and new and launched.step is None:  # (a plain step's token: one)
                chosen, top = plain_logprobs[row]
                a.output.logprobs.append(TokenLogprob(new[0], chosen, top))
            elif a.logprobs is not None and new:  # the token at path node j was chosen from node j's logits
                a.output.logprobs += _logprobs(launched.step.outputs.logits[row, result.path[: len(new)]], new,
                                               a.logprobs)
            if a.output.timestamps is not None:
                a.output.timestamps.extend([now] * len(new))
            record_step(a.stats, None, [0], [len(result.token_list)], [draft.num_nodes],
                        plain=launched.step is None)
            self.stats.new_tokens += len(new)
            self.stats.drafted_nodes += draft.num_nodes
            if a.finished:
                done.append(slot)
            elif a.request.streaming and new:
                updates.append(_snapshot(a.output))
        errors = self._firsts(starting) if starting else {}
        for slot, a, _ in starting:
            if slot in errors:
                bad[slot] = f"failed to start: {errors[slot]!r}"
            elif a.finished:
                done.append(slot)
            elif a.request.streaming:
                updates.append(_snapshot(a.output))
        self.stats.plain_steps += int(not any(d.num_nodes for d in drafts))
        if launched.judged and self._payoff is not None and committed:
            self._judge(committed, remaining, 1 + max(d.num_nodes for d in drafts),
                        time.perf_counter() - launched.started)
        if bad:
            for slot, error in bad.items():
                updates.append(self._active[slot].output)
                self._leave([slot], failed=error)
        for slot in done:
            updates.append(self._active[slot].output)
        self._leave(done)
        self.stats.record_seconds += time.perf_counter() - t2
        return updates

    def abandon(self, launched: _Launched) -> None:
        """Drop a launched step unread (an engine-wide failure or stop follows): the cache leaves its tree mode."""
        self._ahead = None
        self.backend.abort()

    def _verify(self, step: LaunchedStep, actives: list[_Active], failed: list, slots: list[int],
                decoding: list[int]) -> list[VerifyResult]:
        """Each running request's result: a prefill chunk's whole chain; the verified path of a decoding request
        (root only for one that failed this step: its slot commits nothing that anyone keeps). The step's drafts are
        one row per running request; its `best` the logits' argmax [rows, n] on the host, which `launch` copies
        whenever every decoding request is greedy over raw logits (else None: each request's own rule)."""
        tree, rows, logits, best = step.tree, step.drafts, step.outputs.logits, step.best
        drafts = rows.drafts
        results: list[VerifyResult | None] = [
            None if a.pending is None else VerifyResult(path=list(range(d.num_nodes + 1)), tokens=torch.zeros(0),
                                                        score_nodes=[], token_list=[])
            for a, d in zip(actives, drafts)]
        if not decoding:
            return results
        everyone = len(decoding) == len(actives)
        taken = rows if everyone else rows.take(decoding)
        if best is not None:
            best = best if everyone else best[torch.tensor(decoding)]
        elif not everyone:  # the decoding rows' logits (a view when every row decodes: no copy of [R, n, V])
            logits = logits[torch.tensor(decoding, device=logits.device), : 1 + taken.tokens.shape[1]]

        def blame(row: int | None, error: BaseException) -> None:
            # A request's processors or rule fail alone; None: the batch's one pass raised (row by row finds whose).
            _raise_engine_exit(error)
            if row is not None:
                failed.append((slots[decoding[row]], f"verification failed: {error!r}"))

        # Each request its own rule (seed), processors and random stream (row 0 of its own), its ids as it has them.
        step_rows = StepRows(RowTokens(lambda i: actives[decoding[i]].ids(), [actives[row].length for row in decoding]),
                             [actives[row].verifier for row in decoding],
                             [actives[row].row_processors for row in decoding], keys=[0] * len(decoding),
                             tree_rows=decoding)
        for row, result in zip(decoding, verify_batch(tree, taken, logits, step_rows, best=best, on_error=blame)):
            results[row] = result
        return results

    def _cost_model(self):
        """The batch-wide budget's cost model: the verify forward over every slot, measured once on CUDA (all slots
        run every step, so the running count does not change it); None elsewhere or with batch_budget='fixed'. With
        it comes the rule that judges whether drafting pays (`_judge`), where plain steps can run."""
        if self._cost is None:
            self._cost = step_cost(self.config, self.backend, self.model,
                                   ("serving", self.serving.max_slots, self.backend.runner.static_length))
            if self._cost is not None and self.node_budget > 0 and runs_plain(self.backend, True):
                self._payoff = DraftingPayoff(self._cost, self.config.budget_slack)
                self._runs = PlainRuns(PLAIN_RUN, LONGEST_PLAIN_RUN, PATIENCE)
        return self._cost

    def _judge(self, committed: list[int], remaining: list[int], width: int, seconds: float) -> None:
        """Whether a drafting step paid, as `generate`'s batch loop judges its own (`budget.DraftingPayoff`): the
        budget prices the verify forward, not the drafters' host work, and their values can promise far more than the
        text holds. Requests that had `remaining[i]` tokens left committed `committed[i]` in `seconds` of trees
        `width` wide. With requests waiting for a slot, every running one counts (slots free as fast as the batch
        commits); without, those with the most left (they end the engine's work). Steps that do not pay start a run
        of plain steps without the drafters (`budget.PlainRuns`), which a request that starts decoding ends (a new
        text, maybe one that repeats itself)."""
        if self._waiting:
            self._payoff.observe(sum(committed), len(committed), width, seconds)
        else:
            self._payoff.observe_rows(committed, remaining, width, seconds)
        length = self._runs.verdict(self._payoff.pays())
        if length:
            logger.debug("serving: drafts do not pay for their steps (%.0f tokens per request and second against %.0f "
                         "plain): %d plain steps", self._payoff.rate, 1.0 / self._payoff.cost(1), length)
            self._plain_left = length
            self._payoff.restart()

    # ------------------------------------------------------------------ joining and leaving
    def _admit(self, updates: list) -> None:
        """Waiting requests into free slots: prompts without a stored prefix share one left-padded prefill forward
        (the fixed cost of a forward, launch-bound for small models, paid once), prompts that extend a stored state
        run their new tokens from it one by one. A request that fails to start fails alone."""
        free = [s for s in range(self.serving.max_slots) if s not in self._active]
        joining = []
        while self._waiting and free:
            request, output = self._waiting.pop(0)
            slot = free.pop(0)
            try:
                joining.append((slot, self._start(slot, request, output)))
            except BaseException as error:  # a drafter that cannot be built for it
                _raise_engine_exit(error)
                self._not_started(slot, output, error, updates)
        hits = {slot: self.prefixes.longest(a.request.input_ids) for slot, a in joining} if self.prefixes else {}
        for slot, a in list(joining):
            if hits.get(slot) is not None and hits[slot].carry is not None:
                try:
                    a.drafter.adopt(hits[slot].carry)
                except BaseException as error:  # its drafter: it fails alone, before its slot holds anything
                    _raise_engine_exit(error)
                    joining.remove((slot, a))
                    self._not_started(slot, a.output, error, updates)
        if self.serving.prefill == "chunked":  # the prompts run inside the next steps
            for slot, a in joining:
                hit = hits.get(slot)
                start = 0 if hit is None else hit.length
                self.backend.admit(slot, None if hit is None else hit.state)
                a.pending, a.cached = list(a.request.input_ids[start:]), list(a.request.input_ids[:start])
                a.output.reused_prefix_tokens = start
                a.stats.prefill_tokens = len(a.request.input_ids) - start
            return
        fresh = [(slot, a) for slot, a in joining if hits.get(slot) is None]
        groups = [[item] for item in joining if hits.get(item[0]) is not None]
        if len(fresh) > 1 and self.serving.batch_prefill:
            groups.append(fresh)
        else:
            groups += [[item] for item in fresh]
        for group in groups:
            t0 = time.perf_counter()
            try:
                logits = self._prefill([a for _, a in group], [slot for slot, _ in group],
                                       hits.get(group[0][0]) if len(group) == 1 else None)
            except Exception as error:  # bad input the checks missed: the group's requests fail, nobody else
                for slot, a in group:
                    self._not_started(slot, a.output, error, updates)
                continue
            self.stats.prefill_seconds += time.perf_counter() - t0
            errors = self._firsts([(slot, a, logits[row : row + 1]) for row, (slot, a) in enumerate(group)])
            for slot, a in group:
                if slot in errors:  # its drafter's begin, its processors
                    self._not_started(slot, a.output, errors[slot], updates)
                    continue
                if a.finished:  # one new token was all it asked for, or the first one stopped it
                    updates.append(a.output)
                    self._leave([slot])
                elif a.request.streaming:
                    updates.append(_snapshot(a.output))

    def _not_started(self, slot: int, output: SpecGenerationOutput, error: Exception, updates: list) -> None:
        logger.warning("serving: request %s failed to start: %r", output.request_id, error)
        started = self._active.pop(slot, None)
        if started is not None:
            _release(started.drafter, output.request_id)
        if slot in self.backend.running_slots:
            self.backend.select_rows([i for i, s in enumerate(self.backend.running_slots) if s != slot])
        self._ids.discard(output.request_id)
        self.stats.failed += 1
        updates.append(self._fail_output(output, f"failed to start: {error!r}"))

    def _start(self, slot: int, request: ServingRequest, output: SpecGenerationOutput) -> _Active:
        """The request's drafter, rule, processors and stopping criteria, in `slot` (PREFILLING)."""
        gen = self._gen(request)
        limit = len(request.input_ids) + self._max_new(request)
        stopping = StoppingCriteriaList([MaxLengthCriteria(limit)])
        if gen.eos_token_id is not None:
            stopping.append(EosTokenCriteria(gen.eos_token_id))
        if gen.max_time is not None:  # from the request's start, as stock's from its call's
            stopping.append(MaxTimeCriteria(gen.max_time))
        stopping.extend(request.stopping_criteria)
        drafter = make_drafter(self.config, self.model, self.draft_model) if self.serving.speculation else _NoDrafts()
        verifier = make_verifier(self.config, bool(gen.do_sample), drafter)
        seed = getattr(gen, "seed", None)
        if seed is not None and getattr(verifier, "seed", None) is not None:
            # The request's own seed (vLLM's per-request `seed`): its tokens are keyed by (seed, position), so the
            # same request samples the same reply whatever runs beside it and whatever was drafted.
            verifier.seed = int(seed)
        processors = _processors(self.model, gen, request.input_ids, self.device)
        active = _Active(request, output, gen, drafter, verifier, processors, stopping, limit, self.device)
        if request.record_timestamps:
            output.timestamps = []
        output.status = RequestStatus.PREFILLING
        self._active[slot] = active
        return active

    def _prefill(self, actives: list[_Active], slots: list[int], hit: PrefixHit | None) -> torch.Tensor:
        """The prompts' forward on a staging cache (from `hit`'s state for a lone request that extends it; else the
        prompts left-padded in one forward, each row's state exactly its prompt's: padded positions are masked and
        the recurrent layers see zeros there, as stock batched generate runs them), each row's committed state
        copied into its slot. Returns the last position's logits [k, V] (float32)."""
        prompts = [list(a.request.input_ids) for a in actives]
        width = max(len(p) for p in prompts)
        staging = HybridTreeCache(self.model.config)
        start = 0
        if hit is not None:
            import_committed(staging, hit.state)
            start = hit.length
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if len(prompts) == 1:
            positions = torch.arange(start, width, device=self.device)[None]
            out = forward_tokens(self.model, ids[:, start:], staging, position_ids=positions, logits_to_keep=1)
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            out = forward_tokens(self.model, ids, staging, position_ids=positions, attention_mask=mask,
                                 logits_to_keep=1)
        for row, (slot, a, p) in enumerate(zip(slots, actives, prompts)):
            self.backend.admit(slot, export_committed(staging, row=row, start=width - len(p), length=len(p)))
            a.output.reused_prefix_tokens = start
            a.stats.prefill_tokens = len(p) - start
            a.cached = list(p)
        return out.logits[:, -1].to(torch.float32)

    def _firsts(self, started: list[tuple[int, _Active, torch.Tensor]]) -> dict[int, BaseException]:
        """Each request's first token from its prompt's logits (`started`: (slot, request, logits [1, V]) of requests
        whose prompts just went in), its drafter begun (DECODING). The tokens are chosen for every request at once
        where `_first_choices` can (queued before the drafters' begin, which then runs beside the device, and read
        once), else request by request with its rule's `first_token`. Returns {slot: error} of the requests that
        failed (their drafter, processors or stopping criteria), which the caller lets go."""
        t0 = time.perf_counter()
        errors: dict[int, BaseException] = {}
        choices = self._first_choices([a for _, a, _ in started], [logits for *_, logits in started])
        contexts = {}
        for slot, a, _ in started:
            try:
                contexts[slot] = DraftContext(self.model, self.backend.cache, self.adapter, a.gen, None)
                a.drafter.begin(a.ids(), contexts[slot], None)
            except BaseException as error:
                _raise_engine_exit(error)
                errors[slot] = error
        chosen = None if choices is None else choices.tolist()
        for row, (slot, a, logits) in enumerate(started):
            if slot in errors:
                continue
            try:
                output, ids = a.output, a.ids()
                if chosen is None:
                    scores = a.processors(ids, logits.clone()) if a.processors else logits
                    first = a.verifier.first_token(scores, FirstToken(ids, a.drafter, contexts[slot], None, None,
                                                                      self.node_budget))
                else:
                    first = VerifyResult(path=[0], tokens=choices[row : row + 1], score_nodes=[0],
                                         token_list=[chosen[row]])
                a.rec.append([0], [first.token_list])
                a.drafter.accept(a.ids(), VerifyResult(path=[0], tokens=first.tokens, score_nodes=[0],
                                                       token_list=first.token_list))
            except BaseException as error:
                _raise_engine_exit(error)
                errors[slot] = error
                continue
            output.generated_tokens.extend(a.rec.host[0][len(a.request.input_ids) :])
            if a.logprobs is not None:
                output.logprobs += _logprobs(logits, output.generated_tokens, a.logprobs)
            output.status = RequestStatus.DECODING
            now = time.perf_counter()
            output.lifespan = (now, -1)
            if output.timestamps is not None:
                output.timestamps.append(now)
            self.stats.admitted += 1
            self.stats.new_tokens += len(output.generated_tokens)
        self._plain_left = 0  # their text may repeat itself: drafting is judged again (`_judge`)
        self.stats.begin_seconds += time.perf_counter() - t0
        return errors

    def _first_choices(self, actives: list[_Active], logits: list[torch.Tensor]) -> torch.Tensor | None:
        """The first token of each of `actives` [R] on the device, queued: the argmax of its raw logits (each [1, V])
        or its rule's choice over its processed scores by `batch_choices`, as a plain step chooses a root's token
        (its last prompt token the root). None where that is not the rule of every one of them, or a processor
        raised (`_firsts` then goes request by request, which finds whose)."""
        logits = torch.cat(logits)
        if all(a.raw_greedy for a in actives):
            return logits.argmax(dim=-1)
        if not _root_rules_apply(actives):
            return None
        roots = to_device(torch.tensor([a.rec.host[0][-1] for a in actives]), logits.device)
        try:
            return _root_choices(actives, logits, [a.length for a in actives], roots)
        except Exception as error:
            logger.debug("serving: first tokens request by request (%r)", error)
            return None

    def _leave(self, slots: list[int], failed: str | None = None) -> None:
        """Free `slots`: finished requests store their state in the prefix store and report FINISHED; with `failed`,
        FAILED with that error."""
        if not slots:
            return
        running = self.backend.running_slots
        for slot in slots:
            a = self._active.pop(slot)
            self._ids.discard(a.request.request_id)
            ahead = self._ahead
            if (failed is None and ahead is not None and ahead.holds and any(x is a for x in ahead.actives)
                    and a.rec.host[0][-1] in a.eos):
                self.backend.retract(slot)  # the step queued ahead held its eos back (`_queue_ahead`)
            try:
                if failed is None:
                    if self.prefixes is not None and len(a.cached) == self.backend._lengths[slot]:
                        # The drafter's state goes with the committed one (the suffix trie: the next call that
                        # extends these tokens inserts only its new ones).
                        carry = a.drafter.handoff(a.ids())
                        self.prefixes.put(a.cached, self.backend.export_row(running.index(slot)), carry)
                    else:
                        a.drafter.end(a.ids())
            except BaseException as error:  # its drafter: its tokens stand, its state is not kept for reuse
                _raise_engine_exit(error)
                logger.warning("serving: request %s: its drafter failed as it left: %r", a.request.request_id, error)
            _release(a.drafter, a.request.request_id)
            a.output.spec_stats = a.stats
            a.output.lifespan = (a.output.lifespan[0], time.perf_counter())
            if failed is None:
                a.output.status = RequestStatus.FINISHED
                self.stats.finished += 1
            else:
                self._fail_output(a.output, failed)
                self.stats.failed += 1
        keep = [i for i, s in enumerate(running) if s not in slots]
        if len(keep) < len(running):
            self.backend.select_rows(keep)

    @staticmethod
    def _fail_output(output: SpecGenerationOutput, error: str) -> SpecGenerationOutput:
        output.status, output.error = RequestStatus.FAILED, error
        return output


def _chain(tokens: list[int]) -> DraftTree:
    """`tokens` as a chain hanging off the root (a prefill chunk's tokens after its first)."""
    if not tokens:
        return empty_draft(1)
    return DraftTree.from_lists(list(tokens), list(range(-1, len(tokens) - 1)))


# The interpreter's own exits end the engine; anything else a request's code raises (its drafter, processors,
# stopping criteria), a user's BaseException subclass included, fails that request alone.
_ENGINE_EXITS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _raise_engine_exit(error: BaseException) -> None:
    if isinstance(error, _ENGINE_EXITS):
        raise error


def _release(drafter, request_id: str) -> None:
    """A leaving request's drafter released; its failure is logged, not raised (the request is over either way)."""
    try:
        drafter.release()
    except BaseException as error:
        _raise_engine_exit(error)
        logger.warning("serving: request %s: its drafter failed to release: %r", request_id, error)


def _snapshot(output: SpecGenerationOutput) -> SpecGenerationOutput:
    """A copy of a running request's output for a stream (the engine keeps appending to its own)."""
    return dataclasses.replace(output, generated_tokens=list(output.generated_tokens),
                               timestamps=None if output.timestamps is None else list(output.timestamps),
                               logprobs=None if output.logprobs is None else list(output.logprobs))


def _root_rules_apply(actives: list[_Active]) -> bool:
    """Whether `_root_choices` makes every one of these requests' choices (else the verify step decides)."""
    return choices_apply([a.verifier for a in actives], [a.row_processors for a in actives], contexts=True)


def _root_choices(actives: list[_Active], logits: torch.Tensor, known: list[int], roots: torch.Tensor) -> torch.Tensor:
    """Each request's token after its root [R] on the logits' device, as its verify step would choose it there: its
    rule (each request its own stream, key 0, as in `_verify`) over its processed scores, from the root's logits
    [R, V]. `known`: each root's position + 1; `roots` [R] on the device. A processor that reads the ids reads the
    request's recorded ids before its root, then the root (which may not be recorded yet)."""
    contexts = RootContexts([a.rec.buffer for a in actives], [n - 1 for n in known], roots)
    zeros = torch.zeros(len(actives), dtype=torch.long)
    return batch_choices([a.verifier for a in actives], [a.row_processors for a in actives], logits[:, None],
                         torch.tensor(known), zeros[:, None], zeros, False, None, contexts)[:, 0]


def _queued_to_host(value: torch.Tensor | None) -> torch.Tensor | None:
    """A CUDA tensor's copy into pinned host memory, queued (read it once the stream has passed this point); else the
    tensor itself."""
    if value is None or value.device.type != "cuda":
        return value
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    return host.copy_(value, non_blocking=True)


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of `tokens`' log-probability under its row of raw `logits` [k, V] (k = len(tokens)), with the `top`
    likeliest tokens of that row: one host read."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0]
    if top > 0:
        values, ids = logp.topk(top, dim=-1)
        chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
        return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids, values)]
    return [TokenLogprob(t, c, []) for t, c in zip(tokens, chosen.tolist())]


def _processors(model: nn.Module, gen: GenerationConfig, prompt: list[int], device) -> LogitsProcessorList:
    """The processors stock `generate` builds for the request's settings (`_get_logits_processor`, after its special
    tokens are prepared as `generate` prepares them: `min_new_tokens`, `no_repeat_ngram_size`, `bad_words_ids`,
    `suppress_tokens`, `sequence_bias`, the sampling warpers, every one of them), in stock's order, with OpenAI's
    presence / frequency penalties (the generation config's `presence_penalty` / `frequency_penalty`, over the tokens
    after the prompt) before the warpers, as vLLM applies them. Verification calls them on every node's context, so
    each request decodes exactly as plain `generate` with its settings would."""
    gen = copy.deepcopy(gen)
    model._prepare_special_tokens(gen, True, device)
    processors = model._get_logits_processor(gen, input_ids_seq_length=len(prompt),
                                             encoder_input_ids=torch.tensor([prompt], device=device), device=device)
    presence, frequency = getattr(gen, "presence_penalty", None) or 0.0, getattr(gen, "frequency_penalty", None) or 0.0
    if presence or frequency:
        warpers = [i for i, p in enumerate(processors) if _warper(p)]
        processors.insert(warpers[0] if warpers else len(processors),
                          OccurrencePenaltyLogitsProcessor(presence, frequency, len(prompt)))
    return processors


def _warper(processor) -> bool:
    """A sampling warper (temperature, top-k / top-p / min-p, typical, epsilon, eta...): stock names them so, and
    they read the scores alone, never the ids."""
    return type(processor).__name__.endswith("LogitsWarper")
