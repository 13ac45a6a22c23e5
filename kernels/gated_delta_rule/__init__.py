from .common import TreeGatedDeltaOutput
from .naive import naive_commit_gated_delta_rule, naive_tree_gated_delta_rule
from .torch_tree import torch_commit_gated_delta_rule, torch_tree_gated_delta_rule

__all__ = [
    "TreeGatedDeltaOutput",
    "naive_tree_gated_delta_rule",
    "naive_commit_gated_delta_rule",
    "torch_tree_gated_delta_rule",
    "torch_commit_gated_delta_rule",
]
