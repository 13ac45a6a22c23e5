"""The committed tokens of a batch's rows, kept for the batch loop (`engine.batch`).

Each row's tokens live twice: a host list (stopping checks, roots, the drafters' bookkeeping) and a row of one device
buffer [B, max_length] (pre-filled with the pad token), from which drafters and device-side stopping criteria read
views and the output is sliced. A step writes every row's new tokens with one copy; no per-row concatenation, so the
host cost of a step stays a few microseconds per row.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList

from ..stopping import HostStopping

__all__ = ["BatchRecorder"]


class BatchRecorder:
    """Rows' committed tokens with stock generate's batch semantics.

    Args:
        input_ids: [B, L] the left-padded prompts (each row's tokens start as its prompt row, padding included, as
            stock generate's rows do: criteria and logits processors see the same ids).
        stopping: the stopping criteria. truncate: stock pads a stopped row (True when an EOS criterion is present);
            False keeps decoding stopped rows until every row has stopped, and only remembers where each stopped.
        pad_token_id: what fills a stopped row (None: 0, and an error if rows end at different lengths).
        max_length: the generation's max length (the buffer's width).
    """

    def __init__(self, input_ids: torch.Tensor, stopping: StoppingCriteriaList, truncate: bool,
                 pad_token_id: int | None, max_length: int):
        rows, length = input_ids.shape
        self.pad_token_id = pad_token_id
        self.buffer = torch.full((rows, max(max_length, length)), 0 if pad_token_id is None else int(pad_token_id),
                                 dtype=torch.long, device=input_ids.device)
        self.buffer[:, :length] = input_ids
        # On the host (the serving engine's requests, a CPU batch), writes go through a NumPy view: a slice assigned
        # from a list, without building a tensor per write (every request, every step).
        self._host_view = self.buffer.numpy() if self.buffer.device.type == "cpu" else None
        self.host: list[list[int]] = input_ids.tolist()
        self.lengths = [length] * rows
        self.stopping = stopping
        self.host_stopping = HostStopping.build(stopping)
        self.truncate = truncate
        self.finished = [False] * rows
        self.stopped_at: list[int | None] = [None] * rows

    def ids(self, row: int, start: int = 0) -> torch.Tensor:
        """Row `row`'s committed tokens from `start` on: a [1, n] view of the buffer (valid until the next append)."""
        return self.buffer[row : row + 1, start : self.lengths[row]]

    def append(self, rows: list[int], tokens: list[list[int]]) -> None:
        """Commit `tokens[i]` to row `rows[i]`: each prefix is checked as stock generate checks it (a row that
        stops keeps its tokens up to the stop, with `truncate`; else all of them, the stop remembered)."""
        if len(rows) == 1 and self.truncate and self._host_view is not None and self.host_stopping is not None:
            return self._append_host_row(rows[0], tokens[0])
        self._write(rows, tokens)
        for row, new in zip(rows, tokens):
            start = self.lengths[row]
            stops = self._stops(row, start, new)
            kept = next((j + 1 for j, stop in enumerate(stops) if stop), len(new))
            if self.truncate:
                if kept and stops[kept - 1]:
                    self.finished[row] = True
                if kept < len(new):  # the tokens past the stop were written: pad them again
                    self.buffer[row, start + kept : start + len(new)] = 0 if self.pad_token_id is None \
                        else int(self.pad_token_id)
            else:
                if self.stopped_at[row] is None and kept and stops[kept - 1]:
                    self.stopped_at[row] = start + kept
                kept = len(new)
            self.host[row].extend(new[:kept])
            self.lengths[row] = start + kept

    def _append_host_row(self, row: int, new: list[int]) -> None:
        """`append` of one row kept on the host with host stopping criteria and `truncate` (a serving engine's request,
        every step): the tokens up to the first that stops, checked and written without the batch's lists."""
        start, stops, kept = self.lengths[row], self.host_stopping.stops, len(new)
        for j, token in enumerate(new):
            if stops(start + j + 1, token):
                kept = j + 1
                self.finished[row] = True
                break
        if kept:
            self._host_view[row, start : start + kept] = new[:kept]
            self.host[row].extend(new[:kept])
            self.lengths[row] = start + kept

    def _write(self, rows: list[int], tokens: list[list[int]]) -> None:
        """`tokens[i]` into the buffer after row `rows[i]`'s committed tokens, in one copy."""
        device = self.buffer.device
        if self._host_view is not None:
            view = self._host_view
            for row, new in zip(rows, tokens):
                if new:
                    start = self.lengths[row]
                    view[row, start : start + len(new)] = new
            return
        if len(rows) == 1:  # one row (the serving engine's requests): one slice, no index tensors
            start, new = self.lengths[rows[0]], tokens[0]
            if new:
                self.buffer[rows[0], start : start + len(new)] = torch.tensor(new, dtype=torch.long).to(
                    device, non_blocking=True)
            return
        flat_rows, flat_cols, flat = [], [], []
        for row, new in zip(rows, tokens):
            start = self.lengths[row]
            flat_rows += [row] * len(new)
            flat_cols += range(start, start + len(new))
            flat += new
        if flat:
            index = torch.tensor([flat_rows, flat_cols], dtype=torch.long)
            values = torch.tensor(flat, dtype=torch.long)
            self.buffer.index_put_((index[0].to(device, non_blocking=True), index[1].to(device, non_blocking=True)),
                                   values.to(device, non_blocking=True))

    def _stops(self, row: int, start: int, new: list[int]) -> list[bool]:
        if self.host_stopping is not None:
            return [self.host_stopping.stops(start + j + 1, token) for j, token in enumerate(new)]
        verdicts = [self.stopping(self.buffer[row : row + 1, : start + j + 1], None).any() for j in range(len(new))]
        return torch.stack(verdicts).tolist() if verdicts else []

    def limit(self, max_length: int) -> int:
        """The longest a row may grow this step: `max_length`, or without EOS criteria, once every row has stopped,
        the length where the last one stopped (rows still short of it run up to it)."""
        if self.truncate or any(s is None for s in self.stopped_at):
            return max_length
        return min(max_length, max(self.stopped_at))

    def still_running(self, running: list[int], max_length: int) -> list[int]:
        """Positions in `running` of the rows that go on (never one at the length limit, nor one that stopped with
        `truncate`)."""
        limit = self.limit(max_length)
        return [j for j, b in enumerate(running) if self.lengths[b] < limit and not self.finished[b]]

    def sequences(self, length: int) -> torch.Tensor:
        """The output [B, length]: each row's tokens, stopped rows padded."""
        if self.pad_token_id is None and len(set(min(n, length) for n in self.lengths)) > 1:
            raise ValueError("rows of the batch stopped at different lengths and the generation config has no "
                             "pad_token_id to fill the shorter ones")
        return self.buffer[:, :length].clone()
