"""Benchmark of the tree-verification kernels on one GPU (written for the H200).

What this script does, in order:
    1. Ceilings: the device copy bandwidth (a large device-to-device copy, bytes read + written) and the fp32 and
       bf16 matrix rates (torch matmul), measured, not taken from the datasheet.
    2. Correctness gate: every Triton kernel (tree, commit, branch baseline) against the naive references at
       the benchmark's layer sizes, fp32 and bf16; fla's chain kernels against ours on a chain. Any failure
       stops the script before a single timing.
    3. Sweep over batch B and tree size N (random trees, depth <= --depth levels) for
         - a Qwen3.5 linear-attention layer (gated delta rule, H=16, HV=32, K=V=128),
         - a Falcon-H1-like Mamba-2 mixer (H=24, P=64, S=128, G=1),
         - the short conv in front of them (C = 2*H*K + HV*V = 8192, W=4),
       reporting per row:
         (a) ours (closed form, one program per tree) vs branch-by-branch (ONE fused kernel, a full state per
             node in HBM: triton_branch.py), target >= 4x at N=64;
         (b) transient memory: our factors vs one state per node, analytic bytes and measured
             (torch.cuda.max_memory_allocated delta minus the output both produce), target >= 80x at N=64;
         (c) gated delta rule, what a chain verify of N tokens costs through fla (the faster of
             chunk_gated_delta_rule and fused_recurrent_gated_delta_rule; skipped with a message when fla is not
             installed), against ours on the same N-node tree (`tree/fla`: the issue's "a tree costs about what
             a chain does", target <= 1.3x) and against ours on the same chain (`chain/fla`);
         (d) commit: achieved bandwidth (one state read + one write) vs the measured copy bandwidth;
       next to each measured time, its floor: max(FLOPs / rate, bytes / bandwidth), with FLOPs and bytes
       counted from the shapes (the fewest bytes: every input read once, every output written once).
    4. A table, then optional `--out DIR` (JSON with every row + a PNG plot), and a JSON summary line last.

Times are medians of triton.testing.do_bench (L2 flushed between runs), or of CUDA-graph replays with
--cuda-graph. Kernels are timed through their launchers (`*_fwd`), which skip the public functions' input
validation (a host sync).

    python benchmarks/tree_kernels.py --out bench_out        # H200, about 2-4 minutes
    python benchmarks/tree_kernels.py --dry-run              # CPU smoke test, no claims
    python benchmarks/tree_kernels.py --sm90-report          # no GPU: ptxas registers/spills
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from hf_hybrid_spec.kernels import (
    naive_commit_causal_conv1d,
    naive_commit_gated_delta_rule,
    naive_commit_mamba2,
    naive_tree_causal_conv1d,
    naive_tree_gated_delta_rule,
    naive_tree_mamba2,
    torch_commit_causal_conv1d,
    torch_commit_gated_delta_rule,
    torch_commit_mamba2,
    torch_tree_causal_conv1d,
    torch_tree_gated_delta_rule,
    torch_tree_mamba2,
)
from hf_hybrid_spec.kernels.tree import node_depth

TARGET_SPEEDUP = 4.0  # (a) ours vs branch-by-branch at N = 64
TARGET_MEMORY = 80.0  # (b) one state per node / our factors at N = 64
TARGET_CHAIN = 1.3  # (c) ours (on the N-node tree, and on the chain) / fla on a chain of N = 64


@dataclass
class GdnShape:
    """A gated-delta (linear attention) layer."""

    h: int = 16  # query/key heads
    hv: int = 32  # value heads
    k: int = 128  # key head dim
    v: int = 128  # value head dim


@dataclass
class Mamba2Shape:
    """A Mamba-2 mixer."""

    h: int = 24  # heads
    p: int = 64  # head dim
    s: int = 128  # state size
    g: int = 1  # groups of B/C


@dataclass
class ConvShape:
    """The short causal conv in front of the gated-delta layer: channels = 2*H*K + HV*V."""

    c: int = 8192
    w: int = 4
    s: int = 3  # window entries kept


@dataclass
class Row:
    op: str
    batch: int
    nodes: int
    depth: int  # levels of the tree actually drawn
    ours_us: float
    ours_floor_us: float
    ours_flop: float
    ours_bytes: float
    branch_us: float | None = None
    branch_floor_us: float | None = None
    speedup: float | None = None
    mem_ours_bytes: float | None = None  # analytic transient bytes (factors)
    mem_branch_bytes: float | None = None  # analytic transient bytes (one state per node)
    mem_ratio: float | None = None
    mem_ours_measured: float | None = None
    mem_branch_measured: float | None = None
    mem_ratio_measured: float | None = None
    chain_us: float | None = None
    fla_chunk_us: float | None = None
    fla_recurrent_us: float | None = None
    chain_ratio: float | None = None  # ours on the chain / min(fla) on the chain
    tree_over_fla_chain: float | None = None  # ours on the tree / min(fla) on a chain of as many tokens
    commit_us: float | None = None
    commit_floor_us: float | None = None
    commit_gbps: float | None = None
    commit_copy_fraction: float | None = None
    notes: list[str] = field(default_factory=list)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="benchmarks/tree_kernels.py",
        description="Tree verification kernels vs branch-by-branch and fla chains; correctness gate first.",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="tree sizes N (<= 128)")
    ap.add_argument("--depth", type=int, default=8, help="maximum tree depth in levels (default 8)")
    ap.add_argument("--ops", nargs="+", choices=["gdn", "mamba2", "conv"], default=["gdn", "mamba2", "conv"])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="activation dtype (state is fp32)")
    ap.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays (removes launch gaps)")
    ap.add_argument("--block-v", type=int, default=None,
                    help="override the tree kernels' V tile (gated delta rule) / P tile (Mamba-2), for tuning")
    ap.add_argument("--num-warps", type=int, default=None, help="override the tree kernels' warps per program")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for tree_kernels.json and .png")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test: tiny sizes, PyTorch closed form as 'ours', naive as 'branch'; no claims")
    ap.add_argument("--launch-costs", action="store_true",
                    help="instead of the sweep: host microseconds per call of each tree op launched from Python (the "
                         "public op, its launcher, our share of it, Triton's launch alone, the commit) next to its GPU "
                         "time inside a CUDA graph")
    ap.add_argument("--rounds", type=int, default=3,
                    help="--launch-costs: rounds over every measure, alternated, best of each (default 3): the "
                         "host's drift during a run falls on all columns alike")
    ap.add_argument("--host-work", action="store_true",
                    help="no GPU needed: host microseconds per call of our launchers alone (tensor work, tile "
                         "arithmetic; Triton's launch replaced by a no-op) on CPU tensors of the real layer sizes")
    ap.add_argument("--sm90-report", action="store_true",
                    help="no GPU needed: compile every kernel config for sm_90 and print registers / spills / shared")
    args = ap.parse_args(argv)
    if max(args.nodes) > 128:
        ap.error("the tree kernels hold a whole tree per program: N <= 128")
    return args


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------


def random_tree(bsz: int, n: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """[B, N] parent pointers, topological order, random branching, at most `depth` levels."""
    parent = torch.full((bsz, n), -1, dtype=torch.long)
    for b in range(bsz):
        level: list[int] = []
        for i in range(n):
            growable = [j for j in range(i) if level[j] < depth - 1]
            # Half the nodes extend the newest growable node (deep branches), the rest attach anywhere.
            if growable and torch.rand((), generator=gen) < 0.5:
                p = growable[-1]
            else:
                choices = [-1] + growable
                p = choices[int(torch.randint(len(choices), (), generator=gen))]
            parent[b, i] = p
            level.append(0 if p < 0 else level[p] + 1)
    return parent


def gdn_inputs(shape: GdnShape, bsz: int, n: int, dtype, device, gen):
    def randn(*s):
        return torch.randn(*s, generator=gen).to(device)

    q = randn(bsz, n, shape.h, shape.k).to(dtype)
    k = randn(bsz, n, shape.h, shape.k).to(dtype)
    v = randn(bsz, n, shape.hv, shape.v).to(dtype)
    g = F.logsigmoid(randn(bsz, n, shape.hv) + 2.0).to(dtype)
    beta = torch.sigmoid(randn(bsz, n, shape.hv)).to(dtype)
    h0 = randn(bsz, shape.hv, shape.k, shape.v)
    return q, k, v, g, beta, h0


def mamba2_inputs(shape: Mamba2Shape, bsz: int, n: int, dtype, device, gen):
    def randn(*s):
        return torch.randn(*s, generator=gen).to(device)

    x = randn(bsz, n, shape.h, shape.p).to(dtype)
    dt = randn(bsz, n, shape.h).to(dtype)
    a = -torch.exp(torch.rand(shape.h, generator=gen)).to(device)
    b = randn(bsz, n, shape.g, shape.s).to(dtype)
    c = randn(bsz, n, shape.g, shape.s).to(dtype)
    h0 = randn(bsz, shape.h, shape.p, shape.s)
    extra = {"D": randn(shape.h), "z": randn(bsz, n, shape.h, shape.p).to(dtype), "dt_bias": randn(shape.h) * 0.5}
    return (x, dt, a, b, c, h0), extra


def conv_inputs(shape: ConvShape, bsz: int, n: int, dtype, device, gen):
    x = torch.randn(bsz, n, shape.c, generator=gen).to(device, dtype)
    weight = torch.randn(shape.c, shape.w, generator=gen).to(device, dtype)
    bias = torch.randn(shape.c, generator=gen).to(device, dtype)
    state = torch.randn(bsz, shape.c, shape.s, generator=gen).to(device, dtype)
    return x, weight, bias, state


# ----------------------------------------------------------------------------------------------------------
# Implementations: Triton launchers on the GPU, PyTorch closed form / naive oracle in --dry-run
# ----------------------------------------------------------------------------------------------------------


class Impls:
    """The functions timed as 'ours', 'branch' and 'commit' for each op; all share the public signatures."""

    def __init__(self, dry_run: bool, block: int | None = None, num_warps: int | None = None):
        self.dry_run = dry_run
        if dry_run:
            self.gdn_tree = lambda q, k, v, g, beta, parent, h0: torch_tree_gated_delta_rule(
                q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
            self.gdn_commit = torch_commit_gated_delta_rule
            self.gdn_branch = lambda q, k, v, g, beta, parent, h0: naive_tree_gated_delta_rule(
                q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
            self.m2_tree = lambda *a, **kw: torch_tree_mamba2(*a, **kw)
            self.m2_commit = torch_commit_mamba2
            self.m2_branch = lambda *a, **kw: naive_tree_mamba2(*a, **kw)
            self.conv_tree = lambda x, w, b, parent, state: torch_tree_causal_conv1d(x, w, b, parent, state, "silu")
            self.conv_commit = torch_commit_causal_conv1d
            return
        from hf_hybrid_spec.kernels.conv import triton_tree as conv_t
        from hf_hybrid_spec.kernels.gated_delta_rule import triton_branch as gdn_b
        from hf_hybrid_spec.kernels.gated_delta_rule import triton_tree as gdn_t
        from hf_hybrid_spec.kernels.mamba2 import triton_branch as m2_b
        from hf_hybrid_spec.kernels.mamba2 import triton_tree as m2_t

        def gdn_tree(q, k, v, g, beta, parent, h0):
            return gdn_t.tree_gated_delta_rule_fwd(
                q, k, v, g, beta, parent, h0, q.shape[-1] ** -0.5, True, None, block_v=block, num_warps=num_warps)

        def gdn_branch(q, k, v, g, beta, parent, h0):
            return gdn_b.branch_gated_delta_rule_fwd(q, k, v, g, beta, parent, h0, q.shape[-1] ** -0.5, True)

        def m2_tree(x, dt, a, b, c, parent, h0, D=None, z=None, dt_bias=None):
            return m2_t.tree_mamba2_fwd(x, dt, a, b, c, parent, h0, D, z, dt_bias, True, (0.0, math.inf), None,
                                        block_p=block, num_warps=num_warps)

        def m2_branch(x, dt, a, b, c, parent, h0, D=None, z=None, dt_bias=None):
            return m2_b.branch_mamba2_fwd(x, dt, a, b, c, parent, h0, D, z, dt_bias, True, (0.0, math.inf))

        self.gdn_tree, self.gdn_branch = gdn_tree, gdn_branch
        self.gdn_commit = gdn_t.commit_gated_delta_rule_fwd
        self.m2_tree, self.m2_branch = m2_tree, m2_branch
        self.m2_commit = m2_t.commit_mamba2_fwd
        self.conv_tree = lambda x, w, b, parent, state: conv_t.tree_causal_conv1d_fwd(x, w, b, parent, state, "silu")
        self.conv_commit = conv_t.commit_causal_conv1d_fwd
        self.branch_commit = gdn_b.branch_commit


def load_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as exc:
        print(f"[skip] fla is not installed ({exc}): no chain comparison (c)", file=sys.stderr)
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


# ----------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------


def bench_us(fn, args) -> float:
    """Median time of fn() in microseconds."""
    if args.dry_run:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    import triton.testing

    if args.cuda_graph:
        # do_bench_cudagraph runs fn on a fresh side stream that does not wait for the default stream, where the
        # inputs were just written (`leaf = torch.full(...)`, the tree pass whose factors a commit reads): without
        # this sync the commit could read a half-written leaf index and fault (seen on the H200).
        torch.cuda.synchronize()
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3
        except Exception as exc:  # noqa: BLE001 - a function that syncs the host cannot be captured
            print(f"[warn] CUDA graph capture failed ({type(exc).__name__}: {exc}); timing without a graph",
                  file=sys.stderr)
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median") * 1e3


def measured_transient(fn, output_bytes: int, device: str) -> float | None:
    """Peak bytes allocated by fn() beyond what was allocated before, minus the output every method writes."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return float(peak - output_bytes)


@dataclass
class Ceilings:
    copy_gbps: float  # device copy, bytes read + written per second / 1e9
    fp32_tflops: float  # torch fp32 matmul without TF32
    tf32_tflops: float  # torch fp32 matmul with TF32
    bf16_tflops: float


def measure_ceilings(args) -> Ceilings:
    if args.dry_run:
        return Ceilings(*[float("nan")] * 4)
    n = 1 << 28  # 1 GiB of fp32: far past the 60 MB L2
    bufs = [torch.empty(n, device="cuda").uniform_(), torch.empty(n, device="cuda")]
    t_copy = bench_us(lambda: bufs[1].copy_(bufs[0]), args)
    bufs.clear()
    a = torch.randn(8192, 8192, device="cuda")
    prev = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        t_fp32 = bench_us(lambda: a @ a, args)
        torch.backends.cuda.matmul.allow_tf32 = True
        t_tf32 = bench_us(lambda: a @ a, args)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    b = a.to(torch.bfloat16)
    t_bf16 = bench_us(lambda: b @ b, args)
    flop = 2 * 8192**3
    return Ceilings(
        copy_gbps=2 * n * 4 / t_copy / 1e3,
        fp32_tflops=flop / t_fp32 / 1e6,
        tf32_tflops=flop / t_tf32 / 1e6,
        bf16_tflops=flop / t_bf16 / 1e6,
    )


def floor_us(flop: float, nbytes: float, tflops: float, ceil: Ceilings) -> float:
    """max(arithmetic time at `tflops`, bytes at the copy bandwidth), microseconds."""
    if math.isnan(ceil.copy_gbps):
        return float("nan")
    return max(flop / (tflops * 1e6), nbytes / (ceil.copy_gbps * 1e3))


def tree_rate(ceil: Ceilings, dtype) -> float:
    # The tree kernels multiply fp32 operands in IEEE fp32 for fp32 inputs and in TF32 for 16-bit inputs.
    return ceil.fp32_tflops if dtype == torch.float32 else ceil.tf32_tflops


def state_reloads(parent: torch.Tensor) -> int:
    """Nodes whose parent is not the node just before them: the branch kernel reloads a state for each."""
    idx = torch.arange(parent.shape[1])
    return int((parent.cpu() != idx - 1).sum())


# ----------------------------------------------------------------------------------------------------------
# Correctness gate
# ----------------------------------------------------------------------------------------------------------


def rel_err(ref, out) -> float:
    ref, out = ref.double(), out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def correctness_gate(args, impls: Impls, shapes, device, fla) -> list[tuple[str, float, float]]:
    """(check, relative error, tolerance) for every kernel at the benchmark's sizes."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    gdn_shape, m2_shape, conv_shape = shapes
    bsz, n = 2, min(64, max(args.nodes))
    parent = random_tree(bsz, n, args.depth, gen).to(device)
    leaf = torch.tensor([n - 1, -1], device=device)
    checks = []
    dtypes = [("fp32", torch.float32, 1e-4)] + ([] if args.dry_run else [("bf16", torch.bfloat16, 2e-2)])
    for tag, dtype, tol in dtypes:
        if "gdn" in args.ops:
            q, k, v, g, beta, h0 = gdn_inputs(gdn_shape, bsz, n, dtype, device, gen)
            ref = naive_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
            s_ref = naive_commit_gated_delta_rule(h0, ref, parent, leaf)
            out = impls.gdn_tree(q, k, v, g, beta, parent, h0)
            checks += [(f"gdn tree o {tag}", rel_err(ref.o, out.o), tol),
                       (f"gdn tree u {tag}", rel_err(ref.u, out.u), tol),
                       (f"gdn commit {tag}", rel_err(s_ref, impls.gdn_commit(h0, out, parent, leaf)), tol)]
            br = impls.gdn_branch(q, k, v, g, beta, parent, h0)
            checks.append((f"gdn branch o {tag}", rel_err(ref.o, br.o), tol))
            if not args.dry_run:
                s_br = impls.branch_commit(h0, br.states, leaf)
                checks.append((f"gdn branch state {tag}", rel_err(s_ref, s_br), tol))
            if fla is not None:
                chain = (torch.arange(n, device=device) - 1).expand(bsz, n).contiguous()
                ours = impls.gdn_tree(q, k, v, g, beta, chain, h0).o
                fla_o = fla[0](q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)[0]
                # fla computes in TF32/bf16 internally: a loose check that both compute the same function.
                checks.append((f"fla chunk vs ours, chain {tag}", rel_err(ours, fla_o), 2e-2))
        if "mamba2" in args.ops:
            (x, dt, a, b, c, h0), extra = mamba2_inputs(m2_shape, bsz, n, dtype, device, gen)
            ref = naive_tree_mamba2(x, dt, a, b, c, parent, h0, **extra)
            s_ref = naive_commit_mamba2(h0, ref, parent, leaf)
            out = impls.m2_tree(x, dt, a, b, c, parent, h0, **extra)
            checks += [(f"mamba2 tree y {tag}", rel_err(ref.y, out.y), tol),
                       (f"mamba2 commit {tag}", rel_err(s_ref, impls.m2_commit(h0, out, parent, leaf)), tol)]
            br = impls.m2_branch(x, dt, a, b, c, parent, h0, **extra)
            checks.append((f"mamba2 branch y {tag}", rel_err(ref.y, br.y), tol))
            if not args.dry_run:
                s_br = impls.branch_commit(h0, br.states, leaf)
                checks.append((f"mamba2 branch state {tag}", rel_err(s_ref, s_br), tol))
        if "conv" in args.ops:
            x, w, bias, state = conv_inputs(conv_shape, bsz, n, dtype, device, gen)
            ref = naive_tree_causal_conv1d(x, w, bias, parent, state, "silu")
            checks.append((f"conv tree {tag}", rel_err(ref, impls.conv_tree(x, w, bias, parent, state)), tol))
            s_ref = naive_commit_causal_conv1d(state, x, parent, leaf)
            # The window commit only moves values: exact.
            checks.append((f"conv commit {tag}", rel_err(s_ref, impls.conv_commit(state, x, parent, leaf)), 0.0))
    return checks


# ----------------------------------------------------------------------------------------------------------
# Sweep
# ----------------------------------------------------------------------------------------------------------


def run_gdn(args, impls, shape: GdnShape, bsz, n, dtype, device, gen, ceil, fla) -> Row:
    e = torch.finfo(dtype).bits // 8
    parent = random_tree(bsz, n, args.depth, gen).to(device)
    depth = int(node_depth(parent).max()) + 1
    q, k, v, g, beta, h0 = gdn_inputs(shape, bsz, n, dtype, device, gen)
    h, hv, kd, vd = shape.h, shape.hv, shape.k, shape.v
    state_bytes = hv * kd * vd * 4  # one value-head-complete state per batch row
    o_bytes = bsz * n * hv * vd * e

    ours = lambda: impls.gdn_tree(q, k, v, g, beta, parent, h0)
    branch = lambda: impls.gdn_branch(q, k, v, g, beta, parent, h0)
    ours_us, branch_us = bench_us(ours, args), bench_us(branch, args)

    in_bytes = bsz * n * (2 * h * kd * e + hv * vd * e + 2 * hv * e + 8)
    factor_bytes = bsz * n * (hv * vd * 4 + hv * 4 + h * kd * 4)
    ours_bytes = in_bytes + bsz * state_bytes + o_bytes + factor_bytes
    ours_flop = bsz * hv * (4 * n * kd * vd + 4 * n * n * kd + 3 * n * n * vd)
    reloads = state_reloads(parent)
    branch_bytes = in_bytes + bsz * state_bytes + o_bytes + bsz * n * state_bytes + reloads * state_bytes
    branch_flop = 7 * bsz * n * hv * kd * vd

    out = ours()
    leaf = torch.full((bsz,), n - 1, device=device)
    commit_us = bench_us(lambda: impls.gdn_commit(h0, out, parent, leaf), args)
    commit_bytes = 2 * bsz * state_bytes
    row = Row(
        op="gdn", batch=bsz, nodes=n, depth=depth,
        ours_us=ours_us, ours_floor_us=floor_us(ours_flop, ours_bytes, tree_rate(ceil, dtype), ceil),
        ours_flop=ours_flop, ours_bytes=ours_bytes,
        branch_us=branch_us, branch_floor_us=floor_us(branch_flop, branch_bytes, ceil.fp32_tflops, ceil),
        speedup=branch_us / ours_us,
        mem_ours_bytes=factor_bytes, mem_branch_bytes=bsz * n * state_bytes,
        mem_ratio=bsz * n * state_bytes / factor_bytes,
        mem_ours_measured=measured_transient(ours, o_bytes, device),
        mem_branch_measured=measured_transient(branch, o_bytes, device),
        commit_us=commit_us, commit_floor_us=floor_us(0, commit_bytes, ceil.fp32_tflops, ceil),
        commit_gbps=commit_bytes / commit_us / 1e3,
    )
    if row.mem_ours_measured:
        row.mem_ratio_measured = row.mem_branch_measured / row.mem_ours_measured
    if not math.isnan(ceil.copy_gbps):
        row.commit_copy_fraction = row.commit_gbps / ceil.copy_gbps

    # (c) the same layer on a chain of N: what a chain verify costs.
    chain = (torch.arange(n, device=device) - 1).expand(bsz, n).contiguous()
    row.chain_us = bench_us(lambda: impls.gdn_tree(q, k, v, g, beta, chain, h0), args)
    if fla is not None:
        chunk, recurrent = fla
        # fla's cheapest chain verify: outputs only, no state written.
        row.fla_chunk_us = bench_us(
            lambda: chunk(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True), args)
        row.fla_recurrent_us = bench_us(
            lambda: recurrent(q, k, v, g=g, beta=beta, initial_state=h0, use_qk_l2norm_in_kernel=True), args)
        row.chain_ratio = row.chain_us / min(row.fla_chunk_us, row.fla_recurrent_us)
        row.tree_over_fla_chain = row.ours_us / min(row.fla_chunk_us, row.fla_recurrent_us)
    return row


def run_mamba2(args, impls, shape: Mamba2Shape, bsz, n, dtype, device, gen, ceil) -> Row:
    e = torch.finfo(dtype).bits // 8
    parent = random_tree(bsz, n, args.depth, gen).to(device)
    depth = int(node_depth(parent).max()) + 1
    (x, dt, a, b, c, h0), extra = mamba2_inputs(shape, bsz, n, dtype, device, gen)
    h, p, s, g = shape.h, shape.p, shape.s, shape.g
    state_bytes = h * p * s * 4
    y_bytes = bsz * n * h * p * e

    ours = lambda: impls.m2_tree(x, dt, a, b, c, parent, h0, **extra)
    branch = lambda: impls.m2_branch(x, dt, a, b, c, parent, h0, **extra)
    ours_us, branch_us = bench_us(ours, args), bench_us(branch, args)

    in_bytes = bsz * n * (2 * h * p * e + 2 * g * s * e + h * e + 8)
    # Factors as the commit needs them: x and B in fp32 (fresh copies when the inputs are 16-bit), dt, a_cum.
    factor_bytes = bsz * n * ((h * p + g * s) * (4 if e != 4 else 0) + 2 * h * 4)
    factor_bytes_total = bsz * n * ((h * p + g * s) * 4 + 2 * h * 4)
    ours_bytes = in_bytes + bsz * state_bytes + y_bytes + factor_bytes
    ours_flop = bsz * h * (2 * n * n * s + 2 * n * p * s + 2 * n * n * p)
    reloads = state_reloads(parent)
    branch_bytes = in_bytes + bsz * state_bytes + y_bytes + bsz * n * state_bytes + reloads * state_bytes
    branch_flop = 5 * bsz * n * h * p * s

    out = ours()
    leaf = torch.full((bsz,), n - 1, device=device)
    commit_us = bench_us(lambda: impls.m2_commit(h0, out, parent, leaf), args)
    commit_bytes = 2 * bsz * state_bytes
    row = Row(
        op="mamba2", batch=bsz, nodes=n, depth=depth,
        ours_us=ours_us, ours_floor_us=floor_us(ours_flop, ours_bytes, tree_rate(ceil, dtype), ceil),
        ours_flop=ours_flop, ours_bytes=ours_bytes,
        branch_us=branch_us, branch_floor_us=floor_us(branch_flop, branch_bytes, ceil.fp32_tflops, ceil),
        speedup=branch_us / ours_us,
        mem_ours_bytes=factor_bytes_total, mem_branch_bytes=bsz * n * state_bytes,
        mem_ratio=bsz * n * state_bytes / factor_bytes_total,
        mem_ours_measured=measured_transient(ours, y_bytes, device),
        mem_branch_measured=measured_transient(branch, y_bytes, device),
        commit_us=commit_us, commit_floor_us=floor_us(0, commit_bytes, ceil.fp32_tflops, ceil),
        commit_gbps=commit_bytes / commit_us / 1e3,
    )
    if row.mem_ours_measured:
        row.mem_ratio_measured = row.mem_branch_measured / row.mem_ours_measured
        if e == 4:
            row.notes.append("fp32 inputs: x and B are returned as factors without a copy")
    if not math.isnan(ceil.copy_gbps):
        row.commit_copy_fraction = row.commit_gbps / ceil.copy_gbps
    return row


def run_conv(args, impls, shape: ConvShape, bsz, n, dtype, device, gen, ceil) -> Row:
    e = torch.finfo(dtype).bits // 8
    parent = random_tree(bsz, n, args.depth, gen).to(device)
    depth = int(node_depth(parent).max()) + 1
    x, w, bias, state = conv_inputs(shape, bsz, n, dtype, device, gen)
    ours_us = bench_us(lambda: impls.conv_tree(x, w, bias, parent, state), args)
    ours_bytes = 2 * bsz * n * shape.c * e + bsz * shape.c * shape.s * e + shape.c * (shape.w + 1) * e + bsz * n * 8
    ours_flop = 2 * shape.w * bsz * n * shape.c
    leaf = torch.full((bsz,), n - 1, device=device)
    commit_us = bench_us(lambda: impls.conv_commit(state, x, parent, leaf), args)
    commit_bytes = 2 * bsz * shape.c * shape.s * e
    row = Row(
        op="conv", batch=bsz, nodes=n, depth=depth,
        ours_us=ours_us, ours_floor_us=floor_us(ours_flop, ours_bytes, tree_rate(ceil, dtype), ceil),
        ours_flop=ours_flop, ours_bytes=ours_bytes,
        commit_us=commit_us, commit_floor_us=floor_us(0, commit_bytes, ceil.fp32_tflops, ceil),
        commit_gbps=commit_bytes / commit_us / 1e3,
    )
    if not math.isnan(ceil.copy_gbps):
        row.commit_copy_fraction = row.commit_gbps / ceil.copy_gbps
    return row


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def fmt(x, spec=".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def print_table(rows: list[Row]) -> None:
    head = ("op", "B", "N", "lvl", "ours_us", "floor_us", "branch_us", "speedup", "mem_x", "mem_x_meas",
            "chain_us", "fla_chunk", "fla_rec", "tree/fla", "chain/fla", "commit_us", "commit_GB/s", "of_copy")
    print(" ".join(f"{h:>11}" for h in head))
    for r in rows:
        cells = (r.op, r.batch, r.nodes, r.depth, fmt(r.ours_us), fmt(r.ours_floor_us), fmt(r.branch_us),
                 fmt(r.speedup, ".2f"), fmt(r.mem_ratio, ".1f"), fmt(r.mem_ratio_measured, ".1f"), fmt(r.chain_us),
                 fmt(r.fla_chunk_us), fmt(r.fla_recurrent_us), fmt(r.tree_over_fla_chain, ".2f"),
                 fmt(r.chain_ratio, ".2f"), fmt(r.commit_us),
                 fmt(r.commit_gbps, ".0f"), fmt(r.commit_copy_fraction, ".2f"))
        print(" ".join(f"{c!s:>11}" for c in cells))


def summarize(rows: list[Row], args, ceil: Ceilings) -> dict:
    at64 = [r for r in rows if r.nodes == 64]

    def worst(key, ops, fn=min):
        vals = [getattr(r, key) for r in at64 if r.op in ops and getattr(r, key) is not None]
        return fn(vals) if vals else None

    summary = {
        "bench": "tree_kernels",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "cpu",
        "dry_run": args.dry_run,
        "dtype": args.dtype,
        "copy_gbps": ceil.copy_gbps,
        "fp32_tflops": ceil.fp32_tflops,
        "tf32_tflops": ceil.tf32_tflops,
        "bf16_tflops": ceil.bf16_tflops,
        "n64_min_speedup_gdn": worst("speedup", {"gdn"}),
        "n64_min_speedup_mamba2": worst("speedup", {"mamba2"}),
        "n64_min_mem_ratio": worst("mem_ratio", {"gdn", "mamba2"}),
        "n64_min_mem_ratio_measured": worst("mem_ratio_measured", {"gdn", "mamba2"}),
        "n64_max_chain_ratio": worst("chain_ratio", {"gdn"}, max),
        "n64_max_tree_over_fla_chain": worst("tree_over_fla_chain", {"gdn"}, max),
        "min_commit_copy_fraction": min((r.commit_copy_fraction for r in rows if r.commit_copy_fraction), default=None),
    }
    if not args.dry_run:
        summary["targets"] = {
            "speedup>=4x@N64": None if summary["n64_min_speedup_gdn"] is None
            else summary["n64_min_speedup_gdn"] >= TARGET_SPEEDUP,
            "speedup>=4x@N64_mamba2": None if summary["n64_min_speedup_mamba2"] is None
            else summary["n64_min_speedup_mamba2"] >= TARGET_SPEEDUP,
            "memory>=80x@N64": None if summary["n64_min_mem_ratio"] is None
            else summary["n64_min_mem_ratio"] >= TARGET_MEMORY,
            "tree<=1.3x_fla_chain@N64": None if summary["n64_max_tree_over_fla_chain"] is None
            else summary["n64_max_tree_over_fla_chain"] <= TARGET_CHAIN,
            "chain<=1.3x_fla@N64": None if summary["n64_max_chain_ratio"] is None
            else summary["n64_max_chain_ratio"] <= TARGET_CHAIN,
        }
    return summary


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    panels = [
        ("speedup", "(a) branch-by-branch / ours", TARGET_SPEEDUP, {"gdn", "mamba2"}),
        ("mem_ratio", "(b) transient memory: per-node states / factors", TARGET_MEMORY, {"gdn", "mamba2"}),
        ("chain_ratio", "(c) ours / fla on a chain", TARGET_CHAIN, {"gdn"}),
        ("commit_copy_fraction", "(d) commit bandwidth / copy bandwidth", 1.0, {"gdn", "mamba2", "conv"}),
    ]
    for ax, (key, title, target, ops) in zip(axes, panels):
        for op in sorted(ops):
            for bsz in sorted({r.batch for r in rows}):
                pts = [(r.nodes, getattr(r, key)) for r in rows if r.op == op and r.batch == bsz and getattr(r, key)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{op} B={bsz}")
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes N")
        ax.set_title(title, fontsize=10)
        if ax.lines[:-1]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sm90_report() -> int:
    """Compile each tree kernel at the launchers' block sizes for sm_90 (Triton's bundled ptxas, no driver) and
    print ptxas' resource usage: STACK > 0 means spills to local memory."""
    import re
    import subprocess
    import tempfile

    import triton
    from hf_hybrid_spec.kernels.conv import triton_tree as conv_t
    from hf_hybrid_spec.kernels.gated_delta_rule import triton_tree as gdn_t
    from hf_hybrid_spec.kernels.mamba2 import triton_tree as m2_t
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def report(name, kernel, sig, consts, num_warps):
        fn = kernel
        while not isinstance(fn, triton.runtime.jit.JITFunction):
            fn = fn.fn
        src = ASTSource(fn, {a: sig.get(a, "constexpr") for a in fn.arg_names}, consts)
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        print(f"{name:40s} warps={num_warps} regs={m.group(1):>3} stack={m.group(2):>5} B "
              f"shared={ck.metadata.shared // 1024} KiB", flush=True)

    for dt in ("bf16", "fp32"):
        half, prec, p = dt != "fp32", "tf32x3" if dt == "fp32" else "tf32", "*" + dt
        for bt in (16, 32, 64, 128):
            warps = 4 if bt <= 16 else 8
            sig = {"q": p, "k": p, "v": p, "g": p, "beta": p, "parent": "*i64", "h0": "*fp32", "num_nodes": "*i32",
                   "o": p, "u": "*fp32", "k_out": "*fp32", "g_cum": "*fp32", "scale": "fp32", "N": "i32"}
            consts = {"H": 16, "HV": 32, "K": 128, "V": 128, "BT": bt, "LOG2_BT": bt.bit_length() - 1, "BK": 32,
                      "BV": 64 if bt <= 64 else 32, "USE_QK_L2NORM": True, "STORE_K": True, "HALF_DOT": half,
                      "DOT_PRECISION": prec, "USE_NUM_NODES": False}
            report(f"gdn tree {dt} BT={bt}", gdn_t.tree_gated_delta_rule_fwd_kernel, sig, consts, warps)
            sig = {"x": p, "dt": p, "A": "*fp32", "Bm": p, "Cm": p, "parent": "*i64", "h0": "*fp32", "D": "*fp32",
                   "z": p, "dt_bias": "*fp32", "num_nodes": "*i32", "y": p, "x_out": "*fp32", "b_out": "*fp32",
                   "dt_out": "*fp32", "a_cum": "*fp32", "dt_min": "fp32", "dt_max": "fp32", "N": "i32"}
            consts = {"H": 24, "G": 1, "P": 64, "S": 128, "BT": bt, "BP": 64 if bt <= 64 else 32, "BS": 32,
                      "DT_SOFTPLUS": True, "HAS_DT_LIMIT": False, "STORE_X": half, "STORE_B": half, "HALF_DOT": half,
                      "DOT_PRECISION": prec, "HAS_D": True, "HAS_Z": True, "HAS_DT_BIAS": True,
                      "USE_NUM_NODES": False}
            report(f"mamba2 tree {dt} BT={bt}", m2_t.tree_mamba2_fwd_kernel, sig, consts, warps)
        sig = {"x": p, "weight": p, "bias": p, "parent": "*i64", "conv_state": p, "y": p, "N": "i32", "C": "i32",
               "S": "i32"}
        consts = {"W": 4, "BN": 16, "BC": 128, "USE_SILU": True, "HAS_BIAS": True}
        report(f"conv tree {dt}", conv_t.tree_causal_conv1d_fwd_kernel, sig, consts, 4)
    sig = {"h0": "*fp32", "k": "*fp32", "u": "*fp32", "g_cum": "*fp32", "parent": "*i64", "leaf": "*i32",
           "h_out": "*fp32", "N": "i32"}
    consts = {"H": 16, "HV": 32, "K": 128, "V": 128, "BK": 64, "BV": 64}
    report("gdn commit", gdn_t.commit_gated_delta_rule_kernel, sig, consts, 4)
    sig = {"h0": "*fp32", "x": "*fp32", "b": "*fp32", "dt": "*fp32", "a_cum": "*fp32", "parent": "*i64",
           "leaf": "*i32", "h_out": "*fp32", "N": "i32"}
    consts = {"H": 24, "G": 1, "P": 64, "S": 128, "BP": 64, "BS": 64}
    report("mamba2 commit", m2_t.commit_mamba2_kernel, sig, consts, 4)
    return 0


def host_us(fn, iters: int = 400) -> float:
    """Host microseconds per call of `fn` (launches queue asynchronously; the GPU work here is shorter than the
    launch, so the queue never fills and the host's submission time is what is measured)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / iters * 1e6


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing, so what is timed is the launcher's own work."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _Recording:
    """Stands in for a Triton kernel and launches it, keeping the last launch's grid and arguments, so that Triton's
    launch can be timed alone with exactly the arguments a launcher passes."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = (grid, args, kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def _swapped(mod, names, stand_in):
    """Within the block, the Triton kernels `mod.<name>` (the launchers look them up at call time) are `stand_in()`."""
    saved = {name: getattr(mod, name) for name in names}
    try:
        for name in names:
            setattr(mod, name, stand_in())
        yield
    finally:
        for name, kernel in saved.items():
            setattr(mod, name, kernel)


def triton_launch_alone(mod, name: str, launcher):
    """A no-argument callable that repeats the Triton launch `launcher()` makes of `mod.name`, arguments prebuilt."""
    kernel = getattr(mod, name)
    recording = _Recording(kernel)
    with _swapped(mod, [name], lambda: recording):
        launcher()
    grid, args, kwargs = recording.last
    return lambda: kernel[grid](*args, **kwargs)


@dataclass
class EagerCase:
    """One tree op as the eager path calls it on real layer sizes: the public op and commit (dispatch, validation,
    launcher), the launchers alone, and the module whose Triton kernels (`tree_kernel`, `commit_kernel`) they
    launch. `commit()` commits the factors of one `launcher()` call made when the case was built."""

    mod: object
    tree_kernel: str
    commit_kernel: str
    public: object
    launcher: object
    commit_public: object
    commit: object


def eager_case(op: str, shapes, bsz: int, n: int, args, dtype, device: str, gen, views: bool = False,
               stubbed: bool = False) -> EagerCase:
    """The case of `op` ("gdn" or "mamba2"). views: q / k / v as views of one [B, N, C] projection, as a mixer hands
    them over. stubbed: the factors `commit()` reads come from a launcher call with its Triton kernel a no-op (for
    timing the host alone, e.g. on CPU tensors no Triton kernel runs on)."""
    import hf_hybrid_spec.kernels as K
    from hf_hybrid_spec.kernels.gated_delta_rule import triton_tree as gdn_t
    from hf_hybrid_spec.kernels.mamba2 import triton_tree as m2_t

    parent = random_tree(bsz, n, args.depth, gen).to(device)
    leaf = torch.full((bsz,), n - 1, dtype=torch.long, device=device)
    if op == "gdn":
        q, k, v, g, beta, h0 = gdn_inputs(shapes[0], bsz, n, dtype, device, gen)
        if views:
            proj = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)
            q, k, v = (piece.view(t.shape) for piece, t in zip(
                proj.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], dim=-1), (q, k, v)))
        mod, names = gdn_t, ("tree_gated_delta_rule_fwd_kernel", "commit_gated_delta_rule_kernel")
        public = lambda: K.tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)  # noqa: E731
        launcher = lambda: gdn_t.tree_gated_delta_rule_fwd(  # noqa: E731
            q, k, v, g, beta, parent, h0, q.shape[-1] ** -0.5, True, None)
        commit_launcher, commit_public = gdn_t.commit_gated_delta_rule_fwd, K.commit_gated_delta_rule
    else:
        (x, dt, a, b, c, h0), extra = mamba2_inputs(shapes[1], bsz, n, dtype, device, gen)
        mod, names = m2_t, ("tree_mamba2_fwd_kernel", "commit_mamba2_kernel")
        public = lambda: K.tree_mamba2(x, dt, a, b, c, parent, h0, **extra, dt_softplus=True)  # noqa: E731
        launcher = lambda: m2_t.tree_mamba2_fwd(  # noqa: E731
            x, dt, a, b, c, parent, h0, extra["D"], extra["z"], extra["dt_bias"], True, (0.0, math.inf), None)
        commit_launcher, commit_public = m2_t.commit_mamba2_fwd, K.commit_mamba2
    with _swapped(mod, [names[0]] if stubbed else [], _NoLaunch):
        out = launcher()
    return EagerCase(mod, *names, public=public, launcher=launcher,
                     commit_public=lambda: commit_public(h0, out, parent, leaf),
                     commit=lambda: commit_launcher(h0, out, parent, leaf))


def host_work(args, shapes, dtype, gen) -> int:
    """Our launchers' share of an eager tree op's host time, on any machine: each launcher (and its commit) called with
    its Triton kernels replaced by no-ops, on CPU tensors of the real layer sizes (q / k / v as views of one
    projection, as a mixer hands them over). The CPU allocator stands in for CUDA's caching allocator."""
    rows = []
    for op in [o for o in args.ops if o in ("gdn", "mamba2")]:
        for bsz in args.batch:
            for n in args.nodes:
                case = eager_case(op, shapes, bsz, n, args, dtype, "cpu", gen, views=True, stubbed=True)
                with _swapped(case.mod, [case.tree_kernel, case.commit_kernel], _NoLaunch):
                    rows.append({"op": op, "B": bsz, "N": n, "launcher_us": host_us(case.launcher, 2000),
                                 "commit_launcher_us": host_us(case.commit, 2000)})
    print(f"{'op':>7} {'B':>3} {'N':>4} {'launcher':>9} {'commit':>8}   (host us per call, Triton's launch excluded)")
    for r in rows:
        print(f"{r['op']:>7} {r['B']:>3} {r['N']:>4} {r['launcher_us']:>9.1f} {r['commit_launcher_us']:>8.1f}")
    print(json.dumps({"bench": "tree_kernels_host_work", "machine": platform.processor() or platform.machine(),
                      "rows": rows}))
    return 0


def launch_costs(args, shapes, dtype, gen) -> int:
    """Where an eager verify forward's time per tree op goes at small B and N: the host's cost of each layer of
    the call (public op -> launcher -> Triton's own launch; our share = the launcher with Triton's launch replaced by
    a no-op, on the same CUDA tensors) against the kernel's GPU time inside a CUDA graph. Every host measure is the
    best of `--rounds` alternated rounds."""
    rows = []
    for op in [o for o in args.ops if o in ("gdn", "mamba2")]:
        for bsz in args.batch:
            for n in args.nodes:
                case = eager_case(op, shapes, bsz, n, args, dtype, "cuda", gen)
                dev = torch.device("cuda")
                alloc = lambda: torch.empty(bsz, n, 8, device=dev)  # noqa: E731  (one allocation, for scale)
                timed = {"public_us": case.public, "launcher_us": case.launcher, "ours_us": case.launcher,
                         "triton_us": triton_launch_alone(case.mod, case.tree_kernel, case.launcher),
                         "commit_public_us": case.commit_public, "commit_ours_us": case.commit,
                         "commit_triton_us": triton_launch_alone(case.mod, case.commit_kernel, case.commit),
                         "alloc_us": alloc}
                # Our share: the launcher timed with its Triton kernel a no-op.
                stubbed = {"ours_us": case.tree_kernel, "commit_ours_us": case.commit_kernel}
                row = {"op": op, "B": bsz, "N": n}
                for _ in range(args.rounds):
                    for key, fn in timed.items():
                        with _swapped(case.mod, [stubbed[key]] if key in stubbed else [], _NoLaunch):
                            row[key] = min(row.get(key, math.inf), host_us(fn))
                args.cuda_graph = True
                row["gpu_graph_us"] = bench_us(case.launcher, args)
                rows.append(row)
    cols = [("public", "public_us"), ("launcher", "launcher_us"), ("ours", "ours_us"), ("triton", "triton_us"),
            ("commit", "commit_public_us"), ("c.ours", "commit_ours_us"), ("c.triton", "commit_triton_us"),
            ("alloc", "alloc_us"), ("GPU (graph)", "gpu_graph_us")]
    print(f"{'op':>7} {'B':>3} {'N':>4} " + " ".join(f"{c:>{max(8, len(c))}}" for c, _ in cols)
          + f"   (host us per call, best of {args.rounds} rounds; GPU us inside a CUDA graph)")
    for r in rows:
        print(f"{r['op']:>7} {r['B']:>3} {r['N']:>4} " + " ".join(f"{r[k]:>{max(8, len(c))}.1f}" for c, k in cols))
    print(json.dumps({"bench": "tree_kernels_launch", "device": torch.cuda.get_device_name(), "rows": rows}))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sm90_report:
        return sm90_report()
    if args.host_work:
        torch.manual_seed(args.seed)
        return host_work(args, (GdnShape(), Mamba2Shape()), torch.bfloat16 if args.dtype == "bf16" else torch.float32,
                         torch.Generator().manual_seed(args.seed))
    from tqdm import tqdm

    if args.dry_run:
        device = "cpu"
        args.batch, args.nodes = [1, 2], [8, 16]
        args.dtype = "fp32"
        shapes = (GdnShape(h=2, hv=4, k=32, v=16), Mamba2Shape(h=2, p=8, s=16, g=1), ConvShape(c=64))
        fla = None
        print("[dry run] CPU, tiny sizes, PyTorch closed form as 'ours' and the naive loop as 'branch': "
              "the numbers below are not claims", file=sys.stderr)
    else:
        if not torch.cuda.is_available():
            print("a CUDA GPU is needed; use --dry-run for the CPU smoke test", file=sys.stderr)
            return 2
        device = "cuda"
        shapes = (GdnShape(), Mamba2Shape(), ConvShape())
        fla = load_fla() if "gdn" in args.ops else None
    torch.manual_seed(args.seed)
    impls = Impls(args.dry_run, args.block_v, args.num_warps)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    if args.launch_costs:
        if args.dry_run:
            print("--launch-costs needs a GPU", file=sys.stderr)
            return 2
        return launch_costs(args, shapes, dtype, torch.Generator().manual_seed(args.seed))

    checks = correctness_gate(args, impls, shapes, device, fla)
    failed = [c for c in checks if not c[1] <= c[2]]
    for name, err, tol in checks:
        print(f"[gate] {name:34s} rel err {err:.2e} (tol {tol:.0e}) {'FAIL' if (name, err, tol) in failed else 'ok'}",
              file=sys.stderr)
    if failed:
        print(json.dumps({"bench": "tree_kernels", "gate": "failed", "failed": [c[0] for c in failed]}))
        return 1

    ceil = measure_ceilings(args)
    if not args.dry_run:
        print(f"[ceilings] copy {ceil.copy_gbps:.0f} GB/s, matmul fp32 {ceil.fp32_tflops:.1f} / tf32 "
              f"{ceil.tf32_tflops:.0f} / bf16 {ceil.bf16_tflops:.0f} TFLOP/s", file=sys.stderr)
    gen = torch.Generator().manual_seed(args.seed)
    configs = [(op, b, n) for op in args.ops for b in args.batch for n in args.nodes]
    rows: list[Row] = []
    if args.out and os.path.exists(os.path.join(args.out, "rows.jsonl")):
        os.remove(os.path.join(args.out, "rows.jsonl"))  # this run's rows only
    for op, bsz, n in tqdm(configs, desc="tree kernels", file=sys.stderr):
        if op == "gdn":
            rows.append(run_gdn(args, impls, shapes[0], bsz, n, dtype, device, gen, ceil, fla))
        elif op == "mamba2":
            rows.append(run_mamba2(args, impls, shapes[1], bsz, n, dtype, device, gen, ceil))
        else:
            rows.append(run_conv(args, impls, shapes[2], bsz, n, dtype, device, gen, ceil))
        # Row by row, so a run that dies later (a fault in one config poisons the CUDA context) keeps the rest.
        r = rows[-1]
        # The conv op has no branch-by-branch baseline (its window is a gather, not a state).
        tqdm.write(f"[row] {r.op} B={r.batch} N={r.nodes}: ours {fmt(r.ours_us)} us, branch-by-branch "
                   f"{fmt(r.branch_us)} us, speedup {fmt(r.speedup, '.2f')}x", file=sys.stderr)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "rows.jsonl"), "a") as f:
                f.write(json.dumps(asdict(rows[-1])) + "\n")
        if device == "cuda":
            torch.cuda.empty_cache()

    print_table(rows)
    summary = summarize(rows, args, ceil)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tree_kernels.json"), "w") as f:
            json.dump({"summary": summary, "args": vars(args), "gate": checks, "rows": [asdict(r) for r in rows],
                       "shapes": [asdict(s) for s in shapes]}, f, indent=1)
        plot(rows, os.path.join(args.out, "tree_kernels.png"))
    # NaN is not JSON: ceilings are NaN in a dry run.
    print(json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
