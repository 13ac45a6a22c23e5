"""Tree kernels vs their naive references: Triton (interpreter on CPU, compiled on GPU), closed-form PyTorch.

Every op is checked on random trees (random branching, depth 1..8, odd sizes, GQA), output AND committed
state, with NaN-poisoned allocations so an element the kernel never writes fails; a chain must equal the
sequential recurrence (transformers' own reference implementations); leaf = -1 must leave a state row bit
for bit unchanged. Real-size GPU checks live in test_kernels_gpu.py.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

# helpers sets up the Triton interpreter on CPU, before the kernel modules below are imported.
from helpers import DEVICE, TOL, assert_close, chain, random_leaf, random_tree, run
from hf_hybrid_spec.kernels import tree

from hf_hybrid_spec import kernels

try:
    import triton
except ImportError:  # a CPU install without the [triton] extra: the PyTorch forms are still checked
    triton = None
if triton is not None:
    from hf_hybrid_spec.kernels.conv import triton_tree as conv_triton
    from hf_hybrid_spec.kernels.gated_delta_rule import triton_tree as gdn_triton
    from hf_hybrid_spec.kernels.mamba2 import triton_tree as mamba2_triton

needs_triton = pytest.mark.skipif(triton is None, reason="the Triton forms need triton: pip install -e '.[triton]' "
                                  "(the interpreter runs them on a CPU)")
TRITON = pytest.param("triton", marks=needs_triton)

GDN_TREE = {
    "naive": (kernels.naive_tree_gated_delta_rule, kernels.naive_commit_gated_delta_rule),
    "torch": (kernels.torch_tree_gated_delta_rule, kernels.torch_commit_gated_delta_rule),
}
if triton is not None:
    GDN_TREE["triton"] = (gdn_triton.triton_tree_gated_delta_rule, gdn_triton.triton_commit_gated_delta_rule)
CONV_TREE = {
    "naive": (kernels.naive_tree_causal_conv1d, kernels.naive_commit_causal_conv1d),
    "torch": (kernels.torch_tree_causal_conv1d, kernels.torch_commit_causal_conv1d),
}
if triton is not None:
    CONV_TREE["triton"] = (conv_triton.triton_tree_causal_conv1d, conv_triton.triton_commit_causal_conv1d)
MAMBA2_TREE = {
    "naive": (kernels.naive_tree_mamba2, kernels.naive_commit_mamba2),
    "torch": (kernels.torch_tree_mamba2, kernels.torch_commit_mamba2),
}
if triton is not None:
    MAMBA2_TREE["triton"] = (mamba2_triton.triton_tree_mamba2, mamba2_triton.triton_commit_mamba2)


# ----------------------------------------------------------------------------------------------------------
# Gated delta rule
# ----------------------------------------------------------------------------------------------------------


def gdn_inputs(bsz, n, h, hv, kdim, vdim, use_qk_l2norm, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(bsz, n, h, kdim), randn(bsz, n, h, kdim)
    if not use_qk_l2norm:
        # Unit keys keep I + A well conditioned, as the l2norm does in the models.
        k = k / k.norm(dim=-1, keepdim=True)
    v = randn(bsz, n, hv, vdim)
    g = F.logsigmoid(randn(bsz, n, hv) + 2.0)
    beta = torch.sigmoid(randn(bsz, n, hv))
    h0 = randn(bsz, hv, kdim, vdim)
    cast = [t.to(DEVICE, dtype) for t in (q, k, v, g, beta)]
    return (*cast, h0.to(DEVICE))


GDN_CASES = [
    # B, N, H, HV, K, V, depth, use_qk_l2norm, varlen
    pytest.param(2, 37, 2, 4, 60, 36, 8, True, False, id="B2-N37-H2-HV4-K60-V36-D8-l2"),
    pytest.param(1, 64, 1, 2, 32, 16, 8, False, False, id="B1-N64-H1-HV2-K32-V16-D8"),
    pytest.param(3, 13, 2, 2, 16, 20, 1, True, False, id="B3-N13-H2-HV2-K16-V20-D1"),
    pytest.param(2, 50, 1, 1, 100, 70, 4, True, True, id="B2-N50-H1-HV1-K100-V70-D4-varlen"),
    pytest.param(1, 16, 1, 1, 256, 32, 5, True, False, id="B1-N16-H1-HV1-K256-V32-D5"),
    pytest.param(2, 1, 1, 2, 16, 16, 1, False, False, id="B2-N1-H1-HV2-K16-V16"),
    pytest.param(2, 23, 3, 6, 40, 24, 2, True, True, id="B2-N23-H3-HV6-K40-V24-D2-varlen"),
]


@pytest.mark.parametrize("backend", [TRITON, "torch"])
@pytest.mark.parametrize("bsz, n, h, hv, kdim, vdim, depth, use_qk_l2norm, varlen", GDN_CASES)
def test_gated_delta_rule_vs_naive(backend, bsz, n, h, hv, kdim, vdim, depth, use_qk_l2norm, varlen):
    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, h, hv, kdim, vdim, use_qk_l2norm, seed=n)
    parent = random_tree(bsz, n, depth, seed=depth)
    num_nodes = None
    if varlen:
        num_nodes = torch.tensor([max(1, n - 7 * b) for b in range(bsz)], device=DEVICE)
        # Padding nodes are children of the committed state that nobody descends from.
        parent = torch.where(torch.arange(n, device=DEVICE)[None] < num_nodes[:, None], parent, -1)
    h0_before = h0.clone()
    scale = 0.3 if depth == 2 else None
    ref = kernels.naive_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, scale, use_qk_l2norm, num_nodes)
    tree_fn, commit_fn = GDN_TREE[backend]
    out = run(backend, tree_fn, q, k, v, g, beta, parent, h0, scale=scale, use_qk_l2norm=use_qk_l2norm,
              num_nodes=num_nodes)
    assert out.o.dtype == q.dtype
    assert_close("o", ref.o, out.o)
    assert_close("u", ref.u, out.u)
    assert_close("k", ref.k, out.k)
    assert_close("g_cum", ref.g_cum, out.g_cum)
    if varlen:
        pad = torch.arange(n, device=DEVICE)[None] >= num_nodes[:, None]
        assert (out.o[pad] == 0).all(), "padding nodes must output exactly 0"

    leaf = random_leaf(bsz, n, seed=n)
    if varlen:
        leaf = torch.minimum(leaf, num_nodes - 1)
    new_ref = kernels.naive_commit_gated_delta_rule(h0, ref, parent, leaf)
    new = run(backend, commit_fn, h0, out, parent, leaf)
    assert_close("committed state", new_ref, new)
    assert torch.equal(h0, h0_before), "initial_state must not be modified"
    for b in (leaf < 0).nonzero().flatten().tolist():
        assert torch.equal(new[b], h0[b]), "leaf = -1 must leave the state bit-identical"


@pytest.mark.parametrize("backend", [TRITON, "torch", "naive"])
def test_gated_delta_rule_chain_is_the_recurrence(backend):
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    bsz, n, h, hv, kdim, vdim = 2, 29, 2, 4, 48, 40
    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, h, hv, kdim, vdim, True, seed=1)
    # Value heads share key heads (HV = 2H): repeated here, since transformers 5.17's reference takes one key head per
    # value head (its callers repeat; 5.24's repeats itself). Run 49, on 5.17, failed all three backends without it.
    # transformers' own torch function, unwrapped: where fla is installed, its hub decorator dispatches the name to
    # fla's fused kernel (other conventions; on the H200 that is what this test compared against).
    reference = inspect.unwrap(qwen.torch_recurrent_gated_delta_rule)
    rep = hv // h
    o_ref, s_ref = reference(
        q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v, g, beta, initial_state=h0,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    parent = chain(bsz, n)
    tree_fn, commit_fn = GDN_TREE[backend]
    out = run(backend, tree_fn, q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    assert_close("o", o_ref, out.o)
    leaf = torch.full((bsz,), n - 1, device=DEVICE)
    assert_close("final state", s_ref, run(backend, commit_fn, h0, out, parent, leaf))


@pytest.mark.parametrize("backend", [TRITON, "torch", "naive"])
def test_gated_delta_rule_commit_nothing_is_a_copy(backend):
    bsz, n = 3, 11
    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, 1, 2, 24, 20, True, seed=2)
    # Subnormals, signed zeros and large values survive a copy but not an arithmetic detour.
    h0[0, 0, 0, :3] = torch.tensor([-0.0, 1e-42, 1e30])
    parent = random_tree(bsz, n, 4, seed=3)
    tree_fn, commit_fn = GDN_TREE[backend]
    out = tree_fn(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    leaf = torch.full((bsz,), -1, device=DEVICE)
    new = run(backend, commit_fn, h0, out, parent, leaf)
    assert new.data_ptr() != h0.data_ptr()
    assert torch.equal(new, h0) and torch.equal(new.view(torch.int32), h0.view(torch.int32))


@needs_triton
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_gated_delta_rule_reads_views_of_one_projection(use_qk_l2norm):
    """The mixers hand the kernel q, k and v split out of one [B, N, 2*H*K + HV*V] conv output: the Triton launcher
    reads those views through their node stride instead of copying them; same outputs and factors as contiguous
    inputs (and the commit, which reads the returned k, still works when k is returned as is)."""
    bsz, n, h, hv, kdim, vdim = 2, 19, 2, 4, 32, 24
    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, h, hv, kdim, vdim, use_qk_l2norm, seed=7)
    packed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)  # [B, N, C]
    qs, ks, vs = torch.split(packed, [h * kdim, h * kdim, hv * vdim], dim=-1)
    qs, ks, vs = qs.view(bsz, n, h, kdim), ks.view(bsz, n, h, kdim), vs.view(bsz, n, hv, vdim)
    assert not qs.is_contiguous() and not vs.is_contiguous()
    assert tree.node_strided(qs) is qs and tree.node_strided(vs) is vs
    parent = random_tree(bsz, n, 5, seed=7)
    fn = gdn_triton.triton_tree_gated_delta_rule
    ref = run("triton", fn, q, k, v, g, beta, parent, h0, use_qk_l2norm=use_qk_l2norm)
    out = run("triton", fn, qs, ks, vs, g, beta, parent, h0, use_qk_l2norm=use_qk_l2norm)
    for name in ("o", "u", "k", "g_cum"):
        assert torch.equal(getattr(ref, name), getattr(out, name)), name
    leaf = random_leaf(bsz, n, seed=7)
    commit = gdn_triton.triton_commit_gated_delta_rule
    assert torch.equal(run("triton", commit, h0, ref, parent, leaf), run("triton", commit, h0, out, parent, leaf))
    # Layouts the kernel cannot read through one node stride are copied.
    assert tree.node_strided(q.transpose(0, 1).contiguous().transpose(0, 1)).is_contiguous()


@needs_triton
def test_gated_delta_rule_fp16_inputs():
    bsz, n, h, hv, kdim, vdim = 2, 21, 1, 2, 32, 16
    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, h, hv, kdim, vdim, True, dtype=torch.float16, seed=4)
    parent = random_tree(bsz, n, 6, seed=4)
    ref = kernels.naive_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    out = run("triton", gdn_triton.triton_tree_gated_delta_rule, q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    assert out.o.dtype == torch.float16 and out.u.dtype == out.k.dtype == out.g_cum.dtype == torch.float32
    # The reference computes on the same fp16 inputs; the fp16 rounding of o differs, and on a GPU the fp32
    # operands of 16-bit inputs go through TF32 (the interpreter multiplies in fp32).
    tf32 = 5e-3 if DEVICE == "cuda" else TOL
    assert_close("o", ref.o, out.o, tol=max(2e-3, tf32))
    assert_close("u", ref.u, out.u, tol=tf32)


@needs_triton
def test_gated_delta_rule_validation():
    q, k, v, g, beta, h0 = gdn_inputs(1, 5, 2, 4, 16, 16, True)
    parent = chain(1, 5)
    with pytest.raises(ValueError, match="multiple"):
        gdn_triton.triton_tree_gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3], parent, h0[:, :3])
    if DEVICE == "cpu":  # the order is checked on the host only: on a GPU that read would sync every call
        with pytest.raises(ValueError, match="topological"):
            gdn_triton.triton_tree_gated_delta_rule(q, k, v, g, beta, parent.flip(-1), h0)
    with pytest.raises(ValueError, match="num_nodes"):
        gdn_triton.triton_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, num_nodes=torch.tensor([1, 2]))


# ----------------------------------------------------------------------------------------------------------
# Causal conv
# ----------------------------------------------------------------------------------------------------------


def conv_inputs(bsz, n, c, width, s, use_bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, n, c, generator=gen)
    weight = torch.randn(c, width, generator=gen)
    bias = torch.randn(c, generator=gen) if use_bias else None
    conv_state = torch.randn(bsz, c, s, generator=gen)
    return x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE), conv_state.to(DEVICE)


CONV_CASES = [
    # B, N, C, W, S, depth, bias, activation
    pytest.param(2, 37, 100, 4, 3, 8, True, "silu", id="B2-N37-C100-W4-S3-D8"),
    pytest.param(3, 5, 300, 4, 5, 2, False, None, id="B3-N5-C300-W4-S5-D2"),
    pytest.param(1, 1, 20, 2, 1, 1, True, "swish", id="B1-N1-C20-W2-S1"),
    pytest.param(2, 64, 48, 3, 2, 8, True, "silu", id="B2-N64-C48-W3-S2-D8"),
    pytest.param(2, 19, 33, 4, 4, 1, True, "silu", id="B2-N19-C33-W4-S4-D1"),
]


@pytest.mark.parametrize("backend", [TRITON, "torch"])
@pytest.mark.parametrize("bsz, n, c, width, s, depth, use_bias, activation", CONV_CASES)
def test_causal_conv1d_vs_naive(backend, bsz, n, c, width, s, depth, use_bias, activation):
    x, weight, bias, conv_state = conv_inputs(bsz, n, c, width, s, use_bias, seed=n)
    parent = random_tree(bsz, n, depth, seed=depth)
    tree_fn, commit_fn = CONV_TREE[backend]
    ref = kernels.naive_tree_causal_conv1d(x, weight, bias, parent, conv_state, activation)
    assert_close("y", ref, run(backend, tree_fn, x, weight, bias, parent, conv_state, activation))

    leaf = random_leaf(bsz, n, seed=c)
    new_ref = kernels.naive_commit_causal_conv1d(conv_state, x, parent, leaf)
    new = run(backend, commit_fn, conv_state, x, parent, leaf)
    # The window commit only moves values: exact.
    assert torch.equal(new, new_ref)
    for b in (leaf < 0).nonzero().flatten().tolist():
        assert torch.equal(new[b], conv_state[b])


@pytest.mark.parametrize("backend", [TRITON, "torch", "naive"])
def test_causal_conv1d_chain_is_the_sequential_conv(backend):
    bsz, n, c, width, s = 2, 23, 40, 4, 3
    x, weight, bias, conv_state = conv_inputs(bsz, n, c, width, s, True, seed=5)
    seq = torch.cat([conv_state, x.transpose(1, 2)], dim=-1)  # [B, C, S + N]
    y_ref = F.silu(F.conv1d(seq[..., s - (width - 1):], weight[:, None, :], bias, groups=c)).transpose(1, 2)
    parent = chain(bsz, n)
    tree_fn, commit_fn = CONV_TREE[backend]
    assert_close("y", y_ref, run(backend, tree_fn, x, weight, bias, parent, conv_state, "silu"))
    leaf = torch.tensor([n - 1, n // 2], device=DEVICE)
    new = run(backend, commit_fn, conv_state, x, parent, leaf)
    assert torch.equal(new[0], seq[0, :, -s:])
    assert torch.equal(new[1], seq[1, :, n // 2 + 1: n // 2 + 1 + s])


@needs_triton
def test_causal_conv1d_validation():
    x, weight, bias, conv_state = conv_inputs(1, 4, 8, 4, 3, True)
    with pytest.raises(ValueError, match="conv_state"):
        conv_triton.triton_tree_causal_conv1d(x, weight, bias, chain(1, 4), conv_state[..., :2])
    with pytest.raises(ValueError, match="activation"):
        conv_triton.triton_tree_causal_conv1d(x, weight, bias, chain(1, 4), conv_state, "relu")


# ----------------------------------------------------------------------------------------------------------
# Mamba-2
# ----------------------------------------------------------------------------------------------------------


def mamba2_inputs(bsz, n, h, g, p, s, extras, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    x, dt = randn(bsz, n, h, p), randn(bsz, n, h)
    a = -torch.exp(torch.rand(h, generator=gen)).to(DEVICE)
    b, c = randn(bsz, n, g, s), randn(bsz, n, g, s)
    h0 = randn(bsz, h, p, s)
    kwargs = {}
    if extras:
        kwargs = {"D": randn(h), "z": randn(bsz, n, h, p), "dt_bias": randn(h), "dt_limit": (0.05, 3.0)}
    return (x, dt, a, b, c, h0), kwargs


MAMBA2_CASES = [
    # B, N, H, G, P, S, depth, extras (D, z, dt_bias, dt_limit), varlen
    pytest.param(2, 37, 4, 2, 36, 20, 8, True, True, id="B2-N37-H4-G2-P36-S20-D8-varlen"),
    pytest.param(1, 64, 2, 1, 16, 128, 8, False, False, id="B1-N64-H2-G1-P16-S128-D8"),
    pytest.param(3, 9, 3, 3, 70, 24, 2, True, False, id="B3-N9-H3-G3-P70-S24-D2"),
    pytest.param(1, 8, 1, 1, 16, 256, 5, False, False, id="B1-N8-H1-G1-P16-S256-D5"),
    pytest.param(2, 17, 2, 1, 8, 16, 1, True, False, id="B2-N17-H2-G1-P8-S16-D1"),
]


@pytest.mark.parametrize("backend", [TRITON, "torch"])
@pytest.mark.parametrize("bsz, n, h, g, p, s, depth, extras, varlen", MAMBA2_CASES)
def test_mamba2_vs_naive(backend, bsz, n, h, g, p, s, depth, extras, varlen):
    (x, dt, a, b, c, h0), kwargs = mamba2_inputs(bsz, n, h, g, p, s, extras, seed=n)
    parent = random_tree(bsz, n, depth, seed=depth)
    if varlen:
        kwargs["num_nodes"] = torch.tensor([max(1, n - 5 * i) for i in range(bsz)], device=DEVICE)
        parent = torch.where(torch.arange(n, device=DEVICE)[None] < kwargs["num_nodes"][:, None], parent, -1)
    h0_before = h0.clone()
    ref = kernels.naive_tree_mamba2(x, dt, a, b, c, parent, h0, **kwargs)
    tree_fn, commit_fn = MAMBA2_TREE[backend]
    out = run(backend, tree_fn, x, dt, a, b, c, parent, h0, **kwargs)
    for name in ("y", "x", "b", "dt", "a_cum"):
        assert_close(name, getattr(ref, name), getattr(out, name))
    if varlen:
        pad = torch.arange(n, device=DEVICE)[None] >= kwargs["num_nodes"][:, None]
        assert (out.y[pad] == 0).all(), "padding nodes must output exactly 0"

    leaf = random_leaf(bsz, n, seed=s)
    if varlen:
        leaf = torch.minimum(leaf, kwargs["num_nodes"] - 1)
    new = run(backend, commit_fn, h0, out, parent, leaf)
    assert_close("committed state", kernels.naive_commit_mamba2(h0, ref, parent, leaf), new)
    assert torch.equal(h0, h0_before), "initial_state must not be modified"
    for row in (leaf < 0).nonzero().flatten().tolist():
        assert torch.equal(new[row], h0[row]), "leaf = -1 must leave the state bit-identical"


@pytest.mark.parametrize("backend", [TRITON, "torch", "naive"])
def test_mamba2_chain_is_the_chunked_scan(backend):
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
    bsz, n, h, g, p, s = 2, 37, 4, 2, 12, 20
    (x, dt, a, b, c, h0), kwargs = mamba2_inputs(bsz, n, h, g, p, s, True, seed=6)
    del kwargs["z"]  # the chunked scan has no gate; Bamba applies it outside
    y_ref, s_ref = bamba.mamba2_chunk_scan(
        x, dt, a, b, c, chunk_size=16, D=kwargs["D"], dt_bias=kwargs["dt_bias"], initial_states=h0,
        dt_softplus=True, dt_limit=kwargs["dt_limit"], return_final_states=True,
    )
    parent = chain(bsz, n)
    tree_fn, commit_fn = MAMBA2_TREE[backend]
    out = run(backend, tree_fn, x, dt, a, b, c, parent, h0, **kwargs)
    assert_close("y", y_ref, out.y)
    leaf = torch.full((bsz,), n - 1, device=DEVICE)
    assert_close("final state", s_ref, run(backend, commit_fn, h0, out, parent, leaf))


@needs_triton
def test_launch_arithmetic_matches_tritons():
    triton = pytest.importorskip("triton")
    for n in range(1, 1100):
        assert tree.pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 32, 64):
            assert tree.cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert tree.pow2(0) == 1 and tree.pow2(1 << 40) == 1 << 40 and tree.pow2((1 << 40) + 1) == 1 << 41


def test_node_strided_keeps_only_layouts_one_node_stride_can_read():
    base = torch.randn(3, 5, 24)
    assert tree.node_strided(base) is base
    view = base[..., 4:20].view(3, 5, 2, 8)  # a slice of the channels, split into heads
    assert tree.node_strided(view) is view
    for bad in (base.transpose(0, 1), base[:, :, ::2], base[:, ::2]):  # batch-major broken, gaps inside a node...
        fixed = tree.node_strided(bad)
        assert fixed is not bad and fixed.is_contiguous() and torch.equal(fixed, bad)
    one = base[:1, :, 4:20]  # one row: its batch stride is never used
    assert tree.node_strided(one) is one


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_mamba2_reads_views_of_one_projection(dtype):
    """A Mamba-2 mixer splits x, B, C out of its conv output and dt out of its projection: the Triton launcher reads
    those views through their node strides instead of copying them (16-bit inputs: the commit reads the fp32 copies
    the kernel stores; fp32 inputs are returned as the factors, so x and B are copied then). Same outputs, factors and
    committed states as contiguous inputs."""
    bsz, n, h, g, p, s = 2, 21, 4, 2, 16, 24
    (x, dt, a, b, c, h0), kwargs = mamba2_inputs(bsz, n, h, g, p, s, True, seed=5)
    x, dt, b, c = (t.to(dtype) for t in (x, dt, b, c))
    kwargs["z"] = kwargs["z"].to(dtype)
    xbc = torch.cat([x.flatten(2), b.flatten(2), c.flatten(2)], dim=-1)  # [B, N, conv_dim]
    xs, bs, cs = torch.split(xbc, [h * p, g * s, g * s], dim=-1)
    xs, bs, cs = xs.view(bsz, n, h, p), bs.view(bsz, n, g, s), cs.view(bsz, n, g, s)
    proj = torch.cat([torch.randn(bsz, n, 5).to(DEVICE, dtype), dt], dim=-1)  # dt as the projection's last slice
    dts = proj[..., 5:]
    assert not xs.is_contiguous() and not dts.is_contiguous()
    assert all(tree.node_strided(t) is t for t in (xs, bs, cs, dts))
    parent = random_tree(bsz, n, 5, seed=5)
    fn = mamba2_triton.triton_tree_mamba2
    ref = run("triton", fn, x, dt, a, b, c, parent, h0, **kwargs)
    out = run("triton", fn, xs, dts, a, bs, cs, parent, h0, **kwargs)
    for name in ("y", "x", "b", "dt", "a_cum"):
        assert torch.equal(getattr(ref, name), getattr(out, name)), name
    leaf = random_leaf(bsz, n, seed=5)
    commit = mamba2_triton.triton_commit_mamba2
    assert torch.equal(run("triton", commit, h0, ref, parent, leaf), run("triton", commit, h0, out, parent, leaf))


@pytest.mark.parametrize("backend", [TRITON, "torch", "naive"])
def test_mamba2_commit_nothing_is_a_copy(backend):
    (x, dt, a, b, c, h0), _ = mamba2_inputs(2, 6, 2, 1, 8, 16, False, seed=7)
    h0[1, 0, 0, :3] = torch.tensor([-0.0, 1e-42, 1e30])
    parent = random_tree(2, 6, 3, seed=7)
    tree_fn, commit_fn = MAMBA2_TREE[backend]
    out = tree_fn(x, dt, a, b, c, parent, h0)
    new = run(backend, commit_fn, h0, out, parent, torch.full((2,), -1, device=DEVICE))
    assert new.data_ptr() != h0.data_ptr()
    assert torch.equal(new.view(torch.int32), h0.view(torch.int32))


@pytest.mark.parametrize("backend", [TRITON, "torch", "naive"])
@pytest.mark.parametrize("op", ["gated_delta_rule", "mamba2"])
def test_commit_into_the_initial_state_is_the_new_state(backend, op):
    """The cache commits in place (`into=` the state buffer itself: the Triton kernels write it directly, each
    program reading its tile before writing it): the same bits as a commit into a new tensor, for accepted paths of
    every depth and rows that accept nothing."""
    bsz, n = 4, 9
    if op == "gated_delta_rule":
        q, k, v, g, beta, h0 = gdn_inputs(bsz, n, 1, 2, 24, 20, True, seed=11)
        inputs, tree_fn = (q, k, v, g, beta), GDN_TREE[backend][0]
    else:
        (x, dt, a, b, c, h0), _ = mamba2_inputs(bsz, n, 2, 1, 8, 16, False, seed=11)
        inputs, tree_fn = (x, dt, a, b, c), MAMBA2_TREE[backend][0]
    parent = random_tree(bsz, n, 3, seed=11)
    leaf = random_leaf(bsz, n, seed=11)
    leaf[1] = -1
    with kernels.use_backend(backend):
        out = tree_fn(*inputs, parent, h0, use_qk_l2norm=True) if op == "gated_delta_rule" else tree_fn(
            *inputs, parent, h0)
        expected = out.commit(h0, parent, leaf)
        state = h0.clone()
        address = state.data_ptr()
        result = run(backend, out.commit, state, parent, leaf, into=state)
    assert result is state and state.data_ptr() == address
    assert torch.equal(state, expected) and torch.equal(state[1], h0[1])
    # A destination the kernel cannot write directly (another dtype) gets the state copied in.
    half = torch.zeros_like(h0, dtype=torch.float64)
    with kernels.use_backend(backend):
        assert out.commit(h0, parent, leaf, into=half) is half
    assert torch.equal(half, expected.double())


@needs_triton
def test_mamba2_validation():
    (x, dt, a, b, c, h0), _ = mamba2_inputs(1, 4, 3, 2, 8, 16, False)
    with pytest.raises(ValueError, match="multiple"):
        mamba2_triton.triton_tree_mamba2(x, dt, a, b, c, chain(1, 4), h0)


@needs_triton
@pytest.mark.parametrize("op", ["gated_delta_rule", "mamba2", "causal_conv1d"])
def test_triton_ops_take_leaves_and_node_counts_in_either_integer_width(op):
    """The runners keep leaves in int64: the launchers hand them (and node counts) to the kernels as they are, with no
    cast launched per call, and the results are the same bits as with int32."""
    bsz, n = 3, 9
    parent = random_tree(bsz, n, 3, seed=12)
    leaf = random_leaf(bsz, n, seed=12)
    leaf[2] = -1
    counts = torch.tensor([n, n - 2, n - 4], device=DEVICE)
    assert tree.index_arg(leaf, leaf.device) is leaf
    assert tree.index_arg(counts.int(), counts.device).dtype == torch.int32
    assert tree.index_arg(leaf.double(), leaf.device).dtype == torch.int32
    results = []
    for width in (torch.int64, torch.int32):
        if op == "gated_delta_rule":
            q, k, v, g, beta, h0 = gdn_inputs(bsz, n, 1, 2, 16, 16, True, seed=12)
            out = gdn_triton.triton_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, num_nodes=counts.to(width))
            results += [out.o, gdn_triton.triton_commit_gated_delta_rule(h0, out, parent, leaf.to(width))]
        elif op == "mamba2":
            (x, dt, a, b, c, h0), _ = mamba2_inputs(bsz, n, 2, 1, 8, 16, False, seed=12)
            out = mamba2_triton.triton_tree_mamba2(x, dt, a, b, c, parent, h0, num_nodes=counts.to(width))
            results += [out.y, mamba2_triton.triton_commit_mamba2(h0, out, parent, leaf.to(width))]
        else:
            gen = torch.Generator().manual_seed(12)
            state = torch.randn(bsz, 8, 3, generator=gen).to(DEVICE)
            x = torch.randn(bsz, n, 8, generator=gen).to(DEVICE)
            results.append(conv_triton.triton_commit_causal_conv1d(state, x, parent, leaf.to(width)))
    half = len(results) // 2
    assert all(torch.equal(a, b) for a, b in zip(results[:half], results[half:]))


# ----------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------


@needs_triton
def test_public_ops_dispatch_to_triton():
    q, k, v, g, beta, h0 = gdn_inputs(1, 9, 1, 2, 16, 16, True, seed=8)
    parent = random_tree(1, 9, 3, seed=8)
    with kernels.use_backend("triton"):
        out = kernels.tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
        new = kernels.commit_gated_delta_rule(h0, out, parent, torch.tensor([8], device=DEVICE))
    ref = kernels.naive_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    assert_close("o", ref.o, out.o)
    assert_close("state", kernels.naive_commit_gated_delta_rule(h0, ref, parent, torch.tensor([8], device=DEVICE)), new)


# ----------------------------------------------------------------------------------------------------------
# Branch-by-branch baselines of the benchmark (one state per node): they must compute the same function
# ----------------------------------------------------------------------------------------------------------


@needs_triton
def test_branch_baselines_vs_naive():
    from hf_hybrid_spec.kernels.gated_delta_rule.triton_branch import branch_commit, triton_branch_gated_delta_rule
    from hf_hybrid_spec.kernels.mamba2.triton_branch import triton_branch_mamba2

    bsz, n = 2, 29
    parent = random_tree(bsz, n, 6, seed=9)
    leaf = random_leaf(bsz, n, seed=9)

    q, k, v, g, beta, h0 = gdn_inputs(bsz, n, 1, 2, 40, 24, True, seed=9)
    ref = kernels.naive_tree_gated_delta_rule(q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    out = run("triton", triton_branch_gated_delta_rule, q, k, v, g, beta, parent, h0, use_qk_l2norm=True)
    assert_close("o", ref.o, out.o)
    new_ref = kernels.naive_commit_gated_delta_rule(h0, ref, parent, leaf)
    assert_close("state", new_ref, branch_commit(h0, out.states, leaf))

    (x, dt, a, b, c, h0), kwargs = mamba2_inputs(bsz, n, 2, 1, 12, 20, True, seed=9)
    ref = kernels.naive_tree_mamba2(x, dt, a, b, c, parent, h0, **kwargs)
    out = run("triton", triton_branch_mamba2, x, dt, a, b, c, parent, h0, **kwargs)
    assert_close("y", ref.y, out.y)
    assert_close("state", kernels.naive_commit_mamba2(h0, ref, parent, leaf), branch_commit(h0, out.states, leaf))


# ----------------------------------------------------------------------------------------------------------
# Mamba-1 (Jamba's selective scan): naive and PyTorch forms, no Triton kernel (kernels/mamba1/common.py says why)
# ----------------------------------------------------------------------------------------------------------
def mamba1_inputs(bsz, n, d, s, extras, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    x, dt = randn(bsz, n, d), randn(bsz, n, d)
    a = -torch.exp(torch.rand(d, s, generator=gen)).to(DEVICE)
    b, c = randn(bsz, n, s), randn(bsz, n, s)
    h0 = randn(bsz, d, s)
    kwargs = {"D": randn(d), "z": randn(bsz, n, d), "dt_bias": randn(d)} if extras else {}
    return (x, dt, a, b, c, h0), kwargs


MAMBA1_CASES = [
    # B, N, D, S, depth, extras (D, z, dt_bias)
    pytest.param(2, 37, 24, 8, 8, True, id="B2-N37-D24-S8-D8"),
    pytest.param(1, 64, 16, 16, 8, False, id="B1-N64-D16-S16-D8"),
    pytest.param(3, 9, 70, 4, 2, True, id="B3-N9-D70-S4-D2"),
    pytest.param(2, 17, 8, 16, 1, True, id="B2-N17-D8-S16-D1"),
]


@pytest.mark.parametrize("bsz, n, d, s, depth, extras", MAMBA1_CASES)
def test_mamba1_vs_naive(bsz, n, d, s, depth, extras):
    (x, dt, a, b, c, h0), kwargs = mamba1_inputs(bsz, n, d, s, extras, seed=n)
    parent = random_tree(bsz, n, depth, seed=depth)
    h0_before = h0.clone()
    ref = kernels.naive_tree_mamba1(x, dt, a, b, c, parent, h0, **kwargs)
    out = kernels.torch_tree_mamba1(x, dt, a, b, c, parent, h0, **kwargs)
    for name in ("y", "x", "b", "dt"):
        assert_close(name, getattr(ref, name), getattr(out, name))
    leaf = random_leaf(bsz, n, seed=s)
    expected = kernels.naive_commit_mamba1(h0, ref, parent, leaf)
    # Walked on the host, and with the path mask (fixed-shape device ops, what a captured commit runs).
    assert_close("committed state", expected, kernels.torch_commit_mamba1(h0, out, parent, leaf))
    on_path = tree.path_mask(parent, leaf)
    masked = kernels.torch_commit_mamba1(h0, out, parent, leaf, on_path=on_path)
    assert_close("committed state (masked)", expected, masked)
    assert torch.equal(h0, h0_before), "initial_state must not be modified"
    for row in (leaf < 0).nonzero().flatten().tolist():
        assert torch.equal(masked[row], h0[row]), "leaf = -1 must leave the state bit-identical"


@pytest.mark.parametrize("backend", ["torch", "naive"])
def test_mamba1_chain_is_the_selective_scan(backend):
    """A chain from the committed state gives the decode step's outputs, token after token (transformers' Jamba
    single-token update, `selective_state_update`), and its final state."""
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    bsz, n, d, s = 2, 13, 24, 8
    (x, dt, a, b, c, h0), kwargs = mamba1_inputs(bsz, n, d, s, True, seed=3)
    state = h0.clone()
    ys = []
    for i in range(n):
        ys.append(jamba.mamba_selective_state_update(state, x[:, i], dt[:, i], a, b[:, i], c[:, i], kwargs["D"],
                                                     dt_bias=kwargs["dt_bias"], dt_softplus=True, z=kwargs["z"][:, i]))
    parent = chain(bsz, n)
    fn = kernels.torch_tree_mamba1 if backend == "torch" else kernels.naive_tree_mamba1
    out = fn(x, dt, a, b, c, parent, h0, **kwargs)
    assert_close("y", torch.stack(ys, dim=1), out.y)
    leaf = torch.full((bsz,), n - 1, device=DEVICE)
    assert_close("final state", state, kernels.commit_mamba1(h0, out, parent, leaf))


def test_mamba1_validation():
    (x, dt, a, b, c, h0), _ = mamba1_inputs(1, 4, 8, 4, False)
    parent = chain(1, 4)
    with pytest.raises(ValueError, match="A must be"):
        kernels.tree_mamba1(x, dt, a[:, :2].T, b, c, parent, h0)
    with pytest.raises(ValueError, match="initial_state"):
        kernels.tree_mamba1(x, dt, a, b, c, parent, h0[:, :4])
    with pytest.raises(ValueError, match="parent"):
        kernels.tree_mamba1(x, dt, a, b, c, torch.tensor([[0, 0, 1, 2]], device=DEVICE), h0)
