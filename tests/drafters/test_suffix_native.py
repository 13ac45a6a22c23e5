"""The C suffix trie (`NativeSuffixTrie`) against the Python one (`SuffixTrie`): the same nodes, references, counts
and drafts after any sequence of operations; the fallback where it cannot be built."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from hf_hybrid_spec.drafters.base import DraftBudget
from hf_hybrid_spec.drafters.suffix import SuffixDrafter, SuffixTrie
from hf_hybrid_spec.drafters.suffix_native import NativeSuffixTrie, native_available

needs_native = pytest.mark.skipif(not native_available(), reason="no C compiler here: the native suffix trie was "
                                  "not built (the Python trie is used and tested instead)")


def _table(trie):
    """{substring: (count, total, children in order)}: the trie's logical content, its children's order included."""
    table, stack = {}, [((), trie.ROOT)]
    while stack:
        path, node = stack.pop()
        kids = trie.children(node, len(path))
        table[path] = (trie.count(node), trie.total(node, len(path)), [t for t, _ in kids])
        stack += [(path + (t,), c) for t, c in kids]
    return table


def _params(rng):
    return dict(max_match_length=rng.choice([1, 3, 8, 32]), spec_factor=rng.choice([1.0, 0.5, 2.5]),
                spec_offset=rng.choice([0.0, 1.0, -1.0]), max_nodes=rng.choice([1, 4, 16, 64]),
                max_depth=rng.choice([1, 3, 8]), min_token_prob=rng.choice([0.0, 0.1, 0.3, 1.0, 1.5]),
                tree=rng.random() < 0.7)


def _same_drafts(py, c, rng, vocab, text=(), contexts=12):
    """Best drafts for random contexts and for pieces of `text` (which match deep)."""
    for k in range(contexts):
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 3 * py.depth))]
        if text and k % 2:
            end = rng.randint(1, len(text))
            context = list(text[max(0, end - rng.randint(1, 3 * py.depth)) : end])
        a, b = py.active_after(context), c.active_after(context)
        assert a == list(b)
        for _ in range(3):
            params = _params(rng)
            want, got = py.best_draft(a, **params), c.best_draft(b, **params)
            assert want == got, (context, params)


@needs_native
def test_native_trie_matches_the_python_trie_under_random_operations():
    """Request tries fed in chunks of every size and process-wide tries that insert, evict and truncate: identical
    active lists, node ids, logical tables (children in the same order) and best drafts, references to evicted
    sequences included; copies are independent."""
    rng = random.Random(0)
    drafts = 0
    for trial in range(24):
        depth, vocab = rng.choice([2, 5, 12]), rng.choice([3, 6, 50])
        py, c = SuffixTrie(depth), NativeSuffixTrie(depth)
        # A request trie: one sequence fed in chunks.
        pa, ca = [], []
        text = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
        text += text[: rng.randint(0, 30)]
        i = 0
        while i < len(text):
            chunk = text[i : i + rng.choice([1, 2, 7, 40])]
            pa = py.extend_many(pa, chunk)
            ca = c.extend_many(ca, chunk)
            assert pa == list(ca)
            i += len(chunk)
        assert _table(py) == _table(c) and py.num_nodes == c.num_nodes and py.num_tokens == c.num_tokens
        assert py.sequence(0) == c.sequence(0) and c.sequence_length(0) == len(text)
        _same_drafts(py, c, rng, vocab, text)
        drafts += 1
        keep = rng.randint(0, len(text))
        py.truncate(0, keep)
        c.truncate(0, keep)
        assert _table(py) == _table(c) and py.active_after(text[:keep]) == list(c.active_after(text[:keep]))
        # A process-wide trie: outputs inserted and evicted; a reader's references outlive an eviction.
        py, c = SuffixTrie(depth), NativeSuffixTrie(depth)
        live, outputs = [], []
        stale_context = None
        for _ in range(rng.randint(3, 12)):
            if live and rng.random() < 0.35:
                seq = live.pop(rng.randrange(len(live)))
                py.remove(seq)
                c.remove(seq)
            else:
                out = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
                assert py.insert(out) == c.insert(out)
                live.append(py._next_seq - 1)
                stale_context = out
                outputs.append(out)
            assert _table(py) == _table(c) and py.num_nodes == c.num_nodes
        _same_drafts(py, c, rng, vocab, [t for out in outputs for t in out])
        if stale_context:
            a, b = py.active_after(stale_context), c.active_after(stale_context)
            assert a == list(b)
            for seq in list(live):
                py.remove(seq)
                c.remove(seq)
            assert py.follow_many(a, stale_context[:5]) == list(c.follow_many(b, stale_context[:5]))
            params = _params(rng)
            assert py.best_draft(a, **params) == c.best_draft(b, **params)
        snap = c.copy()
        before = _table(snap)
        c.insert([rng.randrange(vocab) for _ in range(30)])
        assert _table(snap) == before and snap.nbytes() > 0
    assert drafts == 24


@needs_native
def test_native_trie_rejects_foreign_references_and_negative_tokens():
    trie = NativeSuffixTrie(6)
    active = trie.extend_many([], [1, 2, 3, 1, 2])
    with pytest.raises(ValueError):
        trie.extend_many(list(active) + [10**9], [4])
    with pytest.raises(ValueError):
        trie.extend_many(active, [-3])
    assert list(trie.extend_many(active, [3])) == SuffixTrie(6).extend_many([], [1, 2, 3, 1, 2, 3])
    # Reads of references the trie never made are nodes without children, never a crash.
    assert trie.children(10**9, 1) == [] and trie.total(-(10**12), 2) == 0 and trie.count(10**9) == 0
    assert trie.follow_many([10**9, -5], [1, 2]) == trie.follow_many([], [1, 2])


@needs_native
def test_suffix_drafter_drafts_the_same_with_either_trie(monkeypatch):
    """A suffix drafter (request and process-wide tries) through a generation-like loop: the same draft each step
    with the C trie as with the Python one."""
    from hf_hybrid_spec.drafters import suffix, suffix_native

    lib = suffix_native._library()
    rng = random.Random(5)
    texts = [[rng.randrange(12) for _ in range(rng.randint(30, 90))] for _ in range(6)]

    def run(native: bool):
        monkeypatch.setattr(suffix_native, "_lib", lib if native else None)
        suffix.clear_global_suffix_cache()
        drafts = []
        for text in texts:
            drafter = SuffixDrafter(cache_key=("native-vs-python",), max_match_length=8, max_depth=6)
            assert isinstance(drafter.local, NativeSuffixTrie if native else SuffixTrie)
            ids = torch.tensor([text[:20]])
            drafter.begin(ids)
            for pos in range(20, len(text), 3):
                tree = drafter.propose(ids, DraftBudget(max_nodes=12, max_depth=5)).host()
                drafts.append((tree.tokens, tree.parents))
                ids = torch.tensor([text[: pos + 3]])
                drafter.catch_up(text[pos : pos + 3])
            drafter.end(ids)
        suffix.clear_global_suffix_cache()
        return drafts

    python, native = run(False), run(True)
    assert python == native and sum(len(t) for t, _ in native) > 50


def _python_in_subprocess(code: str, **env) -> str:
    full = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_python_trie_is_used_where_the_native_one_cannot_be_built(tmp_path):
    """`HF_HYBRID_SPEC_NATIVE=0`, or no compiler on the path with an empty cache: the drafter runs on the Python
    trie."""
    code = ("from hf_hybrid_spec.drafters.suffix import SuffixDrafter; "
            "print(type(SuffixDrafter(use_global=False).local).__name__)")
    assert _python_in_subprocess(code, HF_HYBRID_SPEC_NATIVE="0") == "SuffixTrie"
    no_cc = _python_in_subprocess(code, PATH=str(tmp_path), CC="", HF_HYBRID_SPEC_CACHE=str(tmp_path / "cache"))
    assert no_cc == "SuffixTrie"
    if native_available():
        built = _python_in_subprocess(code, HF_HYBRID_SPEC_CACHE=str(tmp_path / "cache"))
        assert built == "NativeSuffixTrie" and list((tmp_path / "cache" / "native").glob("suffix_trie-*.so"))


@needs_native
def test_native_trie_reads_from_several_threads_at_once():
    """The process-wide trie is read by several requests' threads: each gets its own results (the wrapper's scratch
    buffers are the trie's, so a thread switch between a C call and the read of its results must not mix them)."""
    import threading

    rng = random.Random(7)
    trie = NativeSuffixTrie(12)
    texts = [[rng.randrange(6) for _ in range(200)] for _ in range(4)]
    for text in texts:
        trie.insert(text)
    params = dict(max_match_length=8, spec_factor=1.0, spec_offset=4.0, max_nodes=24, max_depth=6,
                  min_token_prob=0.0, tree=True)
    contexts = [text[i : i + 10] for text in texts for i in range(0, 180, 9)]
    want = [(list(trie.active_after(c)), trie.best_draft(trie.active_after(c), **params)) for c in contexts]
    wrong = []

    def read(offset: int) -> None:
        for k in range(len(contexts)):
            i = (k + offset) % len(contexts)
            active = trie.follow_many([], contexts[i])
            if (list(active), trie.best_draft(active, **params)) != want[i]:
                wrong.append(i)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=read, args=(o,)) for o in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong and sum(d is not None for _, d in want) > len(contexts) // 2
