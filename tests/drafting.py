"""Test drafters: trees of controlled shape around a known continuation."""

import torch

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
