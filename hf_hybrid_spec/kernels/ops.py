"""The op registry: one entry per public op, with its implementation per backend.

Each op folder (`gated_delta_rule/`, `conv/`, `mamba2/`, `mamba1/`, `attention/`) has the same shape: `naive.py`
(the recurrence or the definition, node by node: the test oracle), `torch_tree.py` (closed form or vectorized
PyTorch: the CPU path), `triton_tree.py` (the Triton kernel, where there is one) and `triton_branch.py` (the
branch-by-branch baseline with a state per node, where it exists, for benchmarks), and its `__init__` registers
its ops here. A public op (`kernels.tree_gated_delta_rule`, ...) dispatches on the tensors' device and the backend in
effect (`backend.resolve`); an op without a Triton kernel runs its PyTorch form under the triton backend.

Triton implementations are named as "module:function" (relative to this package) and imported on first use, so that
importing the package never needs triton.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backend import resolve

__all__ = ["Op", "register", "get", "implementation", "run_commit", "registered"]


@dataclass(frozen=True)
class Op:
    """One op: its name and its implementations (`triton`: "module:function", or None where there is none)."""

    name: str
    naive: Callable
    torch: Callable
    triton: str | None = None


_OPS: dict[str, Op] = {}


def register(*ops: Op) -> None:
    for op in ops:
        if op.name in _OPS and _OPS[op.name] != op:
            raise ValueError(f"op {op.name!r} is already registered")
        _OPS[op.name] = op


def registered() -> list[str]:
    return sorted(_OPS)


def get(name: str) -> Op:
    if name not in _OPS:
        raise KeyError(f"no op {name!r}; registered: {registered()}")
    return _OPS[name]


@functools.cache
def _triton(path: str) -> Callable:
    module, function = path.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def implementation(name: str, device: torch.device) -> Callable:
    """The implementation of op `name` for tensors on `device`."""
    op = get(name)
    backend = resolve(device)
    if backend == "naive":
        return op.naive
    if backend == "torch" or op.triton is None:
        return op.torch
    kernel = _triton(op.triton)
    # Triton launches on the current device's stream: tensors on cuda:1 while cuda:0 is current (a model split over
    # GPUs by device_map) must run with their own device made current.
    if device.index is None or device.index == torch.cuda.current_device():
        return kernel
    return functools.partial(_on_device, kernel, device)


def _on_device(kernel, device: torch.device, *args, **kwargs):
    with torch.cuda.device(device):
        return kernel(*args, **kwargs)


def run_commit(name: str, device: torch.device, args: tuple, on_path: torch.Tensor | None,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """Run commit op `name`; only the PyTorch forms read the path mask (the others find the path from the parents on
    the device), and a caller that has it spares them the walk.

    into: where to write the new state (it may be the initial state itself); None: a new tensor. The Triton kernels
    write it directly (each program reads its state tile before it writes it, so in place is safe), which spares a
    copy of the whole state per layer and step: at B = 64 on a ~2B model that copy moved 256 MB per layer."""
    op = get(name)
    impl = implementation(name, device)
    if into is not None and impl is not op.torch and impl is not op.naive:
        return impl(*args, into=into)
    new = impl(*args, on_path=on_path) if on_path is not None and impl is op.torch else impl(*args)
    if into is None:
        return new
    into.copy_(new)
    return into
