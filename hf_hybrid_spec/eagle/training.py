"""Training an `EagleDrafter` against a frozen target: online features, training-time test (TTT), vocab maps.

Used by `recipes/train_eagle3.py`; importable without trl or datasets.

Training-time test (EAGLE-3). A sequence x_0..x_{T-1} gives T - 1 drafter positions: position t pairs the
target's fused features g_t with the embedding of x_{t+1}. Step 0 runs them causally and predicts x_{t+2}.
Step i (1..steps-1) feeds each position the drafter's own step-(i-1) output at the same position together
with the embedding of x_{t+1+i}, and predicts x_{t+2+i}: exactly what a depth-(i+1) draft node sees at
inference. Its queries attend causally to the step-0 keys (the committed context) and to the keys of steps
1..i at the same position (its draft ancestors), with RoPE positions t + i, as `EagleTreeDrafter` lays them
out. Step i's loss is the soft cross-entropy to the target's distribution restricted to the draft vocabulary,
at positions whose target argmax lies in the draft vocabulary, weighted by decay^i (0.8^i).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .modeling import EagleDrafter

__all__ = ["TargetBatch", "TTTOutput", "target_batch", "ttt_loss", "draft_vocabulary"]


@dataclass
class TargetBatch:
    """What the frozen target computed for a batch, under no_grad.

    Attributes:
        input_ids: [B, T] int64.
        aux_states: one [B, T, H] tensor per drafter aux layer (the target's `hidden_states` at those indices).
        logits: [B, T, V] float32 target logits (position t predicts x_{t+1}).
        loss_mask: [B, T] float; 1 where position t's prediction counts (0 on padding).
    """

    input_ids: torch.Tensor
    aux_states: tuple[torch.Tensor, ...]
    logits: torch.Tensor
    loss_mask: torch.Tensor


@dataclass
class TTTOutput:
    """Loss of one batch and per-step diagnostics.

    Attributes:
        loss: scalar, sum over steps of decay^i * step loss.
        step_losses: soft cross-entropy per step (floats).
        step_accuracies: per step, how often the drafter's top-1 equals the target's argmax (floats).
        positions: per step, how many positions counted.
        logits: with `keep_logits`, per step the drafter's logits [B, T - 1, draft_vocab] (position t of step i
            predicts x_{t+2+i}).
    """

    loss: torch.Tensor
    step_losses: list[float] = field(default_factory=list)
    step_accuracies: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None


@torch.no_grad()
def target_batch(target: nn.Module, input_ids: torch.Tensor, aux_layers: list[int],
                 loss_mask: torch.Tensor | None = None) -> TargetBatch:
    """Run the frozen target once over right-padded `input_ids` [B, T] (causal: padding at the end changes
    no earlier position) and keep what training needs."""
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    aux = tuple(out.hidden_states[i] for i in aux_layers)
    if loss_mask is None:
        loss_mask = torch.ones_like(input_ids, dtype=torch.float32)
    return TargetBatch(input_ids=input_ids, aux_states=aux, logits=out.logits.float(), loss_mask=loss_mask.float())


def _shift(x: torch.Tensor, by: int, length: int, fill=0) -> torch.Tensor:
    """x[:, by : by + length] along dim 1, padded with `fill` past the end. x: [B, T, ...]."""
    part = x[:, by : by + length]
    missing = length - part.shape[1]
    if missing <= 0:
        return part
    pad = torch.full((x.shape[0], missing, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([part, pad], dim=1)


def ttt_loss(drafter: EagleDrafter, batch: TargetBatch, steps: int = 7, decay: float = 0.8,
             keep_logits: bool = False) -> TTTOutput:
    """The EAGLE-3 training-time-test loss of `drafter` (bound to the target) on `batch`. See the module doc."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model = drafter
    ids = batch.input_ids
    b, t = ids.shape
    n = t - 1  # drafter positions
    if n < 1:
        raise ValueError("sequences need at least 2 tokens")
    device = model.fc.weight.device
    to_target = model.draft_to_target.to(batch.logits.device)
    in_draft = model.t2d.to(batch.logits.device)
    positions = torch.arange(n, device=device).expand(b, n)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    scale = 1.0 / math.sqrt(model.config.head_dim)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads

    hidden = model.fuse([s[:, :n] for s in batch.aux_states])
    base_keys = base_values = None
    diag_keys: list[torch.Tensor] = []
    diag_values: list[torch.Tensor] = []
    out = TTTOutput(loss=torch.zeros((), device=device), logits=[] if keep_logits else None)
    for i in range(steps):
        if n - i <= 0:
            break
        tokens = _shift(ids, 1 + i, n)  # x_{t+1+i}
        target_logits = _shift(batch.logits, 1 + i, n)  # predicts x_{t+2+i}
        valid = _shift(batch.loss_mask, 1 + i, n) * (torch.arange(n, device=ids.device) < n - i)
        step = model.project(hidden, model.embed(tokens), positions + i)
        if i == 0:
            base_keys, base_values = step.key, step.value
            attn = model.attend(step.query, step.key, step.value, None)
        else:
            diag_keys.append(step.key)
            diag_values.append(step.value)
            q = step.query  # [B, h, n, d]
            k0 = base_keys.repeat_interleave(groups, dim=1)
            v0 = base_values.repeat_interleave(groups, dim=1)
            scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
            diag_v = []
            for kj, vj in zip(diag_keys, diag_values):
                kj = kj.repeat_interleave(groups, dim=1)
                scores.append((q * kj).sum(-1, keepdim=True) * scale)
                diag_v.append(vj.repeat_interleave(groups, dim=1))
            probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
            attn = probs[..., :n] @ v0
            for j, vj in enumerate(diag_v):
                attn = attn + probs[..., n + j : n + j + 1] * vj
        hidden = model.finish(step.residual, attn)
        logits = model.logits(hidden).float()  # [B, n, draft_vocab]
        if keep_logits:
            out.logits.append(logits.detach())

        target_logits = target_logits.to(logits.device)
        argmax = target_logits.argmax(-1)
        mask = valid.to(logits.device) * in_draft.to(logits.device)[argmax].float()
        target_p = torch.softmax(target_logits[..., to_target.to(logits.device)], dim=-1)
        per_position = -(target_p * torch.log_softmax(logits, dim=-1)).sum(-1)
        count = mask.sum()
        step_loss = (per_position * mask).sum() / count.clamp(min=1.0)
        out.loss = out.loss + decay**i * step_loss
        hits = (to_target.to(logits.device)[logits.argmax(-1)] == argmax).float()
        out.step_losses.append(float(step_loss.detach()))
        out.step_accuracies.append(float((hits * mask).sum() / count.clamp(min=1.0)))
        out.positions.append(int(count))
    return out


def draft_vocabulary(token_counts: torch.Tensor, size: int, always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` target ids to draft: those in `always` (e.g. eos), then the most frequent by `token_counts`
    ([V] counts over the training data; ties by id). Returns sorted ids [size]."""
    counts = token_counts.double().clone()
    if size > counts.numel():
        raise ValueError(f"draft vocabulary of {size} tokens exceeds the vocabulary ({counts.numel()})")
    counts[list(always)] = float("inf")
    order = torch.sort(-counts, stable=True).indices[:size]
    return order.sort().values
