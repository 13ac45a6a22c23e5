"""Sampling in a left-padded batch is distribution-exact: each row's first generated tokens follow the target's law
given that row's ids (padding included, as stock's processors see them), with the processors of each preset applied
at every node of every row at once (`verification.batch_choices`).

Chi-square goodness of fit at a fixed seed, p > 1e-3 to pass; the same counts must reject the target's law with 2% of
its probability moved from its likeliest cell to the next (p < 1e-3), so the test can see a shift that small."""

import pytest
import torch
from helpers import chi2_pvalue, drafter_kwargs
from transformers import (LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import tiny_model

V = 8
PAD = 1
PROMPTS = ([2, 5, 3, 7, 2, 5, 3], [4, 6, 3, 4])  # the second left-padded to the first's length
COPIES = 32  # rows per prompt in each call (each row draws with its own key)
CALLS = 150  # 4,800 samples per prompt

PRESETS = {
    # (generate kwargs, the processors stock builds from them for a row behind `padding` pad tokens, in its order:
    # its repetition penalty leaves each row's padding out)
    "sampling": (dict(temperature=0.7, top_k=5, top_p=0.9),
                 lambda padding: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9)]),
    "penalties": (dict(temperature=0.8, repetition_penalty=1.5, no_repeat_ngram_size=2),
                  lambda padding: [RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=padding),
                                   NoRepeatNGramLogitsProcessor(2), TemperatureLogitsWarper(0.8)]),
}


def exact_law(model, prompt: list[int], padding: int, processors) -> torch.Tensor:
    """P(generated tokens 2 and 3) [V * V] for `prompt` behind `padding` pad tokens: summed over token 1, each step's
    distribution the processed softmax given the ids so far (the padded ids, their mask and positions, as stock runs a
    padded row: the recurrent layers' state is not quite the unpadded prompt's)."""
    law = torch.zeros(V, V)
    pads = [PAD] * padding

    def step(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([pads + prompt + tokens])
        mask = torch.tensor([[0] * padding + [1] * (len(prompt) + len(tokens))])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[0, -1].float()
        return torch.softmax(processors(ids, logits[None].clone())[0], dim=-1)

    first = step([])
    for a in range(V):
        if first[a] == 0:
            continue
        second = step([a])
        for b in range(V):
            if second[b] > 0:
                law[b] += first[a] * second[b] * step([a, b])
    return law.flatten()


def shifted(law: torch.Tensor, mass: float = 0.02) -> torch.Tensor:
    top = law.argsort(descending=True)
    moved = law.clone()
    moved[top[0]] -= mass
    moved[top[1]] += mass
    return moved


@pytest.mark.slow
@pytest.mark.parametrize("preset,drafter", [("sampling", "suffix"), ("penalties", "ngram"), ("sampling", "eagle")])
def test_each_rows_tokens_follow_the_targets_law(preset, drafter):
    """Trees that are a function of the context (suffix matches; EAGLE's top-k expansion of a random head, batched)
    and chains (n-gram): the keyed rule. (No built-in drafter samples its drafts; the lossless rule for drafts that
    carry their distribution is tests/verification/test_sampling.py's, one request at a time.)"""
    model = tiny_model("qwen3_5_text", vocab_size=V, seed=3)
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS for _ in range(COPIES)])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS for _ in range(COPIES)])
    kwargs, processors = PRESETS[preset]
    if drafter == "eagle":  # a random head
        drafting = drafter_kwargs(drafter, model)
    else:
        drafting = dict(assistant_config=H.AssistantConfig(drafter=drafter, global_cache=False))
    counts = torch.zeros(len(PROMPTS), V * V)
    torch.manual_seed(2024)
    for _ in range(CALLS):
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, do_sample=True, max_new_tokens=3,
                             eos_token_id=None, custom_generate=H.speculative_generate, **drafting, **kwargs)
        cells = out[:, width + 1] * V + out[:, width + 2]
        for p in range(len(PROMPTS)):
            counts[p] += torch.bincount(cells[p * COPIES : (p + 1) * COPIES], minlength=V * V)
    for p, prompt in enumerate(PROMPTS):
        padding = width - len(prompt)
        law = exact_law(model, prompt, padding, LogitsProcessorList(processors(padding)))
        assert chi2_pvalue(counts[p], law) > 1e-3, (preset, p)
        assert chi2_pvalue(counts[p], shifted(law)) < 1e-3, (preset, p)
