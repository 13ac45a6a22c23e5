"""The HVD payoff predictor as a transformers model: `PayoffPredictorConfig` + `PayoffPredictor`.

Two small MLPs over the step features of `features.py` (standardized with the training set's mean and std,
stored in the config):

- the cache head reads only `CACHE_FEATURES` (what is known before the model drafter runs) and predicts the
  cache draft's payoff: the draft tokens verification will accept;
- the joint heads read every feature, model confidence included, and predict the model draft's payoff and the
  payoff of one tree merging both drafts.

Outputs are non-negative (softplus). A `PreTrainedModel`, so `save_pretrained` / `from_pretrained` /
`push_to_hub` work as for any Hub model; `save_pretrained` also writes a model card (README.md).

    predictor = PayoffPredictor.from_pretrained("checkpoints/payoff/qwen3_5-small")
    cfg = AssistantConfig(drafter="hvd", hvd_predictor="checkpoints/payoff/qwen3_5-small", ...)
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from ..hub import LocalFirstMixin, ModelCardMixin
from .features import CACHE_FEATURES, FEATURE_NAMES

__all__ = ["PayoffPredictorConfig", "PayoffPredictor", "PayoffOutput", "HEADS", "load_predictor"]

# Output columns, and the label columns of the training data, in order.
HEADS = ("cache", "model", "merged")


class PayoffPredictorConfig(PretrainedConfig):
    """Configuration of a `PayoffPredictor`.

    Args:
        cache_features: inputs of the cache head (a subset of `CACHE_FEATURES`: known before the model drafter).
        joint_features: inputs of the model / merged heads (a subset of `FEATURE_NAMES`).
        width: hidden width of both MLPs; num_layers: their hidden layers (>= 1).
        feature_mean / feature_std: per `FEATURE_NAMES` entry, the standardization applied to the inputs (the
            training set's statistics; None: 0 and 1).
        huber_delta: the training loss is the Huber loss with this delta, summed over the heads.
        drafters: what the predictor was trained for (target, model drafter, cache drafter settings).
        training: a free-form record of the training run (data, steps, held-out metrics), for the model card.
    """

    model_type = "hf_hybrid_spec_hvd_payoff"

    def __init__(
        self,
        cache_features: list[str] | None = None,
        joint_features: list[str] | None = None,
        width: int = 32,
        num_layers: int = 2,
        feature_mean: list[float] | None = None,
        feature_std: list[float] | None = None,
        huber_delta: float = 0.5,
        drafters: dict | None = None,
        training: dict | None = None,
        **kwargs,
    ):
        self.cache_features = list(cache_features) if cache_features is not None else list(CACHE_FEATURES)
        self.joint_features = list(joint_features) if joint_features is not None else list(FEATURE_NAMES)
        self.width = width
        self.num_layers = num_layers
        self.feature_mean = [0.0] * len(FEATURE_NAMES) if feature_mean is None else [float(x) for x in feature_mean]
        self.feature_std = [1.0] * len(FEATURE_NAMES) if feature_std is None else [float(x) for x in feature_std]
        self.huber_delta = huber_delta
        self.drafters = dict(drafters or {})
        self.training = dict(training or {})
        super().__init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        unknown = [f for f in self.cache_features if f not in CACHE_FEATURES]
        if unknown or not self.cache_features:
            raise ValueError(f"cache_features must be a non-empty subset of CACHE_FEATURES (known before the model "
                             f"drafter runs); unknown or too late: {unknown}")
        unknown = [f for f in self.joint_features if f not in FEATURE_NAMES]
        if unknown or not self.joint_features:
            raise ValueError(f"joint_features must be a non-empty subset of FEATURE_NAMES, unknown: {unknown}")
        for name in ("width", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if len(self.feature_mean) != len(FEATURE_NAMES) or len(self.feature_std) != len(FEATURE_NAMES):
            raise ValueError(f"feature_mean and feature_std need one entry per feature ({len(FEATURE_NAMES)})")
        if any(not s > 0 for s in self.feature_std):
            raise ValueError("feature_std entries must be > 0")
        if not self.huber_delta > 0:
            raise ValueError(f"huber_delta must be > 0, got {self.huber_delta!r}")


@dataclass
class PayoffOutput(ModelOutput):
    """loss: scalar (when labels were given); payoffs: [B, 3] predicted payoffs, columns `HEADS`."""

    loss: torch.Tensor | None = None
    payoffs: torch.Tensor | None = None


class _FoldedHead:
    """One head of a `PayoffPredictor` for a single feature vector, on the host in float64 numpy. HVD asks for a
    prediction on the steps it cannot decide from the cost model alone; through `torch.nn` the per-op dispatch of
    ~1.7k multiply-adds would be a visible share of a GPU step. Folded into the weights: the feature
    normalization and the head's feature subset (the first layer reads the full `FEATURE_NAMES` vector, zero
    columns for the features it does not use), and GELU's factor 1/2 (into the next layer)."""

    def __init__(self, head: nn.Sequential, index: list[int], mean: list[float], std: list[float]):
        linears = [m for m in head if isinstance(m, nn.Linear)]
        # (the module's parameter dict, weight, bias, their versions): `current` runs every call, so it reads the
        # dicts directly (module attribute access costs a microsecond each)
        self.linears = [(lin._parameters, lin.weight, lin.bias, lin.weight._version, lin.bias._version)
                        for lin in linears]
        index = np.asarray(index, dtype=np.int64)
        mean = np.asarray(mean, dtype=np.float64)
        std = np.asarray(std, dtype=np.float64)
        self.layers = []
        for i, lin in enumerate(linears):
            weight = lin.weight.detach().to("cpu", torch.float64).numpy()
            bias = lin.bias.detach().to("cpu", torch.float64).numpy()
            if i == 0:  # W ((x[index] - mean) / std) + b = W' x + (b - W (mean / std)[index])
                full = np.zeros((weight.shape[0], len(mean)))
                full[:, index] = weight / std[index]
                weight, bias = full, bias - weight @ (mean / std)[index]
            else:  # its input is 2 x GELU(v) = v (1 + erf(v / sqrt 2))
                weight = 0.5 * weight
            self.layers.append((np.ascontiguousarray(weight), bias))

    def current(self) -> bool:
        """Whether the head still has the parameters this was folded from, not updated in place since."""
        for params, w, b, vw, vb in self.linears:
            if params["weight"] is not w or params["bias"] is not b or w._version != vw or b._version != vb:
                return False
        return True

    def __call__(self, features) -> list[float]:
        """features: [len(FEATURE_NAMES)] (a list or a tensor) -> the head's payoffs."""
        if isinstance(features, torch.Tensor):
            features = features.detach().to("cpu", torch.float64).numpy()
        x = np.asarray(features, dtype=np.float64)
        erf = math.erf
        last = len(self.layers) - 1
        for i, (weight, bias) in enumerate(self.layers):
            x = weight @ x + bias
            if i < last:  # exact GELU (as nn.GELU()), its 1/2 folded into the next layer
                x = np.array([v + v * erf(v * _SQRT_HALF) for v in x.tolist()])
        # softplus as F.softplus (linear above 20)
        return [v if v > 20.0 else math.log1p(math.exp(v)) for v in x.tolist()]


_SQRT_HALF = math.sqrt(0.5)


def _mlp(inputs: int, width: int, layers: int, outputs: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(inputs, width), nn.GELU()]
        inputs = width
    mods.append(nn.Linear(inputs, outputs))
    return nn.Sequential(*mods)


class PayoffPredictor(LocalFirstMixin, ModelCardMixin, PreTrainedModel):
    """`forward(features [B, len(FEATURE_NAMES)], labels [B, 3] | None) -> PayoffOutput`. See the module docstring."""

    config_class = PayoffPredictorConfig
    base_model_prefix = "payoff"
    main_input_name = "features"

    def __init__(self, config: PayoffPredictorConfig):
        super().__init__(config)
        index = {name: i for i, name in enumerate(FEATURE_NAMES)}
        # Plain lists, not buffers: they are the config's, and `from_pretrained` builds modules on the meta device.
        self._cache_index = [index[f] for f in config.cache_features]
        self._joint_index = [index[f] for f in config.joint_features]
        self._fast: list[_FoldedHead | None] = [None, None]  # `_folded`: the heads for single vectors
        self.cache_head = _mlp(len(config.cache_features), config.width, config.num_layers, 1)
        self.joint_head = _mlp(len(config.joint_features), config.width, config.num_layers, 2)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=module.in_features ** -0.5)
            nn.init.zeros_(module.bias)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> PayoffOutput:
        """features: [B, F] in `FEATURE_NAMES` order; labels: [B, 3] realized payoffs (`HEADS`), NaN = unknown."""
        if features.ndim != 2 or features.shape[1] != len(FEATURE_NAMES):
            raise ValueError(f"features must be [B, {len(FEATURE_NAMES)}] (FEATURE_NAMES order), got "
                             f"{tuple(features.shape)}")
        mean = torch.tensor(self.config.feature_mean, device=features.device)
        std = torch.tensor(self.config.feature_std, device=features.device)
        x = ((features.float() - mean) / std).to(self.cache_head[0].weight.dtype)
        cache = self.cache_head(x[:, self._cache_index])
        joint = self.joint_head(x[:, self._joint_index])
        payoffs = F.softplus(torch.cat([cache, joint], dim=-1))
        loss = None
        if labels is not None:
            labels = labels.to(payoffs)
            known = ~torch.isnan(labels)
            err = F.huber_loss(payoffs[known], labels[known], delta=self.config.huber_delta, reduction="sum")
            loss = err / max(1, features.shape[0])
        return PayoffOutput(loss=loss, payoffs=payoffs)

    def predict_cache(self, features) -> float:
        """The cache head alone for one feature vector ([F] tensor or list, `FEATURE_NAMES` order): what HVD reads
        before the model drafter runs, every step. `predict(features)[0]` up to rounding, in a few microseconds (see
        `_FoldedHead`)."""
        return self._folded(0)(features)[0]

    def predict_one(self, features) -> tuple[float, float, float]:
        """`predict` for one feature vector ([F] tensor or list) as three floats (`HEADS` order), on the host."""
        return (self._folded(0)(features)[0], *self._folded(1)(features))

    def _folded(self, which: int) -> _FoldedHead:
        """The cache head (0) or the joint heads (1) folded for single-vector calls; rebuilt whenever the head's
        parameters changed (their versions count in-place updates: optimizer steps, `load_state_dict`)."""
        folded = self._fast[which]
        if folded is None or not folded.current():
            head, index = (self.cache_head, self._cache_index) if which == 0 else (self.joint_head, self._joint_index)
            folded = self._fast[which] = _FoldedHead(head, index, self.config.feature_mean, self.config.feature_std)
        return folded

    @torch.no_grad()
    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """[F] or [B, F] features -> [3] or [B, 3] predicted payoffs (`HEADS`)."""
        single = features.ndim == 1
        out = self(features.view(1, -1) if single else features).payoffs
        return out[0] if single else out

    # ------------------------------------------------------------------ Hub
    def model_card(self) -> str:
        """The Hub model card: metadata header, what the predictor is, how it was trained, how to use it."""
        cfg = self.config
        params = sum(p.numel() for p in self.parameters())
        drafters = cfg.drafters or {}
        target = drafters.get("target", "unknown")
        base = f"base_model: {target}\n" if drafters.get("target") else ""

        def table(record: dict) -> str:
            if not record:
                return "Not recorded."
            rows = "\n".join(f"| {k} | {v if isinstance(v, str) else json.dumps(v)} |" for k, v in record.items())
            return "| | |\n| --- | --- |\n" + rows

        return f"""---
library_name: hf_hybrid_spec
license: apache-2.0
tags:
- speculative-decoding
- hybrid-verified-decoding
- hf_hybrid_spec
{base}---

# HVD payoff predictor for `{target}`

A {params}-parameter predictor for **Hybrid Verified Decoding** in `hf_hybrid_spec`: before each verification it
predicts how many draft tokens the target will accept (the *payoff*) from the cache (suffix) draft, from the
model drafter's draft and from one tree merging both. With a profiled cost per step, the decoder verifies the
option with the most tokens per second, and skips the model drafter when the cache draft wins anyway. Output is
exact either way: greedy output is identical to plain greedy decoding.

- cache head: MLP {cfg.num_layers} x {cfg.width} over {len(cfg.cache_features)} features known before the model
  drafter runs: {", ".join(f"`{f}`" for f in cfg.cache_features)}
- model / merged heads: MLP {cfg.num_layers} x {cfg.width} over {len(cfg.joint_features)} features (the above
  plus the model drafter's confidence)
- trained with the Huber loss (delta {cfg.huber_delta}) on realized payoffs

## Trained for

{table(drafters)}

## Training

{table(cfg.training)}

## Use

```python
from hf_hybrid_spec import AssistantConfig, speculative_generate
from hf_hybrid_spec.eagle import EagleDrafter

cfg = AssistantConfig(drafter="hvd", hvd_policy="learned", hvd_predictor="<this repository or directory>")
out = target.generate(**inputs, do_sample=False, custom_generate=speculative_generate,
                      draft_model=EagleDrafter.from_pretrained("<the EAGLE-3 drafter it was trained with>"),
                      assistant_config=cfg)
```

A predictor is trained for one target, one model drafter and the cache drafter's settings; with others its
predictions are uncalibrated (decoding stays exact, only slower).
"""


@functools.lru_cache(maxsize=8)
def load_predictor(path_or_repo_id: str) -> PayoffPredictor:
    """`PayoffPredictor.from_pretrained` once per process for a directory or Hub id (CPU, eval mode)."""
    return PayoffPredictor.from_pretrained(path_or_repo_id).eval()


# `AutoModel.from_pretrained(path)` finds the predictor once this package is imported.
AutoConfig.register(PayoffPredictorConfig.model_type, PayoffPredictorConfig, exist_ok=True)
AutoModel.register(PayoffPredictorConfig, PayoffPredictor, exist_ok=True)
