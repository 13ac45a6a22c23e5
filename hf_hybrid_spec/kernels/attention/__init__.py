"""Attention of a few tree nodes over a KV cache (the verify forward's attention layers, `compile_verify`).

`naive_tree_attention` is the definition node by node, `torch_tree_attention` the same in one batched product, and the
Triton kernel (`triton_tree.triton_tree_attention`) computes it in one split pass over the keys and one combine.
"""

from ..ops import Op, register
from .naive import naive_tree_attention
from .torch_tree import torch_tree_attention

__all__ = ["naive_tree_attention", "torch_tree_attention"]

register(Op("tree_attention", naive_tree_attention, torch_tree_attention, "attention.triton_tree:triton_tree_attention"))
