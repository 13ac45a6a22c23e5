"""Launch a Triton kernel from Python for a few microseconds of host time: `launch(kernel, grid, *args, **kwargs)`.

`kernel[grid](*args, **kwargs)` goes through Triton's JIT entry point on every call: it binds the arguments, builds a
specialization key (and its string form), looks the compiled kernel up, reads the runtime knobs and the current
stream, and only then calls the compiled kernel's launcher. On the H200 machine's host (Triton 3.6) that path cost
~60-140 us per launch, 3-30x the tree kernels' own GPU time at B = 1, and the eager path (`compile=False`) pays it for
every recurrent layer, twice per step (tree op and commit).

Here the first call of a kernel with a given specialization goes through `kernel[grid](...)` as usual (it compiles and
launches) and keeps the compiled kernel it returns; later calls with the same specialization call that compiled
kernel's launcher directly, as `CompiledKernel.__getitem__` does. The key holds everything Triton specializes on, and
more (a finer key only costs an extra trip through Triton): the current device, each constexpr's value, each
tensor's dtype and 16-byte alignment, each integer's equality to 1, divisibility by 16 and width, which arguments are
None, and the launch options (`num_warps`, ...). A `@triton.heuristics` kernel is launched as its JIT function
with the constexprs its heuristics compute (as `Heuristics.run` does), so those are keyed by value too. Anything else (a tuple argument, a launch hook installed by a
profiler, the Triton interpreter, a trace by torch.compile, a Triton without these attributes) goes through
`kernel[grid](...)` every time.

`HF_HYBRID_SPEC_TRITON_LAUNCH=jit` (or `set_cached_launch(False)`) sends every launch through Triton's entry point, for
checking and for A/B timings (`benchmarks/tree_kernels.py --launch-costs`).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import torch

__all__ = ["launch", "set_cached_launch", "cached_launch_enabled"]

_enabled = os.environ.get("HF_HYBRID_SPEC_TRITON_LAUNCH", "cached") != "jit"
_MISSING = object()
_PLAN_ATTR = "_hf_hybrid_spec_launch_plan"
_I32 = (-(1 << 31), 1 << 31)
_U64 = 1 << 63


def set_cached_launch(enabled: bool) -> bool:
    """Turn the cached launch on or off for the process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def cached_launch_enabled() -> bool:
    return _enabled


@dataclass
class _Plan:
    """What one kernel's cached launches need, built once per kernel.

    Attributes:
        index: parameter name -> position. constexpr: per parameter, whether it is a constexpr (keyed by value).
        defaults: per parameter, its default or _MISSING. compiled: specialization key -> compiled kernel.
        usable: False where this kernel always goes through Triton (the interpreter, an unknown Triton API).
    """

    index: dict[str, int]
    constexpr: tuple[bool, ...]
    defaults: tuple
    compiled: dict = field(default_factory=dict)
    usable: bool = True


def _plan(kernel) -> _Plan:
    plan = getattr(kernel, _PLAN_ATTR, None)
    if plan is not None:
        return plan
    params = getattr(kernel, "params", None)
    fn = getattr(kernel, "fn", None)
    if params is None or fn is None or not hasattr(kernel, "device_caches"):  # the interpreter's kernels, or unknown
        plan = _Plan(index={}, constexpr=(), defaults=(), usable=False)
    else:
        signature = inspect.signature(fn).parameters.values()
        plan = _Plan(
            index={p.name: i for i, p in enumerate(signature)},
            constexpr=tuple(bool(p.is_constexpr) for p in params),
            defaults=tuple(_MISSING if p.default is inspect.Parameter.empty else p.default for p in signature),
        )
        if len(plan.constexpr) != len(plan.defaults):
            plan.usable = False
    setattr(kernel, _PLAN_ATTR, plan)
    return plan


def _bind(plan: _Plan, args: tuple, kwargs: dict) -> tuple[list, tuple] | None:
    """The kernel's arguments in parameter order (defaults filled in) and the launch options; None if they do not
    bind (Triton's own call then raises its error)."""
    values = list(args)
    count = len(plan.defaults)
    if len(values) > count:
        return None
    values.extend([_MISSING] * (count - len(values)))
    options = []
    for name, value in kwargs.items():
        i = plan.index.get(name)
        if i is None:
            options.append((name, value))
        elif values[i] is not _MISSING:
            return None
        else:
            values[i] = value
    for i, value in enumerate(values):
        if value is _MISSING:
            if plan.defaults[i] is _MISSING:
                return None
            values[i] = plan.defaults[i]
    return values, tuple(options)


def specialization_key(plan: _Plan, values: list, options: tuple, device) -> tuple | None:
    """A key at least as fine as Triton's specialization of these arguments; None where an argument is of a kind
    this module does not key (it then launches through Triton)."""
    key = [device, options]
    for value, constexpr in zip(values, plan.constexpr):
        if constexpr:
            key.append(value)
        elif isinstance(value, torch.Tensor):
            key.append((value.dtype, value.data_ptr() % 16 == 0))
        elif value is None:
            key.append(None)
        elif isinstance(value, bool):
            key.append(("b", value))
        elif isinstance(value, int):
            key.append((value == 1, value % 16 == 0, _I32[0] <= value < _I32[1], value >= _U64))
        elif isinstance(value, float):
            key.append(float)
        else:
            return None
    return tuple(key)


def _unwrap_heuristics(kernel, args: tuple, kwargs: dict):
    """A `@triton.heuristics` kernel as its JIT function and the constexprs the heuristics compute, as
    `Heuristics.run` computes them (each from the arguments and the values computed before it)."""
    from triton.runtime.autotuner import Heuristics

    while isinstance(kernel, Heuristics):
        kwargs = dict(kwargs)
        named = dict(zip(kernel.arg_names, args))
        for name, heuristic in kernel.values.items():
            kwargs[name] = heuristic({**named, **kwargs})
        kernel = kernel.fn
    return kernel, kwargs


_runtime = None  # (get_current_device, get_current_stream, knobs.runtime), read once


def _triton_runtime():
    global _runtime
    if _runtime is None:
        from triton import knobs
        from triton.runtime import driver

        _runtime = (driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime)
    return _runtime


def launch(kernel, grid: tuple[int, ...], *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`, with the compiled kernel's launcher called directly once this specialization
    has been launched through Triton (see the module docstring). Returns nothing."""
    plan = None
    if _enabled and not torch.compiler.is_compiling():
        kernel, kwargs = _unwrap_heuristics(kernel, args, kwargs)
        plan = _plan(kernel)
    if plan is None or not plan.usable:  # off, the interpreter, or traced by torch.compile (which knows Triton's call)
        kernel[grid](*args, **kwargs)
        return
    bound = _bind(plan, args, kwargs)
    if bound is None:
        kernel[grid](*args, **kwargs)  # Triton raises its own error for arguments that do not bind
        return
    values, options = bound
    current_device, current_stream, runtime = _triton_runtime()
    if runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None:
        kernel[grid](*args, **kwargs)  # a profiler's hooks see every launch
        return
    device = current_device()
    key = specialization_key(plan, values, options, device)
    compiled = plan.compiled.get(key) if key is not None else None
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if key is not None and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            plan.compiled[key] = compiled
        return
    gx = grid[0]
    gy = grid[1] if len(grid) > 1 else 1
    gz = grid[2] if len(grid) > 2 else 1
    compiled.run(gx, gy, gz, current_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                 *values)
