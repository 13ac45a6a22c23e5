"""What a tree cache holds between the verify forward and the commit: the tree, the recurrent layers' token factors,
and snapshots for drafters that undo ordinary steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["TreeState", "PendingRecurrent", "CommitsPath", "CacheSnapshot"]


@dataclass
class TreeState:
    """The tree being verified by the current forward.

    Attributes:
        parent: [B, N] int64 parent pointers over the verify input (node 0 is the root, the last committed
            token; its parent is -1).
        prefix_length: committed tokens already in the attention layers before this tree.
        num_nodes: optional [B] real node count per row (rows padded with dummy leaves).
    """

    parent: torch.Tensor
    prefix_length: int
    num_nodes: torch.Tensor | None = None
    _copies: dict = field(default_factory=dict, repr=False)

    def parent_on(self, device: torch.device) -> torch.Tensor:
        """`parent` on `device`, copied once per device (a model split over devices has layers on several)."""
        if self.parent.device == device:
            return self.parent
        if device not in self._copies:
            self._copies[device] = self.parent.to(device)
        return self._copies[device]


class CommitsPath(Protocol):
    """A tree op's output that rebuilds the state of any root path from its token factors (the kernels' tree ops
    return one: `TreeGatedDeltaOutput`, `TreeMamba2Output`, `TreeMamba1Output`)."""

    def commit(self, initial_state: torch.Tensor, parent: torch.Tensor, leaf: torch.Tensor,
               on_path: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class PendingRecurrent:
    """What one recurrent layer computed for the current tree, to be committed once the leaf is known.

    Attributes:
        conv_inputs: [B, N, C] inputs of the short causal conv (before it), or None if the layer has none.
        recurrent: the tree op's output (its token factors and `commit`), or None if the layer has no recurrent state
            (a conv-only layer).
        state_idx: which of the layer's conv/recurrent states these belong to.
    """

    conv_inputs: torch.Tensor | None = None
    recurrent: CommitsPath | None = None
    state_idx: int = 0


@dataclass
class CacheSnapshot:
    """A point to roll an ordinary (non-tree) cache back to: token counts of attention layers and copies of
    recurrent states. Used by drafters that decode a few tokens autoregressively and then undo them."""

    kv_lengths: dict[int, int]
    conv_states: dict[tuple[int, int], torch.Tensor]
    recurrent_states: dict[tuple[int, int], torch.Tensor]
