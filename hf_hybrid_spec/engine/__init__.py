"""The engine: the decode loops over a request's draft trees and the backends that verify them.

A batch (`batch.decode_batch`, any B > 1; the serving engine's steps too) verifies every row's tree in one forward
on `backend.BatchEagerBackend` or, compiled, `batch_static.BatchStaticBackend` (captured CUDA graphs over a static
cache), which also runs plain steps (`plain`) and the pipelined step (`pipeline`); the verify step is `step`'s
(`launch_step` queues every caller's verify forward, `finish_step` verifies and commits; with it the budget, tree
and records), shared with one request's loop and the serving engine's steps; the batch step asks a backend
what it can do through its capability flags (`queues_plain`, `device_drafts`, `prefills_chunked`,
`draft_forwards`). One request (`loop.decode`) runs on the same backends as a batch of one (on the static path a
one-row `static.StaticRunner`, the runner every static path uses), its own loop around the same step for the
per-request features a batch does not have yet (a streamer, a continued cache, multimodal prompts). What they return
and record: `outputs`."""

from .backend import BatchEagerBackend, VerifyOutputs
from .batch_static import BatchStaticBackend
from .batch import decode_batch
from .loop import PROMPT_INPUTS, decode
from .outputs import Recorder, SpecStats, SpeculativeDecoderOnlyOutput
from .request import Request
from .static import StaticRunner, release_runner, static_runner

__all__ = ["decode", "decode_batch", "Request", "BatchEagerBackend", "BatchStaticBackend", "PROMPT_INPUTS",
           "VerifyOutputs", "Recorder", "SpecStats", "SpeculativeDecoderOnlyOutput",
           "StaticRunner", "static_runner", "release_runner"]
