"""EAGLE-2 dynamic tree expansion with an `EagleDrafter`, for R rows at once (eager, or captured as a CUDA graph).

The tree search itself is `drafters.expansion.grow_tree`; this module supplies its step: the frontier's queries,
keys and values (`EagleDrafter.project`), attention over each row's committed steps and the tree keys grown so far,
and the drafter's layer and head. For a given (R, k, max_nodes, max_depth) and key length every tensor has the same
shape at every call and nothing is read back to the host, so `StaticEagleTree` can capture it. One request is R = 1.
"""

from __future__ import annotations

import torch

from ..drafters.expansion import TreeCandidates, grow_tree
from .modeling import EagleDrafter

__all__ = ["TreeCandidates", "expand_tree"]


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
    """R EAGLE-2 trees, each off its row's newest committed step.

    Args:
        hidden: [R, H] each row's newest step's output; logp: [R, draft_vocab] its log-probabilities (fp32).
        keys, values: [R, kv_heads, S, head_dim] the committed steps' keys and values.
        prefix_mask: bool [R, S], the keys that hold each row's committed steps (None: all S).
        tables: (cos, sin) [R, 1, max_depth - 1, head_dim], rotary tables of the positions of depths 1 ..
            max_depth - 1 (every node of depth d sits at position steps + d - 1 of its row).

    Returns `TreeCandidates` of [R, C] tensors.
    """
    to_target = model.draft_to_target
    cos, sin = tables
    rows, s = keys.shape[0], keys.shape[2]
    prefix = torch.ones(rows, s, dtype=torch.bool, device=logp.device) if prefix_mask is None else prefix_mask
    tree = {"keys": keys[:, :, :0], "values": values[:, :, :0]}  # the expanded nodes' keys and values

    def step(depth: int, frontier_hidden: torch.Tensor, tokens: torch.Tensor,
             own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = model.embed(to_target[tokens])  # [R, k, H]
        proj = model.project(frontier_hidden, embeds,
                             tables=(cos[:, :, depth - 1 : depth], sin[:, :, depth - 1 : depth]))
        tree["keys"] = torch.cat([tree["keys"], proj.key], dim=2)
        tree["values"] = torch.cat([tree["values"], proj.value], dim=2)
        mask = torch.cat([prefix.unsqueeze(1).expand(rows, k, s), own], dim=2).unsqueeze(1)  # [R, 1, k, S + E + k]
        attn = model.attend(proj.query, torch.cat([keys, tree["keys"]], dim=2),
                            torch.cat([values, tree["values"]], dim=2), mask)
        out = model.finish(proj.residual, attn)  # [R, k, H]
        return out, torch.log_softmax(model.logits(out).float(), dim=-1)

    return grow_tree(step, k, max_nodes, max_depth, hidden, logp, to_target)
