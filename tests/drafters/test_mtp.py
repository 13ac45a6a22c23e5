"""The MTP drafter: the target checkpoint's own `mtp.*` head (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), loaded from
checkpoints these tests write, drafting chains and trees; greedy identity with plain generate, its drafts against a
from-scratch recomputation, `use_mtp=True` after `enable`, and the errors."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file as safetensors_load
from transformers import AutoModelForCausalLM

import hf_hybrid_spec as H
from hf_hybrid_spec.drafters.base import DraftBudget, TargetHidden
from hf_hybrid_spec.mtp import MtpHead, mtp_layer_count, save_mtp_state
from hf_hybrid_spec.mtp.drafter import MtpDrafter
from hf_hybrid_spec.testing import tiny_model
from hf_hybrid_spec.tree import VerifyResult

MTP_FAMILIES = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")


def mtp_checkpoint(family: str, path, seed: int = 3, shard: str | None = None, vocab_size: int = 96):
    """A tiny `family` target saved with random MTP weights in the checkpoint layout; returns (target loaded
    back from it, the head that was written)."""
    target = tiny_model(family, mtp_num_hidden_layers=1, vocab_size=vocab_size)
    torch.manual_seed(seed)
    head = MtpHead.from_target(target)
    # Sharper MTP logits than random init gives: drafts then differ from token to token.
    with torch.no_grad():
        head.fc.weight.mul_(3.0)
    target.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    save_mtp_state(head, path)
    loaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    return loaded, head


@pytest.fixture(scope="module", params=MTP_FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    target, head = mtp_checkpoint(request.param, path)
    return request.param, path, target, head


def mtp_config(**kw) -> H.AssistantConfig:
    return H.AssistantConfig(drafter="mtp", **{"max_draft_tokens": 12, "max_depth": 4, "global_cache": False, **kw})


def test_checkpoint_layout_and_loading(family_checkpoint):
    family, path, target, head = family_checkpoint
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    mtp_keys = sorted(k for k in weight_map if k.startswith("mtp."))
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(mtp_keys)
    if family != "qwen3_5_text":  # MoE: experts per expert on disk, as transformers writes a target's own
        assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in mtp_keys
        assert not any(k.endswith("gate_up_proj") for k in mtp_keys)
    assert mtp_layer_count(target.config) == 1
    # transformers dropped them from the target; the drafter loads them through the index, shared embedding/head.
    assert not any(k.startswith("mtp") for k in target.state_dict())
    loaded = MtpHead.from_target(target, load=True)
    for (name, a), b in zip(head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded._shared.embed is target.get_input_embeddings()
    assert loaded._shared.lm_head is target.get_output_embeddings()
    assert not any(n.startswith(("embed", "lm_head")) for n in loaded.state_dict())


@pytest.mark.parametrize("top_k", [1, 3])
def test_greedy_identity(family_checkpoint, top_k):
    family, _, target, _ = family_checkpoint
    torch.manual_seed(0)
    for trial in range(2):
        ids = torch.randint(3, 96, (1, 9 + 5 * trial))
        ref = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
        for compile_ in (False, True):
            out = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None,
                                  custom_generate=H.speculative_generate, return_dict_in_generate=True,
                                  assistant_config=mtp_config(draft_top_k=top_k, compile=compile_))
            assert torch.equal(out.sequences, ref), (family, top_k, compile_)
            assert sum(out.spec_stats.drafted_tokens) > 0


def test_greedy_identity_batch(family_checkpoint):
    family, _, target, _ = family_checkpoint
    ids = torch.tensor([[1, 1, 5, 9, 17, 33, 4], [7, 8, 9, 10, 11, 12, 13]])
    mask = (ids != 1).long()
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=1, attention_mask=mask)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, custom_generate=H.speculative_generate, assistant_config=mtp_config(draft_top_k=2),
                          **kw)
    assert torch.equal(out, ref), family


def _recompute_chain(head: MtpHead, target, ids: torch.Tensor, depth: int) -> list[int]:
    """The greedy MTP chain off `ids` [1, L], recomputed from scratch: every depth is one causal pass over all
    positions (the target's hidden states for committed pairs (h_t, x_{t+1}), the head's own output fed back for
    drafted ones)."""
    with torch.no_grad():
        h = target(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
        tokens = ids[:, 1:]
        chain = []
        for _ in range(depth):
            out = head(h, head.embed(tokens), torch.arange(h.shape[1]).unsqueeze(0), None, None)
            chain.append(int(head.logits(out[0, -1]).argmax()))
            h = torch.cat([h, out[:, -1:]], dim=1)
            tokens = torch.cat([tokens, torch.tensor([[chain[-1]]])], dim=1)
    return chain


@pytest.mark.parametrize("static", [False, True])
def test_drafts_match_recomputation(family_checkpoint, static):
    """The store-based drafter (incremental keys/values, accepts that recompute accepted steps from the target's
    hidden states, tree nodes overwritten; or the fixed-shape static storage) drafts what a from-scratch
    recomputation drafts."""
    from types import SimpleNamespace

    family, _, target, _ = family_checkpoint
    head = MtpHead.from_target(target, load=True)
    drafter = MtpDrafter(head, target, top_k=1, static=static, max_depth=4)
    context = SimpleNamespace(generation_config=SimpleNamespace(max_length=64))
    last = target.config.get_text_config().num_hidden_layers
    budget = DraftBudget(max_nodes=4, max_depth=4)

    def hidden_of(ids):
        with torch.no_grad():
            return target(ids, output_hidden_states=True).hidden_states[last]

    torch.manual_seed(1)
    ids = torch.randint(3, 96, (1, 10))
    drafter.begin(ids, context, TargetHidden((last,), (hidden_of(ids),)))
    assert (drafter._static is not None) == static
    ids = torch.cat([ids, torch.tensor([[7]])], dim=1)  # the first token, from the prefill's logits
    drafter.accept(ids, VerifyResult(path=[0], tokens=torch.tensor([7]), score_nodes=[0]), None)
    for step in range(4):
        assert drafter.steps == ids.shape[1] - 1
        draft = drafter.propose(ids, budget)
        assert draft.tokens[0].tolist() == _recompute_chain(head, target, ids, 4), (family, step)
        assert draft.parents[0].tolist() == [-1, 0, 1, 2]
        new = torch.randint(3, 96, (1, 1 + step % 3))  # what the target "accepted" (path + bonus token)
        ids = torch.cat([ids, new], dim=1)
        # the verify forward's hidden states: the root and the accepted tokens, not the bonus token
        run = hidden_of(ids)[:, -(new.shape[1] + 1) : -1]
        drafter.accept(ids, VerifyResult(path=[0], tokens=new[0], score_nodes=[0]), TargetHidden((last,), (run,)))


def test_use_mtp_after_enable(family_checkpoint):
    family, _, target, _ = family_checkpoint
    H.enable(target)
    ids = torch.tensor([[5, 9, 17, 33, 4, 8, 12]])
    ref = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    out = target.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, use_mtp=True,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert sum(out.spec_stats.drafted_tokens) > 0  # it drafted (plain generate returns no spec_stats)
    assert max(out.spec_stats.drafted_tokens) <= 3  # the MTP drafter's own budget: a chain of 3


def test_head_follows_the_target_when_it_moves(tmp_path):
    target, _ = mtp_checkpoint("qwen3_5_text", tmp_path)
    ids = torch.tensor([[5, 9, 17, 33, 4]])
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, custom_generate=H.speculative_generate,
              assistant_config=mtp_config())
    target.generate(ids, **kw)
    first = target._hf_hybrid_spec_mtp_head
    target.to(torch.float64)
    out = target.generate(ids, **kw)
    assert torch.equal(out, target.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None))
    assert target._hf_hybrid_spec_mtp_head is not first
    assert target._hf_hybrid_spec_mtp_head.fc.weight.dtype == torch.float64


@pytest.mark.slow
def test_sampling_matches_the_target_distribution(tmp_path):
    """Sampling with MTP trees (deterministic top-k drafts) is distribution-exact: the first two sampled tokens
    follow the target's own joint law (chi-square), and the harness rejects a sharper law."""
    from helpers import chi2_pvalue, sampled_pairs, target_joint
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    target, _ = mtp_checkpoint("qwen3_5_text", tmp_path, vocab_size=8)
    ids = torch.tensor([[2, 5, 3, 7, 2, 5]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    joint = target_joint(target, ids, processors)
    torch.manual_seed(4321)
    counts = sampled_pairs(target, ids, 1000, temperature=0.7, top_k=5, custom_generate=H.speculative_generate,
                           assistant_config=mtp_config(draft_top_k=2, max_draft_tokens=4, max_depth=2))
    assert chi2_pvalue(counts, joint) > 1e-3
    assert chi2_pvalue(counts, torch.softmax(2.0 * torch.log(joint + 1e-12), dim=0)) < 1e-3


def test_errors(tmp_path):
    # A family without MTP weights in its config.
    falcon = tiny_model("falcon_h1")
    with pytest.raises(ValueError, match="multi-token-prediction"):
        MtpHead.from_target(falcon)
    with pytest.raises(ValueError, match="knows the MTP layout"):
        MtpHead.from_target(tiny_model("llama", mtp_num_hidden_layers=1))
    # A Qwen3.5 checkpoint whose config declares MTP but that holds no mtp.* tensors.
    target = tiny_model("qwen3_5_text", mtp_num_hidden_layers=1)
    target.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    ids = torch.tensor([[5, 9, 17]])
    with pytest.raises(ValueError, match="no 'mtp"):
        loaded.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate,
                        assistant_config=mtp_config())
    # A target not loaded from a checkpoint.
    with pytest.raises(ValueError, match="not loaded from one"):
        tiny_model("qwen3_5_text", mtp_num_hidden_layers=1).generate(
            ids, max_new_tokens=4, custom_generate=H.speculative_generate, assistant_config=mtp_config())
    # A head built for another model.
    other = MtpHead.from_target(tiny_model("qwen3_5_text", mtp_num_hidden_layers=1))
    with pytest.raises(ValueError, match="different model"):
        loaded.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate, draft_model=other,
                        assistant_config=mtp_config())
    # The failed calls left the model usable: plain and speculative decoding still run, exactly.
    plain = loaded.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    spec = loaded.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                           custom_generate=H.speculative_generate, assistant_config=H.AssistantConfig())
    assert torch.equal(plain, spec)
    # Weights of another shape.
    wrong = tiny_model("qwen3_5_text", mtp_num_hidden_layers=1, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="shape"):
        MtpHead.from_target(wrong).load_mtp_state_dict(
            {k[len("mtp."):]: v for k, v in MtpHead.from_target(target).checkpoint_state_dict().items()})


def test_sharded_checkpoint_reads_only_mtp_shard(tmp_path):
    target, head = mtp_checkpoint("qwen3_next", tmp_path, shard="100KB")
    with open(os.path.join(tmp_path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = {v for k, v in weight_map.items() if k.startswith("mtp.")}
    assert shards == {"mtp.safetensors"} and len(set(weight_map.values())) > 2
    with safe_open(os.path.join(tmp_path, "mtp.safetensors"), "pt") as f:
        assert all(k.startswith("mtp.") for k in f.keys())
    loaded = MtpHead.from_target(target, load=True)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))


def test_recipe_trains_and_saves_in_checkpoint_layout(tmp_path):
    """recipes/train_mtp.py end to end on a tiny target: a few steps lower the loss, the head lands in the target
    checkpoint's own layout, and drafter="mtp" / use_mtp=True load it from there."""
    import json as json_module
    import sys
    from pathlib import Path

    from helpers import tiny_target_with_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    import train_mtp

    tiny_target_with_tokenizer(tmp_path / "target")
    # A read-only target folder (a shared or cached checkpoint): the copy the recipe writes into is still writable.
    for path in [tmp_path / "target", *(tmp_path / "target").iterdir()]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    out = tmp_path / "out"
    rc = train_mtp.main(["--target", str(tmp_path / "target"), "--output_dir", str(out), "--max_steps", "12",
                         "--batch_size", "2", "--seq_len", "24", "--warmup_steps", "1", "--lr", "3e-3",
                         "--source_dirs", os.path.dirname(json_module.__file__), "--heldout_percent", "30",
                         "--eval_prompts", "1", "--eval_new_tokens", "6", "--device", "cpu",
                         "--num_workers", "1"])
    assert rc == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 12 and len(log[0]["per_depth"]) == 2
    assert sum(r["loss"] for r in log[-3:]) < sum(r["loss"] for r in log[:3])
    record = json.loads((out / "mtp_eval.json").read_text())
    assert record["mean_accepted_length_chain"] >= 1.0
    checkpoint = out / "checkpoint"
    for path in [checkpoint, *checkpoint.iterdir()]:
        assert path.stat().st_mode & 0o200, f"{path} is not writable"
    with open(checkpoint / "config.json") as f:
        assert json.load(f)["mtp_num_hidden_layers"] == 1
    card = (checkpoint / "README.md").read_text()
    assert "mtp" in card and "mtp_num_hidden_layers" in card and "Mean accepted length" in card
    target = H.enable(AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval())
    head = MtpHead.from_pretrained(checkpoint, target)
    saved = {k[len("mtp."):]: v for k, v in safetensors_load(checkpoint / "mtp.safetensors").items()}
    assert len(head.layers) == 1 and all(torch.equal(head.state_dict()[k], v) for k, v in saved.items())
    ids = torch.tensor([[5, 9, 17, 33, 4]])
    ref = target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, use_mtp=True), ref)
    with pytest.raises(SystemExit) as exc:
        train_mtp.main(["--help"])
    assert exc.value.code == 0


def test_committed_head_on_the_fixture():
    """The trained head in checkpoints/mtp loads onto the Qwen3.5 fixture, stays exact, and accepts (the fixture
    repeats itself more than real models, so the bound is loose)."""
    from pathlib import Path

    from helpers import load_fixture

    model, tok = load_fixture("qwen3_5-small")
    shard = Path(__file__).resolve().parents[2] / "checkpoints" / "mtp" / "qwen3_5-small" / "mtp.safetensors"
    head = MtpHead.from_target(model, load=True, checkpoint=shard, layers=1)
    ids = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)
    ref = model.generate(ids, **kw)
    for top_k in (1, 3):
        out = model.generate(ids, custom_generate=H.speculative_generate, draft_model=head,
                             return_dict_in_generate=True, **kw,
                             assistant_config=mtp_config(max_depth=3, max_draft_tokens=3 * top_k, draft_top_k=top_k))
        assert torch.equal(out.sequences, ref)
        assert out.spec_stats.mean_accepted_length > 1.5


@pytest.mark.slow
@pytest.mark.fixture
def test_committed_head_drafts_a_batch_on_the_fixture():
    """The trained head at B = 4 (left-padded prompts of different lengths), one batched drafter for every row, through
    the general step (eager) and the pipelined step (compile=True): every row stock's, and the rows accept about
    what one request accepts."""
    from pathlib import Path

    from helpers import load_fixture

    model, tok = load_fixture("qwen3_5-small")
    shard = Path(__file__).resolve().parents[2] / "checkpoints" / "mtp" / "qwen3_5-small" / "mtp.safetensors"
    head = MtpHead.from_target(model, load=True, checkpoint=shard, layers=1)
    texts = ["def fibonacci(n):\n", "import numpy as np\n\n\ndef softmax(x):\n",
             "class Stack:\n    def __init__(self):\n        self.items = []\n", "def merge_sorted(a, b):\n"]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=32, min_new_tokens=32, eos_token_id=None, do_sample=False, pad_token_id=1)
    ref = model.generate(**batch, **kw)
    for compile_ in (False, True):
        out = model.generate(**batch, **kw, custom_generate=H.speculative_generate, draft_model=head,
                             return_dict_in_generate=True,
                             assistant_config=mtp_config(max_depth=3, max_draft_tokens=3, compile=compile_))
        assert torch.equal(out.sequences, ref), compile_
        assert out.spec_stats.mean_accepted_length > 1.5


@pytest.mark.slow
def test_compile_drafter_fuses_the_mtp_passes(tmp_path):
    """compile_drafter=True: both MTP passes compile whole with Inductor (fullgraph: a graph break fails here; on
    CPU they run without graphs) and draft what the plain static passes draft, step for step."""
    target, head = mtp_checkpoint("qwen3_5_text", tmp_path)
    ids = torch.tensor([[5, 9, 17, 33, 4, 8, 12]])
    kw = dict(do_sample=False, max_new_tokens=12, eos_token_id=None, custom_generate=H.speculative_generate,
              return_dict_in_generate=True)
    ref = target.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None)
    cfg = mtp_config(draft_top_k=2, max_draft_tokens=4, max_depth=3, compile=True)
    plain = target.generate(ids, assistant_config=cfg, **kw)
    fused = target.generate(ids, assistant_config=cfg.replace(compile_drafter=True), **kw)
    assert torch.equal(plain.sequences, ref) and torch.equal(fused.sequences, ref)
    assert fused.spec_stats.accepted_lengths == plain.spec_stats.accepted_lengths
    store = next(s for s in target._hf_hybrid_spec_mtp_head._static_mtp.values() if s.fuse)
    assert set(store._compiled) == {"expand", "advance"}  # both compiled passes ran, neither fell back
    assert len(store._fused_budgets) == 1  # the expansion of the first budget only


def test_drafters_example_runs():
    """examples/drafters.py (every drafter on the fixture, checked against plain greedy) exits 0."""
    import importlib.util
    from pathlib import Path

    from helpers import load_fixture

    load_fixture("qwen3_5-small")  # skips (or fails in CI) without the fixture
    path = Path(__file__).resolve().parents[2] / "examples" / "drafters.py"
    spec = importlib.util.spec_from_file_location("drafters_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--max-new-tokens", "12"]) == 0


def _record_mtp(monkeypatch, log):
    """Log every draft of `BatchMtpDrafter` (per batch row) and `MtpDrafter` (row 0) as (tokens, parents, values)."""
    from hf_hybrid_spec.mtp.batch import BatchMtpDrafter
    from hf_hybrid_spec.tree import DraftBatch

    def keep(b, tokens, parents, values):
        log.setdefault(b, []).append((tokens.tolist(), parents.tolist(), values.float()))

    def wrap(cls, name):
        original = getattr(cls, name)

        def method(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if name == "propose_device":
                for b in range(out.tokens.shape[0]):
                    keep(b, out.tokens[b], out.parents[b], out.values[b])
            elif isinstance(out, DraftBatch):
                for i, b in enumerate(args[0]):
                    n = int(out.count[i])
                    keep(b, out.tokens[i, :n], out.parents[i, :n], out.values[i, :n])
            else:
                keep(0, out.tokens[0], out.parents[0], out.scores[0])
            return out

        monkeypatch.setattr(cls, name, method)

    wrap(BatchMtpDrafter, "propose")
    wrap(BatchMtpDrafter, "propose_device")
    wrap(MtpDrafter, "propose")


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "static"])
def test_batched_mtp_drafts_what_each_row_drafts_alone(family_checkpoint, compile_, monkeypatch):
    """At B = 3 (left-padded rows of different lengths) one `BatchMtpDrafter` drafts for every row (the pipelined step
    with compile=True): the output is stock's, and each row's drafts (tokens, tree and path probabilities) are what
    one `MtpDrafter` drafts for that row alone (trees of top-k 2), step by step."""
    from engine.test_batch import greedy, padded_batch

    family, _, target, _ = family_checkpoint
    ids, mask = padded_batch([9, 14, 5], seed=4)
    kw = dict(max_new_tokens=16, eos_token_id=None, custom_generate=H.speculative_generate,
              assistant_config=mtp_config(draft_top_k=2, max_draft_tokens=6, max_depth=3, compile=compile_))
    batch_log: dict = {}
    _record_mtp(monkeypatch, batch_log)
    out = greedy(target, ids, mask, **kw)
    monkeypatch.undo()
    assert torch.equal(out, greedy(target, ids, mask, max_new_tokens=16, eos_token_id=None))
    assert batch_log, "the batched MTP drafter did not draft"
    pads = (mask == 0).sum(-1).tolist()
    for b in range(ids.shape[0]):
        row_log: dict = {}
        _record_mtp(monkeypatch, row_log)
        alone = greedy(target, ids[b : b + 1, pads[b] :], None, **kw)
        monkeypatch.undo()
        assert torch.equal(alone[0], out[b, pads[b] :])
        steps = [i for i in range(len(row_log[0])) if i < len(batch_log[b])]
        assert len(steps) >= 3
        for i in steps[:-2]:  # the batch cuts its last trees on the host where a row's budget is smaller
            (bt, bp, bv), (rt, rp, rv) = batch_log[b][i], row_log[0][i]
            assert (bt, bp) == (rt, rp), f"{family} row {b} step {i}"
            torch.testing.assert_close(bv, rv, rtol=1e-4, atol=1e-5)


def test_batch_store_replays_what_it_runs(monkeypatch):
    """The batched MTP store's passes read their inputs from its buffers at every replay (steps, counts and tokens staged
    in one copy, also from device tensors): replayed from stand-in graphs (`GraphPasses`) they give what the eager
    passes give, over accepts of different counts per row (0: a row that stopped keeps its root)."""
    import hf_hybrid_spec.graphs as G
    from drafters.test_eagle_batch import assert_replay_matches_eager, rerun_capture

    from hf_hybrid_spec.mtp.batch import BatchMtpStore

    monkeypatch.setattr(G, "capture", rerun_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    target = tiny_model("qwen3_5_text", mtp_num_hidden_layers=1)
    torch.manual_seed(2)
    head = MtpHead.from_target(target)
    with torch.no_grad():
        head.fc.weight.mul_(3.0)
    rows, size = 3, target.config.get_text_config().hidden_size
    stores = [BatchMtpStore(head, top_k=2, max_depth=3, capacity=40, rows=rows, use_graphs=g) for g in (False, True)]
    assert_replay_matches_eager(stores, size, 20, [[1, 1, 1], [3, 0, 2], [4, 2, 0], [1, 3, 3], [3, 0, 2]], (4, 3),
                                alternate_device=True)
    assert len(stores[1]._graphs) >= 4  # every accept count and the budget: captured once, replayed after
