"""The general batch step's measured payoff (`budget.DraftingPayoff`, `budget.PlainRuns`): per-row drafters whose
drafts do not pay for their steps sit out runs of plain steps between probes, catch up on the tokens those committed,
and the output stays stock's; drafters that cannot catch up are never left out."""

import pytest
import torch
from engine.test_batch import greedy, padded_batch, row_references

import hf_hybrid_spec as H
from hf_hybrid_spec.drafters import DraftBudget, NgramDrafter, SuffixDrafter
from hf_hybrid_spec.drafters.base import Drafter
from hf_hybrid_spec.engine.budget import DraftingPayoff, PlainRuns, VerifyCost
from hf_hybrid_spec.engine.pipeline import LONGEST_PLAIN_RUN, PATIENCE, PLAIN_RUN
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DraftTree, VerifyResult, empty_draft

VOCAB = 96
# A memory-bound batch: a verify forward of any width costs about a plain step, so only the drafts decide.
FLAT = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.0, 1.01, 1.02, 1.04])


def drafting_steps_when_nothing_holds(forwards: int, first_run: int) -> int:
    """The drafting steps among a batch's `forwards` steps when no draft ever holds: `PATIENCE` of them, then plain
    runs of `first_run`, twice that, ... steps (at most `LONGEST_PLAIN_RUN`), with one probe between runs."""
    left, drafting, length = forwards - PATIENCE, PATIENCE, first_run
    while left > 0:
        left -= min(length, left)
        length = min(2 * length, max(LONGEST_PLAIN_RUN, length))
        if left > 0:
            left, drafting = left - 1, drafting + 1
    return drafting


def test_plain_runs_wait_for_patience_then_double_until_a_step_pays():
    runs = PlainRuns(first=8, longest=32, patience=3)
    assert [runs.verdict(False) for _ in range(3)] == [0, 0, 8]
    assert [runs.verdict(False) for _ in range(4)] == [16, 32, 32, 32]  # each probe that does not pay: at once
    assert runs.verdict(True) == 0
    assert [runs.verdict(False) for _ in range(3)] == [0, 0, 8]  # patience and the first length again
    assert PlainRuns(first=200, longest=128, patience=1).verdict(False) == 200
    with pytest.raises(ValueError, match="patience"):
        PlainRuns(first=8, longest=32, patience=0)


def test_drafting_payoff_counts_what_steps_commit_and_cost():
    # One token per row at width 8 costs more than a plain step: no pay; three do.
    payoff = DraftingPayoff(FLAT, slack=0.05)
    assert payoff.pays()  # nothing observed yet
    payoff.observe(tokens=4, rows=4, width=8, seconds=1e-3)
    assert not payoff.pays()
    payoff.restart()
    payoff.observe(tokens=12, rows=4, width=8, seconds=1e-3)
    assert payoff.pays()
    # The same tokens with host work of three plain steps per step beyond the forward: no pay.
    cost = VerifyCost(widths=[1, 8], seconds=[1e-3, 1e-3])
    slow = DraftingPayoff(cost, slack=0.05, weight=1.0)
    for _ in range(5):
        slow.observe(tokens=12, rows=4, width=8, seconds=4e-3)
    assert not slow.pays()
    fast = DraftingPayoff(cost, slack=0.05, weight=1.0)
    fast.observe(tokens=12, rows=4, width=8, seconds=1.5e-3)
    assert fast.pays()
    # One slow step (the host preempted) among fast ones: the median of what steps cost beyond the forward holds.
    for _ in range(3):
        fast.observe(tokens=12, rows=4, width=8, seconds=1.5e-3)
    fast.observe(tokens=12, rows=4, width=8, seconds=50e-3)
    assert fast.pays()


def test_drafting_payoff_counts_the_rows_furthest_from_done():
    """A static batch ends with its slowest row: three rows that repeat themselves and run ahead (5 tokens per step)
    do not make drafting pay while the row with the most left commits 1; once every row has as much left, all count."""
    cost = VerifyCost(widths=[1, 8], seconds=[1e-3, 1.2e-3])
    behind = DraftingPayoff(cost, slack=0.05, weight=1.0)
    behind.observe_rows(committed=[5, 5, 5, 1], remaining=[40, 60, 52, 90], width=8, seconds=1.2e-3)
    assert not behind.pays()  # (the average, 4 tokens per row, would have paid)
    even = DraftingPayoff(cost, slack=0.05, weight=1.0)
    even.observe_rows(committed=[5, 5, 5, 1], remaining=[90, 90, 90, 90], width=8, seconds=1.2e-3)
    assert even.pays()
    tied = DraftingPayoff(cost, slack=0.05, weight=1.0)  # two rows furthest behind: their mean, 1.5 per step
    tied.observe_rows(committed=[5, 2, 1], remaining=[10, 70, 70], width=8, seconds=1.2e-3)
    assert tied.pays() and tied.rate == pytest.approx(1.5 / 1.2e-3)


class Follower(Drafter):
    """A per-row drafter that catches up: a chain of `depth` tokens of the row's stock output from the committed
    length it reads off `input_ids`, every token wrong until the row has committed `start` tokens past its prompt.
    Counts its proposals and the lengths it reached by `catch_up`, whose tokens must be the row's next ones."""

    catches_up = True

    def __init__(self, reference, start, depth=4):
        self.reference, self.start, self.depth = reference[0].tolist(), start, depth
        self.prompt = self.seen = 0
        self.proposals, self.caught_up = 0, []

    def begin(self, input_ids, context=None, hidden=None):
        self.prompt = self.seen = input_ids.shape[1]

    def accept(self, input_ids, result, hidden=None):
        self.seen = input_ids.shape[1]

    def catch_up(self, tokens):
        assert tokens == self.reference[self.seen : self.seen + len(tokens)], "caught up on the wrong tokens"
        self.seen += len(tokens)
        self.caught_up.append(self.seen)

    def propose(self, input_ids, budget):
        self.proposals += 1
        length = input_ids.shape[1]
        n = min(self.depth, budget.max_nodes, budget.max_depth, len(self.reference) - length)
        if n <= 0:
            return empty_draft(1)
        tokens = self.reference[length : length + n]
        if length < self.prompt + self.start:
            tokens = [(t + 1) % VOCAB for t in tokens]
        return DraftTree.from_lists(tokens, list(range(-1, n - 1)))


def run(model, ids, mask, drafters, **kw):
    return greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=drafters,
                  assistant_config=H.AssistantConfig(compile=True), return_dict_in_generate=True, **kw)


def test_drafts_that_never_hold_sit_out_runs_that_double(monkeypatch):
    """Drafts that never hold: `PATIENCE` drafting steps, then plain runs of `PLAIN_RUN`, twice that, ... steps, one
    probe between runs; the drafters are asked only on those steps, and the output is stock's."""
    import hf_hybrid_spec.engine.batch as B

    monkeypatch.setattr(B, "_cost_model", lambda *args: FLAT)
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([8, 11, 6], seed=10)
    kw = dict(max_new_tokens=80, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    drafters = [Follower(r, start=10**6) for r in row_references(ref, mask)]
    out = run(model, ids, mask, drafters, **kw)
    assert torch.equal(out.sequences, ref)
    drafting = drafting_steps_when_nothing_holds(kw["max_new_tokens"] - 1, PLAIN_RUN)
    stats = out.spec_stats
    assert stats.target_forwards == kw["max_new_tokens"] - 1
    assert stats.target_forwards - stats.plain_steps == drafting and drafting >= PATIENCE + 2
    assert all(d.proposals == drafting for d in drafters)
    assert max(stats.accepted_lengths) == 1


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_drafts_that_hold_later_resume_after_a_plain_run(family, monkeypatch):
    """Drafts that hold only after a row's first tokens: a plain run, the drafters' catch-up at the rows' lengths,
    then drafting that accepts; one row stops on EOS inside the run and is padded as stock pads it."""
    import hf_hybrid_spec.engine.batch as B

    monkeypatch.setattr(B, "_cost_model", lambda *args: FLAT)
    model = tiny_model(family)
    # Prompts where row 1 writes a token first inside the first plain run (new tokens 5-12) that the other rows do
    # not write before their 24th: that token is the EOS (the tiny models repeat themselves, hence the search).
    for seed in range(14, 64):
        ids, mask = padded_batch([9, 13, 7], seed=seed)
        plain = greedy(model, ids, mask, max_new_tokens=40, eos_token_id=None)
        new = plain[:, ids.shape[1] :].tolist()
        found = [t for i, t in enumerate(new[1]) if 5 <= i < 12 and t not in new[1][:i] + new[0][:24] + new[2][:24]]
        if found:
            break
    eos = found[:1]
    ref = greedy(model, ids, mask, max_new_tokens=40, eos_token_id=eos)
    drafters = [Follower(r, start=8) for r in row_references(plain, mask)]
    out = run(model, ids, mask, drafters, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out.sequences, ref)
    stats = out.spec_stats
    assert stats.plain_steps == PLAIN_RUN  # one run: the probe after it holds
    assert max(stats.accepted_lengths) == 5  # a whole chain and the bonus token
    pads = (mask == 0).sum(-1).tolist()
    # Each drafter caught up after every plain step its row committed in (its length after the prompt, the first
    # token, PATIENCE drafting steps and the step); row 1 stopped inside the run.
    start = [ids.shape[1] - pads[b] + 1 + PATIENCE for b in range(3)]
    for b in (0, 2):
        assert drafters[b].caught_up == list(range(start[b] + 1, start[b] + PLAIN_RUN + 1))
    assert 0 < len(drafters[1].caught_up) < PLAIN_RUN
    assert drafters[1].caught_up == list(range(start[1] + 1, start[1] + len(drafters[1].caught_up) + 1))


@pytest.mark.parametrize("name", ["suffix", "ngram"])
def test_cache_drafters_that_rarely_hold_stay_exact_with_plain_runs(name, monkeypatch):
    """The real cache drafters on rows whose text seldom repeats: the batch sits out plain runs, the tries and indexes
    catch up on their tokens, and every row is stock's. (No process-wide suffix cache: what earlier tests taught it
    would decide whether drafts hold.)"""
    import hf_hybrid_spec.engine.batch as B

    monkeypatch.setattr(B, "_cost_model", lambda *args: FLAT)
    runs = []
    original = B._plain_run
    monkeypatch.setattr(B, "_plain_run", lambda *a: runs.append(a[-1]) or original(*a))
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([12, 16, 9, 14], seed=7, period=5)
    kw = dict(max_new_tokens=48, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, return_dict_in_generate=True,
                 assistant_config=H.AssistantConfig(drafter=name, compile=True, global_cache=False), **kw)
    assert torch.equal(out.sequences, ref)
    assert runs and max(out.spec_stats.accepted_lengths) > 1  # plain runs, and drafts that held between them


def test_catch_up_is_the_same_as_accepting_step_by_step():
    tokens = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6]])
    for make in (lambda: SuffixDrafter(use_global=False), lambda: NgramDrafter(ngram_size=2, num_tokens=4)):
        stepped, caught = make(), make()
        stepped.begin(tokens[:, :4])
        caught.begin(tokens[:, :4])
        for n in range(5, tokens.shape[1] + 1):
            stepped.accept(tokens[:, :n], VerifyResult(path=[0], tokens=tokens[0, n - 1 : n], score_nodes=[0],
                                                       token_list=[int(tokens[0, n - 1])]))
        caught.catch_up(tokens[0, 4:].tolist())
        budget = DraftBudget(max_nodes=8, max_depth=4)
        a, b = stepped.propose(tokens, budget), caught.propose(tokens, budget)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert a.num_nodes > 0


def test_drafters_that_cannot_catch_up_are_never_left_out(monkeypatch):
    """A per-row drafter that does not say it catches up drafts on every step, however little its drafts hold."""
    import hf_hybrid_spec.engine.batch as B

    monkeypatch.setattr(B, "_cost_model", lambda *args: FLAT)
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([8, 11], seed=3)
    kw = dict(max_new_tokens=24, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)

    class Stubborn(Follower):
        catches_up = False

    drafters = [Stubborn(r, start=10**6) for r in row_references(ref, mask)]
    out = run(model, ids, mask, drafters, **kw)
    assert torch.equal(out.sequences, ref)
    # Asked on every step but the last (where no row has room for a draft), which is the only plain one.
    stats = out.spec_stats
    assert stats.plain_steps == 1 and all(d.proposals == stats.target_forwards - 1 for d in drafters), (
        stats.plain_steps, stats.target_forwards, [d.proposals for d in drafters])


def test_deferred_suffix_bookkeeping_drafts_what_feeding_at_once_drafts(monkeypatch):
    """A suffix drafter queues what it sees (the prompt at `begin`, committed tokens at `accept` / `catch_up`) and
    extends its trie in `settle`, a part at a time under `stop`; its drafts are those of the tries fed at once."""
    from hf_hybrid_spec.drafters.suffix import NativeSuffixTrie

    monkeypatch.setattr(NativeSuffixTrie, "FEED_CHUNK", 8)  # (the C trie's chunk would take this prompt at once)
    g = torch.Generator().manual_seed(4)
    pattern = torch.randint(3, VOCAB, (7,), generator=g)
    tokens = torch.cat([pattern.repeat(9), torch.randint(3, VOCAB, (5,), generator=g), pattern[:3]]).view(1, -1)
    budget = DraftBudget(max_nodes=8, max_depth=4)
    eager, lazy = SuffixDrafter(use_global=False), SuffixDrafter(use_global=False)
    eager.begin(tokens[:, :40])
    eager.settle()
    lazy.begin(tokens[:, :40])
    assert not lazy.ready
    assert not lazy.settle(stop=lambda: True) and not lazy.ready  # one part of the prompt, then it stops
    eager.catch_up(tokens[0, 40:].tolist())
    lazy.catch_up(tokens[0, 40:].tolist())
    a, b = eager.propose(tokens, budget), lazy.propose(tokens, budget)  # propose settles what is left
    assert lazy.ready and a.num_nodes > 0
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def test_rows_behind_on_bookkeeping_sit_out_steps_within_the_host_limit(monkeypatch):
    """`limit_host`: a row whose drafter has not caught up within the limit drafts nothing this step, a row caught
    up drafts; `idle` settles rows in order while the device is busy; without a limit every row drafts."""
    from hf_hybrid_spec.drafters.batch import PerRowDrafters
    from hf_hybrid_spec.drafters.suffix import NativeSuffixTrie

    monkeypatch.setattr(NativeSuffixTrie, "FEED_CHUNK", 8)  # (the C trie's chunk would take this prompt at once)
    pattern = [5, 6, 7, 8, 9, 10]
    prompt = torch.tensor([pattern * 12])
    rows = PerRowDrafters([SuffixDrafter(use_global=False) for _ in range(3)])
    for d in rows.drafters:
        d.begin(prompt)
    rows.drafters[1].settle()
    budgets = [DraftBudget(max_nodes=4, max_depth=4)] * 3
    ids = [prompt] * 3
    rows.limit_host(0.0)  # the limit is spent at once: only the first part of a row's queue is fed
    counts = rows.propose([0, 1, 2], ids, budgets).counts
    assert counts[0] == 0 and counts[1] > 0 and counts[2] == 0, counts
    calls = iter([True] * 3 + [False] * 100)
    rows.idle(lambda: next(calls))  # busy for a few checks: row 0 gets further, row 2 not at all
    assert not rows.drafters[2].ready and len(rows.drafters[2]._pending) == prompt.shape[1] - 8
    rows.limit_host(None)
    assert all(c > 0 for c in rows.propose([0, 1, 2], ids, budgets).counts)
    assert all(d.ready for d in rows.drafters)


def test_suffix_rows_that_settle_a_part_per_step_stay_exact(monkeypatch):
    """A batch where the host limit is all but zero (a plain step costing a nanosecond): rows catch up on their
    prompts a part per drafting step and through plain runs; the output is stock's."""
    import hf_hybrid_spec.engine.batch as B

    tiny = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1e-9, 1e-9, 1.01e-9, 1.02e-9, 1.04e-9])
    monkeypatch.setattr(B, "_cost_model", lambda *args: tiny)
    limits = []
    from hf_hybrid_spec.drafters.batch import PerRowDrafters

    original = PerRowDrafters.limit_host
    monkeypatch.setattr(PerRowDrafters, "limit_host", lambda self, s: limits.append(s) or original(self, s))
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([40, 56, 33], seed=5, period=5)
    kw = dict(max_new_tokens=40, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, return_dict_in_generate=True,
                 assistant_config=H.AssistantConfig(compile=True, global_cache=False), **kw)
    assert torch.equal(out.sequences, ref)
    assert limits and all(s is not None and s < 1e-6 for s in limits)
