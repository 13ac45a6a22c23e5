"""`HiddenStepDrafter`: the bookkeeping shared by the drafters that run one step per committed token from the
target's hidden states (EAGLE-3's head, the checkpoint's MTP head).

Alignment. Step t pairs the target's hidden state of token x_t with the embedding of x_{t+1} and predicts x_{t+2}.
The target never runs the root (the last committed token) before verification, so after each step the drafter holds
one step per committed token but the root:

    begin(prompt x_0..x_{P-1}, hidden h_0..h_{P-1})  -> steps (h_t, x_{t+1}) for t < P - 1; h_{P-1} waits
    accept(first token x_P)                          -> step (h_{P-1}, x_P); its output predicts x_{P+1}
    propose()                                        -> a tree off that output (the subclass's)
    accept(path root, a_1..a_k, bonus b; hidden of root, a_1..a_k from the verify forward)
                                                     -> steps (h_root, a_1) .. (h_{a_k}, b)

So the drafter's keys and values only ever hold steps built from the target's real hidden states: tree nodes get
temporary entries while drafting, and accepted ones are recomputed from the verify forward's hidden states. No
second target pass. A subclass supplies `_run_steps` (the steps themselves), `_features` (what it keeps of a
`TargetHidden`) and, when it keeps storage per request, `_open_storage` / `_close_storage`.
"""

from __future__ import annotations

import torch

from ..tree import VerifyResult
from .base import DraftContext, Drafter, TargetHidden

__all__ = ["HiddenStepDrafter"]


class HiddenStepDrafter(Drafter):
    """Keeps a step per committed token but the root (see the module docstring); `label` names it in errors."""

    label = "hidden-state"

    def _reset(self) -> None:
        self.steps = 0  # steps held = committed tokens paired with the hidden state before them
        self.pending: list[torch.Tensor] = []  # features [1, t, H] not yet paired with a token
        self.last_hidden: torch.Tensor | None = None  # [1, H] output of the newest step
        self.last_logp: torch.Tensor | None = None  # log-probabilities of the newest step's prediction (fp32)

    # ------------------------------------------------------------------ hooks
    def _features(self, hidden: TargetHidden) -> torch.Tensor:
        """What this drafter keeps of the target's hidden states for T tokens: [1, T, H]."""
        return hidden.states[0]

    def _run_steps(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps `self.steps .. self.steps + count` from features [1, count, H] and the tokens after them
        [1, count]; returns the newest step's (hidden [1, H], log-probabilities)."""
        raise NotImplementedError

    def _device(self) -> torch.device:
        raise NotImplementedError

    def _open_storage(self, context: DraftContext | None) -> None:
        """A request starts (its generation config in `context`): lease what it drafts with."""

    def _close_storage(self) -> None:
        """Give back what `_open_storage` leased."""

    # ------------------------------------------------------------------ keeping in step with the target
    def begin(self, input_ids: torch.Tensor, context: DraftContext | None = None,
              hidden: TargetHidden | None = None) -> None:
        self.release()
        self._open_storage(context)
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
        self._close_storage()

    def _take(self, hidden: TargetHidden | None, where: str) -> None:
        if hidden is None:
            raise RuntimeError(f"the {self.label} drafter got no target hidden states at {where}(); it must run "
                               "inside speculative_generate, which provides the layers in target_hidden_layers")
        if tuple(hidden.layers) != self.target_hidden_layers:
            raise RuntimeError(f"expected target hidden states {self.target_hidden_layers}, got {hidden.layers}")
        with torch.no_grad():
            self.pending.append(self._features(hidden))

    @torch.no_grad()
    def _advance(self, input_ids: torch.Tensor) -> None:
        """Run the steps that both a feature and the token after it are known for."""
        # One piece is the usual case (an accept's run): no concatenation, no copy.
        pending = (self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1)) if self.pending \
            else None
        available = 0 if pending is None else pending.shape[1]
        count = min(available, input_ids.shape[1] - 1 - self.steps)
        if count <= 0:
            return
        tokens = input_ids[:, self.steps + 1 : self.steps + 1 + count].to(self._device())
        self.last_hidden, self.last_logp = self._run_steps(pending[:, :count], tokens)
        self.steps += count
        self.pending = [pending[:, count:]] if available > count else []

    def _check_in_step(self, input_ids: torch.Tensor) -> None:
        if self.last_logp is None or self.steps != input_ids.shape[1] - 1:
            raise RuntimeError(f"the {self.label} drafter holds {self.steps} steps for {input_ids.shape[1]} committed "
                               "tokens; it is out of step with the target (begin/accept were not called in order)")
