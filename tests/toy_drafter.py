"""A toy drafter: the whole of a new drafter, one file and one registration line (tests/integration/test_layering.py)."""

from hf_hybrid_spec.drafters import DraftBudget, Drafter
from hf_hybrid_spec.registry import register_drafter
from hf_hybrid_spec.tree import DraftTree


class RepeatLastDrafter(Drafter):
    """Drafts a chain repeating the last committed token."""

    name = "toy"

    def propose(self, input_ids, budget: DraftBudget) -> DraftTree:
        n = min(budget.max_nodes, budget.max_depth, 3)
        return DraftTree.from_lists([int(input_ids[0, -1])] * n, list(range(-1, n - 1)))


register_drafter("toy", lambda config, target, draft_model: RepeatLastDrafter())
