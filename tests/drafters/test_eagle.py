"""EAGLE-3 drafter: greedy identity, drafting math vs a step-by-step reference, training-time test
vs inference, Hub format round trip, bad input, and the training recipe end to end."""

import json
import os
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_fixture, tiny_target_with_tokenizer
from safetensors import safe_open

import hf_hybrid_spec as H
from hf_hybrid_spec.drafters import DraftBudget, TargetHidden
from hf_hybrid_spec.eagle import EagleConfig, EagleDrafter, EagleTreeDrafter, default_aux_layers
from hf_hybrid_spec.eagle.training import target_batch, ttt_loss
from hf_hybrid_spec.testing import tiny_config, tiny_model
from hf_hybrid_spec.tree import VerifyResult

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["qwen3_5_text", "falcon_h1"]
VOCAB = 96


def prompt(seed=0, length=10):
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(2, VOCAB, (1, 4), generator=gen)
    return torch.cat([torch.randint(2, VOCAB, (1, length - 8), generator=gen), motif, motif], dim=1)


def aux_hidden(target, ids, layers):
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return tuple(out.hidden_states[i] for i in layers)


@torch.no_grad()
def reference_logp(drafter, fused, tokens, chain):
    """Log-probabilities [len(chain) + 1, draft_vocab] after each prefix of `chain`, by a plain causal forward
    over every step (no cache, no tree mask): committed steps (fused [1, n, H], tokens [1, n]) then the chain's
    steps, each fed the previous step's output."""
    rows = []
    hidden, toks = fused, tokens
    for j in range(len(chain) + 1):
        out, logits = drafter(hidden, input_ids=toks)
        rows.append(torch.log_softmax(logits[0, -1].float(), dim=-1))
        if j < len(chain):
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
            toks = torch.cat([toks, torch.tensor([[int(chain[j])]])], dim=1)
    return torch.stack(rows)


def run_drafter_to(drafter, target, ids, accepted):
    """Drive `drafter` as speculative_generate would: begin on ids[:, :p], accept the first token, then accept
    chunks of `accepted` tokens (hidden states of root..last accepted draft). Returns the committed ids."""
    p = ids.shape[1] - 1 - sum(accepted)
    layers = drafter.target_hidden_layers
    states = aux_hidden(target, ids, layers)
    drafter.begin(ids[:, :p], None, TargetHidden(layers, tuple(s[:, :p] for s in states)))
    drafter.accept(ids[:, : p + 1], VerifyResult(path=[0], tokens=ids[0, p : p + 1], score_nodes=[0]))
    length = p + 1
    for k in accepted:
        hidden = TargetHidden(layers, tuple(s[:, length - 1 : length - 1 + k] for s in states))
        path = list(range(k))
        drafter.accept(ids[:, : length + k], VerifyResult(path=path, tokens=ids[0, length : length + k],
                                                           score_nodes=path), hidden)
        length += k
    return ids[:, :length]


def _to_draft_ids(model, target_ids):
    table = {int(t): d for d, t in enumerate(model.draft_to_target.tolist())}
    return [table[int(t)] for t in target_ids]


# ---------------------------------------------------------------------- configuration
def test_default_aux_layers_prefer_post_attention_taps():

    qwen8 = tiny_config("qwen3_5_text", num_hidden_layers=8,
                        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    assert default_aux_layers(qwen8) == [2, 4, 5]  # 4: output of attention layer 3
    qwen24 = tiny_config("qwen3_5_text", num_hidden_layers=24,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6)
    assert default_aux_layers(qwen24) == [2, 12, 20]  # 20: output of attention layer 19, not 21
    assert default_aux_layers(tiny_config("falcon_h1", num_hidden_layers=8)) == [2, 4, 5]
    assert default_aux_layers(tiny_config("llama", num_hidden_layers=32)) == [2, 16, 29]
    for family in ("qwen3_5_text", "falcon_h1", "bamba", "nemotron_h", "lfm2"):
        layers = default_aux_layers(tiny_config(family))
        n = tiny_config(family).num_hidden_layers
        assert layers == sorted(set(layers)) and all(1 <= i < n for i in layers)


@pytest.mark.parametrize("bad", [dict(draft_vocab_size=200, vocab_size=100), dict(aux_layers=[]),
                                 dict(aux_layers=[2, 2]), dict(aux_layers=[2, 9], target_num_hidden_layers=8),
                                 dict(num_attention_heads=6, num_key_value_heads=4), dict(hidden_size=0)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        EagleConfig(**bad)


# ---------------------------------------------------------------------- drafting math
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_scores_and_chain_match_step_by_step_reference(family):
    target = tiny_model(family)
    torch.manual_seed(1)
    model = EagleDrafter.from_target(target, draft_vocab_size=48)
    model.set_vocab_maps(torch.randperm(VOCAB - 2)[:48] + 2)
    ids = torch.cat([prompt(int(family == "falcon_h1")), torch.randint(2, VOCAB, (1, 6))], dim=1)
    n_steps = ids.shape[1] - 1
    layers = tuple(model.config.aux_layers)
    fused = model.fuse([s[:, :n_steps] for s in aux_hidden(target, ids, layers)]).detach()
    tokens = ids[:, 1:]

    tree_drafter = EagleTreeDrafter(model, target, top_k=3)
    committed = run_drafter_to(tree_drafter, target, ids, accepted=[3, 2])
    assert torch.equal(committed, ids) and tree_drafter.steps == n_steps
    draft = tree_drafter.propose(ids, DraftBudget(max_nodes=16, max_depth=4))
    assert draft.num_nodes == 16 and int(draft.depth().max()) <= 4
    parents = draft.parents[0].tolist()
    for node in range(draft.num_nodes):
        path = []
        cur = node
        while cur >= 0:
            path.append(cur)
            cur = parents[cur]
        path.reverse()
        chain = _to_draft_ids(model, draft.tokens[0, path].tolist())
        ref = reference_logp(model, fused, tokens, [model.draft_to_target[c] for c in chain[:-1]])
        expected = sum(float(ref[j, c]) for j, c in enumerate(chain))
        assert abs(float(draft.scores[0, node].log()) - expected) < 1e-4, (node, path)
        if parents[node] >= 0:
            assert draft.scores[0, node] <= draft.scores[0, parents[node]] + 1e-7

    chain_drafter = EagleTreeDrafter(model, target, top_k=1)
    run_drafter_to(chain_drafter, target, ids, accepted=[3, 2])
    chain = chain_drafter.propose(ids, DraftBudget(max_nodes=5, max_depth=5))
    assert chain.parents[0].tolist() == [-1, 0, 1, 2, 3]
    greedy = []
    for _ in range(5):
        ref = reference_logp(model, fused, tokens, [model.draft_to_target[c] for c in greedy])
        greedy.append(int(ref[-1].argmax()))
    assert chain.tokens[0].tolist() == model.draft_to_target[greedy].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_training_time_test_matches_inference(family):
    # TTT step i at position t must be what a depth-(i+1) draft node sees at inference when its ancestors are
    # the true tokens: the same logits as the step-by-step reference.
    target = tiny_model(family)
    torch.manual_seed(2)
    model = EagleDrafter.from_target(target, draft_vocab_size=VOCAB)
    ids = prompt(3, length=14)
    batch = target_batch(target, ids, model.config.aux_layers)
    with torch.no_grad():
        out = ttt_loss(model, batch, steps=4, keep_logits=True)
        fused = model.fuse([s[:, :-1] for s in batch.aux_states])
    for t in (0, 4, 8):
        for i in range(4):
            chain = ids[0, t + 2 : t + 2 + i].tolist()
            ref = reference_logp(model, fused[:, : t + 1], ids[:, 1 : t + 2], chain)[-1]
            got = torch.log_softmax(out.logits[i][0, t], dim=-1)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert len(out.step_losses) == 4 and out.positions[0] > out.positions[3] > 0


# ---------------------------------------------------------------------- greedy identity
def _train_briefly(target, seq, steps=40):
    """A drafter fit to `seq`, the target's own greedy output, so that its drafts get accepted."""
    torch.manual_seed(0)
    model = EagleDrafter.from_target(target, draft_vocab_size=VOCAB)
    batch = target_batch(target, seq, model.config.aux_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = ttt_loss(model, batch, steps=4).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


class RecordingEagle(EagleTreeDrafter):
    """Keeps its key cache when the request ends, for the in-step check."""

    def end(self, input_ids):
        # Static storage holds the committed steps in the first `steps` slots of its buffer.
        keys = self.keys if self._store is None else self._store.keys[:, :, : self.steps]
        self.final_keys, self.final_ids = keys.clone(), input_ids.clone()
        super().end(input_ids)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_random_and_trained_chain_and_tree(family):
    target = tiny_model(family)
    ids = prompt(5)
    # Greedy outputs are prefixes of longer greedy outputs: one stock run gives the reference and training data.
    longer = target.generate(ids, do_sample=False, max_new_tokens=32, eos_token_id=None)
    ref = longer[:, : ids.shape[1] + 24]
    trained = _train_briefly(target, longer)
    random_init = EagleDrafter.from_target(target, draft_vocab_size=32)
    runs = [("random", random_init, 1, 5), ("random", random_init, 4, 16), ("trained", trained, 1, 5)]
    for name, model, top_k, nodes in runs:
        cfg = H.AssistantConfig(drafter="eagle", draft_top_k=top_k, max_draft_tokens=nodes, max_depth=5)
        out = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None,
                              custom_generate=H.speculative_generate, assistant_config=cfg, draft_model=model,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), f"{family} {name} top_k={top_k}"
        if name == "trained":
            assert out.spec_stats.mean_accepted_length > 1.5, out.spec_stats.accepted_lengths
        # Static drafting (compile=True: preallocated drafter keys, fixed-shape expansion; eager on CPU) drafts the
        # same trees: same output, same accepted length at every step.
        static = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None,
                                 custom_generate=H.speculative_generate, assistant_config=cfg.replace(compile=True),
                                 draft_model=model, return_dict_in_generate=True)
        assert torch.equal(static.sequences, ref), f"{family} {name} top_k={top_k} static"
        assert static.spec_stats.accepted_lengths == out.spec_stats.accepted_lengths, f"{family} {name} {top_k}"

    # The trained tree, through a drafter instance that keeps its key cache at the end: it must hold exactly one
    # step per committed token but the root, built from the target's features of the committed tokens (what a
    # from-scratch pass computes).
    # Static storage too (compile=True: the accepts run as fixed-shape passes over the key buffer).
    for static in (False, True):
        drafter = RecordingEagle(trained, target, top_k=4, static=static)
        out = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None,
                              custom_generate=H.speculative_generate, drafter=drafter,
                              assistant_config=H.AssistantConfig(max_draft_tokens=16, max_depth=5, compile=static),
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref) and max(out.spec_stats.accepted_lengths) >= 3
        final = drafter.final_ids
        n = final.shape[1] - 1
        with torch.no_grad():
            fused = trained.fuse([s[:, :n] for s in aux_hidden(target, final, trained.config.aux_layers)])
            step = trained.project(fused, trained.embed(final[:, 1:]), torch.arange(n).unsqueeze(0))
        assert drafter.final_keys.shape == step.key.shape, static
        torch.testing.assert_close(drafter.final_keys, step.key, atol=2e-3, rtol=2e-3, msg=f"static={static}")


def test_static_eagle_storage_is_reused_and_grows():
    from hf_hybrid_spec.eagle.static import _TREES, static_eagle_tree

    target = tiny_model("qwen3_5_text")
    model = EagleDrafter.from_target(target, draft_vocab_size=32)
    cfg = H.AssistantConfig(drafter="eagle", draft_top_k=3, max_draft_tokens=8, max_depth=4, compile=True)
    kw = dict(do_sample=False, eos_token_id=None, custom_generate=H.speculative_generate, assistant_config=cfg,
              draft_model=model)
    for n, new in ((10, 8), (9, 6), (12, 30)):
        ids = prompt(n, length=n)
        ref = target.generate(ids, do_sample=False, max_new_tokens=new, eos_token_id=None)
        assert torch.equal(target.generate(ids, max_new_tokens=new, **kw), ref)
        (tree,) = _TREES[model].values()
        assert tree.capacity == (18 if n < 12 else 42)  # the first request's max_length, until a longer one
    with pytest.raises(RuntimeError, match="holds 42 steps"):
        static_eagle_tree(model, 3, 42).write(40, torch.zeros(1, 1, 3, 1), torch.zeros(1, 1, 3, 1))

    # Leased storage is never handed to a second request running at the same time; released, it is reused.
    class Request:
        pass

    first, second = Request(), Request()
    held = static_eagle_tree(model, 3, 20, owner=first)
    other = static_eagle_tree(model, 3, 20, owner=second)
    assert held is tree and other is not held and held.in_use
    held.release()
    assert static_eagle_tree(model, 3, 20, owner=second) is held
    del second
    assert not held.in_use  # a request that died without ending gives its storage back


def test_static_cache_implies_static_eagle_drafting_and_compile_drafter_needs_it():
    from hf_hybrid_spec.eagle.static import _TREES

    target = tiny_model("qwen3_5_text")
    model = EagleDrafter.from_target(target, draft_vocab_size=32)
    ids = prompt(6)
    ref = target.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None)
    cfg = H.AssistantConfig(drafter="eagle", draft_top_k=3, max_draft_tokens=8, max_depth=4)
    kw = dict(do_sample=False, max_new_tokens=8, eos_token_id=None, custom_generate=H.speculative_generate,
              draft_model=model)
    out = target.generate(ids, assistant_config=cfg, cache_implementation="static", **kw)
    assert torch.equal(out, ref) and len(_TREES.get(model, {})) == 1  # the drafter's static storage was used
    with pytest.raises(ValueError, match="compile_drafter=True .* needs compile=True"):
        target.generate(ids, assistant_config=cfg.replace(compile=False, compile_drafter=True), **kw)
    # compile='auto' (the default) runs a CPU call eagerly: compile_drafter does not apply there, and is no error.
    assert torch.equal(target.generate(ids, assistant_config=cfg.replace(compile_drafter=True), **kw), ref)


@pytest.mark.slow
def test_compile_drafter_on_cpu_drafts_the_same_trees():
    """compile_drafter=True without graphs (CPU): the Inductor-compiled passes run as they are; same output, same
    accepted length at every step as the plain static drafting."""
    from hf_hybrid_spec.eagle.static import _TREES

    target = tiny_model("qwen3_5_text")
    model = EagleDrafter.from_target(target, draft_vocab_size=32)
    ids = prompt(6)
    ref = target.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None)
    cfg = H.AssistantConfig(drafter="eagle", draft_top_k=3, max_draft_tokens=8, max_depth=4, compile=True)
    kw = dict(do_sample=False, max_new_tokens=12, eos_token_id=None, custom_generate=H.speculative_generate,
              draft_model=model, return_dict_in_generate=True)
    plain = target.generate(ids, assistant_config=cfg, **kw)
    fused = target.generate(ids, assistant_config=cfg.replace(compile_drafter=True), **kw)
    assert torch.equal(plain.sequences, ref) and torch.equal(fused.sequences, ref)
    assert fused.spec_stats.accepted_lengths == plain.spec_stats.accepted_lengths
    store = next(t for t in _TREES[model].values() if t.fuse)
    assert store._fused_budgets and store._fused_advance is not None  # the compiled passes ran, none fell back


@pytest.mark.slow
def test_fused_eagle_passes_compile_whole_and_match_the_plain_ones():
    """What `fuse=True` captures on a GPU: the expansion and the accept pass compiled by Inductor with fullgraph=True
    (a graph break anywhere fails here), computing what the plain passes compute. On CPU, eagerly."""
    from hf_hybrid_spec.eagle.static import StaticEagleTree

    target = tiny_model("qwen3_5_text")
    model = EagleDrafter.from_target(target, draft_vocab_size=32)
    store = StaticEagleTree(model, top_k=3, capacity=24, use_graphs=False, fuse=True)
    gen = torch.Generator().manual_seed(0)
    hidden_size = model.config.hidden_size
    for count in (1, 3, 5):
        store.adv_features[:, :count] = torch.randn(1, count, hidden_size, generator=gen)
        store.adv_tokens[:, :count] = torch.randint(0, 64, (1, count), generator=gen)
        store.steps.fill_(4 + count)
        store.keys.zero_()
        plain = [t.clone() for t in store._advance(count)]
        plain_keys = store.keys.clone()
        store.keys.zero_()
        fused = store._fused("advance")(count)
        for a, b in zip(plain, fused):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        # The accept pass writes its steps' keys into the static storage: the compiled one must too.
        assert store.keys.abs().sum() > 0
        torch.testing.assert_close(store.keys, plain_keys, atol=1e-5, rtol=1e-5)
    store.hidden.copy_(torch.randn(1, hidden_size, generator=gen))
    store.logp.copy_(torch.log_softmax(torch.randn(32, generator=gen), dim=-1))
    store.steps.fill_(9)
    plain, fused = store._expand(8, 4), store._fused("expand")(8, 4)
    for name in ("tokens", "parents", "keep"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    torch.testing.assert_close(fused.scores, plain.scores, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_eagle_drafts_match_eager_and_are_reused(family):
    from hf_hybrid_spec.eagle.static import _TREES

    target = tiny_model(family).cuda()
    ids = prompt(5).cuda()
    ref = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    model = EagleDrafter.from_target(target, draft_vocab_size=32).cuda()
    cfg = H.AssistantConfig(drafter="eagle", draft_top_k=4, max_draft_tokens=16, max_depth=5)
    kw = dict(do_sample=False, max_new_tokens=24, eos_token_id=None, custom_generate=H.speculative_generate,
              draft_model=model, return_dict_in_generate=True)
    eager = target.generate(ids, assistant_config=cfg, **kw)
    for fuse in (False, True):  # compile_drafter: the passes compiled by Inductor before capture
        _TREES.pop(model, None)
        captures = []
        for _ in range(2):  # the second request reuses the first one's buffers and graphs
            graphs = target.generate(ids, assistant_config=cfg.replace(compile=True, compile_drafter=fuse), **kw)
            assert torch.equal(graphs.sequences, ref) and torch.equal(eager.sequences, ref)
            if not fuse:  # the same kernels: the same trees (fused ones may round differently, never commit so)
                assert graphs.spec_stats.accepted_lengths == eager.spec_stats.accepted_lengths
            (tree,) = _TREES[model].values()
            captures.append(tree.captures)
        # Draft budgets (at most MAX_GRAPHS) and accept counts (1 .. depth + 1) captured once, in the first request.
        assert 2 <= captures[0] <= tree.MAX_GRAPHS + 6 and captures[1] == captures[0]
        assert len(tree._advance_graphs) >= 1
        assert tree.fuse == fuse and (len(tree._fused_budgets) >= 1) == fuse  # no compile fell back


def _committed_drafter(name):
    path = REPO / "checkpoints" / "drafters" / f"{name}-eagle3"
    return path if (path / "config.json").is_file() else None


@pytest.mark.slow
@pytest.mark.fixture
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_fixture_greedy_identity(name):
    target, tok = load_fixture(name)
    path = _committed_drafter(name)
    if path is not None:
        model = EagleDrafter.from_pretrained(path, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = EagleDrafter.from_target(target)
    enc = tok("import numpy as np\n\n\ndef moving_average(x, w):\n    \"\"\"Moving average of x.\"\"\"\n",
              return_tensors="pt")
    ref = target.generate(**enc, do_sample=False, max_new_tokens=16, eos_token_id=None)
    for top_k, nodes in ((1, 6), (10, 60)):
        cfg = H.AssistantConfig(drafter="eagle", draft_top_k=top_k, max_draft_tokens=nodes, max_depth=6)
        out = target.generate(**enc, do_sample=False, max_new_tokens=16, eos_token_id=None,
                              custom_generate=H.speculative_generate, assistant_config=cfg, draft_model=model,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), f"{name} top_k={top_k}"
        static = target.generate(**enc, do_sample=False, max_new_tokens=16, eos_token_id=None,
                                 custom_generate=H.speculative_generate, assistant_config=cfg.replace(compile=True),
                                 draft_model=model, return_dict_in_generate=True)
        assert torch.equal(static.sequences, ref), f"{name} top_k={top_k} static"
        assert static.spec_stats.accepted_lengths == out.spec_stats.accepted_lengths, name
        if path is not None and top_k > 1:
            # The committed drafter is trained: its tree must get drafts accepted.
            assert out.spec_stats.mean_accepted_length > 1.2, out.spec_stats.accepted_lengths


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_target_head(family, tmp_path):
    """tie_target_head: the draft head is the target's output embedding over the whole vocabulary, read (not
    copied, not trained, not saved); drafting stays exact, eager and static, and survives a save/load round trip."""
    target = tiny_model(family)
    torch.manual_seed(5)
    model = EagleDrafter.from_target(target, draft_vocab_size=40, tie_target_head=True)
    assert model.config.draft_vocab_size == VOCAB and model.lm_head is None and bool(model.t2d.all())
    assert not any(p is target.get_output_embeddings().weight for p in model.parameters())
    hidden = torch.randn(2, 3, target.config.get_text_config().hidden_size)
    expected = model.norm(hidden) @ target.get_output_embeddings().weight.T
    torch.testing.assert_close(model.logits(hidden), expected)

    # Training reaches the drafter's own weights only.
    model.logits(hidden.requires_grad_()).sum().backward()
    assert target.get_output_embeddings().weight.grad is None and model.norm.weight.grad is not None
    model.zero_grad()

    ids = prompt(7)
    ref = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None)
    cfg = H.AssistantConfig(drafter="eagle", draft_top_k=4, max_draft_tokens=16, max_depth=5)
    kw = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, custom_generate=H.speculative_generate,
              return_dict_in_generate=True)
    eager = target.generate(ids, assistant_config=cfg, draft_model=model, **kw)
    static = target.generate(ids, assistant_config=cfg.replace(compile=True), draft_model=model, **kw)
    assert torch.equal(eager.sequences, ref) and torch.equal(static.sequences, ref)
    assert eager.spec_stats.accepted_lengths == static.spec_stats.accepted_lengths

    model.save_pretrained(tmp_path / "d")
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and not any("lm_head" in k or "embed" in k for k in keys)
    assert "output embedding (frozen, not stored here)" in (tmp_path / "d" / "README.md").read_text()
    loaded = EagleDrafter.from_pretrained(tmp_path / "d", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="bind"):
        loaded.logits(hidden)
    again = target.generate(ids, assistant_config=cfg, draft_model=loaded, **kw)
    assert torch.equal(again.sequences, ref) and again.spec_stats.accepted_lengths == eager.spec_stats.accepted_lengths

    with pytest.raises(ValueError, match="draft_vocab_size must equal vocab_size"):
        EagleConfig(vocab_size=96, draft_vocab_size=40, tie_target_head=True)


# ---------------------------------------------------------------------- Hub format
def test_save_load_round_trip_and_hub_layout(tmp_path, monkeypatch):
    target = tiny_model("qwen3_5_text")
    torch.manual_seed(3)
    model = EagleDrafter.from_target(target, draft_vocab_size=40)
    model.set_vocab_maps(torch.randperm(VOCAB)[:40])
    model.init_head_from(target)
    model.config.training["data"] = "unit test"
    mask = os.umask(0o022)
    try:
        model.save_pretrained(tmp_path / "d")
    finally:
        os.umask(mask)
    files = sorted(os.listdir(tmp_path / "d"))
    assert files == ["README.md", "config.json", "model.safetensors"]
    # Every file readable by others as the umask asks (transformers writes its weight shards 0600).
    assert {f: oct((tmp_path / "d" / f).stat().st_mode & 0o777) for f in files} == {f: "0o644" for f in files}
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys
    assert not any("embed" in k for k in keys)  # the embedding is the target's
    card = (tmp_path / "d" / "README.md").read_text()
    assert "qwen3_5_text" in card and "hidden_states[3]" in card and "unit test" in card
    assert json.loads((tmp_path / "d" / "config.json").read_text())["model_type"] == "hf_hybrid_spec_eagle3"

    loaded = EagleDrafter.from_pretrained(tmp_path / "d", dtype=torch.float32)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    assert loaded.config.aux_layers == model.config.aux_layers and loaded.config.training == model.config.training
    ids = torch.cat([prompt(), torch.randint(2, VOCAB, (1, 4))], dim=1)
    drafts = []
    for m in (model, loaded):
        d = EagleTreeDrafter(m, target, top_k=3)
        run_drafter_to(d, target, ids, accepted=[2, 2])
        drafts.append(d.propose(ids, DraftBudget(max_nodes=12, max_depth=4)))
    assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(drafts[0].parents, drafts[1].parents)

    from transformers import AutoModel

    assert type(AutoModel.from_pretrained(tmp_path / "d")) is EagleDrafter

    uploaded = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return type("Repo", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploaded.update(repo=repo_id, files=sorted(os.listdir(folder_path)),
                            card=Path(folder_path, "README.md").read_text())

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    model.push_to_hub("someone/drafter")
    assert uploaded["repo"] == "someone/drafter" and uploaded["files"] == files and uploaded["card"] == card


# ---------------------------------------------------------------------- bad input
def test_bad_input_gets_clear_errors():
    qwen = tiny_model("qwen3_5_text")
    model = EagleDrafter.from_target(qwen, draft_vocab_size=32)
    ids = prompt()
    with pytest.raises(ValueError, match="vocabulary"):
        model.bind(tiny_model("qwen3_5_text", vocab_size=128))
    with pytest.raises(ValueError, match="hidden size"):
        model.bind(tiny_model("qwen3_5_text", hidden_size=96, head_dim=24))
    with pytest.raises(ValueError, match="needs draft_model"):
        qwen.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate,
                      assistant_config=H.AssistantConfig(drafter="eagle"))
    with pytest.raises(ValueError, match="drafter='eagle'"):
        qwen.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate, draft_model=model)
    with pytest.raises(TypeError, match="EagleDrafter"):
        qwen.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate, draft_model=tiny_model("llama"),
                      assistant_config=H.AssistantConfig(drafter="eagle"))
    with pytest.raises(RuntimeError, match="not bound"):
        EagleDrafter(model.config).embed(ids)
    drafter = EagleTreeDrafter(model, qwen)
    with pytest.raises(RuntimeError, match="no target hidden states"):
        drafter.begin(ids, None, None)


# ---------------------------------------------------------------------- the recipe
def _recipe(tmp_path, settings: str):
    """`train_eagle3` imported from recipes/, a tiny target with a tokenizer at tmp_path/target, and a recipe YAML
    (training prompts from the json package's sources) with the test's own `settings` lines appended."""
    import json as json_module

    sys.path.insert(0, str(REPO / "recipes"))
    import train_eagle3

    tiny_target_with_tokenizer(tmp_path / "target")
    config = tmp_path / "recipe.yaml"
    config.write_text(f"source_dirs: [{os.path.dirname(json_module.__file__)}]\nheldout_prompts: 1\n"
                      "heldout_percent: 20\nprompt_tokens: 20\ndraft_vocab_size: 64\nbatch_size: 2\n"
                      "warmup_steps: 1\nlog_every: 1\n" + settings)
    return train_eagle3, config


def test_recipe_runs_end_to_end_and_resumes(tmp_path, capsys):
    train_eagle3, config = _recipe(tmp_path, "num_prompts: 4\nresponse_tokens: 6\nregen_batch_size: 4\n"
                                   "save_every: 1\nttt_steps: 3\neval_prompts: 1\neval_new_tokens: 5\n"
                                   "eval_tree_tokens: 6\neval_depth: 3\neval_top_k: 2\n")
    out = tmp_path / "out"
    args = ["--config", str(config), "--target", str(tmp_path / "target"), "--output_dir", str(out)]
    summary = train_eagle3.main(args + ["--max_steps", "2"])
    assert summary["training"]["steps"] == 2 and summary["evaluate"]["mean_accepted_length_tree"] >= 1.0
    assert sorted(os.listdir(out / "hub")) == ["README.md", "config.json", "model.safetensors"]
    hub = EagleDrafter.from_pretrained(out / "hub")
    assert hub.dtype == torch.bfloat16 and hub.config.draft_vocab_size == 64
    assert "prompts of 20 tokens" in (out / "hub" / "README.md").read_text()
    from datasets import load_from_disk

    data = load_from_disk(str(out / "data"))
    assert len(data["train"]) == 4 and data["train"][0]["prompt_length"] == 20
    # A second run with a larger step budget resumes from the last checkpoint instead of starting over.
    capsys.readouterr()
    summary = train_eagle3.main(args + ["--max_steps", "3", "--stages", "train"])
    assert "resumed from" in capsys.readouterr().out and summary["training"]["steps"] == 3
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 3

    with pytest.raises(SystemExit) as exc:
        train_eagle3.main(["--help"])
    assert exc.value.code == 0


def test_recipe_with_tied_target_head(tmp_path):
    train_eagle3, config = _recipe(tmp_path, "num_prompts: 4\nresponse_tokens: 6\nregen_batch_size: 4\n"
                                   "save_every: 100\nttt_steps: 2\neval_prompts: 1\neval_new_tokens: 5\n"
                                   "eval_tree_tokens: 6\neval_depth: 3\neval_top_k: 2\n")
    out = tmp_path / "out"
    summary = train_eagle3.main(["--config", str(config), "--target", str(tmp_path / "target"), "--output_dir",
                                 str(out), "--max_steps", "2", "--tie_target_head", "true"])
    assert summary["training"]["steps"] == 2 and summary["evaluate"]["mean_accepted_length_tree"] >= 1.0
    hub = EagleDrafter.from_pretrained(out / "hub")
    assert hub.config.tie_target_head and hub.config.draft_vocab_size == hub.config.vocab_size
    with safe_open(out / "hub" / "model.safetensors", "pt") as f:
        assert not any("lm_head" in k for k in f.keys())


def test_docstring_prompts_end_right_after_a_function_docstring(tmp_path):
    sys.path.insert(0, str(REPO / "recipes"))
    import train_eagle3

    source = ('import os\n\n\ndef f(a,\n      b):\n    """Add.\n\n    More words.\n    """\n    return a + b\n\n\n'
              "class C:\n    async def g(self) -> int:\n        r\'\'\'One line.\'\'\'\n        return 1\n\n"
              "    def h(self):\n        return 2  # no docstring\n")
    lines = source.splitlines(keepends=True)
    assert [lines[i] for i in train_eagle3.docstring_ends(lines)] == ['    """\n', "        r\'\'\'One line.\'\'\'\n"]

    class CharTokenizer:  # one token per character, so the cut is easy to read
        def __call__(self, text, add_special_tokens=False):
            return type("Encoding", (), {"input_ids": [ord(c) for c in text]})()

    rng = random.Random(0)
    prompts = {"".join(map(chr, train_eagle3.make_docstring_prompt(source, CharTokenizer(), 12, rng)))
               for _ in range(20)}
    assert prompts == {'ds.\n    """\n', "ne line.\'\'\'\n"}  # the last 12 characters up to each docstring's end
    assert train_eagle3.make_docstring_prompt("def f():\n    return 1\n", CharTokenizer(), 4, rng) is None
    with pytest.raises(ValueError, match="docstring_prompts"):
        train_eagle3.RecipeConfig(target="t", output_dir=str(tmp_path), docstring_prompts=1.5)


def test_regenerate_halves_the_batch_on_out_of_memory(tmp_path, monkeypatch):
    import transformers

    train_eagle3, config = _recipe(tmp_path, "num_prompts: 5\nresponse_tokens: 4\nregen_batch_size: 4\n")
    real = transformers.GenerationMixin.generate
    sizes = []

    def generate(self, input_ids, **kwargs):
        sizes.append(input_ids.shape[0])
        if input_ids.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, input_ids, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", generate)
    out = tmp_path / "out"
    train_eagle3.main(["--config", str(config), "--target", str(tmp_path / "target"), "--output_dir", str(out),
                       "--stages", "regenerate"])
    assert sizes == [4, 2, 1, 1, 1, 1, 1]  # 4 and 2 fail, then every prompt alone
    from datasets import load_from_disk

    data = load_from_disk(str(out / "data"))["train"]
    assert len(data) == 5 and all(len(r["input_ids"]) == 20 + 4 for r in data)


def test_every_eagle_recipe_config_parses(tmp_path):
    sys.path.insert(0, str(REPO / "recipes"))
    import train_eagle3

    configs = sorted((REPO / "recipes" / "configs").glob("eagle3_*.yaml"))
    assert len(configs) >= 3
    for path in configs:
        cfg = train_eagle3.parse_config(["--config", str(path), "--target", "t", "--output_dir", str(tmp_path)])
        assert cfg.max_steps >= 1 and 0.0 <= cfg.docstring_prompts <= 1.0, path.name


@pytest.mark.slow
def test_recipe_shards_the_frozen_target_over_processes(tmp_path, monkeypatch):
    """Two gloo processes (torchrun), DDP over the drafter, with and without --shard_target (FSDP2 over the
    target's layers): the all-gathers are exact, so both runs log the same losses; and --shard_target refuses
    the stages that run the target on one process."""
    import json as json_module
    import subprocess

    train_eagle3, config = _recipe(tmp_path, "num_prompts: 8\nresponse_tokens: 4\nregen_batch_size: 8\n"
                                   "save_every: 100\nttt_steps: 2\nthreads: 1\n")
    common = ["--config", str(config), "--target", str(tmp_path / "target")]
    train_eagle3.main(common + ["--output_dir", str(tmp_path / "ddp"), "--stages", "regenerate"])
    shutil.copytree(tmp_path / "ddp" / "data", tmp_path / "sharded" / "data")
    losses = {}
    for name, extra in (("ddp", []), ("sharded", ["--shard_target", "true"])):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "recipes" / "train_eagle3.py"), *common, "--output_dir", str(tmp_path / name),
               "--stages", "train", "--max_steps", "3", *extra]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        assert ("target sharded over 2 processes" in run.stderr) == bool(extra)
        log = (tmp_path / name / "train_log.jsonl").read_text().splitlines()
        losses[name] = [json_module.loads(line)["loss"] for line in log]
    assert len(losses["ddp"]) == 3
    assert losses["sharded"] == pytest.approx(losses["ddp"], rel=1e-5)

    monkeypatch.setenv("WORLD_SIZE", "2")  # raised before any process group is made
    with pytest.raises(ValueError, match="shard_target runs the train and save stages only"):
        train_eagle3.main(common + ["--output_dir", str(tmp_path / "ddp"), "--shard_target", "true",
                                    "--stages", "train", "evaluate"])
