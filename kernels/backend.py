"""Which implementation the public ops run: Triton kernels, closed-form PyTorch, or the naive oracle.

`auto` (the default) picks Triton for CUDA tensors when Triton imports, and the closed-form PyTorch path
otherwise. Force one with `set_backend("torch")`, the context manager `use_backend(...)`, or the
environment variable HF_HYBRID_SPEC_KERNELS=auto|triton|torch|naive.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

BACKENDS = ("auto", "triton", "torch", "naive")
_backend = os.environ.get("HF_HYBRID_SPEC_KERNELS", "auto")
if _backend not in BACKENDS:
    raise ValueError(f"HF_HYBRID_SPEC_KERNELS must be one of {BACKENDS}, got {_backend!r}")


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def use_backend(name: str):
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(device: torch.device) -> str:
    """The concrete backend for tensors on `device`."""
    if _backend != "auto":
        if _backend == "triton" and not triton_available():
            raise RuntimeError("the triton kernel backend was requested but triton is not installed")
        return _backend
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"
