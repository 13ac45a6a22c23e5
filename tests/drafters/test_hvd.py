"""Hybrid Verified Decoding: greedy identity under every policy (tiny configs and both fixtures), the
payoff predictor's Hub round trip, the label-collection mode against known accepted lengths, the model drafter kept
in step while skipped, draft merging, the cost model, the workload suite, metrics and bad input."""

import math
from pathlib import Path

import pytest
import torch
from helpers import load_fixture
from workloads import AGENTIC, WORKLOADS, load_suite  # benchmarks/workloads.py

import hf_hybrid_spec as H
from hf_hybrid_spec.drafters import DraftBudget, Drafter, SuffixDrafter, TargetHidden
from hf_hybrid_spec.eagle import EagleDrafter, EagleTreeDrafter
from hf_hybrid_spec.hvd import (
    CACHE_FEATURES,
    FEATURE_NAMES,
    CollectPolicy,
    CostProfile,
    HybridDrafter,
    LearnedPolicy,
    OraclePolicy,
    PayoffPredictor,
    PayoffPredictorConfig,
    ReplayPolicy,
    ThresholdPolicy,
    merge_drafts,
    profile_costs,
    realized_payoff,
)
from hf_hybrid_spec.hvd.factory import make_model_drafter
from hf_hybrid_spec.hvd.metrics import payoff_metrics, spearman
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DraftTree, VerifyResult, chain_tree, empty_draft

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96
COST = CostProfile(tree_sizes=[1, 8, 32], verify_seconds=[1.0, 1.1, 1.6], cache_draft_seconds=0.01,
                   model_draft_seconds=0.4)


def repeating_prompt(seed=0):
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(2, VOCAB, (1, 6), generator=gen)
    return torch.cat([torch.randint(2, VOCAB, (1, 5), generator=gen), motif, motif, motif[:, :3]], dim=1)


def plain(model, ids, n):
    return model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=1)


def spec(model, ids, n, **kw):
    return model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=1,
                          custom_generate=H.speculative_generate, return_dict_in_generate=True, **kw)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved_predictor(tmp_path_factory):
    """A freshly initialized predictor saved to disk, with a cost profile next to it."""
    path = tmp_path_factory.mktemp("payoff")
    torch.manual_seed(0)
    PayoffPredictor(PayoffPredictorConfig(width=8, num_layers=1)).save_pretrained(path)
    COST.save(path / "cost.json")
    return path


def hybrid(target, eagle, policy, record=False, merge=True):
    return HybridDrafter(SuffixDrafter(use_global=False), EagleTreeDrafter(eagle, target, top_k=3), policy, COST,
                         model_tokens=8, model_depth=4, allow_merge=merge, record=record)


# ---------------------------------------------------------------------- greedy identity, tiny configs
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_every_policy_matches_plain_greedy(family, saved_predictor):
    target = tiny_model(family)
    torch.manual_seed(1)
    eagle = EagleDrafter.from_target(target, draft_vocab_size=VOCAB)
    ids = repeating_prompt()
    ref = plain(target, ids, 36)
    base = dict(drafter="hvd", max_draft_tokens=16, max_depth=8, draft_top_k=3, hvd_model_tokens=8,
                hvd_model_depth=4, global_cache=False)
    configs = {
        "threshold": H.AssistantConfig(hvd_policy="threshold", hvd_threshold=1.5, **base),
        "learned": H.AssistantConfig(hvd_policy="learned", hvd_predictor=str(saved_predictor),
                                     hvd_cost_profile=str(saved_predictor / "cost.json"), **base),
    }
    for name, cfg in configs.items():
        out = spec(target, ids, 36, assistant_config=cfg, draft_model=eagle)
        assert torch.equal(out.sequences, ref), name
        assert torch.equal(spec(target, ids, 36, assistant_config=cfg.replace(compile=True),
                                draft_model=eagle).sequences, ref), f"{name} compile=True"
        drafter = H.drafters.make_drafter(cfg, target, eagle)
        assert isinstance(drafter, HybridDrafter) and drafter.policy.name == name
    oracle = OraclePolicy(ref[0].tolist())
    loop = H.AssistantConfig(max_draft_tokens=16, max_depth=8)
    drafter = hybrid(target, eagle, oracle)
    assert torch.equal(spec(target, ids, 36, assistant_config=loop, drafter=drafter).sequences, ref)
    # The repeating prompt gives the cache drafter matches the oracle takes.
    assert drafter.options["cache"] > 0 and len(oracle.decisions) == sum(drafter.options.values())
    replay = hybrid(target, eagle, ReplayPolicy(oracle.decisions))
    assert torch.equal(spec(target, ids, 36, assistant_config=loop, drafter=replay).sequences, ref)
    assert replay.policy.diverged == 0 and replay.options == drafter.options
    # Replaying a cache decision skips the model drafter.
    assert replay.model_runs == sum(d != "cache" for d in oracle.decisions) < drafter.model_runs
    # Label collection verifies every kind of tree; without merging, the learned policy never verifies one.
    collect = hybrid(target, eagle, CollectPolicy(0.5, seed=3))
    eager = spec(target, ids, 36, assistant_config=loop, drafter=collect)
    assert torch.equal(eager.sequences, ref)
    assert all(collect.options[o] > 0 for o in ("cache", "model", "merged"))
    # Static path (compile=True): the model drafter catches up on views of the runner's hidden-state history, held
    # across the cache-only steps; same decisions, so the same drafts and accepted lengths as eager.
    collect_static = hybrid(target, eagle, CollectPolicy(0.5, seed=3))
    static = spec(target, ids, 36, assistant_config=loop.replace(compile=True), drafter=collect_static)
    assert torch.equal(static.sequences, ref) and static.spec_stats.static
    assert collect_static.options == collect.options
    assert static.spec_stats.accepted_lengths == eager.spec_stats.accepted_lengths
    no_merge = hybrid(target, eagle, LearnedPolicy(PayoffPredictor.from_pretrained(saved_predictor)), merge=False)
    assert torch.equal(spec(target, ids, 36, assistant_config=loop, drafter=no_merge).sequences, ref)
    assert no_merge.options["merged"] == 0


def test_assistant_model_as_the_model_drafter_and_sampling_stays_valid():
    target = tiny_model("qwen3_5_text")
    assistant = tiny_model("llama", seed=7)
    ids = repeating_prompt(1)
    ref = plain(target, ids, 24)
    cfg = H.AssistantConfig(drafter="hvd", hvd_policy="threshold", hvd_threshold=0.5, max_draft_tokens=12,
                            max_depth=6, draft_top_k=2, hvd_model_tokens=6, global_cache=False)
    out = spec(target, ids, 24, assistant_config=cfg, draft_model=assistant)
    assert torch.equal(out.sequences, ref)
    torch.manual_seed(5)
    sampled = target.generate(ids, do_sample=True, max_new_tokens=8, eos_token_id=None, pad_token_id=1,
                              custom_generate=H.speculative_generate, assistant_config=cfg, draft_model=assistant)
    assert sampled.shape == (1, ids.shape[1] + 8)


# ---------------------------------------------------------------------- greedy identity, fixtures
FIXTURE_PROMPT = (
    "def moving_average(values, window):\n    total = sum(values[:window])\n    out = [total / window]\n"
    "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n    return out\n\n\n# revised: rename values to series\n"
    "def moving_average(series, window):\n"
)


@pytest.mark.slow
@pytest.mark.fixture
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_fixtures_match_plain_greedy_under_each_policy(name, saved_predictor):
    model, tok = load_fixture(name)
    trained = REPO_ROOT / "checkpoints" / "payoff" / name
    predictor = trained if (trained / "config.json").is_file() else saved_predictor
    torch.manual_seed(0)
    eagle = EagleDrafter.from_target(model, draft_vocab_size=1024)
    ids = tok(FIXTURE_PROMPT, return_tensors="pt").input_ids
    ref = plain(model, ids, 24)
    base = dict(drafter="hvd", max_draft_tokens=24, max_depth=8, draft_top_k=4, hvd_model_tokens=12,
                hvd_model_depth=4, global_cache=False)
    for cfg in (H.AssistantConfig(hvd_policy="threshold", **base),
                H.AssistantConfig(hvd_policy="learned", hvd_predictor=str(predictor),
                                  hvd_cost_profile=str(saved_predictor / "cost.json"), **base)):
        out = spec(model, ids, 24, assistant_config=cfg, draft_model=eagle)
        assert torch.equal(out.sequences, ref), cfg.hvd_policy
    oracle = OraclePolicy(ref[0].tolist())
    drafter = HybridDrafter(SuffixDrafter(use_global=False), EagleTreeDrafter(eagle, model, top_k=4), oracle, COST,
                            model_tokens=12, model_depth=4)
    out = spec(model, ids, 24, assistant_config=H.AssistantConfig(max_draft_tokens=24, max_depth=8), drafter=drafter)
    assert torch.equal(out.sequences, ref)
    # The prompt repeats a function: the cache draft is worth verifying on some steps.
    assert drafter.options["cache"] > 0


# ---------------------------------------------------------------------- label collection
class ScriptedDrafter(Drafter):
    """Drafts the reference continuation cut after `schedule[step]` tokens, then a wrong token (a chain); the
    realized payoff of step k is therefore schedule[k] (capped by what is left to generate)."""

    def __init__(self, reference, schedule, vocab=VOCAB):
        self.reference = reference[0].tolist()
        self.schedule = list(schedule)
        self.vocab = vocab
        self.step = 0

    def propose(self, input_ids, budget):
        n = self.schedule[self.step % len(self.schedule)]
        self.step += 1
        length = input_ids.shape[1]
        good = self.reference[length : length + n]
        nxt = self.reference[length + n] if length + n < len(self.reference) else 2
        wrong = [2 + (nxt - 1) % (self.vocab - 2)]  # any token but the reference's next one
        tokens = torch.tensor([good + wrong])[:, : budget.max_depth]
        if tokens.shape[1] == 0:
            return empty_draft(1)
        chain = chain_tree(tokens)
        return DraftTree(tokens=chain.tokens, parents=chain.parents,
                         scores=torch.linspace(0.9, 0.5, tokens.shape[1]).view(1, -1),
                         info={"drafter": "scripted", "match_length": 3, "score": 1.0})


@pytest.mark.parametrize("merged_share", [1.0, 0.0])
def test_label_collection_records_what_verification_realized(merged_share):
    target = tiny_model("llama")
    ids = repeating_prompt(2)
    ref = plain(target, ids, 48)
    cache_plan, model_plan = [3, 0, 5, 1, 2], [1, 2, 0, 4, 2]
    drafter = HybridDrafter(ScriptedDrafter(ref, cache_plan), ScriptedDrafter(ref, model_plan),
                            CollectPolicy(merged_share, seed=1), record=True, model_tokens=8, model_depth=8)
    out = spec(target, ids, 48, assistant_config=H.AssistantConfig(max_draft_tokens=24, max_depth=8),
               drafter=drafter)
    assert torch.equal(out.sequences, ref)
    records = drafter.records
    # Every forward but a last one with room for the bonus token only (nothing is drafted there) has a record.
    assert out.spec_stats.target_forwards - len(records) in (0, 1)
    for k, (rec, committed) in enumerate(zip(records, out.spec_stats.accepted_lengths)):
        # Near the end the budget's depth (tokens left - 1) cuts every draft.
        room = 48 - rec.position - 1
        want = {"cache": min(cache_plan[k % 5], room), "model": min(model_plan[k % 5], room)}
        want["merged"] = max(want["cache"], want["model"])
        assert rec.accepted == committed - 1 == want[rec.option]
        for i, option in enumerate(("cache", "model", "merged")):
            if option == rec.option or merged_share == 1.0:
                assert rec.realized[i] == want[option], (k, option, rec)
            elif not math.isnan(rec.realized[i]):
                # An unverified draft's payoff is recorded only where it is exact (shorter than what was committed).
                assert rec.realized[i] == want[option] < committed
    if merged_share == 0.0:
        assert {r.option for r in records} == {"cache", "model"}


# ---------------------------------------------------------------------- model drafter kept in step while skipped
def test_eagle_catches_up_in_one_batched_accept():
    target = tiny_model("qwen3_5_text")
    torch.manual_seed(2)
    eagle = EagleDrafter.from_target(target, draft_vocab_size=VOCAB)
    ids = torch.cat([repeating_prompt(3), torch.randint(2, VOCAB, (1, 12))], dim=1)
    layers = tuple(eagle.config.aux_layers)
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
    prompt_len, chunks = ids.shape[1] - 10, [3, 1, 4, 2]

    def hidden(a, b):
        return TargetHidden(layers, tuple(states[i][:, a:b] for i in layers))

    class NoCacheDraft(Drafter):
        def propose(self, input_ids, budget):
            return empty_draft(1)

    eager = EagleTreeDrafter(eagle, target, top_k=3)
    # No cache draft: the threshold gate runs the model drafter and verifies its draft.
    lazy = HybridDrafter(NoCacheDraft(), EagleTreeDrafter(eagle, target, top_k=3), ThresholdPolicy(0.0), COST,
                         model_tokens=10, model_depth=4)
    lazy.begin(ids[:, :prompt_len - 1], None, hidden(0, prompt_len - 1))
    eager.begin(ids[:, :prompt_len - 1], None, hidden(0, prompt_len - 1))
    first = VerifyResult(path=[0], tokens=ids[0, prompt_len - 1 : prompt_len], score_nodes=[0])
    lazy.accept(ids[:, :prompt_len], first)
    eager.accept(ids[:, :prompt_len], first)
    length = prompt_len
    for k in chunks:
        path = list(range(k))
        result = VerifyResult(path=path, tokens=ids[0, length : length + k], score_nodes=path)
        h = hidden(length - 1, length - 1 + k)
        lazy.accept(ids[:, : length + k], result, h)
        eager.accept(ids[:, : length + k], result, h)
        length += k
    # The accepts were buffered: the lazy EAGLE drafter has not run a step since the prompt.
    assert lazy.model_drafter.steps < eager.steps == length - 1
    budget = DraftBudget(max_nodes=10, max_depth=4)
    a, b = lazy.propose(ids[:, :length], budget), eager.propose(ids[:, :length], budget)
    assert lazy.model_drafter.steps == length - 1 and lazy.options["model"] == 1
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    torch.testing.assert_close(a.scores, b.scores, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------- payoff predictor
def test_predictor_round_trips_through_save_and_load(tmp_path):
    from transformers import AutoModel

    torch.manual_seed(0)
    cfg = PayoffPredictorConfig(width=16, num_layers=2, feature_mean=[0.5] * len(FEATURE_NAMES),
                                feature_std=[2.0] * len(FEATURE_NAMES), drafters={"target": "tiny"},
                                training={"heldout_cache_mae": 1.25})
    model = PayoffPredictor(cfg).eval()
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "library_name: hf_hybrid_spec" in card and "heldout_cache_mae" in card and "base_model: tiny" in card
    loaded = PayoffPredictor.from_pretrained(tmp_path).eval()
    auto = AutoModel.from_pretrained(tmp_path).eval()
    x = torch.randn(5, len(FEATURE_NAMES))
    out = model.predict(x)
    assert out.shape == (5, 3) and bool((out >= 0).all())
    torch.testing.assert_close(loaded.predict(x), out)
    torch.testing.assert_close(auto.predict(x), out)
    # The per-step fast path (cache head alone) agrees with the full prediction.
    assert all(abs(loaded.predict_cache(x[i]) - float(out[i, 0])) < 1e-5 for i in range(5))
    assert all(abs(a - b) < 1e-5 for i in range(5) for a, b in zip(loaded.predict_one(x[i].tolist()), out[i].tolist()))
    with torch.no_grad():  # ...and follows in-place updates of the weights (an optimizer step)
        loaded.cache_head[0].weight.add_(0.25)
    assert abs(loaded.predict_cache(x[0]) - float(loaded.predict(x)[0, 0])) < 1e-5
    assert abs(loaded.predict_cache(x[0]) - float(out[0, 0])) > 1e-4
    # ...and a parameter replaced by a new one (not an in-place update)
    last = loaded.cache_head[-1]
    last.bias = torch.nn.Parameter(last.bias.detach() + 1.0)
    assert abs(loaded.predict_cache(x[0]) - float(loaded.predict(x)[0, 0])) < 1e-5
    assert loaded.config.feature_std == [2.0] * len(FEATURE_NAMES) and loaded.config.training == cfg.training
    labels = torch.tensor([[1.0, float("nan"), 2.0]] * 5)
    loss = model(x, labels=labels).loss
    loss.backward()
    assert loss.item() > 0 and model.cache_head[0].weight.grad is not None


@pytest.mark.parametrize("num_layers", [1, 3])
def test_host_predictions_match_the_model_at_any_depth(num_layers):
    """`predict_cache` / `predict_one` (numpy, normalization folded in) agree with `predict` (torch) for other MLP
    depths and a cache head over a subset of the features."""
    torch.manual_seed(num_layers)
    cfg = PayoffPredictorConfig(width=8, num_layers=num_layers, cache_features=list(CACHE_FEATURES[:5]),
                                feature_mean=[0.3] * len(FEATURE_NAMES), feature_std=[1.7] * len(FEATURE_NAMES))
    model = PayoffPredictor(cfg).eval()
    x = torch.randn(4, len(FEATURE_NAMES)) * 5
    out = model.predict(x)
    for i in range(4):
        assert model.predict_one(x[i].tolist()) == pytest.approx(out[i].tolist(), abs=1e-5)
        assert model.predict_cache(x[i]) == pytest.approx(float(out[i, 0]), abs=1e-5)


def test_predictor_config_rejects_bad_values():
    with pytest.raises(ValueError, match="known before the model"):
        PayoffPredictorConfig(cache_features=["model_expected"])
    with pytest.raises(ValueError):
        PayoffPredictorConfig(feature_std=[0.0] * len(FEATURE_NAMES))
    with pytest.raises(ValueError):
        PayoffPredictorConfig(width=0)
    with pytest.raises(ValueError, match=r"\[B, "):
        PayoffPredictor(PayoffPredictorConfig())(torch.zeros(2, 3))


# ---------------------------------------------------------------------- bad input
def test_hvd_without_a_model_drafter_is_a_clear_error():
    target = tiny_model("qwen3_5_text")
    cfg = H.AssistantConfig(drafter="hvd", hvd_policy="threshold")
    with pytest.raises(ValueError, match="needs a model drafter: pass draft_model="):
        target.generate(repeating_prompt(), max_new_tokens=4, custom_generate=H.speculative_generate,
                        assistant_config=cfg)
    with pytest.raises(ValueError, match="needs hvd_predictor="):
        H.AssistantConfig(drafter="hvd")
    with pytest.raises(ValueError, match="benchmark-only"):
        H.AssistantConfig(drafter="hvd", hvd_policy="oracle")
    for bad in (dict(hvd_model_tokens=0), dict(hvd_threshold=-1.0), dict(hvd_merge="yes"), dict(hvd_predictor=3),
                dict(hvd_probe_budget=1.5), dict(hvd_probe_budget=True)):
        with pytest.raises(ValueError):
            H.AssistantConfig(drafter="hvd", hvd_policy="threshold", **bad)
    with pytest.raises(TypeError):
        make_model_drafter(H.AssistantConfig(), target, "not a model")
    cfg = H.AssistantConfig(drafter="hvd", hvd_policy="threshold", hvd_cost_profile="x.json")
    assert H.AssistantConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="CostProfile"):
        drafter = HybridDrafter(SuffixDrafter(use_global=False), ScriptedDrafter(repeating_prompt(), [1]),
                                LearnedPolicy(PayoffPredictor(PayoffPredictorConfig())))
        spec(target, repeating_prompt(), 4, drafter=drafter)


# ---------------------------------------------------------------------- merging, payoffs, costs
def test_merge_is_the_union_of_root_paths():
    a = DraftTree(tokens=torch.tensor([[5, 6, 7, 8]]), parents=torch.tensor([[-1, 0, 0, -1]]),
                  scores=torch.tensor([[0.9, 0.5, 0.3, 0.1]]))
    b = DraftTree(tokens=torch.tensor([[5, 6, 9, 4]]), parents=torch.tensor([[-1, 0, 1, -1]]),
                  scores=torch.tensor([[0.8, 0.7, 0.6, 0.2]]))
    m = merge_drafts(a, b, max_nodes=10)
    paths = set()
    for j in range(m.tree.num_nodes):
        path, cur = [], j
        while cur >= 0:
            path.append(int(m.tree.tokens[0, cur]))
            cur = int(m.tree.parents[0, cur])
        paths.add(tuple(reversed(path)))
    assert paths == {(5,), (5, 6), (5, 7), (8,), (5, 6, 9), (4,)}
    assert m.shared == 2 and m.tree.num_nodes == 6
    assert m.tree.scores[0].tolist()[:2] == pytest.approx([0.9, 0.7])
    for cont in ([5, 6, 9, 1], [5, 7, 1], [8, 1], [3]):
        assert realized_payoff(m.tree, cont) == max(realized_payoff(a, cont), realized_payoff(b, cont))
    trimmed = merge_drafts(a, b, max_nodes=3)
    assert trimmed.tree.num_nodes == 3 and [tuple(x) for x in trimmed.tree.parents.tolist()] == [(-1, 0, 1)]
    assert merge_drafts(empty_draft(), empty_draft(), 4).tree.num_nodes == 0


def test_cost_profile_interpolates_and_round_trips(tmp_path):
    assert COST.verify(1) == 1.0 and COST.verify(20) == pytest.approx(1.35) and COST.verify(64) > 1.6
    assert COST.step(7, model_ran=True) == pytest.approx(0.41 + 1.1)
    COST.save(tmp_path / "c.json")
    assert CostProfile.load(tmp_path / "c.json") == COST
    with pytest.raises(ValueError):
        CostProfile(tree_sizes=[8, 1], verify_seconds=[1.0, 1.0], cache_draft_seconds=0, model_draft_seconds=0)


def test_profile_costs_through_the_loop():
    target = tiny_model("qwen3_5_text")
    eagle = EagleDrafter.from_target(target, draft_vocab_size=VOCAB)
    profile = profile_costs(target, SuffixDrafter(use_global=False), EagleTreeDrafter(eagle, target, top_k=2),
                            model_tokens=6, model_depth=3, max_depth=6, tree_sizes=(1, 4, 12), context_tokens=24,
                            repeats=1)
    assert profile.tree_sizes == [1, 4, 12]
    assert all(s > 0 for s in profile.verify_seconds) and profile.verify_seconds == sorted(profile.verify_seconds)
    assert profile.model_draft_seconds > 0 and profile.cache_draft_seconds >= 0
    # The begin, timed over two context lengths: a fixed part and a per-token part, together the measured begin.
    assert profile.model_begin_seconds >= 0 and profile.model_begin_seconds_per_token >= 0
    assert profile.model_begin(24) > 0 and profile.model_begin(240) >= profile.model_begin(24)
    # The model drafter's accepts: one step's, and a catch-up over CATCH_UP_TOKENS at once (HVD's, after it sat out;
    # its size is checked with a drafter of known costs below).
    assert profile.model_accept_seconds > 0 and profile.model_catch_up_seconds >= 0
    for skipped, extra in ((0, profile.model_accept_seconds), (5, profile.model_catch_up_seconds)):
        assert profile.model_overhead(True, skipped, 24) == extra
    assert profile.model_overhead(False, 0, 24) == profile.model_begin(24) + profile.model_catch_up_seconds
    new_fields = ("model_begin_seconds", "model_accept_seconds", "model_catch_up_seconds")
    old = CostProfile.from_dict({k: v for k, v in profile.to_dict().items() if k not in new_fields})
    # A profile saved before these were measured still loads, and prices the model drafter's draft alone.
    assert old.model_begin_seconds == 0.0 and old.model_overhead(True, 5, 24) == 0.0
    with pytest.raises(ValueError, match="profiled seconds"):
        CostProfile.from_dict({**profile.to_dict(), "model_catch_up_seconds": -1.0})


class _Clock:
    """A clock that moves 1 us a read and otherwise only when told to: the profile's timings come out the same
    whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


class _SleepyDrafter(Drafter):
    """Proposes nothing; costs 1 ms of `clock` per committed token it hears of, in `accept` (as EAGLE's accept pass)
    or, `lazy`, in its next `propose` (as the assistant-model drafter feeds the tokens it missed)."""

    def __init__(self, lazy: bool, clock: _Clock):
        self.lazy, self.seen, self.clock = lazy, 0, clock

    def begin(self, input_ids, context=None, hidden=None):
        self.seen = input_ids.shape[1]

    def _feed(self, input_ids):
        self.clock.now += 1e-3 * (input_ids.shape[1] - self.seen)
        self.seen = input_ids.shape[1]

    def accept(self, input_ids, result, hidden=None):
        if not self.lazy:
            self._feed(input_ids)

    def propose(self, input_ids, budget):
        if self.lazy:
            self._feed(input_ids)
        return empty_draft()


@pytest.mark.parametrize("lazy", [False, True])
def test_profile_prices_the_model_drafters_catch_up(lazy):
    # 23 tokens at once (the 24-token context's catch-up) against one per profiled step (random trees are rejected:
    # each step commits one token), whether the drafter pays for them in accept or in its next propose.
    clock = _Clock()
    profile = profile_costs(tiny_model("qwen3_5_text"), SuffixDrafter(use_global=False), _SleepyDrafter(lazy, clock),
                            model_tokens=6, model_depth=3, max_depth=6, tree_sizes=(1, 4), context_tokens=24,
                            repeats=2, clock=clock)
    per_step = profile.model_draft_seconds if lazy else profile.model_accept_seconds
    assert per_step == pytest.approx(1e-3, abs=1e-5)
    # The catch-up's draft is its own step's (1 ms, lazy) and taken off: the 23 tokens' feed is left.
    assert profile.model_catch_up_seconds == pytest.approx(23e-3 - (1e-3 if lazy else 0.0), abs=1e-5)
    assert profile.model_overhead(True, 3, 24) == profile.model_catch_up_seconds


# ---------------------------------------------------------------------- workloads and metrics
def test_workload_suite_is_built_and_split():
    suite = load_suite(REPO_ROOT / "benchmarks" / "workloads.json")
    sizes = suite.sizes()
    assert set(sizes) == set(WORKLOADS)
    for workload in WORKLOADS:
        assert sizes[workload]["heldout"]["sessions"] >= 4 and sizes[workload]["train"]["sessions"] >= 12
    for session in suite.select(AGENTIC, "heldout"):
        assert session.num_calls >= 2
        prompt = session.prompt(1, ["<first output>"])
        assert prompt.startswith(session.texts[0]) and "<first output>" in prompt
    text = "".join(t for s in suite.sessions for t in s.texts)
    assert not any(bad in text for bad in ("networkx", "sympy", "pandas"))
    with pytest.raises(ValueError):
        suite.sessions[0].prompt(1, [])


def test_workload_builder_needs_bfcl(monkeypatch):
    import builtins

    import workloads

    real_import = builtins.__import__

    def no_bfcl(name, *args, **kwargs):
        if name == "bfcl_eval":
            raise ImportError("no bfcl_eval")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bfcl)
    with pytest.raises(ImportError, match="pip install --no-deps bfcl-eval"):
        workloads.build_suite()


def test_metrics():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x * 3) == pytest.approx(1.0) and spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(0.866, abs=1e-3)
    m = payoff_metrics(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1.0, 3.0, float("nan")]))
    assert m.count == 2 and m.mae == pytest.approx(0.5) and m.mae_constant == pytest.approx(1.0)


def test_paired_speed_ratio_separates_a_real_difference_from_noise():
    from hf_hybrid_spec.hvd.metrics import paired_speed_ratio

    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(40, generator=g) * 3 + 0.5).tolist()  # calls of very different lengths
    noisy = [x * (1 + 0.05 * float(torch.randn(1, generator=g))) for x in lengths]
    same = paired_speed_ratio(noisy, lengths)  # identical work, 5% noise per call
    assert same.low < 1.0 < same.high and same.calls == 40
    faster = paired_speed_ratio([x / 1.10 for x in noisy], lengths)  # 10% faster on every call
    assert 1.0 < faster.low < faster.ratio < faster.high and faster.ratio == pytest.approx(1.10 * same.ratio)
    assert str(faster).startswith(f"{faster.ratio:.3f} (")
    with pytest.raises(ValueError, match="same"):
        paired_speed_ratio([1.0], [1.0, 2.0])



# ---------------------------------------------------------------------- policy decisions
class FixedPredictor:
    """Predicts the given payoffs (cache, model, merged) whatever the features."""

    def __init__(self, payoffs):
        self.payoffs = torch.tensor(payoffs)

    def predict(self, features):
        return self.payoffs


def policy_step(cache, model=None, history=None, cost=COST):
    from hf_hybrid_spec.hvd import History
    from hf_hybrid_spec.hvd.policy import Step

    step = Step(cache=cache, features=[0.0] * len(FEATURE_NAMES), history=history or History(model_prior=1.0),
                cost=cost, budget=DraftBudget(max_nodes=16, max_depth=8), model_tokens=8, length=10)
    if model is not None:
        step.model, step.merged = model, merge_drafts(cache, model, 16)
    return step


def test_learned_policy_weighs_predicted_payoff_against_cost():
    from hf_hybrid_spec.hvd import History

    cache = chain_tree(torch.tensor([[5, 6, 7, 8]]))
    model = chain_tree(torch.tensor([[5, 9]]))
    # Cache: (3 + 1) / (0.01 + 1.1) tokens/s beats the model's recent 1 token at 0.41 + 1.1 s: skip the model.
    assert LearnedPolicy(FixedPredictor([3.0, 0.0, 0.0])).before_model(policy_step(cache)) == "cache"
    # A weak cache draft against a model drafter that delivered 3 tokens lately: run the model drafter.
    strong_model = History(model_prior=3.0)
    assert LearnedPolicy(FixedPredictor([0.2, 0.0, 0.0])).before_model(policy_step(cache, history=strong_model)) is None
    # Whatever the prediction, the model drafter runs after `probe_interval` steps without it.
    stale = History(model_prior=0.0)
    stale.steps_since_model = 4
    probing = LearnedPolicy(FixedPredictor([3.0, 0, 0]), probe_interval=4, probe_budget=1.0)
    assert probing.before_model(policy_step(cache, history=stale)) is None
    # ...unless a probe would cost more than its budget: 0.4 s of model drafting > 5% of 4 skipped ~1.07 s steps.
    thrifty = LearnedPolicy(FixedPredictor([3.0, 0, 0]), probe_interval=4, probe_budget=0.05)
    assert thrifty.before_model(policy_step(cache, history=stale)) == "cache"
    stale.steps_since_model = 8  # 0.4 s <= 5% of 8 x ~1.07 s
    assert thrifty.before_model(policy_step(cache, history=stale)) is None
    # ...and only where the model drafter could win at all: a cache draft predicted at 8 tokens per ~1.07 s step
    # beats even a model draft accepted to its full depth (8 + 1 tokens in 1.1 + 0.4 s) or a full-depth merged tree.
    confident = LearnedPolicy(FixedPredictor([8.0, 0, 0]), probe_interval=4, probe_budget=1.0)
    assert confident.before_model(policy_step(cache, history=stale)) == "cache"
    assert stale.steps_since_model == 8  # still due: the next weak cache draft gets the probe
    assert LearnedPolicy(FixedPredictor([4.0, 0, 0]), probe_interval=4,
                         probe_budget=1.0).before_model(policy_step(cache, history=stale)) is None
    # A declined probe is asked again (which needs a prediction) only `probe_recheck` steps later; in between the
    # memo decides (the model drafter's EMA is 0 here: the cache draft wins at any payoff).
    counted = CountingPredictor([8.0, 0, 0])
    rechecking = LearnedPolicy(counted, probe_interval=4, probe_budget=1.0, probe_recheck=3)
    rechecking.begin()
    for skipped, asked in ((8, True), (9, False), (10, False), (11, True), (12, False)):
        stale.steps_since_model = skipped
        step = policy_step(cache, history=stale)
        quick = rechecking.quick_cache(step.cache.num_nodes, stale, COST, step.budget, step.model_tokens,
                                       step.allow_merge, step.model_begun, step.length)
        calls = counted.calls
        assert quick != asked and (quick or rechecking.before_model(step) == "cache"), skipped
        assert counted.calls == calls + asked, skipped
    stale.steps_since_model = 4  # the model drafter ran since: the next due probe is asked at once
    assert not rechecking.quick_cache(cache.num_nodes, stale, COST, step.budget, step.model_tokens, True, True, 10)
    with pytest.raises(ValueError, match="probe_recheck"):
        LearnedPolicy(counted, probe_recheck=0)
    stale.steps_since_model = 8
    # A first probe in a request also pays the model drafter's begin over the context (10 tokens x 0.1 s here).
    with_begin = CostProfile(tree_sizes=[1, 8, 32], verify_seconds=[1.0, 1.1, 1.6], cache_draft_seconds=0.01,
                             model_draft_seconds=0.4, model_begin_seconds_per_token=0.1)
    unbegun = policy_step(cache, history=stale, cost=with_begin)
    unbegun.model_begun = False
    assert thrifty.before_model(unbegun) == "cache"
    unbegun.model_begun = True
    assert thrifty.before_model(unbegun) is None
    # Not only probes: a model drafter that would win on its recent payoff loses to the cache draft when its first
    # draft must also pay its begin over the context (10 tokens x 0.5 s).
    slow_begin = CostProfile(tree_sizes=[1, 8, 32], verify_seconds=[1.0, 1.1, 1.6], cache_draft_seconds=0.01,
                             model_draft_seconds=0.4, model_begin_seconds_per_token=0.5)
    tempting = policy_step(cache, history=strong_model, cost=slow_begin)
    assert LearnedPolicy(FixedPredictor([0.2, 0.0, 0.0])).before_model(tempting) is None
    tempting.model_begun = False
    assert LearnedPolicy(FixedPredictor([0.2, 0.0, 0.0])).before_model(tempting) == "cache"
    # The model drafter catches up before it drafts: cheap right after a step it drafted, an eager pass over many
    # tokens after steps it sat out (3 s here: the cache draft's 1.2 tokens per ~1.07 s step win then).
    catching_up = CostProfile(tree_sizes=[1, 8, 32], verify_seconds=[1.0, 1.1, 1.6], cache_draft_seconds=0.01,
                              model_draft_seconds=0.4, model_accept_seconds=0.1, model_catch_up_seconds=3.0)
    recent = History(model_prior=3.0)
    weak_cache = LearnedPolicy(FixedPredictor([0.2, 0.0, 0.0]))
    assert weak_cache.before_model(policy_step(cache, history=recent, cost=catching_up)) is None
    recent.steps_since_model = 3
    assert weak_cache.before_model(policy_step(cache, history=recent, cost=catching_up)) == "cache"
    # With no cache draft and a model drafter that brings nothing, verifying the root alone is cheapest.
    assert LearnedPolicy(FixedPredictor([0.0, 0, 0])).before_model(
        policy_step(empty_draft(), history=History(model_prior=0.0))) == "cache"
    # Stage 2: the model has run; a merged tree's payoff is never below its parts'.
    assert LearnedPolicy(FixedPredictor([1.0, 2.0, 0.5])).choose(policy_step(cache, model)) == "model"
    policy = LearnedPolicy(FixedPredictor([1.0, 2.0, 3.0]))
    assert policy.choose(policy_step(cache, model)) == "merged" and policy.predicted == [1.0, 2.0, 3.0]
    expensive = CostProfile(tree_sizes=[1, 4, 8], verify_seconds=[1.0, 1.0, 9.0], cache_draft_seconds=0.0,
                            model_draft_seconds=0.0)
    assert policy.choose(policy_step(cache, model, cost=expensive)) == "model"


def test_oracle_picks_the_best_realized_rate():
    cache = chain_tree(torch.tensor([[5, 6, 7, 8]]))
    model = chain_tree(torch.tensor([[5, 9]]))
    reference = list(range(10)) + [5, 6, 7, 1, 1]  # the committed sequence has 10 tokens; then the continuation
    oracle = OraclePolicy(reference)
    assert oracle.choose(policy_step(cache, model)) == "cache" and oracle.predicted == [3.0, 1.0, 3.0]
    reference = list(range(10)) + [5, 9, 1]
    oracle = OraclePolicy(reference)
    # The model's 2 tokens against the cache's 1: the merged tree holds both at the model's cost and 5 nodes.
    assert oracle.choose(policy_step(cache, model)) in ("model", "merged") and oracle.predicted[1] == 2.0
    assert oracle.decisions == [oracle.decisions[0]]
    # The model drafter's begin (10 tokens x 0.5 s here) is charged to the first step that would use it, whatever
    # its recording pass did: then the cache draft's 1 token is worth more; once a decision used the model drafter,
    # its later steps pay no begin.
    slow_begin = CostProfile(tree_sizes=[1, 8, 32], verify_seconds=[1.0, 1.1, 1.6], cache_draft_seconds=0.01,
                             model_draft_seconds=0.4, model_begin_seconds_per_token=0.5)
    fresh = OraclePolicy(reference)
    assert fresh.choose(policy_step(cache, model, cost=slow_begin)) == "cache"
    assert fresh.choose(policy_step(cache, model)) in ("model", "merged")
    assert fresh.choose(policy_step(cache, model, cost=slow_begin)) in ("model", "merged")


class CountingPredictor(FixedPredictor):
    def __init__(self, payoffs):
        super().__init__(payoffs)
        self.calls = 0

    def predict(self, features):
        self.calls += 1
        return self.payoffs


def reference_before_model(step, cache_payoff, cost, probe_interval=16, probe_budget=0.0):
    """The stage-1 rule with the cache payoff always predicted (no short-circuit), clamped at 0 like the policy;
    probes as a fresh policy sees them (none declined before)."""
    cache_payoff = max(cache_payoff, 0.0) if step.cache.num_nodes else 0.0
    skipped = step.history.steps_since_model
    # Before it drafts, the model drafter accepts what was committed since it last drafted (and begins, the first time).
    if step.model_begun:
        overhead = cost.model_accept_seconds if skipped == 0 else cost.model_catch_up_seconds
    else:
        overhead = (cost.model_begin_seconds + cost.model_begin_seconds_per_token * step.length
                    + cost.model_catch_up_seconds)
    rate = lambda payoff, seconds: (payoff + 1.0) / seconds  # noqa: E731
    mp = step.history.model_payoff_ema
    model_seconds = cost.step(step.model_tokens, True) + overhead
    nodes = min(step.budget.max_nodes, step.cache.num_nodes + step.model_tokens)
    merged_seconds = cost.step(nodes, True) + overhead
    cache_rate = rate(cache_payoff, cost.step(step.cache.num_nodes, False))
    if skipped >= probe_interval and probe_budget > 0 and \
            cost.model_draft_seconds + overhead <= probe_budget * skipped * cost.step(step.cache.num_nodes, False):
        depth = step.budget.max_depth
        ceiling = max(rate(min(step.model_tokens, depth), model_seconds), rate(depth, merged_seconds))
        return "cache" if cache_rate >= ceiling else None
    best = max(rate(mp, model_seconds), rate(max(cache_payoff, mp), merged_seconds))
    return "cache" if cache_rate >= best else None


def test_learned_policy_skips_the_predictor_only_where_no_prediction_could_change_the_choice():
    from hf_hybrid_spec.hvd import History

    gen = torch.Generator().manual_seed(0)
    skipped = predicted = 0
    for trial in range(600):
        u = torch.rand(12, generator=gen).tolist()
        # Verify costs that are not monotone in the tree size either (profiles are measured, so noisy).
        cost = CostProfile(tree_sizes=[1, 8, 32], verify_seconds=[1.0, 1.0 + u[0] - 0.3, 1.2 + u[1]],
                           cache_draft_seconds=0.01, model_draft_seconds=2.0 * u[2],
                           model_begin_seconds_per_token=0.05 * u[3], model_begin_seconds=u[3],
                           model_accept_seconds=0.3 * u[10], model_catch_up_seconds=0.3 * u[10] + u[11])
        n = int(u[4] * 14)
        cache = chain_tree(torch.arange(5, 5 + n).unsqueeze(0)) if n else empty_draft()
        step = policy_step(cache, history=History(model_prior=4.0 * u[5]), cost=cost)
        step.model_begun = u[6] < 0.5
        # Probes too: due after 4 skipped steps, within a budget that some of these step counts fill.
        step.history.steps_since_model = int(u[8] * 40) if u[8] > 0.2 else 0  # 0: it drafted the step before
        probe_budget = 0.0 if u[9] < 0.3 else 0.05 + 0.2 * u[9]
        payoff = 6.0 * u[7] - 1.0  # a regression may predict below 0
        features = [0.0] * len(FEATURE_NAMES)
        step.features, step.feature_fn = None, lambda: features
        predictor = CountingPredictor([payoff, 0.0, 0.0])
        policy = LearnedPolicy(predictor, probe_interval=4, probe_budget=probe_budget)
        quick = policy.quick_cache(n, step.history, cost, step.budget, step.model_tokens, step.allow_merge,
                                   step.model_begun, step.length)
        choice = policy.before_model(step)
        assert choice == reference_before_model(step, payoff, cost, 4, probe_budget), trial
        # The memoized fast path (HVD skips building the Step) says "cache" exactly where no prediction is needed,
        # except before a begin whose cost grows with the context (not memoized: it defers to before_model).
        per_token_begin = not step.model_begun and cost.model_begin_seconds_per_token > 0
        assert quick == (choice == "cache" and predictor.calls == 0 and not per_token_begin), trial
        if predictor.calls == 0 and n:
            skipped += 1
            assert choice == "cache" and step.features is None  # neither the features nor the prediction was paid
        elif n:
            predicted += 1
    assert skipped > 20 and predicted > 20, (skipped, predicted)


class SlowPathPolicy(LearnedPolicy):
    """`LearnedPolicy` without its fast path: every step goes through a `Step` and `before_model`."""

    def quick_cache(self, *args) -> bool:
        return False


class CountingQuick(LearnedPolicy):
    def begin(self):
        super().begin()
        self.quick = 0

    def quick_cache(self, *args) -> bool:
        wins = super().quick_cache(*args)
        self.quick += wins
        return wins


def test_hvd_fast_path_decides_and_settles_as_the_full_policy(saved_predictor):
    target = tiny_model("qwen3_5_text")
    torch.manual_seed(1)
    eagle = EagleDrafter.from_target(target, draft_vocab_size=VOCAB)
    ids = repeating_prompt()
    ref = plain(target, ids, 40)
    predictor = PayoffPredictor.from_pretrained(saved_predictor)
    loop = H.AssistantConfig(max_draft_tokens=16, max_depth=8)
    runs = []
    # The fast path settles its steps' cache payoffs in `overlap` (the loop calls it while the verify forward runs),
    # or, where no caller does, before anything reads the history: the same history either way.
    no_overlap = type("NoOverlap", (HybridDrafter,), {"overlap": lambda self: None})
    for policy, cls in ((CountingQuick(predictor, probe_interval=3), HybridDrafter),
                        (CountingQuick(predictor, probe_interval=3), no_overlap),
                        (SlowPathPolicy(predictor, probe_interval=3), HybridDrafter)):
        drafter = hybrid(target, eagle, policy)
        drafter.__class__ = cls
        out = spec(target, ids, 40, assistant_config=loop, drafter=drafter)
        assert torch.equal(out.sequences, ref)
        runs.append((drafter.options, drafter.model_runs, out.spec_stats.accepted_lengths, drafter.history))
    assert runs[0] == runs[1] == runs[2]
    # Both paths were taken: steps decided by the memo, and steps that ran the model drafter.
    fast_policy = CountingQuick(predictor, probe_interval=3)
    drafter = hybrid(target, eagle, fast_policy)
    spec(target, ids, 40, assistant_config=loop, drafter=drafter)
    assert 0 < fast_policy.quick < sum(drafter.options.values()) and drafter.model_runs > 0, fast_policy.quick


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_a_batch_chooses_per_row_and_matches_plain_greedy(family, compile_, saved_predictor):
    """B = 3 left-padded rows, one HVD drafter per row (each its own cache drafter, model drafter and history) under
    each policy: every row stock's; given as one instance per row, each decides on its own row (the repeating rows
    take cache drafts)."""
    from engine.test_batch import greedy

    target = tiny_model(family)
    torch.manual_seed(1)
    eagle = EagleDrafter.from_target(target, draft_vocab_size=VOCAB)
    rows = [repeating_prompt()[0], torch.randint(3, VOCAB, (17,), generator=torch.Generator().manual_seed(2)),
            repeating_prompt()[0, :9]]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.full((width - len(r),), 1), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), torch.ones(len(r), dtype=torch.long)])
                        for r in rows])
    ref = greedy(target, ids, mask, max_new_tokens=24, eos_token_id=None)
    base = dict(drafter="hvd", max_draft_tokens=16, max_depth=8, draft_top_k=3, hvd_model_tokens=8,
                hvd_model_depth=4, global_cache=False, compile=compile_)
    for cfg in (H.AssistantConfig(hvd_policy="threshold", hvd_threshold=1.5, **base),
                H.AssistantConfig(hvd_policy="learned", hvd_predictor=str(saved_predictor),
                                  hvd_cost_profile=str(saved_predictor / "cost.json"), **base)):
        out = greedy(target, ids, mask, max_new_tokens=24, eos_token_id=None, custom_generate=H.speculative_generate,
                     assistant_config=cfg, draft_model=eagle, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), cfg.hvd_policy
        assert out.spec_stats.mean_accepted_length > 1.0
    # One instance per row given directly: each decided on its own row (the repeating rows took cache drafts).
    drafters = [hybrid(target, eagle, ThresholdPolicy(1.5)) for _ in rows]
    out = greedy(target, ids, mask, max_new_tokens=24, eos_token_id=None, custom_generate=H.speculative_generate,
                 assistant_config=H.AssistantConfig(max_draft_tokens=16, max_depth=8, compile=compile_),
                 drafter=drafters)
    assert torch.equal(out, ref)
    assert all(sum(d.options.values()) > 0 for d in drafters)
    assert drafters[0].options["cache"] > 0 and drafters[2].options["cache"] > 0
