"""The scan entry points: `scan(tensors)` for any set of tensors, `scan_inputs` for prepared ones and
`model_inputs` for a model's. The data flows one way: nanscan.engine.inputs prepares, nanscan.engine.dispatch sends each
device's inputs to its backend, the records come back (nanscan.engine.pending) and become a
nanscan.engine.stats.ScanReport."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from nanscan.engine.dispatch import launch
from nanscan.engine.inputs import ScanInput, ScanInputs, as_scan_inputs, prepare_all
from nanscan.engine.plans import ModelScanPlan, whole_tensor
from nanscan.engine.stats import ScanReport


def scan_inputs(inputs: Sequence[ScanInput], *, skipped=(), backend=None, step: int | None = None) -> ScanReport:
    """Scan prepared inputs and wait for the result; tensors on different devices go to each device's backend in
    one call per device (nanscan.engine.dispatch.launch, which the Monitor uses without waiting)."""
    inputs = as_scan_inputs(inputs)
    started = launch(inputs, backend=backend)
    return ScanReport(inputs.identities, started.records(), skipped=skipped, backend=started.backend, step=step)


def scan(tensors: Any, *, backend=None) -> ScanReport:
    """Scan tensors for NaN/inf/zero/subnormal counts, abs min/max, sum of squares and exponent histograms.

    `tensors`: a tensor, a list of tensors, a dict name -> tensor, (name, tensor) pairs, or a module (its
    parameters and buffers); numpy arrays are read as tensors. Integer and bool tensors are listed in
    `report.skipped`. Tensors are read in place.
    `backend`: "cpu", "numba", "cuda", "reference", a backend object, or None (NANSCAN_BACKEND, then auto).
    """
    inputs, skipped = prepare_all(tensors)
    return scan_inputs(inputs, skipped=skipped, backend=backend)


def model_inputs(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 shard: Callable[[torch.Tensor], tuple[torch.Tensor, str]] = whole_tensor) -> ScanInputs:
    """`param:<name>`, `grad:<name>` and `optim:<name>.<key>` inputs for a model (and its optimizer), once; the
    Monitor keeps a ModelScanPlan instead, which prepares them again only when they change.

    `shard(t) -> (local tensor, name suffix)` picks what this process holds of each tensor; nanscan.runtime.distributed
    passes one that scans FSDP2 shards locally and names them `param:<name>@shard<i>/<n>`.
    """
    return ModelScanPlan(shard).inputs(model, optimizer)
