"""A target split over devices (accelerate device_map / dispatch_model): offloaded layers (CPU), layers on the
GPU and on the CPU (needs CUDA), layers on two GPUs (needs 2+ GPUs).
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import RandomTreeDrafter, identity_failures

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import layer_split_device_map, tiny_model

GPUS = torch.cuda.device_count()


def split(model, devices):
    from accelerate import dispatch_model

    return dispatch_model(model, device_map=layer_split_device_map(model, devices))


@pytest.mark.slow
@pytest.mark.skipif(GPUS > 0, reason="a CPU test: where CUDA is present, fla's Triton kernels take over parts of "
                                      "transformers' stock forward, which then fails on CPU tensors")
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_target_with_offloaded_layers_on_cpu(family, tmp_path):
    """accelerate offload (weights on meta between forwards, brought in by hooks): the CPU stand-in for a
    device_map that does not fit; tree forwards bypass the stock forward, so they must run the hooks."""
    from accelerate import dispatch_model

    model = tiny_model(family)
    ids = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    whole = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    model = dispatch_model(model, device_map=layer_split_device_map(model, ["cpu", "disk"]), main_device="cpu",
                           offload_dir=str(tmp_path))
    assert any(p.is_meta for p in model.parameters())
    assert torch.equal(model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None), whole)
    assert identity_failures(model, ids) == []


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
    # The second half's tree kernels run on cuda:1 while cuda:0 is current.
    assert identity_failures(model, ids) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_tensor_parallel_tp_plan_auto(family, tmp_path):
    """transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")`), 2 processes: gloo on CPU
    (NCCL where there are 2 GPUs); each rank runs the same speculative loop on its shard of the model."""
    from transformers import AutoConfig

    if not getattr(AutoConfig.for_model(family), "base_model_tp_plan", None):
        pytest.skip(f"this transformers has no tensor-parallel plan for {family}")
    tiny_model(family, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker, str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if GPUS < 2:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a one-GPU machine: both ranks on the CPU
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if run.returncode != 0 and "terminate called without an active exception" in run.stderr:
        # Seen once in a CI run on the 2-core machine (three reruns passed): a rank aborted in process teardown;
        # one more try. Anything else, or the same twice, fails.
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("identical") == 2, run.stdout
