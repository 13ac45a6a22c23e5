"""Sampling keyed by position: the random draw behind the token at position t of a row depends only on (the call's
seed, the row, t), never on how many draft nodes were verified before it.

Each token is drawn by the Gumbel-max trick, `argmax(scores + G)` with `G` i.i.d. standard Gumbel over the
vocabulary: an exact sample of `softmax(scores)` (scores already processed: temperature, top-k, top-p, ...; a token
filtered to -inf is never drawn). `G` for position t is a counter-based hash of (seed, row, t, token id), so

- a verify tree can draw the target's token at every node at once: node n at depth d (root 0) draws the token at
  position `length + d`, and the walk from the root follows the child holding that token, as the greedy walk
  follows the argmax. Every committed token is the draw plain decoding with the same noise would make at its
  position, so the output is an exact sample of the target and the same whatever was drafted: a call repeated
  after `torch.manual_seed(s)` gives the same tokens although the process-wide suffix cache (or any other drafter
  state) changed the drafts in between.
- nothing is drawn from a generator per node, so the rule runs as a few tensor ops with no host loop.

The hash is murmur3's 32-bit finalizer on int64 tensors, every product kept below 2**63 (16-bit halves), so CPU
and GPU give the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["draw_seed", "gumbel_choice", "position_keys"]

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_GOLDEN = 0x9E3779B9
# A uniform in (0, 1) from the top 24 bits of a hash: exact in float32, never 0 or 1.
_U_SCALE = 1.0 / (1 << 24)

# Hashes of the token ids 0..V-1 by (V, device): the vocabulary's half of every node's noise.
_VOCAB: dict[tuple[int, str], torch.Tensor] = {}


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


def position_keys(seed: int, row: int, positions: torch.Tensor) -> torch.Tensor:
    """The noise key of each position: positions [N] (int64, any device) -> [N] int64 in [0, 2**32)."""
    key = _fmix32((seed & _M32) ^ _fmix32(((seed >> 32) & _M32) ^ _fmix32((row + _GOLDEN) & _M32)))
    return _fmix32(key ^ _fmix32((positions + _GOLDEN) & _M32))


def _vocab_hash(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    found = _VOCAB.get(key)
    if found is None:
        ids = torch.arange(vocab, dtype=torch.int64, device=device)
        found = _VOCAB[key] = _fmix32(_mul32(ids, _GOLDEN) ^ 0x5BD1E995)
    return found


def gumbel_choice(scores: torch.Tensor, seed: int, row: int, positions: torch.Tensor) -> torch.Tensor:
    """The token drawn at each position from `softmax(scores)`.

    Args:
        scores: [N, V] processed scores (float; -inf where a processor removed a token).
        seed: the call's seed (`draw_seed`); row: the batch row (rows of one call draw independently).
        positions: [N] the position of the token each row of `scores` chooses (prompt length for the first token).

    Returns:
        [N] int64 token ids on the scores' device.
    """
    keys = position_keys(seed, row, positions.to(device=scores.device, dtype=torch.int64))
    bits = _fmix32(_vocab_hash(scores.shape[-1], scores.device).unsqueeze(0) ^ keys.unsqueeze(1))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * _U_SCALE
    gumbel = -torch.log(-torch.log(uniform))
    return (scores.float() + gumbel).argmax(dim=-1)
