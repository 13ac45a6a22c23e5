"""EAGLE-2 dynamic tree expansion, as one function of fixed shapes (eager, or captured as a CUDA graph).

The root's top-k draft tokens are the first candidates. For each further depth, the k candidates of the last depth
with the best cumulative log-probability are run through the drafter in one batch (each attends to the committed
steps and its own ancestors), and each yields its top-k children as candidates. The draft is the best `max_nodes`
candidates by cumulative log-probability (closed under parents: a child never scores above its parent, ties go to
the earlier node). `top_k = 1` is a greedy chain.

For a given (k, max_nodes, max_depth) and key length every tensor has the same shape at every call and nothing is
read back to the host, so `StaticEagleTree` can capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .modeling import EagleDrafter

__all__ = ["TreeCandidates", "expand_tree"]


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


def expand_tree(
    model: EagleDrafter,
    k: int,
    max_nodes: int,
    max_depth: int,
    hidden: torch.Tensor,
    logp: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix_mask: torch.Tensor | None,
    tables: tuple[torch.Tensor, torch.Tensor],
) -> TreeCandidates:
    """One EAGLE-2 tree off the newest committed step.

    Args:
        hidden: [1, H] the newest step's output; logp: [draft_vocab] its log-probabilities (fp32).
        keys, values: [1, kv_heads, S, head_dim] the committed steps' keys and values.
        prefix_mask: bool [S], the keys that hold committed steps (None: all S).
        tables: (cos, sin) [1, 1, max_depth - 1, head_dim], rotary tables of the positions of depths 1 ..
            max_depth - 1 (every node of depth d sits at position steps + d - 1).
    """
    device = logp.device
    to_target = model.draft_to_target
    cos, sin = tables
    s = keys.shape[2]
    prefix = torch.ones(s, dtype=torch.bool, device=device) if prefix_mask is None else prefix_mask

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
    tree_keys, tree_values = keys[:, :, :0], values[:, :, :0]
    ancestors = torch.zeros(0, 0, dtype=torch.bool, device=device)  # among expanded nodes, self included
    all_tokens, all_scores = cand_tokens[0], cand_scores[0]
    eye = torch.eye(k, dtype=torch.bool, device=device)
    for depth in range(1, max_depth):
        embeds = model.embed(to_target[all_tokens[frontier]].unsqueeze(0))
        step = model.project(frontier_hidden.unsqueeze(0), embeds,
                             tables=(cos[:, :, depth - 1 : depth], sin[:, :, depth - 1 : depth]))
        expanded = ancestors.shape[0]
        own = torch.zeros(k, expanded + k, dtype=torch.bool, device=device)
        if expanded:
            # Past the first depth every frontier node has an expanded parent (no boolean indexing: graph-safe).
            own[:, :expanded] = ancestors[frontier_parent.clamp(min=0)] & (frontier_parent >= 0).unsqueeze(1)
        own[:, expanded:] = eye
        mask = torch.cat([prefix.expand(k, s), own], dim=1)
        tree_keys = torch.cat([tree_keys, step.key], dim=2)
        tree_values = torch.cat([tree_values, step.value], dim=2)
        attn = model.attend(step.query, torch.cat([keys, tree_keys], dim=2), torch.cat([values, tree_values], dim=2),
                            mask)
        out = model.finish(step.residual, attn)[0]  # [k, H]
        grown = torch.zeros(expanded + k, expanded + k, dtype=torch.bool, device=device)
        grown[:expanded, :expanded] = ancestors
        grown[expanded:] = own
        ancestors = grown

        logp_d = torch.log_softmax(model.logits(out).float(), dim=-1)
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
    return TreeCandidates(tokens=to_target[all_tokens], parents=torch.cat(cand_parents), scores=all_scores,
                          keep=order.sort().values)
