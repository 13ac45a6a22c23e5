"""Exact verification of a draft tree against the target's logits: greedy and lossless sampling.

Greedy: walk from the root, at each node follow the child whose token is the target's argmax; the first
node without such a child yields the bonus token (the argmax itself). The committed tokens are exactly what
plain greedy decoding would produce.

Sampling, for drafts that are a function of the context (cache matches, n-grams, top-k expansions, greedy drafts:
every built-in drafter's): draw the target's token at every node by its position (`noise`: inverse transform
sampling with a uniform keyed by the call's seed, the row and the position) and walk as greedy does, following the
child that holds the drawn token.
A child x is accepted with probability p(x); each committed token is the draw plain sampling would make at its
position, so the output does not depend on the draft and repeats under the same `torch.manual_seed`.

Sampling, for drafts sampled from a draft distribution q (`DraftTree.probs`; recursive rejection sampling over
siblings, SpecInfer / EAGLE): at a node with target distribution p, try its children in order. A child x is
accepted with probability min(1, p(x) / q(x)), else p <- norm(max(0, p - q)); a child without q is a one-hot
proposal: accepted with probability p(x), else p(x) <- 0 and p is renormalized. When every child is rejected, the
bonus token is sampled from what is left of p; past the last accepted node, from its full p. Each committed token
is an exact sample of the target distribution.

The user's logits processors see, for every node, the input ids that plain generation would have had at
that point (committed tokens plus the node's root path), so repetition penalties, min-length rules and
the like behave as they do without speculation. `batch_choices` applies them to every node of every row at once:
the processors it knows as tensor ops over the nodes' contexts, any other processor called once per context length
with the nodes of that length stacked (each with exactly the ids stock would pass it).
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
from transformers.generation import logits_process as _lp
from transformers.utils import logging

from ..tree import VerifyResult, VerifyTree
from .base import FirstToken, StepInputs, Verifier
from .noise import draw_seed, keyed_choice, to_device

__all__ = ["ExactVerifier", "process_tree_logits", "verify_greedy", "verify_sampling", "verify_keyed", "greedy_walk",
           "row_processors", "batch_choices", "choices_apply", "CONTEXT_FREE", "POSITIONAL", "IDS_READING",
           "TOKEN_BIAS", "ALIGNED", "LENGTH_ONLY", "FILL", "NodeContexts", "RootContexts", "greedy_device",
           "DeviceAcceptance", "DeviceChoice", "device_choice", "verify_at_once", "from_config"]

logger = logging.get_logger(__name__)


class ExactVerifier(Verifier):
    """`verification="lossless"`: greedy output is stock greedy's, sampled output an exact sample of the target.

    Sampling draws each token by position (`noise`): with a seed taken from torch's generator when the rule is built
    (one per call), the same call after the same `torch.manual_seed` gives the same tokens whatever was drafted.
    Drafts sampled from a draft distribution (`DraftTree.probs`) go through recursive rejection sampling instead,
    which needs their q."""

    def __init__(self, do_sample: bool, seed: int | None = None):
        self.do_sample = do_sample
        self.raw_greedy = not do_sample
        self.seed = (draw_seed() if seed is None else seed) if do_sample else None

    def first_token(self, scores: torch.Tensor, inputs: FirstToken) -> VerifyResult:
        if self.do_sample:
            position = torch.tensor([inputs.input_ids.shape[1]])
            token = keyed_choice(scores.view(1, -1), self.seed, inputs.row, position).view(1)
        else:
            token = scores.argmax(dim=-1).view(1)
        return VerifyResult(path=[0], tokens=token, score_nodes=[0], token_list=token.tolist())

    def verify(self, tree: VerifyTree, scores: torch.Tensor, inputs: StepInputs) -> VerifyResult:
        if not self.do_sample:
            return verify_greedy(tree, scores)
        if tree.draft.probs is not None:
            return verify_sampling(tree, scores)
        return verify_keyed(tree, scores, self.seed, inputs.row, inputs.length)


# Processors whose output at a node depends on that node's scores alone, never on the ids before it: applied to every
# node of every row at once, they give what stock generate gives at each position. Exact types: a subclass may read
# the ids.
CONTEXT_FREE = tuple(getattr(_lp, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper", "SuppressTokensLogitsProcessor",
    "InfNanRemoveLogitsProcessor") if hasattr(_lp, name))
# Processors whose output at a node depends on the length of the ids before it alone (the node's position), never on
# their values: `min_length` and `min_new_tokens` remove the eos tokens before their bound. `batch_choices` applies
# them from each node's position, worked out on the host (a step past the bound launches nothing for them).
POSITIONAL = (_lp.MinLengthLogitsProcessor, _lp.MinNewTokensLengthLogitsProcessor)
# Processors that read only the length of the ids they are given (`input_ids.shape[-1]`), never their values: forced
# bos / eos, `begin_suppress_tokens`, the exponential decay length penalty. `batch_choices` calls each once per
# distinct length among the nodes, with ids of that length whose values are never read: exact by construction (the
# processor's own code), and no node contexts to build.
LENGTH_ONLY = tuple(getattr(_lp, name) for name in (
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "ExponentialDecayLengthPenalty") if hasattr(_lp, name))
# Processors that read the ids before a node, which `batch_choices` applies to every node at once from `NodeContexts`
# (each row's ids and its tree's paths): the repetition penalty (a token in the context has its score divided by the
# penalty, or multiplied where it is negative).
IDS_READING = (RepetitionPenaltyLogitsProcessor,)
# `sequence_bias` and `bad_words_ids` whose sequences are all one token long bias (or remove) those tokens wherever
# they come, whatever the ids before: context-free then (longer sequences match the ids' end: `ALIGNED` below).
TOKEN_BIAS = (_lp.SequenceBiasLogitsProcessor, _lp.NoBadWordsLogitsProcessor)
# Processors that read the ids before a node and give stock's output at every node when handed all the nodes'
# contexts in one call, right-aligned in an [M, W] tensor with FILL before each (no token equals FILL): they match
# windows or suffixes of real tokens only (`no_repeat_ngram_size`; `bad_words_ids` / `sequence_bias` with longer
# sequences, where every context holds at least the longest sequence: transformers' versions differ on shorter ones).
# A processor of ours may say the same with a method `call_aligned(ids [M, W], lengths [M], scores [M, V])` (the
# server's presence / frequency penalty, which counts from a position), and with `group_key()` and
# `call_group(processors, ids, lengths, scores, nodes)` be applied to several requests' nodes in one call, each
# request with its own settings where their keys are equal.
ALIGNED = (_lp.NoRepeatNGramLogitsProcessor,) + TOKEN_BIAS
FILL = -1
# Each TOKEN_BIAS processor's verdict, worked out once (a bad-words list can hold thousands of sequences; the check
# runs every step).
_SINGLE_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _context_free(processor) -> bool:
    """Whether `processor`'s output at a node depends on that node's scores alone (`CONTEXT_FREE`, or a
    `TOKEN_BIAS` whose sequences are single tokens)."""
    if type(processor) in CONTEXT_FREE:
        return True
    if type(processor) not in TOKEN_BIAS:
        return False
    single = _SINGLE_TOKENS.get(processor)
    if single is None:
        single = _SINGLE_TOKENS[processor] = all(len(ids) == 1 for ids in processor.sequence_bias)
    return single


@dataclass
class NodeContexts:
    """What ids-reading processors need to see every node's context (the ids stock generate would have there: the
    row's committed ids, padding included, then the node's path below the root).

    Attributes:
        row_ids: [R] each row's committed ids [1, L_r] (its last token the root), as stock's processors see them.
        tree: the rows' verify trees ([R, >= N] tokens, node 0 each root; `ancestors` worked out when first used).
        index: the tree rows that are these rows (None: all of them, in order).
    """

    row_ids: Sequence[torch.Tensor]
    tree: VerifyTree
    index: list[int] | None = None

    def presence(self, rows: list[int], n: int, ignore: int, vocab: int, device: torch.device) -> torch.Tensor:
        """[len(rows) * n, vocab] bool: whether each token is in the context of node j of row r (rows' nodes in
        row-major order), the first `ignore` ids of each row left out (`prompt_ignore_length`)."""
        # Padded where the rows are (a serving engine's ids live on the host: one copy that does not wait for the
        # device's queue, as a pageable copy would).
        ids = pad_sequence([self.row_ids[r][0] for r in rows], batch_first=True, padding_value=vocab)
        ids = to_device(ids.clamp(max=vocab), device)  # ids past the scores' vocabulary: a dropped column, as stock's
        if ignore:
            ids[:, :ignore] = vocab
        m = len(rows)
        seen = torch.zeros(m, vocab + 1, dtype=torch.bool, device=device).scatter_(1, ids, True)
        tokens, ancestors = self._below_root(rows, n, device)
        tokens = tokens.clamp(max=vocab)
        # Node j's path tokens into its row of the mask; every other pair writes the dropped column (all writes are
        # True, so duplicate tokens cannot race).
        path = torch.where(ancestors, tokens[:, None, :].expand(m, n, n), vocab)
        seen = seen[:, None, :].repeat(1, n, 1).scatter_(2, path, True)
        return seen[..., :vocab].reshape(m * n, vocab)

    def aligned(self, rows: list[int], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every node's context in one tensor: ([len(rows) * n, W] int64, each node's context right-aligned with
        FILL before it (rows' nodes in row-major order), [len(rows) * n] int64 its length), on `device`."""
        m = len(rows)
        ids = to_device(pad_sequence([self.row_ids[r][0] for r in rows], batch_first=True, padding_value=FILL), device)
        length = ids.shape[1]
        held = to_device(torch.tensor([self.row_ids[r].shape[1] for r in rows]), device)
        tokens, ancestors = self._below_root(rows, n, device)
        depth = ancestors.sum(-1)  # [m, n] each node's path below the root (itself included)
        # Node j's context, left-aligned: its row's ids, then token k of its path at the row's length + depth(k) - 1
        # (every other pair writes a dropped column).
        width = length + n - 1
        context = torch.full((m, n, width + 1), FILL, dtype=torch.long, device=device)
        context[..., :length] = ids[:, None, :]
        place = torch.where(ancestors, held[:, None, None] + depth[:, None, :] - 1, width)
        context.scatter_(2, place, tokens[:, None, :].expand(m, n, n).long())
        total = (held[:, None] + depth).reshape(-1)
        return right_align(context[..., :width].reshape(m * n, width), total), total

    def _below_root(self, rows: list[int], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `rows`' first `n` tree tokens [m, n] and ancestor masks [m, n, n] on `device`, the root left out of
        every path (it is the ids' last token already)."""
        at = to_device(torch.tensor(rows if self.index is None else [self.index[r] for r in rows]), device)
        # A static runner's trees are laid out on the host: copied as the ids are.
        tokens = to_device(self.tree.tokens, device)[at, :n]
        ancestors = to_device(self.tree.ancestors, device)[at, :n, :n].clone()
        ancestors[..., 0] = False
        return tokens, ancestors


@dataclass
class RootContexts:
    """`NodeContexts` for a plain step's one node per row (the root): each row's recorded ids (the first `recorded[b]`
    of row b of `buffer`; padding included) and the step's roots [B] on the device, which may not be recorded yet (a
    plain step queued before the one before it is read).

    Attributes:
        buffer: [B, width] the rows' ids (a batch's `BatchRecorder.buffer`), or one [1, width_b] tensor per row (a
            serving engine's requests, each with its own recorder; on the host or the device).
        recorded: [B] how many of each row's ids come before its root.
        roots: [B] the roots, on the device.
    """

    buffer: torch.Tensor | Sequence[torch.Tensor]
    recorded: list[int]
    roots: torch.Tensor

    def presence(self, rows: list[int], n: int, ignore: int, vocab: int, device: torch.device) -> torch.Tensor:
        """[len(rows), vocab] bool: whether each token is among row r's ids or is its root (`n` is 1)."""
        at = to_device(torch.tensor(rows), device)
        ids, held = self._ids(rows, device)
        position = torch.arange(ids.shape[1], device=device)[None, :]
        inside = (position >= ignore) & (position < held[:, None])
        ids = torch.where(inside, ids.clamp(max=vocab), vocab)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device).scatter_(1, ids, True)
        seen.scatter_(1, self.roots.to(device)[at].clamp(max=vocab)[:, None], True)
        return seen[:, :vocab]

    def aligned(self, rows: list[int], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`NodeContexts.aligned` for the roots: each row's recorded ids and its root, right-aligned."""
        at = to_device(torch.tensor(rows), device)
        recorded, held = self._ids(rows, device)
        width = recorded.shape[1] + 1
        ids = torch.full((len(rows), width + 1), FILL, dtype=torch.long, device=device)
        ids[:, : width - 1] = recorded
        position = torch.arange(width + 1, device=device)[None, :]
        ids = torch.where(position < held[:, None], ids, FILL)  # what is not recorded yet
        ids.scatter_(1, held[:, None], self.roots.to(device)[at][:, None].long())
        return right_align(ids[:, :width], held + 1), held + 1

    def _ids(self, rows: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `rows`' recorded ids [len(rows), W] on `device` (W the most any of them recorded; past a row's own,
        anything) and how many each recorded [len(rows)] (int64, on `device`)."""
        recorded = [self.recorded[r] for r in rows]
        width = max(recorded, default=0)
        if isinstance(self.buffer, torch.Tensor):
            ids = self.buffer.to(device)[to_device(torch.tensor(rows), device), :width]
        else:
            own = [self.buffer[r][0, : self.recorded[r]] for r in rows]
            if all(t.device.type == "cpu" for t in own):  # padded on the host, then one copy
                ids = to_device(pad_sequence(own, batch_first=True), device)
            else:  # (a host row's copy queued, not waited for: a plain step may be queued ahead of the last)
                ids = pad_sequence([to_device(t, device) for t in own], batch_first=True)
        return ids, to_device(torch.tensor(recorded), device)


def right_align(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """ids [M, W] with row m's `lengths[m]` tokens first -> the same tokens last, FILL before them."""
    width = ids.shape[1]
    source = torch.arange(width, device=ids.device)[None, :] - (width - lengths)[:, None]
    return torch.where(source >= 0, ids.gather(1, source.clamp(min=0)), FILL)


def choices_apply(verifiers, processors: list, sampled_drafts=False, contexts: bool = False) -> bool:
    """Whether `batch_choices` makes these rows' choices (its arguments of the same names): each row's rule the exact
    one, its processors context-free or positional (or, with `contexts`, any), and a sampling row's draft not
    sampled from a draft distribution."""
    rules = verifiers if isinstance(verifiers, (list, tuple)) else [verifiers] * len(processors)
    sampled = sampled_drafts if isinstance(sampled_drafts, (list, tuple)) else [sampled_drafts] * len(rules)
    for rule, drafted in zip(rules, sampled):
        if type(rule) is not ExactVerifier or (rule.do_sample and drafted):
            return False
    if contexts:
        return True
    return all(not procs or all(type(p) in POSITIONAL + LENGTH_ONLY or _context_free(p) for p in procs)
               for procs in processors)


class _Aligned:
    """The nodes' right-aligned contexts for the processors that read them, worked out once per group of rows."""

    def __init__(self, contexts, n: int, device: torch.device):
        self.contexts, self.n, self.device, self.made = contexts, n, device, {}

    def __call__(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(rows)
        if key not in self.made:
            self.made[key] = self.contexts.aligned(rows, self.n, self.device)
        return self.made[key]


def _longest_sequence(processor) -> int:
    """The longest sequence a `TOKEN_BIAS` processor matches."""
    return max((len(ids) for ids in processor.sequence_bias), default=0)


def _process(processor, scores: torch.Tensor, ids_length: torch.Tensor, contexts: NodeContexts | None,
             rows: list[int], n: int, aligned: _Aligned | None = None) -> torch.Tensor:
    """One processor over many nodes' scores [M, V] (rows `rows`, `n` nodes each), as stock generate applies it at
    each node: `ids_length` [M] (host int64) the length of the ids stock's processor would see there (padding
    included); `contexts` those ids (for an ids-reading processor), `aligned` them right-aligned."""
    if _context_free(processor):
        return processor(torch.empty((scores.shape[0], 0), dtype=torch.long, device=scores.device), scores)
    if type(processor) in LENGTH_ONLY:
        return _process_lengths(processor, scores, ids_length)
    if type(processor) not in POSITIONAL + IDS_READING:
        return _process_contexts(processor, scores, ids_length, aligned(rows))
    if type(processor) in IDS_READING:
        seen = contexts.presence(rows, n, _ignored_prompt(processor), scores.shape[-1], scores.device)
        return _penalize(processor, scores, seen)
    active = _before_bound(processor, ids_length)
    if not bool(active.any()):  # (past the bound, a step launches nothing for it)
        return scores
    return _without_eos(processor, scores, None if bool(active.all()) else to_device(active, scores.device))


def _process_grouped(processors: list, scores: torch.Tensor, ids_length: torch.Tensor, contexts,
                     aligned: _Aligned | None) -> torch.Tensor:
    """Each row's own processors over its nodes' scores [R, N, V] (in place), rows whose processors at one stage have
    the same settings (`_stage_key`) in one call: a serving engine's requests each hold their own processor objects,
    mostly with the same sampling settings, so a step applies each setting once for the batch, not once per request.
    Exact: a processor's output for a row depends on its settings and that row's scores and ids alone (stock applies
    one object to every row of a batch)."""
    r, n, v = scores.shape
    for stage in range(max(len(procs) if procs else 0 for procs in processors)):
        groups: dict[tuple, list[int]] = {}
        for row, procs in enumerate(processors):
            if procs and stage < len(procs):
                groups.setdefault(_stage_key(procs[stage]), []).append(row)
        for members in groups.values():
            first = processors[members[0]][stage]
            every = len(members) == r
            at = None if every else to_device(torch.tensor(members), scores.device)
            part = (scores if every else scores[at]).reshape(-1, v)
            if type(first) in POSITIONAL:  # each row's own bound (a request's prompt length), one eos removal
                active = torch.cat([_before_bound(processors[row][stage], ids_length[row]) for row in members])
                if not bool(active.any()):
                    continue
                part = _without_eos(first, part, None if bool(active.all()) else to_device(active, scores.device))
            elif hasattr(first, "call_group"):  # each row's own settings beside the shared ones (`_stage_key`)
                ids, lengths = aligned(members)
                part = first.call_group([processors[row][stage] for row in members], ids, lengths, part, n)
            else:
                part = _process(first, part, ids_length[members].reshape(-1), contexts, members, n, aligned)
            if every:
                scores = part.view(r, n, v)
            else:
                scores[at] = part.view(len(members), n, v)
    return scores


# Each processor's `_stage_key`, worked out once per object (a bad-words list can hold thousands of sequences).
_STAGE_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stage_key(processor) -> tuple:
    """What tells processors apart for `_process_grouped`: the type and settings of one we batch (a positional one's
    eos tokens only: each row's bound is its own), the object itself for any other (its state is its own)."""
    kind = type(processor)
    if hasattr(processor, "group_key") and hasattr(processor, "call_group"):
        # A processor of ours that says what its requests must share (the server's presence / frequency penalty:
        # each request's prompt length is its own) and applies itself to a group's nodes with their own settings.
        return (kind.__module__, kind.__qualname__, processor.group_key())
    if not (kind in POSITIONAL + IDS_READING + ALIGNED + LENGTH_ONLY or _context_free(processor)):
        return ("object", id(processor))  # (a caller's own class may be neither hashable nor weakly referenced)
    key = _STAGE_KEYS.get(processor)
    if key is None:
        if kind in POSITIONAL:
            key = (kind.__name__, tuple(processor.eos_token_id.flatten().tolist()))
        else:
            key = _settings(processor)
        _STAGE_KEYS[processor] = key
    return key


def _process_lengths(processor, scores: torch.Tensor, ids_length: torch.Tensor) -> torch.Tensor:
    """A `LENGTH_ONLY` processor over many nodes' scores [M, V]: called once per distinct `ids_length` [M] (host) with
    ids of that length (a zero expanded: their values are never read)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=scores.device)
    lengths = torch.unique(ids_length).tolist()
    if len(lengths) == 1:
        return processor(ids.expand(scores.shape[0], lengths[0]), scores)
    out = scores.clone()
    for length in lengths:
        at = to_device((ids_length == length).nonzero().flatten(), scores.device)
        out[at] = processor(ids.expand(at.shape[0], length), scores[at])
    return out


def _process_contexts(processor, scores: torch.Tensor, ids_length: torch.Tensor,
                      aligned: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A processor that reads the ids, over many nodes' scores [M, V] given their contexts right-aligned (`aligned`:
    ids [M, W], lengths [M] on the device; `ids_length` the same lengths on the host): in one call where it takes
    them so (`ALIGNED`, `call_aligned`), else called once per context length with the nodes of that length and
    exactly their ids (a processor we do not know: exact for any that treats its rows alike, as stock's batches
    need)."""
    ids, lengths = aligned
    if hasattr(processor, "call_aligned"):
        return processor.call_aligned(ids, lengths, scores)
    if type(processor) is _lp.NoRepeatNGramLogitsProcessor:
        # The fill before a context as a token past the vocabulary, which bans nothing (stock clamps those ids to a
        # dropped column): a window of size 1 matches any prefix, and a fill of -1 was an index out of bounds.
        return processor(torch.where(ids == FILL, scores.shape[-1], ids), scores)
    if type(processor) in TOKEN_BIAS and int(ids_length.min()) >= _longest_sequence(processor):
        return processor(ids, scores)
    logger.warning_once(f"{type(processor).__name__}: a logits processor speculation does not batch; it is called once "
                        "per context length among a step's draft nodes (exact, slower)")
    out = scores.clone()
    width = ids.shape[1]
    for length in torch.unique(ids_length).tolist():
        at = to_device((ids_length == length).nonzero().flatten(), scores.device)
        out[at] = processor(ids[at, width - length :], scores[at].clone())
    return out


def batch_choices(verifiers, processors: list, logits: torch.Tensor, lengths: torch.Tensor, depth: torch.Tensor,
                  rows: torch.Tensor, sampled_drafts, pads: torch.Tensor | None = None,
                  contexts: NodeContexts | None = None, keep: bool = False):
    """The token each row's rule chooses at every node, for every row at once, where that is the rule: each row's
    `ExactVerifier` with context-free (`CONTEXT_FREE`) or positional (`POSITIONAL`) processors, or any given
    `contexts` (`IDS_READING` and `ALIGNED` ones as tensor ops over the nodes' contexts, others called once per context
    length), and, when it samples, a draft without a draft distribution (the keyed rule). None where any row's is not
    (the caller verifies row by row).

    Args:
        verifiers: the rule of every row (a batch of one call), or a list with each row's (a serving engine's
            requests, each with its own seed, or greedy).
        processors: [R] each row's processors (the same object for every row: one pass over the whole batch).
        logits: [R, N, V] the verify forward's logits (node 0 each row's root).
        lengths: [R] int64 each row's length without its padding (the root's position + 1).
        depth: [R, N] int64 each node's depth below its root (0 for the root and padding nodes).
        rows: [R] int64 each row's index for the keyed rule (its row in its call).
        sampled_drafts: whether each row's draft (a list), or any row's (a bool), was sampled from a draft
            distribution.
        pads: [R] int64 each row's left padding (None: none), which stock's positional processors count in the
            length of the ids they see.
        contexts: the rows' ids and trees (`NodeContexts`, or `RootContexts` for one node per row), for processors
            that read the ids (None: they are declined).

        keep: also return the processed scores.

    Returns:
        [R, N] int64 on the logits' device: the argmax (greedy rows) or the keyed draw (sampling rows) of each node's
        processed scores; walking each row's tree with them (`engine.step.greedy_rows`) is that row's
        `verify`. With `keep`, (those, the processed scores [R, N, V] fp32). Processor errors propagate (the caller
        can then go row by row to blame one).
    """
    r, n, v = logits.shape
    rules = verifiers if isinstance(verifiers, (list, tuple)) else [verifiers] * r
    if not choices_apply(rules, processors, sampled_drafts, contexts is not None):
        return None
    shared = all(p is processors[0] for p in processors)
    scores = logits.to(torch.float32, copy=not shared)  # rows processed one by one are written in place
    if any(processors):
        # The length of the ids stock's processors would see at each node (host; positional processors read it).
        ids_length = lengths.cpu()[:, None] + depth.cpu() + (0 if pads is None else pads.cpu()[:, None])
    aligned = None if contexts is None else _Aligned(contexts, n, scores.device)
    if shared and processors[0]:
        part = scores.reshape(-1, v)
        for processor in processors[0]:
            part = _process(processor, part, ids_length.reshape(-1), contexts, list(range(r)), n, aligned)
        scores = part.view(r, n, v)
    elif not shared:
        scores = _process_grouped(processors, scores, ids_length, contexts, aligned)
    drawing = [i for i, rule in enumerate(rules) if rule.do_sample]
    # Greedy rows take the argmax (not computed when every row samples).
    choices = scores.argmax(dim=-1) if len(drawing) < r else None
    if drawing:
        # The keys stay on the host: the uniforms are worked out there and go to the device in one copy that does
        # not wait for the queued work (`noise.keyed_choice`).
        k = len(drawing)
        at = torch.tensor(drawing)
        seeds = torch.tensor([rules[i].seed for i in drawing], dtype=torch.int64)
        keys = (seeds[:, None], rows.cpu()[at][:, None], lengths.cpu()[at][:, None] + depth.cpu()[at])  # [k, 1|n]
        if k == r:
            choices = keyed_choice(scores.reshape(-1, v), *keys).view(r, n)
        else:
            at = to_device(at, scores.device)
            choices[at] = keyed_choice(scores[at].reshape(-1, v), *keys).view(k, n)
    return (choices, scores) if keep else choices


def from_config(config, do_sample: bool, drafter) -> ExactVerifier:
    return ExactVerifier(do_sample)


def row_processors(processors: LogitsProcessorList | None, row: int) -> LogitsProcessorList | None:
    """`processors` as they apply to batch row `row` on its own: tree verification calls them with one input row per
    node of that row, so state kept per batch row is taken at `row` (transformers' repetition penalty ignores each
    row's left padding through a [B] tensor, which becomes the row's own count). The list itself when nothing
    changes."""
    if not processors:
        return processors
    out, changed = LogitsProcessorList(), False
    for processor in processors:
        ignore = getattr(processor, "prompt_ignore_length", None)
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = int(ignore[row])
            changed = True
        out.append(processor)
    return out if changed else processors


def process_tree_logits(
    input_ids: torch.Tensor, tree: VerifyTree, logits: torch.Tensor, processors: LogitsProcessorList | None
) -> torch.Tensor:
    """Apply logits processors per node. input_ids: [1, L] (root last); logits: [1, N, V] -> [N, V] fp32."""
    scores = logits[0].float()
    if not processors:
        return scores
    out = torch.empty_like(scores)
    # The tree may have been laid out on the host (static path), and the ids kept there (the serving engine's):
    # index on the scores' device.
    device = scores.device
    input_ids = input_ids.to(device)
    depth = tree.depth[0].to(device)
    # Node i's root path tokens (excluding the root, which input_ids already ends with), by depth group.
    anc = tree.ancestors[0].to(device)  # [N, N]
    tree_tokens = tree.tokens.to(device)
    for d in torch.unique(depth).tolist():
        nodes = (depth == d).nonzero().flatten()
        ids = input_ids.expand(nodes.numel(), -1)
        if d > 0:
            # Ancestors of each node in index order = root path order (topological), root dropped.
            path_cols = anc[nodes].nonzero()[:, 1].view(nodes.numel(), d + 1)[:, 1:]
            ids = torch.cat([ids, tree_tokens[0, path_cols]], dim=1)
        out[nodes] = processors(ids, scores[nodes].clone())
    return out


def verify_greedy(tree: VerifyTree, scores: torch.Tensor) -> VerifyResult:
    """scores: [N, V] processed scores (or raw logits in any float dtype: the argmax is the same). One host read of
    the per-node argmax."""
    path, new_tokens = greedy_walk(tree.token_list(0), tree.children(0), scores.argmax(dim=-1).tolist())
    return VerifyResult.from_host(path, new_tokens, scores.device)


def verify_keyed(tree: VerifyTree, scores: torch.Tensor, seed: int, row: int, length: int) -> VerifyResult:
    """Sampling over a draft that is a function of the context (cache matches, top-k expansions, greedy drafts): the
    target's token at every node drawn by position (node at depth d: position `length + d`, `noise.keyed_choice`),
    then the greedy walk with those draws in place of the argmax. Each child is accepted with probability p(child),
    and the committed tokens are those plain sampling with the same uniforms would draw. One host read of the draws."""
    children = tree.children(0)
    drawn = keyed_choice(scores, seed, row, torch.tensor(_host_depth(children), dtype=torch.int64) + length)
    path, new_tokens = greedy_walk(tree.token_list(0), children, drawn.tolist())
    return VerifyResult.from_host(path, new_tokens, scores.device)


def verify_at_once(verifier, processors, ids: torch.Tensor, tree: VerifyTree, logits: torch.Tensor) -> VerifyResult:
    """One request's `verify` (ids [1, L], root last; tree [1, N]; logits [1, >= N, V]) through `batch_choices` as a
    batch of one: every node's processed scores and choice in one pass, then the walk along the choices; the rule's
    own result, token for token. For a rule and draft `choices_apply` accepts."""
    children = tree.children(0)
    choices = batch_choices(verifier, [processors], logits[:, : len(children)], torch.tensor([ids.shape[1]]),
                            torch.tensor([_host_depth(children)]), torch.zeros(1, dtype=torch.long), False, None,
                            NodeContexts([ids], tree))
    path, new_tokens = greedy_walk(tree.token_list(0), children, choices[0].tolist())
    return VerifyResult.from_host(path, new_tokens, logits.device)


def _host_depth(children: list[list[int]]) -> list[int]:
    """Each node's depth below the root, from the tree's children lists (index order is topological)."""
    depth = [0] * len(children)
    for node, kids in enumerate(children):
        for child in kids:
            depth[child] = depth[node] + 1
    return depth


def greedy_walk(tokens: list, children: list[list[int]], best: list[int]) -> tuple[list[int], list[int]]:
    """The greedy path of one tree on the host: from the root, follow the child whose token is the target's argmax
    `best[node]`; the first node without one gives the bonus token. Returns (path, committed tokens)."""
    path = [0]
    new_tokens: list[int] = []
    node = 0
    while True:
        want = best[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        new_tokens.append(want)
        if nxt is None:
            return path, new_tokens
        path.append(nxt)
        node = nxt


@dataclass
class DeviceAcceptance:
    """Greedy acceptance of a batch of trees, on the device (`greedy_device`).

    Attributes:
        leaf: [R] the deepest accepted node of each row (-1: the row does not run, nothing is committed).
        order: [R, N] the row's path node at each depth (root at 0); past the leaf's depth node 0.
        length: [R] nodes on the path, root included (= new tokens committed; 0 for rows that do not run).
        tokens: [R, N] the committed tokens: the path's draft tokens, then the target's choice after the leaf;
            the first `length` of each row are real.
    """

    leaf: torch.Tensor
    order: torch.Tensor
    length: torch.Tensor
    tokens: torch.Tensor


def greedy_device(tokens: torch.Tensor, parent: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor,
                  valid: torch.Tensor, running: torch.Tensor, logits: torch.Tensor,
                  best: torch.Tensor | None = None) -> DeviceAcceptance:
    """Greedy verification of R trees at once with fixed shapes and no host read (a CUDA graph can hold it, and the
    commit can follow without waiting for the host). Node j of row r is accepted when its token is the target's argmax
    at its parent and every node above it is accepted; each row keeps its deepest accepted node (the lowest index
    among equally deep ones: siblings with one token commit the same tokens). Exact for any tree, as `greedy_walk`.
    With `best` (the rule's choice at every node, `DeviceChoice`) in place of the argmax, the walk is that rule's.

    Args:
        tokens, parent: [R, N] the verify trees (root first, parent[:, 0] = -1). ancestors: [R, N, N] bool, node j on
            node i's root path (itself included); depth: [R, N]. valid: [R, N] the real nodes. running: [R] bool, the
            rows that commit. logits: [R, N, V] the verify forward's. best: [R, N] the token chosen at each node
            (None: the logits' argmax).
    """
    rows, n = tokens.shape
    if best is None:
        best = logits.argmax(dim=-1)  # [R, N]
    nodes = torch.arange(n, device=tokens.device)
    match = ((tokens == best.gather(1, parent.clamp(min=0))) & valid & (parent >= 0)) | (nodes == 0)
    accepted = ~(ancestors & ~match.unsqueeze(1)).any(-1)  # every node on the root path matches
    leaf = torch.where(accepted, depth, -1).argmax(dim=-1)  # the first of the deepest
    on_path = ancestors.gather(1, leaf.view(rows, 1, 1).expand(rows, 1, n)).squeeze(1)  # [R, N]
    at_depth = on_path.unsqueeze(1) & (depth.unsqueeze(1) == nodes.view(1, n, 1))  # [R, depth, node]
    order = at_depth.to(torch.int32).argmax(-1)
    length = depth.gather(1, leaf.unsqueeze(1)).squeeze(1) + 1
    path_tokens = tokens.gather(1, order)
    new = torch.cat([path_tokens[:, 1:], torch.zeros_like(path_tokens[:, :1])], dim=1)
    new = new.scatter(1, (length - 1).unsqueeze(1), best.gather(1, leaf.unsqueeze(1)))
    return DeviceAcceptance(leaf=torch.where(running, leaf, -1), order=order,
                            length=torch.where(running, length, 0), tokens=new)


@dataclass(frozen=True)
class DeviceChoice:
    """The exact rule's choice at every node of every row with fixed shapes and no host read (what the pipelined
    step's captured accept pass holds): the argmax, or the keyed draw (`noise`) with the seed and each node's position
    on the device, of the scores after context-free (`CONTEXT_FREE`), positional (`POSITIONAL`: from each node's ids
    length on the device) and repetition (`IDS_READING`: from each node's context's tokens on the device)
    processors, applied to every node at once. Made by `device_choice`.

    Attributes:
        processors: the call's processors, each context-free, positional or the repetition penalty, in order.
        sample: the keyed draw (else the argmax).
        key: what tells captured passes apart: `sample` and each processor's type and settings (a captured pass holds
            them as constants).
    """

    processors: tuple
    sample: bool
    key: tuple

    @property
    def ignored_prompt(self) -> int | torch.Tensor | None:
        """How many of each row's first ids the repetition penalty leaves out (one number, or [B] one per row: stock
        leaves out each row's left padding); None: no processor reads the ids (the choice needs no `presence`)."""
        reading = [p for p in self.processors if type(p) in IDS_READING]
        if not reading:
            return None
        ignore = getattr(reading[0], "prompt_ignore_length", None)
        return 0 if ignore is None else ignore

    def choose(self, logits: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor,
               ids_length: torch.Tensor, presence: torch.Tensor | None = None) -> torch.Tensor:
        """logits [R, N, V]; seed [1] int64 the call's, on the device; positions [R, N] int64 each node's token's
        position (its row's length without padding, root included, plus its depth); ids_length [R, N] int64 the
        length of the ids stock's processors see there (padding included); presence [R * N, V] bool the tokens of
        each node's context (where `ignored_prompt` is not None) -> [R, N] int64 the choices, as `batch_choices`
        makes them."""
        r, n, v = logits.shape
        scores = logits.reshape(r * n, v).to(torch.float32, copy=True)
        for processor in self.processors:
            if type(processor) in POSITIONAL:
                scores = _positional(processor, scores, ids_length.reshape(-1))
            elif type(processor) in IDS_READING:
                scores = _penalize(processor, scores, presence)
            else:
                scores = processor(torch.empty((r * n, 0), dtype=torch.long, device=scores.device), scores)
        if not self.sample:
            return scores.argmax(dim=-1).view(r, n)
        rows = torch.arange(r, device=positions.device).repeat_interleave(n)
        return keyed_choice(scores, seed.to(positions.device), rows, positions.reshape(-1)).view(r, n)


def device_choice(verifier, processors) -> DeviceChoice | None:
    """The `DeviceChoice` of a call's rule and processors, where there is one: the exact rule (greedy or the keyed
    draw) with context-free and positional processors and at most one repetition penalty. None otherwise (the
    general step decides)."""
    processors = tuple(processors or ())
    if type(verifier) is not ExactVerifier or not all(_context_free(p) or type(p) in POSITIONAL + IDS_READING
                                                      for p in processors):
        return None
    if sum(type(p) in IDS_READING for p in processors) > 1:
        return None
    # (The penalty's ids left out are read when the tokens seen are loaded, outside the captured pass: not in its key,
    # or every padding of a batch would capture passes of its own.)
    return DeviceChoice(processors, verifier.do_sample, (verifier.do_sample,) + tuple(
        (type(p), p.penalty) if type(p) in IDS_READING else _settings(p) for p in processors))


def _ignored_prompt(processor) -> int:
    """How many of the first ids an `IDS_READING` processor leaves out (its `prompt_ignore_length` where that is one
    number; a [B] tensor of them is taken per row by `row_processors`)."""
    ignore = getattr(processor, "prompt_ignore_length", None)
    return ignore if isinstance(ignore, int) else 0


def _penalize(processor, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """The repetition penalty over scores [M, V] where `seen` [M, V] (bool) marks the tokens of each node's context:
    stock's arithmetic (divided by the penalty, multiplied where negative) on those tokens alone."""
    penalty = processor.penalty
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def _positional(processor, scores: torch.Tensor, ids_length: torch.Tensor) -> torch.Tensor:
    """A `POSITIONAL` processor with fixed shapes and no host read: the eos tokens removed at every node whose ids
    length (`ids_length` [M] on the device) is before its bound."""
    return _without_eos(processor, scores, _before_bound(processor, ids_length).to(scores.device))


def _before_bound(processor, ids_length: torch.Tensor) -> torch.Tensor:
    """[M] bool: where a `POSITIONAL` processor removes the eos tokens (ids of `ids_length` before its bound)."""
    if type(processor) is _lp.MinLengthLogitsProcessor:
        return ids_length < processor.min_length
    return ids_length - processor.prompt_length_to_skip < processor.min_new_tokens  # MinNewTokensLength...


def _without_eos(processor, scores: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
    """scores [M, V] with the processor's eos tokens at -inf in the rows `active` [M] (None: every row)."""
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    eos = torch.isin(vocab, processor.eos_token_id.to(scores.device))[None, :]
    return torch.where(eos if active is None else eos & active[:, None], -math.inf, scores)


def _settings(processor) -> tuple:
    """A processor's type and attributes as a hashable key (tensors by their values)."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.flatten().tolist())
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((repr(k), plain(v)) for k, v in value.items()))
        return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)

    return (type(processor).__name__,) + tuple((k, plain(v)) for k, v in sorted(vars(processor).items()))


def verify_sampling(tree: VerifyTree, scores: torch.Tensor, generator: torch.Generator | None = None) -> VerifyResult:
    """scores: [N, V] processed (warped) scores; the target distribution at node i is softmax(scores[i])."""
    probs = torch.softmax(scores, dim=-1)
    tokens = tree.token_list(0)
    children = tree.children(0)
    draft_q = tree.draft.probs  # [1, M, V] or None; draft node j is tree node j + 1
    path = [0]
    new_tokens: list[int] = []
    node = 0
    while True:
        p = probs[node].clone()
        accepted = None
        for c in children[node]:
            x = tokens[c]
            q = None if draft_q is None else draft_q[0, c - 1].to(p)
            if q is None:
                accept_prob = p[x]
            else:
                accept_prob = torch.clamp(p[x] / q[x].clamp(min=1e-20), max=1.0)
            if torch.rand((), device=p.device, generator=generator) < accept_prob:
                accepted = c
                break
            # Residual after rejecting x (one-hot q: zero x; sampled q: subtract q).
            if q is None:
                p[x] = 0.0
            else:
                p = torch.clamp(p - q, min=0.0)
            total = p.sum()
            if total <= 0:
                # Only reachable through rounding when p == q; the accept step would have taken it.
                p = probs[node].clone()
            else:
                p = p / total
        if accepted is None:
            new_tokens.append(int(torch.multinomial(p, 1, generator=generator)))
            break
        new_tokens.append(tokens[accepted])
        path.append(accepted)
        node = accepted
    return VerifyResult.from_host(path, new_tokens, scores.device)
