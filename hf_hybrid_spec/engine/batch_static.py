"""The batch loop's static backend: a batch of R left-padded rows on a leased `static.StaticRunner` of R rows (its
captured verify forward and commit per tree width), or on a serving engine's own runner whose rows are slots.

Row b's committed tokens sit in its runner row's slots 0 .. length[b] - 1 (its left-padded prompt first, masked where
padded, or without padding after a chunked prefill); rows that finished keep their slot and get empty trees that
commit nothing (no work is saved on them, but nothing is recaptured either); drafters that read the target's hidden
states (EAGLE) get each row's accepted path gathered from the forward's states of the layers they name after the
commit. The same code runs eagerly without graphs (CPU), which is what the CPU tests check.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.utils import logging

from ..cache import CommittedState, check_paths, export_committed, import_committed, zero_states
from ..cache.layers import buffers_missing
from ..drafters import BatchHidden
from ..forward import forward_tokens
from ..tree import VerifyTree
from .backend import PrefillOutputs, VerifyOutputs, gather_paths, prompt_forward
from .static import StaticRunner, release_runner, static_runner

logger = logging.get_logger(__name__)

__all__ = ["BatchStaticBackend"]


class BatchStaticBackend:
    """The static backend (the protocol of `backend.BatchEagerBackend`) on a leased `StaticRunner`: a batch of R rows,
    one request being a batch of one.

    Rows that leave the batch (`select_rows`) keep their slot in the runner and get empty trees that commit nothing.

    Args:
        model: the target. rows: R. static_length: slots per row (prompt, new tokens, one tree). buckets: the tree
            widths captured. owner: the lease holder (lives as long as the call). runner: a runner of the caller's
            own (a serving engine's), instead of one leased from the pool.
        hidden_layers: hidden-state indices the drafters read (each row's accepted path's, from `commit`).
        fuse: the runner's compiled regions (`compile_verify`).
        all_hidden: every forward returns every layer's hidden states (a rule that reads them).
        offsets: [R', R] multimodal RoPE offsets of the rows, or None.
    """

    tree_device = torch.device("cpu")  # the runner stages host trees in one copy
    # Capabilities (see `backend.BatchEagerBackend`).
    static = queues_plain = device_drafts = prefills_chunked = True
    draft_forwards = False

    def __init__(self, model: nn.Module, rows: int, static_length: int, buckets: tuple[int, ...], owner,
                 runner: StaticRunner | None = None, hidden_layers: tuple[int, ...] = (), fuse: bool = False,
                 all_hidden: bool = False, offsets: torch.Tensor | None = None):
        self.model = model
        self.hidden_layers = tuple(hidden_layers)
        self.all_hidden = all_hidden
        self.offsets = offsets
        # A runner of the caller's own (a serving engine's, kept for its lifetime), else one leased from the pool.
        self.runner = runner if runner is not None else static_runner(
            model, rows, static_length, buckets, owner, hidden_layers=self.hidden_layers, fuse=fuse,
            all_hidden=all_hidden, rope_rows=0 if offsets is None else offsets.shape[0])
        if self.runner.hidden_layers != self.hidden_layers:
            raise ValueError(f"the runner returns hidden layers {self.runner.hidden_layers}, not "
                             f"{self.hidden_layers}")
        self._owns_lease = runner is None
        self.cache = self.runner.cache
        self.widths = list(self.runner.buckets)
        self.valid: list[int] = []  # committed tokens per running row (the root excepted): its next position
        self.slots = 0  # the prompt width, then the longest row's committed slots (for the cost model's context)
        self._lengths: list[int] = []  # committed slots per runner row (prompt padding included)
        self._roots: list[int] = []
        self._rows: list[int] = list(range(rows))  # runner row of each running row
        self._width = 0  # nodes per row of the pending trees
        self._index = None  # (key, the running rows on the device): `running_index`

    @property
    def captures(self) -> int:
        """CUDA graphs the runner has captured."""
        return self.runner.captures

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                chunked: bool = False, past: CommittedState | None = None, **prompt_inputs):
        """The left-padded prompts [B, L]: one eager forward, exactly as stock generate runs them (with `past`, one
        row's committed state of its first `past.length` tokens, only the rest; `prompt_inputs`, a multimodal
        prompt's inputs), or (`chunked`) `prefill_chunked`. Returns what the model's forward returns (logits
        [B, 1, V]; the hidden states the drafter reads, indexed by layer)."""
        if chunked:
            return self.prefill_chunked(input_ids, attention_mask)
        out = prompt_forward(self.model, self.cache, input_ids, attention_mask, positions, past,
                             bool(self.hidden_layers) or self.all_hidden, **prompt_inputs)
        if self.offsets is not None:
            self.runner.set_position_offsets(self.offsets)
        self.runner.set_prompt_mask(attention_mask)
        self.runner.capture_all(input_ids.shape[1])
        self.valid = attention_mask.sum(-1).tolist()
        self._lengths = [input_ids.shape[1]] * input_ids.shape[0]
        self._roots = list(self.valid)
        self.slots = input_ids.shape[1]
        return out

    def prefill_chunked(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PrefillOutputs:
        """Each row's prompt (without its left padding) as chains through the captured verify forward, the widest
        bucket's worth of tokens per forward (`PREFILL_CHUNK` or more: `engine.batch` captures a bucket that wide for
        it), every chain committed, from an empty state: a few graph replays where
        an eager forward of the model launches every kernel from Python. The cache then holds each row's tokens from
        slot 0 (no padding). A runner whose buffers do not exist yet gets them from a one-token forward first
        (`start_empty`). Returns each row's logits at its last prompt token [B, 1, V] and, for the runner's hidden
        layers, the prompt's hidden states [B, L, H] laid out left-padded as the eager forward's."""
        runner = self.runner
        rows, width = input_ids.shape
        if buffers_missing(self.cache):
            self.start_empty()
        zero_states(self.cache)  # every row an empty sequence
        runner.key_valid.fill_(True)
        # Host-side layout, once: each row's prompt left-aligned ([R, P]; row b's tokens in columns < n_b). Every row
        # takes the same columns per chunk (all start at 0 and take up to the chunk's width), so a chunk is a slice of
        # it, and the hidden states' scatter back into the left-padded layout one indexed copy per layer.
        counts = attention_mask.sum(-1).to("cpu")
        lengths = counts.tolist()
        longest = max(lengths)
        columns = torch.arange(longest)
        real = columns[None] < counts[:, None]  # [R, P]
        source = (width - counts)[:, None] + columns[None]
        prompts = input_ids.to("cpu").gather(1, source.clamp(max=width - 1)).masked_fill(~real, 0)
        chunk = max(runner.buckets)
        logits: torch.Tensor | None = None
        hidden: list[torch.Tensor] = []
        if self.hidden_layers:
            size = self.model.config.get_text_config().hidden_size
            hidden = [torch.zeros(rows, width, size, dtype=self.model.dtype, device=self.model.device)
                      for _ in self.hidden_layers]
        for start in range(0, longest, chunk):
            w = min(chunk, longest - start)
            takes = (counts - start).clamp(0, w)  # [R]
            on = real[:, start : start + w]
            tokens = prompts[:, start : start + w]
            parent = torch.where(on, torch.arange(w) - 1, -1)
            fed = [min(n, start) for n in lengths]
            out = runner.forward(tokens, parent, fed, fed)
            ending = ((counts > start) & (counts <= start + w)).nonzero().flatten()
            if len(ending):  # rows whose last prompt token is in this chunk: its logits (the buffer is replayed over)
                if logits is None:
                    logits = out.new_empty(rows, 1, out.shape[-1])
                at = (counts[ending] - start - 1).to(out.device)
                ending = ending.to(out.device)
                logits[ending, 0] = out[ending, at]
            if hidden:  # right-aligned as the padded prompt's: row b's token i at column width - n_b + i
                row, node = on.nonzero(as_tuple=True)
                column = (width - counts[row] + start + node).to(self.model.device)
                row, node = row.to(self.model.device), node.to(self.model.device)
                for states, layer in zip(hidden, runner.hidden()):
                    states[row, column] = layer[row, node]
            runner.commit(torch.where(takes > 0, takes - 1, -1).tolist(), min(longest, start + w))
        self.valid = list(lengths)
        self._lengths, self._roots = list(lengths), list(lengths)
        self._rows = list(range(rows))
        self.slots = max(lengths)
        return PrefillOutputs(logits=logits, hidden_states=dict(zip(self.hidden_layers, hidden)))

    def forward(self, tree: VerifyTree) -> VerifyOutputs:
        rows = self.runner.rows
        width = self._width = tree.num_nodes
        every = self._rows == list(range(rows))
        if every and tree.tokens.device.type != "cpu":  # a drafter's device tree: copied on the device
            logits = self.runner.forward_device(tree.tokens, tree.parent, self._lengths, self._roots)
        elif every:
            logits = self.runner.forward(tree.tokens.cpu(), tree.parent.cpu(), self._lengths, self._roots)
        else:  # rows not running: lone nodes, nothing committed
            tokens = torch.zeros(rows, width, dtype=torch.long)
            parent = torch.full((rows, width), -1, dtype=torch.long)
            index = torch.tensor(self._rows, dtype=torch.long)
            tokens[index] = tree.tokens.cpu()
            parent[index] = tree.parent.cpu()
            logits = self.runner.forward(tokens, parent, self._lengths, self._roots)
        hidden = self.runner.all_hidden_states() if self.all_hidden else None
        if not every:  # rows left, or joined out of slot order (serving)
            index = self.running_index(logits.device)
            logits = logits.index_select(0, index)
            hidden = None if hidden is None else tuple(h.index_select(0, index) for h in hidden)
        return VerifyOutputs(logits=logits[:, :width],
                             hidden_states=None if hidden is None else tuple(h[:, :width] for h in hidden))

    def commit(self, paths: list[list[int]]) -> BatchHidden | None:
        check_paths(paths, self._width)  # (the runner commits whatever leaf it is given)
        hidden = None
        if self.hidden_layers:
            # Each running row's path, gathered from the forward's hidden states (the runner's rows, bucket width n).
            states = self.runner.hidden()
            n = states[0].shape[1]
            hidden = gather_paths(states, paths, [row * n for row in self._rows], self.hidden_layers)
        leaves = [-1] * self.runner.rows
        for row, path in zip(self._rows, paths):
            leaves[row] = path[-1]
            self._lengths[row] += len(path)
            self._roots[row] += len(path)
        self.valid = [v + len(p) for v, p in zip(self.valid, paths)]
        self.slots = max(self._lengths)
        self.runner.commit(leaves, self.slots)
        return hidden

    # ---- the pipelined step (`engine.pipeline`): every runner row at once, trees and leaves on the device
    def forward_device(self, tokens: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
        """The verify forward of every runner row's tree ([R, w] on the device; rows not running get lone roots that
        commit nothing). Returns the logits [R, n, V] (the bucket's)."""
        return self.runner.forward_device(tokens, parent, self._lengths, self._roots)

    def forward_filled(self, width: int) -> torch.Tensor:
        """The verify forward of the trees already in the runner's bucket for `width` (`engine.step_graphs`)."""
        return self.runner.forward_filled(width, self._lengths, self._roots)

    def commit_device(self, leaves: torch.Tensor) -> None:
        self.runner.commit_device(leaves)

    def finish_commit(self, counts: list[int]) -> None:
        """After `commit_device`: runner row r committed `counts[r]` tokens (0: none)."""
        for row, count in enumerate(counts):
            self._lengths[row] += count
            self._roots[row] += count
        self.valid = [v + counts[row] for v, row in zip(self.valid, self._rows)]
        self.slots = max(self._lengths)
        self.runner.finish_commit(self.slots)

    def retract(self, slot: int) -> None:
        """Runner row `slot` committed one token less than its last step was counted for (a plain step queued ahead
        that held it back on the device, `engine.plain.queue_plain_step`): its length goes back by one."""
        self._lengths[slot] -= 1
        self._roots[slot] -= 1
        if slot in self._rows:
            self.valid[self._rows.index(slot)] -= 1

    def select_rows(self, rows: list[int]) -> None:
        self._rows = [self._rows[r] for r in rows]
        self.valid = [self.valid[r] for r in rows]

    # ---- slots (continuous batching): rows join a running batch between steps
    def start_empty(self) -> None:
        """Make every slot's buffers exist (a one-token forward of every row) with no row running, and capture the
        buckets; rows then join with `admit`."""
        rows = self.runner.rows
        zeros = torch.zeros(rows, 1, dtype=torch.long, device=self.model.device)
        forward_tokens(self.model, zeros, self.cache, position_ids=zeros, attention_mask=torch.ones_like(zeros),
                       logits_to_keep=1)
        self.runner.set_prompt_mask(torch.ones_like(zeros))
        self.runner.capture_all(1)
        self._rows, self.valid = [], []
        self._lengths, self._roots = [0] * rows, [0] * rows
        self.slots = 1

    def admit(self, slot: int, state: CommittedState | None) -> None:
        """Row `slot` (not running) starts a sequence from `state`, its prompt's committed state without padding, or
        from nothing (None: zero recurrent and conv states, no keys: its first tree's root is its first token); it
        runs from the next forward, last among the running rows."""
        if slot in self._rows:
            raise ValueError(f"slot {slot} is running")
        if state is None:
            zero_states(self.cache, slot)
            length = 0
        else:
            import_committed(self.cache, state, row=slot)
            length = state.length
        self.runner.key_valid[slot].fill_(True)
        self._lengths[slot] = self._roots[slot] = length
        self._rows.append(slot)
        self.valid.append(length)
        self.slots = max(self.slots, length)

    def export_row(self, row: int) -> CommittedState:
        """A copy of running row `row`'s committed state (its slot's first `valid` tokens)."""
        return export_committed(self.cache, row=self._rows[row], length=self._lengths[self._rows[row]])

    @property
    def running_slots(self) -> list[int]:
        return list(self._rows)

    def running_index(self, device: torch.device) -> torch.Tensor:
        """The running rows' runner rows [R] on `device`, kept until they change (requests join or leave): a step
        that made it from a list copied it from pageable memory, which waits for the forward the step had just
        queued."""
        key = (tuple(self._rows), str(device))
        if self._index is None or self._index[0] != key:
            index = torch.tensor(self._rows, dtype=torch.long)
            if torch.device(device).type == "cuda":  # pinned: the copy is queued, not waited for
                index = index.pin_memory()
            self._index = (key, index.to(device, non_blocking=True))
        return self._index[1]

    def abort(self) -> None:
        self.runner.abort()

    def release(self) -> None:
        if self._owns_lease:
            release_runner(self.model, self.runner)
