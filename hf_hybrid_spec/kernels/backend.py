"""Which implementation the public ops run: Triton kernels, closed-form PyTorch, or the naive oracle.

`auto` (the default) picks Triton for CUDA tensors when Triton imports, and the closed-form PyTorch path
otherwise. Force one for the process with `set_backend("torch")` or the environment variable
HF_HYBRID_SPEC_KERNELS=auto|triton|torch|naive, or for a block of code with the context manager
`use_backend(...)`.

`use_backend` sets a context variable, not the process default: two threads (two `generate` calls with
different `AssistantConfig.kernel_backend`) each see their own choice, and leaving the block restores exactly
what that thread saw before, whatever the other threads did meanwhile. A new thread starts on the process
default.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

__all__ = ["BACKENDS", "set_backend", "get_backend", "use_backend", "triton_available", "resolve"]

BACKENDS = ("auto", "triton", "torch", "naive")
_default = os.environ.get("HF_HYBRID_SPEC_KERNELS", "auto")
if _default not in BACKENDS:
    raise ValueError(f"HF_HYBRID_SPEC_KERNELS must be one of {BACKENDS}, got {_default!r}")
# None: no `use_backend` block is active in this context, the process default applies.
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar("hf_hybrid_spec_kernel_backend", default=None)


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    """Set the process default (what code outside any `use_backend` block runs)."""
    global _default
    _default = _check(name)


def get_backend() -> str:
    """The backend in effect here: the innermost `use_backend` of this context, else the process default."""
    scoped = _scoped.get()
    return _default if scoped is None else scoped


@contextlib.contextmanager
def use_backend(name: str):
    """Run the block with backend `name`, for this thread / context only."""
    token = _scoped.set(_check(name))
    try:
        yield
    finally:
        _scoped.reset(token)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(device: torch.device) -> str:
    """The concrete backend for tensors on `device`."""
    backend = get_backend()
    if backend != "auto":
        if backend == "triton":
            if not triton_available():
                raise RuntimeError("the triton kernel backend was requested but triton is not installed")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(f"the triton kernel backend runs {device.type} tensors only in the Triton "
                                   "interpreter: set TRITON_INTERPRET=1 before importing triton, or use 'auto'")
        return backend
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"
