"""The pipelined batch step (`engine.pipeline`): drafts, selection, greedy acceptance and the commit on the device,
one read per step. Greedy identity with stock batched generate through it (deep accepts, rows that stop early, stops
without EOS, a measured budget, a node cap), and its device pieces against the host ones they stand in for."""

import pytest
import torch
from engine.test_batch import PAD, StopAfter, greedy, padded_batch, row_references
from transformers import StoppingCriteriaList

import hf_hybrid_spec as H
from hf_hybrid_spec.drafters import BatchDrafter
from hf_hybrid_spec.engine.step import greedy_rows
from hf_hybrid_spec.engine.budget import VerifyCost, choose_width, select_device
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DeviceDrafts, DraftBatch
from hf_hybrid_spec.verification import greedy_device

VOCAB = 96


def random_trees(rows: int, nodes: int, max_depth: int, seed: int, follow=None):
    """Random trees [R, nodes] as device drafts: topological parents of depth <= max_depth, values that fall with
    depth (each below its parent's). `follow[r]` (optional) are tokens row r's first branch follows."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (rows, nodes), generator=g)
    parents = torch.full((rows, nodes), -1)
    depth = torch.ones(rows, nodes, dtype=torch.long)
    values = torch.zeros(rows, nodes)
    for r in range(rows):
        chain = int(torch.randint(1, max_depth + 1, (1,), generator=g))
        for j in range(nodes):
            if j < chain:
                parents[r, j] = j - 1
                if follow is not None and j < len(follow[r]):
                    tokens[r, j] = follow[r][j]
            else:
                p = int(torch.randint(-1, j, (1,), generator=g))
                while p >= 0 and depth[r, p] >= max_depth:
                    p = int(parents[r, p])
                parents[r, j] = p
            depth[r, j] = 1 if parents[r, j] < 0 else depth[r, parents[r, j]] + 1
            up = 1.0 if parents[r, j] < 0 else float(values[r, parents[r, j]])
            values[r, j] = up * float(torch.rand(1, generator=g) * 0.5 + 0.5)
    return DeviceDrafts(tokens=tokens, parents=parents, values=values, depth=depth)


class ReferenceDrafter(BatchDrafter):
    """A batch drafter with device drafting that proposes random trees whose first branch follows each row's stock
    output (`refs[r]`, the row without its padding) for a random number of tokens: deep accepts, partial matches and
    rejected siblings, through the pipelined step."""

    supports_device = True
    target_hidden_layers = ()

    def __init__(self, refs, max_depth=4, seed=0):
        self.refs, self.max_depth, self.seed = refs, max_depth, seed
        self.lengths = [0] * len(refs)
        self.calls = 0

    def begin(self, prompts, context, hidden):
        self.lengths = [p.shape[1] for p in prompts]

    def accept(self, rows, ids, results, hidden):
        for i, b in enumerate(rows):
            self.lengths[b] = ids.lengths[i]

    def propose(self, rows, ids, budgets):
        raise AssertionError("the pipelined step drafts on the device")

    def propose_device(self, max_nodes):
        self.calls += 1
        follow = []
        g = torch.Generator().manual_seed(self.seed * 1000 + self.calls)
        for ref, length in zip(self.refs, self.lengths):
            want = ref[0, length : length + self.max_depth].tolist()
            keep = int(torch.randint(0, len(want) + 1, (1,), generator=g))
            follow.append(want[:keep] + [3] * (self.max_depth - keep))
        return random_trees(len(self.refs), max_nodes, self.max_depth, self.seed * 1000 + self.calls, follow)

    def accept_device(self, counts, tokens, hidden):
        self.lengths = [n + c for n, c in zip(self.lengths, counts.tolist())]

    def advance_host(self, counts):
        pass


def spy_device_choice(monkeypatch) -> list:
    """The device choices the batch loop makes from here on (`verification.device_choice`'s results, None where the
    rule has none), in a list that fills as it runs."""
    import hf_hybrid_spec.engine.batch as B

    real, made = B.device_choice, []
    monkeypatch.setattr(B, "device_choice", lambda *a: made.append(real(*a)) or made[-1])
    return made


def generate_with(model, ids, mask, drafter, config=None, **kw):
    """Batched greedy generate with `drafter` (a BatchDrafter), checking that the pipelined step ran."""
    import hf_hybrid_spec.engine.batch as B

    calls = []
    original = B.run_pipelined

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    B.run_pipelined = spy
    try:
        out = greedy(model, ids, mask, custom_generate=H.speculative_generate, return_dict_in_generate=True,
                     drafter=drafter,
                     assistant_config=config or H.AssistantConfig(compile=True, max_draft_tokens=10, max_depth=4), **kw)
    finally:
        B.run_pipelined = original
    assert calls, "the pipelined step did not run"
    return out


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1", "qwen3_next", "nemotron_h"])
def test_pipelined_step_matches_stock_batched_greedy(family):
    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5, 11], seed=6)
    kw = dict(max_new_tokens=18, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    out = generate_with(model, ids, mask, ReferenceDrafter(row_references(ref, mask), seed=1), **kw)
    assert torch.equal(out.sequences, ref)
    stats = out.spec_stats
    assert stats.mean_accepted_length > 1.5 and max(stats.accepted_lengths) >= 4  # deep accepts happened
    assert all(len(r.accepted_lengths) == r.target_forwards for r in stats.rows)
    assert stats.setup_seconds > 0  # the prefill and the first tokens, timed apart from the steps


def test_pipelined_rows_that_stop_early_are_padded_as_stock_pads_them():
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([7, 12, 4], seed=2)
    plain = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 2])
    ref = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=eos)
    assert (ref == PAD).sum() > (ids == PAD).sum()
    out = generate_with(model, ids, mask, ReferenceDrafter(row_references(plain, mask), seed=2), max_new_tokens=16,
                        eos_token_id=eos)
    assert torch.equal(out.sequences, ref)


def test_pipelined_rows_stopped_without_eos_keep_decoding_as_in_stock():
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([5, 10], seed=3)
    plain = greedy(model, ids, mask, max_new_tokens=20, eos_token_id=None)
    criteria = StoppingCriteriaList([StopAfter(int(plain[1, ids.shape[1] + 4]))])
    ref = greedy(model, ids, mask, max_new_tokens=20, eos_token_id=None, stopping_criteria=criteria)
    out = generate_with(model, ids, mask, ReferenceDrafter(row_references(plain, mask), seed=3), max_new_tokens=20,
                        eos_token_id=None, stopping_criteria=criteria)
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("widths", [(1, 2), (2, 4)], ids=["plain-or-2", "2-or-4"])
def test_pipelined_step_at_the_narrow_widths_a_cost_model_picks(widths, monkeypatch):
    """A cost model under which only narrow trees pay: trees narrower than the longest path the drafter can draft
    (and plain steps), every step's width chosen from the last drafts."""
    import hf_hybrid_spec.engine.batch as B
    from hf_hybrid_spec.engine.budget import VerifyCost

    steep = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.2, 1.5 if 4 in widths else 9.0, 20.0, 40.0])
    monkeypatch.setattr(B, "_cost_model", lambda *args: steep)
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([8, 11, 6], seed=9)
    kw = dict(max_new_tokens=14, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    out = generate_with(model, ids, mask, ReferenceDrafter(row_references(ref, mask), max_depth=4, seed=5), **kw)
    assert torch.equal(out.sequences, ref)
    assert max(out.spec_stats.drafted_tokens) <= max(widths) - 1


@pytest.mark.parametrize("config", [dict(batch_budget="calibrated"), dict(max_verify_nodes=7)],
                         ids=["calibrated", "node-cap"])
def test_pipelined_budgets_stay_exact(config):
    model = tiny_model("qwen3_next")
    ids, mask = padded_batch([8, 8, 13], seed=4)
    kw = dict(max_new_tokens=12, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    cfg = H.AssistantConfig(compile=True, max_draft_tokens=10, max_depth=4, **config)
    out = generate_with(model, ids, mask, ReferenceDrafter(row_references(ref, mask), seed=4), cfg, **kw)
    assert torch.equal(out.sequences, ref)
    if "max_verify_nodes" in config:
        assert max(out.spec_stats.drafted_tokens) <= 7


def likely_trees(rows: int, nodes: int, seed: int, share: float, bonus: float):
    """Random trees of up to `nodes` draft nodes per row as a host batch, their verify trees [rows, 1 + nodes] and
    random logits in which that `share` of the draft nodes get `bonus` at their parent (so paths go deep). Returns
    (the generator, for more draws; the batch; tokens; parent; logits)."""
    g = torch.Generator().manual_seed(seed)
    drafts = random_trees(rows, nodes, 4, seed)
    count = torch.randint(0, nodes + 1, (rows,), generator=g)
    batch = DraftBatch.from_tensors(drafts.tokens, drafts.parents, drafts.values, count)
    roots = torch.randint(3, VOCAB, (rows,), generator=g).tolist()
    tokens, parent = batch.verify_inputs(roots)
    logits = torch.randn(rows, nodes + 1, VOCAB, generator=g)
    for r in range(rows):
        for j in range(1, int(count[r]) + 1):  # (past a row's count, padding leaves under the root)
            if torch.rand(1, generator=g) < share:
                logits[r, parent[r, j], tokens[r, j]] += bonus
    return g, batch, tokens, parent, logits


@pytest.mark.parametrize("seed", range(4))
def test_greedy_on_the_device_accepts_what_the_host_walk_accepts(seed):
    """`greedy_device` over random trees and logits, against `greedy_rows` (the general step's): the same path,
    length and committed tokens for every row; a row that does not run commits nothing."""
    from hf_hybrid_spec.kernels.tree import ancestor_mask

    rows, nodes = 5, 9
    _, batch, tokens, parent, logits = likely_trees(rows, nodes, seed, share=0.7, bonus=10.0)
    host = greedy_rows(batch, logits.argmax(-1))
    anc = ancestor_mask(parent, include_self=True)
    valid = torch.arange(nodes + 1) <= batch.count.unsqueeze(1)
    running = torch.tensor([True, True, False, True, True])
    device = greedy_device(tokens, parent, anc, anc.sum(-1) - 1, valid, running, logits)
    for r in range(rows):
        if not running[r]:
            assert int(device.leaf[r]) == -1 and int(device.length[r]) == 0
            continue
        n = int(device.length[r])
        assert n == len(host[r].path)
        assert device.order[r, :n].tolist() == host[r].path
        assert device.tokens[r, :n].tolist() == host[r].token_list


@pytest.mark.parametrize("seed", range(4))
def test_sampling_on_the_device_accepts_what_the_host_rule_accepts(seed):
    """The pipelined step's sampling acceptance (`DeviceChoice.choose`: every node's keyed draw of its processed
    scores, walked by `greedy_device`) over random trees, against each row's own host rule (`ExactVerifier.verify`,
    the keyed walk over `process_tree_logits`) with the same seed, row and positions: the same path and committed
    tokens, with warpers and a minimum-new-tokens bound that lifts inside the trees."""
    from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    from hf_hybrid_spec.kernels.tree import ancestor_mask
    from hf_hybrid_spec.tree import VerifyTree
    from hf_hybrid_spec.verification import ExactVerifier, StepInputs, device_choice, process_tree_logits

    rows, nodes, eos = 8, 9, 4
    g, batch, tokens, parent, logits = likely_trees(rows, nodes, seed, share=0.85, bonus=9.0)
    logits[..., eos] += 2.0
    lengths = torch.randint(8, 14, (rows,), generator=g)  # each row's length, its root included
    processors = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(6, 4, torch.tensor([eos])),
                                      TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.95)])
    rule = ExactVerifier(True, seed=1234 + seed)
    choice = device_choice(rule, processors)
    anc = ancestor_mask(parent, include_self=True)
    depth = anc.sum(-1) - 1
    positions = lengths[:, None] + depth
    drawn = choice.choose(logits, torch.tensor([rule.seed]), positions, positions)
    valid = torch.arange(nodes + 1) <= batch.count.unsqueeze(1)
    device = greedy_device(tokens, parent, anc, depth, valid, torch.ones(rows, dtype=torch.bool), logits, drawn)
    deep = 0
    for r in range(rows):
        n = int(batch.count[r]) + 1
        tree = VerifyTree(tokens=tokens[r : r + 1, :n], parent=parent[r : r + 1, :n], draft=batch.row(r))
        ids = torch.randint(3, VOCAB, (1, int(lengths[r])), generator=g)
        scores = process_tree_logits(ids, tree, logits[r : r + 1, :n], processors)
        host = rule.verify(tree, scores, StepInputs(int(lengths[r]), None, r))
        k = int(device.length[r])
        assert device.order[r, :k].tolist() == host.path, r
        assert device.tokens[r, :k].tolist() == host.tokens.tolist(), r
        deep += len(host.path) > 2
    assert deep  # some rows accepted more than one draft node (the walk was tested past the first level)


@pytest.mark.parametrize("seed", range(4))
def test_device_selection_keeps_what_the_host_budget_keeps(seed):
    """`select_device` at each width keeps the same nodes in each row as the host ranking (values, then index), laid out
    as the general step lays them out."""
    g = torch.Generator().manual_seed(seed)
    rows, nodes = 6, 12
    drafts = random_trees(rows, nodes, 5, seed)
    caps = torch.randint(0, 6, (rows,), generator=g)
    roots = torch.randint(3, VOCAB, (rows,), generator=g)
    for width in (1, 4, 6, 9, nodes + 1):
        chosen = select_device(drafts, width, caps, roots)
        allowed = drafts.depth <= caps.unsqueeze(1)
        full = DraftBatch(tokens=drafts.tokens, parents=drafts.parents,
                          values=torch.where(allowed, drafts.values, -1.0), depth=drafts.depth,
                          count=torch.full((rows,), nodes))
        # The host budget at this width: every node ranked, those beyond the caps last and dropped.
        rank = torch.sort(full.values, dim=1, descending=True, stable=True).indices
        position = torch.empty_like(rank).scatter_(1, rank, torch.arange(nodes).expand(rows, nodes))
        keep = (position < width - 1) & allowed
        expect_tokens, expect_parent = full.select(keep).verify_inputs(roots.tolist())
        k = expect_tokens.shape[1]
        assert chosen.count.tolist() == keep.sum(1).tolist()
        assert torch.equal(chosen.tokens[:, :k], expect_tokens) and torch.equal(chosen.parent[:, :k], expect_parent)


def test_the_width_counts_the_drafters_cost_and_drafting_stops_where_it_does_not_pay():
    """Drafts are made before the width is applied: a drafting step never verifies fewer nodes than pay for
    themselves once the drafter's cost is spent, and drafting stops when even the best width loses to plain steps
    without a drafter (a compute-bound batch, or a drafter that costs more than its drafts bring)."""
    prefix = [0.0, 3.0, 5.0, 6.0, 6.5, 6.8, 7.0, 7.1, 7.2]  # 4 rows: the sum of each row's best k values
    flat = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.01, 1.02, 1.05, 1.2])
    width, pays = choose_width(prefix, 4, flat, widths=[1, 2, 4, 8, 16], draft_seconds=0.5)
    assert pays and width == 8  # (4 + 7.1) / 1.55 beats every other width, and plain's 4 / 1.0
    # The drafter's cost is paid at width 1 too: once drafting, a tree always beats a plain step.
    steeper = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.3, 2.0, 4.0, 8.0])
    width, pays = choose_width(prefix, 4, steeper, widths=[1, 2, 4, 8, 16], draft_seconds=0.1)
    assert pays and width == 2
    # Drafting loses to plain steps without a drafter: it does not pay (the best drafting width still named).
    assert choose_width(prefix, 4, steeper, widths=[1, 2, 4, 8, 16], draft_seconds=3.0) == (4, False)
    # However well a step is valued, a row never expects more tokens than its nodes.
    assert choose_width([0.0, 40.0, 80.0], 4, steeper, widths=[1, 2], draft_seconds=0.0) == (2, True)
    assert choose_width([0.0, 40.0, 80.0], 4, VerifyCost([1, 2], [1.0, 1.95]), widths=[1, 2])[1] is False
    compute_bound = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 2.0, 4.0, 8.0, 16.0])
    assert choose_width(prefix, 4, compute_bound, widths=[1, 2, 4, 8, 16], draft_seconds=0.0)[1] is False


def test_one_step_measures_the_acceptance_of_every_narrower_width():
    """A row whose accepted path has draft ranks r_1 .. r_d would have accepted the prefix whose running maximum rank
    is below W - 1 at width W: one step at its width measures every narrower width, and none wider."""
    from hf_hybrid_spec.engine.budget import AcceptanceByWidth, accepted_by_width

    measured = AcceptanceByWidth([1, 2, 4, 8, 16], weight=0.5)
    limits = torch.tensor([w - 1 for w in measured.widths])
    never = 1 << 30

    def observe(ranks, width, running=None):
        ranks = torch.tensor(ranks)
        running = torch.ones(ranks.shape[0], dtype=torch.bool) if running is None else torch.tensor(running)
        measured.observe(accepted_by_width(ranks, running, limits).tolist(), int(running.sum()), width)

    # Row 0 accepted 3 drafts of ranks 0, 2, 5; row 1 accepted one of rank 0; row 2 none; row 3 does not run.
    observe([[0, 2, 5, never], [0, never, never, never], [never] * 4, [0, 1, 2, 3]], 8, [True, True, True, False])
    assert measured.mean == {2: 2 / 3, 4: 3 / 3, 8: 4 / 3}  # width 16 was not verified: no number yet
    assert measured.prefix(3) == [0.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 4.0] + [0.0] * 8
    observe([[0, 1, 2, 3]] * 3, 16)  # averages move halfway; 16 takes its first number
    assert measured.mean == {2: (2 / 3 + 1) / 2, 4: (1 + 3) / 2, 8: (4 / 3 + 4) / 2, 16: 4.0}


def test_the_pipelined_width_follows_measured_acceptance_not_the_values(monkeypatch):
    """Drafts whose values promise little (every node valued near zero) but whose chains hold: the first step verifies
    the widest trees, measures what they accept, and the batch keeps drafting; the output is stock's."""
    import hf_hybrid_spec.engine.batch as B

    flat = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.0, 1.01, 1.02, 1.04])
    monkeypatch.setattr(B, "_cost_model", lambda *args: flat)
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([9, 13, 7], seed=14)
    kw = dict(max_new_tokens=20, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)

    class Underconfident(ReferenceDrafter):
        def propose_device(self, max_nodes):
            drafts = super().propose_device(max_nodes)
            return DeviceDrafts(tokens=drafts.tokens, parents=drafts.parents, values=drafts.values * 1e-4,
                                depth=drafts.depth)

    out = generate_with(model, ids, mask, Underconfident(row_references(ref, mask), seed=3), **kw)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.plain_steps == 0
    assert out.spec_stats.mean_accepted_length > 1.5


def test_a_batch_whose_drafting_does_not_pay_runs_plain_steps_without_the_drafter(monkeypatch):
    """Verification that would pay if every node held, with drafts that never hold: once `PATIENCE` steps in a row find
    drafting not paying, the drafter is not called again, the batch runs plain steps (`engine.plain`), and the output
    is stock's."""
    import hf_hybrid_spec.engine.batch as B
    from hf_hybrid_spec.engine.pipeline import PATIENCE

    steep = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.8, 3.6, 7.2, 14.4])  # w / T(w) = 1.11 / T(1)
    monkeypatch.setattr(B, "_cost_model", lambda *args: steep)
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([8, 11, 6], seed=10)
    kw = dict(max_new_tokens=12, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    wrong = [(row + 1) % VOCAB for row in row_references(ref, mask)]  # drafts that never match
    drafter = ReferenceDrafter(wrong, seed=6)
    out = generate_with(model, ids, mask, drafter, **kw)
    assert torch.equal(out.sequences, ref)
    stats = out.spec_stats
    assert stats.target_forwards == 11  # the first token comes with the prompt
    # The first step verifies the widest trees (it measures every width), the next PATIENCE - 1 still draft (each
    # finding that drafting does not pay), then none does.
    assert stats.plain_steps == stats.target_forwards - PATIENCE
    assert drafter.calls == 1 + 4 + PATIENCE  # the first drafts, the cost timing's, one per drafting step


class LateStarter(ReferenceDrafter):
    """Drafts that cannot hold (every node the token after the row's next one) until every row has committed `start`
    tokens past its prompt, then `ReferenceDrafter`'s drafts that follow the rows' stock output. It knows where each
    row is only from the counts its accept pass gets, so a drafter that caught up wrongly on plain steps drafts the
    wrong place and accepts nothing."""

    def __init__(self, refs, start, **kwargs):
        super().__init__(refs, **kwargs)
        self.start = start
        self.prompts = []
        self.wrong_steps = 0

    def begin(self, prompts, context, hidden):
        super().begin(prompts, context, hidden)
        self.prompts = list(self.lengths)

    def propose_device(self, max_nodes):
        drafts = super().propose_device(max_nodes)
        if all(n >= p + self.start for n, p in zip(self.lengths, self.prompts)):
            return drafts
        self.wrong_steps += 1
        after = [int(ref[0, min(n, ref.shape[1] - 1)]) for ref, n in zip(self.refs, self.lengths)]
        wrong = torch.tensor([(t + 1) % VOCAB for t in after]).unsqueeze(1).expand_as(drafts.tokens)
        return DeviceDrafts(tokens=wrong.clone(), parents=drafts.parents, values=drafts.values, depth=drafts.depth)


def test_a_batch_that_stopped_drafting_probes_again_and_resumes(monkeypatch):
    """Drafts that hold only later in the batch: after `PATIENCE` refusals the batch runs a plain run, the drafter
    catches up on its tokens, the widest trees are verified again, and drafting resumes and accepts; stock's output."""
    import hf_hybrid_spec.engine.batch as B
    from hf_hybrid_spec.engine.pipeline import PATIENCE, PLAIN_RUN

    flat = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.0, 1.01, 1.02, 1.04])
    monkeypatch.setattr(B, "_cost_model", lambda *args: flat)
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([9, 13, 7], seed=14)
    kw = dict(max_new_tokens=48, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    drafter = LateStarter(row_references(ref, mask), start=8, seed=5)
    out = generate_with(model, ids, mask, drafter, **kw)
    assert torch.equal(out.sequences, ref)
    stats = out.spec_stats
    path = drafter.max_depth + 1
    run = -(-PLAIN_RUN // path) * path
    assert stats.plain_steps == run  # one run: the probe after it found drafts that hold
    drafting = stats.target_forwards - stats.plain_steps
    assert drafter.wrong_steps >= PATIENCE
    # The drafting steps after the run accept (the first PATIENCE accepted one token per row each).
    late = [n for n in stats.accepted_lengths[PATIENCE * 3 :] if n > 1]
    assert drafting > PATIENCE and len(late) >= 3 * (drafting - PATIENCE) // 2


def test_rows_that_stop_in_a_plain_run_stay_stopped_when_drafting_resumes(monkeypatch):
    """A row reaches EOS inside the plain run; the others resume drafting after it: the stopped row is padded as stock
    pads it and the rest are stock's."""
    import hf_hybrid_spec.engine.batch as B

    flat = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.0, 1.01, 1.02, 1.04])
    monkeypatch.setattr(B, "_cost_model", lambda *args: flat)
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([10, 6, 13], seed=21)
    plain = greedy(model, ids, mask, max_new_tokens=40, eos_token_id=None)
    eos = [int(plain[1, ids.shape[1] + 11])]  # row 1's 12th new token: inside the plain run (new tokens 5-24)
    ref = greedy(model, ids, mask, max_new_tokens=40, eos_token_id=eos)
    drafter = LateStarter(row_references(plain, mask), start=8, seed=2)
    out = generate_with(model, ids, mask, drafter, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.plain_steps > 0 and max(out.spec_stats.accepted_lengths) > 1


def test_drafts_that_never_hold_probe_at_runs_that_double(monkeypatch):
    """Drafts that never hold: `PATIENCE` drafting steps, then plain runs of `PLAIN_RUN`, twice that, ... steps, each
    followed by one probe at the widest trees that sends the batch back at once; stock's output."""
    from engine.test_plain_runs import drafting_steps_when_nothing_holds

    import hf_hybrid_spec.engine.batch as B
    from hf_hybrid_spec.engine.pipeline import PATIENCE, PLAIN_RUN

    flat = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.0, 1.01, 1.02, 1.04])
    monkeypatch.setattr(B, "_cost_model", lambda *args: flat)
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([8, 11, 6], seed=10)
    kw = dict(max_new_tokens=80, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    drafter = LateStarter(row_references(ref, mask), start=10**6, seed=6)
    out = generate_with(model, ids, mask, drafter, **kw)
    assert torch.equal(out.sequences, ref)
    # The rule over the 79 forwards after the prompt's.
    path = drafter.max_depth + 1
    drafting = drafting_steps_when_nothing_holds(kw["max_new_tokens"] - 1, -(-PLAIN_RUN // path) * path)
    stats = out.spec_stats
    assert stats.target_forwards == kw["max_new_tokens"] - 1
    assert stats.target_forwards - stats.plain_steps == drafting and drafting >= PATIENCE + 2  # probes between runs
    assert max(stats.accepted_lengths) == 1


def test_a_batch_where_no_draft_can_pay_decodes_plain_from_the_start(monkeypatch):
    """A verify cost under which no width could pay even if every node held (a compute-bound batch): the batch never
    drafts, its steps are the plain steps of `engine.plain`, and the output is stock's, rows of every length."""
    import hf_hybrid_spec.engine.batch as B

    linear = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 2.0, 4.0, 8.0, 16.0])
    monkeypatch.setattr(B, "_cost_model", lambda *args: linear)
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([9, 5, 12, 7], seed=12)
    kw = dict(max_new_tokens=10, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    drafter = ReferenceDrafter(row_references(ref, mask), seed=2)
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, return_dict_in_generate=True,
                 drafter=drafter, assistant_config=H.AssistantConfig(compile=True, max_draft_tokens=10, max_depth=4),
                 **kw)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.plain_steps == out.spec_stats.target_forwards == 9
    assert drafter.calls == 0


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_the_acceptance_batch_drafter_on_a_decisive_random_model(family):
    """The benchmarks' random shapes: `decisive_head` makes greedy decoding of a random model robust to bf16 rounding
    (the batched tree forward and stock's one-token steps pick the same tokens), and the acceptance-controlled batch
    drafter, through the pipelined step, accepts about what its acceptance says."""
    from transformers import AutoModelForCausalLM

    from hf_hybrid_spec.testing import acceptance_batch_drafter, decisive_head, tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa").eval()
    model = decisive_head(model).to(torch.bfloat16)
    ids, mask = padded_batch([12, 12, 12, 12], seed=11)
    kw = dict(max_new_tokens=24, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    drafter = acceptance_batch_drafter([row.tolist() for row in ref], 0.8, depth=6, vocab_size=VOCAB, seed=0)
    out = generate_with(model, ids, mask, drafter, H.AssistantConfig(compile=True, max_draft_tokens=6, max_depth=6),
                        **kw)
    assert torch.equal(out.sequences, ref)
    # A chain of 6 whose tokens hold with probability 0.8 each: 1 + sum 0.8^k = 3.96 tokens per step on average.
    assert 2.5 < out.spec_stats.mean_accepted_length < 5.0


def test_a_batch_drafter_at_batch_size_one_is_refused_and_the_model_still_decodes():
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([9], seed=12)
    kw = dict(max_new_tokens=8, eos_token_id=None)
    ref = greedy(model, ids, mask, **kw)
    with pytest.raises(ValueError, match="BatchDrafter, which drafts for the rows of a batch"):
        greedy(model, ids, mask, custom_generate=H.speculative_generate, drafter=ReferenceDrafter([ref]), **kw)
    assert torch.equal(greedy(model, ids, mask, custom_generate=H.speculative_generate, **kw), ref)


@pytest.mark.parametrize("eos_rows", [(1,), (0, 2)])
def test_plain_steps_stop_rows_at_eos_as_stock_does(monkeypatch, eos_rows):
    """Plain steps queue each step before reading the last: rows that stop on EOS mid-batch (one, or all but one) are
    padded exactly as stock pads them, and the token computed for them after their stop is not recorded."""
    import hf_hybrid_spec.engine.batch as B

    linear = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 2.0, 4.0, 8.0, 16.0])  # no draft can pay: plain steps
    monkeypatch.setattr(B, "_cost_model", lambda *args: linear)
    model = tiny_model("falcon_h1")
    ids, mask = padded_batch([10, 6, 13], seed=21)
    plain = greedy(model, ids, mask, max_new_tokens=14, eos_token_id=None)
    # Each chosen row's 4th new token as the EOS: those rows stop there (others may stop on it too, as in stock).
    eos = [int(plain[b, ids.shape[1] + 3]) for b in eos_rows]
    ref = greedy(model, ids, mask, max_new_tokens=14, eos_token_id=eos)
    out = greedy(model, ids, mask, custom_generate=H.speculative_generate, return_dict_in_generate=True,
                 drafter=ReferenceDrafter(row_references(plain, mask)), max_new_tokens=14, eos_token_id=eos,
                 assistant_config=H.AssistantConfig(compile=True, max_draft_tokens=10, max_depth=4))
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.plain_steps == out.spec_stats.target_forwards
    for b in eos_rows:
        assert (out.sequences[b, ids.shape[1] + 4 :] == PAD).all()


@pytest.mark.slow
@pytest.mark.fixture
def test_eagle_catches_up_on_plain_steps_from_their_hidden_states(monkeypatch):
    """The committed EAGLE-3 drafter on the fixture at B = 4, with drafting refused for its first `PATIENCE` steps:
    the catch-up after the plain run hands the drafter, for each row, the committed tokens and the target's hidden
    states of the tokens before them (checked against one forward of the finished rows), and drafting after it
    accepts as before; every row stock's."""
    from pathlib import Path

    from helpers import load_fixture

    import hf_hybrid_spec.engine.batch as B
    import hf_hybrid_spec.engine.pipeline as P
    from hf_hybrid_spec.eagle import EagleDrafter
    from hf_hybrid_spec.eagle.batch import BatchEagleDrafter

    model, tok = load_fixture("qwen3_5-small")
    eagle = EagleDrafter.from_pretrained(Path(__file__).resolve().parents[2] / "checkpoints" / "drafters"
                                         / "qwen3_5-small-eagle3")
    flat = VerifyCost(widths=[1, 2, 4, 8, 16, 32, 61], seconds=[1.0] * 7)
    monkeypatch.setattr(B, "_cost_model", lambda *args: flat)
    decisions = []
    real_choice = P.choose_width

    def refuse_first(*args, **kwargs):
        width, pays = real_choice(*args, **kwargs)
        decisions.append(pays)
        return width, pays and len(decisions) > P.PATIENCE

    monkeypatch.setattr(P, "choose_width", refuse_first)
    catch_up, in_run = [], []
    real_run, real_accept = P._plain_run, BatchEagleDrafter.accept_device

    def plain_run(*args, **kwargs):
        in_run.append(True)
        try:
            return real_run(*args, **kwargs)
        finally:
            in_run.pop()

    def accept_device(self, counts, tokens, hidden):
        if in_run:
            catch_up.append((list(self.steps), counts.tolist(), tokens.clone(), tuple(h.clone() for h in hidden)))
        return real_accept(self, counts, tokens, hidden)

    monkeypatch.setattr(P, "_plain_run", plain_run)
    monkeypatch.setattr(BatchEagleDrafter, "accept_device", accept_device)
    texts = ["def fibonacci(n):\n", "import numpy as np\n\n\ndef softmax(x):\n",
             "class Stack:\n    def __init__(self):\n        self.items = []\n", "def merge_sorted(a, b):\n"]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=72, min_new_tokens=72, eos_token_id=None, do_sample=False, pad_token_id=PAD)
    ref = model.generate(**batch, **kw)
    out = model.generate(**batch, **kw, custom_generate=H.speculative_generate, draft_model=eagle,
                         assistant_config=H.AssistantConfig(drafter="eagle", max_depth=6, compile=True),
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    stats, rows = out.spec_stats, len(texts)
    path = 6 + 1  # the accept pass's width: the depth and the root
    run = -(-P.PLAIN_RUN // path) * path
    assert stats.plain_steps == run and len(catch_up) == run // path
    # What the drafter was handed, against one forward of the finished rows: for row b at drafter step s (its
    # committed tokens but the root), column i pairs the hidden state of the row's token s + i with token s + i + 1.
    pads = (batch["attention_mask"] == 0).sum(-1).tolist()
    mask = torch.cat([batch["attention_mask"], torch.ones(rows, kw["max_new_tokens"], dtype=torch.long)], dim=1)
    with torch.no_grad():
        states = model(out.sequences, attention_mask=mask, output_hidden_states=True).hidden_states
    layers = eagle.config.aux_layers
    for steps, counts, tokens, hidden in catch_up:
        for b in range(rows):
            assert counts[b] == path
            at = pads[b] + steps[b] + torch.arange(path)
            assert torch.equal(tokens[b], out.sequences[b, at + 1])
            for layer, h in zip(layers, hidden):
                torch.testing.assert_close(h[b], states[layer][b, at], rtol=1e-4, atol=1e-4)
    after = stats.accepted_lengths[(P.PATIENCE + run) * rows :]
    assert len(after) >= 4 * rows and sum(after) / len(after) > 2.5


def test_a_drafts_cost_is_timed_once_per_timing_key(monkeypatch):
    """The pipelined step times one device draft before the first step (the cost a drafting step adds): once per
    process for each drafter `timing_key` (its weights and settings), at every call for a drafter without one. A key
    from the drafter's object identity would re-time every call of a drafter built per call, and grow without
    bound."""
    import hf_hybrid_spec.engine.batch as B
    import hf_hybrid_spec.engine.pipeline as P

    flat = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.0, 1.01, 1.02, 1.04])
    monkeypatch.setattr(B, "_cost_model", lambda *args: flat)
    monkeypatch.setattr(P, "_DRAFT_SECONDS", {})
    timed = []
    monkeypatch.setattr(P, "time_forward", lambda run, device: timed.append(1) or 1e-3)
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([9, 7], seed=15)
    kw = dict(max_new_tokens=6, eos_token_id=None)
    refs = row_references(greedy(model, ids, mask, **kw), mask)

    class Keyed(ReferenceDrafter):
        def __init__(self, refs, key):
            super().__init__(refs)
            self.key = key

        def timing_key(self):
            return self.key

    for key, expected in (("fused", 1), ("fused", 1), ("eager", 2), (None, 3), (None, 4)):
        generate_with(model, ids, mask, Keyed(refs, key), **kw)
        assert len(timed) == expected, key
    assert set(P._DRAFT_SECONDS) == {(k, "cpu", 2, 10) for k in ("fused", "eager")}


def test_the_step_passes_write_the_same_when_run_twice_as_a_capture_warm_up_runs_them():
    """On CUDA each pass is run twice on a side stream, then captured and replayed: a pass whose second run wrote
    something else than its first (roots moved twice, say) would decode wrong only on the GPU."""
    from hf_hybrid_spec.engine.batch_static import BatchStaticBackend
    from hf_hybrid_spec.engine.step_graphs import step_graphs

    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([6, 9, 4], seed=5)
    backend = BatchStaticBackend(model, rows=3, static_length=64, buckets=(4, 8), owner=None)
    backend.prefill(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
    drafts = random_trees(3, 6, 3, seed=4)
    limits = torch.tensor([0, 3, 7])
    graphs = step_graphs(backend.runner, drafts, 4, limits)
    assert step_graphs(backend.runner, drafts, 4, limits) is graphs  # kept on the runner for its shape
    graphs.roots.copy_(ids[:, -1])
    graphs.set_rows([3, 2, 0], [True, True, False])
    graphs.load(drafts)
    bucket = backend.runner.bucket_for(6)
    graphs.select(6)
    first = bucket.tokens.clone(), bucket.parent.clone()
    graphs.select(6)
    assert torch.equal(bucket.tokens, first[0]) and torch.equal(bucket.parent, first[1])
    assert (bucket.parent[:, 6:] == -1).all()  # the bucket's spare nodes hang off nothing
    backend.forward_filled(6)
    once = graphs.accept(6)
    seen = [t.clone() for t in (once.results, once.totals, once.length, graphs.roots, bucket.leaf)]
    twice = graphs.accept(6)
    for before, after in zip(seen, (twice.results, twice.totals, twice.length, graphs.roots, bucket.leaf)):
        assert torch.equal(before, after)
    assert bucket.leaf[2] == -1 and once.length[2] == 0  # the row that does not run commits nothing
    assert (once.length[:2] >= 1).all()
    # Each running row's root is now its last committed token.
    for b in range(2):
        assert graphs.roots[b] == once.news[b, once.length[b] - 1]
    assert graphs.roots[2] == ids[2, -1]
    backend.abort()
    other = random_trees(3, 5, 3, seed=4)
    assert step_graphs(backend.runner, other, 4, limits) is not graphs  # another shape: buffers of its own


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_the_pipelined_step_samples_what_the_general_step_samples(family, monkeypatch):
    """Sampling (temperature, top-k, top-p) through the pipelined step: every node's keyed draw made on the device
    (`verification.DeviceChoice`) is the general step's, so after the same seed the output is the general step's,
    token for token; drafts that follow that output are accepted deep (the draws agree node by node). Plain runs
    inside the pipelined step sample the same tokens too."""
    import hf_hybrid_spec.engine.batch as B

    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5, 11], seed=6)
    kw = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=18, eos_token_id=None, do_sample=True,
              temperature=0.8, top_k=20, top_p=0.9, custom_generate=H.speculative_generate,
              return_dict_in_generate=True)
    config = H.AssistantConfig(compile=True, max_draft_tokens=10, max_depth=4)
    real = B.pipelines
    monkeypatch.setattr(B, "pipelines", lambda *a: False)
    torch.manual_seed(5)
    ref = model.generate(ids, assistant_config=config, **kw).sequences
    monkeypatch.setattr(B, "pipelines", real)
    ran = []
    original = B.run_pipelined
    monkeypatch.setattr(B, "run_pipelined", lambda *a, **k: ran.append(1) or original(*a, **k))
    torch.manual_seed(5)
    out = model.generate(ids, drafter=ReferenceDrafter(row_references(ref, mask), seed=1), assistant_config=config,
                         **kw)
    assert ran and torch.equal(out.sequences, ref)
    assert out.spec_stats.mean_accepted_length > 1.5 and max(out.spec_stats.accepted_lengths) >= 4
    # Drafts that never hold, under a cost model where drafting must pay: the batch runs plain steps, which draw
    # the same tokens.
    steep = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.8, 3.6, 7.2, 14.4])
    monkeypatch.setattr(B, "_cost_model", lambda *args: steep)
    wrong = [(row + 1) % VOCAB for row in row_references(ref, mask)]
    torch.manual_seed(5)
    out = model.generate(ids, drafter=ReferenceDrafter(wrong, seed=6), assistant_config=config, **kw)
    assert torch.equal(out.sequences, ref) and out.spec_stats.plain_steps > 0


def test_the_pipelined_step_holds_the_eos_back_as_min_new_tokens_asks(monkeypatch):
    """Greedy with the model's eos held back by `min_new_tokens` (a positional processor, applied on the device from
    each node's ids length): through the pipelined step, token for token stock."""
    model = tiny_model("qwen3_5_text")
    ids, mask = padded_batch([7, 12, 4], seed=2)
    plain = greedy(model, ids, mask, max_new_tokens=16, eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + 2])
    kw = dict(max_new_tokens=16, eos_token_id=eos, min_new_tokens=9)
    ref = greedy(model, ids, mask, **kw)
    assert not torch.equal(ref, greedy(model, ids, mask, max_new_tokens=16, eos_token_id=eos))
    made = spy_device_choice(monkeypatch)
    out = generate_with(model, ids, mask, ReferenceDrafter(row_references(ref, mask), seed=2), **kw)
    assert torch.equal(out.sequences, ref) and made and made[0] is not None


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_the_pipelined_step_applies_the_repetition_penalty_as_stock_does(family, monkeypatch):
    """Greedy with `repetition_penalty` (a processor that reads the ids) through the pipelined step: every node's
    context's tokens (its row's ids, padding included, then its path) on the device, the set kept there from step to
    step, and rebuilt after plain runs. Token for token stock; the penalty changes the output here, and drafts that
    follow stock's are accepted deep. Sampling with the penalty draws what the general step draws."""
    import hf_hybrid_spec.engine.batch as B

    model = tiny_model(family)
    ids, mask = padded_batch([9, 14, 5, 11], seed=3, vocab=24)
    kw = dict(max_new_tokens=18, eos_token_id=None, repetition_penalty=1.6)
    ref = greedy(model, ids, mask, **kw)
    assert not torch.equal(ref, greedy(model, ids, mask, max_new_tokens=18, eos_token_id=None))
    made = spy_device_choice(monkeypatch)
    out = generate_with(model, ids, mask, ReferenceDrafter(row_references(ref, mask), seed=2), **kw)
    assert made and made[0] is not None and made[0].ignored_prompt is not None
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.mean_accepted_length > 1.5
    # Drafts that never hold, where drafting must pay: runs of plain steps between drafting steps, after which the
    # tokens seen are rebuilt from the recorder.
    steep = VerifyCost(widths=[1, 2, 4, 8, 16], seconds=[1.0, 1.8, 3.6, 7.2, 14.4])
    monkeypatch.setattr(B, "_cost_model", lambda *args: steep)
    wrong = [(row + 1) % 24 for row in row_references(ref, mask)]
    out = generate_with(model, ids, mask, ReferenceDrafter(wrong, seed=6), **kw)
    assert torch.equal(out.sequences, ref) and out.spec_stats.plain_steps > 0
    monkeypatch.undo()
    # Sampling with the penalty: the pipelined step's draws are the general step's.
    sample = dict(kw, attention_mask=mask, pad_token_id=PAD, do_sample=True, temperature=0.9, top_k=12,
                  custom_generate=H.speculative_generate, return_dict_in_generate=True,
                  assistant_config=H.AssistantConfig(compile=True, max_draft_tokens=10, max_depth=4))
    monkeypatch.setattr(B, "pipelines", lambda *a: False)
    torch.manual_seed(4)
    general = model.generate(ids, **sample).sequences
    monkeypatch.undo()
    ran, original = [], B.run_pipelined
    monkeypatch.setattr(B, "run_pipelined", lambda *a, **k: ran.append(1) or original(*a, **k))
    torch.manual_seed(4)
    piped = model.generate(ids, drafter=ReferenceDrafter(row_references(general, mask), seed=3), **sample).sequences
    assert ran and torch.equal(piped, general)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the captured accept pass)")
def test_on_a_gpu_the_captured_pipelined_step_samples_what_the_general_step_samples():
    """On CUDA the pipelined step's draws run inside a captured graph, from the tensor form of the keyed uniforms:
    the fixture in fp32 with its EAGLE-3 drafter, four left-padded prompts, sampling as Qwen3.5's generation config
    asks; after the same seed the pipelined step and the general step (pipelining turned off) give the same tokens in
    every row, and so does the pipelined step again (its passes replayed)."""
    import os

    import hf_hybrid_spec.engine.batch as B
    from helpers import load_fixture

    from hf_hybrid_spec.eagle import EagleDrafter

    model, tokenizer = load_fixture("qwen3_5-small")
    model = model.to("cuda", torch.float32)
    eagle = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "drafters", "qwen3_5-small-eagle3")
    draft = EagleDrafter.from_pretrained(eagle).to(device="cuda", dtype=torch.float32)
    tokenizer.padding_side = "left"
    texts = ["def add(a, b):\n    return", "class Stack:\n    def __init__(self):\n        self.items = []\n",
             "import os\n\ndef list_files(path):\n", "for i in range(10):\n    print(i)\n"]
    enc = tokenizer(texts, return_tensors="pt", padding=True).to("cuda")
    kw = dict(max_new_tokens=48, do_sample=True, temperature=0.7, top_p=0.95, top_k=20, eos_token_id=None,
              custom_generate=H.speculative_generate, assistant_config=H.AssistantConfig(drafter="eagle"),
              draft_model=draft)
    outs, ran = {}, []
    real, original = B.pipelines, B.run_pipelined
    try:
        B.run_pipelined = lambda *a, **k: ran.append(1) or original(*a, **k)
        for name in ("pipelined", "general", "pipelined again"):
            B.pipelines = (lambda *a: False) if name == "general" else real
            torch.manual_seed(11)
            outs[name] = model.generate(**enc, **kw)
    finally:
        B.pipelines, B.run_pipelined = real, original
    assert len(ran) == 2
    assert torch.equal(outs["pipelined"], outs["general"]) and torch.equal(outs["pipelined"], outs["pipelined again"])
