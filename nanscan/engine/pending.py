"""Scans that may still be running: the small piece of the engine that waits.

A pending scan (nanscan.engine.stats.PendingScan) gives its flag at once (`found_inf`), says without blocking whether it
has finished (`ready()`) and waits only when its records are asked for (`records()`). There are two kinds:

- CompletedScan: a scan that ran on the host (CPU tensors, or a backend without an asynchronous path, such as the
  reference backend on a GPU). There is nothing to wait for.
- nanscan.engine.backends.cuda.AsyncScan: the CUDA kernel enqueued on the current stream. Nothing has waited for it.

nanscan.engine.dispatch.launch returns a StepScan with one such part per device. Monitor(mode="async") reads each step's
verdict one step later through the same calls for both kinds, so the CPU tests run the code path that a GPU takes.
Only the flag copy to pinned memory and its event (nanscan.runtime.history.HistoryRing) are specific to the GPU.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine.compact import CompactRecords
from nanscan.engine.stats import PendingScan, ScannedTensor


class CompletedScan:
    """A scan that already ran on the host: its records are known, so nothing waits."""

    def __init__(self, records: np.ndarray, nonfinite: bool | None = None):
        records.setflags(write=False)  # shared (NOTE: [shared records] in nanscan.engine.stats)
        self._records = records
        self._nonfinite = nonfinite  # the backend's verdict, when it gave one with the records
        self._found_inf: torch.Tensor | None = None

    @property
    def nonfinite(self) -> bool:
        if self._nonfinite is None:
            self._nonfinite = L.any_nonfinite(self._records)
        return self._nonfinite

    @property
    def found_inf(self) -> torch.Tensor:
        if self._found_inf is None:  # made on first use: the sync path on CPU rarely asks for it
            self._found_inf = torch.tensor(1.0 if self.nonfinite else 0.0, dtype=torch.float32)
        return self._found_inf

    def ready(self) -> bool:
        return True

    def records(self) -> np.ndarray:
        return self._records


class ScanPart(NamedTuple):
    """The scan of one device's tensors. `rows`: the rows of the step's records that it fills, in order (None:
    all of them). (Tuples: made every step, and cheaper to make than frozen dataclasses.)"""

    rows: np.ndarray | None
    scan: PendingScan


class StepScan:
    """One check's scan, made of one part per device that its tensors are on. It is itself a PendingScan."""

    def __init__(self, tensors: tuple[ScannedTensor, ...], parts: list[ScanPart], backend: str, *,
                 on_host: bool | None = None):
        self.tensors = tensors  # the identities of the scanned tensors, in record order
        self.parts = parts
        self.backend = backend
        # True when every part ran on the host, so the verdict is already known (a caller that knows says so).
        self.on_host = all(isinstance(part.scan, CompletedScan) for part in parts) if on_host is None else on_host
        self._records: np.ndarray | None = None
        self._found_inf: torch.Tensor | None = None

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def nonfinite_on_host(self) -> bool:
        """The verdict of a scan whose parts all ran on the host (see on_host)."""
        if not self.on_host:
            raise RuntimeError("this scan is still running on a GPU; read its verdict through HistoryRing.verdict")
        if len(self.parts) == 1:
            return self.parts[0].scan.nonfinite
        return any(part.scan.nonfinite for part in self.parts)

    @property
    def device(self) -> torch.device:
        """Where the records are: on the first part that runs on a GPU, else on the CPU."""
        for part in self.parts:
            if not isinstance(part.scan, CompletedScan):
                return part.scan.device_records.device
        return torch.device("cpu")

    @property
    def found_inf(self) -> torch.Tensor:
        """1.0 when any part saw a NaN or an infinity, on `device`. Parts on other devices are combined there
        without a host sync (a device-to-device copy, or a flag made on the device from a host verdict)."""
        if self._found_inf is None:
            self._found_inf = self._combined_flag()
        return self._found_inf

    def _combined_flag(self) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0].scan.found_inf
        device, flag, host_nonfinite = self.device, None, False
        for part in self.parts:
            if isinstance(part.scan, CompletedScan):
                host_nonfinite |= part.scan.nonfinite
            else:
                theirs = part.scan.found_inf.to(device, non_blocking=True)
                flag = theirs if flag is None else torch.maximum(flag, theirs)
        if flag is None:
            return torch.tensor(1.0 if host_nonfinite else 0.0, dtype=torch.float32)
        return torch.ones((), dtype=torch.float32, device=device) if host_nonfinite else flag

    @property
    def host_records(self) -> np.ndarray | None:
        """The records if they were read on the host already (records()), else None; never waits."""
        return self._records

    def ready(self) -> bool:
        return self._records is not None or all(part.scan.ready() for part in self.parts)

    def records(self) -> np.ndarray:
        """The records on the host, in input order (waits for every part)."""
        if self._records is None:
            if len(self.parts) == 1 and self.parts[0].rows is None:
                self._records = self.parts[0].scan.records()
            else:
                records = L.empty_records(self.num_tensors)
                for part in self.parts:
                    records[part.rows] = part.scan.records()
                self._records = records
        return self._records


class HostCopy:
    """A step's records (and scalars such as its loss) on their way to the host without waiting for the GPU: for a
    live export that writes step s once its records come back (nanscan.integrations.live).

    Each GPU part's records are copied into pinned host memory on the current stream, after the scan's event
    (the Monitor's scans run on the current stream, so the wait orders nothing new), and an event is recorded
    after the copies. Host parts and host scalars are taken as they are. `ready()` never blocks; `records()` and
    `scalars()` wait for the copies only.
    """

    def __init__(self, scan: StepScan, scalars: tuple = ()):
        self.tensors = scan.tensors
        self._whole = len(scan.parts) == 1 and scan.parts[0].rows is None
        self._parts: list[tuple[np.ndarray | None, Any]] = []
        self._events: list[torch.cuda.Event] = []
        for rows, part in scan.parts:
            if isinstance(part, CompletedScan):
                self._parts.append((rows, part.records()))
                continue
            stream = torch.cuda.current_stream(part.device_records.device)
            if part.done_event is not None:
                stream.wait_event(part.done_event)
            self._parts.append((rows, self._copy(part.device_records, stream)))
        self._scalars = [self._copy(v, None) if isinstance(v, torch.Tensor) and not v.is_cpu else v
                         for v in scalars]

    def _copy(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        stream = stream if stream is not None else torch.cuda.current_stream(tensor.device)
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            pinned.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._events.append(event)
        return pinned

    def ready(self) -> bool:
        return all(event.query() for event in self._events)

    def _wait(self) -> None:
        for event in self._events:
            event.synchronize()
        self._events = []

    def records(self) -> np.ndarray:
        """The step's records on the host, in input order (waits for the copies)."""
        self._wait()
        host = [(rows, r.numpy() if isinstance(r, torch.Tensor) else r) for rows, r in self._parts]
        if self._whole:
            return host[0][1]
        out = L.empty_records(len(self.tensors))
        for rows, records in host:
            out[rows] = records
        return out

    def scalars(self) -> list:
        """The scalars given, GPU tensors among them as host tensors (waits for the copies)."""
        self._wait()
        return list(self._scalars)


class StepSummary(NamedTuple):
    """What a check reads of a host scan's records every step, taken by the call that scanned them (NOTE: [step
    summary] in csrc/plan/plan_check.cpp): their compact form, the gradient rows' sum of squares (added in row
    order), the loss row's (None without a loss) and a one-element loss's value (None where it was not read)."""

    compact: CompactRecords
    grad_sumsq: float
    loss_sumsq: float | None
    loss_value: float | None


class HostScan(NamedTuple):
    """A check's inputs scanned in one host call (nanscan.engine.plans.ModelScanPlan.scan_on_host): no StepScan.
    `summary` is None where the backend gives none."""

    tensors: tuple[ScannedTensor, ...]
    records: np.ndarray
    nonfinite: bool
    backend: str
    summary: StepSummary | None = None


def completed_scan(tensors: tuple[ScannedTensor, ...], records: np.ndarray, nonfinite: bool | None,
                   backend: str) -> StepScan:
    """The StepScan of a scan that one host backend already ran over all of a check's inputs."""
    return StepScan(tensors, [ScanPart(None, CompletedScan(records, nonfinite))], backend, on_host=True)


