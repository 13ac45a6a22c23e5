"""`staging.HostStaging`: what a send carries, and (on CUDA) that rewriting the buffer never changes a queued copy."""

import pytest
import torch

from hf_hybrid_spec.staging import HostStaging, device_busy


def test_send_carries_the_buffer_and_its_slices():
    staging = HostStaging(6, torch.device("cpu"), fill=-1)
    assert staging.host().tolist() == [-1] * 6
    target = torch.zeros(6, dtype=torch.long)
    staging.host().copy_(torch.arange(6))
    staging.send(target)
    assert target.tolist() == [0, 1, 2, 3, 4, 5]
    staging.host()[4:].copy_(torch.tensor([40, 50]))
    staging.send(target[4:], 4)
    assert target.tolist() == [0, 1, 2, 3, 40, 50]
    grid = torch.zeros(2, 2, dtype=torch.long)
    staging.send(grid, 0, 4)
    assert grid.tolist() == [[0, 1], [2, 3]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU every copy is synchronous")
def test_rewrite_waits_for_the_queued_copy():
    # The device is kept busy, so the first copy is still queued when the host rewrites the buffer: without the wait,
    # the first target would receive the second contents.
    device = torch.device("cuda")
    staging = HostStaging(4, device)
    first, second = (torch.zeros(4, dtype=torch.long, device=device) for _ in range(2))
    for _ in range(3):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of device time queued ahead of the copy
        staging.host().copy_(torch.tensor([1, 2, 3, 4]))
        staging.send(first)
        staging.host().copy_(torch.tensor([5, 6, 7, 8]))
        staging.send(second)
        torch.cuda.synchronize()
        assert first.tolist() == [1, 2, 3, 4]
        assert second.tolist() == [5, 6, 7, 8]


def test_device_busy_follows_the_work_queued_before_it():
    assert device_busy(torch.device("cpu"))() is False  # on the CPU queued work has run
    if not torch.cuda.is_available():
        return
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):
        a = a @ a / 64.0  # ~tens of ms queued
    busy = device_busy(torch.device("cuda"))
    assert busy()
    torch.cuda.synchronize()
    assert not busy()


def test_pinned_buffers_are_staged_or_read_back():
    # A pinned host buffer copied to the device with `non_blocking=True` and rewritten by the host can send its newer
    # contents (the race `HostStaging` closes, which no CPU test can show). So the package pins memory in two places
    # only: HostStaging, and the device-to-host buffers that the loops read after an event (plain steps, the pipelined
    # step's results, a serving step's argmax). A new pinned buffer belongs in one of the two.
    from pathlib import Path

    import hf_hybrid_spec

    root = Path(hf_hybrid_spec.__file__).parent
    pinning = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "pin_memory=" in p.read_text())
    assert pinning == ["engine/pipeline.py", "engine/plain.py", "serving/engine.py", "staging.py"]
