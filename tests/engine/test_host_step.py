"""The host side of a step, made cheaper for HVD's and the serving engine's per-step cost: drafts built from lists,
their memoized host lists, the batch of them walked on the host lists, and the list walk of `realized_payoff`."""

import dataclasses
import random

import pytest
import torch

from hf_hybrid_spec.drafters import DraftBudget
from hf_hybrid_spec.drafters.suffix import SuffixDrafter
from hf_hybrid_spec.hvd.merge import realized_payoff
from hf_hybrid_spec.tree import DraftBatch, DraftTree, _prior_scores, empty_draft



def random_tree(rng: random.Random, m: int, vocab: int = 5) -> tuple[list[int], list[int], list[float]]:
    parents = [rng.randrange(-1, i) for i in range(m)]
    return [rng.randrange(vocab) for _ in range(m)], parents, [rng.random() for _ in range(m)]


def test_from_lists_builds_the_same_tree_as_the_constructor_and_keeps_its_lists():
    tokens, parents, scores = random_tree(random.Random(0), 9)
    fast = DraftTree.from_lists(tokens, parents, scores, info={"drafter": "x"})
    slow = DraftTree(tokens=torch.tensor([tokens]), parents=torch.tensor([parents]),
                     scores=torch.tensor([scores], dtype=torch.float32), info={"drafter": "x"})
    # The tensors are made when first read (the batch and serving steps read only the lists); every field reads.
    assert not {"tokens", "parents", "scores"} & set(vars(fast)) and fast.num_nodes == len(tokens)
    assert all(hasattr(fast, f.name) for f in dataclasses.fields(DraftTree))
    for name in ("tokens", "parents", "scores"):
        assert torch.equal(getattr(fast, name), getattr(slow, name))
        assert getattr(fast, name).dtype == getattr(slow, name).dtype
    assert fast.info == slow.info and fast.probs is None and fast.next_probs is None
    assert fast.host() == slow.host()
    assert fast.host().tokens == tokens and fast.host().parents == parents
    assert DraftTree.from_lists([], []).num_nodes == 0
    with pytest.raises(ValueError, match="topological"):
        DraftTree.from_lists([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="one entry per node"):
        DraftTree.from_lists([1, 2], [-1])


def test_host_lists_follow_the_tree_through_select_and_copies():
    tree = DraftTree.from_lists([4, 5, 6], [-1, 0, 0], [0.9, 0.5, 0.4])
    kept = tree.select(torch.tensor([0, 2]))
    assert kept.host().tokens == [4, 6] and kept.host().parents == [-1, 0]
    # HVD's relabeled copy: the same nodes and host lists, deterministic, its own info; the original untouched.
    sampled = DraftTree(tokens=tree.tokens, parents=tree.parents, probs=torch.rand(1, 3, 7), scores=tree.scores,
                        info={"drafter": "model"}, next_probs=torch.rand(1, 4, 7))
    sampled.host()
    relabeled = sampled.relabeled({"drafter": "hvd"})
    assert relabeled.tokens is sampled.tokens and relabeled.parents is sampled.parents
    assert relabeled.scores is sampled.scores and relabeled.host() is sampled.host()
    assert relabeled.probs is None and relabeled.next_probs is None and relabeled.info == {"drafter": "hvd"}
    assert sampled.probs is not None and sampled.next_probs is not None and sampled.info == {"drafter": "model"}
    assert {f.name for f in dataclasses.fields(DraftTree)} <= set(vars(relabeled))
    # A tree from lists, relabeled before its tensors were read (HVD over a suffix draft): its lists, then the same
    # tensors as the original when read; a dataclasses.replace copy keeps every field.
    fresh = DraftTree.from_lists([4, 5, 6], [-1, 0, 0], [0.9, 0.5, 0.4])
    copy = fresh.relabeled({"drafter": "hvd"})
    assert copy.num_nodes == 3 and copy.host() is fresh.host() and copy.info == {"drafter": "hvd"}
    assert torch.equal(copy.tokens, fresh.tokens) and torch.equal(copy.scores, fresh.scores)
    replaced = dataclasses.replace(fresh, info={"x": 1})
    assert torch.equal(replaced.parents, fresh.parents) and replaced.num_nodes == 3 and replaced.info == {"x": 1}


def reference_payoff(tree: DraftTree, tokens: list[int]) -> int:
    """The dict walk realized_payoff used before (first matching sibling, as greedy verification takes it)."""
    children = {}
    for j, (t, p) in enumerate(zip(tree.tokens[0].tolist(), tree.parents[0].tolist())):
        children.setdefault((p, t), j)
    node, accepted = -1, 0
    for tok in tokens:
        node = children.get((node, tok), -2)
        if node == -2:
            break
        accepted += 1
    return accepted


def test_realized_payoff_list_walk_matches_the_dict_walk():
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        tokens, parents, _ = random_tree(rng, rng.randrange(1, 12), vocab=3)
        tree = DraftTree.from_lists(tokens, parents)
        # Continuations that follow a random root path, then go anywhere.
        node, cont = -1, []
        while True:
            kids = [j for j, p in enumerate(parents) if p == node]
            if not kids or rng.random() < 0.2:
                break
            node = rng.choice(kids)
            cont.append(tokens[node])
        cont += [rng.randrange(3) for _ in range(2)]
        assert realized_payoff(tree, cont) == reference_payoff(tree, cont)
        checked += reference_payoff(tree, cont) > 1
    assert checked > 30  # the walks went deep, not just one level


def test_suffix_drafts_respect_the_budget_they_declare():
    assert SuffixDrafter.respects_budget
    drafter = SuffixDrafter(use_global=False, max_depth=8)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 2, 3, 9, 1, 2, 3]])
    drafter.begin(ids, None, None)
    for nodes, depth in ((3, 8), (16, 2), (16, 5)):
        draft = drafter.propose(ids, DraftBudget(max_nodes=nodes, max_depth=depth))
        assert 0 < draft.num_nodes <= nodes
        assert int(draft.depth().max()) <= depth


def test_a_subclass_that_overrides_propose_makes_no_budget_promise():
    import hf_hybrid_spec as H
    from hf_hybrid_spec.testing import tiny_model

    model = tiny_model("qwen3_5_text")
    ids = torch.randint(2, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)[0].tolist()

    class Oracle(SuffixDrafter):
        """Proposes the next 8 reference tokens whatever the budget (deeper than the last steps allow)."""

        def propose(self, input_ids, budget):
            nxt = ref[input_ids.shape[1] : input_ids.shape[1] + 8]
            return DraftTree.from_lists(nxt, list(range(-1, len(nxt) - 1)))

    class Tuned(SuffixDrafter):
        max_match_length = 16

    assert not Oracle.respects_budget and Tuned.respects_budget and SuffixDrafter.respects_budget
    # The loop trims what a drafter without the promise proposes beyond the budget: exactly max_new_tokens.
    out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate, drafter=Oracle(use_global=False))
    assert out[0].tolist() == ref[: ids.shape[1] + 5]


def test_a_batch_of_host_drafts_is_the_tensor_walks_batch_to_the_bit():
    """`DraftBatch.from_drafts` walks depths and capped values on the rows' host lists; `from_tensors` settles them
    with tensor passes per level. Random batches (empty rows, unscored rows among scored ones, scores outside [0, 1]):
    every field equal."""
    rng = random.Random(0)
    for _ in range(200):
        drafts = []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(0, 12)
            tokens, parents, scores = random_tree(rng, n, vocab=50)
            scores = None if rng.random() < 0.4 else [rng.uniform(-0.2, 1.2) for _ in range(n)]
            drafts.append(DraftTree.from_lists(tokens, parents, scores) if n else empty_draft(1))
        batch = DraftBatch.from_drafts(drafts)
        hosts = [d.host() for d in drafts]
        width = batch.tokens.shape[1]
        scores = None
        if any(h.scores is not None for h in hosts):
            rows = [h.scores if h.scores is not None else _prior_scores(h.parents, 0.6) for h in hosts]
            scores = torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)
        walked = DraftBatch.from_tensors(batch.tokens, batch.parents, scores.view(len(hosts), width) if scores is not
                                         None else None, batch.count, 0.6)
        for name in ("tokens", "parents", "values", "depth", "count"):
            assert torch.equal(getattr(batch, name), getattr(walked, name)), name
    assert empty_draft(1) is empty_draft(1) and empty_draft(1).num_nodes == 0  # one shared empty draft


def test_from_drafts_lays_out_each_rows_lists():
    """The batch's tables hold each row's tokens and parents, padded (tokens 0, parents -1), as int64."""
    rng = random.Random(1)
    drafts = [DraftTree.from_lists(*random_tree(rng, n, vocab=50)) for n in (3, 7, 1)] + [empty_draft(1)]
    batch = DraftBatch.from_drafts(drafts)
    assert batch.tokens.dtype == batch.parents.dtype == batch.depth.dtype == torch.long
    assert batch.values.dtype == torch.float32 and batch.tokens.shape == (4, 7)
    for row, d in enumerate(drafts):
        n = d.num_nodes
        assert batch.tokens[row].tolist() == d.host().tokens + [0] * (7 - n)
        assert batch.parents[row].tolist() == d.host().parents + [-1] * (7 - n)


def test_suffix_chain_growth_from_an_implicit_node_is_the_best_first_trees():
    """From a substring that occurred once the suffix trie lays out its occurrence's continuation directly
    (`_grow_chain`); the general best-first growth (`_grow_tree`) gives the same draft, for every implicit match in
    random texts, under budgets and caps of every size and near the trie's depth and the sequence's end."""
    from hf_hybrid_spec.drafters.suffix import SuffixTrie

    rng = random.Random(2)
    checked = 0
    for trial in range(30):
        max_match_length = rng.choice([3, 6, 32])
        period = rng.randint(2, 9)
        text = [rng.randrange(4 if trial % 2 else 40) for _ in range(rng.randint(10, 60))]
        text += text[:period] * rng.randint(0, 3)
        trie = SuffixTrie(max_match_length + 8)
        active = trie.extend_many([], text)
        for m, node in enumerate(active[:max_match_length], start=1):
            if node >= 0:
                continue
            for nodes, depth in ((24, 8), (3, 8), (24, 2), (1, 1), (24, 12)):
                cap = rng.choice([min(nodes, m), nodes])  # (the whole budget too: the trie depth binds)
                assert trie._grow_chain(node, m, depth, 0.1, cap) == trie._grow_tree(node, m, depth, 0.1, True, cap)
                # Earlier positions of the same occurrence, whose continuations run into the text.
                back = node + rng.randint(1, len(text))
                if back < 0:
                    assert trie._grow_chain(back, m, depth, 0.1, cap) == trie._grow_tree(back, m, depth, 0.1, True,
                                                                                         cap)
                    checked += 1
    assert checked > 100



@pytest.mark.parametrize("new", [[1, 2, 3], [1, 7, 3], [7], [], [2, 3, 4, 5, 6]])
def test_one_host_rows_append_is_the_batch_append(new):
    """A serving request's recorder (one row on the host, host stopping criteria, stopped rows truncated) takes its
    own quicker `append`: the same tokens, lengths, buffer and stop as the batch's path (an eos mid-step, the length
    limit inside the step)."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    from hf_hybrid_spec.engine.rows import BatchRecorder

    def recorder():
        return BatchRecorder(torch.tensor([[9, 8, 9]]), StoppingCriteriaList([MaxLengthCriteria(7),
                                                                              EosTokenCriteria(7)]), True, 0, 9)

    fast, batch = recorder(), recorder()
    batch.host_stopping = batch._host_view = None  # the generic path: the criteria on tensors, device-style writes
    for rec in (fast, batch):
        rec.append([0], [new])
    assert fast.host == batch.host and fast.lengths == batch.lengths and fast.finished == batch.finished
    assert torch.equal(fast.buffer, batch.buffer)
    assert fast.finished[0] == (7 in new or 3 + len(new) >= 7)
