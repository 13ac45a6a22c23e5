"""A/B/C of the fused verify forward (`compile_verify`), same process, same weights: graph replays of each
tree-size bucket, the runners timed in alternating rounds.

- "fused": as it was before the two additions below (projections in order, MLPs on their compiled class forward,
  attention on sdpa);
- "+parallel": the independent projections on side streams (`fusion.parallel_linears`, `models.mlp`);
- "+parallel+attention" (the default): also the attention layers on our tree-attention kernel
  (`models.tree_attention`).

Also checks that the variants' logits agree (argmax agreement and the largest difference).

    python benchmarks/ab_parallel_linears.py --model random:qwen3_5-2b --tokenizer ../models/qwen3_5-small
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from bench import encode_prompts, load_model, measure_copy_bandwidth_gbps, weight_floor_ms

from hf_hybrid_spec import fusion
from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.drafters.base import DraftTree
from hf_hybrid_spec.engine.static import StaticRunner
from hf_hybrid_spec.forward import forward_tokens
from hf_hybrid_spec.models import tree_attention
from hf_hybrid_spec.tree import build_verify_tree


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", required=True, help="a model folder, or random:<shape> as the bench takes")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for random:<shape> models")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--buckets", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20, help="replays per round")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement); cpu runs it as a smoke test")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also compare every variant's logits with an fp32 copy of the model's plain (unfused, "
                             "sdpa) verify forward of the largest bucket: the variants' rounding against the truth")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("no GPU here: the A/B needs one (--device cpu runs it as a smoke test)")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    model, tok = load_model(args.model, getattr(torch, args.dtype), args.device, None)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = encode_prompts(tok, 1, args.device, model.config.get_text_config().vocab_size, args.prompt_tokens)[0]
    prefix = ids.shape[1]
    buckets = tuple(sorted(args.buckets))

    def runner(parallel: bool, attention: bool) -> StaticRunner:
        fusion.set_parallel(parallel)
        tree_attention.set_tree_attention(attention)
        r = StaticRunner(model, 1, prefix + 2 * max(buckets), buckets, fuse=True)
        with torch.no_grad():
            forward_tokens(model, ids, r.cache, logits_to_keep=1)
        return r

    trees = {}
    for n in buckets:
        draft = DraftTree(tokens=torch.ones(1, n - 1, dtype=torch.long),
                          parents=(torch.arange(n - 1) - 1).view(1, -1))
        trees[n] = build_verify_tree(ids[0, -1:].cpu(), draft)

    def forwards(r: StaticRunner, n: int, reps: int):
        out = None
        with torch.no_grad():
            for _ in range(reps):
                out = r.forward(trees[n].tokens, trees[n].parent, [prefix], [prefix])[:, :n]
                r.abort()
        return out

    runners = {"fused": runner(False, False), "+parallel": runner(True, False),
               "+parallel+attention": runner(True, True)}
    fusion.set_parallel(True)
    tree_attention.set_tree_attention(True)
    logits = {}
    for name, r in runners.items():
        for n in buckets:
            out = forwards(r, n, 3)  # compiles, captures
        logits[name] = out.float().clone()
    diff = {name: (logits[name] - logits["fused"]).abs().max().item() for name in runners}
    agree = {name: (logits[name].argmax(-1) == logits["fused"].argmax(-1)).float().mean().item() for name in runners}
    vs_fp32 = {}
    if args.fp32_reference:
        import copy

        exact = copy.deepcopy(model).float()
        plain = StaticRunner(exact, 1, prefix + 2 * max(buckets), buckets, use_graphs=False)
        with torch.no_grad():
            forward_tokens(exact, ids, plain.cache, logits_to_keep=1)
        ref = forwards(plain, max(buckets), 1).float()
        vs_fp32 = {name: dict(max_diff=round((logits[name] - ref).abs().max().item(), 4),
                              argmax_agreement=round((logits[name].argmax(-1) == ref.argmax(-1)).float().mean().item(),
                                                     4)) for name in runners}
        print(f"logits of the {max(buckets)}-node bucket vs the fp32 plain forward: {vs_fp32}")
        del exact, plain
    times = {(name, n): [] for name in runners for n in buckets}
    for _ in range(args.rounds):
        for n in buckets:
            for name, r in runners.items():
                sync()
                t = time.perf_counter()
                forwards(r, n, args.reps)
                sync()
                times[(name, n)].append(1e3 * (time.perf_counter() - t) / args.reps)
    floor = weight_floor_ms(model, measure_copy_bandwidth_gbps(args.device)) if cuda else float("nan")
    print(f"{args.model} {args.dtype}: weight floor {floor:.3f} ms; logits vs 'fused', max |diff| {diff}, argmax "
          f"agreement {agree}")
    names = list(runners)
    print("| nodes | " + " | ".join(f"{name} ms" for name in names) + " | default / fused | default x floor |")
    print("| ---: |" + " ---: |" * (len(names) + 2))
    summary = {}
    for n in buckets:
        ms = {name: statistics.median(times[(name, n)]) for name in names}
        last = ms[names[-1]]
        summary[n] = {**{name: round(v, 4) for name, v in ms.items()}, "ratio": round(last / ms["fused"], 4),
                      "x_floor": round(last / floor, 3)}
        print(f"| {n} | " + " | ".join(f"{ms[name]:.3f}" for name in names)
              + f" | {last / ms['fused']:.3f} | {last / floor:.2f} |")
    print(json.dumps(dict(model=args.model, floor_ms=round(floor, 4), logits_max_diff=diff, argmax_agreement=agree,
                          vs_fp32=vs_fp32, buckets=summary)))


if __name__ == "__main__":
    main()
