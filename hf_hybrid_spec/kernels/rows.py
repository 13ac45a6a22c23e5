"""Copy chosen rows of several [1, N, H] tensors into one [L, 1, T, H] buffer: `out[l, 0, dst[r]] = src_l[0, order[r]]`.

The static runner's commit graph keeps the target's hidden states of every committed token for drafters that read
them (EAGLE, HVD): each step it copies the accepted path's rows of L layers (3 for EAGLE-3) into a per-token
history. In PyTorch that is a gather and a scatter per layer, 2L launches of a few kilobytes each, every one paying
the fixed cost of a graph node whatever its size; the Triton kernel does all L layers in one launch. `order` and
`dst` stay on the device (the commit graph computes them), so neither path reads anything back to the host.
"""

from __future__ import annotations

import torch

from .backend import resolve

__all__ = ["gather_rows", "torch_gather_rows", "MAX_TRITON_SOURCES"]

MAX_TRITON_SOURCES = 4  # source pointers one launch takes; more sources take several launches


def _check(out: torch.Tensor, sources: tuple[torch.Tensor, ...], order: torch.Tensor, dst: torch.Tensor) -> None:
    if out.ndim != 4 or out.shape[1] != 1:
        raise ValueError(f"out must be [L, 1, T, H], got {tuple(out.shape)}")
    if len(sources) != out.shape[0]:
        raise ValueError(f"{len(sources)} sources for {out.shape[0]} output layers")
    for s in sources:
        if s.ndim != 3 or s.shape[0] != 1 or s.shape[2] != out.shape[3]:
            raise ValueError(f"sources must be [1, N, {out.shape[3]}], got {tuple(s.shape)}")
    if order.ndim != 1 or dst.shape != order.shape:
        raise ValueError(f"order and dst must be [R] of one length, got {tuple(order.shape)} and {tuple(dst.shape)}")


def torch_gather_rows(out: torch.Tensor, sources: tuple[torch.Tensor, ...], order: torch.Tensor,
                      dst: torch.Tensor) -> None:
    """The reference (and any device, including a model split over devices: each source is read on its own)."""
    for j, src in enumerate(sources):
        rows = src.index_select(1, order.to(src.device)).to(out.device, out.dtype)
        out[j].index_copy_(1, dst.to(out.device), rows)


def _triton_fits(out: torch.Tensor, sources: tuple[torch.Tensor, ...], order: torch.Tensor, dst: torch.Tensor) -> bool:
    """One device, one dtype, unit-stride rows: what the kernel assumes (anything else takes the PyTorch path)."""
    return (all(s.device == out.device and s.dtype == out.dtype and s.stride(2) == 1 for s in sources)
            and out.stride(3) == 1 and order.device == out.device and dst.device == out.device)


def gather_rows(out: torch.Tensor, sources: tuple[torch.Tensor, ...], order: torch.Tensor, dst: torch.Tensor) -> None:
    """`out[l, 0, dst[r], :] = sources[l][0, order[r], :]` for every layer l and row r, in place.

    Args:
        out: [L, 1, T, H] buffer.
        sources: L tensors [1, N, H].
        order: [R] int rows to read (0 <= order < N).
        dst: [R] int positions to write (0 <= dst < T; distinct, or later rows win as `index_copy_` leaves it).
    """
    _check(out, sources, order, dst)
    if not sources or order.numel() == 0:
        return
    if resolve(out.device) == "triton" and _triton_fits(out, sources, order, dst):
        from .triton_rows import triton_gather_rows

        for start in range(0, len(sources), MAX_TRITON_SOURCES):
            part = sources[start : start + MAX_TRITON_SOURCES]
            triton_gather_rows(out[start : start + len(part)], part, order, dst)
    else:
        torch_gather_rows(out, sources, order, dst)
