"""Plain greedy decode steps of a batch on the batched static runner: what a batch runs once drafting does not pay.

The budget's promise is that speculation never loses to autoregressive decoding, so the step it falls back to must
cost what a plain decode step costs. The pipelined and general batch steps can verify a tree of width 1, but they
carry the tree machinery (selection, masks, the walk or its device version, per-node bookkeeping) around a one-token
forward: measured on the H200 at B = 8 to 64, that made a width-1 step 0.7-1.4 ms slower than stock's compiled
decode step. Here one step is

    forward_device(roots)            # each row's last token alone: the runner's narrowest captured graph
    argmax -> commit_device          # every running row keeps its root; rows that stopped commit nothing
    read the new tokens              # the one wait; stopping criteria and records on the host

about a dozen launches around the captured forward, and the host knows every row's new length without reading it
(one token per running row). Greedy over raw logits only (no logits processors): the token is the argmax of the
target's own logits, as stock greedy takes it.
"""

from __future__ import annotations

import time

import torch

from .outputs import SpecStats
from .rows import BatchRecorder

__all__ = ["plain_steps", "runs_plain"]


def runs_plain(backend, raw_greedy: bool) -> bool:
    """Whether a batch's plain steps can run here: the batched static runner and greedy over raw logits."""
    from .batch_static import BatchStaticBackend

    return isinstance(backend, BatchStaticBackend) and raw_greedy


def plain_steps(backend, rec: BatchRecorder, running: list[int], max_length: int, stats: SpecStats,
                row_stats: list[SpecStats]) -> None:
    """Step the batch without drafts until no row runs. `running` are the running rows, which index the runner's rows
    (a `generate` batch: row b is runner row b); the cache holds every row's committed tokens but its last, which is
    the next step's root (`rec.host[b][-1]`)."""
    runner = backend.runner
    rows, device = runner.rows, runner.device
    pinned = device.type == "cuda"
    new_host = torch.zeros(rows, dtype=torch.long, pin_memory=pinned)
    roots = torch.tensor([rec.host[b][-1] for b in range(rows)], dtype=torch.long).to(device)
    parent = torch.full((rows, 1), -1, dtype=torch.long, device=device)
    leaves = on = None
    while running:
        t0 = time.perf_counter()
        if on is None:  # the running rows changed: each running row commits its root (leaf 0), the rest nothing
            flags = torch.zeros(rows, dtype=torch.long)
            flags[running] = 1
            on = flags.to(device)
            leaves = on - 1
        try:
            logits = backend.forward_device(roots.unsqueeze(1), parent)
            best = logits[:, 0].argmax(dim=-1)
            backend.commit_device(leaves)
        except BaseException:
            backend.abort()
            raise
        roots = torch.where(on.bool(), best, roots)
        new_host.copy_(roots, non_blocking=True)
        if pinned:
            torch.cuda.current_stream(device).synchronize()
        new = new_host.tolist()
        rec.append(running, [[new[b]] for b in running])
        counts = [0] * rows
        for b in running:
            counts[b] = 1
        backend.finish_commit(counts)
        stats.target_forwards += 1
        stats.plain_steps += 1
        stats.verify_seconds += time.perf_counter() - t0
        for b in running:
            for s in (stats, row_stats[b]):
                s.accepted_lengths.append(1)
                s.drafted_tokens.append(0)
            row_stats[b].target_forwards += 1
        keep = rec.still_running(running, max_length)
        if len(keep) < len(running):
            if keep:
                backend.select_rows(keep)
            running = [running[j] for j in keep]
            on = None
