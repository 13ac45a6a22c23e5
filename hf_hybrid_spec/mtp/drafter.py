"""`MtpDrafter`: drafts chains (recursive MTP) and EAGLE-2 trees with the target checkpoint's own MTP head.

Alignment. MTP step t pairs the target's last hidden state h_t (after its final norm) with the embedding of x_{t+1}
and predicts x_{t+2}. The target never runs the root (the last committed token) before verification, so after
each step the head holds one step per committed token but the root (as EAGLE-3 does, `eagle.drafter`):

    begin(prompt x_0..x_{P-1}, hidden h_0..h_{P-1})  -> steps (h_t, x_{t+1}) for t < P - 1; h_{P-1} waits
    accept(first token x_P)                          -> step (h_{P-1}, x_P); its output predicts x_{P+1}
    propose()                                        -> chain / tree off that output, fed back recursively
    accept(path root, a_1..a_k, bonus b; hidden of root, a_1..a_k from the verify forward)
                                                     -> steps (h_root, a_1) .. (h_{a_k}, b)

The head's keys and values (`MtpStore`) hold only steps built from the target's real hidden states: tree nodes
are written past the committed steps while drafting and overwritten afterwards; accepted ones are recomputed from
the verify forward's hidden states. No second target pass. With `static=True` (`AssistantConfig(compile=True)`) the
keys and values live in a `StaticMtp` and, on CUDA, the tree expansion and the accept pass are captured graphs
(`mtp.static`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..drafters.base import DraftBudget, DraftContext, Drafter, TargetHidden
from ..drafters.expansion import grow_tree, host_draft
from ..tree import DraftTree, VerifyResult, empty_draft
from .modeling import MtpHead, MtpStore
from .static import StaticMtp, additive, static_mtp

__all__ = ["MtpDrafter", "from_config"]


class MtpDrafter(Drafter):
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
        self.store.release()
        self.steps = 0  # steps held = committed tokens paired with the hidden state before them
        self.pending: list[torch.Tensor] = []  # target hidden states [1, t, H] not yet paired with a token
        self.last_hidden: torch.Tensor | None = None  # [1, H] output of the newest step
        self.last_logp: torch.Tensor | None = None  # [V] log-probabilities of the newest step (fp32)

    # ------------------------------------------------------------------ keeping in step with the target
    def begin(self, input_ids: torch.Tensor, context: DraftContext | None = None,
              hidden: TargetHidden | None = None) -> None:
        self._reset()
        self._release_static()
        max_length = getattr(getattr(context, "generation_config", None), "max_length", None)
        if self.static and max_length is not None:
            self._static = static_mtp(self.head, self.top_k, self.max_depth, max_length, owner=self,
                                      fuse=self.fuse)
        self._take(hidden, "begin")
        self._advance(input_ids)

    def accept(self, input_ids: torch.Tensor, result: VerifyResult, hidden: TargetHidden | None = None) -> None:
        if hidden is not None:
            self._take(hidden, "accept")
        self._advance(input_ids)

    def end(self, input_ids: torch.Tensor) -> None:
        self.release()

    def release(self) -> None:
        self._reset()
        self._release_static()

    def _release_static(self) -> None:
        if self._static is not None:
            self._static.release()
            self._static = None

    def _take(self, hidden: TargetHidden | None, where: str) -> None:
        if hidden is None:
            raise RuntimeError(f"the MTP drafter got no target hidden states at {where}(); it must run inside "
                               "speculative_generate, which provides the layers in target_hidden_layers")
        if tuple(hidden.layers) != self.target_hidden_layers:
            raise RuntimeError(f"expected target hidden states {self.target_hidden_layers}, got {hidden.layers}")
        self.pending.append(hidden.states[0])

    @torch.no_grad()
    def _advance(self, input_ids: torch.Tensor) -> None:
        """Run the steps that both a target hidden state and the token after it are known for."""
        pending = torch.cat(self.pending, dim=1) if self.pending else None
        available = 0 if pending is None else pending.shape[1]
        count = min(available, input_ids.shape[1] - 1 - self.steps)
        if count <= 0:
            return
        device = self.head.fc.weight.device
        tokens = input_ids[:, self.steps + 1 : self.steps + 1 + count].to(device)
        if self._static is not None:
            self.last_hidden, self.last_logp = self._static.advance(self.steps, pending[:, :count], tokens)
            self.steps += count
            self.pending = [pending[:, count:]] if available > count else []
            return
        positions = torch.arange(self.steps, self.steps + count, device=device).unsqueeze(0)
        # Causal over everything held: new step i sees the `steps` old steps and new steps 0..i.
        allowed = torch.ones(count, self.steps + count, dtype=torch.bool, device=device)
        allowed[:, self.steps:] = torch.ones(count, count, dtype=torch.bool, device=device).tril()
        self.store.length = self.steps
        out = self.head(pending[:, :count].to(device), self.head.embed(tokens), positions,
                        additive(allowed, self.head.fc.weight.dtype), self.store)
        self.steps += count
        self.pending = [pending[:, count:]] if available > count else []
        self.last_hidden = out[:, -1]
        self.last_logp = torch.log_softmax(self.head.logits(out[0, -1]).float(), dim=-1)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if self.last_logp is None or self.steps != input_ids.shape[1] - 1:
            raise RuntimeError(f"the MTP drafter holds {self.steps} steps for {input_ids.shape[1]} committed "
                               "tokens; it is out of step with the target (begin/accept were not called in order)")
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
            cands = grow_tree(step, k, budget.max_nodes, budget.max_depth, self.last_hidden, self.last_logp)
        finally:
            self.store.length = steps  # the tree's keys and values are dropped (overwritten next time)
        return host_draft(cands, "mtp")


def from_config(config, target: nn.Module, draft_model: nn.Module | None) -> MtpDrafter:
    """The drafter `AssistantConfig(drafter="mtp")` names: `draft_model` an `MtpHead`, or None to load the target
    checkpoint's own `mtp.*` weights (once per target: the head is kept on the target)."""
    head = draft_model
    if head is None:
        head = getattr(target, "_hf_hybrid_spec_mtp_head", None)
        param = next(target.parameters())
        if head is None or (head.fc.weight.device, head.fc.weight.dtype) != (param.device, param.dtype):
            # First use, or the target moved (`.to(...)`) since: load the head where the target now is.
            head = MtpHead.from_target(target, load=True)
            # Not a submodule (object.__setattr__): the target's state dict and .to() stay as they were.
            object.__setattr__(target, "_hf_hybrid_spec_mtp_head", head)
    static = config.compile is True  # speculative_generate resolves "auto" before it builds the drafter
    return MtpDrafter(head, target, top_k=config.draft_top_k, static=static, max_depth=config.max_depth,
                      fuse=static and config.compile_drafter)
