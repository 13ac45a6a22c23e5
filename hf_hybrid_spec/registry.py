"""Registries of drafters and verification rules: the names an `AssistantConfig` may use, and how each is built.

A drafter is registered as `name -> factory(config, target, draft_model) -> Drafter`, a verification rule as
`name -> factory(config, do_sample, drafter) -> Verifier`. The loop builds both through these tables, so a new one
is one new file plus one registration line, and no layer below the factory imports it:

    from hf_hybrid_spec.registry import register_drafter

    class MyDrafter(Drafter): ...
    register_drafter("mine", lambda config, target, draft_model: MyDrafter())
    AssistantConfig(drafter="mine")   # now valid

The built-in entries name their factories as "module:function" strings, imported when the entry is first used:
importing the registry (and `AssistantConfig`, which validates names against it) imports none of them.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Registry", "DRAFTERS", "VERIFICATIONS", "register_drafter", "register_verification"]


@dataclass
class _Entry:
    factory: Callable | str  # a callable, or "module:function" imported on first use
    takes_draft_model: bool = False  # drafters: whether `draft_model=` is this drafter's input
    # drafters: `factory(config, target, draft_model, rows) -> BatchDrafter` for a batch of `rows`, when the drafter
    # has a batched form (one drafter for all rows); None: a batch gets one drafter per row.
    batch_factory: Callable | str | None = None


class Registry:
    """Names -> factories, for one kind of component (see the module docstring)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def register(self, name: str, factory: Callable | str, *, takes_draft_model: bool = False,
                 batch_factory: Callable | str | None = None, replace: bool = False) -> None:
        """Register `factory` under `name`; `replace=True` to override an earlier registration."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        for f in (factory, batch_factory):
            if f is not None and not (callable(f) or (isinstance(f, str) and ":" in f)):
                raise ValueError(f"a {self.kind} factory must be a callable or 'module:function', got {f!r}")
        if factory is None:
            raise ValueError(f"a {self.kind} factory must be a callable or 'module:function', got None")
        with self._lock:
            if name in self._entries and not replace:
                raise ValueError(f"{self.kind} {name!r} is already registered (pass replace=True to override it)")
            self._entries[name] = _Entry(factory, takes_draft_model, batch_factory)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def takes_draft_model(self, name: str) -> bool:
        return self._entry(name).takes_draft_model

    def get(self, name: str) -> Callable:
        """The factory registered as `name` (imported now if it was named by a string)."""
        entry = self._entry(name)
        entry.factory = _load(entry.factory)
        return entry.factory

    def get_batch(self, name: str) -> Callable | None:
        """The batch factory registered with `name` (imported now), or None when it has none."""
        entry = self._entry(name)
        if entry.batch_factory is not None:
            entry.batch_factory = _load(entry.batch_factory)
        return entry.batch_factory

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        return entry


def _load(factory: Callable | str) -> Callable:
    if isinstance(factory, str):
        module, function = factory.split(":")
        return getattr(importlib.import_module(module), function)
    return factory


DRAFTERS = Registry("drafter")
VERIFICATIONS = Registry("verification")


def register_drafter(name: str, factory: Callable | str, *, takes_draft_model: bool = False,
                     batch_factory: Callable | str | None = None, replace: bool = False) -> None:
    """Register a drafter: `factory(config, target, draft_model) -> Drafter` (see the module docstring), and where it
    has a batched form `batch_factory(config, target, draft_model, rows) -> drafters.BatchDrafter`."""
    DRAFTERS.register(name, factory, takes_draft_model=takes_draft_model, batch_factory=batch_factory,
                      replace=replace)


def register_verification(name: str, factory: Callable | str, *, replace: bool = False) -> None:
    """Register a verification rule: `factory(config, do_sample, drafter) -> Verifier`."""
    VERIFICATIONS.register(name, factory, replace=replace)


# The built-in entries (their modules register nothing themselves: these lines are their registrations).
register_drafter("suffix", "hf_hybrid_spec.drafters.suffix:from_config")
register_drafter("ngram", "hf_hybrid_spec.drafters.ngram:from_config")
register_drafter("model", "hf_hybrid_spec.drafters.model:from_config", takes_draft_model=True)
register_drafter("eagle", "hf_hybrid_spec.eagle.drafter:from_config", takes_draft_model=True,
                 batch_factory="hf_hybrid_spec.eagle.batch:from_config")
register_drafter("mtp", "hf_hybrid_spec.mtp.drafter:from_config", takes_draft_model=True,
                 batch_factory="hf_hybrid_spec.mtp.batch:from_config")
register_drafter("self_ssm", "hf_hybrid_spec.drafters.self_spec:self_ssm_from_config",
                 batch_factory="hf_hybrid_spec.drafters.self_spec:self_ssm_batch_from_config")
register_drafter("layerskip", "hf_hybrid_spec.drafters.self_spec:layerskip_from_config",
                 batch_factory="hf_hybrid_spec.drafters.self_spec:layerskip_batch_from_config")
register_drafter("hvd", "hf_hybrid_spec.hvd.factory:from_config", takes_draft_model=True)
register_verification("lossless", "hf_hybrid_spec.verification.exact:from_config")
for _rule in ("cospec", "fly", "typical"):
    register_verification(_rule, "hf_hybrid_spec.verification.arbitrated:from_config")
del _rule
