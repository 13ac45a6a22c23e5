"""Assistant-model drafter: any causal LM with the target's vocabulary, hybrid ones included.

The assistant keeps its own `HybridTreeCache` in step with the committed tokens: each proposal first feeds it
the tokens committed since the last one (the root included), then drafts

- a chain (`top_k == 1`): greedy decoding for up to `max_depth` tokens, after which the cache is rolled back
  to the committed point (a snapshot of its recurrent states and a crop of its attention layers), or
- a tree (`top_k > 1`, EAGLE-2 style): each step expands the top-k children of the `top_k` most probable
  frontier nodes with one tree forward of the assistant (never committed), and the best `max_nodes` nodes
  by path log-probability form the draft.

Drafts are deterministic, so sampling verification stays lossless without draft probabilities.

With `next_probs=True` (set by the lossy verification rules, `verification.arbitrated`) every proposal also
carries the assistant's full next-token distribution after the root and after every node, leaves included:
a chain costs one more assistant forward (the last token's), a tree one more tree forward over the kept nodes.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..cache import HybridTreeCache
from ..forward import forward_tokens, forward_tree
from ..models import get_adapter
from ..tree import DraftTree, VerifyTree, chain_tree, empty_draft
from .base import DraftBudget, Drafter, check_top_k

__all__ = ["ModelDrafter", "check_same_vocabulary", "from_config"]


def check_same_vocabulary(target: nn.Module, draft: nn.Module) -> None:
    """Raise ValueError unless the two models share a vocabulary (same size, same special tokens)."""
    tv = target.config.get_text_config().vocab_size
    dv = draft.config.get_text_config().vocab_size
    if tv != dv:
        raise ValueError(
            f"the draft model has a vocabulary of {dv} tokens but the target has {tv}: speculative decoding "
            "needs a drafter that uses the target's tokenizer"
        )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        a = getattr(target.generation_config, attr, None)
        b = getattr(draft.generation_config, attr, None)
        if a is not None and b is not None and a != b:
            raise ValueError(f"target and draft model disagree on {attr} ({a} vs {b}): different tokenizers?")


class ModelDrafter(Drafter):
    name = "model"
    catches_up = True  # each `propose` feeds the assistant every committed token since the last one

    def __init__(self, draft_model: nn.Module, top_k: int = 1, next_probs: bool = False):
        self.model = draft_model
        self.top_k = top_k
        self.next_probs = next_probs
        get_adapter(draft_model)  # routes its recurrent layers for tree forwards, or raises for unsupported models
        self.cache: HybridTreeCache | None = None
        self.processed = 0

    def begin(self, input_ids: torch.Tensor, context=None, hidden=None) -> None:
        self.cache = HybridTreeCache(self.model.config)
        self.processed = 0

    def release(self) -> None:
        self.cache = None

    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        device = self.model.device
        length = input_ids.shape[1]
        new = input_ids[:, self.processed :].to(device)
        positions = torch.arange(self.processed, length, device=device).unsqueeze(0)
        out = forward_tokens(self.model, new, self.cache, position_ids=positions, logits_to_keep=1)
        self.processed = length
        logits = out.logits[:, -1].float()
        if self.next_probs and budget.max_depth <= 0:
            # Nothing to draft, but lossy verification still needs the assistant's choice after the root.
            draft = dataclasses.replace(empty_draft(1, logits.device), next_probs=torch.softmax(logits, dim=-1)[:, None])
        elif self.top_k == 1:
            draft = self._chain(logits, length, min(budget.max_nodes, budget.max_depth))
        else:
            draft = self._tree(logits, length, budget)
        # Tokens, parents and scores on the host (one read; trimming, layout and verification then read no device
        # memory); the assistant's distributions, when lossy verification asked for them, stay on its device.
        return DraftTree(
            tokens=draft.tokens.cpu(),
            parents=draft.parents.cpu(),
            scores=None if draft.scores is None else draft.scores.cpu(),
            info={"drafter": "model"},
            next_probs=draft.next_probs,
        )

    def _chain(self, logits: torch.Tensor, length: int, steps: int) -> DraftTree:
        if steps <= 0:
            return empty_draft(1, logits.device)
        snap = self.cache.snapshot()
        tokens = []
        dists = [torch.softmax(logits, dim=-1)] if self.next_probs else []
        try:
            for d in range(steps):
                tok = logits.argmax(dim=-1, keepdim=True)  # [1, 1]
                tokens.append(tok)
                if d + 1 == steps and not self.next_probs:
                    break
                pos = torch.tensor([[length + d]], device=logits.device)
                logits = forward_tokens(self.model, tok, self.cache, position_ids=pos).logits[:, -1].float()
                if self.next_probs:
                    dists.append(torch.softmax(logits, dim=-1))
        finally:
            self.cache.restore(snap)
        chain = chain_tree(torch.cat(tokens, dim=1).cpu())  # one read; the parents are built on the host
        if self.next_probs:
            chain = dataclasses.replace(chain, next_probs=torch.stack(dists, dim=1))  # [1, steps + 1, V]
        return chain

    def _tree(self, logits: torch.Tensor, length: int, budget: DraftBudget) -> DraftTree:
        k = self.top_k
        dev = logits.device
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # cumulative log-probability of each node's path
        logp = torch.log_softmax(logits[0], dim=-1)
        top = logp.topk(k)
        frontier = []
        for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
            tokens.append(tok)
            parents.append(-1)
            scores.append(lp)
            frontier.append(len(tokens) - 1)
        for _depth in range(1, budget.max_depth):
            if len(tokens) >= 4 * budget.max_nodes:
                break
            # Expand the k best frontier nodes: one tree forward over the draft so far (root = last committed).
            frontier = sorted(frontier, key=lambda i: -scores[i])[:k]
            # The assistant already holds the root, so the draft nodes hang off its committed state directly.
            sub = VerifyTree.from_parents(torch.tensor([tokens], device=dev), torch.tensor([parents], device=dev))
            out = forward_tree(self.model, sub, self.cache, length, torch.tensor([length], device=dev))
            self.cache.abort()
            node_logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [M, V]
            new_frontier = []
            for i in frontier:
                top = node_logp[i].topk(k)
                for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                    tokens.append(tok)
                    parents.append(i)
                    scores.append(scores[i] + lp)
                    new_frontier.append(len(tokens) - 1)
            frontier = new_frontier
        # Global top nodes by path log-probability; a parent never scores below its child, and ties are
        # broken by index, so the kept set is closed under parents and stays in topological order.
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: budget.max_nodes]
        keep = torch.tensor(sorted(order), dtype=torch.long)
        full = DraftTree(
            tokens=torch.tensor([tokens], dtype=torch.long),
            parents=torch.tensor([parents], dtype=torch.long),
            scores=torch.tensor([scores], dtype=torch.float32).exp(),
        )
        kept = full.select(keep)  # on the host, where the lists are
        if self.next_probs:
            # The expansion forwards never ran the deepest kept nodes: one tree forward over the kept tree gives the
            # assistant's distribution after every node.
            sub = VerifyTree.from_parents(kept.tokens.to(dev), kept.parents.to(dev))
            out = forward_tree(self.model, sub, self.cache, length, torch.tensor([length], device=dev))
            self.cache.abort()
            node_probs = torch.softmax(out.logits[0].float(), dim=-1)  # [M, V]
            kept = dataclasses.replace(
                kept, next_probs=torch.cat([torch.softmax(logits, dim=-1), node_probs], dim=0).unsqueeze(0)
            )
        return kept


def from_config(config, target: nn.Module, draft_model: nn.Module | None) -> ModelDrafter:
    """`drafter="model"`: `draft_model` any causal LM with the target's vocabulary."""
    if draft_model is None:
        raise ValueError("the 'model' drafter needs a draft model: pass draft_model= (or assistant_model= after enable())")
    if getattr(getattr(draft_model, "config", None), "model_type", None) == "hf_hybrid_spec_eagle3":
        raise ValueError("draft_model is an EagleDrafter: pass assistant_config=AssistantConfig(drafter='eagle', ...)")
    check_same_vocabulary(target, draft_model)
    check_top_k(config.draft_top_k, draft_model)
    return ModelDrafter(draft_model, top_k=config.draft_top_k)
