import functools
import os

import torch

# Triton kernels run in the interpreter on CPU-only machines. transformers imports triton (through
# torch._dynamo) as soon as it loads, so this must be set before anything imports transformers.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hf_hybrid_spec.testing import fixture_path  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() == "true"


@functools.cache
def _load_fixture(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fixture_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def load_fixture(name: str):
    """(model, tokenizer) of a trained fixture; skips where ../shared/models is absent, fails in CI."""
    if fixture_path(name) is None:
        message = f"fixture model {name} not found (expected in ../shared/models)"
        if IN_CI:
            pytest.fail(message + " and CI=true: the fixtures must be present in CI")
        pytest.skip(message)
    return _load_fixture(name)


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
