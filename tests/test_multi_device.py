"""A target split over devices (accelerate device_map / dispatch_model): layers on the GPU and on the CPU.

Runs where CUDA is available (the lent H200 here); the multi-GPU variant needs a machine with 2+ GPUs.
"""

import pytest
import torch

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import layer_split_device_map, tiny_model

from drafting import RandomTreeDrafter

GPUS = torch.cuda.device_count()


def split(model, devices):
    from accelerate import dispatch_model

    return dispatch_model(model, device_map=layer_split_device_map(model, devices))


@pytest.mark.skipif(GPUS < 1, reason="needs a GPU (layers split between cuda:0 and the CPU)")
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
@pytest.mark.parametrize("compile_", [False, True])
def test_target_split_between_gpu_and_cpu(family, compile_):
    model = split(tiny_model(family), [0, "cpu"])
    ids = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    ref = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate, drafter=RandomTreeDrafter(96, reference=ref.cpu()),
                         assistant_config=H.AssistantConfig(compile=compile_))
    assert torch.equal(out, ref)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_target_split_over_two_gpus(family):
    model = split(tiny_model(family), [0, 1])
    ids = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    ref = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    # Random trees over the reference: accepted and rejected nodes in every step, on layers of both GPUs (the
    # second half's tree kernels run on cuda:1 while cuda:0 is current).
    for compile_ in (False, True):
        for drafter in (None, RandomTreeDrafter(96, reference=ref.cpu())):
            out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 custom_generate=H.speculative_generate, drafter=drafter,
                                 assistant_config=H.AssistantConfig(compile=compile_))
            assert torch.equal(out, ref), (compile_, drafter)
