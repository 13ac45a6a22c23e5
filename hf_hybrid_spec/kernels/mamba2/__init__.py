from ..ops import Op, register
from .common import TreeMamba2Output
from .naive import naive_commit_mamba2, naive_tree_mamba2
from .torch_tree import torch_commit_mamba2, torch_tree_mamba2

__all__ = [
    "TreeMamba2Output",
    "naive_tree_mamba2",
    "naive_commit_mamba2",
    "torch_tree_mamba2",
    "torch_commit_mamba2",
]

register(
    Op("tree_mamba2", naive_tree_mamba2, torch_tree_mamba2, "mamba2.triton_tree:triton_tree_mamba2"),
    Op("commit_mamba2", naive_commit_mamba2, torch_commit_mamba2, "mamba2.triton_tree:triton_commit_mamba2"),
)
