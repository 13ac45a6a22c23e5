"""The tree cache: a transformers `DynamicCache` that verifies a whole draft tree in one forward (`tree_cache`), the
static layers of its CUDA-graph variant (`layers`), what a pending tree holds (`state`), and committed states moved
between caches (`transfer`)."""

from .layers import StaticCursor, StaticKVLayer, StaticKVMixin, StaticLinearKVLayer
from .state import CacheSnapshot, CommitsPath, PendingRecurrent, TreeState
from .transfer import CommittedState, committed_length, export_committed, import_committed, zero_states
from .tree_cache import HybridTreeCache, check_paths, commit_paths

__all__ = ["HybridTreeCache", "check_paths", "commit_paths", "TreeState", "PendingRecurrent", "CommitsPath",
           "CacheSnapshot", "StaticCursor", "StaticKVMixin", "StaticKVLayer", "StaticLinearKVLayer", "CommittedState",
           "committed_length", "export_committed", "import_committed", "zero_states"]
