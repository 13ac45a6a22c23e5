"""EAGLE drafting cost per step, eager vs static (CUDA graphs), on one model: ms per draft, ms per token, tokens per
forward, against suffix+graphs and stock greedy (correctness: every output equal to stock greedy is counted).

    python benchmarks/time_eagle_draft.py --model ../shared/models/qwen3_5-small \\
        --drafter checkpoints/drafters/qwen3_5-small-eagle3 --dtype bfloat16
"""

from __future__ import annotations

import json
import time

import torch
from bench import encode_prompts, load_model

import hf_hybrid_spec as H
from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.eagle import EagleDrafter


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--drafter", required=True, help="an EagleDrafter folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=24, help="EAGLE tree nodes")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype, device, None)
    eagle = EagleDrafter.from_pretrained(args.drafter).to(device=device, dtype=dtype).eval()
    prompts = encode_prompts(tok, args.num_prompts, device, model.config.get_text_config().vocab_size,
                             args.prompt_tokens)
    eagle_cfg = H.AssistantConfig(drafter="eagle", max_draft_tokens=args.nodes, max_depth=args.depth,
                                  draft_top_k=args.top_k)
    methods = {
        "eagle eager": dict(assistant_config=eagle_cfg, draft_model=eagle),
        "eagle static+graphs": dict(assistant_config=eagle_cfg.replace(compile=True), draft_model=eagle),
        "suffix+graphs": dict(assistant_config=H.AssistantConfig(compile=True)),
    }
    kw = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, eos_token_id=None,
              do_sample=False)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for spec in methods.values():  # warm-up: Triton, graph captures
        model.generate(prompts[0], custom_generate=H.speculative_generate, return_dict_in_generate=True, **kw, **spec)
    rows = {name: {"seconds": 0.0, "tokens": 0, "forwards": 0, "draft": 0.0, "same": 0} for name in ["stock", *methods]}
    for ids in prompts:
        sync()
        t = time.perf_counter()
        ref = model.generate(ids, **kw)
        sync()
        rows["stock"]["seconds"] += time.perf_counter() - t
        rows["stock"]["tokens"] += ref.shape[1] - ids.shape[1]
        for name, spec in methods.items():
            sync()
            t = time.perf_counter()
            out = model.generate(ids, custom_generate=H.speculative_generate, return_dict_in_generate=True, **kw,
                                 **spec)
            sync()
            r = rows[name]
            r["seconds"] += time.perf_counter() - t
            r["tokens"] += out.sequences.shape[1] - ids.shape[1]
            r["forwards"] += out.spec_stats.target_forwards
            r["draft"] += out.spec_stats.draft_seconds
            r["same"] += int(torch.equal(out.sequences, ref))
    stock_ms = 1e3 * rows["stock"]["seconds"] / rows["stock"]["tokens"]
    print(f"{'method':<22}{'ms/token':>10}{'tok/fwd':>9}{'draft ms/fwd':>14}{'vs stock':>10}{'same':>6}")
    summary = {}
    for name, r in rows.items():
        ms = 1e3 * r["seconds"] / r["tokens"]
        fwd = r["tokens"] / r["forwards"] if r["forwards"] else 1.0
        draft = 1e3 * r["draft"] / r["forwards"] if r["forwards"] else 0.0
        same = r["same"] if name != "stock" else len(prompts)
        print(f"{name:<22}{ms:>10.2f}{fwd:>9.2f}{draft:>14.2f}{stock_ms / ms:>9.2f}x{same:>6}")
        summary[name] = {"ms_per_token": round(ms, 3), "tokens_per_forward": round(fwd, 3),
                         "draft_ms_per_forward": round(draft, 3), "same_as_stock": same}
    print(json.dumps({"model": args.model, "device": device, "dtype": args.dtype, "results": summary}))


if __name__ == "__main__":
    main()
