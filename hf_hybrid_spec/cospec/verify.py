"""Arbitrated (lossy) greedy verification of a draft tree, and the hook the generate loop calls.

At every node on the way down, the target's choice t is its argmax; the draft's choice d is the argmax of the
drafter's `next_probs` at that node (or, for drafters that report no distributions, the node's first child).
Where d != t an `Arbiter` decides which one is kept; verification then continues below the kept token if the
tree has a node for it, and stops otherwise: the kept token is this step's last token. So the "bonus" token is
arbitrated like every other one, which is what makes the two constant arbiters exact:

- never keep d: the walk is `verify_greedy` node for node (lossless greedy output);
- always keep d: every committed token is the draft model's own argmax, the last one of each step included
  (the drafter reports its distribution after the leaf), and the first new token is arbitrated too (the drafter
  is begun before the first token is committed), so the output is the draft model's plain greedy output.

Sampling is not defined for these rules: `make_lossy_verifier` refuses `do_sample=True`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..drafters import DraftBudget, DraftContext, Drafter, TargetHidden
from ..tree import VerifyTree, build_verify_tree
from ..verify import VerifyResult
from .arbiters import Arbiter, FlyGate, Mismatch, TypicalAcceptance

__all__ = ["ArbitratedResult", "verify_arbitrated", "LossyVerifier", "make_lossy_verifier", "load_arbiter"]


@dataclass
class ArbitratedResult(VerifyResult):
    """A `VerifyResult` plus what the arbiter did.

    Attributes:
        decisions: mismatches the arbiter ruled on.
        overrides: of those, where it kept the draft's token.
    """

    decisions: int = 0
    overrides: int = 0


def _child_with(kids: list[int], tokens: list[int], token: int) -> int | None:
    return next((c for c in kids if tokens[c] == token), None)


def verify_arbitrated(
    tree: VerifyTree, scores: torch.Tensor, arbiter: Arbiter, length: int, hidden: torch.Tensor | None = None
) -> ArbitratedResult:
    """Greedy verification with an arbiter at every draft/target mismatch.

    Args:
        tree: the verify tree (root first); `tree.draft.next_probs` [1, N, V] gives the draft's choices.
        scores: [N, V] processed target scores.
        arbiter: decides each mismatch.
        length: committed tokens (the root is the last of them).
        hidden: optional [N, H] target hidden states, for arbiters that read them.
    """
    best = scores.argmax(dim=-1).tolist()
    tokens = tree.token_list(0)
    children = tree.children(0)
    depth = tree.depth[0].tolist()
    n = len(tokens)
    next_probs = None if tree.draft is None or tree.draft.next_probs is None else tree.draft.next_probs[0]
    if next_probs is not None:
        choice: list[int | None] = next_probs.argmax(dim=-1).tolist()
    else:
        choice = [tokens[kids[0]] if kids else None for kids in children]
    # agree[i]: tokens accepted by exact matching below node i (nodes are in topological order).
    agree = [0] * n
    for i in reversed(range(n)):
        c = _child_with(children[i], tokens, best[i])
        agree[i] = 0 if c is None else 1 + agree[c]

    path = [0]
    new_tokens: list[int] = []
    decisions = overrides = 0
    node = 0
    while True:
        keep = best[node]
        d = choice[node]
        if d is not None and d != keep:
            below = _child_with(children[node], tokens, d)
            mismatch = Mismatch(
                node=node, depth=depth[node], position=length + depth[node], draft_token=d, target_token=keep,
                target_logits=scores[node], draft_probs=None if next_probs is None else next_probs[node],
                draft_continues=below is not None, agreement_below=0 if below is None else agree[below],
                target_hidden=None if hidden is None else hidden[node],
            )
            decisions += 1
            if arbiter.decide(mismatch):
                keep = d
                overrides += 1
        new_tokens.append(keep)
        nxt = _child_with(children[node], tokens, keep)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return ArbitratedResult.from_host(path, new_tokens, scores.device, decisions=decisions, overrides=overrides)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> Arbiter:
    from .modeling import CoSpecArbiter

    return CoSpecArbiter.from_pretrained(path).eval()


def load_arbiter(arbiter) -> Arbiter:
    """An `Arbiter` from an instance, or from a saved `CoSpecArbiter` (directory or Hub id; loaded once)."""
    if isinstance(arbiter, Arbiter):
        return arbiter
    if isinstance(arbiter, (str, os.PathLike)):
        return _load_cached(os.fspath(arbiter))
    raise TypeError(f"arbiter must be an Arbiter or the path / Hub id of a saved CoSpecArbiter, got {arbiter!r}")


class LossyVerifier:
    """What the generate loop calls when `verification != "lossless"`."""

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter

    @property
    def uses_target_hidden(self) -> bool:
        return bool(self.arbiter.uses_target_hidden)

    def verify(self, tree: VerifyTree, scores: torch.Tensor, length: int, outputs) -> ArbitratedResult:
        """Verify one tree; `outputs` is the target's forward output (hidden states when asked for)."""
        hidden = outputs.hidden_states[-1][0] if self.uses_target_hidden else None
        return verify_arbitrated(tree, scores, self.arbiter, length, hidden)

    def first_token(
        self, drafter: Drafter, input_ids: torch.Tensor, context: DraftContext, prompt_hidden: TargetHidden | None,
        scores: torch.Tensor, outputs, max_nodes: int,
    ) -> ArbitratedResult | None:
        """Arbitrate the first new token: `scores` [1, V] are the target's processed prefill scores.

        Begins `drafter` on the prompt to read its choice after it; only for drafters that report `next_probs`
        and keep their state across a second `begin` on the same prompt (the model drafter). None otherwise.
        """
        if not getattr(drafter, "next_probs", False):
            return None
        drafter.begin(input_ids, context, prompt_hidden)
        draft = drafter.propose(input_ids, DraftBudget(max_nodes=max_nodes, max_depth=0)).truncate_depth(0)
        if draft.next_probs is None:
            return None
        tree = build_verify_tree(input_ids[:, -1], draft)
        hidden = outputs.hidden_states[-1][0, -1:] if self.uses_target_hidden else None
        return verify_arbitrated(tree, scores, self.arbiter, input_ids.shape[1], hidden)


def make_lossy_verifier(config, do_sample: bool, drafter: Drafter) -> LossyVerifier | None:
    """The verifier `config.verification` asks for; None for "lossless" (the default, untouched path)."""
    if config.verification == "lossless":
        return None
    if do_sample:
        raise NotImplementedError(
            f"verification={config.verification!r} is defined for greedy decoding only; pass do_sample=False "
            "(sampling keeps the lossless rule)"
        )
    if config.verification == "fly":
        arbiter: Arbiter = FlyGate(config.fly_entropy_threshold, config.fly_window)
    elif config.verification == "typical":
        arbiter = TypicalAcceptance(config.typical_epsilon, config.typical_delta, config.typical_temperature)
    else:
        arbiter = load_arbiter(config.arbiter)
    if arbiter.needs_draft_probs and not getattr(drafter, "next_probs", False):
        raise ValueError(
            f"the {type(arbiter).__name__} arbiter reads the draft's next-token distributions: use drafter='model' "
            "with draft_model= (or a drafter with next_probs=True)"
        )
    return LossyVerifier(arbiter)
