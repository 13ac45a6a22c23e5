"""`MtpDrafter`: drafts chains (recursive MTP) and EAGLE-2 trees with the target checkpoint's own MTP head.

Alignment: MTP step t pairs the target's last hidden state h_t (after its final norm) with the embedding of x_{t+1}
and predicts x_{t+2}; the drafter holds one step per committed token but the root (`drafters.hidden_steps`, shared
with the EAGLE drafter). Its keys and values (`MtpStore`) hold only steps built from the target's real hidden
states: tree nodes are written past the committed steps while drafting and overwritten afterwards. No second target
pass. With `static=True` (`AssistantConfig(compile=True)`) the keys and values live in a `StaticMtp` and, on CUDA,
the tree expansion and the accept pass are captured graphs (`mtp.static`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..drafters.base import DraftBudget, DraftContext
from ..drafters.expansion import grow_row_tree, host_draft
from ..drafters.hidden_steps import HiddenStepDrafter
from ..tree import DraftTree, empty_draft
from .modeling import MtpHead, MtpStore
from .static import StaticMtp, additive, static_mtp

__all__ = ["MtpDrafter", "from_config", "resolve_head"]


class MtpDrafter(HiddenStepDrafter):
    """A `Drafter` that proposes chains (`top_k=1`) or EAGLE-2 trees from the target's MTP head.

    Args:
        head: the `MtpHead` (built for `target`).
        target: the target model.
        top_k: children per expanded node, and nodes expanded per depth.
        static: keep the keys and values in preallocated storage and draft with fixed shapes, captured as CUDA
            graphs on the GPU (`StaticMtp`, sized at `begin` from the request's max_length; `max_depth` sets its
            tree part).
        fuse: with `static`, compile its passes with Inductor before capturing them (`compile_drafter=True`).
    """

    name = "mtp"
    label = "MTP"

    def __init__(self, head: MtpHead, target: nn.Module, top_k: int = 1, static: bool = False, max_depth: int = 8,
                 fuse: bool = False):
        if not isinstance(head, MtpHead):
            raise TypeError(f"the 'mtp' drafter needs an MtpHead as draft_model, got {type(head).__name__}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        tc = target.config.get_text_config()
        if head._shared.embed is not target.get_input_embeddings():
            raise ValueError("this MtpHead was built for a different model than the one generating: build it with "
                             "MtpHead.from_target(target, load=True)")
        self.head = head
        self.top_k = min(top_k, tc.vocab_size)
        self.target_hidden_layers = (tc.num_hidden_layers,)  # the last hidden state, after the final norm
        self.store = MtpStore()
        self.static, self.max_depth, self.fuse = static, max_depth, fuse
        self._static: StaticMtp | None = None  # this request's static storage (static=True)
        self._reset()

    def _reset(self) -> None:
        super()._reset()
        self.store.release()

    # ------------------------------------------------------------------ keeping in step with the target
    def _open_storage(self, context: DraftContext | None) -> None:
        max_length = getattr(getattr(context, "generation_config", None), "max_length", None)
        if self.static and max_length is not None:
            self._static = static_mtp(self.head, self.top_k, self.max_depth, max_length, owner=self,
                                      fuse=self.fuse)

    def _close_storage(self) -> None:
        if self._static is not None:
            self._static.release()
            self._static = None

    def _device(self) -> torch.device:
        return self.head.fc.weight.device

    def _run_steps(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._static is not None:
            return self._static.advance(self.steps, features, tokens)
        count, device = features.shape[1], self._device()
        positions = torch.arange(self.steps, self.steps + count, device=device).unsqueeze(0)
        # Causal over everything held: new step i sees the `steps` old steps and new steps 0..i.
        allowed = torch.ones(count, self.steps + count, dtype=torch.bool, device=device)
        allowed[:, self.steps:] = torch.ones(count, count, dtype=torch.bool, device=device).tril()
        self.store.length = self.steps
        out = self.head(features.to(device), self.head.embed(tokens), positions,
                        additive(allowed, self.head.fc.weight.dtype), self.store)
        return out[:, -1], torch.log_softmax(self.head.logits(out[0, -1]).float(), dim=-1)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        self._check_in_step(input_ids)
        if budget.max_depth <= 0 or budget.max_nodes <= 0:
            return empty_draft(1, input_ids.device)
        if self._static is not None:
            return host_draft(self._static.draft(self.steps, self.last_hidden, self.last_logp, budget), "mtp")
        k = min(self.top_k, budget.max_nodes)
        steps, device, dtype = self.steps, self.last_logp.device, self.head.fc.weight.dtype
        committed = torch.ones(k, steps, dtype=torch.bool, device=device)

        def step(depth: int, hidden: torch.Tensor, tokens: torch.Tensor,
                 own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Every node of depth d sits at position steps + d - 1; its keys go after the nodes expanded before it.
            positions = torch.full((1, k), steps + depth - 1, dtype=torch.long, device=device)
            self.store.length = steps + own.shape[1] - k
            mask = additive(torch.cat([committed, own], dim=1), dtype)
            out = self.head(hidden.unsqueeze(0), self.head.embed(tokens.unsqueeze(0)), positions, mask, self.store)[0]
            return out, torch.log_softmax(self.head.logits(out).float(), dim=-1)

        try:
            cands = grow_row_tree(step, k, budget.max_nodes, budget.max_depth, self.last_hidden, self.last_logp)
        finally:
            self.store.length = steps  # the tree's keys and values are dropped (overwritten next time)
        return host_draft(cands, "mtp")


def resolve_head(target: nn.Module, draft_model: nn.Module | None) -> MtpHead:
    """`draft_model` (an `MtpHead`), or with None the target checkpoint's own `mtp.*` weights, loaded once per target
    and device (the head is kept on the target)."""
    head = draft_model
    if head is None:
        head = getattr(target, "_hf_hybrid_spec_mtp_head", None)
        param = next(target.parameters())
        if head is None or (head.fc.weight.device, head.fc.weight.dtype) != (param.device, param.dtype):
            # First use, or the target moved (`.to(...)`) since: load the head where the target now is.
            head = MtpHead.from_target(target, load=True)
            # Not a submodule (object.__setattr__): the target's state dict and .to() stay as they were.
            object.__setattr__(target, "_hf_hybrid_spec_mtp_head", head)
    return head


def from_config(config, target: nn.Module, draft_model: nn.Module | None) -> MtpDrafter:
    """The drafter `AssistantConfig(drafter="mtp")` names: `draft_model` an `MtpHead`, or None to load the target
    checkpoint's own `mtp.*` weights (`resolve_head`)."""
    static = config.compile is True  # speculative_generate resolves "auto" before it builds the drafter
    return MtpDrafter(resolve_head(target, draft_model), target, top_k=config.draft_top_k, static=static,
                      max_depth=config.max_depth, fuse=static and config.compile_drafter)
