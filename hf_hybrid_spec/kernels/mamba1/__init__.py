from ..ops import Op, register
from .common import TreeMamba1Output
from .naive import naive_commit_mamba1, naive_tree_mamba1
from .torch_tree import torch_commit_mamba1, torch_tree_mamba1

__all__ = [
    "TreeMamba1Output",
    "naive_tree_mamba1",
    "naive_commit_mamba1",
    "torch_tree_mamba1",
    "torch_commit_mamba1",
]

register(
    Op("tree_mamba1", naive_tree_mamba1, torch_tree_mamba1, None),
    Op("commit_mamba1", naive_commit_mamba1, torch_commit_mamba1, None),
)
