"""Profiling the costs of Hybrid Verified Decoding (`cost.CostProfile`) on this machine, through the real decoding loop.

`profile_costs` runs one `speculative_generate` call with a profiling drafter: each step it times one proposal of
each drafter, then proposes a random tree of a given size N and times the loop until the next `accept` (target
forward over the tree + verification + commit, as the loop spends it), and the model drafter's accept of that step.
It drives the public loop, so it sits above it (with `factory`, which builds HVD drafters with a profile).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from transformers.utils import logging

from ..drafters.base import DraftBudget, Drafter, TargetHidden
from ..tree import DraftTree, VerifyResult, empty_draft
from .cost import CostProfile, profile_key

logger = logging.get_logger(__name__)

__all__ = ["profile_costs", "DEFAULT_TREE_SIZES", "CATCH_UP_TOKENS"]

DEFAULT_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Tokens of the timed catch-up: about what HVD hands its model drafter after skipping a probe interval (16 steps) of
# agentic text at 3-5 committed tokens per step.
CATCH_UP_TOKENS = 48


class _ProfileDrafter(Drafter):
    """Times a step's parts through the loop: each step it times one proposal of each drafter, then proposes a random
    tree of the next size in `sizes` (random tokens are rejected, so the full size is verified) and times the loop
    from its return to the following `accept`: tree forward, verification, commit. The drafters hear every
    `accept`, so they stay in step with the target (the EAGLE drafter reads the hidden states it asked for)."""

    name = "profile"

    def __init__(self, cache_drafter: Drafter, model_drafter: Drafter, sizes: list[int], steps: int,
                 model_budget: DraftBudget, vocab_size: int, sync, clock):
        self.cache_drafter = cache_drafter
        self.model_drafter = model_drafter
        self.target_hidden_layers = tuple(model_drafter.target_hidden_layers)
        self.sizes = sizes
        self.steps = steps
        self.model_budget = model_budget
        self.vocab = vocab_size
        self.sync = sync
        self.clock = clock
        self.gen = torch.Generator().manual_seed(0)
        self.verify: dict[int, list[float]] = {}
        self.cache_seconds: list[float] = []
        self.model_seconds: list[float] = []
        self._step = 0
        self._started: float | None = None
        self.begin_seconds_per_token = 0.0
        self.begin_seconds = 0.0
        self.accept_seconds: list[float] = []
        self.catch_up_and_draft_seconds = 0.0

    def begin(self, input_ids, context=None, hidden=None):
        self.cache_drafter.begin(input_ids, context, None)
        # The begin timed over the whole context and over its first quarter: a line through the two gives its
        # fixed part (launches, setup) and its per-token part, so a longer context in use is priced right.
        full = input_ids.shape[1]
        short = max(1, full // 4)
        short_hidden = hidden
        if hidden is not None:
            short_hidden = TargetHidden(layers=hidden.layers, states=tuple(h[:, :short] for h in hidden.states))
        seconds = {}
        for length, ids, states in ((short, input_ids[:, :short], short_hidden), (full, input_ids, hidden)):
            self.model_drafter.begin(ids, context, states)  # once untimed: first-call costs (allocator, kernels)
            self.sync()
            start = self.clock()
            self.model_drafter.begin(ids, context, states)
            self.sync()
            seconds[length] = self.clock() - start
        # The drafter ends up begun over the whole context, as the profile's steps need.
        per_token = (seconds[full] - seconds[short]) / (full - short) if full > short else 0.0
        self.begin_seconds_per_token = max(per_token, 0.0)
        self.begin_seconds = max(seconds[full] - self.begin_seconds_per_token * full, 0.0)
        # A catch-up: begun over all but the last k tokens, then one accept of those k (as HVD's `_catch_up_model`
        # hands them over) and the draft after it, timed together (a drafter that feeds the tokens it missed in its
        # next `propose`, as the assistant-model drafter does, catches up there); the steady draft's time is taken
        # off in `profile_costs`. Once untimed, then timed; the last begin leaves the drafter over the whole context.
        k = min(CATCH_UP_TOKENS, full - 1)
        if k >= 1:
            tokens = input_ids[0, full - k :]
            chain = list(range(k + 1))
            result = VerifyResult(path=chain, tokens=tokens, score_nodes=chain[:-1], token_list=tokens.tolist())
            tail = None if hidden is None else TargetHidden(layers=hidden.layers,
                                                            states=tuple(h[:, full - k :] for h in hidden.states))
            head = None if hidden is None else TargetHidden(layers=hidden.layers,
                                                            states=tuple(h[:, : full - k] for h in hidden.states))
            for _ in range(2):
                self.model_drafter.begin(input_ids[:, : full - k], context, head)
                self.sync()
                start = self.clock()
                self.model_drafter.accept(input_ids, result, tail)
                self.model_drafter.propose(input_ids, self.model_budget)
                self.sync()
                self.catch_up_and_draft_seconds = self.clock() - start
            self.model_drafter.begin(input_ids, context, hidden)

    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if self._step >= self.steps:
            return empty_draft(1, input_ids.device)
        t0 = self.clock()
        self.cache_drafter.propose(input_ids, budget)
        t1 = self.clock()
        self.model_drafter.propose(input_ids, self.model_budget)
        self.sync()
        t2 = self.clock()
        self.cache_seconds.append(t1 - t0)
        self.model_seconds.append(t2 - t1)
        size = self.sizes[self._step % len(self.sizes)]
        self._step += 1
        n = min(size - 1, budget.max_nodes)
        depth = max(1, min(budget.max_depth, n))
        # A chain as deep as the budget allows, the remaining nodes as sibling branches off its nodes.
        parents = [j - 1 for j in range(min(n, depth))] + [(j % depth) - 1 for j in range(n - min(n, depth))]
        tokens = torch.randint(2, self.vocab, (1, n), generator=self.gen).to(input_ids.device)
        tree = DraftTree(tokens=tokens, parents=torch.tensor([parents], dtype=torch.long, device=input_ids.device))
        self._pending_size = size
        self._started = self.clock()
        return tree

    def accept(self, input_ids, result, hidden=None):
        if self._started is not None:
            self.verify.setdefault(self._pending_size, []).append(self.clock() - self._started)
            self._started = None
        self.cache_drafter.accept(input_ids, result, None)
        start = self.clock()
        self.model_drafter.accept(input_ids, result, hidden)
        self.sync()
        self.accept_seconds.append(self.clock() - start)

    def end(self, input_ids):
        self.cache_drafter.end(input_ids)
        self.model_drafter.end(input_ids)

    def release(self):
        self.cache_drafter.release()
        self.model_drafter.release()


def profile_costs(
    target: nn.Module,
    cache_drafter: Drafter,
    model_drafter: Drafter,
    model_tokens: int,
    model_depth: int,
    max_depth: int,
    tree_sizes: tuple[int, ...] = DEFAULT_TREE_SIZES,
    context_tokens: int = 256,
    repeats: int = 3,
    compile: bool = False,
    compile_verify: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> CostProfile:
    """Time the parts of a step on this machine, in one `speculative_generate` call (see `_ProfileDrafter`).

    Args:
        target: the target model.
        cache_drafter / model_drafter: fresh drafters of the kinds HVD will combine (used for this profile only;
            the cache drafter must not write to the process-wide suffix cache).
        model_tokens / model_depth: the model drafter's budget; max_depth: the deepest verified tree.
        tree_sizes: verify tree sizes N (root included) to time.
        context_tokens: committed tokens before the timed steps (a random prompt).
        repeats: timed steps per size, after one warm-up round over every size; the median is kept. Verify times
            are then made non-decreasing in N (a larger tree never costs less; noise can say otherwise).
        compile: time the static-cache path (`AssistantConfig(compile=True)`: CUDA-graph replays on a GPU), the one
            HVD will run with; its graphs are captured in the warm-up round.
        compile_verify: with `compile`, the verify forward's pure regions fused by Inductor (as HVD will run them).
        clock: seconds, read around each timed part (`time.perf_counter`; tests pass a clock of their own).
    """
    from ..config import AssistantConfig
    from ..generate import speculative_generate  # the API above the loop, as this module is

    device = next(target.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(2, vocab, (1, context_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    sizes = sorted({int(n) for n in tree_sizes})
    steps = len(sizes) * (repeats + 1)
    drafter = _ProfileDrafter(cache_drafter, model_drafter, sizes, steps, DraftBudget(model_tokens, model_depth),
                              vocab, sync, clock)
    config = AssistantConfig(max_draft_tokens=max(max(sizes) - 1, 1), max_depth=max_depth, compile=compile,
                             compile_verify=compile and compile_verify)
    # The budget's depth shrinks in the last steps of a request: leave room so every timed tree has its full shape.
    target.generate(prompt, do_sample=False, max_new_tokens=steps + max_depth + 1, eos_token_id=None,
                    pad_token_id=1, custom_generate=speculative_generate, drafter=drafter, assistant_config=config)
    verify = []
    for n in sizes:
        verify.append(max(statistics.median(drafter.verify[n][1:]), verify[-1] if verify else 0.0))
    warm = len(sizes)
    model_draft = statistics.median(drafter.model_seconds[warm:])
    profile = CostProfile(
        tree_sizes=sizes,
        verify_seconds=verify,
        cache_draft_seconds=statistics.median(drafter.cache_seconds[warm:]),
        model_draft_seconds=model_draft,
        key=profile_key(target, model_drafter),
        model_begin_seconds_per_token=drafter.begin_seconds_per_token,
        model_begin_seconds=drafter.begin_seconds,
        # (accepts[0] is the prefill token's, before any timed step)
        model_accept_seconds=statistics.median(drafter.accept_seconds[warm + 1:] or drafter.accept_seconds),
        model_catch_up_seconds=max(drafter.catch_up_and_draft_seconds - model_draft, 0.0),
    )
    verify = dict(zip(profile.tree_sizes, [round(s, 5) for s in profile.verify_seconds]))
    logger.info("HVD cost profile %s: verify %s s, cache draft %.2e s, model draft %.2e s, model begin %.2e s + "
                "%.2e s/token, model accept %.2e s, catch-up %.2e s", profile.key, verify, profile.cache_draft_seconds,
                profile.model_draft_seconds, profile.model_begin_seconds, profile.model_begin_seconds_per_token,
                profile.model_accept_seconds, profile.model_catch_up_seconds)
    return profile
