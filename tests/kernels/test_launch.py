"""The cached Triton launch (`kernels.launch`): which calls reuse a compiled kernel and what its launcher receives.

A fake JIT function stands in for Triton's (no GPU here): it records every trip through `kernel[grid](...)` (Triton's
entry point, which compiles) and every direct call of the compiled kernel's launcher. The GPU tests
(`test_kernels_gpu.py`) run the real kernels through the same path against their references.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from hf_hybrid_spec.kernels import launch as launch_module
from hf_hybrid_spec.kernels.launch import launch, set_cached_launch

pytest.importorskip("triton")


def _kernel_fn(x, y, n, scale, flag, BLOCK, MODE="a"):  # noqa: N803 (constexprs as Triton names them)
    pass


class _Param:
    def __init__(self, name: str):
        self.name = name
        self.is_constexpr = name.isupper()


class _Compiled:
    def __init__(self, owner):
        self.owner = owner
        self.function = object()
        self.packed_metadata = ("meta",)

    def run(self, *launch_args):
        self.owner.direct.append(launch_args)


class FakeJit:
    """Enough of `triton.JITFunction` for `launch`: fn, params, device_caches and `kernel[grid](...)`."""

    def __init__(self):
        self.fn = _kernel_fn
        self.params = [_Param(name) for name in inspect.signature(_kernel_fn).parameters]
        self.device_caches = {}
        self.compiles = []  # (grid, args, kwargs) of each trip through Triton's entry point
        self.direct = []  # the arguments of each direct launcher call

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            return _Compiled(self)
        return run


@pytest.fixture
def fake_runtime(monkeypatch):
    """The current device 0 and stream 1234, no launch hooks."""
    runtime = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(launch_module, "_runtime", (lambda: 0, lambda device: 1234, runtime))
    previous = set_cached_launch(True)
    yield runtime
    set_cached_launch(previous)


def _call(kernel, x, y, n=32, scale=0.5, flag=True, block=64, **kwargs):
    launch(kernel, (3, 2), x, y, n, scale, flag, BLOCK=block, **kwargs)


def test_second_call_launches_the_compiled_kernel_directly(fake_runtime):
    kernel = FakeJit()
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    _call(kernel, x, y)
    assert len(kernel.compiles) == 1 and not kernel.direct
    _call(kernel, x + 1, y, n=48, scale=0.25)  # another tensor, another multiple of 16, another float: same kernel
    assert len(kernel.compiles) == 1 and len(kernel.direct) == 1
    gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, *values = kernel.direct[0]
    assert (gx, gy, gz, stream) == (3, 2, 1, 1234)
    assert metadata == ("meta",) and (launch_metadata, enter, leave) == (None, None, None)
    # Every parameter in order, constexprs and defaults included, as Triton's JIT hands them to the launcher.
    assert values[2:] == [48, 0.25, True, 64, "a"]
    assert values[0] is not x and torch.equal(values[0], x + 1)


@pytest.mark.parametrize("change", [
    "dtype", "misaligned", "equal_to_1", "not_multiple_of_16", "wide_int", "constexpr", "default_constexpr", "none",
    "bool", "option",
])
def test_every_specialization_change_goes_through_triton(fake_runtime, change):
    kernel = FakeJit()
    x, y = torch.zeros(64), torch.zeros(8, dtype=torch.int32)
    _call(kernel, x, y)
    _call(kernel, x, y)
    assert len(kernel.compiles) == 1 and len(kernel.direct) == 1
    variants = {
        "dtype": lambda: _call(kernel, x.double(), y),
        "misaligned": lambda: _call(kernel, x[1:], y),  # 4 bytes past a 16-byte boundary
        "equal_to_1": lambda: _call(kernel, x, y, n=1),
        "not_multiple_of_16": lambda: _call(kernel, x, y, n=33),
        "wide_int": lambda: _call(kernel, x, y, n=1 << 32),
        "constexpr": lambda: _call(kernel, x, y, block=128),
        "default_constexpr": lambda: _call(kernel, x, y, MODE="b"),
        "none": lambda: _call(kernel, x, None),
        "bool": lambda: _call(kernel, x, y, flag=False),
        "option": lambda: _call(kernel, x, y, num_warps=8),
    }
    variants[change]()
    assert len(kernel.compiles) == 2, change
    variants[change]()  # now cached too
    assert len(kernel.compiles) == 2 and len(kernel.direct) == 2


def test_options_reach_triton_not_the_launcher(fake_runtime):
    kernel = FakeJit()
    x, y = torch.zeros(8), torch.zeros(8)
    _call(kernel, x, y, num_warps=4)
    assert kernel.compiles[0][2] == {"BLOCK": 64, "num_warps": 4}
    _call(kernel, x, y, num_warps=4)
    assert len(kernel.direct[0]) == 9 + 7


@pytest.mark.parametrize("why", ["off", "hook", "unbound", "tuple_argument"])
def test_falls_back_to_triton(fake_runtime, why):
    kernel = FakeJit()
    x, y = torch.zeros(8), torch.zeros(8)
    if why == "off":
        set_cached_launch(False)
    elif why == "hook":
        fake_runtime.launch_enter_hook = lambda metadata: None
    for _ in range(3):
        if why == "unbound":
            launch(kernel, (1,), x, y, 1, 0.5)  # flag and BLOCK missing: Triton's call reports it
        elif why == "tuple_argument":
            launch(kernel, (1,), x, (y, y), 1, 0.5, True, BLOCK=16)
        else:
            _call(kernel, x, y)
    assert len(kernel.compiles) == 3 and not kernel.direct


def test_interpreter_and_unknown_kernels_go_through_triton(fake_runtime):
    class Unknown:
        calls = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                Unknown.calls += 1
            return run

    for _ in range(2):
        launch(Unknown(), (1,), 1, 2)
    assert Unknown.calls == 2


def _heuristic_kernel(x, n, num_nodes, BLOCK: "tl.constexpr", USE_NUM_NODES: "tl.constexpr"):  # noqa: N803
    pass


def test_heuristics_become_keyed_constexprs():
    """A `@triton.heuristics` kernel (as the tree kernels are) is unwrapped into its JIT function plus the constexprs
    the heuristics compute, which the key then holds by value. Built as a real JITFunction (the suite runs under the
    interpreter, whose `triton.jit` gives none)."""
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction

    jit = JITFunction(_heuristic_kernel)
    kernel = Heuristics(jit, jit.arg_names, {"USE_NUM_NODES": lambda args: args["num_nodes"] is not None})
    for nodes, expected in ((None, False), (torch.ones(2), True)):
        inner, kwargs = launch_module._unwrap_heuristics(kernel, (torch.zeros(4), 8), {"num_nodes": nodes,
                                                                                        "BLOCK": 16})
        assert inner is jit and kwargs["USE_NUM_NODES"] is expected and kwargs["BLOCK"] == 16
    plan = launch_module._plan(jit)
    assert plan.usable
    assert [name for name, i in plan.index.items() if plan.constexpr[i]] == ["BLOCK", "USE_NUM_NODES"]
    assert launch_module._bind(plan, (torch.zeros(4), 8), kwargs)[0][1:] == [8, kwargs["num_nodes"], 16, True]
