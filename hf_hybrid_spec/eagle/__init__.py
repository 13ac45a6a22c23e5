"""EAGLE-3 drafters for hybrid targets.

    from hf_hybrid_spec.eagle import EagleDrafter
    drafter = EagleDrafter.from_pretrained("checkpoints/drafters/qwen3_5-small-eagle3")
    out = target.generate(**inputs, custom_generate=speculative_generate, draft_model=drafter,
                          assistant_config=AssistantConfig(drafter="eagle"))   # 60 nodes, depth 6, top-k 10

- `EagleConfig`, `default_aux_layers`: the configuration, and which target layers feed the drafter.
- `EagleDrafter`: the model (a `PreTrainedModel`: from_pretrained / save_pretrained / push_to_hub).
- `EagleTreeDrafter`: the `Drafter` that drafts EAGLE-2 dynamic trees with it in `speculative_generate`.
- `training`: the training-time-test loss and vocabulary maps used by `recipes/train_eagle3.py`.
"""

from transformers import AutoConfig, AutoModel

from .configuration import EagleConfig, attention_layer_flags, default_aux_layers
from .drafter import EagleTreeDrafter
from .modeling import EagleDrafter

# `AutoModel.from_pretrained(path)` finds the drafter once this package is imported.
AutoConfig.register(EagleConfig.model_type, EagleConfig, exist_ok=True)
AutoModel.register(EagleConfig, EagleDrafter, exist_ok=True)

__all__ = ["EagleConfig", "EagleDrafter", "EagleTreeDrafter", "default_aux_layers", "attention_layer_flags"]
