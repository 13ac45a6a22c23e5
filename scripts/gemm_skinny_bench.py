"""Skinny linear layers at verify shapes: cuBLAS (F.linear) vs our Triton kernel, per weight shape and row count.

Each timing is a CUDA graph of back-to-back calls that cycle through enough copies of the weight to defeat the L2
cache (as a forward reads each layer's weight once), replayed; the time per call is reported with the weight-read
rate and its share of a device-to-device copy's rate (the practical bandwidth). Our kernel is swept over launch
configurations and the best per (shape, rows) is kept. Last, the projected GEMM time of one verify forward of the
2B Qwen3.5 / 1.4B Falcon-H1 shapes (per-shape counts x per-call times), cuBLAS vs best-of-sweep.

Usage (GPU): python scripts/gemm_skinny_bench.py [--rows 9 33] [--out DIR]
"""
import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.gemm.triton_skinny import SkinnyConfig, triton_skinny_linear  # noqa: E402

# (name, N, K): count per verify forward of the 2B Qwen3.5 shape / the 1.4B Falcon-H1 shape of hf_hybrid_spec.bench.
SHAPES = {
    "qwen2b": [("gdn_qkv", 8192, 2048, 18), ("gdn_z", 4096, 2048, 18), ("gdn_b/a", 32, 2048, 36),
               ("gdn_out", 2048, 4096, 18), ("mlp_gate/up", 6144, 2048, 48), ("mlp_down", 2048, 6144, 24),
               ("attn_q", 4096, 2048, 6), ("attn_k/v", 512, 2048, 12), ("attn_o", 2048, 2048, 6),
               ("lm_head", 151936, 2048, 1)],
    "falcon1.5b": [("mamba_in", 3352, 2048, 24), ("mamba_out", 2048, 1536, 24), ("mlp_gate/up", 6144, 2048, 48),
                   ("mlp_down", 2048, 6144, 24), ("attn_q", 1024, 2048, 24), ("attn_k/v", 256, 2048, 48),
                   ("attn_o", 2048, 1024, 24), ("lm_head", 65536, 2048, 1)],
}


def configs():
    for bn, bk, split, stages in itertools.product((16, 32, 64, 128), (128, 256), (1, 2), (3, 5)):
        yield SkinnyConfig(block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=stages)


def time_graph(fn, weights, calls: int = 8, replays: int = 10) -> float:
    """Seconds per call of `fn(w)` over `calls` weights in a captured graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays / calls


def copy_rate() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    seconds = time_graph(lambda w: b.copy_(w), [a], calls=4, replays=5)
    return 2 * a.numel() * a.element_size() / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[9, 33])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", default=None, help="folder for results.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    bandwidth = copy_rate()
    print(f"device {torch.cuda.get_device_name()}: copy rate {bandwidth / 1e12:.2f} TB/s")
    shapes = {(n, k) for model in args.models for _, n, k, _ in SHAPES[model]}
    best: dict[tuple[int, int, int], dict] = {}
    all_configs = list(configs())
    print("| N | K | rows | cuBLAS us | % of copy rate | ours us | % | ours / cuBLAS | best config |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for (n, k), m in itertools.product(sorted(shapes), args.rows):
        nbytes = n * k * 2
        copies = max(1, min(16, (256 << 20) // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = F.linear(x, weights[0])
        t_cublas = time_graph(lambda w: F.linear(x, w), weights)
        results = []
        for cfg in all_configs:
            try:
                y = triton_skinny_linear(x, weights[0], config=cfg)
                if not torch.allclose(y.float(), ref.float(), atol=5e-2, rtol=2e-2):
                    print(f"MISMATCH N={n} K={k} rows={m} {cfg}: {(y.float() - ref.float()).abs().max().item()}")
                    continue
                results.append((time_graph(lambda w: triton_skinny_linear(x, w, config=cfg), weights), cfg))
            except Exception as err:  # a config the toolchain refuses: skip it, say so once
                print(f"config failed N={n} K={k} rows={m} {cfg}: {type(err).__name__}: {str(err)[:120]}")
        t_ours, cfg = min(results, key=lambda r: r[0])
        rate = lambda t: 100 * nbytes / t / bandwidth  # noqa: E731
        best[(n, k, m)] = dict(cublas_s=t_cublas, ours_s=t_ours, config=cfg.__dict__,
                               top5=[(t, c.__dict__) for t, c in sorted(results, key=lambda r: r[0])[:5]])
        print(f"| {n} | {k} | {m} | {t_cublas * 1e6:.1f} | {rate(t_cublas):.0f} | {t_ours * 1e6:.1f} | "
              f"{rate(t_ours):.0f} | {t_ours / t_cublas:.2f} | {cfg.block_n}/{cfg.block_k}/s{cfg.split_k}/"
              f"st{cfg.num_stages} |", flush=True)
        del weights
    summary = {}
    for model in args.models:
        for m in args.rows:
            cub = sum(c * best[(n, k, m)]["cublas_s"] for _, n, k, c in SHAPES[model])
            ours = sum(c * min(best[(n, k, m)]["ours_s"], best[(n, k, m)]["cublas_s"]) for _, n, k, c in SHAPES[model])
            floor = sum(c * n * k * 2 for _, n, k, c in SHAPES[model]) / bandwidth
            summary[f"{model}/rows{m}"] = dict(cublas_ms=cub * 1e3, best_ms=ours * 1e3, copy_floor_ms=floor * 1e3)
            print(f"{model} rows={m}: GEMMs per forward cuBLAS {cub * 1e3:.3f} ms, best of ours/cuBLAS per shape "
                  f"{ours * 1e3:.3f} ms, at the copy rate {floor * 1e3:.3f} ms")
    out = dict(copy_rate_Bps=bandwidth, summary=summary,
               shapes={f"{n}x{k}/rows{m}": v for (n, k, m), v in best.items()})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(dict(summary=summary)))


if __name__ == "__main__":
    main()
