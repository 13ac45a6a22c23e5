"""Batched speculative decoding (B > 1 left-padded rows): greedy identity with stock batched `generate` for every
family, the per-row drafters, random trees, early-finishing rows and rows that never match; batch sampling's
distribution; the batch-wide budget; bad input."""

import pytest
import torch
from helpers import RandomTreeDrafter, drafter_kwargs, load_fixture
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)
from verification.test_sampling import RandomSampledDrafter, V, chi2_pvalue, target_joint

import hf_hybrid_spec as H
from hf_hybrid_spec.engine.budget import VerifyCost, choose_nodes, choose_width, node_values
from hf_hybrid_spec.testing import TINY_FAMILIES, tiny_model
from hf_hybrid_spec.tree import DraftTree, empty_draft

PAD = 1


def padded_batch(lengths, seed=0, vocab=96, period=4):
    """Left-padded prompts of the given lengths (each repeats a short random pattern, so cache drafters match)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        pattern = torch.randint(3, vocab, (period,), generator=g)
        ids[b, width - n :] = pattern.repeat(n // period + 1)[:n]
        mask[b, width - n :] = 1
    return ids, mask


def greedy(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kw)


def row_references(ref, mask):
    """Each row's stock output without its left padding ([1, L_b]): what a per-row test drafter follows."""
    pads = (mask == 0).sum(-1).tolist()
    return [ref[b : b + 1, pads[b] :] for b in range(ref.shape[0])]


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_batch_greedy_matches_stock_for_every_family(family, compile_):
    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5])
    kw = dict(max_new_tokens=14, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate,
                 assistant_config=H.AssistantConfig(global_cache=False, compile=compile_), **kw)
    assert torch.equal(out, ref)
    # Random trees over each row's reference: accepted and rejected nodes of every depth, rows of different widths.
    drafters = [RandomTreeDrafter(96, reference=r, seed=b) for b, r in enumerate(row_references(ref, mask))]
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=drafters,
                 assistant_config=H.AssistantConfig(compile=compile_), return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    stats = out.spec_stats
    assert len(stats.rows) == 3 and stats.target_forwards < 14
    assert sum(len(r.accepted_lengths) for r in stats.rows) == len(stats.accepted_lengths)


class _ShiftFromLast(LogitsProcessor):
    """A processor speculation does not know: lowers the score of the token after the ids' last one."""

    def __call__(self, input_ids, scores):
        return scores.scatter_add(1, (input_ids[:, -1:] + 1) % scores.shape[1], torch.full_like(scores[:, :1], -3.0))


def processor_mix(model, ids, mask) -> dict:
    """Generate kwargs with every kind of processor, built from what the rows generate without them (so each one
    changes something): the model's eos held back by min_new_tokens, a repetition penalty, n-gram blocking, a
    two-token bad word, a sequence bias, a suppressed token and a processor of the caller's own."""
    plain = greedy(model, ids, mask, max_new_tokens=14, eos_token_id=None)[:, ids.shape[1] :].tolist()
    return dict(max_new_tokens=14, eos_token_id=plain[0][3], min_new_tokens=6, repetition_penalty=1.2,
                no_repeat_ngram_size=3, bad_words_ids=[plain[1][1:3]], sequence_bias={tuple(plain[2][2:4]): -2.0},
                suppress_tokens=[plain[0][0]], logits_processor=LogitsProcessorList([_ShiftFromLast()]))


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_batch_greedy_with_every_kind_of_processor_matches_stock_for_every_family(family):
    """Every row's nodes chosen at once with all of `processor_mix`'s processors, on the eager and the static path,
    with the suffix drafter and random trees that follow each row's reference: token for token stock."""
    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5], seed=2)
    kw = processor_mix(model, ids, mask)
    ref = greedy(model, ids, mask, **kw)
    assert not torch.equal(ref, greedy(model, ids, mask, max_new_tokens=14, eos_token_id=kw["eos_token_id"]))
    for compile_ in (False, True):
        out = greedy(model, ids, mask, custom_generate=H.speculative_generate,
                     assistant_config=H.AssistantConfig(global_cache=False, compile=compile_), **kw)
        assert torch.equal(out, ref), compile_
        drafters = [RandomTreeDrafter(96, reference=r, seed=b) for b, r in enumerate(row_references(ref, mask))]
        out = greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=drafters,
                     assistant_config=H.AssistantConfig(compile=compile_), **kw)
        assert torch.equal(out, ref), compile_


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_processors_that_read_the_length_choose_at_once_and_match_stock(family, monkeypatch):
    """Forced bos / eos, `begin_suppress_tokens` and the exponential decay length penalty (processors that read the
    ids' length alone) over a padded batch and one request, eager and static: every step's nodes chosen in one pass
    (`batch_choices`, no row-by-row fallback), token for token stock."""
    import hf_hybrid_spec.engine.step as step_module

    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5], seed=4)
    plain = greedy(model, ids, mask, max_new_tokens=12, eos_token_id=None)[:, ids.shape[1] :].tolist()
    eos = plain[0][4]
    kw = dict(max_new_tokens=12, eos_token_id=eos, forced_eos_token_id=eos, max_length=ids.shape[1] + 9,
              begin_suppress_tokens=[plain[1][0], plain[2][0]], exponential_decay_length_penalty=(2, 1.6))
    kw.pop("max_new_tokens")
    ref = greedy(model, ids, mask, **kw)
    assert ref[:, ids.shape[1] :].tolist() != [row[: ref.shape[1] - ids.shape[1]] for row in plain]
    chosen = []
    real = step_module.batch_choices
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: chosen.append(real(*a, **k)) or chosen[-1])
    for compile_ in (False, True):
        out = greedy(model, ids, mask, custom_generate=H.speculative_generate,
                     assistant_config=H.AssistantConfig(global_cache=False, compile=compile_), **kw)
        assert torch.equal(out, ref), compile_
        one = greedy(model, ids[:1, 3:], mask[:1, 3:], custom_generate=H.speculative_generate,
                     assistant_config=H.AssistantConfig(global_cache=False, compile=compile_),
                     **dict(kw, max_length=ids.shape[1] + 6))
        assert torch.equal(one, greedy(model, ids[:1, 3:], mask[:1, 3:], **dict(kw, max_length=ids.shape[1] + 6)))
    assert chosen and all(c is not None for c in chosen)


@pytest.mark.parametrize("name", ["ngram", "model", "eagle"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_batch_greedy_with_every_kind_of_processor_matches_stock_for_every_drafter(family, name):
    model = tiny_model(family)
    ids, mask = padded_batch([6, 11, 3, 8], seed=1)
    kw = processor_mix(model, ids, mask)
    ref = greedy(model, ids, mask, **kw)
    for compile_ in (False, True):
        out = greedy(model, ids, mask, custom_generate=H.speculative_generate,
                     **drafter_kwargs(name, model, compile=compile_), **kw)
        assert torch.equal(out, ref), compile_


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("name", ["suffix", "ngram", "model", "eagle"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_batch_greedy_matches_stock_for_every_drafter(family, name, compile_):
    model = tiny_model(family)
    ids, mask = padded_batch([6, 11, 3, 8], seed=1)
    kw = dict(max_new_tokens=12, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate,
                 **drafter_kwargs(name, model, compile=compile_), **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
def test_rows_that_finish_early_are_padded_as_stock_pads_them(compile_):
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([7, 12, 4], seed=2)
    plain = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=None)
    # An EOS that one row reaches early (its 3rd new token) and the others later or never.
    eos = int(plain[0, ids.shape[1] + 2])
    ref = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=eos)
    assert (ref == PAD).sum() > (ids == PAD).sum()  # some row was padded after its EOS
    drafters = [RandomTreeDrafter(96, reference=r, seed=b) for b, r in enumerate(row_references(plain, mask))]
    out = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=eos, custom_generate=H.speculative_generate,
                 drafter=drafters, assistant_config=H.AssistantConfig(compile=compile_))
    assert torch.equal(out, ref)


class StopAfter(StoppingCriteria):
    """Stops a row once its last token is `token` (a per-row criterion with no EOS token: stock keeps decoding
    stopped rows until every row has stopped)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_rows_stopped_without_an_eos_criterion_keep_decoding_as_in_stock():
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([5, 10], seed=3)
    plain = greedy(model, ids, mask, max_new_tokens=20, eos_token_id=None)
    token = int(plain[1, ids.shape[1] + 4])
    criteria = StoppingCriteriaList([StopAfter(token)])
    ref = greedy(model, ids, mask, max_new_tokens=20, eos_token_id=None, stopping_criteria=criteria)
    out = greedy(model, ids, mask, max_new_tokens=20, eos_token_id=None, stopping_criteria=criteria,
                 custom_generate=H.speculative_generate, assistant_config=H.AssistantConfig(global_cache=False))
    assert torch.equal(out, ref)


def test_rows_that_never_match_and_a_batch_budget_cap():
    model = tiny_model("qwen3_next")
    ids, mask = padded_batch([8, 8, 13], seed=4)
    kw = dict(max_new_tokens=10, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    refs = row_references(ref, mask)
    # Row 1 never follows its reference (every draft rejected); the forward's cap is below the rows' asks.
    drafters = [RandomTreeDrafter(96, reference=refs[b], seed=b, p_follow=0.0 if b == 1 else 0.9) for b in range(3)]
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=drafters,
                 assistant_config=H.AssistantConfig(max_verify_nodes=10, batch_budget="fixed"),
                 return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    assert max(out.spec_stats.drafted_tokens) <= 10
    assert out.spec_stats.rows[1].mean_accepted_length <= out.spec_stats.rows[0].mean_accepted_length


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
def test_a_calibrated_budget_stays_exact(compile_):
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([6, 9], seed=5)
    kw = dict(max_new_tokens=10, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    drafters = [RandomTreeDrafter(96, reference=r, seed=b) for b, r in enumerate(row_references(ref, mask))]
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=drafters,
                 assistant_config=H.AssistantConfig(batch_budget="calibrated", compile=compile_), **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
def test_logits_processors_see_each_rows_ids_as_in_stock(compile_):
    """Repetition penalty and n-gram blocking read each row's ids, left padding included, as stock generate's do."""
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([7, 12, 4], seed=8)
    kw = dict(max_new_tokens=14, eos_token_id=None, repetition_penalty=1.4, no_repeat_ngram_size=3)
    ref = greedy(model, ids, mask, **kw)
    drafters = [RandomTreeDrafter(96, reference=r, seed=b) for b, r in enumerate(row_references(ref, mask))]
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=drafters,
                 assistant_config=H.AssistantConfig(compile=compile_), **kw)
    assert torch.equal(out, ref)


def test_stop_strings_and_the_stock_kwargs_after_enable():
    """Stop strings (a device-side criterion, checked per row), and after `enable` the stock speculation kwargs
    (prompt lookup, an assistant model) on a batch."""
    from helpers import char_tokenizer

    model = tiny_model("qwen3_5_text")
    tok = char_tokenizer()
    ids, mask = padded_batch([6, 10], seed=9)
    plain = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=None)
    stop = tok.decode(plain[0, ids.shape[1] + 3 : ids.shape[1] + 5])
    kw = dict(max_new_tokens=16, eos_token_id=0, stop_strings=[stop], tokenizer=tok)
    ref = greedy(model, ids, mask, **kw)
    H.enable(model)
    try:
        out = greedy(model, ids, mask, assistant_config=H.AssistantConfig(global_cache=False), **kw)
        assert torch.equal(out, ref)
        kw = dict(max_new_tokens=12, eos_token_id=None)
        ref = greedy(model, ids, mask, **kw)
        assert torch.equal(greedy(model, ids, mask, prompt_lookup_num_tokens=4, **kw), ref)
        assert torch.equal(greedy(model, ids, mask, assistant_model=tiny_model("qwen3_5_text", seed=1), **kw), ref)
    finally:
        del model.generate  # back to the class's generate


@pytest.mark.fixture
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_batch_greedy_on_the_fixtures(name):
    model, tokenizer = load_fixture(name)
    texts = ["def add(a, b):\n    return", "class Stack:\n    def __init__(self):\n        self.items = []\n    def push",
             "import os\n\ndef list_files(path):\n"]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    kw = dict(max_new_tokens=24, do_sample=False)
    ref = model.generate(**enc, **kw)
    out = model.generate(**enc, custom_generate=H.speculative_generate, return_dict_in_generate=True,
                         assistant_config=H.AssistantConfig(global_cache=False), **kw)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.mean_accepted_length > 1.0  # the fixtures repeat themselves more than real models do


@pytest.mark.slow
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
def test_batch_sampling_matches_each_rows_target_distribution(compile_):
    """Rows of two prompts (two rows each, left-padded differently): each row's first two tokens follow the target's
    joint law for its prompt (chi-square at a fixed seed, p > 1e-3), and the harness rejects a sharper law."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    model = tiny_model("qwen3_5_text", vocab_size=V, seed=3)
    prompts = [[2, 5, 3, 7, 2, 5], [4, 6, 4]]
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(4)])
    joints = [target_joint(model, torch.tensor([p]), processors) for p in prompts]
    rows = [prompts[0], prompts[1], prompts[1], prompts[0]]
    ids = torch.full((4, 6), PAD)
    mask = torch.zeros(4, 6, dtype=torch.long)
    for b, p in enumerate(rows):
        ids[b, 6 - len(p) :] = torch.tensor(p)
        mask[b, 6 - len(p) :] = 1
    counts = [torch.zeros(V * V) for _ in prompts]
    torch.manual_seed(4321)
    for call in range(300):
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=0.6, top_k=4, top_p=1.0,
                             max_new_tokens=2, eos_token_id=None, pad_token_id=PAD,
                             custom_generate=H.speculative_generate,
                             assistant_config=H.AssistantConfig(compile=compile_),
                             drafter=[RandomSampledDrafter("tree" if b % 2 else "chain", seed=call * 4 + b)
                                      for b in range(4)])
        for b, p in enumerate(rows):
            a, c = out[b, -2:].tolist()
            counts[prompts.index(p)][a * V + c] += 1
    for count, joint in zip(counts, joints):
        assert chi2_pvalue(count, joint) > 1e-3
        sharper = torch.softmax(2.0 * torch.log(joint + 1e-12), dim=0)
        assert chi2_pvalue(count, sharper) < 1e-3


# ---------------------------------------------------------------------- the budget
def chain(values):
    n = len(values)
    return DraftTree(tokens=torch.arange(n).view(1, n), parents=(torch.arange(n) - 1).view(1, n),
                     scores=torch.tensor([values]))


def test_budget_falls_to_zero_where_verifying_costs_more_than_it_gains():
    drafts = [chain([0.9, 0.8, 0.7]), chain([0.5, 0.2])]
    values = [node_values(d) for d in drafts]
    cheap = VerifyCost(widths=[1, 64], seconds=[1.0, 1.0])  # memory-bound: drafts are free
    choice = choose_nodes(values, cheap)
    assert choice.nodes == 5 and choice.width == 4
    steep = VerifyCost(widths=[1, 2, 64], seconds=[1.0, 2.0, 64.0])  # compute-bound: each width costs a step
    choice = choose_nodes(values, steep)
    assert choice.nodes == 0 and choice.keep == [[], []] and choice.width == 1
    # In between: width 2 (one node per row) pays, wider does not.
    middle = VerifyCost(widths=[1, 2, 3, 4], seconds=[1.0, 1.05, 2.0, 3.0])
    choice = choose_nodes(values, middle)
    assert choice.keep == [[0], [0]]
    # A static runner's widths are its buckets (a plain step costs the smallest).
    buckets = VerifyCost(widths=[8, 16], seconds=[1.0, 1.9])
    assert choose_nodes(values, buckets, widths=[8, 16]).nodes == 5


def test_a_budget_that_keeps_every_node_hands_the_batch_back():
    """`apply_budget` skips the selection when the choice keeps every node (the usual serving step on a GPU, where a
    wide forward costs little more than a narrow one); when it cuts, the selection keeps the chosen nodes."""
    from hf_hybrid_spec.engine.step import apply_budget
    from hf_hybrid_spec.engine.outputs import SpecStats
    from hf_hybrid_spec.tree import DraftBatch

    batch = DraftBatch.from_drafts([chain([0.9, 0.8, 0.7]), chain([0.5, 0.2])])
    config = H.AssistantConfig()
    cheap = VerifyCost(widths=[1, 64], seconds=[1.0, 1.0])
    assert apply_budget(batch, cheap, config, SpecStats(), None) is batch
    middle = VerifyCost(widths=[1, 2, 3, 4], seconds=[1.0, 1.05, 2.0, 3.0])
    cut = apply_budget(batch, middle, config, SpecStats(), None)
    assert cut is not batch and cut.counts == [1, 1] and cut.tokens[:, 0].tolist() == [0, 0]


def test_budget_shares_nodes_by_path_probability_across_rows():
    drafts = [chain([0.95, 0.9, 0.85, 0.8]), chain([0.3, 0.1]), chain([0.9, 0.6])]
    choice = choose_nodes([node_values(d) for d in drafts], None, max_nodes=5)
    assert choice.keep == [[0, 1, 2, 3], [], [0]]
    # Under a cost model too: the forward's cap goes to the likeliest nodes across rows.
    flat = VerifyCost(widths=[1, 8], seconds=[1.0, 1.0])
    assert choose_nodes([node_values(d) for d in drafts], flat, max_nodes=5).keep == [[0, 1, 2, 3], [], [0]]
    # A node is never worth more than its parent: a likely child under an unlikely parent waits for the parent.
    tree = DraftTree(tokens=torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 0, -1]]),
                     scores=torch.tensor([[0.2, 0.9, 0.5]]))
    assert node_values(tree) == pytest.approx([0.2, 0.2, 0.5])
    assert choose_nodes([node_values(tree)], None, max_nodes=2).keep == [[0, 2]]
    # Without scores the prior decays with depth.
    plain = DraftTree(tokens=torch.tensor([[5, 6]]), parents=torch.tensor([[-1, 0]]))
    assert node_values(plain) == pytest.approx([0.6, 0.36])


def test_verify_cost_interpolates_and_checks_its_table():
    cost = VerifyCost(widths=[4, 8, 16], seconds=[1.0, 2.0, 3.0])
    assert cost(1) == 1.0 and cost(6) == pytest.approx(1.5) and cost(24) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="increase"):
        VerifyCost(widths=[4, 4], seconds=[1.0, 1.0])
    # A static runner's buckets: a width between two runs padded to the wider one and costs all of it.
    buckets = VerifyCost(widths=[4, 8, 16], seconds=[1.0, 2.0, 3.0], padded=True)
    assert buckets(1) == 1.0 and buckets(5) == 2.0 and buckets(8) == 2.0 and buckets(9) == 3.0
    assert buckets(24) == pytest.approx(4.0)


def test_pipelined_width_is_not_one_node_past_a_bucket():
    # A chain drafter's widest tree (8 nodes and the root) runs in the 16-wide bucket: one more node, expected
    # 0.43 tokens per row, for the 16-wide forward's cost. Interpolated, the 9-wide tree looked almost as cheap as
    # the 8-wide one; the bucket's real cost sends the batch to width 8.
    seconds = [8.3, 8.4, 9.3, 11.6, 16.4]
    prefix = [64 * sum(0.9**k for k in range(1, d + 1)) for d in range(9)]
    widths = [2, 4, 8, 9]
    assert choose_width(prefix, 64, VerifyCost([1, 2, 4, 8, 16], seconds), widths=widths)[0] == 9
    assert choose_width(prefix, 64, VerifyCost([1, 2, 4, 8, 16], seconds, padded=True), widths=widths)[0] == 8


# ---------------------------------------------------------------------- bad input and what a batch refuses
def test_bad_batches_get_clear_errors_and_leave_the_model_as_it_was():
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([6, 9], seed=6)
    kw = dict(max_new_tokens=6, eos_token_id=None, custom_generate=H.speculative_generate, pad_token_id=PAD)
    before = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    right = torch.flip(mask, [1])
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(torch.flip(ids, [1]), attention_mask=right, **kw)
    # Called with everything generate prepares (so it does not go through generate, which would build the mask).
    prepared = GenerationConfig(max_length=ids.shape[1] + 6, pad_token_id=PAD, num_beams=1, num_return_sequences=1,
                                do_sample=False)
    with pytest.raises(ValueError, match="no attention_mask"):
        H.speculative_generate(model, ids, LogitsProcessorList(),
                               StoppingCriteriaList([MaxLengthCriteria(prepared.max_length)]), prepared)
    with pytest.raises(ValueError, match="must match"):
        model.generate(ids, attention_mask=mask[:, 1:], **kw)
    with pytest.raises(ValueError, match="empty"):
        model.generate(ids, attention_mask=torch.cat([torch.zeros_like(mask[:1]), mask[1:]]), **kw)
    with pytest.raises(ValueError, match="one per row"):
        model.generate(ids, attention_mask=mask, drafter=[RandomTreeDrafter(96)], **kw)
    after = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    assert torch.equal(before, after)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("name", ["random-trees", "eagle"])
def test_batch_scores_and_logits_match_stock(name, compile_):
    """`output_scores` / `output_logits` at B > 1: per generated position a [B, V] tensor, as stock's; each row's
    entries up to its stop are stock's (a repetition penalty makes the scores differ from the logits), and after a
    row's EOS they hold the pad token with probability one (stock runs the model on the pad tokens there)."""
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([7, 12, 4], seed=2)
    plain = greedy(model, ids, mask, max_new_tokens=12, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 2])  # row 0 stops at its 3rd new token
    kw = dict(max_new_tokens=12, eos_token_id=eos, repetition_penalty=1.3, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    ref = greedy(model, ids, mask, **kw)
    if name == "eagle":
        extra = drafter_kwargs("eagle", model, compile=compile_)
    else:
        extra = dict(drafter=[RandomTreeDrafter(96, reference=r, seed=b)
                              for b, r in enumerate(row_references(plain, mask))],
                     assistant_config=H.AssistantConfig(compile=compile_))
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, **extra, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == ref.sequences.shape[1] - ids.shape[1]
    stop = ids.shape[1] + 3
    for t, (ours, theirs, ours_raw, theirs_raw) in enumerate(zip(out.scores, ref.scores, out.logits, ref.logits)):
        assert ours.shape == theirs.shape and ours_raw.shape == theirs_raw.shape
        live = [b for b in range(3) if ref.sequences[b, ids.shape[1] + t] != PAD or b != 0]
        torch.testing.assert_close(ours[live], theirs[live], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours_raw[live], theirs_raw[live], rtol=1e-4, atol=1e-4)
        if ids.shape[1] + t >= stop:  # row 0 stopped: the pad token, surely
            assert ours[0, PAD] == 0 and torch.isinf(ours[0]).sum() == ours.shape[1] - 1
    assert not torch.equal(out.scores[3], out.logits[3])  # the penalty processed the scores
    transitions = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    assert transitions.shape == (3, len(out.scores)) and transitions[0, 3:].eq(0).all()


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
@pytest.mark.parametrize("field", ["hidden_states", "attentions"])
def test_batch_hidden_states_and_attentions_match_stock(field, family):
    """`output_hidden_states` / `output_attentions` at B > 1 (the eager backend; weights need eager attention): the
    prompt's first ([B, P, D] per layer; [B, heads, P, P] per attention layer), then per generated position t each
    row's those of the input that chose its token ([B, 1, D]; [B, heads, 1, P + t]: its row over every key before it,
    its padding columns 0, no other branch's or row's keys), as stock's; zeros after a row's EOS. compile=True
    refuses both, as at B = 1."""
    model = tiny_model(family)
    if field == "attentions":
        model.set_attn_implementation("eager")  # attention weights are only returned by eager attention
    ids, mask = padded_batch([7, 12, 4], seed=2)
    plain = greedy(model, ids, mask, max_new_tokens=10, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 2])  # row 0 stops at its 3rd new token
    kw = dict(max_new_tokens=10, eos_token_id=eos, return_dict_in_generate=True, output_scores=True,
              **{f"output_{field}": True})
    ref = greedy(model, ids, mask, **kw)
    drafters = [RandomTreeDrafter(96, reference=r, seed=b) for b, r in enumerate(row_references(plain, mask))]
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=drafters, **kw)
    assert torch.equal(out.sequences, ref.sequences) and out.spec_stats.target_forwards < 9
    assert max(out.spec_stats.accepted_lengths) >= 3  # paths of several nodes: each node's own row and columns
    ours_all, theirs_all = getattr(out, field), getattr(ref, field)
    assert len(ours_all) == len(theirs_all) == len(out.scores)
    atol = 1e-5 if field == "attentions" else 1e-4
    new = ref.sequences[:, ids.shape[1] :]
    for t, (ours, theirs) in enumerate(zip(ours_all, theirs_all)):
        assert len(ours) == len(theirs)
        stopped = [b for b in range(3) if bool((new[b, :t] == eos).any())]  # its EOS came before position t
        live = [b for b in range(3) if b not in stopped]
        for a, b in zip(ours, theirs):
            if b is None:  # a layer without attention weights
                assert a is None
                continue
            assert a.shape == b.shape
            torch.testing.assert_close(a[live], b[live], rtol=1e-4, atol=atol)
            assert not a[stopped].any()
    assert (new[0, 3:] == PAD).all()  # row 0 did stop
    assert any(a is not None and a[1].abs().sum() > 0 for a in ours_all[5])
    with pytest.raises(NotImplementedError, match="output_attentions / output_hidden_states need the eager path"):
        greedy(model, ids, mask, custom_generate=H.speculative_generate, assistant_config=H.AssistantConfig(
            compile=True), **kw)


def test_batch_sampled_scores_have_stocks_layout():
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([5, 9], seed=4)
    out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=0.7, top_k=20, max_new_tokens=6,
                         eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True,
                         custom_generate=H.speculative_generate,
                         drafter=[RandomTreeDrafter(96, seed=b) for b in range(2)])
    assert len(out.scores) == 6 and all(s.shape == (2, model.config.vocab_size) for s in out.scores)
    # top_k=20 warped the scores: 20 finite entries per row, and each committed token is one of them.
    for t, s in enumerate(out.scores):
        assert (torch.isfinite(s).sum(-1) <= 20).all()
        chosen = out.sequences[:, ids.shape[1] + t]
        assert torch.isfinite(s.gather(1, chosen[:, None])).all()


@pytest.mark.parametrize("ask,match", [
    (lambda model: dict(drafter=[H.SelfSSMDrafter(model), H.SelfSSMDrafter(model)]), "one instance per row"),
    (dict(return_dict_in_generate=True, output_attentions=True, assistant_config=H.AssistantConfig(compile=True)),
     "output_attentions / output_hidden_states need the eager path"),
    (dict(drafter=RandomTreeDrafter(96)), "one per row"),
], ids=["self_ssm-instances", "attentions", "one-drafter"])
def test_what_a_batch_does_not_support_is_named(ask, match):
    model = tiny_model("qwen3_5_text")
    ask = ask(model) if callable(ask) else ask
    ids, mask = padded_batch([6, 9], seed=7)
    with pytest.raises((NotImplementedError, ValueError), match=match):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None, pad_token_id=PAD,
                       custom_generate=H.speculative_generate, **ask)


class Intermittent(RandomTreeDrafter):
    """Drafts on some steps only (a cache drafter with no match): steps where no row drafts."""

    def __init__(self, *args, every=3, **kwargs):
        super().__init__(*args, **kwargs)
        self.every, self.calls = every, 0

    def propose(self, input_ids, budget):
        self.calls += 1
        if self.calls % self.every:
            return empty_draft(1, input_ids.device)
        return super().propose(input_ids, budget)


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_steps_where_no_row_drafts_run_as_plain_steps(family, monkeypatch):
    """On the static path a step where no row drafts is a plain step (`engine.plain.plain_step`), not a tree of
    width 1; rows that stop early and rows of different lengths, the output stock's."""
    import hf_hybrid_spec.engine.batch as B

    used = []
    original = B.plain_step
    monkeypatch.setattr(B, "plain_step", lambda *a, **k: used.append(1) or original(*a, **k))
    model = tiny_model(family)
    ids, mask = padded_batch([7, 12, 4], seed=3)
    plain = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=None)
    eos = int(plain[2, ids.shape[1] + 5])
    ref = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=eos)
    drafters = [Intermittent(96, reference=r, seed=b, every=2 + b) for b, r in enumerate(row_references(plain, mask))]
    out = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=eos, custom_generate=H.speculative_generate,
                 drafter=drafters, assistant_config=H.AssistantConfig(compile=True), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert used and out.spec_stats.plain_steps == len(used)


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1", "nemotron_h"])
def test_the_chunked_prefill_gives_what_the_eager_prefill_gives(family):
    """`prefill="chunked"`: each row's prompt as chains through the runner's forward (several chunks per row
    here), from an empty state: each row's last logits and the drafter's hidden states, laid out left-padded, are the
    eager prefill's; a second call on the kept runner (no one-token forward first) gives them too."""
    from hf_hybrid_spec.engine.batch_static import BatchStaticBackend

    model = tiny_model(family)
    layers = (1, model.config.get_text_config().num_hidden_layers)
    ids, mask = padded_batch([7, 12, 4], seed=2)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    backend = BatchStaticBackend(model, rows=3, static_length=40, buckets=(1, 2, 4), owner=None, hidden_layers=layers)
    eager = backend.prefill(ids, mask, positions)
    for _ in range(2):
        chunked = backend.prefill(ids, mask, positions, chunked=True)
        torch.testing.assert_close(chunked.logits, eager.logits[:, -1:], rtol=1e-4, atol=1e-4)
        for i in layers:
            real = mask.bool()  # the padding's columns are zeros, which nobody reads
            torch.testing.assert_close(chunked.hidden_states[i][real], eager.hidden_states[i][real], rtol=1e-4,
                                       atol=1e-4)
            assert not chunked.hidden_states[i][~real].any()
        assert backend.valid == mask.sum(-1).tolist() and backend.slots == 12


@pytest.mark.parametrize("name", ["random-trees", "eagle"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_batches_with_the_chunked_prefill_match_stock(family, name):
    model = tiny_model(family)
    ids, mask = padded_batch([7, 12, 4], seed=2)
    ref = greedy(model, ids, mask, max_new_tokens=12, eos_token_id=None)
    for _ in range(2):  # a fresh runner (its buffers made by a one-token forward), then the kept one
        if name == "eagle":
            extra = drafter_kwargs("eagle", model, compile=True, prefill="chunked", compile_buckets=(4,))
        else:
            extra = dict(drafter=[RandomTreeDrafter(96, reference=r, seed=b)
                                  for b, r in enumerate(row_references(ref, mask))],
                         assistant_config=H.AssistantConfig(compile=True, prefill="chunked",
                                                            compile_buckets=(4,)))
        out = greedy(model, ids, mask, max_new_tokens=12, eos_token_id=None, custom_generate=H.speculative_generate,
                     return_dict_in_generate=True, **extra)
        assert torch.equal(out.sequences, ref)
    with pytest.raises(ValueError, match="prefill must be one of"):
        H.AssistantConfig(prefill="lazy")


def test_auto_prefill_bounds():
    # "auto" chunks up to 512-token prompts and 16,384 tokens in the call (measured to 64 x 256 on the H200).
    from hf_hybrid_spec.engine.backend import chunked_prefill

    assert chunked_prefill("auto", 64, 256) and chunked_prefill("auto", 1, 512) and chunked_prefill("auto", 32, 512)
    assert not chunked_prefill("auto", 1, 513) and not chunked_prefill("auto", 33, 512)
    assert chunked_prefill("chunked", 128, 4096) and not chunked_prefill("eager", 1, 16)
