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
from ..tree import DraftBatch, DraftTree, VerifyTree, empty_draft
from .base import DraftBudget, DraftContext, Drafter, TargetHidden, check_top_k
from .batch import BatchDrafter

__all__ = [
    "BatchSelfSpecDrafter",
    "LayerSkipDrafter",
    "SelfSSMDrafter",
    "SelfSpecDrafter",
    "layerskip_batch_from_config",
    "layerskip_from_config",
    "self_ssm_batch_from_config",
    "self_ssm_from_config",
]


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
        growth = _Growth(self.top_k, budget.max_nodes)
        for _ in range(budget.max_depth):
            growth.extend(self._frontier_log_probs(root, growth.tokens, growth.parents, growth.frontier, length))
            if not growth.frontier:
                break
        return growth.draft(self.name)

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


class _Growth:
    """One row's draft tree as it grows, depth by depth (`SelfSpecDrafter.propose`, `BatchSelfSpecDrafter`): the
    frontier's top-k children are candidates, the best by path log-probability join the tree up to `max_nodes`, and
    the k best new nodes are the next frontier."""

    def __init__(self, k: int, max_nodes: int):
        self.k, self.max_nodes = k, max_nodes
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []  # log-probability of each node's root path under the drafter
        self.frontier = [-1] if max_nodes > 0 else []  # draft-node indices to expand next; -1 is the root

    def extend(self, logp: torch.Tensor) -> None:
        """The frontier's log-probabilities [F, V] (fp32) -> its children join the tree; the frontier moves on."""
        top = logp.topk(self.k, dim=-1)
        self.extend_top(top.values.tolist(), top.indices.tolist())

    def extend_top(self, values: list[list[float]], indices: list[list[int]]) -> None:
        """`extend` from each frontier node's top-k children, read to the host: their log-probabilities and tokens
        ([F][k] each)."""
        cand_scores = [(0.0 if f < 0 else self.scores[f]) + v for f, row in zip(self.frontier, values) for v in row]
        cand_tokens = [t for row in indices for t in row]
        cand_parents = [f for f in self.frontier for _ in range(self.k)]
        order = sorted(range(len(cand_tokens)), key=lambda i: -cand_scores[i])
        new = []
        for i in order:
            if len(self.tokens) >= self.max_nodes:
                break
            self.tokens.append(cand_tokens[i])
            self.parents.append(cand_parents[i])
            self.scores.append(cand_scores[i])
            new.append(len(self.tokens) - 1)
        self.frontier = new[: self.k]  # the k most probable of the new nodes (`order` is best first)

    def whole(self) -> DraftTree:
        """Every node so far in the order they joined (the indices the frontier holds), for the next depth's
        forward."""
        if not self.tokens:
            return empty_draft(1)
        return DraftTree(tokens=torch.tensor([self.tokens], dtype=torch.long),
                         parents=torch.tensor([self.parents], dtype=torch.long))

    def draft(self, name: str) -> DraftTree:
        """The best `max_nodes` nodes as a draft, on the host."""
        if not self.tokens:
            return empty_draft(1)
        # Nodes were added level by level, so parents precede children; a path score never rises along a path, so
        # the best max_nodes nodes (ties by index) are closed under parents.
        keep = sorted(sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[: self.max_nodes])
        # On the host, where the lists already are (like a cache draft: trimming, layout and verification then read
        # no device memory).
        full = DraftTree(
            tokens=torch.tensor([self.tokens], dtype=torch.long),
            parents=torch.tensor([self.parents], dtype=torch.long),
            scores=torch.tensor([self.scores], dtype=torch.float32).exp(),
            info={"drafter": name},
        )
        return full.select(torch.tensor(keep, dtype=torch.long))


class BatchSelfSpecDrafter(BatchDrafter):
    """A self-speculative drafter (`SelfSSMDrafter`, `LayerSkipDrafter`) for every row of a batch: each depth of
    every running row's tree is one forward of the restricted target over all rows (`DraftContext.draft_forward`:
    the rows' roots and nodes so far on the committed cache, which the engine leaves as it was), so a step drafts
    with `max_depth` batched forwards, not `max_depth` per row. The batch runs on the eager backend
    (`drafts_on_target`): the restriction changes the model's forward, which captured graphs would not see.

    Args:
        drafter: the one-request drafter whose restriction and top-k this uses.
    """

    drafts_on_target = True

    def __init__(self, drafter: SelfSpecDrafter):
        self.drafter = drafter
        self.name = drafter.name
        self.context: DraftContext | None = None

    def begin(self, prompts: list[torch.Tensor], context: DraftContext, hidden=None) -> None:
        if context is None or context.target is not self.drafter.target:
            raise ValueError(f"the {self.name} drafter drafts with the target's own weights: it was built for a "
                             "different model than the one generating")
        if context.draft_forward is None:
            raise RuntimeError(f"the {self.name} drafter drafts a batch through the engine's draft forward, which this "
                               "batch backend does not offer")
        self.context = context

    @torch.no_grad()
    def propose(self, rows: list[int], ids, budgets: list[DraftBudget]) -> DraftBatch:
        if self.context is None:
            raise RuntimeError("propose called before begin")
        growths = [_Growth(self.drafter.top_k, budget.max_nodes if budget.max_depth > 0 else 0)
                   for budget in budgets]
        roots = [int(ids[i][0, -1]) for i in range(len(rows))]
        for depth in range(max((budget.max_depth for budget in budgets), default=0)):
            growing = [i for i, (g, budget) in enumerate(zip(growths, budgets))
                       if g.frontier and depth < budget.max_depth]
            if not growing:
                break
            current = DraftBatch.from_drafts([g.whole() for g in growths])
            with self.drafter.restricted():
                logits = self.context.draft_forward(roots, current)  # [R, N, V]
            # Every growing row's frontier nodes at once: one top-k and one read for the batch.
            rows_at = [i for i in growing for _ in growths[i].frontier]
            nodes_at = [f + 1 for i in growing for f in growths[i].frontier]
            picked = logits[torch.tensor(rows_at, device=logits.device), torch.tensor(nodes_at, device=logits.device)]
            top = torch.log_softmax(picked.float(), dim=-1).topk(self.drafter.top_k, dim=-1)
            values, indices = top.values.tolist(), top.indices.tolist()
            start = 0
            for i in growing:
                end = start + len(growths[i].frontier)
                growths[i].extend_top(values[start:end], indices[start:end])
                start = end
        return DraftBatch.from_drafts([g.draft(self.name) for g in growths])

    def end(self, ids: list[torch.Tensor]) -> None:
        self.context = None

    def release(self) -> None:
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


def self_ssm_batch_from_config(config, target: nn.Module, draft_model, rows: int) -> BatchSelfSpecDrafter:
    """`drafter="self_ssm"` for a batch: one restricted forward of all rows per depth."""
    return BatchSelfSpecDrafter(self_ssm_from_config(config, target))


def layerskip_batch_from_config(config, target: nn.Module, draft_model, rows: int) -> BatchSelfSpecDrafter:
    """`drafter="layerskip"` for a batch: one early-exit forward of all rows per depth."""
    return BatchSelfSpecDrafter(layerskip_from_config(config, target))
