"""Tree verification and factorized state commit for recurrent layers: the package's bottom layer (as fla keeps
`fla/ops/`).

Math on tensors only: nothing here imports transformers. Each op has up to three implementations with one contract:
`naive_*` (the recurrence walked node by node, the test oracle), `torch_*` (closed form, vectorized; the CPU
path) and a Triton kernel (CUDA, and the Triton interpreter in tests); each op folder registers them (`ops`), and the
un-prefixed functions dispatch on the tensors' device and the backend in effect (`backend`). A tree op's output
knows how to commit its own path (`TreeGatedDeltaOutput.commit`, ...), so a cache commits any recurrent kind the
same way.

Ops (shapes follow fla: [B, N, H, K] with N tree nodes in topological order, `parent` [B, N] with -1 for
children of the committed state):
    tree_gated_delta_rule / commit_gated_delta_rule   Qwen3.5, Qwen3-Next, OLMo-hybrid linear attention
    tree_causal_conv1d / commit_causal_conv1d         the short conv in front of those layers and of Mamba
    tree_mamba2 / commit_mamba2                       Falcon-H1, Bamba, Nemotron-H, GraniteMoeHybrid mixers
    tree_mamba1 / commit_mamba1                       Jamba's Mamba-1 mixers (no Triton kernel: `mamba1.common`
                                                      says why; the PyTorch form runs on every device)
    tree_attention                                    attention of tree nodes over a KV cache (`compile_verify`)
"""

from .dispatch import *  # noqa: F403
from .dispatch import __all__  # noqa: F401
