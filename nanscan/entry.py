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
        """The optimizer, built by the factory when one was given."""
        optimizer = self.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise EntryError(f"ReplaySpec.optimizer is {type(optimizer).__name__}: give a torch.optim.Optimizer "
                                 "over the model's parameters, or a factory optimizer(model) -> Optimizer")
            optimizer = optimizer(self.model)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise EntryError(f"the ReplaySpec.optimizer factory returned {type(optimizer).__name__}, expected a "
                                 "torch.optim.Optimizer over the model's parameters")
        return optimizer


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
        function = getattr(module, attr)
    except AttributeError:
        raise EntryError(f"replay entry {target!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(function):
        raise EntryError(f"replay entry {target!r} names an object of type {type(function).__name__}, not a function "
                         "taking the config dict and returning a nanscan.entry.ReplaySpec")
    return function


def build_spec(target: str, config: dict | None) -> ReplaySpec:
    """Call the entry with the config and check what it returns."""
    spec = load_entry(target)(dict(config or {}))
    if not isinstance(spec, ReplaySpec):
        raise EntryError(f"replay entry {target!r} returned {type(spec).__name__}, expected nanscan.entry.ReplaySpec")
    # Checked here, so that a wrong field is named now and not met as an AttributeError deep inside a replay.
    wrong = []
    if not isinstance(spec.model, torch.nn.Module):
        wrong.append(f"model is {type(spec.model).__name__}, not a torch.nn.Module")
    if not callable(spec.step_fn):
        wrong.append(f"step_fn is {type(spec.step_fn).__name__}, not a function step_fn(model, batch) -> loss")
    if not (isinstance(spec.optimizer, torch.optim.Optimizer) or callable(spec.optimizer)):
        wrong.append(f"optimizer is {type(spec.optimizer).__name__}, not a torch.optim.Optimizer or a factory "
                     "optimizer(model) -> Optimizer")
    if spec.select_samples is not None and not callable(spec.select_samples):
        wrong.append(f"select_samples is {type(spec.select_samples).__name__}, not a function "
                     "select_samples(batch, indices) -> batch")
    if wrong:
        raise EntryError(f"replay entry {target!r} returned a ReplaySpec whose {'; '.join(wrong)}")
    return spec
