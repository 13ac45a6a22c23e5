"""Shared test helpers: the trained fixtures, test drafters (trees of controlled shape around a known continuation),
every built-in drafter as generate kwargs, an offline tokenizer."""

import contextlib
import functools
import os
import sys
import types

import pytest
import torch
from hf_hybrid_spec.kernels import tree

from hf_hybrid_spec.testing import fixture_path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4  # relative error (Frobenius norm) in fp32 of a kernel against its reference

IN_CI = os.environ.get("CI", "").lower() == "true"


@functools.cache
def _load_fixture(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fixture_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def load_fixture(name: str):
    """(model, tokenizer) of a trained fixture; skips where ../shared/models is absent, fails in CI."""
    if fixture_path(name) is None:
        message = f"fixture model {name} not found (expected in ../shared/models)"
        if IN_CI:
            pytest.fail(message + " and CI=true: the fixtures must be present in CI")
        pytest.skip(message)
    return _load_fixture(name)

from hf_hybrid_spec.drafters import DraftBudget, Drafter
from hf_hybrid_spec.tree import DraftTree, empty_draft


class RandomTreeDrafter(Drafter):
    """Random trees of depth 1..max_depth. When `reference` (the plain greedy output) is given, one branch
    follows it for a random number of tokens, so deep acceptances and partial matches both happen."""

    name = "random_tree"

    def __init__(self, vocab_size, reference=None, seed=0, max_nodes=16, branch=3, p_follow=0.8):
        self.vocab = vocab_size
        self.reference = None if reference is None else reference[0].tolist()
        self.gen = torch.Generator().manual_seed(seed)
        self.max_nodes = max_nodes
        self.branch = branch
        self.p_follow = p_follow

    def _rand(self, hi):
        return int(torch.randint(hi, (1,), generator=self.gen))

    def propose(self, input_ids, budget: DraftBudget) -> DraftTree:
        length = input_ids.shape[1]
        max_depth = min(budget.max_depth, 1 + self._rand(8))
        n = min(budget.max_nodes, self.max_nodes, 1 + self._rand(self.max_nodes))
        if max_depth <= 0 or n <= 0:
            return empty_draft(1, input_ids.device)
        tokens, parents, depth = [], [], []
        follow = -1  # index of the node continuing the reference, -1 = root
        follow_ok = self.reference is not None and float(torch.rand((), generator=self.gen)) < self.p_follow
        while len(tokens) < n:
            d_follow = 0 if follow < 0 else depth[follow]
            ref_pos = length + d_follow
            if follow_ok and d_follow < max_depth and self.reference is not None and ref_pos < len(self.reference):
                same = [i for i in range(len(tokens)) if parents[i] == follow and tokens[i] == self.reference[ref_pos]]
                if same:
                    follow = same[0]
                    continue
                tokens.append(self.reference[ref_pos])
                parents.append(follow)
                depth.append(d_follow + 1)
                follow = len(tokens) - 1
                follow_ok = float(torch.rand((), generator=self.gen)) < 0.85
                continue
            cands = [-1] + [i for i in range(len(tokens)) if depth[i] < max_depth]
            p = cands[self._rand(len(cands))]
            siblings = {tokens[i] for i in range(len(tokens)) if parents[i] == p}
            tok = self._rand(self.vocab)
            if tok in siblings:
                continue
            tokens.append(tok)
            parents.append(p)
            depth.append(1 if p < 0 else depth[p] + 1)
        return DraftTree(tokens=torch.tensor([tokens]), parents=torch.tensor([parents]))


def identity_failures(model, ids, max_new_tokens=32, vocab_size=96) -> list[str]:
    """Plain greedy vs speculative decoding with the default suffix drafter and with random trees over the
    reference (accepted and rejected nodes every step), eager and `compile=True`; returns what differed."""
    import hf_hybrid_spec as H

    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    ref = model.generate(ids, **kwargs)
    failures = []
    for compile_ in (False, True):
        for drafter in (None, RandomTreeDrafter(vocab_size, reference=ref.cpu())):
            out = model.generate(ids, custom_generate=H.speculative_generate, drafter=drafter,
                                 assistant_config=H.AssistantConfig(compile=compile_), **kwargs)
            if not torch.equal(out, ref):
                failures.append(f"compile={compile_}, drafter={drafter.name if drafter else 'suffix'}")
    return failures


# Every built-in drafter, as generate kwargs (a config and, where it needs one, a draft model), for a target model.
BUILTIN_DRAFTERS = ("suffix", "ngram", "model", "eagle", "self_ssm", "layerskip", "hvd")


def drafter_kwargs(name: str, target, compile: bool = False, draft_model=None, **config) -> dict:
    """generate kwargs that run the built-in drafter `name` on `target`: an `AssistantConfig` and, for the drafters
    that need one, a draft model (`draft_model`, or a random `EagleDrafter` for eagle / hvd and the target itself for
    model). Random weights accept little; the point is the code path, and exactness holds whatever is accepted."""
    import hf_hybrid_spec as H
    from hf_hybrid_spec.eagle import EagleDrafter

    base = dict(max_draft_tokens=12, max_depth=4, global_cache=False, compile=compile, **config)
    if name in ("eagle", "hvd") and draft_model is None:
        vocab = target.config.get_text_config().vocab_size
        torch.manual_seed(1)
        draft_model = EagleDrafter.from_target(target, draft_vocab_size=min(vocab, 1024))
    if name == "model" and draft_model is None:
        draft_model = target
    extra = {
        "eagle": dict(draft_top_k=3),
        "layerskip": dict(exit_layer=1),
        "hvd": dict(hvd_policy="threshold", hvd_model_tokens=8, hvd_model_depth=3, draft_top_k=2),
    }.get(name, {})
    kwargs = dict(assistant_config=H.AssistantConfig(drafter=name, **{**base, **extra}))
    if name in ("model", "eagle", "hvd"):
        kwargs["draft_model"] = draft_model
    return kwargs


def char_tokenizer(vocab_size: int = 96):
    """A character-level tokenizer built offline (ids 0-2: "<eos>", "<pad>", "<unk>"; id i >= 3 is chr(30 + i), so
    "!".."~" and more), for tests that need a tokenizer (stop strings, streamers) on the tiny random models."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<pad>": 1, "<unk>": 2, **{chr(30 + i): i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", bos_token="<eos>",
                                   pad_token="<pad>")


# ---------------------------------------------------------------------- kernels: the Triton interpreter, random trees
def _interpret_triton_stdlib() -> None:
    """Make triton's own @jit helpers (tl.sum, tl.max, tl.sigmoid, ...) runnable by the interpreter.

    Triton picks interpreter or compiler per function when it is decorated, and transformers imports
    torch._dynamo, which imports triton, so by the time this module runs (after the test setup) triton.language is
    usually loaded in compiled mode. Wrapping its @jit functions the way an interpreted import would have
    done fixes that; it is a no-op when TRITON_INTERPRET=1 was set before anything imported triton.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("triton.language") and isinstance(module, types.ModuleType):
            for attr, obj in list(vars(module).items()):
                if isinstance(obj, JITFunction):
                    setattr(module, attr, wrapped.setdefault(id(obj), InterpretedFunction(obj.fn)))


# Where a GPU exists the kernel tests run compiled on it; on CPU they run in the Triton interpreter, chosen before any
# kernel module is imported (triton decides per function at decoration time).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _interpret_triton_stdlib()
    except ImportError:  # no triton: the tests that need it skip
        pass


def random_tree(bsz: int, n: int, depth: int, seed: int) -> torch.Tensor:
    """[B, N] parent pointers in topological order, random branching, at most `depth` levels.

    Half the nodes extend the newest node that may still grow, so deep branches appear; the rest attach
    uniformly to the committed state or any node above the depth limit.
    """
    gen = torch.Generator().manual_seed(seed)
    parent = torch.full((bsz, n), -1, dtype=torch.long)
    for b in range(bsz):
        level: list[int] = []
        for i in range(n):
            growable = [j for j in range(i) if level[j] < depth - 1]
            if growable and torch.rand((), generator=gen) < 0.5:
                p = growable[-1]
            else:
                choices = [-1] + growable
                p = choices[int(torch.randint(len(choices), (), generator=gen))]
            parent[b, i] = p
            level.append(0 if p < 0 else level[p] + 1)
    assert int(tree.node_depth(parent).max()) <= depth - 1
    return parent.to(DEVICE)


def chain(bsz: int, n: int) -> torch.Tensor:
    return (torch.arange(n) - 1).expand(bsz, n).contiguous().to(DEVICE)


def random_leaf(bsz: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    leaf = torch.randint(-1, n, (bsz,), generator=gen)
    if bsz > 1:
        # At least one row accepts nothing and one accepts a node.
        leaf[0], leaf[-1] = -1, max(int(leaf[-1]), 0)
    return leaf.to(DEVICE)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float = TOL) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values (an unwritten, NaN-poisoned element?)"
    err = rel_err(ref, out)
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol:.0e}"


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty / torch.empty_like return NaN-filled float tensors: an element a kernel does not write
    stays NaN and fails `assert_close`."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
        mp.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
        yield


def run(backend: str, fn, *args, **kwargs):
    if backend == "triton":
        with poisoned_allocations():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def tiny_target_with_tokenizer(path, **overrides):
    """A tiny Qwen3.5 target (config `overrides`) and a small byte-level BPE tokenizer trained here (no download),
    saved in `path`: a checkpoint folder as the recipes read one."""
    import glob
    import json as json_module
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_hybrid_spec.testing import tiny_model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [Path(f).read_text() for f in sorted(glob.glob(os.path.join(os.path.dirname(json_module.__file__), "*.py")))]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   bos_token="<|endoftext|>")
    target = tiny_model("qwen3_5_text", vocab_size=len(fast), **overrides)
    target.save_pretrained(path)
    fast.save_pretrained(path)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of `counts` to the law `probs` (cells expecting < 5 merged)."""
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    # Merge cells with tiny expectations into one so the chi-square approximation holds.
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    exp = exp * (obs.sum() / exp.sum())  # float rounding of the law's total
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def target_joint(model, ids, processors):
    """Exact P(first two generated tokens) under stock sampling with `processors` ([V * V], V the vocabulary)."""
    V = model.config.get_text_config().vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
        p1 = torch.softmax(processors(ids, logits[None].clone())[0], dim=-1)
        joint = torch.zeros(V, V)
        for a in range(V):
            ext = torch.cat([ids, torch.tensor([[a]])], dim=1)
            la = model(input_ids=ext).logits[0, -1].float()
            joint[a] = p1[a] * torch.softmax(processors(ext, la[None].clone())[0], dim=-1)
    return joint.flatten()


def sampled_pairs(model, ids, n, **kw):
    """Counts [V * V] of the first two tokens of `n` sampled generations of `ids` (generate kwargs `kw`)."""
    V = model.config.get_text_config().vocab_size
    counts = torch.zeros(V * V)
    for _ in range(n):
        out = model.generate(ids, do_sample=True, top_p=1.0, max_new_tokens=2, eos_token_id=None, **kw)
        a, b = out[0, -2:].tolist()
        counts[a * V + b] += 1
    return counts
