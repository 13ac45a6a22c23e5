"""Draft-tree helpers for Hybrid Verified Decoding: merging two drafts, and what a draft would have accepted.

- `merge_drafts(a, b, max_nodes)`: one tree holding every root path of `a` and of `b` (identical sibling tokens
  become one node), trimmed to `max_nodes` by path score. Greedy verification of the merged tree accepts
  exactly max(what `a` accepts, what `b` accepts): every greedy-matching path of either draft is in it.
- `realized_payoff(tree, tokens)`: accepted draft tokens of `tree` if the target's continuation is `tokens`,
  i.e. the depth of the longest root path of `tree` that is a prefix of `tokens`. Under greedy verification
  that is exactly what verifying `tree` would accept, when `tokens` is the greedy continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import DraftTree, empty_draft

__all__ = ["MergedDraft", "merge_drafts", "realized_payoff"]


@dataclass
class MergedDraft:
    """A merged draft and where its nodes came from.

    Attributes:
        tree: the merged DraftTree [1, M] (topological order, scores = max of the sources' path scores).
        from_a / from_b: [M] bool, whether node j is a node of `a` / of `b` (both for shared root paths).
        shared: nodes present in both drafts (the overlap of their root paths).
    """

    tree: DraftTree
    from_a: torch.Tensor
    from_b: torch.Tensor

    @property
    def shared(self) -> int:
        return int((self.from_a & self.from_b).sum())


def _node_scores(tree: DraftTree) -> list[float]:
    """Per-node path scores; a draft without scores (a greedy chain) gets 1, 1/2, 1/3... by depth, so trimming
    keeps its shallow nodes first."""
    if tree.scores is not None:
        return tree.scores[0].tolist()
    return [1.0 / float(d) for d in tree.depth()[0].tolist()]


def merge_drafts(a: DraftTree, b: DraftTree, max_nodes: int) -> MergedDraft:
    """The union of the root paths of drafts `a` and `b` (batch size 1), at most `max_nodes` nodes.

    Nodes of `a` come first, then the nodes of `b` not already there; siblings never repeat a token. When the
    union is larger than `max_nodes`, the nodes with the highest path score are kept (a node's merged score is
    the max of its sources' scores, never above its parent's, ties to the earlier node, so the kept set is
    closed under parents).
    """
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    device = a.tokens.device
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    in_a: list[bool] = []
    in_b: list[bool] = []
    for which, tree in ((0, a), (1, b)):
        local_to_merged: list[int] = []
        for tok, par, score in zip(tree.tokens[0].tolist(), tree.parents[0].tolist(), _node_scores(tree)):
            mparent = -1 if par < 0 else local_to_merged[par]
            key = (mparent, tok)
            node = index.get(key)
            if node is None:
                node = index[key] = len(tokens)
                tokens.append(tok)
                parents.append(mparent)
                scores.append(score)
                in_a.append(False)
                in_b.append(False)
            else:
                scores[node] = max(scores[node], score)
            (in_a if which == 0 else in_b)[node] = True
            local_to_merged.append(node)
    if not tokens:
        empty = empty_draft(1, device)
        none = torch.zeros(0, dtype=torch.bool)
        return MergedDraft(tree=empty, from_a=none, from_b=none.clone())
    # A child's merged score can exceed its parent's only through rounding between sources; clamp along paths so
    # that trimming by score stays closed under parents.
    for j, p in enumerate(parents):
        if p >= 0 and scores[j] > scores[p]:
            scores[j] = scores[p]
    merged = DraftTree(
        tokens=torch.tensor([tokens], dtype=torch.long, device=device),
        parents=torch.tensor([parents], dtype=torch.long, device=device),
        scores=torch.tensor([scores], dtype=torch.float32, device=device),
        info={"drafter": "hvd", "source": "merged"},
    )
    from_a = torch.tensor(in_a)
    from_b = torch.tensor(in_b)
    if len(tokens) > max_nodes:
        order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:max_nodes]
        keep = torch.tensor(sorted(order), dtype=torch.long)
        merged = merged.select(keep.to(device))
        from_a, from_b = from_a[keep], from_b[keep]
    return MergedDraft(tree=merged, from_a=from_a, from_b=from_b)


def realized_payoff(tree: DraftTree | None, tokens: list[int]) -> int:
    """Draft tokens of `tree` that a target continuing with `tokens` accepts (0 for None or an empty tree)."""
    if tree is None or tree.num_nodes == 0:
        return 0
    host = tree.host()
    toks, parents = host.tokens, host.parents
    node, accepted, start = -1, 0, 0
    # A walk down the lists (HVD settles every step): nodes are in topological order, so a node's children come
    # after it; among duplicate siblings the first matches, as in greedy verification.
    for tok in tokens:
        for j in range(start, len(toks)):
            if parents[j] == node and toks[j] == tok:
                break
        else:
            break
        node, start, accepted = j, j + 1, accepted + 1
    return accepted
