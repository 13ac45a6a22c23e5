"""EAGLE-2 dynamic tree growth over any drafter that runs k tree nodes per step (EAGLE-3 heads, MTP heads), for
one row or for every row of a batch at once.

The root's top-k draft tokens are the first candidates. For each further depth, the k candidates of the last depth
with the best cumulative log-probability are run through the drafter in one batch (each attends to the committed
steps and its own ancestors), and each yields its top-k children as candidates. The draft is the best `max_nodes`
candidates by cumulative log-probability (closed under parents: a child never scores above its parent, ties go to
the earlier node). `top_k = 1` is a greedy chain.

`grow_tree` grows R trees side by side (one per batch row, every tensor with a leading R); `grow_row_tree` is the
one-row form. The drafter itself is a callback (`TreeStep`), so the bookkeeping lives here once. For a given
(R, k, max_nodes, max_depth) every tensor has the same shape at every call and nothing is read back to the host, so
a caller may capture it as a CUDA graph (EAGLE's `StaticEagleTree` and MTP's `StaticMtp` do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..tree import DeviceDrafts, DraftBatch, DraftTree

__all__ = ["TreeCandidates", "TreeStep", "RowTreeStep", "grow_tree", "grow_row_tree", "host_draft", "host_drafts",
           "host_batch", "kept_candidates"]


@dataclass
class TreeCandidates:
    """Every candidate of one expansion, on the drafter's device ([C] tensors for one row, [R, C] for R rows).

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
        """Run the k frontier nodes of `depth` of every row (1-based: depth-1 nodes are the root's children) through
        the drafter.

        hidden: [R, k, H] the hidden state each node's parent step produced; tokens: [R, k] the nodes' draft ids;
        own: bool [R, k, E + k], which of the E nodes expanded so far in the row (in expansion order) and of these k
        each node may attend to (its ancestors and itself), besides every committed step of its row. Returns
        (out [R, k, H], fp32 log-probabilities [R, k, draft_vocab] of each node's children). A step that keeps
        per-node keys and values appends these k after the E earlier ones, matching `own`'s layout.
        """


class RowTreeStep(Protocol):
    def __call__(self, depth: int, hidden: torch.Tensor, tokens: torch.Tensor,
                 own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`TreeStep` of one row: hidden [k, H], tokens [k], own [k, E + k] -> (out [k, H], logp [k, draft_vocab])."""


def grow_tree(step: TreeStep, k: int, max_nodes: int, max_depth: int, hidden: torch.Tensor, logp: torch.Tensor,
              to_target: torch.Tensor | None = None) -> TreeCandidates:
    """R EAGLE-2 trees, each off its row's newest committed step.

    Args:
        step: runs one depth's k frontier nodes of every row (see `TreeStep`).
        hidden: [R, H] each row's newest committed step's output; logp: [R, draft_vocab] its log-probabilities (fp32).
        to_target: [draft_vocab] target id of each draft id (None: the same ids).

    Returns `TreeCandidates` of [R, C] tensors (`keep` [R, min(C, max_nodes)]).
    """
    device = logp.device
    rows, width = logp.shape[0], hidden.shape[-1]
    top = logp.topk(k, dim=-1)  # [R, k]
    cand_tokens = [top.indices]  # draft ids, per depth
    cand_scores = [top.values]  # cumulative log-probabilities
    cand_parents = [torch.full((rows, k), -1, dtype=torch.long, device=device)]
    num_cands = k
    # The frontier of each row: candidates to run next (global candidate ids), the hidden state of their parent's
    # step, and their parent's index among the row's expanded nodes (-1: the root step). It is always k wide.
    frontier = torch.arange(k, device=device).expand(rows, k)
    frontier_hidden = hidden.unsqueeze(1).expand(rows, k, width)
    frontier_parent = torch.full((rows, k), -1, dtype=torch.long, device=device)
    ancestors = torch.zeros(rows, 0, 0, dtype=torch.bool, device=device)  # among expanded nodes, self included
    all_tokens, all_scores = cand_tokens[0], cand_scores[0]
    eye = torch.eye(k, dtype=torch.bool, device=device)
    for depth in range(1, max_depth):
        expanded = ancestors.shape[1]
        own = torch.zeros(rows, k, expanded + k, dtype=torch.bool, device=device)
        if expanded:
            # Past the first depth every frontier node has an expanded parent (no boolean indexing: graph-safe).
            parent_rows = ancestors.gather(1, frontier_parent.clamp(min=0).unsqueeze(-1).expand(rows, k, expanded))
            own[:, :, :expanded] = parent_rows & (frontier_parent >= 0).unsqueeze(-1)
        own[:, :, expanded:] = eye
        out, logp_d = step(depth, frontier_hidden, all_tokens.gather(1, frontier), own)
        grown = torch.zeros(rows, expanded + k, expanded + k, dtype=torch.bool, device=device)
        grown[:, :expanded, :expanded] = ancestors
        grown[:, expanded:] = own
        ancestors = grown

        child = logp_d.topk(k, dim=-1)  # [R, k, k]
        scores = (all_scores.gather(1, frontier).unsqueeze(-1) + child.values).flatten(1)  # [R, k * k]
        cand_tokens.append(child.indices.flatten(1))
        cand_scores.append(scores)
        cand_parents.append(frontier.repeat_interleave(k, dim=1))
        new_ids = torch.arange(num_cands, num_cands + k * k, device=device)
        num_cands += k * k
        all_tokens = torch.cat(cand_tokens, dim=1)
        all_scores = torch.cat(cand_scores, dim=1)
        if depth + 1 == max_depth:
            break
        best = scores.topk(k, dim=-1).indices  # [R, k]
        frontier = new_ids[best]
        frontier_hidden = out.gather(1, (best // k).unsqueeze(-1).expand(rows, k, width))
        frontier_parent = expanded + best // k

    # Stable sort: among equal scores the earlier candidate (a parent before its child) comes first, so the kept
    # set is closed under parents.
    order = torch.sort(all_scores, dim=-1, descending=True, stable=True).indices[:, :max_nodes]
    tokens = all_tokens if to_target is None else to_target[all_tokens]
    return TreeCandidates(tokens=tokens, parents=torch.cat(cand_parents, dim=1), scores=all_scores,
                          keep=order.sort(dim=-1).values)


def grow_row_tree(step: RowTreeStep, k: int, max_nodes: int, max_depth: int, hidden: torch.Tensor,
                  logp: torch.Tensor, to_target: torch.Tensor | None = None) -> TreeCandidates:
    """One EAGLE-2 tree (`grow_tree` for one row): hidden [1, H], logp [draft_vocab]; `step` a `RowTreeStep`.
    Returns `TreeCandidates` of [C] tensors."""

    def rows_step(depth: int, frontier_hidden: torch.Tensor, tokens: torch.Tensor,
                  own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, logp_d = step(depth, frontier_hidden[0], tokens[0], own[0])
        return out.unsqueeze(0), logp_d.unsqueeze(0)

    cands = grow_tree(rows_step, k, max_nodes, max_depth, hidden, logp.unsqueeze(0), to_target)
    return TreeCandidates(tokens=cands.tokens[0], parents=cands.parents[0], scores=cands.scores[0],
                          keep=cands.keep[0])


def host_draft(cands: TreeCandidates, drafter: str) -> DraftTree:
    """The kept candidates of one row ([C] `TreeCandidates`) as a draft on the host, in one read (like a cache draft):
    trimming it, laying out the verify tree and reading its tokens during verification then touch no device memory."""
    rows = TreeCandidates(tokens=cands.tokens.unsqueeze(0), parents=cands.parents.unsqueeze(0),
                          scores=cands.scores.unsqueeze(0), keep=cands.keep.unsqueeze(0))
    return host_drafts(rows, drafter)[0]


def host_drafts(cands: TreeCandidates, drafter: str) -> list[DraftTree]:
    """Each row's kept candidates ([R, C] `TreeCandidates`) as a draft on the host, all rows in one read."""
    rows, n = cands.tokens.shape
    ints = torch.cat([cands.tokens, cands.parents, cands.keep], dim=1).cpu()
    scores = cands.scores.exp().cpu()
    drafts = []
    for row in range(rows):
        full = DraftTree(tokens=ints[row : row + 1, :n], parents=ints[row : row + 1, n : 2 * n],
                         scores=scores[row : row + 1], info={"drafter": drafter})
        drafts.append(full.select(ints[row, 2 * n :]))
    return drafts


def kept_candidates(cands: TreeCandidates, k: int) -> DeviceDrafts:
    """Every row's kept candidates ([R, C] `TreeCandidates` of an expansion with `k` children per node) as
    `DeviceDrafts` on their device, with no host read: the kept nodes gathered, their parents renumbered among them,
    values their path probabilities, depths from the candidates' layout (the root's k children, then k * k per
    depth)."""
    keep = cands.keep
    rows, kept = keep.shape
    tokens = cands.tokens.gather(1, keep)
    parent_ids = cands.parents.gather(1, keep)  # candidate ids (-1: under the root)
    index = torch.arange(kept, device=keep.device).expand(rows, kept)
    renumber = torch.full_like(cands.parents, -1).scatter_(1, keep, index)
    parents = torch.where(parent_ids >= 0, renumber.gather(1, parent_ids.clamp(min=0)), -1)
    depth = torch.where(keep < k, 1, 2 + torch.div(keep - k, k * k, rounding_mode="floor"))
    return DeviceDrafts(tokens=tokens, parents=parents, values=cands.scores.gather(1, keep).exp().float(),
                        depth=depth)


def host_batch(cands: TreeCandidates, k: int) -> DraftBatch:
    """Every row's kept candidates ([R, C] `TreeCandidates` on the drafter's device, `k` children per node) as one
    `DraftBatch` on the host: gathered and renumbered on the device (`kept_candidates`), then one read (no per-row
    objects: a batch of 60-node trees would cost milliseconds of host work per step otherwise)."""
    drafts = kept_candidates(cands, k)
    rows, kept = drafts.tokens.shape
    ints = torch.cat([drafts.tokens, drafts.parents, drafts.depth], dim=1).cpu()
    return DraftBatch(tokens=ints[:, :kept], parents=ints[:, kept : 2 * kept], values=drafts.values.cpu(),
                      depth=ints[:, 2 * kept :], count=torch.full((rows,), kept, dtype=torch.long))
