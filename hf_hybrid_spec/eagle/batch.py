"""`BatchEagleDrafter`: EAGLE-2 trees for every row of a batch from one expansion per step.

The rows share one `StaticEagleTree` of R rows (`drafters.batch_hidden` holds the loop's side: alignment, accept,
propose, the device calls of the pipelined step). On CUDA with `static=True` both passes are captured graphs, as for
one request.
"""

from __future__ import annotations

import torch
from torch import nn

from ..drafters.batch_hidden import BatchHiddenStepDrafter
from .modeling import EagleDrafter
from .static import StaticEagleTree, static_eagle_tree

__all__ = ["BatchEagleDrafter", "from_config"]


class BatchEagleDrafter(BatchHiddenStepDrafter):
    """EAGLE-2 trees (chains for `top_k=1`) for the R rows of a batch from a bound `EagleDrafter`.

    Args:
        model: the EagleDrafter (bound to `target` here; its aux layers become `target_hidden_layers`).
        target: the target model. rows: the batch size R.
        top_k: children per expanded node, and nodes expanded per depth. max_depth: the expansion's depth.
        static: capture the passes as CUDA graphs on the GPU (the kept `StaticEagleTree` of this drafter and R).
        fuse: with `static`, compile the passes with Inductor before capturing them.
    """

    name = "eagle"
    label = "EAGLE"

    def __init__(self, model: EagleDrafter, target: nn.Module, rows: int, top_k: int = 10, max_depth: int = 6,
                 static: bool = False, fuse: bool = False):
        if not isinstance(model, EagleDrafter):
            raise TypeError(f"the 'eagle' drafter needs an EagleDrafter as draft_model, got {type(model).__name__}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        self.model = model.bind(target)
        super().__init__(rows, min(top_k, model.config.draft_vocab_size), max_depth, tuple(model.config.aux_layers))
        self.static, self.fuse = static, fuse

    def timing_key(self) -> tuple:
        return (self.name, id(self.model), self.top_k, self.max_depth, self.static, self.fuse)

    def _open_store(self, capacity: int) -> StaticEagleTree:
        if self.static:
            return static_eagle_tree(self.model, self.top_k, capacity, owner=self, fuse=self.fuse, rows=self.rows)
        return StaticEagleTree(self.model, self.top_k, capacity, use_graphs=False, rows=self.rows)

    def _features(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.model.fuse(states)


def from_config(config, target: nn.Module, draft_model: nn.Module | None, rows: int) -> BatchEagleDrafter:
    """The batch drafter `AssistantConfig(drafter="eagle")` names for a batch of `rows`: `draft_model` must be an
    `EagleDrafter`."""
    if draft_model is None:
        raise ValueError("the 'eagle' drafter needs draft_model=EagleDrafter.from_pretrained(...)")
    static = config.compile is True  # speculative_generate resolves "auto" before it builds the drafter
    return BatchEagleDrafter(draft_model, target, rows, top_k=config.draft_top_k, max_depth=config.max_depth,
                             static=static, fuse=static and config.compile_drafter)
