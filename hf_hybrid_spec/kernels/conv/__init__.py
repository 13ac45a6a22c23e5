from ..ops import Op, register
from .naive import naive_commit_causal_conv1d, naive_tree_causal_conv1d
from .torch_tree import torch_commit_causal_conv1d, torch_tree_causal_conv1d

__all__ = [
    "naive_tree_causal_conv1d",
    "naive_commit_causal_conv1d",
    "torch_tree_causal_conv1d",
    "torch_commit_causal_conv1d",
]

register(
    Op("tree_causal_conv1d", naive_tree_causal_conv1d, torch_tree_causal_conv1d,
       "conv.triton_tree:triton_tree_causal_conv1d"),
    Op("commit_causal_conv1d", naive_commit_causal_conv1d, torch_commit_causal_conv1d,
       "conv.triton_tree:triton_commit_causal_conv1d"),
)
