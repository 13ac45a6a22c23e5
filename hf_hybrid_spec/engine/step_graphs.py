"""The pipelined step's small device ops, captured as CUDA graphs next to the runner's forward and commit.

Around its captured verify forward and commit, one pipelined step (`engine.pipeline`) runs some hundred small
PyTorch ops: the budget's selection of each row's nodes (`budget.select_device`), the acceptance
(`verification.greedy_device`, over the rule's choices where it samples or processes: `DeviceChoice`), the gather of
the accepted paths' hidden states, the acceptance by width and the packing of what the host reads. Launched one by one
they cost the host about a millisecond per step and leave the device waiting between them (at B = 64 on the fixtures
the step was host-bound; docs/benchmarks.md, "Batches").
Here they are two graphs per verify width, replayed around the runner's own:

    load(drafts)          # the drafter's [R, M] drafts into this object's buffers (four copies)
    select(width)         # graph: each row's nodes within the width, written into the bucket's tree buffers
    runner forward        # graph (the bucket's)
    accept(width)         # graph: acceptance, the bucket's leaves, the paths' hidden states, ranks, packed results,
                          #        each row's next root
    runner commit         # graph (the bucket's), reading the leaves `accept` wrote
    remember(width)       # graph, where the rule reads the ids (the repetition penalty): the committed tokens
                          #        into each row's set of tokens seen, which the next accept reads

Both bodies are pure functions of the buffers they read (what a capture's warm-up runs twice must write what the
replay writes; `roots` is rewritten to where(running, last committed token, roots), the same however often it runs).
Without graphs (CPU, a runner without them) the same bodies run eagerly. Kept on the runner (its buffers and graphs
live as long as it does), one per drafts shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graphs import GraphPasses
from ..staging import HostStaging
from ..tree import DeviceDrafts
from ..verification import DeviceChoice, greedy_device
from .budget import accepted_by_width, select_device

__all__ = ["NO_RANK", "AcceptOutputs", "StepGraphs", "step_graphs"]

# A draft rank past a row's accepted path: beyond every width.
NO_RANK = 1 << 30


@dataclass
class AcceptOutputs:
    """What `StepGraphs.accept` leaves on the device (static buffers, rewritten by the next step's).

    Attributes:
        length: [R] tokens each row commits (0: the row does not run). news: [R, P] the committed tokens (the first
            `length` real; P the longest accepted path). hidden: the accepted paths' hidden states of the runner's
            layers, [R, P, H] each (empty without layers). totals: [K] accepted draft tokens over the running rows
            at each tracked width (`budget.AcceptanceByWidth`). results: [R, 2 + P] what the host reads: the
            committed count, the kept draft nodes, then the tokens.
    """

    length: torch.Tensor
    news: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    totals: torch.Tensor
    results: torch.Tensor


class StepGraphs(GraphPasses):
    """The select and accept passes of the pipelined step for one `static.StaticRunner` and one drafts shape (see the
    module docstring).

    Args:
        runner: the batch runner (its buckets, hidden layers and graph setting). drafts: a first proposal, whose shape
            and dtypes the buffers take. path: the longest accepted path, root included. limits: [K] each tracked
            width minus one, on the device (`budget.accepted_by_width`).
    """

    PASSES = "pipelined batch step"

    def __init__(self, runner, drafts: DeviceDrafts, path: int, limits: torch.Tensor):
        self.runner = runner
        self.device = runner.device
        self.use_graphs = runner.use_graphs
        self._graphs: dict = {}
        self._pool = None
        rows = runner.rows
        self.path = path
        self.limits = limits.to(self.device)
        self.tokens = torch.zeros_like(drafts.tokens)
        self.parents = torch.full_like(drafts.parents, -1)
        self.values = torch.zeros_like(drafts.values)
        self.depth = torch.ones_like(drafts.depth)
        self.flags = torch.zeros(2 * rows, dtype=torch.long, device=self.device)  # caps, then running (0/1)
        self.flags_staging = HostStaging(2 * rows, self.device)
        self.roots = torch.zeros(rows, dtype=torch.long, device=self.device)
        # The rule's choice at every node (None: the argmax), the call's seed (the keyed draw's) and each row's left
        # padding, which stock's positional processors count (`set_choice`).
        self.choice: DeviceChoice | None = None
        self.seed = torch.zeros(1, dtype=torch.long, device=self.device)
        self.pads = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        # Where the rule reads the ids: [R, V + 1] bool, the tokens each row's ids hold (the last column takes what
        # is left out; `set_seen`, `remember`).
        self.seen: torch.Tensor | None = None
        self._selected: tuple[torch.Tensor, torch.Tensor] | None = None  # the last select's count [R], rank [R, W]

    def matches(self, drafts: DeviceDrafts, path: int, limits: torch.Tensor) -> bool:
        """Whether these buffers take `drafts` (same shapes and dtypes) for the same path and widths."""
        mine = (self.tokens, self.parents, self.values, self.depth)
        theirs = (drafts.tokens, drafts.parents, drafts.values, drafts.depth)
        return (path == self.path and torch.equal(limits.to(self.device), self.limits)
                and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(mine, theirs)))

    def load(self, drafts: DeviceDrafts) -> None:
        """The next step's drafts into the buffers the select pass reads."""
        self.tokens.copy_(drafts.tokens)
        self.parents.copy_(drafts.parents)
        self.values.copy_(drafts.values)
        self.depth.copy_(drafts.depth)

    def set_rows(self, caps: list[int], running: list[bool]) -> None:
        """Each runner row's depth cap (0: drafts nothing) and whether it runs, in one host-to-device copy."""
        self.flags_staging.host().copy_(torch.tensor(caps + [int(r) for r in running], dtype=torch.long))
        self.flags_staging.send(self.flags)

    def set_choice(self, choice: DeviceChoice | None, seed: int | None, pads: list[int]) -> None:
        """The call's rule (None: greedy over raw logits), its seed (a sampling call's, else None) and each runner
        row's left padding."""
        self.choice = choice
        if seed is not None:
            self.seed.fill_(seed)
        self.pads.copy_(torch.tensor(pads, dtype=torch.long).view(-1, 1))

    def set_seen(self, ids: torch.Tensor, lengths: list[int], ignore: int | torch.Tensor) -> None:
        """Each runner row's set of tokens seen, for a rule that reads the ids: those of `ids` [R, W] (its recorded
        ids, padding included, as stock's processors are given them) before its length in `lengths`, from position
        `ignore` on (`prompt_ignore_length`: one number, or [R] one per row); ids past the scores' vocabulary (the
        output head's) are left out, as stock's penalty leaves them."""
        vocab = self.runner.model.get_output_embeddings().weight.shape[0]
        if self.seen is None or self.seen.shape[1] != vocab + 1:
            self.seen = torch.zeros(self.runner.rows, vocab + 1, dtype=torch.bool, device=self.device)
        ids = ids.to(self.device).clamp(max=vocab)
        position = torch.arange(ids.shape[1], device=self.device)[None, :]
        held = torch.tensor(lengths, device=self.device)[:, None]
        if isinstance(ignore, torch.Tensor):
            ignore = ignore.to(self.device)[:, None]
        self.seen.zero_().scatter_(1, torch.where((position >= ignore) & (position < held), ids, vocab), True)

    def remember(self, accepted: AcceptOutputs, width: int) -> None:
        """The committed tokens of the step just accepted into each row's set of tokens seen (no-op where the rule
        reads no ids). Its own pass, after `accept`: what accept reads, it must not write."""
        if self.seen is not None and self.choice is not None and self.choice.ignored_prompt is not None:
            self._run(("remember", width), lambda: self._remember(accepted))

    def select(self, width: int) -> None:
        """Each row's likeliest nodes within `width` into the tree buffers of the bucket that verifies `width`."""
        self._selected = self._run(("select", width), lambda: self._select(width))

    def accept(self, width: int) -> AcceptOutputs:
        """After the bucket's forward: every row's accepted path (see `AcceptOutputs`); the bucket's leaves are set
        for the runner's commit."""
        key = None if self.choice is None else self.choice.key
        return self._run(("accept", width, key), lambda: self._accept(width))

    # ------------------------------------------------------------------ the bodies (graph-safe, idempotent)
    def _select(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.runner.rows
        bucket = self.runner.bucket_for(width)
        drafts = DeviceDrafts(tokens=self.tokens, parents=self.parents, values=self.values, depth=self.depth)
        chosen = select_device(drafts, width, self.flags[:rows], self.roots)
        bucket.tokens[:, :width].copy_(chosen.tokens)
        bucket.parent[:, :width].copy_(chosen.parent)
        if width < bucket.n:  # the bucket's spare nodes: lone nodes nobody commits
            bucket.tokens[:, width:].zero_()
            bucket.parent[:, width:].fill_(-1)
        return chosen.count, chosen.rank

    def _accept(self, width: int) -> AcceptOutputs:
        rows, path = self.runner.rows, self.path
        bucket = self.runner.bucket_for(width)
        count, rank = self._selected  # (a captured accept reads the captured select's outputs of its width)
        running = self.flags[rows:].bool()
        n = bucket.n
        valid = torch.arange(n, device=self.device) <= count.unsqueeze(1)
        best = None
        if self.choice is not None:
            # Each node's token's position (its row's root position + 1 + its depth) and the length of the ids stock
            # sees there (that, padding included).
            positions = bucket.roots.unsqueeze(1) + 1 + bucket.depth
            presence = None
            if self.choice.ignored_prompt is not None:
                # Node j's context: its row's ids (the root last), then the tokens on its path (itself included:
                # the root's own is seen already). Other pairs write the dropped column.
                vocab = self.seen.shape[1] - 1
                below = torch.where(bucket.anc, bucket.tokens.clamp(max=vocab)[:, None, :].expand(rows, n, n), vocab)
                presence = self.seen[:, None, :].repeat(1, n, 1).scatter_(2, below, True)[..., :vocab]
                presence = presence.reshape(rows * n, vocab)
            best = self.choice.choose(bucket.out.logits, self.seed, positions, positions + self.pads, presence)
        accepted = greedy_device(bucket.tokens, bucket.parent, bucket.anc, bucket.depth, valid, running,
                                 bucket.out.logits, best)
        bucket.leaf.copy_(accepted.leaf)
        order = accepted.order[:, :path]
        hidden = ()
        if self.runner.hidden_layers:
            hidden = tuple(h.gather(1, order.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
                           for h in self.runner.hidden_of(bucket))
        news = accepted.tokens[:, :path]  # a narrow tree's paths are shorter still: its width is all there is
        # Each row's accepted path's draft ranks (depth 1 on), their running maximum, and past the path a rank no
        # width reaches: what every narrower width would have accepted, summed over the rows.
        ranks = rank.gather(1, accepted.order[:, 1:path])
        beyond = torch.arange(ranks.shape[1], device=self.device) >= (accepted.length - 1).unsqueeze(1)
        ranks = torch.where(beyond, NO_RANK, ranks).cummax(dim=1).values
        totals = accepted_by_width(ranks, running, self.limits)
        packed = torch.cat([accepted.length.unsqueeze(1), count.unsqueeze(1), news], dim=1)
        results = torch.nn.functional.pad(packed, (0, 2 + path - packed.shape[1]))
        last = news.gather(1, (accepted.length - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        self.roots.copy_(torch.where(running, last, self.roots))
        return AcceptOutputs(length=accepted.length, news=news, hidden=hidden, totals=totals, results=results)

    def _remember(self, accepted: AcceptOutputs) -> None:
        vocab = self.seen.shape[1] - 1
        committed = torch.arange(accepted.news.shape[1], device=self.device)[None, :] < accepted.length[:, None]
        self.seen.scatter_(1, torch.where(committed, accepted.news.clamp(max=vocab), vocab), True)


def step_graphs(runner, drafts: DeviceDrafts, path: int, limits: torch.Tensor) -> StepGraphs:
    """The runner's `StepGraphs` for drafts of this shape (kept on the runner, replaced when the shape changes)."""
    kept = getattr(runner, "step_graphs", None)
    if kept is None or not kept.matches(drafts, path, limits):
        kept = runner.step_graphs = StepGraphs(runner, drafts, path, limits)
    return kept
