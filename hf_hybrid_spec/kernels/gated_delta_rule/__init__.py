from ..ops import Op, register
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

register(
    Op("tree_gated_delta_rule", naive_tree_gated_delta_rule, torch_tree_gated_delta_rule,
       "gated_delta_rule.triton_tree:triton_tree_gated_delta_rule"),
    Op("commit_gated_delta_rule", naive_commit_gated_delta_rule, torch_commit_gated_delta_rule,
       "gated_delta_rule.triton_tree:triton_commit_gated_delta_rule"),
)
