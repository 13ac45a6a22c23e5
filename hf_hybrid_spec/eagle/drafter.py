"""`EagleTreeDrafter`: drafts EAGLE-2 dynamic trees with an `EagleDrafter`, inside `speculative_generate`.

Alignment (EAGLE-3): one drafter step per committed token but the root, from the fused target features of the
verify forward (`drafters.hidden_steps`, shared with the MTP drafter); tree nodes get temporary keys and values
during `propose` that are dropped afterwards. No second target pass is needed.

Tree (EAGLE-2): `tree.expand_tree`. With `static=True` (`AssistantConfig(compile=True)`) the drafter's keys and
values live in a `StaticEagleTree` and, on CUDA, each draft budget's expansion is a captured graph.
"""

from __future__ import annotations

import torch
from torch import nn

from ..drafters.base import DraftBudget, DraftContext, TargetHidden
from ..drafters.expansion import host_draft, host_drafts
from ..drafters.hidden_steps import HiddenStepDrafter
from ..tree import DraftTree, empty_draft
from .modeling import EagleDrafter
from .static import StaticEagleTree, static_eagle_tree
from .tree import expand_tree

__all__ = ["EagleTreeDrafter", "from_config"]


class EagleTreeDrafter(HiddenStepDrafter):
    """A `Drafter` that proposes EAGLE-2 trees (chains for `top_k=1`) from a bound `EagleDrafter`.

    Args:
        model: the EagleDrafter (bound to `target` here; its aux layers become `target_hidden_layers`).
        target: the target model.
        top_k: children per expanded node, and nodes expanded per depth.
        static: keep the drafter's keys and values in preallocated storage and draft with fixed shapes, captured
            as CUDA graphs on the GPU (`StaticEagleTree`; sized at `begin` from the request's max_length).
    """

    name = "eagle"
    label = "EAGLE"

    def __init__(self, model: EagleDrafter, target: nn.Module, top_k: int = 10, static: bool = False,
                 fuse: bool = False):
        if not isinstance(model, EagleDrafter):
            raise TypeError(f"the 'eagle' drafter needs an EagleDrafter as draft_model, got {type(model).__name__}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        self.model = model.bind(target)
        self.top_k = min(top_k, model.config.draft_vocab_size)
        self.target_hidden_layers = tuple(model.config.aux_layers)
        self.static = static
        self.fuse = fuse
        self._store: StaticEagleTree | None = None  # this request's static storage (static=True)
        self._reset()

    def _reset(self) -> None:
        super()._reset()
        self.keys: torch.Tensor | None = None  # [1, kv_heads, steps, head_dim]
        self.values: torch.Tensor | None = None

    # ------------------------------------------------------------------ keeping in step with the target
    def _open_storage(self, context: DraftContext | None) -> None:
        max_length = getattr(getattr(context, "generation_config", None), "max_length", None)
        if self.static and max_length is not None:
            self._store = static_eagle_tree(self.model, self.top_k, max_length, owner=self, fuse=self.fuse)

    def _close_storage(self) -> None:
        if self._store is not None:
            self._store.release()
            self._store = None

    def _features(self, hidden: TargetHidden) -> torch.Tensor:
        return self.model.fuse(hidden.states)

    def _device(self) -> torch.device:
        return self.model.fc.weight.device

    def _run_steps(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count, device = features.shape[1], self._device()
        if self._store is not None:
            # An accept's few steps: fixed shapes in the static storage (a graph replay on CUDA).
            newest = self._store.advance(self.steps, features, tokens)
            if newest is not None:
                return newest
        positions = torch.arange(self.steps, self.steps + count, device=device).unsqueeze(0)
        step = self.model.project(features, self.model.embed(tokens), positions)
        if self._store is not None:
            keys, values = self._store.write(self.steps, step.key, step.value)
        else:
            keys = step.key if self.keys is None else torch.cat([self.keys, step.key], dim=2)
            values = step.value if self.values is None else torch.cat([self.values, step.value], dim=2)
        past = keys.shape[2] - count
        # Causal over everything held: new step i sees the `past` old steps and new steps 0..i.
        mask = torch.ones(count, past + count, dtype=torch.bool, device=device)
        mask[:, past:] = torch.ones(count, count, dtype=torch.bool, device=device).tril()
        out = self.model.finish(step.residual, self.model.attend(step.query, keys, values, mask))
        self.keys, self.values = keys, values
        return out[:, -1], torch.log_softmax(self.model.logits(out[0, -1]).float(), dim=-1)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        self._check_in_step(input_ids)
        if budget.max_depth <= 0 or budget.max_nodes <= 0:
            return empty_draft(1, input_ids.device)
        if self._store is not None:
            cands = self._store.draft(self.steps, self.last_hidden, self.last_logp, budget)
        else:
            depths = torch.arange(self.steps, self.steps + budget.max_depth - 1, device=self.last_logp.device)
            tables = self.model.rotary_tables(depths.view(1, -1), self.last_hidden.dtype)
            cands = expand_tree(self.model, self.top_k, budget.max_nodes, budget.max_depth, self.last_hidden,
                                self.last_logp.unsqueeze(0), self.keys, self.values, None, tables)
            return host_drafts(cands, "eagle")[0]
        return host_draft(cands, "eagle")


def from_config(config, target: nn.Module, draft_model: nn.Module | None) -> EagleTreeDrafter:
    """The drafter `AssistantConfig(drafter="eagle")` names: `draft_model` must be an `EagleDrafter`."""
    if draft_model is None:
        raise ValueError("the 'eagle' drafter needs draft_model=EagleDrafter.from_pretrained(...)")
    static = config.compile is True  # speculative_generate resolves "auto" before it builds the drafter
    return EagleTreeDrafter(draft_model, target, top_k=config.draft_top_k, static=static,
                            fuse=static and config.compile_drafter)
