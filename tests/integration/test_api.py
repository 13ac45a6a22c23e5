"""Public API: config validation and round trip, enable(), output format, streamers, bad input."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import tiny_model


def ids_of(n=10, seed=0):
    return torch.randint(2, 96, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- AssistantConfig
def test_config_round_trip(tmp_path):
    cfg = H.AssistantConfig(drafter="ngram", max_draft_tokens=5, ngram_size=2, min_token_prob=0.2)
    path = cfg.save_pretrained(tmp_path)
    assert json.loads(open(path).read())["drafter"] == "ngram"
    assert H.AssistantConfig.from_pretrained(tmp_path) == cfg
    assert H.AssistantConfig.from_pretrained(path) == cfg
    assert H.AssistantConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(drafter="nope"), "drafter"),
        (dict(max_draft_tokens=0), "max_draft_tokens"),
        (dict(max_depth=-1), "max_depth"),
        (dict(min_token_prob=0.0), "min_token_prob"),
        (dict(min_token_prob=1.5), "min_token_prob"),
        (dict(verification="yolo"), "verification"),
        (dict(kernel_backend="cuda"), "kernel_backend"),
        (dict(tree="yes"), "tree"),
        (dict(compile_drafter=1), "compile_drafter"),
        (dict(ngram_size=2.5), "ngram_size"),
    ],
)
def test_config_rejects_invalid_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        H.AssistantConfig(**kwargs)


def test_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown"):
        H.AssistantConfig.from_dict({"drafter": "suffix", "speed": 11})


# ---------------------------------------------------------------------- output format
def test_output_format_matches_stock_generate():
    model = tiny_model("qwen3_5_text")
    ids = ids_of()
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(drafter="ngram"), **kw)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12 and len(out.logits) == 12
    for a, b in zip(out.scores, ref.scores):
        assert a.shape == b.shape == (1, 96)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    stats = out.spec_stats
    assert isinstance(stats, H.SpecStats)
    assert sum(stats.accepted_lengths) == 12 - 1  # the first token comes from the prefill
    assert stats.target_forwards == len(stats.accepted_lengths) == len(stats.drafted_tokens)
    assert stats.setup_seconds > 0  # the prefill and the first token, timed apart from the steps
    plain_tensor = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None,
                                  custom_generate=H.speculative_generate)
    assert isinstance(plain_tensor, torch.Tensor) and plain_tensor.shape == (1, 15)


def test_min_new_tokens_and_repetition_penalty_are_honoured():
    model = tiny_model("falcon_h1")
    ids = ids_of(8)
    free = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    eos = int(free[0, 9])  # the second generated token
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=1, min_new_tokens=10,
              repetition_penalty=1.3)
    ref = model.generate(ids, **kw)
    out = model.generate(ids, custom_generate=H.speculative_generate, **kw)
    assert torch.equal(out, ref)


def test_repetition_penalty_with_left_padding_on_branching_trees():
    """transformers' repetition penalty keeps the padding of each batch row in a [B] tensor; tree verification calls
    it with one row per node of a depth, which it refused ("Incompatible prompt_ignore_length batch size")."""
    from helpers import RandomTreeDrafter

    model = tiny_model("falcon_h1")
    ids = ids_of(10)
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    kw = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, attention_mask=mask, repetition_penalty=1.2)
    ref = model.generate(ids, **kw)
    for compile_ in (False, True):
        out = model.generate(ids, custom_generate=H.speculative_generate, drafter=RandomTreeDrafter(96, reference=ref),
                             assistant_config=H.AssistantConfig(compile=compile_), **kw)
        assert torch.equal(out, ref)


def test_host_stopping_matches_the_stock_criteria():
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import (
        EosTokenCriteria,
        MaxLengthCriteria,
        MaxTimeCriteria,
    )

    from hf_hybrid_spec.stopping import HostStopping

    stock = StoppingCriteriaList([MaxLengthCriteria(14), EosTokenCriteria([3, 7]), MaxTimeCriteria(60.0)])
    host = HostStopping.build(stock)
    ids = ids_of(16, seed=3)
    ids[0, 5], ids[0, 9] = 3, 7
    for length in range(1, 17):
        prefix = ids[:, :length]
        assert host.stops(length, int(prefix[0, -1])) == bool(stock(prefix, None).any()), length
    assert HostStopping.build(StoppingCriteriaList([MaxTimeCriteria(0.0, initial_timestamp=0.0)])).stops(1, 5)

    class OwnMaxLength(MaxLengthCriteria):  # a subclass may change __call__: it is never decided on the host
        pass

    assert HostStopping.build(StoppingCriteriaList([OwnMaxLength(5)])) is None


@pytest.mark.parametrize("compile", [False, True])
def test_custom_stopping_criteria_stop_where_stock_stops(compile):
    """A criterion of the user's own runs on the device path, one prefix per committed token, as stock does."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    model = tiny_model("qwen3_5_text")
    ids = ids_of(12)
    free = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    stop = int(free[0, 12 + 9])  # the tenth generated token
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None,
              stopping_criteria=StoppingCriteriaList([StopAfter(stop)]))
    ref = model.generate(ids, **kw)
    assert ref.shape[1] < free.shape[1]
    out = model.generate(ids, custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(drafter="ngram", compile=compile), **kw)
    assert torch.equal(out, ref)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True

    def tokens(self):
        return [t for c in self.chunks for t in c]


def test_streamer_receives_prompt_then_every_token():
    model = tiny_model("qwen3_5_text")
    ids = ids_of()
    for route in ("custom_generate", "enable"):
        streamer = Collect()
        if route == "custom_generate":
            out = model.generate(ids, max_new_tokens=15, do_sample=False, eos_token_id=None, streamer=streamer,
                                 custom_generate=H.speculative_generate)
        else:
            m = H.enable(tiny_model("qwen3_5_text"))
            out = m.generate(ids, max_new_tokens=15, do_sample=False, eos_token_id=None, streamer=streamer,
                             prompt_lookup_num_tokens=4)
        assert streamer.ended, route
        assert streamer.tokens() == out[0].tolist(), route


# ---------------------------------------------------------------------- enable()
def stock_prompt_lookup_is_stocks(model, ids) -> bool:
    """Whether stock handles prompt lookup on this hybrid itself: transformers before 5.25 refuses it (a recurrent
    state cannot be cropped), 5.25 on runs chains by keeping the recurrent states of the last steps. Either way no
    speculative statistics come back (stock's own path, not ours)."""
    try:
        out = model.generate(ids, max_new_tokens=5, do_sample=False, prompt_lookup_num_tokens=3,
                             return_dict_in_generate=True)
    except ValueError as err:
        assert "stateful" in str(err) or "cropped" in str(err), err
        return True
    return not hasattr(out, "spec_stats")


def test_enable_routes_stock_kwargs():
    model = tiny_model("qwen3_5_text")
    ids = ids_of()
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert stock_prompt_lookup_is_stocks(model, ids)
    H.enable(model)
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None), ref)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=3,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.spec_stats.target_forwards > 0
    assistant = tiny_model("falcon_h1", seed=5)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, assistant_model=assistant)
    assert torch.equal(out, ref)
    out = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                         assistant_config=H.AssistantConfig(drafter="suffix"))
    assert torch.equal(out, ref)
    other = tiny_model("qwen3_5_text", seed=4)
    assert stock_prompt_lookup_is_stocks(other, ids)  # only the enabled instance changed


# ---------------------------------------------------------------------- bad input
def still_usable(model, ids):
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate)
    assert torch.equal(out, ref)


def test_unsupported_model_lists_supported_families():
    # Pure Mamba-1 (its own MambaCache, no attention layer): not a family the package serves.
    cfg = AutoConfig.for_model("mamba", vocab_size=96, hidden_size=64, num_hidden_layers=2, state_size=8,
                               pad_token_id=1, eos_token_id=0, bos_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="Supported families: qwen3_5.*jamba"):
        model.generate(ids_of(), max_new_tokens=4, custom_generate=H.speculative_generate)
    with pytest.raises(ValueError, match="'mamba'"):
        H.enable(model)


def test_draft_model_with_another_vocabulary():
    model = tiny_model("qwen3_5_text")
    other = tiny_model("llama", vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate(ids_of(), max_new_tokens=4, custom_generate=H.speculative_generate, draft_model=other)
    still_usable(model, ids_of())


def test_empty_prompt_and_zero_new_tokens():
    model = tiny_model("falcon_h1")
    with pytest.raises(ValueError, match="non-empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4, custom_generate=H.speculative_generate)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids_of(), max_new_tokens=0, custom_generate=H.speculative_generate)
    still_usable(model, ids_of())


def test_unsupported_options_raise_clearly():
    model = tiny_model("qwen3_5_text")
    ids = ids_of()
    with pytest.raises(NotImplementedError, match="output_attentions / output_hidden_states need the eager path"):
        model.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate, output_attentions=True,
                       return_dict_in_generate=True, assistant_config=H.AssistantConfig(compile=True))
    with pytest.raises(NotImplementedError, match="guidance_scale"):
        model.generate(ids, max_new_tokens=4, guidance_scale=1.5, custom_generate=H.speculative_generate)
    with pytest.raises(ValueError, match="model drafter|draft model"):
        model.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate,
                       assistant_config=H.AssistantConfig(drafter="model"))
    with pytest.raises(TypeError, match="Drafter"):
        model.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate, drafter=object())
    still_usable(model, ids)


def test_flash_attention_is_refused_with_a_clear_message():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="4D mask"):
        H.get_adapter(model)


def test_failure_inside_verification_leaves_no_pending_tree():
    model = tiny_model("qwen3_5_text")
    ids = ids_of()

    class Boom(H.Drafter):
        calls = 0

        def propose(self, input_ids, budget):
            Boom.calls += 1
            if Boom.calls == 3:
                raise RuntimeError("drafter failed")
            return H.DraftTree(tokens=torch.tensor([[5, 6]]), parents=torch.tensor([[-1, 0]]))

    with pytest.raises(RuntimeError, match="drafter failed"):
        model.generate(ids, max_new_tokens=10, custom_generate=H.speculative_generate, drafter=Boom())
    still_usable(model, ids)


def test_drafters_receive_target_hidden_states_of_every_token_run():
    model = tiny_model("falcon_h1")
    ids = ids_of(9)

    class Recorder(H.Drafter):
        target_hidden_layers = (0, 2, -1)

        def __init__(self):
            self.seen = []

        def begin(self, input_ids, context, hidden=None):
            assert context.target is model and context.cache.is_ready()
            self.seen.append(hidden.states)

        def accept(self, input_ids, result, hidden=None):
            if hidden is not None:
                self.seen.append(hidden.states)

        def propose(self, input_ids, budget):
            return H.DraftTree(tokens=torch.tensor([[5, 7, 9]]), parents=torch.tensor([[-1, 0, -1]]))

    rec = Recorder()
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate, drafter=rec)
    ran = out[:, :-1]  # the last token is the next root: never run through the target
    with torch.no_grad():
        ref = model(input_ids=ran, output_hidden_states=True).hidden_states
    for k, layer in enumerate(Recorder.target_hidden_layers):
        got = torch.cat([s[k] for s in rec.seen], dim=1)
        torch.testing.assert_close(got, ref[layer], rtol=1e-4, atol=1e-4)


def test_suffix_drafter_reads_the_live_global_cache():
    """A drafter built before its request (HVD builds its cache drafter ahead; a user may clear the process-wide
    cache in between) must draft from, and add to, the cache that is live when the request begins."""
    H.clear_global_suffix_cache()
    early = H.SuffixDrafter(cache_key=("live-cache-test",))
    H.clear_global_suffix_cache()
    earlier_request = H.SuffixDrafter(cache_key=("live-cache-test",))
    ids = torch.tensor([[1, 2, 7, 8, 9, 10, 11, 12]])
    earlier_request.begin(ids[:, :2])
    earlier_request.end(ids)  # its output 7..12 goes to the process-wide cache
    context = torch.tensor([[3, 7, 8]])
    early.begin(context)
    draft = early.propose(context, H.DraftBudget(max_nodes=8, max_depth=8))
    assert draft.tokens[0, :2].tolist() == [9, 10]  # a match of 2 drafts up to 2 tokens (max_spec_factor 1)
    early.end(torch.cat([context, torch.tensor([[9, 10, 11, 12]])], dim=1))
    later = H.SuffixDrafter(cache_key=("live-cache-test",))
    later.begin(context)
    assert later.global_cache is early.global_cache
    H.clear_global_suffix_cache()


def _trie_table(trie):
    """{substring: (count, total)} of every node of a SuffixTrie, explicit or implicit (its logical content)."""
    table, stack = {}, [((), trie.ROOT)]
    while stack:
        path, node = stack.pop()
        if path:
            table[path] = (trie.count(node), trie.total(node, len(path)))
        stack += [(path + (t,), c) for t, c in trie.children(node, len(path))]
    return table


def _expected_table(seqs, depth):
    """{substring: (count, total)} of the substrings (length <= depth) of `seqs`, counted directly."""
    from collections import Counter

    counts = Counter(tuple(s[i:j]) for s in seqs for i in range(len(s)) for j in range(i + 1, min(len(s), i + depth) + 1))
    totals = Counter()
    for k, c in counts.items():
        if len(k) > 1:
            totals[k[:-1]] += c
    return {k: (c, totals[k]) for k, c in counts.items()}


def test_suffix_trie_counts_and_eviction():
    """The trie counts every substring up to its depth; removing a sequence (the global cache evicting its oldest
    output) leaves exactly the trie of what remains, and freed nodes are reused."""
    from hf_hybrid_spec.drafters.suffix import SuffixTrie

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 5, (n,), generator=g).tolist() for n in (40, 25, 33)]
    trie = SuffixTrie(depth=6)
    ids = [trie.insert(s) for s in seqs]
    table = _trie_table(trie)
    assert table == _expected_table(seqs, 6)
    # Only the substrings seen more than once are stored as nodes (the root too); the rest are positions.
    repeated = sum(1 for c, _ in table.values() if c > 1)
    assert trie.num_nodes <= repeated + 1 < len(table)
    trie.remove(ids[0])
    fresh = fresh_of(seqs[1:])
    assert _trie_table(trie) == _trie_table(fresh) == _expected_table(seqs[1:], 6)
    size = len(trie._count)
    trie.insert(seqs[0])
    assert len(trie._count) == size and _trie_table(trie) == table  # freed ids were reused, nothing grew

    # A copy is independent: what one learns, the other does not see (benchmarks replay calls from a snapshot).
    from hf_hybrid_spec.drafters.suffix import GlobalSuffixCache

    cache = GlobalSuffixCache(depth=6, max_outputs=2)
    cache.add(seqs[1])
    snap = cache.copy()
    cache.add(seqs[2])
    assert _trie_table(snap.trie) == _trie_table(fresh_of([seqs[1]])) and len(snap.outputs) == 1
    assert _trie_table(cache.trie) == _trie_table(fresh_of(seqs[1:]))
    # Bounded by tokens too: past the budget the oldest outputs go.
    cache.max_tokens = len(seqs[0]) + 5
    cache.add(seqs[0])
    assert [n for _, n in cache.outputs] == [len(seqs[0])] and cache.output_tokens == len(seqs[0])
    assert _trie_table(cache.trie) == _trie_table(fresh_of([seqs[0]]))


def fresh_of(seqs, depth=6):
    """The trie of `seqs` built from scratch."""
    from hf_hybrid_spec.drafters.suffix import SuffixTrie

    trie = SuffixTrie(depth=depth)
    for s in seqs:
        trie.insert(s)
    return trie


def _request_trie(tokens, depth=6):
    """A request's trie: one sequence, extended token by token."""
    from hf_hybrid_spec.drafters.suffix import SuffixTrie

    trie, active = SuffixTrie(depth=depth), []
    for t in tokens:
        active = trie.extend(active, t)
    return trie, active


def test_suffix_trie_truncate_leaves_the_trie_of_the_prefix():
    """`truncate(0, keep)` on a request's trie gives exactly the trie of its first `keep` tokens (counts, totals),
    for cuts anywhere, repeats included (a small vocabulary), and its `active_after` state is the one extending would
    have left."""
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        tokens = torch.randint(0, 4, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        keep = int(torch.randint(0, len(tokens) + 1, (1,), generator=g))
        trie, _ = _request_trie(tokens)
        trie.truncate(0, keep)
        expected, active = _request_trie(tokens[:keep])
        assert _trie_table(trie) == _trie_table(expected) == _expected_table([tokens[:keep]], 6), (trial, keep)
        # The active suffixes after the prefix, as paths: what extending token by token leaves.
        expected_paths = [tuple(tokens[keep - 1 - i : keep]) for i in range(len(active))]
        assert [trie.count(n) for n in trie.active_after(tokens[:keep])] == \
            [_trie_table(trie)[p][0] for p in expected_paths]
    # The trie keeps working after a cut: extending it again gives the trie of the new sequence.
    tokens = torch.randint(0, 4, (50,), generator=g).tolist()
    trie, _ = _request_trie(tokens)
    trie.truncate(0, 30)
    active = trie.active_after(tokens[:30])
    for t in [3, 1, 2, 2, 0]:
        active = trie.extend(active, t)
    assert _trie_table(trie) == _trie_table(_request_trie(tokens[:30] + [3, 1, 2, 2, 0])[0])


def test_suffix_drafter_adopts_and_prefeeds_the_trie_it_would_build():
    """The serving engine's path: a request's trie handed off at its end, adopted by the next call and prefed its
    prompt chunk by chunk, leaves `begin` with the trie and the drafts of a drafter that builds its own from the whole
    prompt; an adopted trie the prompt diverges from is cut back to what they share; prefeeding alone works too."""
    from hf_hybrid_spec.drafters import DraftBudget
    from hf_hybrid_spec.tree import VerifyResult

    def drafter():
        return H.SuffixDrafter(use_global=False, max_match_length=8, max_depth=6)

    g = torch.Generator().manual_seed(5)
    prompt, output = torch.randint(0, 7, (1, 120), generator=g), torch.randint(0, 7, (1, 30), generator=g)
    full = torch.cat([prompt, output], 1)
    first = drafter()
    first.begin(prompt)
    first.accept(full, VerifyResult(path=[0], tokens=output[0], score_nodes=[0], token_list=output[0].tolist()))
    carry = first.handoff(full)
    assert carry.sequence(0).tolist() == full[0].tolist() and first.local is not carry
    cases = {"extends": (torch.cat([full, torch.randint(0, 7, (1, 40), generator=g)], 1), carry),
             "diverges": (torch.cat([full[:, :-3], torch.randint(0, 7, (1, 20), generator=g)], 1), carry),
             "prefed only": (torch.randint(0, 7, (1, 90), generator=g), None)}
    for name, (nxt, adopted) in cases.items():
        taken = drafter()
        if adopted is not None:
            taken.adopt(adopted.copy())
        for end in range(1, nxt.shape[1] + 1, 16):  # the chunks as they go in
            taken.prefeed(nxt[0, :end].tolist())
        taken.begin(nxt)
        own = drafter()
        own.begin(nxt)
        assert taken.settle() and own.settle()  # `begin` leaves the prompt's tokens to `settle` (or `propose`)
        assert _trie_table(taken.local) == _trie_table(own.local), name
        ids = nxt
        for _ in range(3):
            drafts = [d.propose(ids, DraftBudget(max_nodes=16, max_depth=6)) for d in (taken, own)]
            assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist(), name
            assert drafts[0].parents.tolist() == drafts[1].parents.tolist(), name
            new = torch.randint(0, 7, (2,), generator=g)
            ids = torch.cat([ids, new.view(1, -1)], 1)
            for d in (taken, own):
                d.accept(ids, VerifyResult(path=[0], tokens=new, score_nodes=[0], token_list=new.tolist()))
        assert drafts[0].num_nodes > 0, name  # the comparison compared something
    # A drafter without a state to hand on ends as before and hands nothing.
    assert H.NgramDrafter().handoff(full) is None


def test_suffix_drafter_takes_over_the_trie_of_an_earlier_call():
    """The next call of an agent loop (its prompt repeats the earlier prompt and output, then diverges at the
    boundary) takes over the earlier request's trie: same trie, same drafts as a drafter that builds its own."""
    from hf_hybrid_spec.drafters import DraftBudget
    from hf_hybrid_spec.tree import VerifyResult

    H.clear_global_suffix_cache()
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 7, (1, 120), generator=g)
    output = torch.randint(0, 7, (1, 30), generator=g)
    first = H.SuffixDrafter(cache_key=("handoff-test",), max_match_length=8, max_depth=6)
    first.begin(prompt)
    tokens = output[0].tolist()
    first.accept(torch.cat([prompt, output], 1), VerifyResult(path=[0], tokens=output[0], score_nodes=[0],
                                                              token_list=tokens))
    first.end(torch.cat([prompt, output], 1))
    cache = first.global_cache
    assert len(cache.finished) == 1
    # The next prompt: the earlier one, its output but the last 2 tokens (re-tokenized differently), new text.
    nxt = torch.cat([prompt, output[:, :-2], torch.randint(0, 7, (1, 40), generator=g)], 1)
    reference_cache = cache.copy()
    reference_cache.finished.clear()
    taken = H.SuffixDrafter(cache_key=("handoff-test",), max_match_length=8, max_depth=6)
    taken.begin(nxt)
    assert len(cache.finished) == 0  # it left the cache
    own = H.SuffixDrafter(cache_key=("handoff-test",), max_match_length=8, max_depth=6)
    H.clear_global_suffix_cache()
    from hf_hybrid_spec.drafters import suffix

    suffix._GLOBAL[(("handoff-test",), 14)] = reference_cache
    own.begin(nxt)
    assert own.global_cache is reference_cache
    assert taken.settle() and own.settle()  # the prompt's tokens wait for `settle` / `propose`
    assert _trie_table(taken.local) == _trie_table(own.local)
    ids = nxt
    for step in range(4):  # drafts at the prompt's end, then after a few accepted tokens
        drafts = [d.propose(ids, DraftBudget(max_nodes=16, max_depth=6)) for d in (taken, own)]
        assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
        assert drafts[0].parents.tolist() == drafts[1].parents.tolist() and torch.equal(drafts[0].scores,
                                                                                        drafts[1].scores)
        new = torch.randint(0, 7, (2,), generator=g)
        ids = torch.cat([ids, new.view(1, -1)], 1)
        for d in (taken, own):
            d.accept(ids, VerifyResult(path=[0], tokens=new, score_nodes=[0], token_list=new.tolist()))
    assert drafts[0].num_nodes > 0  # the comparison compared something
    # A prompt that shares little with the kept tries builds its own (cutting would cost more).
    own.end(ids)
    assert len(reference_cache.finished) == 1
    unrelated = H.SuffixDrafter(cache_key=("handoff-test",), max_match_length=8, max_depth=6)
    other = torch.randint(0, 7, (1, 50), generator=g)
    unrelated.begin(other)
    unrelated.settle()
    assert len(reference_cache.finished) == 1 and unrelated.local.num_nodes > 1
    # The kept tries stay within the token budget (oldest out first); one over it on its own is not kept.
    reference_cache.max_tokens = unrelated.local.num_tokens - 1
    unrelated.end(other)
    assert len(reference_cache.finished) == 0
    H.clear_global_suffix_cache()


def _ngram_reference(seq: list[int], ngram_size: int, want: int) -> list[int]:
    """Prompt lookup written the plain way: scan for the earliest earlier occurrence of the last n tokens."""
    for n in range(min(ngram_size, len(seq) - 1), 0, -1):
        for start in range(len(seq) - n):
            if seq[start : start + n] == seq[-n:]:
                return seq[start + n : start + n + want]
    return []


def test_ngram_index_drafts_what_a_scan_finds():
    from hf_hybrid_spec.drafters import DraftBudget, NgramDrafter
    from hf_hybrid_spec.tree import VerifyResult

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        size, want = 1 + trial % 4, 1 + trial % 7
        seq = torch.randint(0, 6, (1, 30), generator=g)
        drafter = NgramDrafter(ngram_size=size, num_tokens=want)
        drafter.begin(seq[:, :10])
        for end in range(10, 31, 3):  # the loop feeds what it commits through accept
            if end > 10:
                new = seq[0, end - 3 : end].tolist()
                drafter.accept(seq[:, :end], VerifyResult(path=[0], tokens=torch.tensor(new), score_nodes=[0],
                                                          token_list=new))
            draft = drafter.propose(seq[:, :end], DraftBudget(max_nodes=16, max_depth=16))
            assert draft.tokens[0].tolist() == _ngram_reference(seq[0, :end].tolist(), size, want), (trial, end)
            assert draft.num_nodes == 0 or draft.parents[0].tolist() == list(range(-1, draft.num_nodes - 1))
    # Used without begin (outside the loop), it indexes the sequence it is given.
    fresh = NgramDrafter(ngram_size=2, num_tokens=3)
    ids = torch.tensor([[1, 2, 3, 4, 1, 2]])
    assert fresh.propose(ids, DraftBudget(max_nodes=8, max_depth=8)).tokens[0].tolist() == [3, 4, 1]


def test_node_depth_host_walk_matches_the_ancestor_mask():
    from hf_hybrid_spec.kernels.tree import ancestor_mask, node_depth

    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 17, 64):
        parent = torch.tensor([[int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
                               for _ in range(3)])
        expected = ancestor_mask(parent, include_self=True).sum(-1) - 1
        assert torch.equal(node_depth(parent), expected)


def test_speculative_generate_keeps_sdpa_off_cudnn_and_restores_the_setting():
    """cuDNN attention builds a plan per new shape (tens of ms each on an H200; a speculative loop sees a new key
    length every step), so speculative_generate switches it off and puts the user's setting back after, also when
    calls overlap from several threads."""
    import threading

    from hf_hybrid_spec.drafters import Drafter
    from hf_hybrid_spec.forward import sdpa_without_cudnn
    from hf_hybrid_spec.tree import empty_draft

    seen = []

    class Probe(Drafter):
        def propose(self, input_ids, budget):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return empty_draft(1, input_ids.device)

    model = tiny_model("qwen3_5_text")
    ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    initial = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for user_setting in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(user_setting)
            seen.clear()
            model.generate(ids, max_new_tokens=3, do_sample=False, custom_generate=H.speculative_generate,
                           drafter=Probe())
            assert seen and not any(seen)
            assert torch.backends.cuda.cudnn_sdp_enabled() is user_setting

        # Overlapping contexts (two threads): off while either is inside, restored when the last one leaves.
        torch.backends.cuda.enable_cudnn_sdp(True)
        entered, release = threading.Event(), threading.Event()

        def other():
            with sdpa_without_cudnn():
                entered.set()
                release.wait(10)

        thread = threading.Thread(target=other)
        thread.start()
        entered.wait(10)
        with sdpa_without_cudnn():
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # the other thread is still inside
        release.set()
        thread.join(10)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(initial)


@pytest.mark.parametrize("family", ["qwen3_5_text", "falcon_h1"])
def test_a_deep_copy_of_a_used_model_runs_its_own_weights(family):
    """Speculation installs routed forwards on the recurrent mixers; a deep copy (TRL's reference model, an EMA copy)
    must run the copy's weights, in plain forwards and under speculation alike."""
    import copy

    model = tiny_model(family)
    ids = ids_of()
    model.generate(ids, max_new_tokens=4, custom_generate=H.speculative_generate)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
        ref = tiny_model(family)
        ref.load_state_dict(twin.state_dict())
        assert torch.equal(twin(ids).logits, ref(ids).logits)
        assert not torch.equal(twin(ids).logits, model(ids).logits)
    kwargs = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(twin.generate(ids, custom_generate=H.speculative_generate, **kwargs),
                       ref.generate(ids, **kwargs))
    # and the copy's double() reaches its mixers (the closure it replaced kept calling the original's)
    with torch.no_grad():
        assert twin.double()(ids).logits.dtype == torch.float64


def test_every_package_folder_is_installed():
    """pyproject lists packages by hand (the kernels folder is mapped into hf_hybrid_spec): a folder missing there
    works in the editable install the tests use and is absent from a wheel."""
    import pathlib

    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("hf_hybrid_spec", "hf_hybrid_spec"), ("kernels", "hf_hybrid_spec.kernels")):
        for init in (root / top).rglob("__init__.py"):
            rel = init.parent.relative_to(root / top).parts
            found.add(".".join((name, *rel)))
    assert found == listed


def test_num_return_sequences_samples_each_copy_on_its_own():
    """`num_return_sequences=n` with sampling: stock generate repeats each prompt n times, and each copy is a row that
    samples on its own: the first two tokens of 1,200 copies of one prompt follow the target's joint law (chi-square,
    p > 1e-3; a sharper law is rejected), and the call repeats under the same seed, as stock's does."""
    from helpers import chi2_pvalue, target_joint
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    vocab = 8
    model = tiny_model("qwen3_5_text", vocab_size=vocab, seed=5)
    ids = torch.tensor([[2, 5, 3, 2, 5, 3, 2]])
    joint = target_joint(model, ids, LogitsProcessorList([TemperatureLogitsWarper(0.8)]))

    def sample():
        torch.manual_seed(3)
        return model.generate(ids, max_new_tokens=2, do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                              num_return_sequences=1200, eos_token_id=None, pad_token_id=1,
                              custom_generate=H.speculative_generate)

    out = sample()
    assert out.shape == (1200, ids.shape[1] + 2)
    counts = torch.zeros(vocab * vocab)
    for a, c in out[:, ids.shape[1]:].tolist():
        counts[a * vocab + c] += 1
    assert chi2_pvalue(counts, joint) > 1e-3
    assert chi2_pvalue(counts, torch.softmax(2.0 * torch.log(joint + 1e-12), dim=0)) < 1e-3
    assert torch.equal(sample(), out)
