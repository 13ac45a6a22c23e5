"""Where trees are verified: the eager backend here (a dynamic cache, every kernel launched from Python) and the static
one (`batch_static.BatchStaticBackend`: a static cache, each tree width's forward and commit captured as CUDA graphs),
behind one protocol for a batch of any size (one request is a batch of one):

    out = backend.prefill(input_ids, attention_mask, positions, ...)   # the prompts, as stock generate runs them
    verified = backend.forward(tree)                                   # one forward over every row's verify tree
    hidden = backend.commit(paths)                                     # each row keeps its path; drafters' states
    backend.select_rows(rows)                                          # rows that stopped leave the batch
    backend.abort() / backend.release()                                # drop a pending tree / end the call

Trees are [B, N] (root first in each row: the last token each row chose, not yet in the cache) and a commit keeps one
root->leaf path per row. Each backend counts what its rows have committed (`valid`); what else one can do it says in
capability flags (`static`, `queues_plain`, `device_drafts`, `prefills_chunked`, `draft_forwards`), which the steps
read instead of its class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import CommittedState, HybridTreeCache, commit_paths, import_committed
from ..drafters import BatchHidden
from ..forward import forward_tokens, forward_tree
from ..models import get_adapter
from ..tree import VerifyTree

__all__ = ["BatchEagerBackend", "VerifyOutputs", "PrefillOutputs", "prompt_forward", "gather_paths",
           "chunked_prefill"]

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


class BatchEagerBackend:
    """Eager verification of a batch of rows at different committed lengths, on one dynamic `HybridTreeCache`.

    Row b's committed tokens (its prompt without left padding, then what it generated, the root excepted) are the last
    `valid[b]` of the cache's `slots` key slots; the slots before them are masked (`key_valid`). Each step every row's
    tree (padded to the batch's widest with leaves nobody commits) runs in one forward, at positions counted from
    `valid`; `commit` keeps each row's own path and right-aligns the rows again (`cache.commit_paths`; a row without
    padding keeps its slots in place). Finished rows leave the batch (`select_rows`).

    Args:
        model: the target. hidden_layers: hidden-state indices the drafters read (returned per row by `commit`).
        all_hidden: every forward returns all its hidden states (a rule that reads them, `uses_target_hidden`, or
            the caller's `output_hidden_states`).
        attentions: every forward returns its attention weights (`output_attentions`; eager attention only).
        offsets: [R, B] multimodal RoPE offsets of the rows (Qwen3.5's vision-language model), or None.
    """

    # Widths the budget may pick (None: any); the static backend's are its buckets.
    widths: list[int] | None = None
    # What a backend can do besides forward / commit (the steps ask these, never the class):
    static = False  # a static cache (a runner's), its forwards captured where the device allows
    queues_plain = False  # width-1 steps queued on the device (`forward_device`, `commit_device`, `finish_commit`)
    device_drafts = False  # the pipelined step's device-side drafts and acceptance
    prefills_chunked = False  # prompts in chunks through the captured verify forward (`prefill(..., chunked=True)`)
    draft_forwards = True  # a drafter's own forwards on this cache (`engine.batch._draft_forward`)
    captures = 0  # CUDA graphs captured for the call

    def __init__(self, model: nn.Module, hidden_layers: tuple[int, ...], all_hidden: bool = False,
                 attentions: bool = False, offsets: torch.Tensor | None = None):
        get_adapter(model)  # route the recurrent mixers (else a tree forward would run the stock one on the states)
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.all_hidden = all_hidden
        self.attentions = attentions
        self.offsets = offsets
        self.tree_device = model.device
        self.cache = HybridTreeCache(model.config)
        self.valid: list[int] = []
        self.slots = 0
        self._key_valid: torch.Tensor | None = None  # [R, slots] bool
        self._last = None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                past: CommittedState | None = None, **prompt_inputs):
        """The left-padded prompt [B, L] with its mask, exactly as stock generate runs it. With `past` (one row: the
        committed state of the prompt's first `past.length` tokens, a continued call) the cache starts from it and
        only the rest of the prompt runs, as stock generate runs a prompt after a filled cache. `prompt_inputs`: a
        multimodal prompt's inputs (pixel values, grids...), for this forward only."""
        self.valid = attention_mask.sum(-1).tolist()
        self.slots = input_ids.shape[1]
        self._key_valid = attention_mask.bool()
        return prompt_forward(self.model, self.cache, input_ids, attention_mask, positions, past,
                              bool(self.hidden_layers) or self.all_hidden, self.attentions, **prompt_inputs)

    def forward(self, tree: VerifyTree) -> VerifyOutputs:
        """Run the rows' trees [R, N] (roots first); the cache stays in tree mode (commit or abort next)."""
        root_position = torch.tensor(self.valid, dtype=torch.long).to(self.model.device, non_blocking=True)
        out = forward_tree(self.model, tree, self.cache, prefix_length=self.slots, root_position=root_position,
                           prefix_mask=self._key_valid,
                           output_hidden_states=bool(self.hidden_layers) or self.all_hidden,
                           output_attentions=self.attentions, position_offsets=self.offsets)
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
        if self.offsets is not None:
            self.offsets = self.offsets.index_select(1, index.to(self.offsets.device))

    def abort(self) -> None:
        self._last = None
        self.cache.abort()

    def release(self) -> None:
        self._last = None


def prompt_forward(model: nn.Module, cache: HybridTreeCache, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   positions: torch.Tensor, past: CommittedState | None, output_hidden_states: bool,
                   output_attentions: bool = False, **prompt_inputs):
    """The prompts' forward [B, L] into `cache`, exactly as stock generate runs it (the last position's logits). With
    `past` (one row: the committed state of the prompt's first `past.length` tokens, a continued call) the cache
    starts from it and only the rest of the prompt runs, as stock generate runs a prompt after a filled cache."""
    start = 0
    if past is not None:
        import_committed(cache, past)
        start = past.length
    return forward_tokens(model, input_ids[:, start:], cache, position_ids=positions[..., start:],
                          attention_mask=attention_mask, logits_to_keep=1, output_hidden_states=output_hidden_states,
                          output_attentions=output_attentions, **prompt_inputs)


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
