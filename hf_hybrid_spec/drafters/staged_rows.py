"""The accept passes of a drafter store of R rows (EAGLE's `StaticEagleTree`, MTP's `BatchMtpStore`): each row's
committed steps from target features and tokens, with the per-row integers (steps, counts, tokens) staged in one
device buffer that the pass re-reads at every call, so one captured pass serves every step.

A store mixing this in has `rows`, `capacity`, `MAX_ADVANCE`, `LABEL` (its name in errors), the device buffers
`steps` / `counts` [R], `hidden` [R, H], `logp` [R, V], `adv_features` [R, MAX_ADVANCE, H], `adv_tokens`
[R, MAX_ADVANCE], the staging `_row_ints` (a `staging.HostStaging`) and `_row_ints_device` [R * (2 + MAX_ADVANCE)], and
`_advance(count, features=None, tokens=None) -> (hidden [R, H], logp [R, V])` (row r's step `counts[r] - 1`) and
`_advance_pass(count)` (the staged pass, `_unstage` then `_advance` then `_keep_newest`, eager or replayed).
"""

from __future__ import annotations

import torch

__all__ = ["StagedRows"]


class StagedRows:
    """Mixin: `advance_rows` (host-staged) and `advance_rows_device` (from device tensors) over `_advance_pass`."""

    def advance_rows(self, steps: list[int], counts: list[int], features: torch.Tensor, tokens: torch.Tensor) -> None:
        """Every row's next committed steps: row r's `steps[r] .. steps[r] + counts[r]` (0: none) from target features
        [R, C, H] and the tokens after them [R, C] (C >= max(counts); the rest is padding). Writes their keys and
        values, and each row's newest step's output and log-probabilities into `hidden` / `logp` (rows with count 0
        keep theirs), and advances `steps` on the device. A pass longer than MAX_ADVANCE (a batch's prompts) runs
        eagerly."""
        rows, count = tokens.shape
        end = max(s + c for s, c in zip(steps, counts))
        if end > self.capacity:
            raise RuntimeError(f"{self.LABEL} holds {self.capacity} steps per row, {end} needed")
        ints = self._row_ints.host()
        ints[:rows].copy_(torch.tensor(steps, dtype=torch.long))
        ints[rows : 2 * rows].copy_(torch.tensor(counts, dtype=torch.long))
        if count <= self.MAX_ADVANCE:
            ints[2 * rows :].view(rows, self.MAX_ADVANCE)[:, :count].copy_(tokens)
        self._row_ints.send(self._row_ints_device)
        if count > self.MAX_ADVANCE:
            self._unstage(tokens=False)
            self._keep_newest(*self._advance(count, features.to(self.dtype), tokens.to(self.device)))
            return
        self.adv_features[:, :count].copy_(features)
        self._advance_pass(count)

    def advance_rows_device(self, counts: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """`advance_rows` from device tensors (no host read): counts [R], features [R, C, H] and tokens [R, C]
        (C <= MAX_ADVANCE), each row from its current `steps` on the device."""
        rows, count = tokens.shape
        if count > self.MAX_ADVANCE:
            raise ValueError(f"an accept pass from the device takes at most {self.MAX_ADVANCE} steps per row, got "
                             f"{count}")
        # The pass re-reads its integers from the staging buffer (as for host-staged passes): the device steps, the
        # counts and the tokens go there.
        staged = self._row_ints_device
        staged[:rows].copy_(self.steps)
        staged[rows : 2 * rows].copy_(counts)
        staged[2 * rows :].view(rows, self.MAX_ADVANCE)[:, :count].copy_(tokens)
        self.adv_features[:, :count].copy_(features)
        self._advance_pass(count)

    def _unstage(self, tokens: bool = True) -> None:
        """A pass's staged integers into place: steps, counts and (`tokens`) the tokens (graph-safe device copies)."""
        rows, staged = self.rows, self._row_ints_device
        self.steps.copy_(staged[:rows])
        self.counts.copy_(staged[rows : 2 * rows])
        if tokens:
            self.adv_tokens.copy_(staged[2 * rows :].view(rows, self.MAX_ADVANCE))

    def _keep_newest(self, hidden: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After an accept pass: each row that committed steps gets its newest step as the root of its next tree, and
        its step count advances (graph-safe: no host reads). Returns `hidden`, `logp` (the store's buffers)."""
        moved = (self.counts > 0).unsqueeze(1)
        self.hidden.copy_(torch.where(moved, hidden, self.hidden))
        self.logp.copy_(torch.where(moved, logp, self.logp))
        self.steps.add_(self.counts)
        return self.hidden, self.logp
