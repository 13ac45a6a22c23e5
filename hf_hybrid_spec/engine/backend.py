"""Where a request's trees are verified: the eager backend (a dynamic cache, every kernel launched from Python) and the
static one (a static cache, each tree-size bucket's forward and commit captured as CUDA graphs), and their batch
forms, behind one protocol:

    out = backend.prefill(input_ids, attention_mask, positions, ...)   # the prompt, as stock generate runs it
    verified = backend.forward(tree)                                   # one forward over every row's verify tree
    hidden = backend.commit(paths)                                     # each row keeps its path; drafters' states
    backend.abort() / backend.release()                                # drop a pending tree / end the request

Trees are [B, N] (root first in each row: the last token each row chose, not yet in the cache) and a commit keeps one
root->leaf path per row. Each backend counts what its rows have committed; the single-request backends
(`EagerBackend`, `StaticBackend`) run B = 1, the static one on the same `static.StaticRunner` as a batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import CommittedState, HybridTreeCache, commit_paths, import_committed, zero_states
from ..cache.layers import buffers_missing
from ..drafters import BatchHidden, HistoryHidden, TargetHidden
from ..forward import forward_tokens, forward_tree
from ..tree import VerifyTree
from .outputs import target_hidden
from .static import StaticRunner, release_runner, static_runner

__all__ = ["TreeBackend", "EagerBackend", "StaticBackend", "BatchEagerBackend", "VerifyOutputs", "PrefillOutputs",
           "gather_paths", "chunked_prefill"]

# The width of a chunked prefill's chains (`AssistantConfig(prefill="chunked")`), captured besides the buckets (a narrow
# bucket would take a replay per few prompt tokens; the tree kernels hold at most 128 nodes).
PREFILL_CHUNK = 64
# prefill="auto" runs the chunked prefill for prompts padded to at most AUTO_CHUNKED_LENGTH tokens (8 chains) and at
# most AUTO_CHUNKED_TOKENS in the call (rows x padded length): shorter chunked up to those sizes on the fixtures
# (docs/batching.md, "Prompts"). Each chain is a replay and a commit where an eager forward's launches cost about the
# same at any length: past a few chains per row the eager forward wins (the length bound is reasoned from that, not
# measured).
AUTO_CHUNKED_LENGTH = 512
AUTO_CHUNKED_TOKENS = 16384


def chunked_prefill(prefill: str, rows: int, length: int) -> bool:
    """Whether a call of `rows` prompts padded to `length` tokens prefills chunked (`AssistantConfig.prefill`)."""
    if prefill == "auto":
        return length <= AUTO_CHUNKED_LENGTH and rows * length <= AUTO_CHUNKED_TOKENS
    return prefill == "chunked"


@dataclass
class VerifyOutputs:
    """One verify forward's outputs for the tree's N real nodes.

    Attributes:
        logits: [B, N, V].
        hidden_states: every layer's [B, N, H] (embeddings first), when asked for.
        attentions: every attention layer's weights [B, heads, N, keys], when asked for (eager backend only).
    """

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class PrefillOutputs:
    """A chunked prefill's outputs, read as a model forward's: logits [B, 1, V] (each row's at its last prompt token)
    and hidden_states {layer index: [B, L, H]} for the layers the drafter reads."""

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor]


class TreeBackend(ABC):
    """Verification of one request's trees on its cache (see the module docstring).

    Args (both backends):
        model: the target. hidden_layers: indices into its hidden states that the drafter reads (for `commit`).
        output_hidden_states: every forward returns every layer's hidden states (a lossy arbiter, or the caller).
        offsets: [R, B] multimodal RoPE offsets of the request, or None.
    """

    cache: HybridTreeCache
    static: bool = False

    def __init__(self, model: nn.Module, hidden_layers: tuple[int, ...], output_hidden_states: bool,
                 offsets: torch.Tensor | None):
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.output_hidden_states = output_hidden_states
        self.offsets = offsets
        self.prompt_length = 0
        self.valid = 0  # tokens committed to the cache: the next tree's root sits at this position

    @property
    def max_nodes(self) -> int | None:
        """The most nodes (root included) one verify forward takes; None: no limit of the backend's own."""
        return None

    @property
    def tree_device(self) -> torch.device:
        """Where a draft built on the host is laid out as a verify tree."""
        return self.model.device

    @property
    def captures(self) -> int:
        return 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor,
                output_attentions: bool = False, past: CommittedState | None = None, **prompt_inputs):
        """The prompt's forward, exactly as stock generate runs it: the model's outputs (last position's logits).
        With `past` (the committed state of the prompt's first `past.length` tokens, a continued call), the cache
        starts from it and only the rest of the prompt runs, as stock generate runs a prompt after a filled cache."""
        self.prompt_length = self.valid = input_ids.shape[1]
        start = 0
        if past is not None:
            import_committed(self.cache, past)
            start = past.length
        return forward_tokens(self.model, input_ids[:, start:], self.cache, position_ids=positions[..., start:],
                              attention_mask=attention_mask, logits_to_keep=1,
                              output_hidden_states=bool(self.hidden_layers) or self.output_hidden_states,
                              output_attentions=output_attentions, **prompt_inputs)

    @abstractmethod
    def forward(self, tree: VerifyTree) -> VerifyOutputs:
        """Run `tree` [1, N] (its root the token after the `valid` committed ones); the cache stays in tree mode."""

    @abstractmethod
    def commit(self, paths: list[list[int]]) -> TargetHidden | None:
        """Keep `paths[0]` (root first) of the pending tree; returns the drafter's hidden states of the path's
        tokens."""

    def abort(self) -> None:
        """Drop the pending tree (nothing committed changes)."""
        self.cache.abort()

    def release(self) -> None:
        """The request is over (or failed): give back what it held."""


class EagerBackend(TreeBackend):
    """A `HybridTreeCache` built for the request; trees go through `forward_tree` with their attention mask."""

    def __init__(self, model: nn.Module, hidden_layers: tuple[int, ...], output_hidden_states: bool,
                 offsets: torch.Tensor | None, output_attentions: bool = False):
        super().__init__(model, hidden_layers, output_hidden_states, offsets)
        self.output_attentions = output_attentions
        self.cache = HybridTreeCache(model.config)
        self._mask: torch.Tensor | None = None  # [B, L] 0/1 padding mask of the committed tokens
        self._last = None  # the pending tree's model outputs

    def prefill(self, input_ids, attention_mask, positions, output_attentions=False, past=None, **prompt_inputs):
        self._mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
        return super().prefill(input_ids, attention_mask, positions, output_attentions, past, **prompt_inputs)

    def forward(self, tree: VerifyTree) -> VerifyOutputs:
        mask, length = self._mask, self.valid + 1
        if mask.shape[1] < length:  # generated tokens are never padding
            mask = self._mask = torch.cat(
                [mask, torch.ones(mask.shape[0], length - mask.shape[1], dtype=mask.dtype, device=mask.device)], 1)
        out = forward_tree(
            self.model, tree, self.cache, prefix_length=length - 1, root_position=mask[:, : length - 1].sum(-1),
            prefix_mask=mask[:, : length - 1],
            output_hidden_states=bool(self.hidden_layers) or self.output_hidden_states,
            output_attentions=self.output_attentions, position_offsets=self.offsets,
        )
        self._last = out
        return VerifyOutputs(logits=out.logits, hidden_states=getattr(out, "hidden_states", None),
                             attentions=getattr(out, "attentions", None))

    def commit(self, paths: list[list[int]]) -> TargetHidden | None:
        (path,) = paths
        out, self._last = self._last, None
        hidden = None
        if self.hidden_layers:  # the path's rows only (no index copy for drafters that read none)
            index = torch.tensor(path).to(out.logits.device, non_blocking=True)
            hidden = target_hidden(out, self.hidden_layers, index)
        commit_paths(self.cache, [path], [self.valid])
        self.valid += len(path)
        return hidden

    def abort(self) -> None:
        self._last = None
        super().abort()


class StaticBackend(TreeBackend):
    """One request on a leased one-row `StaticRunner` (static cache, a captured forward and commit per tree-size
    bucket on CUDA): a batch of one on the runner every static path uses.

    Args beyond the base's:
        static_length: the request's cache length (prompt, new tokens and one tree). buckets: tree sizes captured.
        fuse: the runner's compiled regions (`compile_verify`). owner: the lease holder (lives as long as the call).
        chunked: the prompt goes in as chains through the runner (`prefill="chunked"`, where the call allows it).
    """

    static = True

    def __init__(self, model: nn.Module, hidden_layers: tuple[int, ...], output_hidden_states: bool,
                 offsets: torch.Tensor | None, static_length: int, buckets: tuple[int, ...], fuse: bool, owner,
                 chunked: bool = False):
        super().__init__(model, hidden_layers, output_hidden_states, offsets)
        self.chunked = chunked
        # A chunked prefill's chains get a bucket of their own width; the trees stay within the config's buckets.
        self._max_nodes = max(buckets)
        if chunked:
            buckets = tuple(sorted(set(buckets) | {PREFILL_CHUNK}))
        # Leased to this call: a concurrent call never gets the same runner. Drafters that read hidden states get
        # the committed tokens' from the runner's history (written by the commit graph); a lossy arbiter reads every
        # tree node's, returned by the forward.
        self.runner: StaticRunner = static_runner(
            model, 1, static_length, buckets, owner, fuse=fuse, all_hidden=output_hidden_states,
            history_layers=self.hidden_layers, rope_rows=0 if offsets is None else offsets.shape[0])
        self.cache = self.runner.cache
        self._valid_prompt = 0

    @property
    def max_nodes(self) -> int:
        return self._max_nodes

    @property
    def tree_device(self) -> torch.device:
        # The runner stages a host tree into its buffers in one copy.
        return torch.device("cpu")

    @property
    def captures(self) -> int:
        return self.runner.captures

    def prefill(self, input_ids, attention_mask, positions, output_attentions=False, past=None, **prompt_inputs):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if (self.chunked and past is None and not prompt_inputs and not output_attentions
                and not self.output_hidden_states and self.offsets is None and bool(mask.all())):
            return self._prefill_chunked(input_ids)
        out = super().prefill(input_ids, attention_mask, positions, output_attentions, past, **prompt_inputs)
        if self.offsets is not None:
            self.runner.set_position_offsets(self.offsets)
        self.runner.capture_all(input_ids.shape[1])
        self.runner.set_prompt_mask(mask)  # the runner keeps the prompt's padding mask itself
        self._valid_prompt = int(mask.sum())
        return out

    def _prefill_chunked(self, input_ids: torch.Tensor) -> PrefillOutputs:
        """The prompt [1, P] (no padding, nothing continued) as chains through the captured verify forward, the
        widest bucket's worth of tokens per replay, each chain committed: a few graph replays where an eager forward
        launches every kernel of the model from Python (what bounds a small model's prefill). The drafter's hidden
        states of the prompt come from the runner's history, where the commits wrote them. A runner whose cache has
        no buffers yet gets them from a one-token forward first, then starts from an empty state."""
        runner, cache = self.runner, self.cache
        prompt = input_ids.shape[1]
        self.prompt_length = self._valid_prompt = self.valid = prompt
        if buffers_missing(cache):
            zero = torch.zeros(1, 1, dtype=torch.long, device=self.model.device)
            forward_tokens(self.model, zero, cache, position_ids=zero, attention_mask=torch.ones_like(zero),
                           logits_to_keep=1)
            cache.reset()
        zero_states(cache)  # an empty sequence, run as trees
        runner.key_valid.fill_(True)
        runner.capture_all(1)
        tokens = input_ids[0].tolist()
        chunk = runner.max_nodes
        logits = None
        for start in range(0, prompt, chunk):
            take = tokens[start : start + chunk]
            k = len(take)
            out = runner.forward(torch.tensor([take], dtype=torch.long),
                                 (torch.arange(k, dtype=torch.long) - 1).view(1, k), [start], [start])
            if start + k == prompt:
                logits = out[:, k - 1 : k].clone()  # the bucket's buffer is rewritten by its next replay
            runner.commit([k - 1], start + k)
        hidden = {}
        if self.hidden_layers:
            hidden = dict(zip(self.hidden_layers, runner.committed_hidden(0, prompt)))
        return PrefillOutputs(logits=logits, hidden_states=hidden)

    def forward(self, tree: VerifyTree) -> VerifyOutputs:
        n = tree.num_nodes
        lengths, roots = [self.valid], [self._valid_prompt + self.valid - self.prompt_length]
        # A tree laid out on the host goes in with one copy; a drafter's device tree is copied on the device.
        if tree.tokens.device.type == "cpu" and tree.parent.device.type == "cpu":
            logits = self.runner.forward(tree.tokens, tree.parent, lengths, roots)
        else:
            logits = self.runner.forward_device(tree.tokens, tree.parent, lengths, roots)
        hidden = None
        if self.output_hidden_states:
            hidden = tuple(h[:, :n] for h in self.runner.all_hidden_states())
        return VerifyOutputs(logits=logits[:, :n], hidden_states=hidden)

    def commit(self, paths: list[list[int]]) -> TargetHidden | None:
        (path,) = paths
        if not path or path[0] != 0 or any(b <= a for a, b in zip(path, path[1:])):
            raise ValueError(f"path must start at the root (node 0) and go down the tree, got {path}")
        start = self.valid
        self.runner.commit([path[-1]], start + len(path))  # one graph replay on CUDA
        self.valid = start + len(path)
        if not self.hidden_layers:
            return None
        # Sliced from the runner's history when the drafter first reads it.
        return HistoryHidden(self.hidden_layers, self.runner.committed_hidden, start, self.valid)

    def abort(self) -> None:
        self.runner.abort()

    def release(self) -> None:
        release_runner(self.model, self.runner)


class BatchEagerBackend:
    """Eager verification of a batch of rows at different committed lengths, on one dynamic `HybridTreeCache`.

    Row b's committed tokens (its prompt without left padding, then what it generated, the root excepted) are the last
    `valid[b]` of the cache's `slots` key slots; the slots before them are masked (`key_valid`). Each step every row's
    tree (padded to the batch's widest with leaves nobody commits) runs in one forward, at positions counted from
    `valid`; `commit` keeps each row's own path and right-aligns the rows again (`cache.commit_paths`).
    Finished rows leave the batch (`select_rows`).

    Args:
        model: the target. hidden_layers: hidden-state indices the drafters read (returned per row by `commit`).
        all_hidden: every forward returns all its hidden states (a rule that reads them, `uses_target_hidden`).
        attentions: every forward returns its attention weights (`output_attentions`; eager attention only).
    """

    # Widths the budget may pick (None: any); the static backend's are its buckets.
    widths: list[int] | None = None
    # What a batch backend can do besides forward / commit (the batch step asks these, never the class):
    queues_plain = False  # width-1 steps queued on the device (`forward_device`, `commit_device`, `finish_commit`)
    device_drafts = False  # the pipelined step's device-side drafts and acceptance
    prefills_chunked = False  # prompts in chunks through the captured verify forward (`prefill(..., chunked=True)`)
    draft_forwards = True  # a drafter's own forwards on this cache (`engine.batch._draft_forward`)

    def __init__(self, model: nn.Module, hidden_layers: tuple[int, ...], all_hidden: bool = False,
                 attentions: bool = False):
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.all_hidden = all_hidden
        self.attentions = attentions
        self.tree_device = model.device
        self.cache = HybridTreeCache(model.config)
        self.valid: list[int] = []
        self.slots = 0
        self._key_valid: torch.Tensor | None = None  # [R, slots] bool
        self._last = None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor):
        """The left-padded prompt [B, L] with its mask, exactly as stock generate runs it."""
        self.valid = attention_mask.sum(-1).tolist()
        self.slots = input_ids.shape[1]
        self._key_valid = attention_mask.bool()
        return forward_tokens(self.model, input_ids, self.cache, position_ids=positions, attention_mask=attention_mask,
                              logits_to_keep=1, output_hidden_states=bool(self.hidden_layers) or self.all_hidden,
                              output_attentions=self.attentions)

    def forward(self, tree: VerifyTree) -> VerifyOutputs:
        """Run the rows' trees [R, N] (roots first); the cache stays in tree mode (commit or abort next)."""
        root_position = torch.tensor(self.valid, dtype=torch.long).to(self.model.device, non_blocking=True)
        out = forward_tree(self.model, tree, self.cache, prefix_length=self.slots, root_position=root_position,
                           prefix_mask=self._key_valid,
                           output_hidden_states=bool(self.hidden_layers) or self.all_hidden,
                           output_attentions=self.attentions)
        self._last = out
        return VerifyOutputs(logits=out.logits, hidden_states=getattr(out, "hidden_states", None),
                             attentions=getattr(out, "attentions", None))

    def commit(self, paths: list[list[int]]) -> BatchHidden | None:
        """Keep each row's root->leaf path; returns the hidden states of each row's path for the drafter."""
        out, self._last = self._last, None
        hidden = None
        if self.hidden_layers:
            states = tuple(out.hidden_states[i] for i in self.hidden_layers)
            n = states[0].shape[1]
            hidden = gather_paths(states, paths, [row * n for row in range(len(paths))], self.hidden_layers)
        self.slots = commit_paths(self.cache, paths, self.valid)
        self.valid = [v + len(p) for v, p in zip(self.valid, paths)]
        keep = torch.tensor(self.valid, dtype=torch.long)[:, None]
        self._key_valid = (torch.arange(self.slots)[None] >= self.slots - keep).to(self.model.device,
                                                                                  non_blocking=True)
        return hidden

    def select_rows(self, rows: list[int]) -> None:
        """Keep the batch rows `rows` (positions in the current batch, in order)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.cache.select_rows(index)
        self.valid = [self.valid[r] for r in rows]
        self._key_valid = self._key_valid.index_select(0, index.to(self._key_valid.device))

    def abort(self) -> None:
        self._last = None
        self.cache.abort()

    def release(self) -> None:
        self._last = None


def gather_paths(states: tuple[torch.Tensor, ...], paths: list[list[int]], offsets: list[int],
                 layers: tuple[int, ...]) -> BatchHidden:
    """Each row's path out of a verify forward's hidden states (`states`: [R', n, H] each, layers in order): row i's
    nodes `paths[i]` at flat offset `offsets[i]` (its row times n). Returns [R, C, H] per layer (C the longest path;
    shorter paths padded with their leaf) as a `BatchHidden` with each row's path length."""
    width = max(len(path) for path in paths)
    flat = [offset + node for offset, path in zip(offsets, paths) for node in path + path[-1:] * (width - len(path))]
    index = torch.tensor(flat, dtype=torch.long).to(states[0].device, non_blocking=True)
    size = states[0].shape[-1]
    gathered = tuple(s.reshape(-1, size).index_select(0, index).view(len(paths), width, size) for s in states)
    return BatchHidden(layers, gathered, [0] * len(paths), [len(path) for path in paths])
