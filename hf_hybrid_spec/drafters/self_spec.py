"""Self-speculative drafters: the target drafts for itself with part of its own computation.

- `SelfSSMDrafter` (`drafter="self_ssm"`): the target with its attention pathway suppressed
  (`ModelAdapter.suppress_attention`; component-aware self-speculation, arXiv 2605.01106). On a parallel
  hybrid (Falcon-H1) that leaves the Mamba-2 branch of every layer; on a sequential one (Qwen3.5) the
  recurrent layers alone, with or without the attention layers' MLPs.
- `LayerSkipDrafter` (`drafter="layerskip"`): the first `exit_layer` decoder layers, then the model's own
  final norm and head (`ModelAdapter.early_exit`; LayerSkip, arXiv 2404.16710).

Neither holds state of its own. Every drafting step is a tree-mode forward on the target's committed
`HybridTreeCache` (`DraftContext.cache`), so it starts from the committed recurrent states with no extra
prefill, followed by `cache.abort()`: recurrent layers never write their state in tree mode and attention
layers are cropped back, so the committed state is exactly what it was. The draft is a chain
(`draft_top_k=1`, `max_depth` tokens) or an EAGLE-2-style tree (`draft_top_k > 1`): each step runs the root
and every node drafted so far, expands the top-k children of the k most probable frontier nodes, and the best
`max_nodes` nodes by path probability form the proposal. Draft positions assume an unpadded prompt: a
left-padded one only lowers the acceptance, never the exactness (verification is the loop's).

The drafted tokens' first-E-layer activations are not handed to verification (docs/benchmarks.md,
"Self-speculation", says why): the loop's verify forward recomputes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..forward import forward_tree
from ..models import get_adapter
from ..tree import DraftTree, VerifyTree, empty_draft
from .base import DraftBudget, DraftContext, Drafter, TargetHidden, check_top_k

__all__ = ["SelfSpecDrafter", "SelfSSMDrafter", "LayerSkipDrafter", "self_ssm_from_config", "layerskip_from_config"]


class SelfSpecDrafter(Drafter):
    """Drafts with the target under `restricted()` (a context manager that removes part of the model).

    Args:
        target: the target model (the one `generate` runs on).
        top_k: children expanded per node; 1 drafts a chain.
    """

    name = "self"
    per_row = False  # drafts with tree forwards on the target's own (batched) cache

    def __init__(self, target: nn.Module, top_k: int = 1):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        self.target = target
        self.adapter = get_adapter(target)
        self.top_k = top_k
        self.context: DraftContext | None = None

    def restricted(self) -> contextlib.AbstractContextManager:
        """The part of the target that drafts, active for the duration of one drafting forward."""
        raise NotImplementedError

    def begin(self, input_ids: torch.Tensor, context: DraftContext, hidden: TargetHidden | None = None) -> None:
        if context is None or context.target is not self.target:
            raise ValueError(f"the {self.name} drafter drafts with the target's own weights: it was built for a "
                             "different model than the one generating")
        self.context = context

    @torch.no_grad()
    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if self.context is None:
            raise RuntimeError("propose called before begin")
        device = input_ids.device
        if budget.max_depth < 1 or budget.max_nodes < 1:
            return empty_draft(1, device)
        length = input_ids.shape[1]
        root = input_ids[:, -1:]
        k = self.top_k
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # log-probability of each node's root path under the drafter
        frontier = [-1]  # draft-node indices to expand next; -1 is the root
        for _ in range(budget.max_depth):
            logp = self._frontier_log_probs(root, tokens, parents, frontier, length)  # [F, V]
            base = torch.tensor([0.0 if f < 0 else scores[f] for f in frontier], device=logp.device)
            top = logp.topk(k, dim=-1)
            cand_scores = (base[:, None] + top.values).flatten().tolist()
            cand_tokens = top.indices.flatten().tolist()
            cand_parents = [f for f in frontier for _ in range(k)]
            order = sorted(range(len(cand_tokens)), key=lambda i: -cand_scores[i])
            new = []
            for i in order:
                if len(tokens) >= budget.max_nodes:
                    break
                tokens.append(cand_tokens[i])
                parents.append(cand_parents[i])
                scores.append(cand_scores[i])
                new.append(len(tokens) - 1)
            # Expand the k most probable of the new nodes (`order` is best first).
            frontier = new[:k]
            if not frontier:
                break
        # Nodes were added level by level, so parents precede children; a path score never rises along a
        # path, so the best max_nodes nodes (ties by index) are closed under parents.
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: budget.max_nodes])
        # On the host, where the lists already are (like a cache draft: trimming, layout and verification then read
        # no device memory).
        full = DraftTree(
            tokens=torch.tensor([tokens], dtype=torch.long),
            parents=torch.tensor([parents], dtype=torch.long),
            scores=torch.tensor([scores], dtype=torch.float32).exp(),
            info={"drafter": self.name},
        )
        return full.select(torch.tensor(keep, dtype=torch.long))

    def _frontier_log_probs(self, root: torch.Tensor, tokens: list[int], parents: list[int], frontier: list[int],
                            length: int) -> torch.Tensor:
        """One drafting forward of root + draft nodes on the committed cache; [F, V] fp32 log-probs at the
        frontier nodes. The cache is back in its committed state on return (or on error)."""
        dev = root.device
        node_tokens = torch.cat([root, torch.tensor([tokens], dtype=torch.long, device=dev)], dim=1)
        # Verify-tree indexing: the root is node 0, draft node j is node j + 1.
        node_parents = torch.tensor([[-1] + [p + 1 for p in parents]], dtype=torch.long, device=dev)
        tree = VerifyTree.from_parents(node_tokens, node_parents)
        cache = self.context.cache
        try:
            with self.restricted():
                out = forward_tree(self.target, tree, cache, prefix_length=length - 1,
                                   root_position=torch.tensor([length - 1], device=dev),
                                   position_offsets=self.context.position_offsets)
        finally:
            cache.abort()
        rows = torch.tensor([f + 1 for f in frontier], device=out.logits.device)
        return torch.log_softmax(out.logits[0, rows].float(), dim=-1)

    def end(self, input_ids: torch.Tensor) -> None:
        self.context = None


class SelfSSMDrafter(SelfSpecDrafter):
    """The target with its attention pathway suppressed (`variant`: see `hf_hybrid_spec.config.SSM_VARIANTS`).

    Raises ValueError for attention-only models and for a variant that does not fit the family's layout
    (e.g. "skip_layer" on a parallel hybrid, "rescale_ssm" on a sequential one).
    """

    name = "self_ssm"

    def __init__(self, target: nn.Module, variant: str = "zero_attention", ssm_scale: float = 1.5, top_k: int = 1):
        super().__init__(target, top_k)
        self.variant = variant
        self.ssm_scale = ssm_scale
        # Enter once now so that a variant that does not apply fails when the drafter is built.
        with self.restricted():
            pass

    def restricted(self) -> contextlib.AbstractContextManager:
        return self.adapter.suppress_attention(self.target, self.variant, self.ssm_scale)


class LayerSkipDrafter(SelfSpecDrafter):
    """The first `exit_layer` decoder layers of the target, then its final norm and head.

    Raises ValueError unless 1 <= exit_layer < number of decoder layers.
    """

    name = "layerskip"

    def __init__(self, target: nn.Module, exit_layer: int, top_k: int = 1):
        super().__init__(target, top_k)
        self.exit_layer = exit_layer
        with self.restricted():
            pass

    def restricted(self) -> contextlib.AbstractContextManager:
        return self.adapter.early_exit(self.target, self.exit_layer)


def restriction(model: nn.Module, kind: str, ssm_variant: str = "zero_attention", ssm_scale: float = 1.5,
                exit_layer: int | None = None) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context manager that turns `model` into the `kind` ("self_ssm" / "layerskip") draft,
    for ordinary forwards too (perplexity of an ablation, early-exit training)."""
    adapter = get_adapter(model)
    if kind == "self_ssm":
        return lambda: adapter.suppress_attention(model, ssm_variant, ssm_scale)
    if kind == "layerskip":
        return lambda: adapter.early_exit(model, exit_layer)
    raise ValueError(f"kind must be 'self_ssm' or 'layerskip', got {kind!r}")


def self_ssm_from_config(config, target: nn.Module, draft_model=None) -> SelfSSMDrafter:
    """`drafter="self_ssm"`: the target with its attention pathway suppressed (`ssm_variant`, `ssm_scale`)."""
    check_top_k(config.draft_top_k, target)
    return SelfSSMDrafter(target, variant=config.ssm_variant, ssm_scale=config.ssm_scale, top_k=config.draft_top_k)


def layerskip_from_config(config, target: nn.Module, draft_model=None) -> LayerSkipDrafter:
    """`drafter="layerskip"`: the target's first `exit_layer` layers."""
    check_top_k(config.draft_top_k, target)
    return LayerSkipDrafter(target, exit_layer=config.exit_layer, top_k=config.draft_top_k)
