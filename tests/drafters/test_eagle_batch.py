"""EAGLE for a batch: one expansion per step drafts every row's tree (`eagle.batch.BatchEagleDrafter`). Each row's
drafts are the ones a one-row `EagleTreeDrafter` proposes for that row alone; the R-row static storage gives the same
outputs replayed from (stand-in) graphs as run eagerly; on the fixture the batch accepts what one request accepts."""

import dataclasses
from pathlib import Path

import pytest
import torch
from engine.test_batch import PAD, greedy, padded_batch
from helpers import load_fixture

import hf_hybrid_spec as H
from hf_hybrid_spec.eagle import EagleDrafter, EagleTreeDrafter
from hf_hybrid_spec.eagle import batch as EB
from hf_hybrid_spec.eagle import static as ES
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import DraftBatch

REPO = Path(__file__).resolve().parents[2]


def record(monkeypatch, cls, log):
    """Wrap `cls.propose` (and, for the batch drafter, `propose_device`, which the pipelined step calls) so every
    draft it returns is logged as (tokens, parents) lists, per batch row."""
    original = cls.propose
    if hasattr(cls, "propose_device"):
        on_device = cls.propose_device

        def propose_device(self, *args, **kwargs):
            out = on_device(self, *args, **kwargs)
            for b, (tokens, parents) in enumerate(zip(out.tokens.tolist(), out.parents.tolist())):
                log.setdefault(b, []).append((tokens, parents))
            return out

        monkeypatch.setattr(cls, "propose_device", propose_device)

    def propose(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if isinstance(out, DraftBatch):  # BatchEagleDrafter: (rows, ids, budgets) -> the running rows' drafts
            for i, b in enumerate(args[0]):
                host = out.row(i).host()
                log.setdefault(b, []).append((host.tokens, host.parents))
        else:
            log.setdefault(0, []).append((out.host().tokens, out.host().parents))
        return out

    monkeypatch.setattr(cls, "propose", propose)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_batched_eagle_drafts_what_each_row_drafts_alone(family, compile_, monkeypatch):
    target = tiny_model(family)
    torch.manual_seed(1)
    eagle = EagleDrafter.from_target(target, draft_vocab_size=48)
    ids, mask = padded_batch([9, 14, 5], seed=4)
    kw = dict(max_new_tokens=16, eos_token_id=None, draft_model=eagle, custom_generate=H.speculative_generate,
              assistant_config=H.AssistantConfig(drafter="eagle", draft_top_k=3, max_draft_tokens=10, max_depth=4,
                                                 compile=compile_))
    batch_log: dict = {}
    record(monkeypatch, EB.BatchEagleDrafter, batch_log)
    out = greedy(target, ids, mask, **kw)
    assert torch.equal(out, greedy(target, ids, mask, max_new_tokens=16, eos_token_id=None))
    monkeypatch.undo()
    pads = (mask == 0).sum(-1).tolist()
    for b in range(ids.shape[0]):
        row_log: dict = {}
        record(monkeypatch, EagleTreeDrafter, row_log)
        alone = greedy(target, ids[b : b + 1, pads[b] :], None, **kw)
        monkeypatch.undo()
        assert torch.equal(alone[0], out[b, pads[b] :])
        # Every step where the row's budget allows the full depth (the batch cuts deeper trees on the host).
        steps = [i for i, (tokens, parents) in enumerate(row_log[0]) if i < len(batch_log[b])]
        assert len(steps) >= 3
        for i in steps[:-2]:
            assert batch_log[b][i] == row_log[0][i], f"row {b} step {i}"


class RerunGraph:
    """A stand-in for a captured CUDA graph on CPU: `replay` runs the captured function again and copies what it returns
    into the tensors the capture returned (what a real replay rewrites in place)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        copy_into(self.out, self.fn())


def copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif dataclasses.is_dataclass(dst):
        for field in dataclasses.fields(dst):
            copy_into(getattr(dst, field.name), getattr(src, field.name))
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src):
            copy_into(a, b)


def rerun_capture(fn, pool, device, warmups=2):
    for _ in range(warmups):
        fn()
    out = fn()
    return RerunGraph(fn, out), out


def assert_replay_matches_eager(stores, size: int, prompt_steps: int, rounds: list[list[int]], budget: tuple[int, int],
                                alternate_device: bool = False) -> None:
    """Drive two R-row stores (`drafters.staged_rows.StagedRows`: eager, then replayed) through the same prompts'
    steps and then accepts of `rounds[i][r]` steps per row (0: a row that stopped keeps its root), drafting with
    `budget` (nodes, depth) after each: their roots, log-probabilities, step counts and trees agree at every round.
    `alternate_device`: every other round goes through `advance_rows_device` (counts from the device)."""
    rows = len(rounds[0])
    gen = torch.Generator().manual_seed(0)
    steps = [5, 9, 2][:rows]
    features = torch.randn(rows, prompt_steps, size, generator=gen)
    tokens = torch.randint(0, 96, (rows, prompt_steps), generator=gen)
    with torch.no_grad():
        for store in stores:
            store.advance_rows([0] * rows, steps, features, tokens)  # the prompts' steps: one long eager pass
        for i, counts in enumerate(rounds):
            width = max(counts)
            features = torch.randn(rows, width, size, generator=gen)
            tokens = torch.randint(0, 96, (rows, width), generator=gen)
            outs = []
            for store in stores:
                if alternate_device and i % 2:
                    store.advance_rows_device(torch.tensor(counts), features, tokens)
                else:
                    store.advance_rows(steps, counts, features, tokens)
                cands = store.draft_rows(*budget)
                outs.append((store.hidden.clone(), store.logp.clone(), store.steps.clone(), cands.tokens.clone(),
                             cands.parents.clone(), cands.keep.clone(), cands.scores.clone()))
            steps = [s + c for s, c in zip(steps, counts)]
            assert outs[0][2].tolist() == steps
            for a, b in zip(*outs):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_batch_store_replays_what_it_runs(monkeypatch):
    """The R-row storage's passes read their inputs from its buffers at every replay (steps, counts and tokens staged in
    one copy): replayed from stand-in graphs they give what the eager passes give, over accepts of different counts per
    row (0: a row that stopped keeps its root)."""
    monkeypatch.setattr(ES, "capture", rerun_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    target = tiny_model("qwen3_5_text")
    torch.manual_seed(2)
    eagle = EagleDrafter.from_target(target, draft_vocab_size=40)
    rows, size = 3, eagle.config.hidden_size
    stores = [ES.StaticEagleTree(eagle, top_k=3, capacity=40, use_graphs=g, rows=rows) for g in (False, True)]
    assert_replay_matches_eager(stores, size, 10, [[1, 1, 1], [3, 0, 2], [4, 2, 0], [1, 3, 3]], (6, 3))
    assert stores[1].captures >= 4  # every accept count and the budget: captured once, replayed after


@pytest.mark.slow
@pytest.mark.fixture
@pytest.mark.parametrize("name", ["qwen3_5-small", "falcon_h1-small"])
def test_batched_eagle_on_the_fixtures(name):
    """The committed drafters at B = 4 (left-padded prompts of different lengths): every row identical to stock greedy,
    and as many tokens per step as the rows accept alone."""
    model, tok = load_fixture(name)
    drafter = EagleDrafter.from_pretrained(REPO / "checkpoints" / "drafters" / f"{name}-eagle3")
    texts = ["def fibonacci(n):\n", "import numpy as np\n\n\ndef softmax(x):\n",
             "class Stack:\n    def __init__(self):\n        self.items = []\n", "def merge_sorted(a, b):\n"]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=24, min_new_tokens=24, eos_token_id=None, do_sample=False, pad_token_id=PAD)
    ref = model.generate(**batch, **kw)
    out = model.generate(**batch, **kw, custom_generate=H.speculative_generate, draft_model=drafter,
                         assistant_config=H.AssistantConfig(drafter="eagle"), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.spec_stats.mean_accepted_length > 2.5
