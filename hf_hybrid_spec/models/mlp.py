"""MLP forwards for the fused verify forward (`AssistantConfig(compile_verify=True)`, `fusion.fused_regions`).

Within the fused regions an MLP module normally runs its class forward compiled by Inductor, which issues the gate
and up projections one after the other. These forwards compute the same function with the two projections side by
side (`fusion.parallel_linears`: parallel branches of the captured graph) and the activation in one compiled
kernel. Each is registered by class name in its family's adapter (`ModelAdapter.mlps`) and used only where
`applies` holds (a silu activation); every other MLP keeps the compiled class forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fusion import fusable, parallel_linears

__all__ = ["gated_silu_mlp", "multiplied_gated_silu_mlp", "applies"]


def applies(module: nn.Module) -> bool:
    """Whether the module has the gate / up / down projections and the silu activation these forwards assume."""
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"))


@fusable
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@fusable
def scaled_silu_mul(gate: torch.Tensor, up: torch.Tensor, gate_multiplier: float) -> torch.Tensor:
    return up * F.silu(gate * gate_multiplier)


def gated_silu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)): Llama-style MLPs (Qwen3.5's)."""
    gate, up = parallel_linears(x, module.gate_proj, module.up_proj)
    return module.down_proj(silu_mul(gate, up))


def multiplied_gated_silu_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier: Falcon-H1's muP MLP."""
    gate, up = parallel_linears(x, module.gate_proj, module.up_proj)
    return module.down_proj(scaled_silu_mul(gate, up, module.gate_multiplier)) * module.down_multiplier
