"""nanscan.check(model): the every-step call without a Monitor of one's own, backed by a default Monitor per model
(held weakly: it lives exactly as long as the model)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from nanscan.runtime.monitor import Monitor
from nanscan.engine.stats import ScanReport

_default_monitors: "weakref.WeakKeyDictionary[torch.nn.Module, Monitor]" = weakref.WeakKeyDictionary()


def default_monitor(model: torch.nn.Module, *, create: bool = True) -> Monitor | None:
    """The Monitor that nanscan.check(model) uses: on_invalid="warn", bundles in $NANSCAN_BUNDLE_DIR (else
    "nanscan-bundles"), history of 64 steps. It holds the model weakly, so it lives exactly as long as the model."""
    monitor = _default_monitors.get(model)
    if monitor is None and create:
        monitor = Monitor(model, on_invalid="warn")
        monitor._model = None  # weak only: the dictionary's value must not keep its key alive
        _default_monitors[model] = monitor
    return monitor


def check(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
          backend=None, scaler: Any = None) -> ScanReport:
    """The every-step call: scan the model's parameters, gradients and (given an optimizer) its state, and the
    parameters it trains outside the model.

    Steps are counted per model when `step` is not given; the first step with a non-finite value is remembered
    and returned by `first_invalid(model)`. Behind it is a default nanscan.Monitor per model (see
    nanscan.runtime.default.default_monitor): the first non-finite step also writes an evidence bundle to
    $NANSCAN_BUNDLE_DIR (default "nanscan-bundles") and issues a NonFiniteWarning; use a Monitor directly to
    include the batch and loss, raise instead, or choose the bundle directory. On a GPU the default Monitor
    checks asynchronously (no host sync): the verdict for a step arrives with the next call, still naming the
    step, so `first_invalid(model)` is set one call later than on the CPU. `scaler`: the torch.amp.GradScaler of
    a mixed-precision loop, whose overflow skips are then expected (see nanscan.runtime.monitor's module docstring).
    """
    monitor = default_monitor(model)
    monitor.optimizer = optimizer
    monitor.backend = backend
    monitor.scaler = scaler
    return monitor.check(step=step)


def first_invalid(model: torch.nn.Module) -> int | None:
    """The first step at which `check(model)` saw a NaN or infinity, or None."""
    monitor = default_monitor(model, create=False)
    return None if monitor is None else monitor.first_invalid_step
