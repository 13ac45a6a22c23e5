"""Probe (device run 28): where the "rest" of an EAGLE step goes under recipes/eval_eagle.py --compile on the H200.

Run 27 timed eval_eagle's EAGLE tree at 1.8 ms drafting + 1.8 ms verifying but 31-44 ms of "rest" per target forward
(the suffix method 0.4-0.6 ms); probe run 25 timed the same configuration, called twice on one prompt, at ~2 ms/token.
This calls each method twice on each of a few new prompts and splits each call into prefill, drafter begin, drafter
accepts, Triton compiles (JIT cache misses) and graph captures.
Usage: python scripts/probe_eval_rest.py MODEL DRAFTER
"""
import contextlib
import sys
import time
from collections import defaultdict

import torch
import triton.runtime.jit as tjit
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_hybrid_spec as H
import hf_hybrid_spec.generate as G
from hf_hybrid_spec import static as S
from hf_hybrid_spec.eagle import EagleDrafter
from hf_hybrid_spec.eagle import drafter as ED
from hf_hybrid_spec.prompts import code_prompts

sys.path.insert(0, "recipes")
from eval_eagle import humaneval_prompts  # noqa: E402

T = defaultdict(float)
N = defaultdict(int)


def timed(name, fn):
    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize()
        T[name] += time.perf_counter() - t
        N[name] += 1
        return r
    return wrapper


tjit.JITFunction._do_compile = timed("triton_compile", tjit.JITFunction._do_compile)
G.forward_tokens = timed("prefill", G.forward_tokens)
drafter_cls = ED.EagleTreeDrafter
drafter_cls.begin = timed("begin", drafter_cls.begin)
drafter_cls.accept = timed("accept", drafter_cls.accept)
S.StaticTreeRunner._capture = timed("verify_capture", S.StaticTreeRunner._capture)

M, E = sys.argv[1], sys.argv[2]
dtype = torch.bfloat16
model = AutoModelForCausalLM.from_pretrained(M, dtype=dtype, attn_implementation="sdpa").to("cuda").eval()
tok = AutoTokenizer.from_pretrained(M)
dr = EagleDrafter.from_pretrained(E, dtype=dtype).to("cuda").eval()
cfgs = {"tree60": H.AssistantConfig(drafter="eagle", max_draft_tokens=60, max_depth=6, draft_top_k=10, compile=True),
        "chain6": H.AssistantConfig(drafter="eagle", max_draft_tokens=6, max_depth=6, draft_top_k=1, compile=True),
        "suffix": H.AssistantConfig(drafter="suffix", compile=True),
        "sfx_eager": H.AssistantConfig(drafter="suffix")}
prompts = humaneval_prompts()[:4] + code_prompts()[:2]
longest = max(prompts, key=lambda p: len(tok(p).input_ids))
kw = dict(max_new_tokens=128, min_new_tokens=128, eos_token_id=None, do_sample=False, return_dict_in_generate=True,
          custom_generate=H.speculative_generate)
print(f"drafter class {drafter_cls.__name__}; prompt lengths {[len(tok(p).input_ids) for p in prompts]}")


def call(name, text):
    ids = tok(text, return_tensors="pt").input_ids.cuda()
    T.clear(), N.clear()
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_config=cfgs[name],
                         draft_model=None if "s" in name[:1] else dr, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    s = out.spec_stats
    parts = " ".join(f"{k} {1e3 * v:.0f}ms/{N[k]}" for k, v in sorted(T.items()))
    print(f"  {name:<7} wall {1e3 * wall:7.0f} ms  fwd {s.target_forwards:3d}  draft {1e3 * s.draft_seconds:6.0f}  verify "
          f"{1e3 * s.verify_seconds:6.0f}  | {parts}", flush=True)


print("warm-up (longest prompt)")
for name in cfgs:
    call(name, longest)
fixed = G.sdpa_without_cudnn
for i, p in enumerate(prompts):
    # Run 29: the first half as shipped (cuDNN attention off inside speculative_generate), the second with it allowed.
    cudnn = i >= len(prompts) // 2
    G.sdpa_without_cudnn = contextlib.nullcontext if cudnn else fixed
    print(f"prompt {i} ({len(tok(p).input_ids)} tokens), cuDNN attention {'allowed' if cudnn else 'off'}")
    for rep in range(2):
        for name in cfgs:
            call(name, p)
