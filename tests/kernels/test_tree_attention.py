"""Tree attention (`kernels.attention`) and its routing into the fused verify forward (`models.tree_attention`):
the Triton kernel against the reference (interpreter on CPU, compiled on a GPU), and a model's forward with its
attention routed to the kernel against the same forward on sdpa."""

import helpers  # noqa: F401  (on CPU: runs Triton in the interpreter, set before the kernel module loads)
import pytest
import torch

pytest.importorskip("triton", reason="the tree-attention kernel is Triton only: pip install -e '.[triton]'")

from hf_hybrid_spec.kernels.attention import torch_tree_attention  # noqa: E402
from hf_hybrid_spec.kernels.attention.triton_tree import triton_tree_attention  # noqa: E402

from hf_hybrid_spec.models import get_adapter, tree_attention  # noqa: E402
from hf_hybrid_spec.testing import tiny_model  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def tree_inputs(b, hq, hkv, n, length, d, dtype, seed=0, visible=0.4):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen).to(DEVICE, dtype)
               for shape in ((b, hq, n, d), (b, hkv, length, d), (b, hkv, length, d)))
    allowed = torch.rand(b, 1, n, length, generator=gen) < visible
    allowed[..., : length // 3] = True  # a committed prefix
    allowed[..., -1] = False  # unfilled static slots at the end
    allowed[0, 0, 0] = False
    allowed[0, 0, 0, 5] = True  # a row that sees one key, in one split
    mask = torch.zeros(b, 1, n, length).masked_fill(~allowed, torch.finfo(dtype).min).to(DEVICE, dtype)
    return q, k, v, mask


@pytest.mark.slow
@pytest.mark.parametrize("b,hq,hkv,n,length,d", [
    (1, 8, 2, 8, 100, 64),     # grouped heads, the 8-node bucket
    (2, 4, 4, 5, 70, 48),      # no grouping, head dim not a power of 2, two rows of the batch
    (1, 8, 2, 33, 130, 32),    # more rows than one row block
    (1, 2, 1, 3, 200, 256),    # head dim 256 (Qwen3.5)
    (1, 4, 2, 1, 17, 16),      # one node
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not CUDA, reason="the Triton interpreter's bf16 tl.dot is wrong (triton 3.9: errors of 1e10 on a 16x16 product)"))])
def test_triton_tree_attention_matches_the_reference(b, hq, hkv, n, length, d, dtype):
    q, k, v, mask = tree_inputs(b, hq, hkv, n, length, d, dtype, seed=n + length)
    ref = torch_tree_attention(q.double(), k.double(), v.double(), mask.double(), d**-0.5)
    out = triton_tree_attention(q, k, v, mask, d**-0.5)
    assert out.shape == (b, n, hq, d) and out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    assert (out.double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
    # The row that sees one key gets exactly that key's value.
    torch.testing.assert_close(out[0, 0, 0].float(), v[0, 0, 5].float(), rtol=tol, atol=tol)


def test_triton_tree_attention_refuses_mismatched_shapes():
    q, k, v, mask = tree_inputs(1, 3, 2, 4, 20, 16, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        triton_tree_attention(q, k, v, mask, 0.25)
    q, k, v, mask = tree_inputs(1, 4, 2, 4, 20, 16, torch.float32)
    with pytest.raises(ValueError, match="mask"):
        triton_tree_attention(q, k, v, mask[..., :10], 0.25)


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_routed_attention_runs_the_kernel_inside_a_model_and_matches_sdpa(family, monkeypatch):
    """The model's attention layers through `routed_attention`, the kernel forced on this device (on CPU: the
    interpreter), against the same forward on sdpa: same logits; the configs are put back after."""
    model = tiny_model(family).to(DEVICE)  # on a GPU the kernel compiles; on CPU the interpreter runs it
    modules = get_adapter(model).attention_modules(model)
    assert modules and model.config._attn_implementation == "sdpa"
    calls = []

    def applies(*args):  # the kernel's own conditions, on any device (on CPU: the interpreter), counted
        calls.append(tree_attention.kernel_supports(*args))
        return calls[-1]

    monkeypatch.setattr(tree_attention, "kernel_applies", applies)
    n, prefix = 6, 9
    ids = torch.randint(2, 90, (1, prefix + n), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    # A tree mask: the prefix, then each node sees itself and (as a chain with one branch) its ancestors.
    parent = [-1, 0, 1, 1, 3, 4]
    allowed = torch.zeros(n, prefix + n, dtype=torch.bool)
    allowed[:, :prefix] = True
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, prefix + j] = True
            j = parent[j]
    full = torch.ones(1, 1, prefix + n, prefix + n).tril().bool()
    full[0, 0, prefix:] = allowed
    mask = torch.zeros(full.shape).masked_fill(~full, torch.finfo(torch.float32).min).to(DEVICE)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        with tree_attention.routed_attention(modules):
            assert all(m.config._attn_implementation == tree_attention.TREE_ATTENTION for m in modules)
            out = model(ids, attention_mask=mask).logits
            # Another thread running the model meanwhile gets sdpa itself: the kernel is never asked.
            import threading

            before, elsewhere = len(calls), []
            worker = threading.Thread(target=lambda: elsewhere.append(model(ids, attention_mask=mask).logits))
            worker.start()
            worker.join()
            assert len(calls) == before and torch.equal(elsewhere[0], ref)
    assert all(m.config._attn_implementation == "sdpa" for m in modules)
    assert calls and all(calls)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_kernel_applies_only_where_the_kernel_computes_the_same():
    q = torch.zeros(1, 4, 3, 16)
    k = torch.zeros(1, 2, 10, 16)
    mask = torch.zeros(1, 1, 3, 10)
    assert not tree_attention.kernel_applies(q, k, k, mask, 0.0, {})  # CPU tensors: sdpa
    if CUDA:
        q, k, mask = q.cuda(), k.cuda(), mask.cuda()
        assert tree_attention.kernel_applies(q, k, k, mask, 0.0, {})
        assert not tree_attention.kernel_applies(q, k, k, mask.bool(), 0.0, {})
        assert not tree_attention.kernel_applies(q, k, k, mask, 0.1, {})
        assert not tree_attention.kernel_applies(q, k, k, mask, 0.0, {"sliding_window": 4})
        assert not tree_attention.kernel_applies(q, k, k, mask[..., :5], 0.0, {})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_compile_verify_with_the_attention_kernel_matches_plain_greedy(family, monkeypatch):
    """The static runner's fused verify forward with its attention on the kernel (forced on the CPU: the
    interpreter; the runner's own tree mask over its static slots, every bucket): stock greedy's output."""
    from helpers import RandomTreeDrafter

    import hf_hybrid_spec as H

    calls = []

    def applies(*args):
        calls.append(tree_attention.kernel_supports(*args))
        return calls[-1]

    monkeypatch.setattr(tree_attention, "kernel_applies", applies)
    model = tiny_model(family).to(DEVICE)
    ids = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    cfg = H.AssistantConfig(compile=True, compile_verify=True, compile_buckets=(4, 8, 16), max_draft_tokens=15)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate, assistant_config=cfg,
                         drafter=RandomTreeDrafter(96, reference=ref.cpu(), max_nodes=14))
    assert torch.equal(out, ref)
    assert calls and all(calls)  # every attention call of the verify forwards went to the kernel
