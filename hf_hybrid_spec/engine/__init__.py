"""The engine: the decode loops over a request's draft trees and the backends that verify them.

A batch (`batch.decode_batch`, any B > 1; the serving engine's steps too) verifies every row's tree in one forward
on `backend.BatchEagerBackend` or, compiled, `batch_static.BatchStaticBackend` (captured CUDA graphs over a static
cache), which also runs plain steps (`plain`) and the pipelined step (`pipeline`); the step's pieces (budget, tree,
verification, records) are `step`'s, shared with the serving engine's steps; the batch step asks a backend
what it can do through its capability flags (`queues_plain`, `device_drafts`, `prefills_chunked`,
`draft_forwards`). One request (`loop.decode`) runs on the same backends as a batch of one (on the static path a
one-row `static.StaticRunner`, the runner every static path uses), its own loop until a request runs through the
batch step. What they return and record: `outputs`."""

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
