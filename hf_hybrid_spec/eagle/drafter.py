"""`EagleTreeDrafter`: drafts EAGLE-2 dynamic trees with an `EagleDrafter`, inside `speculative_generate`.

Alignment (EAGLE-3). The drafter's step t pairs the target's features of token x_t with the embedding of
x_{t+1} and predicts x_{t+2}. The target never runs the root (the last committed token) before verification,
so after each step the drafter holds one step per committed token but the root:

    begin(prompt x_0..x_{P-1}, hidden g_0..g_{P-1})  -> steps (g_t, x_{t+1}) for t < P - 1; g_{P-1} waits
    accept(first token x_P)                          -> step (g_{P-1}, x_P); its output predicts x_{P+1}
    propose()                                        -> tree off that output (the drafter's own KV + tree KV)
    accept(path root, a_1..a_k, bonus b; hidden of root, a_1..a_k from the verify forward)
                                                     -> steps (g_root, a_1) .. (g_{a_k}, b)

The drafter's key/value cache therefore only ever holds steps built from the target's real hidden states:
tree nodes get temporary keys/values during `propose` that are dropped afterwards (rejected positions are
rolled back by construction; accepted ones are recomputed from the verify forward's hidden states, as EAGLE
does). No second target pass is needed.

Tree (EAGLE-2): `tree.expand_tree`. With `static=True` (`AssistantConfig(compile=True)`) the drafter's keys and
values live in a `StaticEagleTree` and, on CUDA, each draft budget's expansion is a captured graph.
"""

from __future__ import annotations

import torch
from torch import nn

from ..drafters.base import DraftBudget, DraftContext, Drafter, TargetHidden
from ..drafters.expansion import host_draft
from ..tree import DraftTree, VerifyResult, empty_draft
from .modeling import EagleDrafter
from .static import StaticEagleTree, static_eagle_tree
from .tree import expand_tree

__all__ = ["EagleTreeDrafter", "from_config"]


class EagleTreeDrafter(Drafter):
    """A `Drafter` that proposes EAGLE-2 trees (chains for `top_k=1`) from a bound `EagleDrafter`.

    Args:
        model: the EagleDrafter (bound to `target` here; its aux layers become `target_hidden_layers`).
        target: the target model.
        top_k: children per expanded node, and nodes expanded per depth.
        static: keep the drafter's keys and values in preallocated storage and draft with fixed shapes, captured
            as CUDA graphs on the GPU (`StaticEagleTree`; sized at `begin` from the request's max_length).
    """

    name = "eagle"

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
        self.keys: torch.Tensor | None = None  # [1, kv_heads, steps, head_dim]
        self.values: torch.Tensor | None = None
        self.steps = 0  # drafter steps held = committed tokens paired with the features before them
        self.features: list[torch.Tensor] = []  # fused target features [1, t, H] not yet paired with a token
        self.last_hidden: torch.Tensor | None = None  # [1, H] output of the newest step
        self.last_logp: torch.Tensor | None = None  # [draft_vocab] log-probabilities of the newest step

    # ------------------------------------------------------------------ keeping in step with the target
    def begin(self, input_ids: torch.Tensor, context: DraftContext | None = None,
              hidden: TargetHidden | None = None) -> None:
        self._reset()
        self._release_store()
        max_length = getattr(getattr(context, "generation_config", None), "max_length", None)
        if self.static and max_length is not None:
            self._store = static_eagle_tree(self.model, self.top_k, max_length, owner=self, fuse=self.fuse)
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
        self._release_store()

    def _release_store(self) -> None:
        if self._store is not None:
            self._store.release()
            self._store = None

    def _take(self, hidden: TargetHidden | None, where: str) -> None:
        if hidden is None:
            raise RuntimeError(f"the EAGLE drafter got no target hidden states at {where}(); it must run inside "
                               "speculative_generate, which provides the layers in target_hidden_layers")
        if tuple(hidden.layers) != self.target_hidden_layers:
            raise RuntimeError(f"expected target hidden states {self.target_hidden_layers}, got {hidden.layers}")
        with torch.no_grad():
            self.features.append(self.model.fuse(hidden.states))

    @torch.no_grad()
    def _advance(self, input_ids: torch.Tensor) -> None:
        """Run the steps that both a target feature and the token after it are known for."""
        pending = torch.cat(self.features, dim=1) if self.features else None
        available = 0 if pending is None else pending.shape[1]
        count = min(available, input_ids.shape[1] - 1 - self.steps)
        if count <= 0:
            return
        device = self.model.fc.weight.device
        tokens = input_ids[:, self.steps + 1 : self.steps + 1 + count].to(device)
        if self._store is not None:
            # An accept's few steps: fixed shapes in the static storage (a graph replay on CUDA).
            newest = self._store.advance(self.steps, pending[:, :count], tokens)
            if newest is not None:
                self.last_hidden, self.last_logp = newest
                self.steps += count
                self.features = [pending[:, count:]] if available > count else []
                return
        positions = torch.arange(self.steps, self.steps + count, device=device).unsqueeze(0)
        step = self.model.project(pending[:, :count], self.model.embed(tokens), positions)
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
        self.steps += count
        self.features = [pending[:, count:]] if available > count else []
        self.last_hidden = out[:, -1]
        self.last_logp = torch.log_softmax(self.model.logits(out[0, -1]).float(), dim=-1)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if self.last_logp is None or self.steps != input_ids.shape[1] - 1:
            raise RuntimeError(f"the EAGLE drafter holds {self.steps} steps for {input_ids.shape[1]} committed "
                               "tokens; it is out of step with the target (begin/accept were not called in order)")
        if budget.max_depth <= 0 or budget.max_nodes <= 0:
            return empty_draft(1, input_ids.device)
        if self._store is not None:
            cands = self._store.draft(self.steps, self.last_hidden, self.last_logp, budget)
        else:
            depths = torch.arange(self.steps, self.steps + budget.max_depth - 1, device=self.last_logp.device)
            tables = self.model.rotary_tables(depths.view(1, -1), self.last_hidden.dtype)
            cands = expand_tree(self.model, self.top_k, budget.max_nodes, budget.max_depth, self.last_hidden,
                                self.last_logp, self.keys, self.values, None, tables)
        return host_draft(cands, "eagle")



def from_config(config, target: nn.Module, draft_model: nn.Module | None) -> EagleTreeDrafter:
    """The drafter `AssistantConfig(drafter="eagle")` names: `draft_model` must be an `EagleDrafter`."""
    if draft_model is None:
        raise ValueError("the 'eagle' drafter needs draft_model=EagleDrafter.from_pretrained(...)")
    static = config.compile is True  # speculative_generate resolves "auto" before it builds the drafter
    return EagleTreeDrafter(draft_model, target, top_k=config.draft_top_k, static=static,
                            fuse=static and config.compile_drafter)
