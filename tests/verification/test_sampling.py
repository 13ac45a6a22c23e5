"""Lossless sampling: the empirical distribution of speculative samples equals the target's.

Chi-square goodness of fit at a fixed seed; a failing p-value (< 1e-3) means the verification rule is
biased. Two levels: the verification rule alone on synthetic logits (many samples, high power), and the
whole `generate` loop on a tiny-vocabulary hybrid model (joint distribution of the first two tokens).
"""


import pytest
import torch
from helpers import chi2_pvalue, sampled_pairs, target_joint
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_hybrid_spec as H
from hf_hybrid_spec.drafters import Drafter
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DraftTree, build_verify_tree
from hf_hybrid_spec.verification import verify_keyed, verify_sampling

V = 8


def two_level_tree(gen, with_q: bool):
    """Root with 3 children, the first two with 2 children each; tokens distinct among siblings."""
    first = torch.randperm(V, generator=gen)[:3].tolist()
    tokens, parents = list(first), [-1, -1, -1]
    for p in (0, 1):
        for t in torch.randperm(V, generator=gen)[:2].tolist():
            tokens.append(t)
            parents.append(p)
    probs = None
    if with_q:
        # A sampled tree: siblings are independent draws from one draft distribution q of their parent
        # (duplicates allowed), which is what recursive rejection sampling needs to be exact.
        q_root, q_a, q_b = torch.distributions.Dirichlet(torch.ones(V)).sample((3,))
        qs = [q_root, q_root, q_root, q_a, q_a, q_b, q_b]
        tokens = [int(torch.multinomial(q, 1, generator=gen)) for q in qs]
        probs = torch.stack(qs).unsqueeze(0)
    return DraftTree(tokens=torch.tensor([tokens]), parents=torch.tensor([parents]), probs=probs)


def test_keyed_uniforms_are_the_same_bits_on_the_host_and_as_tensors():
    """The host form (numpy, where the positions are known; broadcast keys) and the tensor form (what a device
    runs) of the keyed uniforms agree bit for bit, and keyed_choice draws the same tokens from either."""
    from hf_hybrid_spec.verification import noise

    tensor_form = noise._tensor_uniforms  # what a device runs (here on the CPU's tensors)

    gen = torch.Generator().manual_seed(3)
    seeds = torch.randint(0, 1 << 62, (6, 1), generator=gen)
    rows = torch.randint(0, 1 << 20, (6, 1), generator=gen)
    positions = torch.randint(0, 1 << 40, (6, 5), generator=gen)
    host = noise.keyed_uniforms(seeds, rows, positions)
    assert host.shape == (6, 5) and host.dtype == torch.float64 and bool(((host > 0) & (host < 1)).all())
    assert torch.equal(host, tensor_form(seeds.expand(6, 5), rows.expand(6, 5), positions))
    assert torch.equal(noise.keyed_uniforms(7, 2, positions[0]), tensor_form(7, 2, positions[0]))
    # keyed_choice from broadcast host keys and from flat ones: the tokens the tensor-form uniforms pick
    scores = torch.randn(30, 11, generator=gen)
    flat = (seeds.expand(6, 5).reshape(-1), rows.expand(6, 5).reshape(-1), positions.reshape(-1))
    cdf = torch.softmax(scores, dim=-1).to(torch.float64).cumsum(-1)
    u = tensor_form(*flat) * cdf[:, -1]
    expected = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp(max=10)
    assert torch.equal(noise.keyed_choice(scores, seeds, rows, positions), expected)
    assert torch.equal(noise.keyed_choice(scores, *flat), expected)


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic-tree", "sampled-tree"])
@pytest.mark.parametrize("rule", ["keyed", "rejection"])
def test_verify_rule_is_exact_on_synthetic_logits(with_q, rule):
    if rule == "keyed" and with_q:
        pytest.skip("draws by position need a draft that is a function of the context (no q)")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    scores = torch.randn(8, V, generator=gen) * 1.5
    p = torch.softmax(scores, dim=-1)
    # First committed token ~ p_root; when it was accepted at root child c, the second ~ p_c.
    n = 6000
    first = torch.zeros(V)
    second = {c: torch.zeros(V) for c in range(1, 4)}
    tree = build_verify_tree(torch.tensor([1]), two_level_tree(gen, with_q))
    for _ in range(n):
        if with_q:
            # Losslessness holds over the draft's own randomness: draw a fresh sampled tree every time.
            tree = build_verify_tree(torch.tensor([1]), two_level_tree(gen, with_q))
        if rule == "keyed":
            # A new seed per draw, as each generate call takes one from torch's generator.
            r = verify_keyed(tree, scores, seed=int(torch.randint(1 << 62, (), generator=gen)), row=0, length=5)
        else:
            r = verify_sampling(tree, scores)
        first[int(r.tokens[0])] += 1
        if len(r.path) >= 2:
            second[r.path[1]][int(r.tokens[1])] += 1
    assert chi2_pvalue(first, p[0]) > 1e-3
    for node, counts in second.items():
        if counts.sum() > 200:
            assert chi2_pvalue(counts, p[node]) > 1e-3
    assert sum(c.sum() for c in second.values()) > 500  # deep acceptances were exercised


class RandomSampledDrafter(Drafter):
    """Draws a chain (q sampled, probs attached) or a deterministic random tree each step."""

    def __init__(self, mode, seed=0):
        self.mode = mode
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, input_ids, budget):
        if self.mode == "tree":
            draft = two_level_tree(self.gen, with_q=False)
            return draft.truncate_depth(budget.max_depth)
        depth = min(3, budget.max_depth)
        q = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((depth,))
        toks = torch.stack([torch.multinomial(q[i], 1, generator=self.gen) for i in range(depth)]).view(1, -1)
        return DraftTree(tokens=toks, parents=(torch.arange(depth) - 1).view(1, -1), probs=q.unsqueeze(0))


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", [("falcon_h1", "chain"), ("qwen3_5_text", "tree"), ("jamba", "tree")],
                         ids=["falcon_h1-chain-sampled-q", "qwen3_5-deterministic-tree", "jamba-deterministic-tree"])
def test_generate_sampling_matches_target_distribution(family, mode):
    model = tiny_model(family, vocab_size=V, seed=3)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5]])
    temperature, top_k = 0.6, 4
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    joint = target_joint(model, ids, processors)
    torch.manual_seed(1234)
    counts = sampled_pairs(model, ids, 1000, temperature=temperature, top_k=top_k,
                           custom_generate=H.speculative_generate, drafter=RandomSampledDrafter(mode))
    assert chi2_pvalue(counts, joint) > 1e-3
    # Power check: the same counts reject a law that is visibly sharper than the target's.
    sharper = torch.softmax(2.0 * torch.log(joint + 1e-12), dim=0)
    assert chi2_pvalue(counts, sharper) < 1e-3


@pytest.mark.slow
def test_plain_sampling_passes_the_same_harness():
    """Calibrates the harness: stock sampling passes the test that speculative sampling must pass."""
    model = tiny_model("falcon_h1", vocab_size=V, seed=3)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(4)])
    joint = target_joint(model, ids, processors)
    torch.manual_seed(99)
    counts = sampled_pairs(model, ids, 600, temperature=0.6, top_k=4)
    assert chi2_pvalue(counts, joint) > 1e-3


def test_sampling_is_reproducible_with_a_seed():
    model = tiny_model("falcon_h1", vocab_size=V)
    ids = torch.tensor([[2, 5, 3, 7]])
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(model.generate(ids, do_sample=True, max_new_tokens=12, eos_token_id=None,
                                   custom_generate=H.speculative_generate,
                                   assistant_config=H.AssistantConfig(drafter="ngram")))
    assert torch.equal(outs[0], outs[1])


def _sample(model, ids, seed, **kw):
    torch.manual_seed(seed)
    return model.generate(ids, do_sample=True, temperature=1.3, max_new_tokens=24, eos_token_id=None, **kw)


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_sampled_output_is_the_seeds_whatever_was_drafted(family):
    """Draws keyed by position: after the same torch.manual_seed, every drafter (the process-wide suffix cache before
    and after it learned this very output included) commits the same tokens; another seed gives others."""
    import toy_drafter  # noqa: F401  (registers "toy")

    model = tiny_model(family, vocab_size=V)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5, 3, 7, 2]])
    outs = [_sample(model, ids, 11, custom_generate=H.speculative_generate, assistant_config=cfg)
            for cfg in (H.AssistantConfig(), H.AssistantConfig(), "ngram", "toy",
                        H.AssistantConfig(drafter="suffix", global_cache=False, max_depth=2))]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    other = _sample(model, ids, 12, custom_generate=H.speculative_generate)
    assert not torch.equal(other, outs[0])


def test_sampled_rows_of_a_batch_repeat_with_the_seed_and_differ_from_each_other():
    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3]])
    mask = (ids != 1).long()
    kw = dict(attention_mask=mask, pad_token_id=1, custom_generate=H.speculative_generate)
    first = _sample(model, ids, 3, **kw)
    again = _sample(model, ids, 3, assistant_config="ngram", **kw)
    assert torch.equal(first, again)
    # The same prompt in two rows draws two samples.
    same = torch.tensor([[2, 5, 3, 7, 2], [2, 5, 3, 7, 2]])
    out = _sample(model, same, 3, custom_generate=H.speculative_generate)
    assert not torch.equal(out[0], out[1])


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_a_batch_draws_every_rows_nodes_at_once_as_row_by_row(family, monkeypatch):
    """Sampling with context-free processors (temperature, top-k, top-p) chooses every node of every row in one pass
    (`verification.batch_choices`); the tokens are those the row-by-row rule commits after the same seed."""
    import hf_hybrid_spec.engine.step as step_module
    from hf_hybrid_spec.verification import batch_choices

    model = tiny_model(family, vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    kw = dict(attention_mask=(ids != 1).long(), pad_token_id=1, custom_generate=H.speculative_generate,
              top_k=6, top_p=0.9)
    used = []
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: used.append(1) or batch_choices(*a, **k))
    at_once = _sample(model, ids, 5, **kw)
    assert used  # the batched choice ran
    monkeypatch.setattr(step_module, "choices_apply", lambda *a, **k: False)
    row_by_row = _sample(model, ids, 5, **kw)
    assert torch.equal(at_once, row_by_row)


def test_batch_choices_is_greedy_with_context_free_processors_and_declines_the_others():
    """Greedy with `suppress_tokens` is the argmax of the processed scores; rows with processors of their own, and
    rules of their own (greedy beside sampling, seeds), choose each by its own; processors that read the ids
    (repetition penalty), drafts with a draft distribution and other rules are left to the row-by-row path."""
    from transformers import RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor

    from hf_hybrid_spec.verification import ExactVerifier, batch_choices

    logits = torch.randn(2, 3, V)
    args = (torch.tensor([4, 5]), torch.zeros(2, 3, dtype=torch.long), torch.arange(2), False)
    suppress = LogitsProcessorList([SuppressTokensLogitsProcessor([int(logits[0, 0].argmax())])])
    chosen = batch_choices(ExactVerifier(False), [suppress, suppress], logits, *args)
    expected = suppress(None, logits.reshape(6, V)).argmax(-1).view(2, 3)
    assert torch.equal(chosen, expected) and chosen[0, 0] != logits[0, 0].argmax()
    sampler = ExactVerifier(True, seed=3)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)])
    assert batch_choices(sampler, [warpers, warpers], logits, *args).shape == (2, 3)
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)])
    assert batch_choices(sampler, [penalty, penalty], logits, *args) is None
    # Each row its own processors and rule: the same as each row alone.
    before = logits.clone()
    mixed = batch_choices([sampler, ExactVerifier(False)], [warpers, suppress], logits, *args)
    alone = [batch_choices(sampler, [warpers], logits[:1], args[0][:1], args[1][:1], args[2][:1], False),
             batch_choices(ExactVerifier(False), [suppress], logits[1:], args[0][1:], args[1][1:], args[2][1:], False)]
    assert torch.equal(mixed, torch.cat(alone)) and torch.equal(mixed[1], expected[1])
    assert torch.equal(logits, before)  # the caller's logits are left as they were
    assert batch_choices(sampler, [warpers, warpers], logits, *args[:3], True) is None

    class Other(ExactVerifier):
        pass

    assert batch_choices(Other(True, seed=3), [warpers, warpers], logits, *args) is None


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_plain_steps_sample_the_tokens_drafting_steps_sample(family, monkeypatch):
    """On the batched static runner a batch that samples with context-free processors runs plain steps too
    (`engine.plain` with the rule's choice): with a drafter that never drafts every step is plain, and the tokens are
    those the drafting steps commit after the same seed (each position's draw is keyed, whatever step makes it)."""
    import hf_hybrid_spec.engine.plain as plain_module
    from hf_hybrid_spec.tree import empty_draft

    class Silent(Drafter):
        def propose(self, input_ids, budget):
            return empty_draft(1)

    model = tiny_model(family, vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    kw = dict(attention_mask=(ids != 1).long(), pad_token_id=1, custom_generate=H.speculative_generate, top_k=6)
    queued = []
    real = plain_module._queue
    monkeypatch.setattr(plain_module, "_queue", lambda *a, **k: queued.append(1) or real(*a, **k))
    silent = dict(assistant_config=H.AssistantConfig(compile=True))
    plain = _sample(model, ids, 9, drafter=[Silent() for _ in range(3)], **silent, **kw)
    assert len(queued) >= 20  # every token after the first came from a plain step
    drafting = _sample(model, ids, 9, assistant_config=H.AssistantConfig(compile=True), **kw)
    assert torch.equal(plain, drafting)
    eager = _sample(model, ids, 9, assistant_config=H.AssistantConfig(compile=False), **kw)
    assert torch.equal(plain, eager)
    # The calibrated budget's runs of plain steps queued ahead of their reads (drafts rarely pay on random weights):
    # the same tokens again.
    calibrated = _sample(model, ids, 9, assistant_config=H.AssistantConfig(compile=True, batch_budget="calibrated"),
                         **kw)
    assert torch.equal(calibrated, eager)
    # Greedy with a context-free processor: plain steps take the processed argmax, as plain generate does.
    gen = dict(attention_mask=kw["attention_mask"], pad_token_id=1, max_new_tokens=16, eos_token_id=None,
               suppress_tokens=[3])
    expected = model.generate(ids, **gen)
    queued.clear()
    got = model.generate(ids, custom_generate=H.speculative_generate, drafter=[Silent() for _ in range(3)], **silent,
                         **gen)
    assert len(queued) >= 10
    assert torch.equal(got, expected)


def test_positional_processors_are_applied_at_each_nodes_place():
    """`min_length` / `min_new_tokens` in `batch_choices`: at every node of every row the eos tokens are removed
    exactly where stock's processor, given that node's ids (padding included), removes them."""
    from transformers import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    from hf_hybrid_spec.verification import ExactVerifier, batch_choices

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, V, generator=gen)
    eos = [2, 5]
    logits[..., 2] += 10.0  # an eos token is every node's argmax unless it is removed
    lengths, pads = torch.tensor([6, 9, 7]), torch.tensor([3, 0, 2])
    depth = torch.tensor([[0, 1, 2, 3], [0, 1, 1, 2], [0, 1, 2, 2]])
    for processor in (MinNewTokensLengthLogitsProcessor(9, 2, eos), MinLengthLogitsProcessor(11, eos)):
        procs = LogitsProcessorList([processor, TopKLogitsWarper(4)])
        chosen = batch_choices(ExactVerifier(False), [procs] * 3, logits, lengths, depth, torch.arange(3), False,
                               pads)
        expected = torch.empty(3, 4, dtype=torch.long)
        for r in range(3):
            for j in range(4):
                ids = torch.zeros(1, int(lengths[r] + pads[r] + depth[r, j]), dtype=torch.long)
                expected[r, j] = procs(ids, logits[r, j][None].clone()).argmax()
        assert torch.equal(chosen, expected)
        assert (chosen == 2).any() and (chosen != 2).any()  # the bound falls inside these trees


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
def test_a_batch_with_min_new_tokens_chooses_at_once_and_matches_plain_generate(compile_, monkeypatch):
    """Greedy with `min_new_tokens` (and sampling with it) takes the batched choices and, on the static runner, plain
    steps: greedy is token for token plain generate with left padding; sampling the row-by-row rule's tokens."""
    import hf_hybrid_spec.engine.step as step_module
    from hf_hybrid_spec.verification import batch_choices

    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    mask = (ids != 1).long()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=1)
    eos = int(free[1, 8])  # a token the model picks early on
    kw = dict(attention_mask=mask, pad_token_id=1, max_new_tokens=12, do_sample=False, eos_token_id=eos,
              min_new_tokens=6)
    expected = model.generate(ids, **kw)
    used = []
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: used.append(1) or batch_choices(*a, **k))
    got = model.generate(ids, custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(compile=compile_), **kw)
    assert used and torch.equal(got, expected)
    sample = dict(kw, do_sample=True, top_k=6, custom_generate=H.speculative_generate,
                  assistant_config=H.AssistantConfig(compile=compile_))
    torch.manual_seed(4)
    at_once = model.generate(ids, **sample)
    monkeypatch.setattr(step_module, "choices_apply", lambda *a, **k: False)
    torch.manual_seed(4)
    row_by_row = model.generate(ids, **sample)
    assert torch.equal(at_once, row_by_row)


@pytest.mark.parametrize("ignore", [None, 2])
def test_a_repetition_penalty_is_applied_to_every_nodes_context_at_once(ignore):
    """The repetition penalty in `batch_choices` (`NodeContexts`): each node's scores penalized for the tokens of its
    row's ids (padding included, the first `prompt_ignore_length` left out) and of its path, as stock's processor
    does given that node's ids (`process_tree_logits`, node by node), on random trees with repeated tokens."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from hf_hybrid_spec.tree import DraftBatch, VerifyTree
    from hf_hybrid_spec.verification import ExactVerifier, NodeContexts, batch_choices, process_tree_logits

    gen = torch.Generator().manual_seed(1)
    rows, width = 3, 6
    drafts = []
    for _ in range(rows):
        parents = [-1] + [int(torch.randint(-1, j, (1,), generator=gen)) for j in range(width - 1)]
        drafts.append(DraftTree(tokens=torch.randint(0, V, (1, width), generator=gen), parents=torch.tensor([parents])))
    batch = DraftBatch.from_drafts(drafts)
    roots = torch.randint(0, V, (rows,), generator=gen)
    tokens = torch.cat([roots[:, None], batch.tokens], dim=1)
    parent = torch.cat([torch.full((rows, 1), -1), torch.where(batch.parents >= 0, batch.parents + 1, 0)], dim=1)
    tree = VerifyTree.from_parents(tokens, parent)
    row_ids = [torch.cat([torch.randint(0, V, (1, 4 + r), generator=gen), roots[r].view(1, 1)], dim=1)
               for r in range(rows)]
    logits = torch.randn(rows, width + 1, V, generator=gen)
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=ignore),
                                 TemperatureLogitsWarper(0.9)])
    lengths = torch.tensor([ids.shape[1] for ids in row_ids])
    depth = torch.cat([torch.zeros(rows, 1, dtype=torch.long), batch.depth], dim=1)
    args = (logits, lengths, depth, torch.arange(rows), False)
    assert batch_choices(ExactVerifier(False), [procs] * rows, *args) is None  # no contexts: declined
    chosen = batch_choices(ExactVerifier(False), [procs] * rows, *args, None, NodeContexts(row_ids, tree))
    for r in range(rows):
        one = VerifyTree.from_parents(tokens[r : r + 1], parent[r : r + 1])
        expected = process_tree_logits(row_ids[r], one, logits[r : r + 1], procs).argmax(-1)
        assert torch.equal(chosen[r], expected)
    # The penalty changes choices here (or the test would not see a wrong context).
    assert not torch.equal(chosen, logits.argmax(-1))


def test_a_batch_with_a_repetition_penalty_chooses_at_once_and_matches_plain_generate(monkeypatch):
    """Greedy with `repetition_penalty` over a left-padded batch: every row's nodes chosen at once, token for token
    plain generate; sampling with it, the row-by-row rule's tokens after the same seed."""
    import hf_hybrid_spec.engine.step as step_module
    from hf_hybrid_spec.verification import batch_choices

    model = tiny_model("falcon_h1", vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    kw = dict(attention_mask=(ids != 1).long(), pad_token_id=1, max_new_tokens=12, do_sample=False,
              eos_token_id=None, repetition_penalty=1.3)
    expected = model.generate(ids, **kw)
    assert not torch.equal(expected, model.generate(ids, **dict(kw, repetition_penalty=1.0)))
    used = []
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: used.append(1) or batch_choices(*a, **k))
    for compile_ in (False, True):
        got = model.generate(ids, custom_generate=H.speculative_generate,
                             assistant_config=H.AssistantConfig(compile=compile_), **kw)
        assert torch.equal(got, expected)
    assert used
    sample = dict(kw, do_sample=True, top_k=6, custom_generate=H.speculative_generate)
    torch.manual_seed(2)
    at_once = model.generate(ids, **sample)
    monkeypatch.setattr(step_module, "choices_apply", lambda *a, **k: False)
    torch.manual_seed(2)
    assert torch.equal(at_once, model.generate(ids, **sample))


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_plain_steps_apply_a_repetition_penalty_to_what_the_rows_hold(family, monkeypatch):
    """Plain steps with a repetition penalty (`verification.RootContexts`: the recorded ids and the root in flight,
    queued before the step before is read): greedy is token for token plain generate over a left-padded batch, with
    a prompt_ignore_length too; sampling gives the drafting steps' and the eager path's tokens after the same seed."""
    import hf_hybrid_spec.engine.plain as plain_module
    from hf_hybrid_spec.tree import empty_draft

    class Silent(Drafter):
        def propose(self, input_ids, budget):
            return empty_draft(1)

    model = tiny_model(family, vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    queued = []
    real = plain_module._queue
    monkeypatch.setattr(plain_module, "_queue", lambda *a, **k: queued.append(1) or real(*a, **k))
    silent = dict(drafter=[Silent() for _ in range(3)], assistant_config=H.AssistantConfig(compile=True))
    gen = dict(attention_mask=(ids != 1).long(), pad_token_id=1, max_new_tokens=14, eos_token_id=None,
               repetition_penalty=1.4)
    expected = model.generate(ids, **gen)
    assert not torch.equal(expected, model.generate(ids, **dict(gen, repetition_penalty=1.0)))
    got = model.generate(ids, custom_generate=H.speculative_generate, **silent, **gen)
    assert len(queued) >= 13 and torch.equal(got, expected)
    from transformers import RepetitionPenaltyLogitsProcessor

    ignoring = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.4, prompt_ignore_length=4)])
    plain_gen = dict(gen, repetition_penalty=None)
    expected = model.generate(ids, logits_processor=ignoring, **plain_gen)
    got = model.generate(ids, custom_generate=H.speculative_generate, logits_processor=ignoring,
                         **dict(silent, drafter=[Silent() for _ in range(3)]), **plain_gen)
    assert torch.equal(got, expected)
    kw = dict(gen, do_sample=True, top_k=6, custom_generate=H.speculative_generate)
    torch.manual_seed(7)
    plain = model.generate(ids, **dict(silent, drafter=[Silent() for _ in range(3)]), **kw)
    torch.manual_seed(7)
    eager = model.generate(ids, assistant_config=H.AssistantConfig(compile=False), **kw)
    assert torch.equal(plain, eager)


@pytest.mark.parametrize("extra", [dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=3),
                                   dict(bad_words_ids=[[6, 6]]), dict(sequence_bias={(6, 6): -4.0})])
def test_plain_steps_give_processors_each_rows_ids_once(extra, monkeypatch):
    """Plain steps with processors that read the order of the ids (n-grams, multi-token bad words and biases): the
    root is in each row's context once, whether it is recorded already (a run's first step) or is the token of the
    step in flight, so greedy is token for token plain generate over a left-padded batch. (A root counted twice
    breaks n-grams and nothing that reads only which tokens occur, like the repetition penalty.)"""
    import hf_hybrid_spec.engine.plain as plain_module
    from hf_hybrid_spec.tree import empty_draft

    class Silent(Drafter):
        def propose(self, input_ids, budget):
            return empty_draft(1)

    model = tiny_model("qwen3_5_text", vocab_size=12)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    queued = []
    real = plain_module._queue
    monkeypatch.setattr(plain_module, "_queue", lambda *a, **k: queued.append(1) or real(*a, **k))
    gen = dict(attention_mask=(ids != 1).long(), pad_token_id=1, max_new_tokens=14, eos_token_id=None)
    expected = model.generate(ids, **gen, **extra)
    assert not torch.equal(expected, model.generate(ids, **gen))
    got = model.generate(ids, custom_generate=H.speculative_generate, drafter=[Silent() for _ in range(3)],
                         assistant_config=H.AssistantConfig(compile=True), **gen, **extra)
    assert len(queued) >= 13 and torch.equal(got, expected)


def test_bad_words_and_biases_of_one_and_more_tokens_choose_at_once(monkeypatch):
    """`bad_words_ids` / `sequence_bias` whose sequences are single tokens are context-free (`TOKEN_BIAS`), longer
    ones read the nodes' contexts (`ALIGNED`): a padded batch chooses every node at once and matches plain
    generate."""
    import hf_hybrid_spec.engine.step as step_module
    from hf_hybrid_spec.verification import batch_choices

    model = tiny_model("falcon_h1", vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    mask = (ids != 1).long()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=1)
    common = int(free[:, 7:].flatten().mode().values)  # a token the rows pick often
    chosen = []
    monkeypatch.setattr(step_module, "batch_choices",
                        lambda *a, **k: chosen.append(batch_choices(*a, **k)) or chosen[-1])
    for extra in (dict(bad_words_ids=[[common]]), dict(sequence_bias={(common,): -3.0}),
                  dict(bad_words_ids=[[common, int(free[0, 8])]])):
        kw = dict(attention_mask=mask, pad_token_id=1, max_new_tokens=12, do_sample=False, eos_token_id=None, **extra)
        expected = model.generate(ids, **kw)
        assert not torch.equal(expected, free)
        chosen.clear()
        for compile_ in (False, True):
            got = model.generate(ids, custom_generate=H.speculative_generate,
                                 assistant_config=H.AssistantConfig(compile=compile_), **kw)
            assert torch.equal(got, expected), extra
        assert chosen and all(c is not None for c in chosen), extra
