"""The CoSpec arbiter as a transformers model: `CoSpecArbiterConfig` + `CoSpecArbiter`.

A small MLP over the mismatch features of `features.py` (optionally plus a projection of the target's last
hidden state at the node) that outputs the log-odds of keeping the draft's token. It is a `PreTrainedModel`,
so `save_pretrained` / `from_pretrained` / `push_to_hub` work as for any Hub model; `save_pretrained` also writes
a model card (README.md) that records how the arbiter was trained.

    arbiter = CoSpecArbiter.from_pretrained("checkpoints/arbiters/qwen3_5-small_drafted-by_falcon_h1-small")
    cfg = AssistantConfig(drafter="model", verification="cospec", arbiter=arbiter)   # or the directory path
"""

from __future__ import annotations

import json
import math
from dataclasses import field

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers import initialization as init

from ..hub import LocalFirstMixin, ModelCardMixin
from .arbiters import Arbiter, Mismatch
from .features import FEATURE_NAMES, mismatch_features

__all__ = ["CoSpecArbiterConfig", "CoSpecArbiter"]


class CoSpecArbiterConfig(PretrainedConfig):
    """Configuration of a `CoSpecArbiter`.

    Args:
        features: names of the scalar inputs, in order (a subset of `features.FEATURE_NAMES`).
        width: width of the MLP's hidden layers.
        num_layers: hidden layers of the MLP (>= 1).
        target_hidden_size: size of the target's hidden state when the arbiter reads it; 0 (default) means it
            does not, and verification then runs without `output_hidden_states`.
        hidden_projection: the hidden state is projected to this many inputs first.
        threshold: at inference the draft's token is kept when the accept probability exceeds this.
        init_accept_prob: accept probability of a freshly initialised arbiter (its head bias); a small value
            starts training near lossless verification.
        training_summary: free-form facts about training (target, draft, data, reward, steps, validation
            numbers), written into the model card.
    """

    model_type = "cospec_arbiter"

    features: list = field(default_factory=lambda: list(FEATURE_NAMES))
    width: int = 32
    num_layers: int = 2
    target_hidden_size: int = 0
    hidden_projection: int = 16
    threshold: float = 0.5
    init_accept_prob: float = 0.2
    training_summary: dict | None = None

    def __post_init__(self, **kwargs):
        unknown = [f for f in self.features if f not in FEATURE_NAMES]
        if unknown or not self.features:
            raise ValueError(f"features must be a non-empty subset of {FEATURE_NAMES}, got unknown {unknown}")
        for name in ("width", "num_layers", "hidden_projection"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.target_hidden_size, int) or self.target_hidden_size < 0:
            raise ValueError(f"target_hidden_size must be an integer >= 0, got {self.target_hidden_size!r}")
        if not 0.0 < self.threshold < 1.0 or not 0.0 < self.init_accept_prob < 1.0:
            raise ValueError("threshold and init_accept_prob must be in (0, 1)")
        super().__post_init__(**kwargs)


class CoSpecArbiter(LocalFirstMixin, ModelCardMixin, PreTrainedModel, Arbiter):
    """Policy over mismatches: `forward(features [B, F], target_hidden [B, H] | None) -> accept log-odds [B]`.

    As an `Arbiter`, `decide(mismatch)` keeps the draft's token when sigmoid(log-odds) > `config.threshold`.
    """

    config_class = CoSpecArbiterConfig
    base_model_prefix = "arbiter"
    main_input_name = "features"
    needs_draft_probs = True

    def __init__(self, config: CoSpecArbiterConfig):
        super().__init__(config)
        inputs = len(config.features)
        self.hidden_proj = None
        if config.target_hidden_size > 0:
            self.hidden_proj = nn.Linear(config.target_hidden_size, config.hidden_projection)
            inputs += config.hidden_projection
        layers: list[nn.Module] = []
        for _ in range(config.num_layers):
            layers += [nn.Linear(inputs, config.width), nn.GELU()]
            inputs = config.width
        self.mlp = nn.Sequential(*layers)
        self.head = nn.Linear(inputs, 1)
        self._feature_names = tuple(config.features)
        self.post_init()

    @property
    def uses_target_hidden(self) -> bool:
        return self.config.target_hidden_size > 0

    def _init_weights(self, module: nn.Module) -> None:
        if module is self.head:
            # Start near "always keep the target's token": small weights, bias at the initial accept log-odds.
            init.normal_(module.weight, mean=0.0, std=0.01)
            p = self.config.init_accept_prob
            init.constant_(module.bias, math.log(p / (1.0 - p)))
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=1.0 / math.sqrt(module.in_features))
            init.zeros_(module.bias)

    def forward(self, features: torch.Tensor, target_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """features: [B, F]; target_hidden: [B, H] (required iff config.target_hidden_size > 0) -> [B] log-odds."""
        x = features.to(self.head.weight.dtype)
        if self.hidden_proj is not None:
            if target_hidden is None:
                raise ValueError("this arbiter reads the target's hidden state; pass target_hidden [B, H]")
            x = torch.cat([x, self.hidden_proj(target_hidden.to(x.dtype))], dim=-1)
        return self.head(self.mlp(x)).squeeze(-1)

    def inputs(self, mismatch: Mismatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model inputs for one mismatch: features [F] and the hidden state [H] (or None)."""
        feats = mismatch_features(mismatch, self._feature_names).to(self.head.weight.device)
        hidden = None
        if self.hidden_proj is not None:
            if mismatch.target_hidden is None:
                raise ValueError("this arbiter reads the target's hidden state but the mismatch carries none")
            hidden = mismatch.target_hidden.to(self.head.weight.device)
        return feats, hidden

    @torch.no_grad()
    def accept_logit(self, mismatch: Mismatch) -> float:
        """Log-odds of keeping the draft's token at `mismatch`."""
        feats, hidden = self.inputs(mismatch)
        return float(self(feats[None], None if hidden is None else hidden[None])[0])

    def decide(self, mismatch: Mismatch) -> bool:
        p = self.config.threshold
        return self.accept_logit(mismatch) > math.log(p / (1.0 - p))

    # ------------------------------------------------------------------ Hub
    def model_card(self) -> str:
        """The Hub model card: metadata header, what the arbiter is, how to use it, how it was trained."""
        from huggingface_hub import ModelCardData

        cfg = self.config
        summary = cfg.training_summary or {}
        meta = ModelCardData(
            library_name="hf_hybrid_spec", license="apache-2.0",
            tags=["speculative-decoding", "cospec", "arbiter", "hybrid-models"],
        ).to_yaml()
        params = sum(p.numel() for p in self.parameters())
        hidden = (f"plus the target's last hidden state ({cfg.target_hidden_size} -> {cfg.hidden_projection})"
                  if cfg.target_hidden_size else "no hidden states")
        rows = "\n".join(f"| {k} | {json.dumps(v) if not isinstance(v, str) else v} |" for k, v in summary.items())
        training = ("| | |\n| --- | --- |\n" + rows) if rows else "No training summary was recorded."
        return f"""---
{meta}
---

# CoSpec arbiter

A {params}-parameter policy for **lossy, opt-in** speculative decoding with
`hf_hybrid_spec` (CoSpec, arXiv 2605.24793): at each position where the draft model's choice
differs from the target's, it decides whether to keep the draft's token. Keeping it is an *override*: the output
is no longer the target's greedy output (it can be better or worse), and fewer target forwards are needed.

- Inputs: {", ".join(f"`{f}`" for f in cfg.features)}; {hidden}.
- MLP: {cfg.num_layers} x {cfg.width}, GELU; output: log-odds of keeping the draft token; kept when the
  probability exceeds {cfg.threshold}.

## Use

```python
from hf_hybrid_spec import AssistantConfig, speculative_generate

cfg = AssistantConfig(drafter="model", verification="cospec", arbiter="<this repo or directory>")
out = target.generate(**inputs, do_sample=False, custom_generate=speculative_generate, draft_model=draft,
                      assistant_config=cfg, return_dict_in_generate=True)
out.spec_stats.arbiter_overrides   # mismatches where the draft's token was kept
```

Greedy decoding only (`do_sample=True` is refused). An arbiter is trained for one target/draft pair and one
kind of task; on others its decisions are uncalibrated.

## Training

{training}
"""


AutoConfig.register(CoSpecArbiterConfig.model_type, CoSpecArbiterConfig, exist_ok=True)
AutoModel.register(CoSpecArbiterConfig, CoSpecArbiter, exist_ok=True)
