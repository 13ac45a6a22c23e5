"""The cost model of Hybrid Verified Decoding: seconds per step of drafting and verifying, profiled on the machine.

A step costs the cache drafter's proposal (always made: it is what the policy reads), the model drafter's proposal
when it runs, and one verify forward of the chosen tree, whose time depends on the tree size N (root included):

    step_seconds(option) = cache_draft + [model ran] * (model_draft + model_overhead) + verify(N)

where `model_overhead` is what the model drafter must do before it can draft: its begin (EAGLE: a pass over the
context) on its first draft of a request, and the accept of the tokens committed since it last drafted. HVD hands
it those as one accept right before it drafts: after one step, a step's few tokens (`model_accept_seconds`); after
skipped steps, many (`model_catch_up_seconds`: an EAGLE accept past its fixed shapes runs eagerly, like a begin).

`hvd.profiling.profile_costs` measures these through the real decoding loop. Profiles are cached per process by
target, device, dtype and model drafter (`cached_profile`), and save to / load from JSON.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import asdict, dataclass, field

from torch import nn

from ..drafters.base import Drafter

__all__ = ["CostProfile", "cached_profile", "clear_profile_cache", "profile_key"]


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
