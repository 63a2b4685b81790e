"""Replay entries: how nanscan rebuilds a user's training step from a bundle's config (replay, ablate, preflight).

A replay entry is a function named "package.module:function". It receives the config dict recorded in the bundle
(or given to preflight) and returns a ReplaySpec. The demo registers its own (nanscan.demo:replay_entry).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


@dataclass
class ReplaySpec:
    """Everything needed to run one training step again.

    model: the model, freshly built from the config (weights are then loaded from the bundle's state).
    optimizer: an optimizer over model's parameters, or a factory `optimizer(model) -> Optimizer`.
    step_fn: `step_fn(model, batch) -> loss` (forward only; nanscan calls backward and the optimizer itself).
    batches: optional healthy batches (e.g. for preflight and for confirming an ablation on held-out data).
    select_samples: optional `select_samples(batch, indices) -> batch` that keeps only the given sample rows;
        when absent, nanscan slices every tensor in the batch along dimension 0.
    """

    model: torch.nn.Module
    optimizer: Any
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: Iterable[Any] | None = None
    select_samples: Callable[[Any, list[int]], Any] | None = None
    extras: dict = field(default_factory=dict)

    def make_optimizer(self) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return self.optimizer
        return self.optimizer(self.model)


class EntryError(ValueError):
    """A replay entry that cannot be found or does not return a ReplaySpec."""


def load_entry(target: str) -> Callable[[dict], ReplaySpec]:
    """The function named by "package.module:function"."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise EntryError(f"replay entry {target!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryError(f"replay entry {target!r}: cannot import {module_name!r} ({exc}); "
                         "is the package installed, or the directory on PYTHONPATH?") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise EntryError(f"replay entry {target!r}: module {module_name!r} has no attribute {attr!r}") from None


def build_spec(target: str, config: dict | None) -> ReplaySpec:
    """Call the entry with the config and check what it returns."""
    spec = load_entry(target)(dict(config or {}))
    if not isinstance(spec, ReplaySpec):
        raise EntryError(f"replay entry {target!r} returned {type(spec).__name__}, expected nanscan.entry.ReplaySpec")
    return spec
