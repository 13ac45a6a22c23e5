"""Tiny Falcon-H1 on the static (CUDA graph) path: syncs after every tree / commit kernel outside capture and prints
it, so a kernel that faults is named. Found the fp32 tree Mamba-2 fault with 16-wide P tiles (Triton 3.6, H200).

    python scripts/diag_tiny_falcon.py fp32|bf16|p32|g2|nographs
"""
import argparse

import hf_hybrid_spec.kernels as K
import torch

import hf_hybrid_spec as H
from hf_hybrid_spec import static as S
from hf_hybrid_spec.testing import tiny_model

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("mode", choices=["fp32", "bf16", "p32", "g2", "nographs"])
mode = parser.parse_args().mode
orig = K._impl
def traced(op, device):
    fn = orig(op, device)
    def run(*a, **k):
        cap = torch.cuda.is_current_stream_capturing()
        if not cap:
            torch.cuda.synchronize()
        out = fn(*a, **k)
        if not cap:
            torch.cuda.synchronize()
        print("ok", op, "capturing" if cap else "", [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in a][:6], flush=True)
        return out
    return run
K._impl = traced
over = {}
dtype = torch.float32
if mode == "bf16": dtype = torch.bfloat16
if mode == "p32": over = dict(mamba_d_head=32, mamba_d_ssm=128)
if mode == "g2": over = dict(mamba_n_groups=2)
if mode == "nographs":
    init = S.StaticTreeRunner.__init__
    def no_graphs(self, *a, **k):
        k["use_graphs"] = False
        init(self, *a, **k)
    S.StaticTreeRunner.__init__ = no_graphs
model = tiny_model("falcon_h1", dtype=dtype, **over).cuda()
ids = torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(0)).cuda()
ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, custom_generate=H.speculative_generate,
                     assistant_config=H.AssistantConfig(compile=True, drafter="ngram"))
torch.cuda.synchronize()
print("DONE", "same" if torch.equal(out, ref) else "MISMATCH", mode)
