"""Sampling keyed by position: the random draw behind the token at position t of a row depends only on (the call's
seed, the row, t), never on how many draft nodes were verified before it.

Each token is drawn by inverse transform sampling: one uniform u in (0, 1) per position, and the token is the first
whose cumulative probability under `softmax(scores)` exceeds u (scores already processed: temperature, top-k,
top-p, ...; a token filtered to -inf has probability 0 and is never drawn). u for position t is a counter-based hash
of (seed, row, t), so

- a verify tree can draw the target's token at every node at once: node n at depth d (root 0) draws the token at
  position `length + d`, and the walk from the root follows the child holding that token, as the greedy walk
  follows the argmax. Every committed token is the draw plain decoding with the same uniforms would make at its
  position, so the output is an exact sample of the target and the same whatever was drafted: a call repeated
  after `torch.manual_seed(s)` gives the same tokens although the process-wide suffix cache (or any other drafter
  state) changed the drafts in between.
- one uniform per node and a cumulative sum over the vocabulary: a few tensor ops, nothing drawn from a generator.

The hash is murmur3's 32-bit finalizer, on the host in numpy's uint64 (where the positions are known: a handful of
vector ops, then one copy to the device) or on int64 tensors of any device (every product kept below 2**63); both give
the same bits, so CPU and GPU draw the same uniforms. On a GPU the host form is the fast one: the tensor form launches
about 150 tiny kernels per call.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["draw_seed", "keyed_choice", "keyed_uniforms", "to_device"]

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), a Python int or int64 tensor (no int64 overflow)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _fmix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


_U = {name: np.uint64(value) for name, value in
      dict(m32=_M32, c1=_C1, c2=_C2, golden=_GOLDEN, mix=0x5BD1E995, s5=5, s6=6, s13=13, s16=16, s27=1 << 27,
           s32=32).items()}


def _fmix32_host(x: np.ndarray) -> np.ndarray:
    """`_fmix32` on uint64 arrays of values below 2**32 (each product below 2**64: numpy's uint64 holds it)."""
    u = _U
    x ^= x >> u["s16"]
    x *= u["c1"]
    x &= u["m32"]
    x ^= x >> u["s13"]
    x *= u["c2"]
    x &= u["m32"]
    x ^= x >> u["s16"]
    return x


def _host_uniforms(seed, row, positions: torch.Tensor) -> torch.Tensor:
    """`keyed_uniforms` on the host, in numpy: the same bits as the tensor form. The three broadcast against each
    other (e.g. seed and row [R, 1], positions [R, N]: each row's key hashed once)."""

    def u64(x) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            x = x.cpu().numpy()
        return np.asarray(x, dtype=np.int64).astype(np.uint64)

    u, mix = _U, _fmix32_host  # each call below takes a fresh array, which it changes in place
    m32 = u["m32"]
    seed, row, pos = u64(seed), u64(row), u64(positions)
    key = mix((seed & m32) ^ mix(((seed >> u["s32"]) & m32) ^ mix((row + u["golden"]) & m32)))
    first = mix(key ^ mix((pos + u["golden"]) & m32))
    second = mix(first ^ mix((key + u["mix"]) & m32))
    bits = (first >> u["s6"]) * u["s27"] + (second >> u["s5"])  # 26 + 27 bits
    out = (bits.astype(np.float64) + 0.5) / float(1 << 53)
    return torch.from_numpy(out)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queue (pinned, non-blocking) where it is CUDA: a
    blocking copy would wait for the work queued before it (the plain steps queue the next step before reading
    this one)."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.contiguous().pin_memory().to(device, non_blocking=True)


def draw_seed() -> int:
    """A call's sampling seed, drawn from torch's default generator: `torch.manual_seed(s)` (or transformers'
    `set_seed(s)`) before a call fixes its samples, as it does for stock `generate`."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))


def keyed_uniforms(seed: int | torch.Tensor, row: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The uniform of each position: positions [N] (int64, any device) -> [N] float64 in (0, 1) on that device, 53
    random bits from two 32-bit hashes of (seed, row, position). `seed` and `row`: one value, or [N] int64 (each
    position's; on the host where `positions` is)."""
    if positions.device.type == "cpu":
        return _host_uniforms(seed, row, positions)
    return _tensor_uniforms(seed, row, positions)


def _tensor_uniforms(seed, row, positions: torch.Tensor) -> torch.Tensor:
    """`keyed_uniforms` as int64 tensor ops where the positions are (a device's; any device gives the same bits)."""
    key = _fmix32((seed & _M32) ^ _fmix32(((seed >> 32) & _M32) ^ _fmix32((row + _GOLDEN) & _M32)))
    first = _fmix32(key ^ _fmix32((positions + _GOLDEN) & _M32))
    second = _fmix32(first ^ _fmix32((key + 0x5BD1E995) & _M32))
    bits = (first >> 6) * (1 << 27) + (second >> 5)  # 26 + 27 bits
    return (bits.to(torch.float64) + 0.5) / float(1 << 53)


def keyed_choice(scores: torch.Tensor, seed: int | torch.Tensor, row: int | torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """The token drawn at each position from `softmax(scores)`.

    Args:
        scores: [N, V] processed scores (float; -inf where a processor removed a token).
        seed: the call's seed (`draw_seed`), or [N] int64 each score row's (requests of a serving batch);
        row: the batch row (rows of one call draw independently), or [N] int64, each score row's batch row (a whole
            batch's trees at once).
        positions: [N] the position of the token each row of `scores` chooses (prompt length for the first token).
            On the host, the uniforms are worked out there and go to the device in one copy that does not wait for
            it (the fast form; seed, row and positions may then be any shapes that broadcast to N values in row-major
            order, e.g. [R, 1], [R, 1] and [R, n]); on the device, there.

    Returns:
        [N] int64 token ids on the scores' device.
    """
    cdf = torch.softmax(scores.float(), dim=-1).to(torch.float64).cumsum(dim=-1)
    if positions.device.type == "cpu":
        u = to_device(_host_uniforms(seed, row, positions).reshape(-1), scores.device) * cdf[:, -1]
    else:
        if isinstance(row, torch.Tensor):
            row = row.to(device=scores.device, dtype=torch.int64)
        if isinstance(seed, torch.Tensor):
            seed = seed.to(device=scores.device, dtype=torch.int64)
        u = _tensor_uniforms(seed, row, positions.to(dtype=torch.int64)) * cdf[:, -1]
    # The first token whose cumulative probability exceeds u: never one of probability 0 (its cdf equals the one
    # before it).
    return torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp(max=scores.shape[-1] - 1)
