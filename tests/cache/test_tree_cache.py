"""Tree forward + commit on every adapter family, against the stock model run on each root path."""

import pytest
import torch
from hf_hybrid_spec.kernels import use_backend
from transformers import DynamicCache

from hf_hybrid_spec import HybridTreeCache, get_adapter
from hf_hybrid_spec.cache import commit_paths
from hf_hybrid_spec.forward import forward_tokens, forward_tree
from hf_hybrid_spec.testing import TINY_FAMILIES, tiny_model
from hf_hybrid_spec.tree import DraftTree, build_verify_tree

FAMILIES = sorted(TINY_FAMILIES)


def random_tree(n, max_depth, vocab, gen):
    parents, depth = [], []
    for i in range(n):
        cands = [-1] + [j for j in range(i) if depth[j] < max_depth - 1]
        p = cands[int(torch.randint(len(cands), (1,), generator=gen))]
        parents.append(p)
        depth.append(0 if p < 0 else depth[p] + 1)
    tokens = torch.randint(2, vocab, (1, n), generator=gen)
    return DraftTree(tokens=tokens, parents=torch.tensor([parents]))


def stock_logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits[0].float()


@pytest.mark.parametrize("backend", ["torch", "naive"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_and_commit_match_sequential(family, backend):
    model = tiny_model(family)
    get_adapter(model)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 96, (1, 9), generator=gen)
    with use_backend(backend), torch.no_grad():
        cache = HybridTreeCache(model.config)
        forward_tokens(model, prompt[:, :-1], cache, position_ids=torch.arange(8)[None])
        draft = random_tree(11, 5, 96, gen)
        tree = build_verify_tree(prompt[:, -1], draft)
        out = forward_tree(model, tree, cache, prefix_length=8, root_position=torch.tensor([8]))
        logits = out.logits[0].float()
        # Every node's logits equal the stock model's on prompt + that node's root path.
        kids = tree.children(0)
        leaves = [i for i in range(tree.num_nodes) if not kids[i]]
        for leaf in leaves:
            path = tree.ancestors[0, leaf].nonzero().flatten()
            ref = stock_logits(model, torch.cat([prompt[:, :-1], tree.tokens[:, path]], dim=1))[8:]
            torch.testing.assert_close(logits[path], ref, rtol=1e-4, atol=1e-4)
        leaf = leaves[len(leaves) // 2]
        path = tree.ancestors[0, leaf].nonzero().flatten()
        commit_paths(cache, [path.tolist()], [8])
        # After the commit the cache continues exactly like a stock cache fed the same tokens.
        seq = torch.cat([prompt[:, :-1], tree.tokens[:, path]], dim=1)
        ref_cache = DynamicCache(config=model.config)
        forward_tokens(model, seq, ref_cache, position_ids=torch.arange(seq.shape[1])[None])
        nxt = torch.randint(2, 96, (1, 3), generator=gen)
        pos = torch.arange(seq.shape[1], seq.shape[1] + 3)[None]
        a = forward_tokens(model, nxt, cache, position_ids=pos, logits_to_keep=0).logits
        b = forward_tokens(model, nxt, ref_cache, position_ids=pos, logits_to_keep=0).logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1", "lfm2"])
def test_abort_leaves_cache_untouched(family):
    model = tiny_model(family)
    get_adapter(model)
    prompt = torch.randint(2, 96, (1, 7))
    with torch.no_grad():
        cache = HybridTreeCache(model.config)
        forward_tokens(model, prompt, cache, position_ids=torch.arange(7)[None])
        snap = cache.snapshot()
        tree = build_verify_tree(torch.tensor([5]), random_tree(6, 3, 96, torch.Generator().manual_seed(0)))
        forward_tree(model, tree, cache, prefix_length=7, root_position=torch.tensor([7]))
        cache.abort()
        after = cache.snapshot()
    assert after.kv_lengths == snap.kv_lengths
    for key, t in snap.recurrent_states.items():
        assert torch.equal(after.recurrent_states[key], t)
    for key, t in snap.conv_states.items():
        assert torch.equal(after.conv_states[key], t)


def test_routing_leaves_plain_forward_unchanged():
    model = tiny_model("qwen3_5_text")
    ids = torch.randint(2, 96, (1, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        get_adapter(model)
        get_adapter(model)  # idempotent
        after = model(input_ids=ids).logits
        ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(before, after)
    assert ref.shape[1] == 17


def test_begin_tree_requires_prefill_and_matching_prefix():
    model = tiny_model("qwen3_5_text")
    get_adapter(model)
    cache = HybridTreeCache(model.config)
    with pytest.raises(RuntimeError, match="prefill"):
        cache.begin_tree(torch.tensor([[-1]]), prefix_length=0)
    with torch.no_grad():
        forward_tokens(model, torch.randint(2, 96, (1, 5)), cache, position_ids=torch.arange(5)[None])
    with pytest.raises(RuntimeError, match="prefix"):
        cache.begin_tree(torch.tensor([[-1]]), prefix_length=3)
    with pytest.raises(ValueError):
        cache.begin_tree(torch.tensor([[0]]), prefix_length=5)
    assert not cache.in_tree_mode


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_a_path_that_does_not_go_down_from_the_root_is_refused_and_the_commit_after_it_is_exact(family):
    model = tiny_model(family)
    get_adapter(model)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 96, (1, 8), generator=gen)
    draft = random_tree(10, 4, 96, gen)
    snaps = []
    for refused_first in (False, True):
        with torch.no_grad():
            cache = HybridTreeCache(model.config)
            forward_tokens(model, prompt[:, :-1], cache, position_ids=torch.arange(7)[None])
            tree = build_verify_tree(prompt[:, -1], draft)
            forward_tree(model, tree, cache, prefix_length=7, root_position=torch.tensor([7]))
            leaf = tree.num_nodes - 1
            path = tree.ancestors[0, leaf].nonzero().flatten().tolist()
            if refused_first:
                for bad in (path[1:], path[::-1], [0, tree.num_nodes]):
                    with pytest.raises(ValueError, match="path must start at the root"):
                        commit_paths(cache, [bad], [7])
            commit_paths(cache, [path], [7])
            snaps.append(cache.snapshot())
    assert snaps[0].kv_lengths == snaps[1].kv_lengths
    for key, t in snaps[0].recurrent_states.items():
        assert torch.equal(snaps[1].recurrent_states[key], t)
    for key, t in snaps[0].conv_states.items():
        assert torch.equal(snaps[1].conv_states[key], t)
