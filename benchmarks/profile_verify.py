"""Where one static verify forward spends its GPU time, kernel by kernel (against the forward's weight-read floor).

Builds the static runner (`AssistantConfig(compile=True)`, and `--fuse` for compile_verify), prefills a prompt,
then profiles `--reps` verify forwards of one tree-size bucket, eagerly (no graph: every kernel is seen with its
own duration) and by graph replay (wall time). Prints kernels grouped by name: launches and microseconds per
forward, and the sum against the replay's wall time (the rest is gaps between kernels).

    python benchmarks/profile_verify.py --model random:qwen3_5-2b --tokenizer ../models/qwen3_5-small --fuse
"""

from __future__ import annotations

import collections
import time

import torch
from bench import encode_prompts, load_model, measure_copy_bandwidth_gbps, weight_floor_ms

from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.drafters.base import DraftTree
from hf_hybrid_spec.engine.static import StaticRunner
from hf_hybrid_spec.forward import forward_tokens
from hf_hybrid_spec.tree import build_verify_tree


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="a model folder, or random:<shape> as the bench takes")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for random:<shape> models")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--fuse", action="store_true", help="compile_verify: the pure regions fused by Inductor")
    parser.add_argument("--nodes", type=int, default=8, help="tree-size bucket to profile")
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this profile needs a GPU")

    model, tok = load_model(args.model, getattr(torch, args.dtype), "cuda", None)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = encode_prompts(tok, 1, "cuda", model.config.get_text_config().vocab_size, args.prompt_tokens)[0]
    n = args.nodes
    draft = DraftTree(tokens=torch.ones(1, n - 1, dtype=torch.long), parents=(torch.arange(n - 1) - 1).view(1, -1))
    tree = build_verify_tree(ids[0, -1:].cpu(), draft)
    prefix = ids.shape[1]

    def runner_for(use_graphs: bool) -> StaticRunner:
        runner = StaticRunner(model, 1, prefix + 2 * n, (n,), use_graphs=use_graphs, fuse=args.fuse)
        with torch.no_grad():
            forward_tokens(model, ids, runner.cache, logits_to_keep=1)
        return runner

    def forwards(runner: StaticRunner, reps: int) -> None:
        with torch.no_grad():
            for _ in range(reps):
                runner.forward(tree.tokens, tree.parent, [prefix], [prefix])
                runner.abort()

    eager, graphs = runner_for(False), runner_for(True)
    for runner in (eager, graphs):
        forwards(runner, 3)  # compiles, captures
    torch.cuda.synchronize()
    t = time.perf_counter()
    forwards(graphs, args.reps)
    torch.cuda.synchronize()
    replay_ms = 1e3 * (time.perf_counter() - t) / args.reps

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forwards(eager, args.reps)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:90]]
            k[0] += 1
            k[1] += e.device_time
    total_us = sum(v[1] for v in kernels.values()) / args.reps
    launches = sum(v[0] for v in kernels.values()) / args.reps
    bandwidth = measure_copy_bandwidth_gbps("cuda")
    floor = weight_floor_ms(model, bandwidth)
    print(f"{args.model} {args.dtype} fuse={args.fuse} {n}-node verify: graph replay {replay_ms:.3f} ms "
          f"({replay_ms / floor:.1f}x the weight floor {floor:.3f} ms); eager forward: {launches:.0f} kernels, "
          f"{total_us / 1e3:.3f} ms of kernel time")
    print(f"{'kernel':<92}{'per fwd':>8}{'us/fwd':>10}{'share':>7}")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[: args.rows]:
        print(f"{name:<92}{count / args.reps:>8.1f}{us / args.reps:>10.1f}{us / args.reps / total_us:>7.1%}")


if __name__ == "__main__":
    main()
