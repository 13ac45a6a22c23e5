"""EAGLE-2 dynamic tree growth over any drafter that runs k tree nodes per step (EAGLE-3 heads, MTP heads).

The root's top-k draft tokens are the first candidates. For each further depth, the k candidates of the last depth
with the best cumulative log-probability are run through the drafter in one batch (each attends to the committed
steps and its own ancestors), and each yields its top-k children as candidates. The draft is the best `max_nodes`
candidates by cumulative log-probability (closed under parents: a child never scores above its parent, ties go to
the earlier node). `top_k = 1` is a greedy chain.

The drafter itself is a callback (`TreeStep`), so the bookkeeping lives here once. For a given (k, max_nodes,
max_depth) every tensor has the same shape at every call and nothing is read back to the host, so a caller may
capture `grow_tree` as a CUDA graph (EAGLE's `StaticEagleTree` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..tree import DraftTree

__all__ = ["TreeCandidates", "TreeStep", "grow_tree", "host_draft"]


@dataclass
class TreeCandidates:
    """Every candidate of one expansion, on the drafter's device.

    Attributes:
        tokens: [C] target-vocabulary ids (C = k + (max_depth - 1) k^2).
        parents: [C] parent candidate of each, -1 for children of the root; topological order.
        scores: [C] cumulative log-probabilities.
        keep: [min(C, max_nodes)] sorted indices of the best candidates (closed under parents).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    keep: torch.Tensor


class TreeStep(Protocol):
    def __call__(self, depth: int, hidden: torch.Tensor, tokens: torch.Tensor,
                 own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the k frontier nodes of `depth` (1-based: depth-1 nodes are the root's children) through the drafter.

        hidden: [k, H] the hidden state each node's parent step produced; tokens: [k] the nodes' draft ids;
        own: bool [k, E + k], which of the E nodes expanded so far (in expansion order) and of these k each node
        may attend to (its ancestors and itself), besides every committed step. Returns (out [k, H], fp32
        log-probabilities [k, draft_vocab] of each node's children). A step that keeps per-node keys and values
        appends these k after the E earlier ones, matching `own`'s layout.
        """


def grow_tree(step: TreeStep, k: int, max_nodes: int, max_depth: int, hidden: torch.Tensor, logp: torch.Tensor,
              to_target: torch.Tensor | None = None) -> TreeCandidates:
    """One EAGLE-2 tree off the newest committed step.

    Args:
        step: runs one depth's k frontier nodes (see `TreeStep`).
        hidden: [1, H] the newest committed step's output; logp: [draft_vocab] its log-probabilities (fp32).
        to_target: [draft_vocab] target id of each draft id (None: the same ids).
    """
    device = logp.device
    top = logp.topk(k)
    cand_tokens = [top.indices]  # draft ids, per depth
    cand_scores = [top.values]  # cumulative log-probabilities
    cand_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    num_cands = k
    # The frontier: candidates to run next (global candidate ids), the hidden state of their parent's step, and
    # their parent's index among the expanded nodes (-1: the root step). It is always k wide.
    frontier = torch.arange(k, device=device)
    frontier_hidden = hidden.expand(k, -1)
    frontier_parent = torch.full((k,), -1, dtype=torch.long, device=device)
    ancestors = torch.zeros(0, 0, dtype=torch.bool, device=device)  # among expanded nodes, self included
    all_tokens, all_scores = cand_tokens[0], cand_scores[0]
    eye = torch.eye(k, dtype=torch.bool, device=device)
    for depth in range(1, max_depth):
        expanded = ancestors.shape[0]
        own = torch.zeros(k, expanded + k, dtype=torch.bool, device=device)
        if expanded:
            # Past the first depth every frontier node has an expanded parent (no boolean indexing: graph-safe).
            own[:, :expanded] = ancestors[frontier_parent.clamp(min=0)] & (frontier_parent >= 0).unsqueeze(1)
        own[:, expanded:] = eye
        out, logp_d = step(depth, frontier_hidden, all_tokens[frontier], own)
        grown = torch.zeros(expanded + k, expanded + k, dtype=torch.bool, device=device)
        grown[:expanded, :expanded] = ancestors
        grown[expanded:] = own
        ancestors = grown

        child = logp_d.topk(k, dim=-1)  # [k, k]
        scores = (all_scores[frontier].unsqueeze(1) + child.values).flatten()
        cand_tokens.append(child.indices.flatten())
        cand_scores.append(scores)
        cand_parents.append(frontier.repeat_interleave(k))
        new_ids = torch.arange(num_cands, num_cands + k * k, device=device)
        num_cands += k * k
        all_tokens = torch.cat(cand_tokens)
        all_scores = torch.cat(cand_scores)
        if depth + 1 == max_depth:
            break
        best = scores.topk(k).indices
        frontier = new_ids[best]
        frontier_hidden = out[best // k]
        frontier_parent = expanded + best // k

    # Stable sort: among equal scores the earlier candidate (a parent before its child) comes first, so the kept
    # set is closed under parents.
    order = torch.sort(all_scores, descending=True, stable=True).indices[:max_nodes]
    tokens = all_tokens if to_target is None else to_target[all_tokens]
    return TreeCandidates(tokens=tokens, parents=torch.cat(cand_parents), scores=all_scores,
                          keep=order.sort().values)


def host_draft(cands: TreeCandidates, drafter: str) -> DraftTree:
    """The kept candidates as a draft on the host, in one read (like a cache draft): trimming it, laying out the
    verify tree and reading its tokens during verification then touch no device memory."""
    n = cands.tokens.numel()
    ints = torch.cat([cands.tokens, cands.parents, cands.keep]).cpu()
    full = DraftTree(tokens=ints[:n].unsqueeze(0), parents=ints[n : 2 * n].unsqueeze(0),
                     scores=cands.scores.exp().unsqueeze(0).cpu(), info={"drafter": drafter})
    return full.select(ints[2 * n :])
