"""Model adapters: route a hybrid layer's forward to tree verification, without forking model files.

An adapter names the recurrent mixer classes of one model family and gives the tree forward of each. `install`
wraps those modules' `forward` (instance attribute, like accelerate's hooks): the wrapper calls the family's
tree forward only when the cache passed in is a `HybridTreeCache` in tree mode, and the stock forward
otherwise, so prefill, plain `generate` and training see unchanged behaviour. Attention layers need no
routing: the tree is expressed through their 4D mask and position ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import SSM_VARIANTS
from ..routing import ROUTED_FLAG, TreeForward, find_mixer_cache, overriding, route

# SSM_VARIANTS: how `ModelAdapter.suppress_attention` removes the attention pathway (self-speculation):
#   "zero_attention": every attention module outputs zeros; the rest of its layer runs (parallel hybrids: the
#       SSM branch alone feeds the residual; sequential hybrids: attention layers keep only their MLP).
#   "rescale_ssm": parallel hybrids only; attention zeroed and the SSM branch multiplied by `ssm_scale`, so
#       the mixer's contribution to the residual keeps about its usual size.
#   "skip_layer": sequential hybrids only; each decoder layer that holds attention is the identity (its MLP is
#       skipped too: the residual stream passes through unchanged).

__all__ = ["ModelAdapter", "TreeForward", "find_mixer_cache", "ROUTED_FLAG", "SSM_VARIANTS"]


@dataclass
class ModelAdapter:
    """How one model family runs a draft tree.

    Attributes:
        name: family name shown to users ("qwen3_5", "falcon_h1", ...).
        model_types: `config.model_type` values of the text model this adapter serves.
        mixers: class name of each recurrent mixer module -> its tree forward.
        kind: "sequential" (recurrent and attention layers alternate), "parallel" (both in every layer), or
            "attention" (no recurrent layer); used by the self-speculative drafters.
        attention: class names of the family's attention modules (what `suppress_attention` turns off).
        layer_tuple_length: 0 where the family's decoder layer returns the hidden states tensor; n where it
            returns an n-tuple with the hidden states first (what a layer skipped by "skip_layer" returns, with
            None in the other places).
        mlps: class name of MLP modules -> the forward they run in the fused verify forward (`models.mlp`: the same
            function, its projections in parallel; used where `mlp.applies` holds).
    """

    name: str
    model_types: tuple[str, ...]
    mixers: dict[str, TreeForward] = field(default_factory=dict)
    kind: str = "sequential"
    attention: tuple[str, ...] = ()
    layer_tuple_length: int = 0
    mlps: dict[str, Callable] = field(default_factory=dict)

    def fused_forwards(self, model: nn.Module) -> dict[nn.Module, Callable]:
        """The modules of `model` that run an `mlps` forward inside `fusion.fused_regions`, with that forward."""
        from .mlp import applies

        return {m: self.mlps[type(m).__name__] for m in model.modules()
                if type(m).__name__ in self.mlps and applies(m)}

    def mixer_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if type(m).__name__ in self.mixers]

    def install(self, model: nn.Module) -> None:
        """Route every recurrent mixer of `model` to its tree forward (idempotent; `routing.route`)."""
        for module in self.mixer_modules(model):
            route(module, self.mixers[type(module).__name__])

    # ------------------------------------------------------------------ self-speculation
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder's layer list (the text backbone's, for multimodal wrappers)."""
        layers = getattr(model.get_decoder(), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise NotImplementedError(
                f"{type(model).__name__}: cannot find the decoder's `layers` list, so self-speculation does not "
                "apply to it"
            )
        return layers

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if type(m).__name__ in self.attention]

    @contextlib.contextmanager
    def suppress_attention(self, model: nn.Module, variant: str = "zero_attention",
                           ssm_scale: float = 1.0) -> Iterator[None]:
        """Within the block, `model` runs with its attention pathway removed as `variant` says (see
        SSM_VARIANTS), for calls made in this thread only (`routing.overriding`: other threads using the model
        meanwhile see it whole); configs and weights are never touched. Raises ValueError where the variant does
        not apply to this family."""
        if self.kind == "attention" or not self.attention:
            raise ValueError(
                f"self_ssm drafting needs a hybrid model with recurrent layers; {self.name} models are "
                "attention-only, so suppressing attention leaves nothing to draft with (use drafter='layerskip')"
            )
        if variant not in SSM_VARIANTS:
            raise ValueError(f"ssm variant must be one of {SSM_VARIANTS}, got {variant!r}")
        if variant == "rescale_ssm" and self.kind != "parallel":
            raise ValueError(f"'rescale_ssm' needs a parallel hybrid; {self.name} is {self.kind}: use "
                             "'zero_attention' or 'skip_layer'")
        if variant == "skip_layer" and self.kind != "sequential":
            raise ValueError(f"'skip_layer' needs a sequential hybrid; in {self.name} ({self.kind}) every layer "
                             "holds an SSM branch too: use 'zero_attention' or 'rescale_ssm'")
        attention = self.attention_modules(model)
        if not attention:
            raise ValueError(f"{type(model).__name__} has none of the attention modules {sorted(self.attention)}")
        overrides: dict[nn.Module, Callable] = {}
        if variant == "skip_layer":
            ids = {id(m) for m in attention}
            skip = _pass_through(self.layer_tuple_length)
            for layer in self.decoder_layers(model):
                if any(id(m) in ids for m in layer.modules()):
                    overrides[layer] = skip
        else:
            overrides.update((module, _zero_attention) for module in attention)
        if variant == "rescale_ssm":
            scaled = _scaled(ssm_scale)
            overrides.update((module, scaled) for module in self.mixer_modules(model))
        with overriding(overrides):
            yield

    @contextlib.contextmanager
    def early_exit(self, model: nn.Module, exit_layer: int) -> Iterator[None]:
        """Within the block, `model` runs its first `exit_layer` decoder layers only, then its own final norm
        and head (multipliers included): the later layers pass the residual stream through unchanged, which is
        exactly an early exit. For calls made in this thread only, as `suppress_attention`."""
        layers = self.decoder_layers(model)
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < len(layers):
            raise ValueError(f"exit_layer must be an integer in [1, {len(layers) - 1}] for this "
                             f"{len(layers)}-layer model, got {exit_layer!r}")
        skip = _pass_through(self.layer_tuple_length)
        with overriding({layer: skip for layer in layers[exit_layer:]}):
            yield


def _zero_attention(base, *args, **kwargs):
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    # Attention modules return (output, weights); o_proj maps back to the hidden size.
    return torch.zeros_like(hidden_states), None


def _pass_through(tuple_length: int) -> Callable:
    def forward(base, *args, **kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return (hidden_states,) + (None,) * (tuple_length - 1) if tuple_length else hidden_states

    return forward


def _scaled(scale: float) -> Callable:
    def scaled(base, *args, **kwargs):
        return base(*args, **kwargs) * scale

    return scaled
