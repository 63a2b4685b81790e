"""The scan entry points: `scan(tensors)` for any set of tensors and `check(model)` for the every-step call."""

from __future__ import annotations

from typing import Any, Callable

import torch

from nanscan.inputs import InputCache, ScanInput, prepare, prepare_all
from nanscan.pending import launch
from nanscan.stats import ScanReport


def scan_inputs(inputs: list[ScanInput], *, skipped=(), backend=None, step: int | None = None) -> ScanReport:
    """Scan prepared inputs and wait for the result; tensors on different devices go to each device's backend in
    one call per device (nanscan.pending.launch, which the Monitor uses without waiting)."""
    started = launch(inputs, backend=backend)
    return ScanReport([item.identity for item in inputs], started.records(), skipped=skipped,
                      backend=started.backend, step=step)


def scan(tensors: Any, *, backend=None) -> ScanReport:
    """Scan tensors for NaN/inf/zero/subnormal counts, abs min/max, sum of squares and exponent histograms.

    `tensors`: a tensor, a list of tensors, a dict name -> tensor, (name, tensor) pairs, or a module (its
    parameters and buffers). Integer and bool tensors are listed in `report.skipped`. Tensors are read in place.
    `backend`: "cpu", "numba", "cuda", "reference", a backend object, or None (NANSCAN_BACKEND, then auto).
    """
    inputs, skipped = prepare_all(tensors)
    return scan_inputs(inputs, skipped=skipped, backend=backend)


def _whole(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    return t, ""


def model_inputs(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 shard: Callable[[torch.Tensor], tuple[torch.Tensor, str]] = _whole,
                 cache: InputCache | None = None) -> list[ScanInput]:
    """`param:<name>`, `grad:<name>` and `optim:<name>.<key>` inputs for a model (and its optimizer).

    `shard(t) -> (local tensor, name suffix)` picks what this process holds of each tensor; nanscan.distributed
    passes one that scans FSDP2 shards locally and names them `param:<name>@shard<i>/<n>`. `cache` (the Monitor
    keeps one) skips re-preparing tensors already seen at an earlier step.
    """
    inputs: list[ScanInput] = []
    names: dict[int, str] = {}

    def add(kind: str, name: str, t: torch.Tensor, key: str = "") -> None:
        item = cache.get(t) if cache is not None else None
        if item is None:
            local, suffix = shard(t)
            item = prepare(f"{kind}:{name}{suffix}{key}", local)
            if item is None:
                return
            if cache is not None:
                cache.put(t, item)
        inputs.append(item)

    for name, p in model.named_parameters():
        names[id(p)] = name
        add("param", name, p)
        if p.grad is not None:
            add("grad", name, p.grad)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                pname = names.get(id(p), f"<unnamed {tuple(p.shape)}>")
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
                        add("optim", pname, value, f".{key}")
    return inputs


def check(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
          backend=None) -> ScanReport:
    """The every-step call: scan the model's parameters, gradients and (given an optimizer) its state.

    Steps are counted per model when `step` is not given; the first step with a non-finite value is remembered
    and returned by `first_invalid(model)`. Behind it is a default nanscan.Monitor per model (see
    nanscan.monitor.default_monitor): the first non-finite step also writes an evidence bundle to
    $NANSCAN_BUNDLE_DIR (default "nanscan-bundles") and issues a NonFiniteWarning; use a Monitor directly to
    include the batch and loss, raise instead, or choose the bundle directory. On a GPU the default Monitor
    checks asynchronously (no host sync): the verdict for a step arrives with the next call, still naming the
    step, so `first_invalid(model)` is set one call later than on the CPU.
    """
    from nanscan.monitor import default_monitor  # noqa: PLC0415 - nanscan.monitor imports this module

    monitor = default_monitor(model)
    monitor.optimizer = optimizer
    monitor.backend = backend
    return monitor.check(step=step)


def first_invalid(model: torch.nn.Module) -> int | None:
    """The first step at which `check(model)` saw a NaN or infinity, or None."""
    from nanscan.monitor import default_monitor  # noqa: PLC0415

    monitor = default_monitor(model, create=False)
    return None if monitor is None else monitor.first_invalid_step
