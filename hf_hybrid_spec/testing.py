"""Tiny random-weight models of every supported family, built from configs (no download).

Used by the test suite and by the examples when the trained fixtures are absent. Random weights give
meaningless acceptance rates, but they exercise every code path, and exactness must hold for them too.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

__all__ = ["TINY_FAMILIES", "tiny_config", "tiny_model", "tiny_vlm", "fixture_path", "FIXTURES", "acceptance_drafter",
           "acceptance_batch_drafter", "decisive_head"]

FIXTURES = ("qwen3_5-small", "falcon_h1-small")

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               bos_token_id=0, eos_token_id=0, pad_token_id=1)

TINY_FAMILIES: dict[str, dict] = {
    "qwen3_5_text": dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    "qwen3_5_moe_text": dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    "qwen3_next": dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    "falcon_h1": dict(
        num_hidden_layers=3, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16,
    ),
    "bamba": dict(
        num_hidden_layers=3, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=16, attn_layer_indices=[1],
    ),
    "nemotron_h": dict(
        num_hidden_layers=4, head_dim=16, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=8, n_groups=1,
        conv_kernel=4, chunk_size=16, hybrid_override_pattern="M*M-",
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=3, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4,
        mamba_chunk_size=16, num_local_experts=0, shared_intermediate_size=128,
        layer_types=["mamba", "attention", "mamba"],
    ),
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
    "jamba": dict(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
    ),
    "llama": dict(num_hidden_layers=2),
}


def tiny_config(family: str, vocab_size: int = 96, **overrides):
    """A small config of `family` (a key of TINY_FAMILIES: a transformers model_type)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"no tiny config for {family!r}; known: {sorted(TINY_FAMILIES)}")
    kwargs = {**_COMMON, **TINY_FAMILIES[family], "vocab_size": vocab_size, **overrides}
    return AutoConfig.for_model(family, **kwargs)


def tiny_model(family: str, seed: int = 0, vocab_size: int = 96, dtype=torch.float32, **overrides):
    """A random-weight causal LM of `family` in eval mode, with sdpa attention."""
    config = tiny_config(family, vocab_size=vocab_size, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    # Random init leaves some decays near 1 and the outputs nearly constant; widen the logits so greedy
    # decoding does not sit on near-ties (identity tests would then measure rounding, not correctness).
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(4.0)
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 1
    model.generation_config.bos_token_id = 0
    return model


# Token ids the tiny vision-language models reserve (within the 96-token vocabulary).
VLM_TOKENS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)


def tiny_vlm(family: str = "qwen3_5", seed: int | None = None, vocab_size: int = 96):
    """A random-weight Qwen3.5 vision-language model (`family`: "qwen3_5" or "qwen3_5_moe") and the inputs of a prompt
    with one image: `(model, inputs)`, `inputs` being what a processor returns (input_ids, pixel_values,
    image_grid_thw, mm_token_type_ids) for text, a 16x16-pixel image (4x4 patches of 4x4 pixels, merged 2x2 into four
    image tokens), then more text. The default seeds (5, and 1 for the MoE) give greedy outputs that vary over the
    tokens and change with the image."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    text_family = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}[family]
    text = tiny_config(text_family, vocab_size=vocab_size).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)
    config_cls, model_cls = {"qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
                             "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)}[family]
    config = config_cls(text_config=text, vision_config=vision, **VLM_TOKENS)
    torch.manual_seed(({"qwen3_5": 5, "qwen3_5_moe": 1}[family]) if seed is None else seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # as tiny_model: no near-ties in greedy decoding
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 1
    patches = 4  # per side: 4x4 patches of 4x4 pixels, merged 2x2 into 4 tokens
    ids = torch.tensor([[5, 6, VLM_TOKENS["vision_start_token_id"]] + [VLM_TOKENS["image_token_id"]] * 4
                        + [VLM_TOKENS["vision_end_token_id"], 7, 8, 9, 10, 7, 8, 9]])
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  pixel_values=torch.randn(patches * patches, 3 * 2 * 4 * 4,
                                           generator=torch.Generator().manual_seed(100)),
                  image_grid_thw=torch.tensor([[1, patches, patches]]),
                  mm_token_type_ids=(ids == VLM_TOKENS["image_token_id"]).int())
    return model, inputs


def fixture_path(name: str) -> Path | None:
    """Path of a trained fixture model (../shared/models/<name> from the repo), or None where absent.

    HF_HYBRID_SPEC_FIXTURES overrides the folder that holds the fixtures.
    """
    roots = []
    if os.environ.get("HF_HYBRID_SPEC_FIXTURES"):
        roots.append(Path(os.environ["HF_HYBRID_SPEC_FIXTURES"]))
    repo = Path(__file__).resolve().parent.parent
    roots += [repo.parent / "shared" / "models", repo / "shared" / "models", repo / ".carry" / "models"]
    for root in roots:
        if (root / name / "config.json").is_file():
            return root / name
    return None


def layer_split_device_map(model, devices: list) -> dict[str, object]:
    """A `device_map` that puts the first half of the decoder layers (and the embedding) on `devices[0]` and the
    rest (final norm; the head too unless it is tied to the embedding) on `devices[-1]`: pipeline placement as
    `device_map="auto"` makes it over two GPUs, but deterministic, for tests and benchmarks. Apply it with
    `accelerate.dispatch_model(model, device_map=...)`.
    """
    layers = model.model.layers
    half = len(layers) // 2
    # A head tied to the embedding shares its weight, so both must sit on one device.
    tied = model.config.get_text_config().tie_word_embeddings
    device_map: dict[str, object] = {"model.embed_tokens": devices[0], "lm_head": devices[0] if tied else devices[-1]}
    for name, _ in model.model.named_children():
        if name not in ("embed_tokens", "layers"):
            device_map[f"model.{name}"] = devices[-1]
    for i in range(len(layers)):
        device_map[f"model.layers.{i}"] = devices[0] if i < half else devices[-1]
    return device_map


def acceptance_drafter(continuation: list[int], acceptance: float, depth: int = 8, vocab_size: int = 2,
                       seed: int = 0):
    """A drafter for benchmarks only: it proposes the target's own greedy continuation of its row, computed beforehand
    (`continuation`: the row's prompt and generated tokens, no padding), as a chain of up to `depth` tokens, each
    replaced by another token with probability 1 - `acceptance`: speed at a known per-token acceptance on realistic
    shapes, whose random weights accept nothing a real drafter proposes. Exactness holds whatever it proposes.
    (The class is defined here, not at import: importing `hf_hybrid_spec.testing` stays light.)"""
    import random

    from .drafters import Drafter
    from .tree import DraftTree, empty_draft

    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance!r}")

    class AcceptanceDrafter(Drafter):
        name = "acceptance"
        respects_budget = True  # never more than the budget's nodes and depth
        catches_up = True  # it drafts from the committed length alone

        def __init__(self):
            self.rng = random.Random(seed)  # a few microseconds per step: the drafter must not be what is timed

        def propose(self, input_ids, budget):
            start = input_ids.shape[1]
            n = min(depth, budget.max_nodes, budget.max_depth, len(continuation) - start)
            if n <= 0:
                return empty_draft(1)
            tokens = list(continuation[start : start + n])
            for i in range(n):
                if self.rng.random() >= acceptance:  # any other token: the target's greedy choice differs there
                    tokens[i] = (tokens[i] + 1 + self.rng.randrange(max(vocab_size - 1, 1))) % vocab_size
            return DraftTree.from_lists(tokens, list(range(-1, n - 1)))

    return AcceptanceDrafter()


def acceptance_batch_drafter(continuations: list[list[int]], acceptance: float, depth: int = 8, vocab_size: int = 2,
                             seed: int = 0):
    """`acceptance_drafter` for a whole batch, drafting on the device: row b proposes the next `depth` tokens of
    `continuations[b]` (its prompt and generated tokens, no padding) from its committed length, each replaced with
    probability 1 - `acceptance`, as a chain whose nodes are worth `acceptance ** depth` to the budget. A
    `BatchDrafter` with device drafting, so a greedy batch on the static path runs the pipelined step
    (`engine.pipeline`) as EAGLE does: the cost of speculation at a known acceptance on realistic shapes, with no
    host read per step. For benchmarks only."""
    from .drafters import BatchDrafter
    from .tree import DeviceDrafts, DraftBatch

    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance!r}")

    class AcceptanceBatchDrafter(BatchDrafter):
        name = "acceptance"
        supports_device = True

        def __init__(self):
            self.max_depth = depth
            width = max(len(c) for c in continuations) + depth
            self.table = torch.zeros(len(continuations), width, dtype=torch.long)
            for b, row in enumerate(continuations):
                self.table[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            self.lengths = None  # [R] committed tokens per row, on the device

        def begin(self, prompts, context, hidden):
            device = context.target.device
            self.table = self.table.to(device)
            self.lengths = torch.tensor([p.shape[1] for p in prompts], dtype=torch.long, device=device)
            self.generator = torch.Generator(device=device).manual_seed(seed)

        def accept(self, rows, ids, results, hidden):
            index = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
            self.lengths.index_copy_(0, index, torch.tensor(list(ids.lengths), device=self.lengths.device))

        def propose_device(self, max_nodes):
            n = max(min(depth, max_nodes), 1)
            rows, device = self.table.shape[0], self.table.device
            steps = torch.arange(n, device=device)
            columns = (self.lengths.unsqueeze(1) + steps).clamp(max=self.table.shape[1] - 1)
            tokens = self.table.gather(1, columns)
            flip = torch.rand(rows, n, generator=self.generator, device=device) >= acceptance
            shift = torch.randint(1, max(vocab_size, 2), (rows, n), generator=self.generator, device=device)
            tokens = torch.where(flip, (tokens + shift) % vocab_size, tokens)
            depth_ = (steps + 1).expand(rows, n)
            return DeviceDrafts(tokens=tokens, parents=(steps - 1).expand(rows, n),
                                values=torch.full((rows, n), acceptance, device=device) ** depth_, depth=depth_)

        def timing_key(self):
            return (self.name, depth, vocab_size)

        def accept_device(self, counts, tokens, hidden):
            self.lengths += counts

        def advance_host(self, counts):
            pass

        def propose(self, rows, ids, budgets):
            drafts = self.propose_device(max(b.max_nodes for b in budgets))
            index = torch.tensor(rows, dtype=torch.long, device=drafts.tokens.device)
            keep = torch.stack([drafts.depth[0] <= min(b.max_depth, b.max_nodes) for b in budgets])
            batch = DraftBatch(tokens=drafts.tokens[index].cpu(), parents=drafts.parents[index].cpu(),
                               values=drafts.values[index].float().cpu(), depth=drafts.depth[index].cpu(),
                               count=torch.full((len(rows),), drafts.tokens.shape[1], dtype=torch.long))
            return batch.select(keep.cpu())

    return AcceptanceBatchDrafter()


def decisive_head(model, scale: float = 50.0):
    """Make a random-weight model's greedy choice robust to rounding, for benchmarks of random shapes: the input
    embedding scaled by `scale` (the residual stream then carries the current token, the layers' random outputs a
    small part of it) and the output embedding a copy of it (untied heads; a tied one already is), so the argmax is
    the current token by a margin of ~sqrt(hidden) standard deviations. Without it the top two logits of a random
    model are so close that bf16 rounding of a batched tree and of a single token pick different ones, and a
    continuation computed beforehand (the acceptance drafters') drifts from the one being decoded. The compute of
    every layer is unchanged. Returns the model."""
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.mul_(scale)
        head = model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != embedding.data_ptr():
            head.weight.copy_(embedding / scale)
    return model
