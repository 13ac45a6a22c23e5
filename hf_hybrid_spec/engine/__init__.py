"""The engine: one decode loop (`loop.decode`) over a request's trees, through a backend that verifies them eagerly
(`backend.EagerBackend`) or from captured CUDA graphs over a static cache (`backend.StaticBackend`, on
`static.StaticTreeRunner`), with what it returns and records in `outputs`."""

from .backend import EagerBackend, StaticBackend, TreeBackend, VerifyOutputs
from .loop import PROMPT_INPUTS, Request, decode
from .outputs import Recorder, SpecStats, SpeculativeDecoderOnlyOutput
from .static import StaticTreeRunner, release_runner, static_runner

__all__ = ["decode", "Request", "PROMPT_INPUTS", "TreeBackend", "EagerBackend", "StaticBackend", "VerifyOutputs",
           "Recorder", "SpecStats", "SpeculativeDecoderOnlyOutput", "StaticTreeRunner", "static_runner",
           "release_runner"]
