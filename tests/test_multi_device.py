"""A target split over devices (accelerate device_map / dispatch_model): layers on the GPU and on the CPU.

Runs where CUDA is available (the lent H200 here); the multi-GPU variant needs a machine with 2+ GPUs.
"""

import pytest
import torch

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import tiny_model

from drafting import RandomTreeDrafter

GPUS = torch.cuda.device_count()


def split(model, devices):
    from accelerate import dispatch_model

    layers = model.model.layers
    half = len(layers) // 2
    device_map = {"model.embed_tokens": devices[0], "lm_head": devices[-1]}
    for name, _ in model.model.named_children():
        if name not in ("embed_tokens", "layers"):
            device_map[f"model.{name}"] = devices[-1]
    for i in range(len(layers)):
        device_map[f"model.layers.{i}"] = devices[0] if i < half else devices[-1]
    return dispatch_model(model, device_map=device_map)


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
    for cfg in (H.AssistantConfig(), H.AssistantConfig(compile=True)):
        out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                             custom_generate=H.speculative_generate, assistant_config=cfg)
        assert torch.equal(out, ref)
