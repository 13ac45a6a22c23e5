"""Probe (device run 25): why EAGLE under recipes/eval_eagle.py --compile ran ~10x slower per step than under
scripts/time_eagle_draft.py on the H200. Times one tree / chain call per loading style and prints the step split."""
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_hybrid_spec as H
from hf_hybrid_spec.eagle import EagleDrafter
from hf_hybrid_spec.prompts import code_prompts

M, E = sys.argv[1], sys.argv[2]
dtype = torch.bfloat16
model = AutoModelForCausalLM.from_pretrained(M, dtype=dtype, attn_implementation="sdpa").to("cuda").eval()
tok = AutoTokenizer.from_pretrained(M)
drafters = {"eval-style": EagleDrafter.from_pretrained(E, dtype=dtype).to("cuda").eval(),
            "timing-style": EagleDrafter.from_pretrained(E).to(device="cuda", dtype=dtype).eval()}
ids = tok(code_prompts()[0], return_tensors="pt").input_ids.cuda()
kw = dict(max_new_tokens=64, min_new_tokens=64, eos_token_id=None, do_sample=False, return_dict_in_generate=True,
          custom_generate=H.speculative_generate)
for mask in (True, False):
    for style, dr in drafters.items():
        for name, cfg in {"tree60": H.AssistantConfig(drafter="eagle", max_draft_tokens=60, max_depth=6, draft_top_k=10),
                          "tree24": H.AssistantConfig(drafter="eagle", max_draft_tokens=24, max_depth=6, draft_top_k=8),
                          "chain6": H.AssistantConfig(drafter="eagle", max_draft_tokens=6, max_depth=6, draft_top_k=1)}.items():
            extra = dict(attention_mask=torch.ones_like(ids)) if mask else {}
            for rep in range(2):
                torch.cuda.synchronize(); t = time.perf_counter()
                out = model.generate(ids, assistant_config=cfg.replace(compile=True), draft_model=dr, **extra, **kw)
                torch.cuda.synchronize(); dt = time.perf_counter() - t
            s = out.spec_stats
            print(f"mask={mask} {style:<13}{name:<8} {1e3 * dt / 64:7.2f} ms/token  fwd {s.target_forwards}  draft "
                  f"{1e3 * s.draft_seconds / s.target_forwards:6.2f}  verify {1e3 * s.verify_seconds / s.target_forwards:6.2f} "
                  f"ms/fwd  captures {s.graph_captures}", flush=True)
