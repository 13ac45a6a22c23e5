"""The engine: one decode loop (`loop.decode`; a batch of rows: `batch.decode_batch`) over a request's trees, through a backend that verifies them eagerly
(`backend.EagerBackend`) or from captured CUDA graphs over a static cache (`backend.StaticBackend`, on
`static.StaticTreeRunner`), with what it returns and records in `outputs`."""

from .backend import BatchEagerBackend, EagerBackend, StaticBackend, TreeBackend, VerifyOutputs
from .batch import decode_batch
from .loop import PROMPT_INPUTS, decode
from .outputs import Recorder, SpecStats, SpeculativeDecoderOnlyOutput
from .request import Request
from .static import StaticTreeRunner, release_runner, static_runner

__all__ = ["decode", "decode_batch", "Request", "BatchEagerBackend", "PROMPT_INPUTS", "TreeBackend", "EagerBackend", "StaticBackend", "VerifyOutputs",
           "Recorder", "SpecStats", "SpeculativeDecoderOnlyOutput", "StaticTreeRunner", "static_runner",
           "release_runner"]
