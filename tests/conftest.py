"""Shared pytest setup: the Triton interpreter on CPU machines, this folder and benchmarks/ importable (the shared
helpers are in `helpers.py`), a fixed seed per test, and the `one_thread` fixture.

Markers: `slow` (seconds each: fixtures, statistical tests, recipes, concurrency, subprocesses) and `gpu`. A quick run
of the rest: `python -m pytest -q tests -m "not slow"`.
"""

import os
import sys
from pathlib import Path

import torch

# Triton kernels run in the interpreter on CPU-only machines. transformers imports triton (through
# torch._dynamo) as soon as it loads, so this must be set before anything imports transformers.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS.parent / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Run a module single-threaded (restored afterwards): its models are small, and on a shared 2-core CPU OpenMP
    threads spinning against each other make such forwards many times slower. Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
