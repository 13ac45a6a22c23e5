"""The engine: the decode loops over a request's draft trees and the backends that verify them.

A batch (`batch.decode_batch`, any B > 1; the serving engine's steps too) verifies every row's tree in one forward
on `backend.BatchEagerBackend` or, compiled, `batch_static.BatchStaticBackend` (captured CUDA graphs over a static
cache), which also runs plain steps (`plain`) and the pipelined step (`pipeline`); the step's pieces (budget, tree,
verification, records) are `step`'s, shared with the serving engine's steps; the batch step asks a backend
what it can do through its capability flags (`queues_plain`, `device_drafts`, `prefills_chunked`,
`draft_forwards`). One request (`loop.decode`) runs on `backend.EagerBackend` or `backend.StaticBackend` (on a
one-row `static.StaticRunner`, the runner every static path uses), its own loop until a request runs as a batch of
one. What they return and record: `outputs`."""

from .backend import BatchEagerBackend, EagerBackend, StaticBackend, TreeBackend, VerifyOutputs
from .batch import decode_batch
from .loop import PROMPT_INPUTS, decode
from .outputs import Recorder, SpecStats, SpeculativeDecoderOnlyOutput
from .request import Request
from .static import StaticRunner, release_runner, static_runner

__all__ = ["decode", "decode_batch", "Request", "BatchEagerBackend", "PROMPT_INPUTS", "TreeBackend", "EagerBackend",
           "StaticBackend", "VerifyOutputs", "Recorder", "SpecStats", "SpeculativeDecoderOnlyOutput",
           "StaticRunner", "static_runner", "release_runner"]
