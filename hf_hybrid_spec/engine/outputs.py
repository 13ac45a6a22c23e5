"""What a decoding call returns and records: `SpecStats`, the output class, and the `Recorder` that collects committed
tokens (with their scores, logits, attentions and hidden states when asked) and applies stopping criteria."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..drafters import TargetHidden
from ..stopping import HostStopping
from ..tree import VerifyResult

__all__ = ["SpecStats", "SpeculativeDecoderOnlyOutput", "Recorder", "BatchOutputs", "CACHE_FIELD", "count_arbiter",
           "prompt_outputs", "path_outputs", "path_attentions", "target_hidden"]

CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclass
class SpecStats:
    """What speculation did during one `generate` call.

    Attributes:
        target_forwards: verification forwards of the target (the prefill is not counted).
        accepted_lengths: per verification forward, tokens committed (accepted draft tokens + the bonus token).
        drafted_tokens: per verification forward, draft nodes verified.
        prefill_tokens: prompt tokens run through the target before the first step.
        draft_seconds / verify_seconds: wall time spent drafting and in target forward + verification.
        setup_seconds: wall time from the call's start to its first step: the prefill, the first token, the drafter's
            begin and (for a batch) the verify cost model.
        arbiter_decisions / arbiter_overrides: lossy verification only: draft/target mismatches an arbiter ruled
            on, and how many of them kept the draft's token.
        static / graph_captures: whether the static cache verified the trees, and how many CUDA graphs it
            captured (one per tree-size bucket used, never more).
        budget_capped: `max_draft_tokens` was above `AssistantConfig.max_verify_nodes`, which capped every tree.
        rows: for a batch, each row's own statistics (its steps, accepted lengths and draft sizes); the batch's
            `accepted_lengths` / `drafted_tokens` then hold one entry per row and step, `target_forwards` counts the
            batched forwards, and `plain_steps` those where the batch budget verified no draft at all.
    """

    target_forwards: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    drafted_tokens: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    setup_seconds: float = 0.0
    arbiter_decisions: int = 0
    arbiter_overrides: int = 0
    static: bool = False  # verified with the static cache
    graph_captures: int = 0  # CUDA graphs captured (at most one per tree-size bucket)
    budget_capped: bool = False
    rows: list[SpecStats] | None = None
    plain_steps: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward, bonus included (1.0 means no speedup from drafts)."""
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens."""
        accepted = sum(self.accepted_lengths) - len(self.accepted_lengths)
        return accepted / max(1, sum(self.drafted_tokens))


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the speculation statistics."""

    spec_stats: SpecStats | None = None


class BatchOutputs:
    """`output_scores` / `output_logits` / `output_hidden_states` / `output_attentions` for a batch: each row's
    processed scores, raw logits, hidden states and attention weights of the tokens it committed, laid out at the end
    as stock generate lays them out: one [B, V] tensor per generated position; per position a tuple over layers of
    [B, P, D] hidden states (the prompt's at the first, P = its length; [B, 1, D] after, the state of the input that
    chose the position's token); per position a tuple over attention layers of [B, heads, P, P] weights (the prompt's),
    then [B, heads, 1, P + t] at generated position t (the input's row over every key before it).

    A row that stopped before the last position has no forward after its stop (speculation stops verifying it, where
    stock decodes it on, feeding it pad tokens): its scores / logits there are -inf but 0 at `pad_token_id`, the pad
    token with probability one, which is what the row's output holds there, and its hidden states and attention
    weights zeros.

    Args:
        rows: the batch size. scores / logits / hidden_states / attentions: which to keep.
    """

    def __init__(self, rows: int, scores: bool, logits: bool, hidden_states: bool = False, attentions: bool = False):
        self.scores: list[list[torch.Tensor]] | None = [[] for _ in range(rows)] if scores else None
        self.logits: list[list[torch.Tensor]] | None = [[] for _ in range(rows)] if logits else None
        # Per row, per layer, the [k, D] states of its tokens after the first; the prompt's states [B, P, D] per layer.
        self.states: list[list[tuple[torch.Tensor, ...]]] | None = [[] for _ in range(rows)] if hidden_states else None
        self.prompt_states: tuple[torch.Tensor, ...] | None = None
        # Per row, per token after the first, per attention layer its [heads, keys] row (None for a layer without
        # weights); the prompt's [B, heads, P, P] per layer.
        self.attentions: list[list[tuple]] | None = [[] for _ in range(rows)] if attentions else None
        self.prompt_attentions: tuple | None = None

    def add(self, row: int, scores: torch.Tensor, logits: torch.Tensor, kept: int,
            states: tuple[torch.Tensor, ...] | None = None, attentions: list[tuple] | None = None) -> None:
        """Row `row` committed `kept` tokens, chosen by `scores` / `logits` [k >= kept, V] at nodes whose hidden states
        are `states` ([k, D] per layer; None for the first token, whose are the prompt's) and whose attention rows are
        `attentions` (`path_attentions`); the entries past `kept`, tokens its stopping criteria cut, are dropped."""
        if self.scores is not None:
            self.scores[row].append(scores[:kept])
        if self.logits is not None:
            self.logits[row].append(logits[:kept])
        if self.states is not None and states is not None:
            self.states[row].append(tuple(s[:kept] for s in states))
        if self.attentions is not None and attentions is not None:
            self.attentions[row].extend(attentions[:kept])

    def outputs(self, positions: int, pad_token_id: int | None) -> tuple[tuple | None, ...]:
        """(scores, logits, hidden states, attentions) over `positions` generated positions (None for what was not
        kept)."""
        return (self._layout(self.scores, positions, pad_token_id), self._layout(self.logits, positions, pad_token_id),
                self._states(positions), self._attentions(positions))

    def _attentions(self, positions: int) -> tuple | None:
        if self.attentions is None:
            return None
        prompt = self.prompt_attentions
        length = next((a.shape[-1] for a in prompt if a is not None), None)
        if length is None:  # no layer returned weights (no attention layer)
            return (prompt,) * positions
        out = [prompt]
        for t in range(1, positions):
            layers = []
            for layer, first in enumerate(prompt):
                if first is None:
                    layers.append(None)
                    continue
                keys = length + t
                rows = [tokens[t - 1][layer] if t - 1 < len(tokens) else first.new_zeros(first.shape[1], keys)
                        for tokens in self.attentions]
                layers.append(torch.stack(rows).unsqueeze(2))  # [B, heads, 1, P + t]
            out.append(tuple(layers))
        return tuple(out)

    def _states(self, positions: int) -> tuple | None:
        if self.states is None:
            return None
        layers = len(self.prompt_states)
        later = positions - 1
        table = []  # per layer [B, later, D]
        for layer in range(layers):
            d = self.prompt_states[layer].shape[-1]
            like = self.prompt_states[layer]
            rows = []
            for chunks in self.states:
                got = torch.cat([c[layer] for c in chunks]) if chunks else like.new_zeros(0, d)
                got = got[:later]
                rows.append(torch.cat([got, got.new_zeros(later - got.shape[0], d)]))
            table.append(torch.stack(rows))
        return (tuple(self.prompt_states),) + tuple(
            tuple(table[layer][:, t : t + 1] for layer in range(layers)) for t in range(later))

    @staticmethod
    def _layout(rows: list[list[torch.Tensor]] | None, positions: int, pad_token_id: int | None) -> tuple | None:
        if rows is None:
            return None
        per_row = [torch.cat(chunks)[:positions] for chunks in rows]
        vocab, device = per_row[0].shape[-1], per_row[0].device
        stopped = torch.full((vocab,), float("-inf"), device=device)
        stopped[0 if pad_token_id is None else int(pad_token_id)] = 0.0
        table = torch.stack([torch.cat([r, stopped.expand(positions - r.shape[0], vocab)]) for r in per_row], dim=1)
        return tuple(table.unbind(0))


class Recorder:
    """Collects committed tokens, scores and logits; applies stopping criteria token by token.

    Keeps the committed ids twice: `input_ids` on the model's device (what the caller gets back) and `host_ids`, a
    Python list, so that stopping checks, drafters and streamers never read the device.
    """

    def __init__(self, input_ids, stopping_criteria, streamer, want_scores, want_logits, want_attentions=False,
                 want_hidden_states=False):
        self.input_ids = input_ids
        self.host_ids: list[int] = input_ids[0].tolist()
        self.stopping = stopping_criteria
        self.host_stopping = HostStopping.build(stopping_criteria)
        self.streamer = streamer
        self.scores = () if want_scores else None
        self.logits = () if want_logits else None
        self.attentions = () if want_attentions else None
        self.hidden_states = () if want_hidden_states else None
        self.finished = False
        # Batches (`engine.batch`): truncate=False keeps every token past a stop and records where it fired.
        self.truncate = True
        self.stopped_at: int | None = None

    def append(self, tokens: torch.Tensor, scores: torch.Tensor | None, logits: torch.Tensor | None,
               token_list: list[int] | None = None, attentions: list | None = None,
               hidden_states: list | None = None) -> int:
        """Commit `tokens` [k] (one score / logit row each, read only when asked for); stops early where a
        criterion fires. `token_list`: the same tokens on the host, when the caller has them. `attentions` /
        `hidden_states`: when asked for, one entry per token (a tuple over layers, as stock generate keeps them).
        Returns kept k.

        The criteria see each prefix exactly as stock generate would (input ids and scores up to that token).
        Length / EOS / time criteria are decided on the host; any other list is called on the device and its
        verdicts are read back in one host sync per step, not one per token.
        """
        k = tokens.shape[0]
        length = self.input_ids.shape[1]
        if token_list is None:
            token_list = tokens.tolist()
        # One concatenation per step; each criterion sees a prefix of it (a view).
        full = torch.cat([self.input_ids, tokens.view(1, k).to(self.input_ids.device)], dim=-1)
        if self.host_stopping is not None:
            stops = [self.host_stopping.stops(length + j + 1, token_list[j]) for j in range(k)]
        else:
            verdicts = []
            for j in range(k):
                seen = None if self.scores is None else self.scores + tuple(scores[i : i + 1] for i in range(j + 1))
                verdicts.append(self.stopping(full[:, : length + j + 1], seen).any())
            stops = torch.stack(verdicts).tolist() if verdicts else []
        kept = next((j + 1 for j, stop in enumerate(stops) if stop), k)
        if not self.truncate:
            # A row of a batch without EOS criteria: stock generate keeps decoding it after its criterion fires
            # (until every row has stopped), so its tokens are all kept and the first stop is only remembered.
            if self.stopped_at is None and stops[kept - 1]:
                self.stopped_at = length + kept
            kept = k
        else:
            self.finished = bool(stops[kept - 1])
        if kept:
            self.input_ids = full if kept == k else full[:, : length + kept].clone()
            self.host_ids.extend(token_list[:kept])
            if self.scores is not None:
                self.scores += tuple(scores[i : i + 1] for i in range(kept))
            if self.logits is not None:
                self.logits += tuple(logits[i : i + 1] for i in range(kept))
            if self.attentions is not None:
                self.attentions += tuple(attentions[:kept])
            if self.hidden_states is not None:
                self.hidden_states += tuple(hidden_states[:kept])
        if self.streamer is not None and kept:
            self.streamer.put(torch.tensor([token_list[:kept]], dtype=torch.long))
        return kept


def target_hidden(outputs, layers: tuple[int, ...], index: torch.Tensor | None = None) -> TargetHidden | None:
    """The drafter's requested hidden states from a target forward, at token positions `index` (all if None)."""
    if not layers:
        return None
    # index_select, not advanced indexing: the same copy with a fraction of the host-side dispatch (every step).
    states = tuple(outputs.hidden_states[i] if index is None else outputs.hidden_states[i].index_select(1, index)
                   for i in layers)
    return TargetHidden(layers=layers, states=states)


def prompt_outputs(out, want_attentions: bool, want_states: bool) -> tuple[list | None, list | None]:
    """The first generated token's attentions / hidden states, as stock generate keeps them: the prefill's, over the
    whole prompt (attentions [1, H, P, P] per attention layer, hidden states [1, P, D] per layer)."""
    attentions = [tuple(out.attentions)] if want_attentions else None
    states = [tuple(out.hidden_states)] if want_states else None
    return attentions, states


def path_outputs(out, result: VerifyResult) -> list[tuple[torch.Tensor, ...]]:
    """Per committed token, the verify forward's hidden states at the node that chose it, as a chain forward would
    have produced them: token k was chosen at node path[k] (accepted draft tokens, then the bonus token at the
    leaf); [1, 1, D] per layer."""
    states = []
    for k, node in enumerate(result.score_nodes):
        if node != result.path[k]:
            raise RuntimeError(f"token {k} was chosen at node {node}, off the accepted path {result.path}")
        states.append(tuple(h[:, node : node + 1] for h in out.hidden_states))
    return states


def path_attentions(attentions: tuple, row: int, path: list[int], nodes: list[int], slots: int, valid: int,
                    pads: int) -> list[tuple]:
    """Row `row`'s attention rows of a batched verify forward (`engine.backend.BatchEagerBackend`: the row's committed
    keys are the last `valid` of `slots`, then the tree's nodes) at the nodes that chose its committed tokens
    (`nodes`, along `path`), laid out as stock's batched decode lays them: the row's `pads` left-padding columns
    (weight 0), its committed keys, then its path up to the node, never the other branches' or rows' columns.

    attentions: per attention layer [R, heads, N, slots + N] (None for a layer without weights). Returns per token a
    tuple over layers of [heads, pads + valid + k + 1] (token k)."""
    device = next((a.device for a in attentions if a is not None), None)
    if device is None:
        return [tuple(None for _ in attentions) for _ in nodes]
    columns = torch.cat([torch.arange(slots - valid, slots), slots + torch.tensor(path, dtype=torch.long)]).to(device)
    out = []
    for k, node in enumerate(nodes):
        keep = columns[: valid + k + 1]
        out.append(tuple(None if a is None else torch.nn.functional.pad(a[row, :, node].index_select(-1, keep),
                                                                       (pads, 0)) for a in attentions))
    return out


def count_arbiter(result, *stats: SpecStats) -> None:
    """What a lossy rule's arbiter did at one step of one row (its results carry `decisions` / `overrides`), added to
    each of `stats` (the request's, and in a batch the row's)."""
    for s in stats:
        s.arbiter_decisions += getattr(result, "decisions", 0)
        s.arbiter_overrides += getattr(result, "overrides", 0)
