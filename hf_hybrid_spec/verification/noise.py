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

The hash is murmur3's 32-bit finalizer on Python ints and int64 tensors (every product kept below 2**63), so CPU and
GPU draw the same uniforms.
"""

from __future__ import annotations

import torch

__all__ = ["draw_seed", "keyed_choice", "keyed_uniforms"]

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


def draw_seed() -> int:
    """A call's sampling seed, drawn from torch's default generator: `torch.manual_seed(s)` (or transformers'
    `set_seed(s)`) before a call fixes its samples, as it does for stock `generate`."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))


def keyed_uniforms(seed: int | torch.Tensor, row: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The uniform of each position: positions [N] (int64, any device) -> [N] float64 in (0, 1), 53 random bits
    from two 32-bit hashes of (seed, row, position). `seed` and `row`: one value, or [N] int64 (each position's)."""
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

    Returns:
        [N] int64 token ids on the scores' device.
    """
    cdf = torch.softmax(scores.float(), dim=-1).to(torch.float64).cumsum(dim=-1)
    if isinstance(row, torch.Tensor):
        row = row.to(device=scores.device, dtype=torch.int64)
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=scores.device, dtype=torch.int64)
    u = keyed_uniforms(seed, row, positions.to(device=scores.device, dtype=torch.int64)) * cdf[:, -1]
    # The first token whose cumulative probability exceeds u: never one of probability 0 (its cdf equals the one
    # before it).
    return torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp(max=scores.shape[-1] - 1)
