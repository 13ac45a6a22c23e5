"""A host buffer that fills device buffers with asynchronous copies and can be rewritten at any time.

A copy from pinned host memory is queued: the device reads the host buffer when the copy runs, not when the host
queues it. A loop that queues step after step without reading anything back (a chunked prefill, a run of plain steps)
gets ahead of the device, and rewriting a pinned buffer there sends the newer contents in place of the older ones,
silently. `HostStaging.host()` waits for the copy queued last out of the buffer (in a loop that reads every step,
long done) before it hands the buffer out again; `send` queues a copy and marks it.

On the CPU (and for a CPU target) the buffer is ordinary memory and every copy is synchronous.

`device_busy` is the other side of the same overlap: whether the work queued so far still runs, for host work that
may fill the wait.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["HostStaging", "device_busy"]


def device_busy(device: torch.device) -> Callable[[], bool]:
    """`busy()`: True while the work queued on `device`'s current stream so far (when this is called) still runs; never
    on the CPU, where queued work has run. For host work that fills the wait (deferred drafter bookkeeping)."""
    if torch.device(device).type != "cuda":
        return lambda: False
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return lambda: not event.query()


class HostStaging:
    """A host buffer of `size` (pinned for a CUDA `device`) for asynchronous host-to-device copies.

    Usage: `buffer = staging.host()` (waits for the last copy out of it), write `buffer` (or a part), then
    `staging.send(target)` or `staging.send(target, start, end)` for the elements `start:end` of the flattened buffer.
    """

    def __init__(self, size: int | tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.long,
                 fill: int = 0):
        self.pinned = torch.device(device).type == "cuda"
        self._host = torch.full(size if isinstance(size, tuple) else (size,), fill, dtype=dtype,
                                pin_memory=self.pinned)
        self._sent = torch.cuda.Event() if self.pinned else None
        self._pending = False

    def host(self) -> torch.Tensor:
        """The host buffer, once the device has run the copy queued last out of it."""
        if self._pending:
            self._sent.synchronize()
            self._pending = False
        return self._host

    def send(self, target: torch.Tensor, start: int = 0, end: int | None = None) -> None:
        """Queue the copy of the flattened buffer's elements `start:end` into `target` (as many elements)."""
        source = self._host.view(-1)[start:end]
        target.view(-1).copy_(source, non_blocking=True)
        if self._sent is not None and target.device.type == "cuda":
            # On the stream the copy went to: the target's device's current stream (not the current device's).
            self._sent.record(torch.cuda.current_stream(target.device))
            self._pending = True
