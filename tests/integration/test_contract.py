"""transformers' own generation contract on every supported family, after `hf_hybrid_spec.enable(model)`.

The assisted-decoding and prompt-lookup tests of transformers' `GenerationTesterMixin` (tests/generation/test_utils.py),
written again here from their public behaviour: with `assistant_model=` (a random one, or the model itself) or
`prompt_lookup_num_tokens=`, greedy output is stock greedy's, and every output field (scores, logits, attentions,
hidden states) has the shape stock generation gives it, one entry per generated token. Plus the stronger check the
package promises: those fields equal stock greedy's tensor for tensor, for chain and tree drafts.
"""

import pytest
import torch
from helpers import RandomTreeDrafter

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import TINY_FAMILIES, tiny_model, tiny_vlm

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT_FAMILIES = sorted(TINY_FAMILIES)
FAMILIES = TEXT_FAMILIES + ["qwen3_5-vlm", "qwen3_5_moe-vlm"]
# The logits processors transformers' tests add (bad words, a repetition penalty, invalid-value removal).
PROCESSORS = dict(bad_words_ids=[[1, 0]], repetition_penalty=1.2, remove_invalid_values=True)
NEW_TOKENS = 4


def build(family: str, seed: int = 0):
    """(model on eager attention, generate inputs): a prompt of 10 tokens, or for a VLM its image prompt."""
    if family.endswith("-vlm"):
        model, inputs = tiny_vlm(family.removesuffix("-vlm"))
    else:
        model = tiny_model(family, seed=seed)
        ids = torch.randint(2, 90, (1, 10), generator=torch.Generator().manual_seed(seed))
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    model.set_attn_implementation("eager")  # attention weights are only returned by eager attention
    return model, inputs


def contract_kwargs(max_new_tokens=NEW_TOKENS):
    return dict(max_new_tokens=max_new_tokens, num_beams=1, eos_token_id=None, output_scores=True, output_logits=True,
                output_attentions=True, output_hidden_states=True, return_dict_in_generate=True, use_cache=True,
                **PROCESSORS)


def check_shapes(out, model, prompt_length: int) -> None:
    """The shapes stock generation gives: per generated token i, attentions [1, heads, q, k] for each attention
    layer and hidden states [1, q, hidden] for the embeddings and each layer, with q = the prompt length and k = q for
    the first token, then q = 1 and k = prompt length + i."""
    text = model.config.get_text_config()
    new = out.sequences.shape[1] - prompt_length
    assert new == NEW_TOKENS
    assert len(out.scores) == len(out.logits) == new
    assert all(t.shape == (1, text.vocab_size) for t in out.scores + out.logits)
    assert len(out.attentions) == len(out.hidden_states) == new
    layers = len(out.attentions[0])
    assert layers > 0
    for i in range(new):
        q = prompt_length if i == 0 else 1
        k = prompt_length if i == 0 else prompt_length + i
        assert len(out.attentions[i]) == layers
        assert all(a.shape == (1, text.num_attention_heads, q, k) for a in out.attentions[i]), i
        assert len(out.hidden_states[i]) == text.num_hidden_layers + 1
        assert all(h.shape == (1, q, text.hidden_size) for h in out.hidden_states[i]), i


def check_similar(ref, out) -> None:
    """As transformers' `_check_similar_generate_outputs`: the same sequences, or scores that agree at the first
    mismatch (a near-tie resolved the other way)."""
    if torch.equal(ref.sequences, out.sequences):
        return
    first = int((ref.sequences != out.sequences).int().argmax()) - (ref.sequences.shape[1] - len(ref.scores))
    torch.testing.assert_close(ref.scores[first], out.scores[first], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("assistant", ["random", "same"])
@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_decoding_matches_greedy_search(family, assistant):
    model, inputs = build(family)
    ref = model.generate(**inputs, do_sample=False, **contract_kwargs())
    if assistant == "same":
        draft = model
    elif family.endswith("-vlm"):
        draft = tiny_model(family.removesuffix("-vlm") + "_text", seed=1)  # an assistant reads the text only
    else:
        draft = tiny_model(family, seed=1)
    H.enable(model)
    out = model.generate(**inputs, do_sample=False, assistant_model=draft, **contract_kwargs())
    check_similar(ref, out)
    for o in (ref, out):
        check_shapes(o, model, inputs["input_ids"].shape[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_decoding_sample(family):
    model, inputs = build(family)
    H.enable(model)
    torch.manual_seed(0)
    out = model.generate(**inputs, do_sample=True, top_k=10, top_p=0.7, temperature=0.7, assistant_model=model,
                         **contract_kwargs())
    check_shapes(out, model, inputs["input_ids"].shape[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_decoding_matches_greedy_search(family):
    model, inputs = build(family)
    ref = model.generate(**inputs, do_sample=False, **contract_kwargs())
    H.enable(model)
    out = model.generate(**inputs, do_sample=False, prompt_lookup_num_tokens=2, max_matching_ngram_size=2,
                         **contract_kwargs())
    check_similar(ref, out)
    check_shapes(out, model, inputs["input_ids"].shape[1])


class ReferenceChainDrafter(RandomTreeDrafter):
    """Chains along the reference output, cut at a random length and corrupted at a random place."""

    def propose(self, input_ids, budget):
        from hf_hybrid_spec.tree import DraftTree, chain_tree

        start = input_ids.shape[1]
        want = min(budget.max_depth, 1 + self._rand(5))
        tokens = self.reference[start : start + want]
        if not tokens:
            return super().propose(input_ids, budget)
        if self._rand(3) == 0:
            tokens[self._rand(len(tokens))] = self._rand(self.vocab)
        tree = chain_tree(torch.tensor([tokens]))
        return DraftTree(tokens=tree.tokens, parents=tree.parents)


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_equal_stock_greedy_tensor_for_tensor(family, shape):
    model, inputs = build(family)
    kwargs = contract_kwargs(max_new_tokens=12)
    ref = model.generate(**inputs, do_sample=False, **kwargs)
    cls = ReferenceChainDrafter if shape == "chain" else RandomTreeDrafter
    out = model.generate(**inputs, do_sample=False, custom_generate=H.speculative_generate,
                         drafter=cls(model.config.get_text_config().vocab_size, reference=ref.sequences), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.spec_stats.target_forwards < 12  # drafts were accepted: some steps committed several tokens
    for field in ("scores", "logits"):
        for a, b in zip(getattr(ref, field), getattr(out, field), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for field in ("attentions", "hidden_states"):
        for step_ref, step_out in zip(getattr(ref, field), getattr(out, field), strict=True):
            for a, b in zip(step_ref, step_out, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_prompt_with_an_image_under_every_drafter(family, compile):
    """The vision encoder runs once (stock generate runs it before decoding), the prompt's multimodal positions are
    continued by every draft: identity with plain generate for each built-in drafter."""
    from helpers import BUILTIN_DRAFTERS, drafter_kwargs

    model, inputs = tiny_vlm(family)
    ref = model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)
    other = dict(inputs, pixel_values=torch.randn(inputs["pixel_values"].shape, generator=torch.Generator().manual_seed(7)))
    assert not torch.equal(model.generate(**other, max_new_tokens=16, do_sample=False, eos_token_id=None), ref)
    assistant = tiny_model(f"{family}_text", seed=1)
    for name in BUILTIN_DRAFTERS:
        kwargs = drafter_kwargs(name, model, compile=compile, draft_model=assistant if name == "model" else None)
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None,
                             custom_generate=H.speculative_generate, **kwargs)
        assert torch.equal(out, ref), name
