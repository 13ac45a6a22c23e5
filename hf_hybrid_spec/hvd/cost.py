"""The cost model of Hybrid Verified Decoding: seconds per step of drafting and verifying, profiled on the machine.

A step costs the cache drafter's proposal (always made: it is what the policy reads), the model drafter's proposal
when it runs, and one verify forward of the chosen tree, whose time depends on the tree size N (root included):

    step_seconds(option) = cache_draft + [model ran] * (model_draft + model_overhead) + verify(N)

where `model_overhead` is what the model drafter must do before it can draft: its begin (EAGLE: a pass over the
context) on its first draft of a request, and the accept of the tokens committed since it last drafted. HVD hands
it those as one accept right before it drafts: after one step, a step's few tokens (`model_accept_seconds`); after
skipped steps, many (`model_catch_up_seconds`: an EAGLE accept past its fixed shapes runs eagerly, like a begin).

`profile_costs` measures these through the real decoding loop, in one `speculative_generate` call with a profiling
drafter: each step it times one proposal of each drafter, then proposes a random tree of a given size N and times
the loop until the next `accept` (target forward over the tree + verification + commit, as the loop spends it), and
the model drafter's accept of that step.
Profiles are cached per process by target, device, dtype and model drafter (`cached_profile`), and save to / load
from JSON so a machine is profiled once.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from transformers.utils import logging

from ..drafters.base import DraftBudget, Drafter, TargetHidden
from ..tree import DraftTree, empty_draft
from ..verify import VerifyResult

logger = logging.get_logger(__name__)

__all__ = ["CostProfile", "profile_costs", "cached_profile", "clear_profile_cache", "DEFAULT_TREE_SIZES",
           "CATCH_UP_TOKENS"]

DEFAULT_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Tokens of the timed catch-up: about what HVD hands its model drafter after skipping a probe interval (16 steps) of
# agentic text at 3-5 committed tokens per step.
CATCH_UP_TOKENS = 48


@dataclass
class CostProfile:
    """Measured seconds of one step's parts, for one target / model drafter pair on one machine.

    Attributes:
        tree_sizes: verify tree sizes N (root included) that were timed, ascending.
        verify_seconds: per size, one target forward over the tree + verification + commit.
        cache_draft_seconds: one proposal of the cache (suffix) drafter.
        model_draft_seconds: one proposal of the model drafter at its HVD budget.
        key: what was measured (target, device, dtype, drafter); informational.
        model_begin_seconds_per_token / model_begin_seconds: the model drafter's begin (EAGLE: its pass over the
            prompt), paid by its first draft in a request: `model_begin_seconds + per_token x context tokens`
            (`model_begin`). Both 0 in profiles saved before they were measured; the fixed part is 0 in profiles
            saved before it was (their per-token figure was the whole begin divided by a 256-token context, which
            overstates a long context's begin on a GPU, where most of it is fixed).
        model_accept_seconds / model_catch_up_seconds: the model drafter's accept of one step's committed tokens
            (its draft ran the step before), and what `CATCH_UP_TOKENS` tokens at once (it sat out steps) add to its
            accept and next draft (a drafter that feeds missed tokens in `propose` pays there); see the module
            docstring. Both 0 in profiles saved before they were measured.
    """

    tree_sizes: list[int]
    verify_seconds: list[float]
    cache_draft_seconds: float
    model_draft_seconds: float
    key: str = ""
    extra: dict = field(default_factory=dict)
    model_begin_seconds_per_token: float = 0.0
    model_begin_seconds: float = 0.0
    model_accept_seconds: float = 0.0
    model_catch_up_seconds: float = 0.0

    def __post_init__(self):
        sizes = [int(n) for n in self.tree_sizes]
        if not sizes or len(sizes) != len(self.verify_seconds):
            raise ValueError("tree_sizes and verify_seconds must be non-empty and of the same length")
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"tree_sizes must be distinct, ascending and >= 1, got {self.tree_sizes}")
        if any(not s > 0 for s in self.verify_seconds) or self.cache_draft_seconds < 0 or self.model_draft_seconds < 0 \
                or self.model_begin_seconds_per_token < 0 or self.model_begin_seconds < 0 \
                or self.model_accept_seconds < 0 or self.model_catch_up_seconds < 0:
            raise ValueError("profiled seconds must be positive (verify) and >= 0 (drafting)")
        self.tree_sizes = sizes
        self.verify_seconds = [float(s) for s in self.verify_seconds]
        self._steps: dict[tuple[int, bool], float] = {}  # `step` memo: policies ask for the same few every step

    def verify(self, num_nodes: int) -> float:
        """Seconds to verify a tree of `num_nodes` nodes (root included): piecewise linear between the profiled
        sizes, the end segments extended (never below the smallest profiled time)."""
        sizes, secs = self.tree_sizes, self.verify_seconds
        if len(sizes) == 1:
            return secs[0]
        i = min(max(bisect.bisect_left(sizes, num_nodes), 1), len(sizes) - 1)
        n0, n1, s0, s1 = sizes[i - 1], sizes[i], secs[i - 1], secs[i]
        return max(secs[0], s0 + (s1 - s0) * (num_nodes - n0) / (n1 - n0))

    def model_begin(self, context_tokens: int) -> float:
        """Seconds of the model drafter's begin over `context_tokens` committed tokens."""
        return self.model_begin_seconds + self.model_begin_seconds_per_token * context_tokens

    def model_overhead(self, begun: bool, skipped: int, context_tokens: int) -> float:
        """Seconds the model drafter spends before its draft this step (see the module docstring): its begin over
        `context_tokens` unless it has `begun`, and the accept of what was committed since it last drafted,
        `skipped` steps ago (0: it drafted the step before; a begin is always followed by a catch-up over the
        tokens generated since the prompt)."""
        if begun:
            return self.model_accept_seconds if skipped == 0 else self.model_catch_up_seconds
        return self.model_begin(context_tokens) + self.model_catch_up_seconds

    def step(self, draft_nodes: int, model_ran: bool) -> float:
        """Seconds of a step that verifies `draft_nodes` draft nodes (plus the root); the cache drafter always
        proposes, the model drafter when `model_ran`."""
        key = (draft_nodes, model_ran)
        seconds = self._steps.get(key)
        if seconds is None:
            drafting = self.cache_draft_seconds + (self.model_draft_seconds if model_ran else 0.0)
            seconds = self._steps[key] = drafting + self.verify(draft_nodes + 1)
        return seconds

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile:
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostProfile:
        with open(path) as f:
            return cls.from_dict(json.load(f))


class _ProfileDrafter(Drafter):
    """Times a step's parts through the loop: each step it times one proposal of each drafter, then proposes a random
    tree of the next size in `sizes` (random tokens are rejected, so the full size is verified) and times the loop
    from its return to the following `accept`: tree forward, verification, commit. The drafters hear every
    `accept`, so they stay in step with the target (the EAGLE drafter reads the hidden states it asked for)."""

    name = "profile"

    def __init__(self, cache_drafter: Drafter, model_drafter: Drafter, sizes: list[int], steps: int,
                 model_budget: DraftBudget, vocab_size: int, sync):
        self.cache_drafter = cache_drafter
        self.model_drafter = model_drafter
        self.target_hidden_layers = tuple(model_drafter.target_hidden_layers)
        self.sizes = sizes
        self.steps = steps
        self.model_budget = model_budget
        self.vocab = vocab_size
        self.sync = sync
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
            start = time.perf_counter()
            self.model_drafter.begin(ids, context, states)
            self.sync()
            seconds[length] = time.perf_counter() - start
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
                start = time.perf_counter()
                self.model_drafter.accept(input_ids, result, tail)
                self.model_drafter.propose(input_ids, self.model_budget)
                self.sync()
                self.catch_up_and_draft_seconds = time.perf_counter() - start
            self.model_drafter.begin(input_ids, context, hidden)

    def propose(self, input_ids: torch.Tensor, budget: DraftBudget) -> DraftTree:
        if self._step >= self.steps:
            return empty_draft(1, input_ids.device)
        t0 = time.perf_counter()
        self.cache_drafter.propose(input_ids, budget)
        t1 = time.perf_counter()
        self.model_drafter.propose(input_ids, self.model_budget)
        self.sync()
        t2 = time.perf_counter()
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
        self._started = time.perf_counter()
        return tree

    def accept(self, input_ids, result, hidden=None):
        if self._started is not None:
            self.verify.setdefault(self._pending_size, []).append(time.perf_counter() - self._started)
            self._started = None
        self.cache_drafter.accept(input_ids, result, None)
        start = time.perf_counter()
        self.model_drafter.accept(input_ids, result, hidden)
        self.sync()
        self.accept_seconds.append(time.perf_counter() - start)

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
    """
    from ..config import AssistantConfig
    from ..generate import speculative_generate

    device = next(target.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(2, vocab, (1, context_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    sizes = sorted({int(n) for n in tree_sizes})
    steps = len(sizes) * (repeats + 1)
    drafter = _ProfileDrafter(cache_drafter, model_drafter, sizes, steps, DraftBudget(model_tokens, model_depth),
                              vocab, sync)
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


def profile_key(target: nn.Module, model_drafter: Drafter) -> str:
    """Identity of a profile: target, device, dtype, and the model drafter (its class and weights' name)."""
    param = next(target.parameters())
    draft = getattr(model_drafter, "model", None)
    draft_name = getattr(getattr(draft, "config", None), "_name_or_path", "") or type(draft).__name__
    return (f"{getattr(target.config, '_name_or_path', '') or type(target).__name__}|{param.device}|{param.dtype}|"
            f"{type(model_drafter).__name__}:{draft_name}:top_k={getattr(model_drafter, 'top_k', None)}")


_PROFILES: dict[tuple, CostProfile] = {}


def cached_profile(key: tuple, make) -> CostProfile:
    """The process-wide profile for `key`, made by `make()` on first use."""
    profile = _PROFILES.get(key)
    if profile is None:
        profile = _PROFILES[key] = make()
    return profile


def clear_profile_cache() -> None:
    _PROFILES.clear()
