"""How many of the target's greedy tokens an EAGLE drafter's reduced vocabulary can propose at all (its t2d map),
on the first 8 HumanEval prompts and the first 8 built-in code prompts, 48 new tokens each, fp32 on CPU.
Usage: python benchmarks/eagle_vocab_coverage.py   (both fixtures and their committed drafters)"""
import sys

import torch

sys.path.insert(0, "recipes")
from eval_eagle import humaneval_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_hybrid_spec.eagle import EagleDrafter
from hf_hybrid_spec.prompts import code_prompts

torch.set_num_threads(2)
for fx in ("qwen3_5-small", "falcon_h1-small"):
    M = f"../shared/models/{fx}"
    model = AutoModelForCausalLM.from_pretrained(M, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(M)
    d = EagleDrafter.from_pretrained(f"checkpoints/drafters/{fx}-eagle3", dtype=torch.float32)
    t2d = d.t2d.bool() if hasattr(d, "t2d") else None
    for name, prompts in (("humaneval", humaneval_prompts()[:8]), ("code", code_prompts()[:8])):
        inv = tot = 0
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            out = model.generate(ids, do_sample=False, max_new_tokens=48, min_new_tokens=48, eos_token_id=None)
            new = out[0, ids.shape[1]:]
            inv += int(t2d[new].sum()); tot += new.numel()
        print(fx, name, f"draft-vocab coverage of the target's greedy tokens: {inv/tot:.3f} ({tot} tokens)", flush=True)
