"""Linear layers at verify shapes (a few rows against a large weight) on the GPU: `skinny_linear`.

`skinny_linear(x, weight, bias)` is `F.linear` with the same contract; for at most `MAX_ROWS` rows of a CUDA fp16 /
bf16 input it runs our Triton kernel (`triton_skinny`), elsewhere `F.linear`. It is also the custom op
`torch.ops.hf_hybrid_spec.skinny_linear`, so Inductor-compiled regions call it as one opaque kernel and CUDA graphs
capture it. The launch configuration is tuned once per (N, K, row tile, dtype, device) on first use outside a graph
capture (the static runner's warm-up), timing a few candidates with the L2 cache flushed; during a capture an untuned
shape takes the default. Splits of K are at most 2, so the float32 partial sums are added in one order whatever the
timing: results are deterministic run to run.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

__all__ = ["skinny_linear", "skinny_supported", "MAX_ROWS", "tuned_configs"]

logger = logging.getLogger(__name__)

MAX_ROWS = 64
_DTYPES = (torch.float16, torch.bfloat16)
_tuned: dict[tuple, object] = {}
_lock = threading.Lock()


def skinny_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` runs our kernel for these operands (else it is `F.linear`)."""
    if x.device.type != "cuda" or x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.device != x.device:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 0 < rows <= MAX_ROWS and weight.ndim == 2 and weight.stride(-1) == 1


def _candidates():
    from .triton_skinny import SkinnyConfig

    # Tiles along N x K, K splits (at most 2: see the module docstring), pipeline stages. Few and wide apart: the
    # first use of each compiles it.
    return [SkinnyConfig(block_n=bn, block_k=bk, split_k=s, num_stages=st)
            for bn, bk, s, st in ((16, 256, 1, 4), (32, 256, 1, 4), (64, 128, 1, 4), (64, 256, 1, 3),
                                  (128, 128, 1, 3), (16, 256, 2, 4), (32, 256, 2, 4), (32, 128, 1, 5))]


def _time(fn, flush: torch.Tensor, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        flush.zero_()  # evict the weight from L2: a forward reads each layer's weight once
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _config(x2: torch.Tensor, weight: torch.Tensor):
    from .triton_skinny import SkinnyConfig, block_m, triton_skinny_linear

    key = (weight.shape[0], weight.shape[1], block_m(x2.shape[0]), x2.dtype, x2.device.index)
    config = _tuned.get(key)
    if config is not None:
        return config
    if torch.cuda.is_current_stream_capturing():
        return SkinnyConfig()
    with _lock:
        if key in _tuned:
            return _tuned[key]
        flush = torch.empty(64 << 20, dtype=torch.int8, device=x2.device)
        timed = []
        for candidate in _candidates():
            try:
                triton_skinny_linear(x2, weight, None, candidate)  # compile / warm
                timed.append((_time(lambda c=candidate: triton_skinny_linear(x2, weight, None, c), flush), candidate))
            except Exception as err:  # a configuration this toolchain / GPU refuses: the others remain
                logger.debug("skinny_linear: %s failed for %s: %s", candidate, key, err)
        config = min(timed, key=lambda t: t[0])[1] if timed else SkinnyConfig()
        _tuned[key] = config
        logger.debug("skinny_linear: tuned %s -> %s", key, config)
        return config


def tuned_configs() -> dict:
    """The configurations chosen so far, by (N, K, row tile, dtype, device index)."""
    return dict(_tuned)


def _skinny_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not skinny_supported(x, weight):
        return F.linear(x, weight, bias)
    from .triton_skinny import triton_skinny_linear

    x2 = x.reshape(-1, x.shape[-1])
    with torch.cuda.device(x.device):
        return triton_skinny_linear(x2, weight, bias, _config(x2, weight)).view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("hf_hybrid_spec::skinny_linear", mutates_args=())
def _skinny_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _skinny_impl(x, weight, bias)


@_skinny_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; our Triton kernel where `skinny_supported` (see the module docstring)."""
    return _skinny_op(x, weight, bias)
