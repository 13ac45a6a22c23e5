"""`EagleConfig`: the configuration of an EAGLE-3 drafter, and the default target layers it reads.

The drafter reads the target's hidden states at three depths (`aux_layers`, indices into the target's
`hidden_states` output: 0 is the embedding output, i is the input of decoder layer i). `default_aux_layers`
picks them for hybrid targets; see its docstring for the reasoning.
"""

from __future__ import annotations

from transformers import PretrainedConfig

__all__ = ["EagleConfig", "default_aux_layers", "attention_layer_flags"]


def attention_layer_flags(target_config) -> list[bool]:
    """For each decoder layer of a target, whether it holds (full) softmax attention.

    Reads the layout fields transformers' hybrid configs use: `layer_types` (Qwen3.5, Qwen3-Next, LFM2,
    Granite 4.0 hybrid), `attn_layer_indices` (Bamba), `hybrid_override_pattern` (Nemotron-H, `*` = attention).
    A model without such a field (Falcon-H1: attention and Mamba-2 side by side in every layer; Llama-style
    models) has attention in every layer.
    """
    config = target_config.get_text_config()
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [("attention" in t and "linear" not in t) for t in layer_types[:n]]
    indices = getattr(config, "attn_layer_indices", None)
    if indices is not None:
        return [i in set(indices) for i in range(n)]
    pattern = getattr(config, "hybrid_override_pattern", None)
    if pattern:
        return [c == "*" for c in pattern[:n]]
    return [True] * n


def default_aux_layers(target_config) -> list[int]:
    """The three target depths an EAGLE-3 drafter reads, as `hidden_states` indices (low, middle, high).

    EAGLE-3 reads the inputs of layers 2, N // 2 and N - 3 of an N-layer target: low-level (lexical), middle
    and high-level features. For hybrid targets we keep the low tap and move the middle and high taps onto the
    residual stream right after a full-attention layer (index i where layer i - 1 is attention), when one is
    near:

    - In a sequential hybrid (Qwen3.5: [linear, linear, linear, attention] x k) only the few attention layers
      retrieve exact content from the whole context; the gated-delta layers keep a compressed state. The
      residual right after an attention layer carries what it retrieved (the identifier to repeat, the line
      being copied), which is what makes code continuations predictable two or more tokens ahead. A tap after
      linear layers would see that information only once more layers have mixed it.
    - The low tap stays at 2: token-level features, where the layer type matters little.
    - Never index 0 (the embeddings: the drafter already gets the token embedding) nor N (after the final norm,
      tied to the next-token logits that the drafter's input token already reflects).
    - A parallel hybrid (Falcon-H1) has attention and Mamba-2 summed into the residual in every layer, so every
      layer qualifies and the taps are EAGLE-3's own.

    Results: an 8-layer [lin, lin, lin, attn] x 2 Qwen3.5 -> [2, 4, 5] (4 = output of attention layer 3; the
    only later post-attention index, 8, is the final output, so the high tap stays at 5); a 24-layer Qwen3.5
    -> [2, 12, 20]; an 8-layer Falcon-H1 -> [2, 4, 5]; a 32-layer Llama -> [2, 16, 29]. Small targets get
    distinct indices in [1, N - 1] as close to these as possible (fewer than three when N < 4).
    """
    config = target_config.get_text_config()
    n = config.num_hidden_layers
    if n < 2:
        raise ValueError(f"an EAGLE-3 drafter needs a target with at least 2 layers, got {n}")
    attention = attention_layer_flags(config)
    valid = list(range(1, n))  # hidden_states indices the drafter may read
    post_attention = [i for i in valid if attention[i - 1]]
    chosen: list[int] = []

    def nearest(anchor: int, pool: list[int]) -> int | None:
        free = [i for i in pool if i not in chosen]
        return min(free, key=lambda i: (abs(i - anchor), i)) if free else None

    chosen.append(min(2, n - 1))
    for anchor in (n // 2, n - 3):
        anchor = min(max(anchor, 1), n - 1)
        # Snap onto a post-attention index only when one is within a quarter of the depth.
        pick = nearest(anchor, [i for i in post_attention if abs(i - anchor) <= max(1, n // 4)])
        if pick is None:
            pick = nearest(anchor, valid)
        if pick is not None:
            chosen.append(pick)
    return sorted(set(chosen))


class EagleConfig(PretrainedConfig):
    """Configuration of an `EagleDrafter` (EAGLE-3: fc over target features, one decoder layer, draft head).

    Args:
        hidden_size: the target's hidden size H (the drafter works at the same width).
        vocab_size: the target's vocabulary size V (the token embedding is the target's, shared).
        draft_vocab_size: tokens the draft head predicts (the most frequent ones; maps `d2t`/`t2d`).
        tie_target_head: use the target's output embedding, frozen and not stored, as the draft head over the
            whole vocabulary (draft_vocab_size must equal vocab_size), as EAGLE-1 did. For targets with a small
            vocabulary, where a reduced draft vocabulary saves nothing and leaves tokens undraftable (the fixtures'
            8,192-token vocabulary: a 2,048-token draft vocabulary holds 74% of qwen3_5-small's HumanEval tokens).
        aux_layers: `hidden_states` indices of the target fed to `fc: len(aux_layers) * H -> H`.
        num_attention_heads, num_key_value_heads, head_dim: the decoder layer's attention.
        intermediate_size: width of the decoder layer's SwiGLU MLP.
        rms_norm_eps, rope_theta, max_position_embeddings: as in Llama.
        target_model_type, target_name_or_path, target_num_hidden_layers: what the drafter was trained for;
            `target_num_hidden_layers` bounds `aux_layers`.
        target_attention_layers: per target layer, whether it holds full attention (for the model card).
        norm_before_residual: the layer's residual is the hidden input after `hidden_norm` (speculators' option)
            instead of before it (EAGLE-3's and SpecForge's layer).
        aux_layers_from_target: `aux_layers` are EAGLE-3's default for the target, [2, N // 2, N - 3], set when
            the drafter is bound (imported checkpoints that name no layers).
        training: a free-form record of how it was trained (data, tokens, steps, measured acceptance), written
            into the model card.
    """

    model_type = "hf_hybrid_spec_eagle3"

    def __init__(
        self,
        hidden_size: int = 512,
        vocab_size: int = 8192,
        draft_vocab_size: int = 2048,
        tie_target_head: bool = False,
        aux_layers: list[int] | None = None,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        intermediate_size: int = 1024,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 8192,
        target_model_type: str | None = None,
        target_name_or_path: str | None = None,
        target_num_hidden_layers: int | None = None,
        target_attention_layers: list[bool] | None = None,
        training: dict | None = None,
        norm_before_residual: bool = False,
        aux_layers_from_target: bool = False,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.tie_target_head = tie_target_head
        self.aux_layers = list(aux_layers) if aux_layers is not None else [2, 4, 5]
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.target_model_type = target_model_type
        self.target_name_or_path = target_name_or_path
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_attention_layers = None if target_attention_layers is None else list(target_attention_layers)
        self.training = dict(training or {})
        self.norm_before_residual = bool(norm_before_residual)
        self.aux_layers_from_target = bool(aux_layers_from_target)
        super().__init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EagleConfig.{name} must be a positive integer, got {value!r}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) cannot exceed vocab_size ({self.vocab_size})")
        if not isinstance(self.tie_target_head, bool):
            raise ValueError(f"EagleConfig.tie_target_head must be a bool, got {self.tie_target_head!r}")
        if self.tie_target_head and self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"tie_target_head predicts the whole vocabulary: draft_vocab_size must equal vocab_size "
                             f"({self.vocab_size}), got {self.draft_vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embeddings), got {self.head_dim}")
        if not self.aux_layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.aux_layers):
            raise ValueError(f"aux_layers must be a non-empty list of hidden_states indices >= 0, got {self.aux_layers!r}")
        if len(set(self.aux_layers)) != len(self.aux_layers):
            raise ValueError(f"aux_layers must be distinct, got {self.aux_layers!r}")
        top = self.target_num_hidden_layers
        if top is not None and max(self.aux_layers) > top:
            raise ValueError(f"aux_layers {self.aux_layers} reach past the target's {top} layers "
                             f"(hidden_states has indices 0..{top})")
