"""Model adapters: route a hybrid layer's forward to tree verification, without forking model files.

An adapter names the recurrent mixer classes of one model family and gives the tree forward of each. `install`
wraps those modules' `forward` (instance attribute, like accelerate's hooks): the wrapper calls the family's
tree forward only when the cache passed in is a `HybridTreeCache` in tree mode, and the stock forward
otherwise, so prefill, plain `generate` and training see unchanged behaviour. Attention layers need no
routing: the tree is expressed through their 4D mask and position ids.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cache import HybridTreeCache
from ..config import SSM_VARIANTS

# SSM_VARIANTS: how `ModelAdapter.suppress_attention` removes the attention pathway (self-speculation, issue #5):
#   "zero_attention": every attention module outputs zeros; the rest of its layer runs (parallel hybrids: the
#       SSM branch alone feeds the residual; sequential hybrids: attention layers keep only their MLP).
#   "rescale_ssm": parallel hybrids only; attention zeroed and the SSM branch multiplied by `ssm_scale`, so
#       the mixer's contribution to the residual keeps about its usual size.
#   "skip_layer": sequential hybrids only; each decoder layer that holds attention is the identity (its MLP is
#       skipped too: the residual stream passes through unchanged).

__all__ = ["ModelAdapter", "TreeForward", "find_mixer_cache", "ROUTED_FLAG", "SSM_VARIANTS"]

# (module, hidden_states [B, N, D], cache in tree mode) -> output [B, N, D]
TreeForward = Callable[[nn.Module, torch.Tensor, HybridTreeCache], torch.Tensor]

ROUTED_FLAG = "__hf_hybrid_spec_routed__"


def find_mixer_cache(args: tuple, kwargs: dict):
    """The cache argument of a mixer call, whatever transformers version named it."""
    for name in ("cache", "cache_params", "past_key_values"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    for a in args:
        if isinstance(a, HybridTreeCache):
            return a
    return None


def _tree_forward_under_accelerate_hooks(module: nn.Module, tree_forward: TreeForward, cache, args, kwargs):
    """The tree forward of a mixer that accelerate dispatched (device_map placement or offload).

    Its hook wraps the stock forward, which the tree path bypasses, so the hook's steps run here: inputs go to
    the execution device and offloaded weights (meta at rest) come in. Tree forwards also read some submodules'
    weights directly (conv1d.weight, ...) without calling them, so every offloaded submodule is brought in too.
    """
    hook = module._hf_hook
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    offloaded = []
    if getattr(hook, "offload", True):  # placement-only hooks (a split over GPUs) offload nothing: skip the scan
        offloaded = [m for m in module.modules() if m is not module and getattr(m, "_hf_hook", None) is not None
                     and any(p.is_meta for p in m.parameters(recurse=False))]
    for m in offloaded:
        m._hf_hook.pre_forward(m)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    out = tree_forward(module, hidden_states, cache)
    for m in offloaded:
        m._hf_hook.post_forward(m, None)
    return hook.post_forward(module, out)


class _RoutedForward:
    """A mixer's forward once installed: the tree forward while its cache is in tree mode, the original otherwise.

    An object, not a closure: `copy.deepcopy(model)` (TRL's reference models, EMA copies) copies it with the module,
    its attributes rebound to the copy (the module through deepcopy's memo, the original bound method to the copied
    module). A closure would be shared as it is, and the copy would run the original model's weights.
    """

    def __init__(self, module: nn.Module, original: Callable, tree_forward: TreeForward):
        self.module, self.original, self.tree_forward = module, original, tree_forward
        functools.update_wrapper(self, original)
        setattr(self, ROUTED_FLAG, True)

    def __call__(self, *args, **kwargs):
        cache = find_mixer_cache(args, kwargs)
        if isinstance(cache, HybridTreeCache) and cache.in_tree_mode:
            module = self.module
            if getattr(module, "_hf_hook", None) is not None:
                return _tree_forward_under_accelerate_hooks(module, self.tree_forward, cache, args, kwargs)
            hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            return self.tree_forward(module, hidden_states, cache)
        return self.original(*args, **kwargs)


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
        """Route every recurrent mixer of `model` (idempotent)."""
        for module in self.mixer_modules(model):
            if getattr(module.forward, ROUTED_FLAG, False):
                continue
            module.forward = self._routed(module, module.forward, self.mixers[type(module).__name__])

    @staticmethod
    def _routed(module: nn.Module, original: Callable, tree_forward: TreeForward) -> Callable:
        return _RoutedForward(module, original, tree_forward)

    # ------------------------------------------------------------------ self-speculation (issue #5)
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
        SSM_VARIANTS). Forwards are swapped on module instances and always restored on exit; configs and
        weights are never touched. Raises ValueError where the variant does not apply to this family. Not
        thread-safe: while the block runs, every forward of `model` is the restricted one."""
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
        with contextlib.ExitStack() as stack:
            if variant == "skip_layer":
                ids = {id(m) for m in attention}
                for layer in self.decoder_layers(model):
                    if any(id(m) in ids for m in layer.modules()):
                        stack.enter_context(_swapped_forward(layer, _pass_through(self.layer_tuple_length)))
            else:
                for module in attention:
                    stack.enter_context(_swapped_forward(module, _zero_attention))
            if variant == "rescale_ssm":
                for module in self.mixer_modules(model):
                    stack.enter_context(_swapped_forward(module, _scaled(module.forward, ssm_scale)))
            yield

    @contextlib.contextmanager
    def early_exit(self, model: nn.Module, exit_layer: int) -> Iterator[None]:
        """Within the block, `model` runs its first `exit_layer` decoder layers only, then its own final norm
        and head (multipliers included). The full layer list is put back on exit, whatever happens (not
        thread-safe, as `suppress_attention`)."""
        decoder = model.get_decoder()
        layers = self.decoder_layers(model)
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < len(layers):
            raise ValueError(f"exit_layer must be an integer in [1, {len(layers) - 1}] for this "
                             f"{len(layers)}-layer model, got {exit_layer!r}")
        decoder.layers = layers[:exit_layer]
        try:
            yield
        finally:
            decoder.layers = layers


@contextlib.contextmanager
def _swapped_forward(module: nn.Module, forward: Callable) -> Iterator[None]:
    # Instance-level forward (as `install` and accelerate's hooks do); an earlier instance forward (a routed
    # mixer) is put back, otherwise the class forward shows through again.
    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had_own:
            module.forward = previous
        else:
            del module.forward


def _zero_attention(*args, **kwargs):
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    # Attention modules return (output, weights); o_proj maps back to the hidden size.
    return torch.zeros_like(hidden_states), None


def _pass_through(tuple_length: int) -> Callable:
    def forward(*args, **kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return (hidden_states,) + (None,) * (tuple_length - 1) if tuple_length else hidden_states

    return forward


def _scaled(forward: Callable, scale: float) -> Callable:
    def scaled(*args, **kwargs):
        return forward(*args, **kwargs) * scale

    return scaled
