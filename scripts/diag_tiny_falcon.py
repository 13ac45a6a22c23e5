"""Tiny Falcon-H1 on the static (CUDA graph) path: syncs after every tree / commit kernel outside capture and prints
it, so a kernel that faults is named. Found the fp32 tree Mamba-2 fault with 16-wide P tiles (Triton 3.6, H200).

    python scripts/diag_tiny_falcon.py fp32|bf16|p32|g2|nographs

fp32 / bf16: the test suite's tiny config in that dtype; p32: head dim 32; g2: two groups; nographs: the static
cache without CUDA graphs. Prints "DONE same" when the output equals stock greedy.
"""

import argparse

import torch

import hf_hybrid_spec as H
import hf_hybrid_spec.kernels as K
from hf_hybrid_spec import static as S
from hf_hybrid_spec.testing import tiny_model

OVERRIDES = {"p32": {"mamba_d_head": 32, "mamba_d_ssm": 128}, "g2": {"mamba_n_groups": 2}}


def traced(impl):
    """Wrap the kernel dispatcher: sync before and after each op (outside capture) and print it."""

    def lookup(op, device):
        fn = impl(op, device)

        def run(*args, **kwargs):
            capturing = torch.cuda.is_current_stream_capturing()
            if not capturing:
                torch.cuda.synchronize()
            out = fn(*args, **kwargs)
            if not capturing:
                torch.cuda.synchronize()
            shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in args][:6]
            print("ok", op, "capturing" if capturing else "", shapes, flush=True)
            return out

        return run

    return lookup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["fp32", "bf16", "p32", "g2", "nographs"])
    mode = parser.parse_args().mode
    K._impl = traced(K._impl)
    if mode == "nographs":
        init = S.StaticTreeRunner.__init__

        def no_graphs(self, *args, **kwargs):
            kwargs["use_graphs"] = False
            init(self, *args, **kwargs)

        S.StaticTreeRunner.__init__ = no_graphs
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = tiny_model("falcon_h1", dtype=dtype, **OVERRIDES.get(mode, {})).cuda()
    ids = torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(0)).cuda()
    kw = {"max_new_tokens": 24, "do_sample": False, "eos_token_id": None}
    ref = model.generate(ids, **kw)
    out = model.generate(ids, custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(compile=True, drafter="ngram"), **kw)
    torch.cuda.synchronize()
    print("DONE", "same" if torch.equal(out, ref) else "MISMATCH", mode)


if __name__ == "__main__":
    main()
