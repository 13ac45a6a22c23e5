"""CoSpec and the training-free lossy rules: exactness at both ends, the rules, the arbiter model, the recipe.

- verification="lossless" is untouched: greedy identity with plain generate, no arbiter counts.
- An arbiter that never keeps the draft's token reproduces lossless greedy output exactly; one that always keeps
  it reproduces the draft model's own plain greedy output exactly (first token and last token of every step
  included), on tiny configs and on the fixtures, chains and trees.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_fixture

import hf_hybrid_spec as H
from hf_hybrid_spec.cospec import (
    ConstantArbiter,
    CoSpecArbiter,
    CoSpecArbiterConfig,
    FlyGate,
    Mismatch,
    SamplingArbiter,
    TypicalAcceptance,
)
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DraftTree, build_verify_tree
from hf_hybrid_spec.verification.arbitrated import verify_arbitrated

REPO = Path(__file__).resolve().parents[2]
PAIRS = [("qwen3_5_text", "falcon_h1"), ("falcon_h1", "qwen3_5_text")]


def _prompt(length, seed=0, vocab=96):
    return torch.randint(2, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def _spec(target, draft, ids, max_new_tokens, **cfg):
    cfg = {"drafter": "model", "max_depth": 4, "max_draft_tokens": 8, **cfg}
    return target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                           custom_generate=H.speculative_generate, draft_model=draft,
                           assistant_config=H.AssistantConfig(**cfg), return_dict_in_generate=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_pairs():
    return {(t, d): (tiny_model(t), tiny_model(d, seed=7)) for t, d in PAIRS}


# ---------------------------------------------------------------------------------------------------- exactness
@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-by-{p[1]}")
@pytest.mark.parametrize("top_k", [1, 2])
def test_constant_arbiters_reproduce_both_endpoints(tiny_pairs, pair, top_k):
    target, draft = tiny_pairs[pair]
    for length in (11, 1):
        ids = _prompt(length, seed=length)
        ref_target = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None)
        ref_draft = draft.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=None)
        assert not torch.equal(ref_target, ref_draft)
        lossless = _spec(target, draft, ids, 30, draft_top_k=top_k)
        assert torch.equal(lossless.sequences, ref_target)
        assert lossless.spec_stats.arbiter_decisions == lossless.spec_stats.arbiter_overrides == 0
        reject = _spec(target, draft, ids, 30, draft_top_k=top_k, verification="cospec",
                       arbiter=ConstantArbiter(False))
        assert torch.equal(reject.sequences, ref_target)
        assert reject.spec_stats.arbiter_decisions > 0 and reject.spec_stats.arbiter_overrides == 0
        accept = _spec(target, draft, ids, 30, draft_top_k=top_k, verification="cospec",
                       arbiter=ConstantArbiter(True))
        assert torch.equal(accept.sequences, ref_draft)
        stats = accept.spec_stats
        assert stats.arbiter_overrides == stats.arbiter_decisions > 0
        # Every committed token is the draft's, so a step commits its whole path plus the draft's next token.
        assert stats.mean_accepted_length > lossless.spec_stats.mean_accepted_length


@pytest.mark.slow
@pytest.mark.fixture
@pytest.mark.parametrize("names", [("qwen3_5-small", "falcon_h1-small"), ("falcon_h1-small", "qwen3_5-small")],
                         ids=lambda n: f"{n[0]}-by-{n[1]}")
def test_constant_arbiters_on_fixtures(names):
    target, tok = load_fixture(names[0])
    draft, _ = load_fixture(names[1])
    text = "import numpy as np\n\n\ndef moving_average(values, window):\n    kernel = np.ones(window)"
    ids = tok(text, return_tensors="pt").input_ids
    ref_target = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    ref_draft = draft.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    assert not torch.equal(ref_target, ref_draft)
    for top_k, depth in ((1, 5), (2, 3)):
        reject = _spec(target, draft, ids, 24, draft_top_k=top_k, max_depth=depth, verification="cospec",
                       arbiter=ConstantArbiter(False))
        assert torch.equal(reject.sequences, ref_target), f"top_k={top_k}"
        accept = _spec(target, draft, ids, 24, draft_top_k=top_k, max_depth=depth, verification="cospec",
                       arbiter=ConstantArbiter(True))
        assert torch.equal(accept.sequences, ref_draft), f"top_k={top_k}"
        assert accept.spec_stats.arbiter_overrides > 0


def test_training_free_rules_run_end_to_end(tiny_pairs):
    target, draft = tiny_pairs[PAIRS[0]]
    ids = _prompt(11)
    ref = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    # A window longer than any draft can never be confirmed: FLy then keeps every target token.
    never = _spec(target, draft, ids, 24, verification="fly", fly_window=6, fly_entropy_threshold=0.0)
    assert torch.equal(never.sequences, ref) and never.spec_stats.arbiter_overrides == 0
    for cfg in (dict(verification="typical", typical_epsilon=1e-6, typical_delta=1e-6),
                dict(verification="fly", fly_window=1, fly_entropy_threshold=0.0)):
        out = _spec(target, draft, ids, 24, **cfg)
        assert out.spec_stats.arbiter_overrides > 0, cfg
        assert not torch.equal(out.sequences, ref)
    # The rules work with drafters that report no distributions (the draft's choice is then the first child).
    out = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None,
                          custom_generate=H.speculative_generate,
                          assistant_config=H.AssistantConfig(drafter="suffix", verification="fly"))
    assert out.shape[1] == ids.shape[1] + 24


# ---------------------------------------------------------------------------------------------------- rules
def _chain_case():
    """Root -> a(5) -> b(6) -> c(7); the target wants 9 at the root, then 6 after a, then 7 after b."""
    v = 16
    draft = DraftTree(tokens=torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 0, 1]]),
                      next_probs=torch.nn.functional.one_hot(torch.tensor([[5, 6, 7, 8]]), v).float())
    tree = build_verify_tree(torch.tensor([3]), draft)
    scores = torch.full((4, v), -5.0)
    for node, tok in enumerate([9, 6, 7, 2]):
        scores[node, tok] = 5.0
    scores[0, 5] = 4.0  # the target finds the draft's 5 almost as good as its 9 (high entropy at the root)
    return tree, scores


class _Recorder(ConstantArbiter):
    def __init__(self, accept):
        super().__init__(accept)
        self.seen = []

    def decide(self, mismatch):
        self.seen.append(mismatch)
        return super().decide(mismatch)


def test_verify_arbitrated_walks_the_kept_token():
    tree, scores = _chain_case()
    rec = _Recorder(False)
    out = verify_arbitrated(tree, scores, rec, length=10)
    assert out.path == [0] and out.tokens.tolist() == [9] and out.decisions == 1 and out.overrides == 0
    m = rec.seen[0]
    assert (m.node, m.depth, m.position, m.draft_token, m.target_token) == (0, 0, 10, 5, 9)
    assert m.draft_continues and m.agreement_below == 2  # the target accepts 6 and 7 after 5
    rec = _Recorder(True)
    out = verify_arbitrated(tree, scores, rec, length=10)
    # Keep 5, accept 6 and 7 exactly, then the leaf: the draft wants 8, the target 2: kept 8.
    assert out.path == [0, 1, 2, 3] and out.tokens.tolist() == [5, 6, 7, 8]
    assert out.decisions == out.overrides == 2
    assert not rec.seen[1].draft_continues and rec.seen[1].position == 13


def test_fly_gate_and_typical_acceptance():
    tree, scores = _chain_case()
    assert verify_arbitrated(tree, scores, FlyGate(0.3, window=3), 10).tokens.tolist()[:3] == [5, 6, 7]
    assert verify_arbitrated(tree, scores, FlyGate(0.3, window=4), 10).tokens.tolist() == [9]  # window too long
    assert verify_arbitrated(tree, scores, FlyGate(5.0, window=3), 10).tokens.tolist() == [9]  # target too sure
    logits = torch.tensor([2.0, 1.5, -3.0, -3.0])
    m = Mismatch(node=0, depth=0, position=0, draft_token=1, target_token=0, target_logits=logits, draft_probs=None,
                 draft_continues=False, agreement_below=0)
    p = torch.softmax(logits / 0.7, -1)
    h = float(-(p * p.log()).sum())
    expect = float(p[1]) > min(0.09, 0.3 * math.exp(-h))
    assert TypicalAcceptance().decide(m) == expect
    assert TypicalAcceptance(epsilon=0.99, delta=10.0).decide(m) is False


# ---------------------------------------------------------------------------------------------------- arbiter model
@pytest.mark.parametrize("hidden", [0, 64])
def test_arbiter_save_load_round_trip(tmp_path, hidden, tiny_pairs):
    from transformers import AutoModel

    arb = CoSpecArbiter(CoSpecArbiterConfig(target_hidden_size=hidden, width=16,
                                            training_summary={"target": "t", "steps": 3}))
    with torch.no_grad():
        for p in arb.parameters():
            p.add_(torch.randn_like(p))
    arb.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable as the umask (022) asks
    card = (tmp_path / "README.md").read_text()
    assert "library_name: hf_hybrid_spec" in card and "| steps | 3 |" in card
    for loaded in (CoSpecArbiter.from_pretrained(tmp_path), AutoModel.from_pretrained(tmp_path)):
        assert isinstance(loaded, CoSpecArbiter)
        saved, back = arb.state_dict(), loaded.state_dict()
        assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
        x = torch.randn(5, len(loaded.config.features))
        hid = torch.randn(5, hidden) if hidden else None
        # Same weights, not always bit-identical outputs: newer transformers (5.24 here) keep loaded weights as views
        # of the mapped file, not 64-byte aligned, and the CPU GEMM rounds differently there (1 ulp seen).
        torch.testing.assert_close(loaded(x, hid), arb(x, hid), rtol=1e-6, atol=1e-6)
    # In generate, by path or by instance; the config serializes an instance by the path it came from.
    target, draft = tiny_pairs[PAIRS[0]]
    ids = _prompt(9)
    by_path = _spec(target, draft, ids, 12, verification="cospec", arbiter=str(tmp_path))
    cfg = H.AssistantConfig(drafter="model", verification="cospec", arbiter=loaded)
    assert H.AssistantConfig.from_dict(cfg.to_dict()).arbiter == str(tmp_path)
    by_instance = _spec(target, draft, ids, 12, verification="cospec", arbiter=loaded)
    assert torch.equal(by_path.sequences, by_instance.sequences)
    assert by_path.spec_stats.arbiter_decisions > 0


def test_sampling_arbiter_records_decisions(tiny_pairs):
    target, draft = tiny_pairs[PAIRS[0]]
    arb = CoSpecArbiter(CoSpecArbiterConfig(target_hidden_size=64, init_accept_prob=0.5))
    policy = SamplingArbiter(arb, torch.Generator().manual_seed(0))
    ids = _prompt(9)
    out = _spec(target, draft, ids, 16, verification="cospec", arbiter=policy)
    stats = out.spec_stats
    assert len(policy.decisions) == stats.arbiter_decisions > 0
    assert sum(d.accept for d in policy.decisions) == stats.arbiter_overrides
    positions = [d.position for d in policy.decisions]
    assert positions == sorted(positions) and positions[0] >= ids.shape[1]
    assert all(d.hidden.shape == (64,) for d in policy.decisions)
    from hf_hybrid_spec.cospec import decision_log_probs

    torch.testing.assert_close(decision_log_probs(arb, policy.decisions),
                               torch.tensor([d.log_prob for d in policy.decisions]))


def test_bad_configurations_are_refused(tiny_pairs):
    target, draft = tiny_pairs[PAIRS[0]]
    with pytest.raises(ValueError, match="needs arbiter"):
        H.AssistantConfig(verification="cospec")
    with pytest.raises(ValueError, match="only used with"):
        H.AssistantConfig(verification="fly", arbiter=ConstantArbiter(True))
    with pytest.raises(ValueError, match="cannot serialize"):
        H.AssistantConfig(verification="cospec", arbiter=ConstantArbiter(True)).to_json_string()
    ids = _prompt(5)
    with pytest.raises(NotImplementedError, match="greedy decoding only"):
        target.generate(ids, do_sample=True, max_new_tokens=4, custom_generate=H.speculative_generate,
                        draft_model=draft, assistant_config=H.AssistantConfig(drafter="model", verification="typical"))
    with pytest.raises(ValueError, match="next-token distributions"):
        target.generate(ids, do_sample=False, max_new_tokens=4, custom_generate=H.speculative_generate,
                        assistant_config=H.AssistantConfig(verification="cospec", arbiter=CoSpecArbiter(
                            CoSpecArbiterConfig())))


# ---------------------------------------------------------------------------------------------------- recipe
@pytest.mark.slow
def test_recipe_runs_a_few_steps_on_tiny_models(tmp_path):
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        from cospec_task import build, split_of
    finally:
        sys.path.pop(0)
    task, manifest = build(packages=["pluggy"], per_file=2, caps=(12, 3, 3))
    assert manifest["examples"] == {"train": 12, "validation": 3, "test": 3}
    for split in ("train", "validation", "test"):
        assert {split_of(p) for p in task[split]["path"]} == {split}
    with pytest.raises(ValueError, match="held out"):
        build(packages=["sympy"])
    task.save_to_disk(str(tmp_path / "task"))
    out = tmp_path / "arbiter"
    cmd = [sys.executable, str(REPO / "recipes" / "train_cospec.py"), "--target", "tiny:qwen3_5_text", "--draft",
           "tiny:falcon_h1", "--task", str(tmp_path / "task"), "--out", str(out), "--steps", "2",
           "--prompts-per-step", "2", "--num-generations", "2", "--eval-every", "2", "--eval-examples", "2",
           "--max-new-tokens", "6", "--max-depth", "3", "--init-accept-prob", "0.5", "--prefilter", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.json", "model.safetensors", "README.md", "reward_curve.png", "train_log.jsonl"):
        assert (out / name).is_file(), name
    arb = CoSpecArbiter.from_pretrained(out)
    assert arb.config.training_summary["steps"] == 2
    lines = (out / "train_log.jsonl").read_text().splitlines()
    assert sum('"kind": "train"' in line for line in lines) == 2


@pytest.mark.parametrize("cfg", [dict(verification="typical", typical_epsilon=1e-6, typical_delta=1e-6),
                                 dict(verification="fly", fly_window=1, fly_entropy_threshold=0.0)],
                         ids=["typical", "fly"])
def test_training_free_rules_on_a_batch_decide_each_row_as_alone(cfg):
    """'typical' and 'fly' at B = 3 (left-padded rows, the suffix drafter: no draft distributions, so the draft's
    choice is a node's first child at any batch size): each row is what the row generates alone under the same rule,
    the arbiter overrode the target somewhere, and the batch's statistics are the rows' sums."""
    from engine.test_batch import PAD, greedy

    target = tiny_model("qwen3_5_text")
    motif = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(5))
    rows = [motif.repeat(3), torch.cat([_prompt(6, seed=1)[0], motif.repeat(2)]), motif.repeat(2)[:11]]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.full((width - len(r),), PAD), r]) for r in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    config = H.AssistantConfig(drafter="suffix", global_cache=False, max_draft_tokens=8, max_depth=4, **cfg)
    kw = dict(max_new_tokens=20, eos_token_id=None, custom_generate=H.speculative_generate, assistant_config=config,
              return_dict_in_generate=True)
    out = greedy(target, ids, mask, **kw)
    overrides = 0
    for b, row in enumerate(rows):
        alone = greedy(target, row[None], None, **kw)
        assert torch.equal(out.sequences[b, width - len(row) :], alone.sequences[0]), f"row {b}"
        assert out.spec_stats.rows[b].arbiter_overrides == alone.spec_stats.arbiter_overrides
        overrides += alone.spec_stats.arbiter_overrides
    assert out.spec_stats.arbiter_overrides == overrides > 0


def _padded_rows(seed=5):
    """Three left-padded rows of different lengths, two of them repeating a motif (drafts that hold)."""
    from engine.test_batch import PAD

    motif = torch.randint(3, 96, (7,), generator=torch.Generator().manual_seed(seed))
    rows = [motif.repeat(3), torch.cat([_prompt(6, seed=1)[0], motif.repeat(2)]), motif.repeat(2)[:11]]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.full((width - len(r),), PAD), r]) for r in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    return rows, ids, mask, width


@pytest.mark.parametrize("arbiter", ["never", "always", "learned", "learned-hidden"])
def test_cospec_on_a_batch_decides_each_row_as_alone(tiny_pairs, arbiter):
    """verification='cospec' at B = 3 with an assistant model per row (its next-token distributions on, as alone):
    each row is what it generates alone under the same arbiter; the constant arbiters give the target's greedy rows
    (never) and the draft model's (always); a learned arbiter over the mismatch features, and one that also reads the
    target's hidden states (the batch then runs on the eager backend), decide as alone too."""
    from engine.test_batch import PAD, greedy

    target, draft = tiny_pairs[PAIRS[0]]
    rows, ids, mask, width = _padded_rows()
    if arbiter.startswith("learned"):
        hidden = target.config.hidden_size if arbiter == "learned-hidden" else 0
        chosen = CoSpecArbiter(CoSpecArbiterConfig(width=16, init_accept_prob=0.5, target_hidden_size=hidden))
        with torch.no_grad():
            for p in chosen.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    else:
        chosen = ConstantArbiter(arbiter == "always")
    config = H.AssistantConfig(drafter="model", verification="cospec", arbiter=chosen, max_draft_tokens=8,
                               max_depth=4)
    kw = dict(max_new_tokens=16, eos_token_id=None, custom_generate=H.speculative_generate, draft_model=draft,
              assistant_config=config, return_dict_in_generate=True)
    out = greedy(target, ids, mask, **kw)
    decisions = overrides = 0
    for b, row in enumerate(rows):
        alone = greedy(target, row[None], None, **kw)
        assert torch.equal(out.sequences[b, width - len(row) :], alone.sequences[0]), f"row {b}"
        assert out.spec_stats.rows[b].arbiter_decisions == alone.spec_stats.arbiter_decisions
        decisions += alone.spec_stats.arbiter_decisions
        overrides += alone.spec_stats.arbiter_overrides
        endpoint = (target if arbiter == "never" else draft).generate(row[None], do_sample=False, max_new_tokens=16,
                                                                      eos_token_id=None, pad_token_id=PAD)
        if not arbiter.startswith("learned"):
            assert torch.equal(alone.sequences, endpoint), f"row {b}"
    assert out.spec_stats.arbiter_decisions == decisions > 0
    assert out.spec_stats.arbiter_overrides == overrides
    assert (overrides == 0) == (arbiter == "never")


def test_a_batch_shows_the_arbiter_each_rows_mismatches_as_alone(tiny_pairs):
    """What the arbiter is shown on a batch, position (in the row without its padding) included: the mismatches of
    the rows decoded alone."""
    from engine.test_batch import greedy

    target, draft = tiny_pairs[PAIRS[0]]
    rows, ids, mask, width = _padded_rows()

    def seen(arbiter, ids, mask):
        config = H.AssistantConfig(drafter="model", verification="cospec", arbiter=arbiter, max_draft_tokens=8,
                                   max_depth=4)
        greedy(target, ids, mask, max_new_tokens=12, eos_token_id=None, custom_generate=H.speculative_generate,
               draft_model=draft, assistant_config=config)
        return sorted((m.position, m.depth, m.draft_token, m.target_token, m.agreement_below) for m in arbiter.seen)

    alone = sorted(sum((seen(_Recorder(False), row[None], None) for row in rows), []))
    assert alone and seen(_Recorder(False), ids, mask) == alone

    # An arbiter that reads the target's hidden states is shown each row's own (the first token's included).
    class HiddenRecorder(_Recorder):
        uses_target_hidden = True

    def hidden_seen(ids, mask):
        arbiter = HiddenRecorder(False)
        seen(arbiter, ids, mask)
        return sorted(((m.position, m.depth, m.draft_token, m.target_token, m.target_hidden) for m in arbiter.seen),
                      key=lambda m: m[:4])

    alone = sorted(sum((hidden_seen(row[None], None) for row in rows), []), key=lambda m: m[:4])
    batch = hidden_seen(ids, mask)
    assert [m[:4] for m in batch] == [m[:4] for m in alone] and any(m[0] == len(r) for m in alone for r in rows)
    for ours, theirs in zip(batch, alone):
        torch.testing.assert_close(ours[4], theirs[4], rtol=1e-4, atol=1e-4)


def test_cospec_on_a_batch_refuses_what_it_cannot_run(tiny_pairs):
    from engine.test_batch import greedy

    target, draft = tiny_pairs[PAIRS[0]]
    _, ids, mask, _ = _padded_rows()
    kw = dict(max_new_tokens=4, eos_token_id=None, custom_generate=H.speculative_generate)
    before = greedy(target, ids, mask, **kw)
    with pytest.raises(ValueError, match="next-token distributions"):  # the suffix drafter reports none
        greedy(target, ids, mask, assistant_config=H.AssistantConfig(verification="cospec", arbiter=CoSpecArbiter(
            CoSpecArbiterConfig())), **kw)
    assert torch.equal(greedy(target, ids, mask, **kw), before)
