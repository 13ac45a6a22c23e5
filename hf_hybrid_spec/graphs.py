"""What the static verify runner and the static drafters share: CUDA graph capture, and leases on kept storage.

`capture(fn, pool, device)` warms `fn` up on a side stream (Triton compiles, cuBLAS picks algorithms), then records
one call of it into a `torch.cuda.CUDAGraph` in `pool`, and returns the graph and what that call returned (its
tensors live in the pool and are rewritten by every replay).

`Leased`: static storage is kept across requests (its graphs point at it), so two requests running at the same time
(threads) must never get the same one; a lease marks which request holds it.

`GraphPasses`: a drafter store's passes run eagerly, or captured on first use of their key and replayed after.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["GraphPasses", "Leased", "capture", "clear_cublas_workspaces"]


def clear_cublas_workspaces() -> None:
    """cuBLAS keeps one workspace per (handle, stream) and a captured matmul keeps using the one it saw. Clearing them
    right before a capture makes the capture allocate its own inside the graph's pool (which lives as long as the
    graph), and right after it, so nothing else reuses that one. Without this a graph can point at a workspace that
    someone else frees: torch.compile's CUDA graphs (stock generate with cache_implementation="static") clear all
    workspaces, and replays then hit an illegal address."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU-only builds
    if clear is not None:
        clear()


def capture(fn: Callable[[], Any], pool, device: torch.device, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm `fn` up `warmups` times on a side stream, then capture one call. Returns (graph, fn's output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    clear_cublas_workspaces()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        clear_cublas_workspaces()
    return graph, out


class Leased:
    """Mixin: `lease(owner)` marks the object in use by `owner` (an object that lives as long as the request) until
    `release()`, or until the owner is gone (a request that raised and was dropped)."""

    _owner = None

    def lease(self, owner) -> None:
        self._owner = weakref.ref(owner)

    def release(self) -> None:
        self._owner = None

    @property
    def in_use(self) -> bool:
        return self._owner is not None and self._owner() is not None


class GraphPasses:
    """Mixin for a drafter's fixed-shape storage: `_run(key, fn)` runs `fn()` eagerly without graphs, else replays the
    graph captured on the first call with `key` (the warm-up calls write what the replay writes). At most
    `MAX_GRAPHS` keys of kind "expand" (`key[0]`) are captured; others run eagerly. A capture that fails warns and
    everything runs eagerly from then on: drafting decides only what gets verified, never what is committed.

    The class sets `use_graphs`, `device`, `_graphs = {}` and `_pool = None`; `PASSES` names its passes in warnings.
    """

    MAX_GRAPHS = 4
    PASSES = "drafter"

    def _run(self, key: tuple, fn: Callable[[], Any]):
        if not self.use_graphs:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            if key[0] == "expand" and sum(k[0] == "expand" for k in self._graphs) >= self.MAX_GRAPHS:
                return fn()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                entry = capture(fn, self._pool, self.device)
            except RuntimeError as err:
                logger.warning("capturing a pass of the %s failed (%s); drafting eagerly instead", self.PASSES, err)
                self.use_graphs = False
                return fn()
            self._graphs[key] = entry
        graph, out = entry
        graph.replay()
        return out
