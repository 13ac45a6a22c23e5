"""Tree kernels compiled on a GPU at real layer sizes, vs the naive references (fp32 oracle on the same inputs).

Sizes: a Qwen3.5 linear-attention layer (H=16, HV=32, K=V=128), Falcon-H1 / Bamba-like Mamba-2 mixers, the
8192-channel short conv in front of Qwen3.5's layer. Trees of N = 64 and 128 nodes, depth <= 8 levels, and
a chain of 128 (the deepest tree a program can hold).

Tolerances (relative Frobenius error vs the fp32 naive recurrence on the same, already-rounded inputs):
    fp32 inputs: 1e-4 everywhere (IEEE fp32 products, fp32 accumulation).
    bf16 inputs: outputs 1e-2 (bf16 rounding of o/y, about 4e-3, plus TF32 products); the gated delta rule's
    u and committed state 1e-2 (TF32 in the solve); Mamba-2's dt, a_cum and committed state 5e-3 (dt is
    rounded to bf16 after softplus like transformers does, and the kernel's exp/log may land one bf16 ulp
    away on a few elements). Keys, gates and fp32 copies of inputs: 1e-5. Window commits must be exact.
"""

import pytest
import torch
from helpers import assert_close, poisoned_allocations, random_leaf, random_tree

from hf_hybrid_spec import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOLS = {
    torch.float32: {"out": 1e-4, "factor": 1e-4, "state": 1e-4, "m2_dt": 1e-5, "m2_state": 1e-4},
    torch.bfloat16: {"out": 1e-2, "factor": 1e-2, "state": 1e-2, "m2_dt": 5e-3, "m2_state": 5e-3},
}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def chain(bsz, n):
    return (torch.arange(n, device="cuda") - 1).expand(bsz, n).contiguous()


def gdn_inputs(bsz, n, h=16, hv=32, kdim=128, vdim=128, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = randn(bsz, n, h, kdim), randn(bsz, n, h, kdim), randn(bsz, n, hv, vdim)
    g = torch.nn.functional.logsigmoid(randn(bsz, n, hv) + 2.0)
    beta = torch.sigmoid(randn(bsz, n, hv))
    return (*(t.to(dtype) for t in (q, k, v, g, beta)), randn(bsz, hv, kdim, vdim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bsz, n, parent_kind", [
    pytest.param(4, 64, "tree", id="B4-N64-H16-HV32-K128-V128-D8"),
    pytest.param(2, 128, "tree", id="B2-N128-H16-HV32-K128-V128-D8"),
    pytest.param(1, 128, "chain", id="B1-N128-chain"),
    pytest.param(3, 37, "varlen", id="B3-N37-varlen"),
])
def test_gated_delta_rule_gpu(dtype, bsz, n, parent_kind):
    from hf_hybrid_spec.kernels.gated_delta_rule.triton_tree import (
        triton_commit_gated_delta_rule,
        triton_tree_gated_delta_rule,
    )

    tol = TOLS[dtype]
    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, dtype=dtype, seed=n)
    parent = chain(bsz, n) if parent_kind == "chain" else random_tree(bsz, n, 8, seed=n)
    num_nodes = None
    if parent_kind == "varlen":
        num_nodes = torch.tensor([n, n - 10, 1], device="cuda")
        parent = torch.where(torch.arange(n, device="cuda")[None] < num_nodes[:, None], parent, -1)
    ref = kernels.naive_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True, num_nodes=num_nodes)
    with poisoned_allocations():
        out = triton_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True, num_nodes=num_nodes)
    assert out.o.dtype == dtype
    assert_close("o", ref.o, out.o, tol["out"])
    assert_close("u", ref.u, out.u, tol["factor"])
    assert_close("k", ref.k, out.k, 1e-5)
    assert_close("g_cum", ref.g_cum, out.g_cum, 1e-5)

    leaf = torch.full((bsz,), n - 1, device="cuda") if parent_kind == "chain" else random_leaf(bsz, n, seed=n)
    if num_nodes is not None:
        leaf = torch.minimum(leaf, num_nodes - 1)
    with poisoned_allocations():
        new = triton_commit_gated_delta_rule(h0, out, parent, leaf)
    assert_close("state", kernels.naive_commit_gated_delta_rule(h0, ref, parent, leaf), new, tol["state"])
    for b in (leaf < 0).nonzero().flatten().tolist():
        assert torch.equal(new[b], h0[b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bsz, n, h, g, p, s", [
    pytest.param(4, 64, 24, 1, 64, 128, id="B4-N64-H24-G1-P64-S128"),
    pytest.param(2, 128, 24, 1, 64, 128, id="B2-N128-H24-G1-P64-S128"),
    pytest.param(2, 64, 32, 2, 64, 256, id="B2-N64-H32-G2-P64-S256"),
])
def test_mamba2_gpu(dtype, bsz, n, h, g, p, s):
    from hf_hybrid_spec.kernels.mamba2.triton_tree import triton_commit_mamba2, triton_tree_mamba2

    tol = TOLS[dtype]
    gen = torch.Generator(device="cuda").manual_seed(n)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    x, dt, b, c, z = (randn(*shp).to(dtype) for shp in
                      ((bsz, n, h, p), (bsz, n, h), (bsz, n, g, s), (bsz, n, g, s), (bsz, n, h, p)))
    a = -torch.exp(torch.rand(h, generator=gen, device="cuda"))
    h0 = randn(bsz, h, p, s)
    extra = {"D": randn(h), "z": z, "dt_bias": randn(h) * 0.5, "dt_limit": (0.001, 10.0)}
    parent = random_tree(bsz, n, 8, seed=n)
    ref = kernels.naive_tree_mamba2(x, dt, a, b, c, parent, h0, **extra)
    with poisoned_allocations():
        out = triton_tree_mamba2(x, dt, a, b, c, parent, h0, **extra)
    assert out.y.dtype == dtype
    assert_close("y", ref.y, out.y, tol["out"])
    for name in ("x", "b"):
        assert_close(name, getattr(ref, name), getattr(out, name), 1e-5)
    for name in ("dt", "a_cum"):
        assert_close(name, getattr(ref, name), getattr(out, name), tol["m2_dt"])
    leaf = random_leaf(bsz, n, seed=s)
    with poisoned_allocations():
        new = triton_commit_mamba2(h0, out, parent, leaf)
    assert_close("state", kernels.naive_commit_mamba2(h0, ref, parent, leaf), new, tol["m2_state"])
    for row in (leaf < 0).nonzero().flatten().tolist():
        assert torch.equal(new[row], h0[row])


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_gpu(dtype):
    from hf_hybrid_spec.kernels.conv.triton_tree import triton_commit_causal_conv1d, triton_tree_causal_conv1d

    bsz, n, c, width, s = 4, 128, 8192, 4, 3
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(bsz, n, c, generator=gen, device="cuda").to(dtype)
    weight = torch.randn(c, width, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(c, generator=gen, device="cuda").to(dtype)
    state = torch.randn(bsz, c, s, generator=gen, device="cuda").to(dtype)
    parent = random_tree(bsz, n, 8, seed=1)
    ref = kernels.naive_tree_causal_conv1d(x, weight, bias, parent, state, "silu")
    with poisoned_allocations():
        y = triton_tree_causal_conv1d(x, weight, bias, parent, state, "silu")
    assert_close("y", ref, y, TOLS[dtype]["out"])
    leaf = random_leaf(bsz, n, seed=2)
    with poisoned_allocations():
        new = triton_commit_causal_conv1d(state, x, parent, leaf)
    assert torch.equal(new, kernels.naive_commit_causal_conv1d(state, x, parent, leaf))


def test_branch_baselines_gpu():
    """The benchmark's baselines compute the same function at real sizes (fp32)."""
    from hf_hybrid_spec.kernels.gated_delta_rule.triton_branch import branch_commit, triton_branch_gated_delta_rule
    from hf_hybrid_spec.kernels.mamba2.triton_branch import triton_branch_mamba2

    bsz, n = 2, 64
    parent = random_tree(bsz, n, 8, seed=3)
    leaf = random_leaf(bsz, n, seed=3)
    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, dtype=torch.float32, seed=3)
    ref = kernels.naive_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    out = triton_branch_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    assert_close("o", ref.o, out.o)
    new_ref = kernels.naive_commit_gated_delta_rule(h0, ref, parent, leaf)
    assert_close("state", new_ref, branch_commit(h0, out.states, leaf))

    gen = torch.Generator(device="cuda").manual_seed(4)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    x, dt = randn(bsz, n, 24, 64), randn(bsz, n, 24)
    b, c = randn(bsz, n, 1, 128), randn(bsz, n, 1, 128)
    h0 = randn(bsz, 24, 64, 128)
    a = -torch.exp(torch.rand(24, generator=gen, device="cuda"))
    ref = kernels.naive_tree_mamba2(x, dt, a, b, c, parent, h0)
    out = triton_branch_mamba2(x, dt, a, b, c, parent, h0)
    assert_close("y", ref.y, out.y)
    assert_close("state", kernels.naive_commit_mamba2(h0, ref, parent, leaf), branch_commit(h0, out.states, leaf))
