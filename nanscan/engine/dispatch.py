"""Prepared inputs to backends: each device's tensors go to that device's backend in one call, and come back as a
StepScan (nanscan.engine.pending) whose records feed a ScanReport. The one step between inputs and records."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from nanscan.engine import backends
from nanscan.engine.inputs import ScanInput, as_scan_inputs
from nanscan.engine.pending import CompletedScan, ScanPart, StepScan


def launch(inputs: Sequence[ScanInput], *, backend=None) -> StepScan:
    """Scan `inputs` without waiting for any GPU. Each device's tensors go to that device's backend in one call.
    A backend with `scan_async` (CUDA) only enqueues its kernel on the current stream and leaves the records on the
    device. Every other backend scans at once on the host. `backend`: a name, a Backend, None (auto), or a mapping
    from device name to the Backend already chosen for it (select_for_part)."""
    inputs = as_scan_inputs(inputs)
    if len(inputs.devices) == 1:  # the usual case: no grouping, and the inputs' table goes to the backend as it is
        groups = [(inputs.devices[0], None, inputs)]
    else:
        by_device: dict[str, list[int]] = {}
        for i, identity in enumerate(inputs.identities):
            by_device.setdefault(identity.device, []).append(i)
        groups = []
        for device, rows in by_device.items():
            rows = np.asarray(rows, dtype=np.int64)
            groups.append((device, rows, inputs.take(rows)))
    parts, used = [], []
    for device, rows, group in groups:
        if isinstance(backend, dict):
            chosen = backend[device]
        elif backend is None or isinstance(backend, str):
            chosen = select_for_part(torch.device(device), backend, mixed=len(groups) > 1)
        else:  # a Backend, as select() gives it back: no torch.device to make (~15 us a check, in cold caches)
            chosen = backend
        used.append(chosen.name)
        scan_async = getattr(chosen, "scan_async", None)
        if scan_async is not None:
            # The caching allocator orders the reuse of freed memory after the work of the stream that allocated
            # it. The scan runs on the current stream: when that is the default stream, which produced the
            # gradients, their memory is reused only after the scan ran, and holding them (keep_inputs) would keep a
            # step's gradients alive beside the next step's. A check made on a side stream holds them until read.
            index = torch.device(device).index
            side_stream = torch.cuda.current_stream(index) != torch.cuda.default_stream(index)
            scan = scan_async(group, records_to_host=False, keep_inputs=side_stream)
        elif hasattr(chosen, "scan_with_verdict"):  # the native CPU backend: records and verdict in one call
            scan = CompletedScan(*chosen.scan_with_verdict(group))
        else:
            scan = CompletedScan(chosen.scan_records(group))
        parts.append(ScanPart(rows, scan))
    name = "+".join(dict.fromkeys(used)) if used else (backend if isinstance(backend, str) else "")
    return StepScan(inputs.identities, parts, name)


def select_for_part(device: torch.device, backend: Any, *, mixed: bool) -> Any:
    """The backend for one device's inputs. A backend named for a check whose inputs span several devices scans
    those it can; the others (typically AdamW's CPU step counters beside CUDA weights, or a Python-float loss)
    go to the automatic choice, where refusing would fail every check. Inputs on one device keep the error."""
    try:
        return backends.select(device, backend)
    except backends.BackendUnavailable:
        if not mixed:
            raise
        return backends.select(device, "auto")
