"""Where one speculative generate call spends its time: host functions (cProfile) and GPU kernels (torch.profiler).

Warms up (compiles, captures graphs), then profiles one call. The host table shows our functions by cumulative
time (a device sync, e.g. the verifier's read of the argmax, absorbs the GPU work queued before it); the kernel
table shows GPU time per kernel, graph replays included.

    python benchmarks/profile_step.py --model ../shared/models/qwen3_5-small --dtype bfloat16 --compile
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
from bench import encode_prompts, load_model

import hf_hybrid_spec as H
from hf_hybrid_spec.cli import argument_parser


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="a model folder, or random:<shape> as the bench takes")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for random:<shape> models")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--compile", action="store_true", help="static cache + CUDA graphs (AssistantConfig(compile=True))")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=30, help="rows per table")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.model, getattr(torch, args.dtype), device, None)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = encode_prompts(tok, 1, device, model.config.get_text_config().vocab_size, args.prompt_tokens)[0]
    cfg = H.AssistantConfig(drafter=args.drafter, compile=args.compile)
    kw = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, eos_token_id=None,
              do_sample=False, custom_generate=H.speculative_generate, assistant_config=cfg,
              return_dict_in_generate=True)
    for _ in range(2):
        model.generate(ids, **kw)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    sync()
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    sync()
    wall = time.perf_counter() - t
    stats = out.spec_stats
    steps = stats.target_forwards
    print(f"{args.model} {args.dtype} drafter={args.drafter} compile={args.compile}: {wall * 1e3:.1f} ms, "
          f"{steps} steps, {1e3 * wall / steps:.2f} ms/step, {stats.mean_accepted_length:.2f} tokens/step, "
          f"draft {1e3 * stats.draft_seconds / steps:.2f} ms/step, verify+commit {1e3 * stats.verify_seconds / steps:.2f} ms/step")

    prof = cProfile.Profile()
    prof.enable()
    model.generate(ids, **kw)
    sync()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats("hf_hybrid_spec|stopping|tolist|item", args.rows)
    print(f"host, per call of {steps} steps (cumulative seconds):")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-6000:])
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.rows)
    print("host, every function by own time:")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-6000:])

    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            model.generate(ids, **kw)
            sync()
        print("GPU kernels, one call (self CUDA time):")
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
