"""The skinny GEMM of the verify forward (`kernels.gemm`): the Triton kernel against F.linear (interpreter on CPU,
compiled on a GPU), its custom op and fallback, and its routing inside `fusion.fused_regions`."""

import functools

import pytest
import torch
import torch.nn.functional as F
import test_kernels  # noqa: F401  (on CPU: runs Triton in the interpreter, set before the kernel module loads)

import hf_hybrid_spec as H
from hf_hybrid_spec import fusion
from hf_hybrid_spec.kernels import gemm
from hf_hybrid_spec.kernels.gemm.triton_skinny import SkinnyConfig, triton_skinny_linear
from hf_hybrid_spec.testing import tiny_model

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("rows,n,k,config,bias", [
    (9, 100, 300, SkinnyConfig(), False),                                   # ragged N and K
    (3, 64, 512, SkinnyConfig(block_n=32, block_k=128, split_k=2), True),  # K split: float32 partial sums
    (33, 40, 200, SkinnyConfig(block_n=16, block_k=64, split_k=2), True),  # ragged split
    (64, 48, 96, SkinnyConfig(block_n=64, block_k=64), False),              # the largest row tile
    (1, 17, 33, SkinnyConfig(block_n=16, block_k=64), False),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_skinny_linear_matches_f_linear(rows, n, k, config, bias, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    y = triton_skinny_linear(x.view(1, rows, k), w, b, config)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (1, rows, n) and y.dtype == dtype
    # fp16 output rounding (|y| ~ sqrt(K)); fp32: products in tf32 on a GPU
    tol = 2e-3 if dtype == torch.float16 else (2e-2 if CUDA else 1e-4)
    err = (y[0].double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, err
    # Two splits add their partial sums in one order: bit-identical when run again.
    assert torch.equal(y, triton_skinny_linear(x.view(1, rows, k), w, b, config))


def test_triton_skinny_linear_refuses_what_it_is_not_for():
    w = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 64 rows"):
        triton_skinny_linear(torch.randn(65, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="K=12"):
        triton_skinny_linear(torch.randn(2, 12, device=DEVICE), w)


def test_skinny_linear_is_f_linear_where_the_kernel_does_not_apply():
    x, w, b = torch.randn(2, 5, 16), torch.randn(8, 16), torch.randn(8)
    assert not gemm.skinny_supported(x, w)  # CPU
    assert torch.equal(gemm.skinny_linear(x, w, b), F.linear(x, w, b))
    # As a custom op it is traced by torch.compile as one call (what the compiled MLP regions see).
    compiled = torch.compile(lambda a: gemm.skinny_linear(a, w, b), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), F.linear(x, w, b))
    if CUDA:
        big = torch.randn(65, 16, device="cuda", dtype=torch.bfloat16)
        assert not gemm.skinny_supported(big, w.to("cuda", torch.bfloat16))  # > 64 rows: cuBLAS
        assert not gemm.skinny_supported(big[:4].float(), w.cuda())  # fp32: cuBLAS


def test_fused_regions_route_the_given_linears_and_put_them_back():
    model = tiny_model("qwen3_5_text")
    assert fusion.linear_modules(model) == []  # only GPU fp16 / bf16 layers are routed
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears
    ids = torch.randint(2, 90, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        with fusion.fused_regions(model, [], linears):
            assert all(isinstance(m.__dict__.get("forward"), functools.partial) for m in linears)
            routed = model(ids).logits
    assert not any("forward" in m.__dict__ for m in linears)
    assert torch.equal(routed, ref)  # on CPU the skinny op is F.linear


def test_compile_verify_gemm_must_be_a_bool():
    with pytest.raises(ValueError, match="compile_verify_gemm must be a bool"):
        H.AssistantConfig(compile_verify_gemm="yes")


@pytest.mark.skipif(not CUDA, reason="the skinny GEMM runs on a GPU")
def test_skinny_linear_tunes_outside_capture_and_replays_in_a_graph():
    torch.manual_seed(0)
    w = torch.randn(3352, 2048, device="cuda", dtype=torch.bfloat16) / 45
    x = torch.randn(9, 2048, device="cuda", dtype=torch.bfloat16)
    assert gemm.skinny_supported(x, w)
    y = gemm.skinny_linear(x, w)
    assert any(key[:2] == (3352, 2048) for key in gemm.tuned_configs())
    ref = F.linear(x.float(), w.float())
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm.skinny_linear(static_x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm.skinny_linear(static_x, w)
    static_x.copy_(x * 2)
    graph.replay()
    assert torch.equal(out, gemm.skinny_linear(x * 2, w))
