"""Worker for test_multi_device.test_tensor_parallel: run by torchrun, one process per rank (gloo on CPU, NCCL on
GPUs). Loads a saved tiny model with tp_plan="auto" and checks speculative == plain greedy on every rank.

    torchrun --standalone --nproc_per_node 2 tests/integration/tp_worker.py <saved model dir>
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers
from helpers import identity_failures  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], tp_plan="auto")
rank = dist.get_rank()
sharded = sum(p.numel() for p in model.parameters() if type(p).__name__ == "DTensor")
ids = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(0)).to(model.device)
failures = identity_failures(model, ids)
if failures:
    raise SystemExit(f"rank {rank}: speculative output differs from greedy: {failures}")
print(f"rank {rank}: identical, {sharded} parameters in DTensors")
dist.destroy_process_group()
