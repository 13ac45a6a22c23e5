"""Find the illegal memory access seen on the H200 with the ~2B Qwen3.5-shaped random model (bf16).

Each stage runs in its own process (an illegal access poisons the CUDA context), with CUDA_LAUNCH_BLOCKING=1
so the traceback names the failing op:

    sdpa:<backend>   SDPA alone at the 2B attention shape (head_dim 256, GQA 8/2) with tree masks of every
                     size 1..64 over prefixes of 400..410 tokens, vs the math backend
    e2e:<kernels>    speculative generate (suffix drafter, eager path, then the graphs path, then eager again)
                     with HF_HYBRID_SPEC_KERNELS=<kernels>

Usage: python scripts/diag_2b.py [stage ...]   (no stage: all)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback

STAGES = ["sdpa:default", "sdpa:efficient", "sdpa:cudnn", "e2e:triton", "e2e:torch"]


def sdpa_stage(backend: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    backends = {"efficient": [SDPBackend.EFFICIENT_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
                "math": [SDPBackend.MATH]}
    worst = 0.0
    for n in range(1, 65):
        for p in range(400, 411, 5):
            q = torch.randn(1, 8, n, 256, device=dev, dtype=dt)
            k = torch.randn(1, 8, p + n, 256, device=dev, dtype=dt)
            v = torch.randn(1, 8, p + n, 256, device=dev, dtype=dt)
            allowed = torch.ones(n, p + n, dtype=torch.bool, device=dev)
            allowed[:, p:] = torch.rand(n, n, device=dev) < 0.3
            allowed[:, p:] |= torch.eye(n, dtype=torch.bool, device=dev)
            mask = torch.zeros(1, 1, n, p + n, dtype=dt, device=dev).masked_fill_(~allowed, torch.finfo(dt).min)
            with sdpa_kernel(backends["math"]):
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()
            if backend == "default":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                with sdpa_kernel(backends[backend]):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.cuda.synchronize()
            worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
    print(f"sdpa:{backend} ok, worst rel err {worst:.2e}")


def e2e_stage(kernels: str) -> None:
    import torch

    from hf_hybrid_spec import AssistantConfig, speculative_generate
    from hf_hybrid_spec.bench import encode_prompts, load_model, warm_up_tree_sizes

    model, _ = load_model("random:qwen3_5-2b", torch.bfloat16, "cuda")
    ids = encode_prompts(None, 1, "cuda", model.config.vocab_size, 400)[0]
    kw = {"max_new_tokens": 64, "min_new_tokens": 64, "eos_token_id": None, "do_sample": False}
    ref = model.generate(ids, **kw)
    for step, compile_ in enumerate([False, False, True, False, True, False]):
        cfg = AssistantConfig(drafter="suffix", compile=compile_)
        t = time.perf_counter()
        if step == 0:
            warm_up_tree_sizes(model, ids, cfg)
        out = model.generate(ids, custom_generate=speculative_generate, assistant_config=cfg,
                             return_dict_in_generate=True, **kw)
        torch.cuda.synchronize()
        st = out.spec_stats
        print(f"e2e:{kernels} step {step} compile={compile_}: {time.perf_counter() - t:.1f}s "
              f"forwards={st.target_forwards} same_as_greedy={torch.equal(out.sequences, ref)}", flush=True)
    print(f"e2e:{kernels} ok")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        kind, arg = sys.argv[2].split(":")
        try:
            (sdpa_stage if kind == "sdpa" else e2e_stage)(arg)
        except BaseException:  # noqa: BLE001 (report any failure, then exit non-zero)
            traceback.print_exc()
            sys.exit(1)
        return
    for stage in sys.argv[1:] or STAGES:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        if stage.startswith("e2e:"):
            env["HF_HYBRID_SPEC_KERNELS"] = stage.split(":")[1]
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", stage], env=env, capture_output=True, text=True,
                              check=False)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        keep = [ln for ln in lines if not ln.startswith("[transformers]") and "warn" not in ln.lower()]
        print(f"=== {stage}: rc={proc.returncode} ({time.perf_counter() - t:.0f}s)")
        print("\n".join(keep[-30:]), flush=True)


if __name__ == "__main__":
    main()
