"""Logits processors over every node of every row at once (`verification.batch_choices`): each node's scores are
what stock's processor gives at that position (its ids: the row's, padding included, then the node's path), for the
processors we batch as tensor ops and for any other (called once per context length)."""

import dataclasses

import pytest
import torch
from transformers import (ExponentialDecayLengthPenalty, ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor,
                          LogitsProcessor, LogitsProcessorList, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                          SuppressTokensAtBeginLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper)

import hf_hybrid_spec as H
from hf_hybrid_spec.serving.penalties import OccurrencePenaltyLogitsProcessor
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DraftBatch, DraftTree, VerifyTree
from hf_hybrid_spec.verification import ExactVerifier, NodeContexts, RootContexts, batch_choices, process_tree_logits
from hf_hybrid_spec.verification.noise import keyed_choice

V = 12


class PenalizeLast(LogitsProcessor):
    """A processor speculation does not know: reads the ids' last token and the length, writes in place."""

    def __call__(self, input_ids, scores):
        scores[torch.arange(scores.shape[0]), input_ids[:, -1] % scores.shape[1]] -= 2.0 + input_ids.shape[1] % 3
        return scores


@dataclasses.dataclass
class Shift(LogitsProcessor):
    """A processor of the caller's own that compares by value, so it has no hash (a dataclass's `__eq__`)."""

    by: float = 1.5

    def __call__(self, input_ids, scores):
        return scores - self.by * (input_ids[:, -1:] % 3 == torch.arange(scores.shape[1]) % 3)


PROCESSORS = {
    "no_repeat_1": lambda: [NoRepeatNGramLogitsProcessor(1)],
    "no_repeat_2": lambda: [NoRepeatNGramLogitsProcessor(2)],
    "no_repeat_3": lambda: [NoRepeatNGramLogitsProcessor(3), TemperatureLogitsWarper(0.8)],
    "bad_words": lambda: [NoBadWordsLogitsProcessor([[1, 2], [3, 1, 2], [5]], eos_token_id=None)],
    "sequence_bias": lambda: [SequenceBiasLogitsProcessor({(1, 2): -4.0, (2, 3, 1): 3.5, (4,): -1.0})],
    "occurrence": lambda: [OccurrencePenaltyLogitsProcessor(0.7, 0.4, prompt_length=3)],
    "custom": lambda: [PenalizeLast(), TopKLogitsWarper(5)],
    "forced_eos": lambda: [ForcedEOSTokenLogitsProcessor(max_length=6, eos_token_id=4)],
    "decay": lambda: [ExponentialDecayLengthPenalty((2, 1.5), eos_token_id=4, input_ids_seq_length=2)],
    "forced_bos": lambda: [ForcedBOSTokenLogitsProcessor(bos_token_id=3), TemperatureLogitsWarper(0.9)],
    "begin_suppress": lambda: [SuppressTokensAtBeginLogitsProcessor([2, 5], begin_index=6)],
    "repetition": lambda: [RepetitionPenaltyLogitsProcessor(1.7)],
}
# Processors that read only the ids' length: chosen without the nodes' contexts too.
LENGTH_ONLY_NAMES = {"forced_eos", "decay", "forced_bos", "begin_suppress"}


def random_trees(gen, rows: int, width: int, shortest: int):
    """Random draft trees over a few tokens (repeats, so n-grams and sequences match), their verify tree [rows,
    width + 1] and each row's committed ids (lengths from `shortest` up, the root last)."""
    drafts = []
    for _ in range(rows):
        parents = [-1] + [int(torch.randint(-1, j, (1,), generator=gen)) for j in range(width - 1)]
        drafts.append(DraftTree(tokens=torch.randint(0, 6, (1, width), generator=gen), parents=torch.tensor([parents])))
    batch = DraftBatch.from_drafts(drafts)
    roots = torch.randint(0, 6, (rows,), generator=gen)
    tokens = torch.cat([roots[:, None], batch.tokens], dim=1)
    parent = torch.cat([torch.full((rows, 1), -1), torch.where(batch.parents >= 0, batch.parents + 1, 0)], dim=1)
    row_ids = [torch.cat([torch.randint(0, 6, (1, shortest - 1 + 2 * r), generator=gen), roots[r].view(1, 1)], dim=1)
               for r in range(rows)]
    depth = torch.cat([torch.zeros(rows, 1, dtype=torch.long), batch.depth], dim=1)
    return tokens, parent, row_ids, depth


@pytest.mark.parametrize("shortest", [1, 5])
@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_every_nodes_scores_are_stocks_given_that_nodes_ids(name, shortest):
    """Greedy and keyed-sampling choices at every node of three rows of different lengths (contexts shorter than the
    n-grams and sequences too) are those of the node's scores processed by stock's processors with its ids alone
    (`process_tree_logits`, node by node)."""
    gen = torch.Generator().manual_seed(hash(name) % 1000 + shortest)
    rows, width = 3, 7
    tokens, parent, row_ids, depth = random_trees(gen, rows, width, shortest)
    tree = VerifyTree.from_parents(tokens, parent)
    logits = torch.randn(rows, width + 1, V, generator=gen)
    procs = LogitsProcessorList(PROCESSORS[name]())
    lengths = torch.tensor([ids.shape[1] for ids in row_ids])
    args = (logits, lengths, depth, torch.arange(rows), False, None)
    greedy = batch_choices(ExactVerifier(False), [procs] * rows, *args, NodeContexts(row_ids, tree))
    without = batch_choices(ExactVerifier(False), [procs] * rows, *args[:-1])
    if name in LENGTH_ONLY_NAMES:  # the length is all they read: the same choices without the contexts
        assert torch.equal(without, greedy)
    else:
        assert without is None  # no contexts: declined
    sampler = ExactVerifier(True, seed=11)
    drawn = batch_choices(sampler, [procs] * rows, *args, NodeContexts(row_ids, tree))
    differs = False
    for r in range(rows):
        one = VerifyTree.from_parents(tokens[r : r + 1], parent[r : r + 1])
        scores = process_tree_logits(row_ids[r], one, logits[r : r + 1], LogitsProcessorList(PROCESSORS[name]()))
        assert torch.equal(greedy[r], scores.argmax(-1)), r
        keys = (torch.tensor([[11]]), torch.tensor([[r]]), lengths[r] + depth[r : r + 1])
        assert torch.equal(drawn[r], keyed_choice(scores, *keys).view(-1)), r
        differs |= not torch.equal(scores, logits[r].float())
    assert differs  # the processors changed something here (or the test would not see a wrong context)


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("name", ["no_repeat_2", "custom", "occurrence", "repetition"])
def test_plain_steps_roots_get_stocks_scores(name, apart):
    """`RootContexts` (a plain step: each row's recorded ids and its root, not recorded yet) gives what stock's
    processors give with the row's ids and the root appended, the rows in one buffer (a batch) or each in its own of
    its own width (a serving engine's requests)."""
    gen = torch.Generator().manual_seed(3)
    buffer = torch.randint(0, 6, (3, 16), generator=gen)
    recorded, roots = [6, 9, 7], torch.randint(0, 6, (3,), generator=gen)
    logits = torch.randn(3, 1, V, generator=gen)
    procs = LogitsProcessorList(PROCESSORS[name]())
    lengths = torch.tensor(recorded) + 1
    held = [buffer[r : r + 1, : recorded[r] + 1 + r].clone() for r in range(3)] if apart else buffer
    chosen = batch_choices(ExactVerifier(False), [procs] * 3, logits, lengths, torch.zeros(3, 1, dtype=torch.long),
                           torch.arange(3), False, None, RootContexts(held, recorded, roots))
    for r in range(3):
        ids = torch.cat([buffer[r, : recorded[r]], roots[r : r + 1]])[None]
        expected = LogitsProcessorList(PROCESSORS[name]())(ids, logits[r].clone()).argmax(-1)
        assert torch.equal(chosen[r], expected), r


@pytest.mark.parametrize("name", ["no_repeat_ngram_size", "no_repeat_ngram_size=1", "bad_words_ids", "sequence_bias",
                                  "logits_processor"])
def test_a_padded_batch_with_processors_that_read_the_ids_chooses_at_once_and_is_plain_generate(name, monkeypatch):
    """Greedy over a left-padded batch with processors that read the ids (n-grams, multi-token bad words and
    biases, a processor of the caller's own): every row's nodes chosen in one pass, token for token plain generate,
    on the eager and the static path."""
    import hf_hybrid_spec.engine.step as step_module

    model = tiny_model("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[1, 1, 2, 5, 3, 7, 2], [2, 5, 3, 7, 2, 5, 3], [1, 7, 2, 5, 3, 7, 2]])
    free = dict(attention_mask=(ids != 1).long(), pad_token_id=1, max_new_tokens=12, do_sample=False,
                eos_token_id=None)
    plain = model.generate(ids, **free)[:, 7:].tolist()
    # Sequences the rows generate without the processor, so that it changes them.
    extra = {"no_repeat_ngram_size": 2, "no_repeat_ngram_size=1": 1, "bad_words_ids": [plain[0][1:3], plain[1][2:5]],
             "sequence_bias": {tuple(plain[0][1:3]): -3.0, tuple(plain[2][3:6]): -2.5},
             "logits_processor": LogitsProcessorList([PenalizeLast()])}[name]
    kw = dict(free, **{name.split("=")[0]: extra})
    expected = model.generate(ids, **kw)
    assert expected[:, 7:].tolist() != plain  # the processor matters here
    chosen = []
    real = step_module.batch_choices
    monkeypatch.setattr(step_module, "batch_choices", lambda *a, **k: chosen.append(real(*a, **k)) or chosen[-1])
    for compile_ in (False, True):
        got = model.generate(ids, custom_generate=H.speculative_generate,
                             assistant_config=H.AssistantConfig(compile=compile_), **kw)
        assert torch.equal(got, expected), compile_
    assert chosen and all(c is not None for c in chosen)


def test_a_device_choice_is_told_apart_by_its_settings():
    """A captured accept pass holds its rule's settings as constants: calls whose rules or processors differ get
    different keys (so a pass captured for one is never replayed for the other), equal ones the same key; processors
    that read the ids other than one repetition penalty have no device choice."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, TopPLogitsWarper

    from hf_hybrid_spec.verification import device_choice

    def key(verifier, *procs):
        choice = device_choice(verifier, LogitsProcessorList(procs))
        return None if choice is None else choice.key

    sampler = ExactVerifier(True, seed=1)
    base = key(sampler, TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.95))
    assert base == key(ExactVerifier(True, seed=2), TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.95))
    assert base != key(sampler, TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.95))
    assert base != key(sampler, TopPLogitsWarper(0.95), TemperatureLogitsWarper(0.7))
    assert base != key(ExactVerifier(False), TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.95))
    eos = torch.tensor([4])
    assert key(ExactVerifier(False), MinNewTokensLengthLogitsProcessor(5, 3, eos)) != key(
        ExactVerifier(False), MinNewTokensLengthLogitsProcessor(5, 4, eos))
    # The repetition penalty by its penalty (the prompt ids it leaves out are loaded outside the pass); two of them,
    # or a processor of the caller's own, have none.
    def padded(penalty, pads):  # (set after construction: not every 5.x constructor takes it)
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        processor.prompt_ignore_length = torch.tensor(pads)
        return processor

    penalty = key(sampler, padded(1.1, [0, 3]))
    assert penalty == key(sampler, padded(1.1, [2, 0]))
    assert penalty is not None and penalty != key(sampler, RepetitionPenaltyLogitsProcessor(1.2))
    assert key(sampler, RepetitionPenaltyLogitsProcessor(1.1), RepetitionPenaltyLogitsProcessor(1.2)) is None
    assert key(sampler, PenalizeLast()) is None


def test_rows_with_their_own_processors_of_equal_settings_are_processed_together(monkeypatch):
    """A serving engine's requests each hold their own processor objects: rows whose processors at a stage have the
    same settings are processed in one call (a minimum-new-tokens bound still each row's own), and every row's
    choices are those of its own processors alone, greedy and sampling, beside rows with other settings, other
    orders, an unknown processor and none."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, TopPLogitsWarper

    eos = torch.tensor([4])

    def usual(prompt):  # a chat client's sampling settings, a request's own objects
        return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), MinNewTokensLengthLogitsProcessor(
            prompt, 6, eos), TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9)])

    rows, width = 8, 6
    lists = [usual(2), usual(5), usual(9), usual(4), usual(3),
             LogitsProcessorList([TopKLogitsWarper(5), TemperatureLogitsWarper(0.5)]),  # another order, other values
             LogitsProcessorList([PenalizeLast(), Shift(), NoRepeatNGramLogitsProcessor(2)]), None]
    calls = {}

    def counted(cls):
        real = cls.__call__

        def call(self, input_ids, scores):
            calls[cls.__name__] = calls.get(cls.__name__, 0) + 1
            return real(self, input_ids, scores)
        return call

    for cls in (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper):
        monkeypatch.setattr(cls, "__call__", counted(cls))
    gen = torch.Generator().manual_seed(5)
    tokens, parent, row_ids, depth = random_trees(gen, rows, width, 3)
    tree = VerifyTree.from_parents(tokens, parent)
    logits = torch.randn(rows, width + 1, V, generator=gen) * 3
    logits[..., 4] += 6.0  # the eos often the likeliest: where each row's minimum-new-tokens bound falls matters
    lengths = torch.tensor([ids.shape[1] for ids in row_ids])
    rules = [ExactVerifier(True, seed=7 + r) if r % 2 else ExactVerifier(False) for r in range(rows)]
    args = (logits, lengths, depth, torch.arange(rows), False, None, NodeContexts(row_ids, tree))
    together = batch_choices(rules, lists, *args)
    counts, calls = dict(calls), {}
    # The five requests of the usual settings: each temperature, top-k and top-p setting applied once for them all.
    assert counts == {"TemperatureLogitsWarper": 2, "TopKLogitsWarper": 2, "TopPLogitsWarper": 1}
    for r in range(rows):
        alone = batch_choices([rules[r]], [lists[r]], logits[r : r + 1], lengths[r : r + 1], depth[r : r + 1],
                              torch.tensor([r]), False, None, NodeContexts([row_ids[r]], tree, [r]))
        assert torch.equal(together[r], alone[0]), r
        one = VerifyTree.from_parents(tokens[r : r + 1], parent[r : r + 1])
        scores = process_tree_logits(row_ids[r], one, logits[r : r + 1], lists[r])
        if rules[r].do_sample:
            keys = (torch.tensor([[7 + r]]), torch.tensor([[r]]), lengths[r] + depth[r : r + 1])
            assert torch.equal(together[r], keyed_choice(scores, *keys).view(-1)), r
        else:
            assert torch.equal(together[r], scores.argmax(-1)), r


def test_the_servers_penalties_of_several_requests_are_applied_together(monkeypatch):
    """Requests with the same presence / frequency penalties and prompts of their own lengths: one call for their
    nodes (`group_key` / `call_group`), each node's scores those of its own request's processor alone."""
    rows, width = 5, 6
    prompts = [2, 5, 3, 4, 2]
    lists = [LogitsProcessorList([OccurrencePenaltyLogitsProcessor(0.7, 0.4, prompt_length=p)]) for p in prompts]
    lists[4] = LogitsProcessorList([OccurrencePenaltyLogitsProcessor(1.5, 0.0, prompt_length=prompts[4])])
    calls = []
    real = OccurrencePenaltyLogitsProcessor.call_aligned
    monkeypatch.setattr(OccurrencePenaltyLogitsProcessor, "call_aligned",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    gen = torch.Generator().manual_seed(8)
    tokens, parent, row_ids, depth = random_trees(gen, rows, width, 4)
    tree = VerifyTree.from_parents(tokens, parent)
    logits = torch.randn(rows, width + 1, V, generator=gen)
    lengths = torch.tensor([ids.shape[1] for ids in row_ids])
    chosen, kept = batch_choices(ExactVerifier(False), lists, logits, lengths, depth, torch.arange(rows), False, None,
                                 NodeContexts(row_ids, tree), keep=True)
    assert len(calls) == 2  # the four requests of one setting, then the fifth
    for r in range(rows):
        one = VerifyTree.from_parents(tokens[r : r + 1], parent[r : r + 1])
        scores = process_tree_logits(row_ids[r], one, logits[r : r + 1], lists[r])
        assert torch.allclose(kept[r], scores) and torch.equal(chosen[r], scores.argmax(-1)), r
