"""Arbitrated (lossy, opt-in) greedy verification of a draft tree: CoSpec, FLy and typical acceptance.

At every node on the way down, the target's choice t is its argmax; the draft's choice d is the argmax of the
drafter's `next_probs` at that node (or, for drafters that report no distributions, the node's first child).
Where d != t an `Arbiter` decides which one is kept; verification then continues below the kept token if the
tree has a node for it, and stops otherwise: the kept token is this step's last token. So the "bonus" token is
arbitrated like every other one, which is what makes the two constant arbiters exact:

- never keep d: the walk is `verify_greedy` node for node (lossless greedy output);
- always keep d: every committed token is the draft model's own argmax, the last one of each step included
  (the drafter reports its distribution after the leaf), and the first new token is arbitrated too (the drafter
  is begun before the first token is committed), so the output is the draft model's plain greedy output.

Sampling is not defined for these rules: `from_config` refuses `do_sample=True`. The arbiters themselves (the learned
CoSpec model, FLy's gate, Medusa's typical acceptance) live in `hf_hybrid_spec.cospec`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..cospec.arbiters import Arbiter, FlyGate, Mismatch, TypicalAcceptance
from ..drafters import DraftBudget
from ..tree import VerifyResult, VerifyTree, build_verify_tree
from .base import FirstToken, StepInputs, Verifier

__all__ = ["ArbitratedResult", "verify_arbitrated", "ArbitratedVerifier", "from_config", "load_arbiter"]


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
    from ..cospec.modeling import CoSpecArbiter

    return CoSpecArbiter.from_pretrained(path).eval()


def load_arbiter(arbiter) -> Arbiter:
    """An `Arbiter` from an instance, or from a saved `CoSpecArbiter` (directory or Hub id; loaded once)."""
    if isinstance(arbiter, Arbiter):
        return arbiter
    if isinstance(arbiter, (str, os.PathLike)):
        return _load_cached(os.fspath(arbiter))
    raise TypeError(f"arbiter must be an Arbiter or the path / Hub id of a saved CoSpecArbiter, got {arbiter!r}")


class ArbitratedVerifier(Verifier):
    """Greedy verification with an arbiter at every draft / target mismatch (see the module docstring)."""

    wants_empty_drafts = True  # the token after the root is arbitrated too, at the end of a request included

    def __init__(self, arbiter: Arbiter):
        self.arbiter = arbiter
        self.uses_target_hidden = bool(arbiter.uses_target_hidden)

    def verify(self, tree: VerifyTree, scores: torch.Tensor, inputs: StepInputs) -> ArbitratedResult:
        hidden = inputs.hidden_states[-1][0] if self.uses_target_hidden else None
        return verify_arbitrated(tree, scores, self.arbiter, inputs.length, hidden)

    def first_token(self, scores: torch.Tensor, inputs: FirstToken) -> ArbitratedResult:
        """The first new token is arbitrated too: the drafter (begun on the prompt) is asked for its choice after it,
        for drafters that report distributions; the target's argmax otherwise."""
        drafter = inputs.drafter
        draft = None
        if getattr(drafter, "next_probs", False):
            draft = drafter.propose(inputs.input_ids, DraftBudget(max_nodes=inputs.max_nodes, max_depth=0))
            draft = draft.truncate_depth(0)
        if draft is None or draft.next_probs is None:
            token = scores.argmax(dim=-1).view(1)
            return ArbitratedResult(path=[0], tokens=token, score_nodes=[0], token_list=token.tolist())
        tree = build_verify_tree(inputs.input_ids[:, -1], draft)
        hidden = inputs.outputs.hidden_states[-1][0, -1:] if self.uses_target_hidden else None
        return verify_arbitrated(tree, scores, self.arbiter, inputs.input_ids.shape[1], hidden)


def from_config(config, do_sample: bool, drafter) -> ArbitratedVerifier:
    """The arbitrated rule `config.verification` names ("cospec", "fly" or "typical")."""
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
    if hasattr(drafter, "next_probs"):
        drafter.next_probs = True  # a drafter that can report its distributions does, for the arbiter to read
    if arbiter.needs_draft_probs and not getattr(drafter, "next_probs", False):
        raise ValueError(
            f"the {type(arbiter).__name__} arbiter reads the draft's next-token distributions: use drafter='model' "
            "with draft_model= (or a drafter with next_probs=True)"
        )
    return ArbitratedVerifier(arbiter)
