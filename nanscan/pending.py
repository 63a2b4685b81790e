"""Scans launched without waiting for them, and the Monitor's history ring.

A pending scan (nanscan.stats.PendingScan) gives its flag at once (`found_inf`), says without blocking whether it
has finished (`ready()`) and waits only when its records are asked for (`records()`). There are two kinds:

- CompletedScan: a scan that ran on the host (CPU tensors, or a backend without an asynchronous path, such as the
  reference backend on a GPU). There is nothing to wait for.
- nanscan._cuda_backend.AsyncScan: the CUDA kernel enqueued on the current stream. Nothing has waited for it.

`launch` returns a StepScan with one such part per device. Monitor(mode="async") reads each step's verdict one
step later through the same calls for both kinds, so the CPU tests run the code path that a GPU takes. Only the
flag copy to pinned memory and its event (HistoryRing) are specific to the GPU.

NOTE: [history ring]
The Monitor keeps its last `size` steps as references to each step's records, where the scan left them: the
numpy array a host scan returned, or the int64 tensor a GPU scan wrote on the device. Nothing is copied per step
(a copy of a few hundred KiB into a preallocated ring cost more than the scan of a small model), and nothing
leaves the GPU: a step's slot is simply replaced `size` steps later. On a GPU, each step copies only its verdict
flag (4 bytes) to pinned host memory and records an event after it. Reading the history (Monitor.history, a
bundle) copies each kept step to the host once, after the event its scan recorded (the scan may have run on
another stream than the reader's). Memory stays at size x tensors x 264 x 8 bytes however long the
run is. Host records are made read-only when the scan returns them, because the report handed to the caller and
the history share the array.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from nanscan import _layout as L
from nanscan import backends
from nanscan.inputs import ScanInput, as_scan_inputs
from nanscan.stats import PendingScan, ScannedTensor, ScanReport


class CompletedScan:
    """A scan that already ran on the host: its records are known, so nothing waits."""

    def __init__(self, records: np.ndarray, nonfinite: bool | None = None):
        records.setflags(write=False)  # shared by the report and the history (NOTE: [history ring])
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


def completed_scan(tensors: tuple[ScannedTensor, ...], records: np.ndarray, nonfinite: bool | None,
                   backend: str) -> StepScan:
    """The StepScan of a scan that one host backend already ran over all of a check's inputs."""
    return StepScan(tensors, [ScanPart(None, CompletedScan(records, nonfinite))], backend, on_host=True)


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
        chosen = backend[device] if isinstance(backend, dict) else \
            select_for_part(torch.device(device), backend, mixed=len(groups) > 1)
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


class RingEntry(NamedTuple):
    """What the ring keeps about one step besides its records. `loss` and `lr` are floats, None, or 0-dim tensor
    copies on the GPU, read only when the history is read."""

    step: int
    tensors: tuple[ScannedTensor, ...]  # shared with the step's report (ScanReport keeps a tuple), not copied
    skipped: tuple[str, ...]
    backend: str
    loss: Any
    lr: Any


# What the ring keeps of one device's part of a step: its rows (None: all), its records (a host array or a device
# tensor) and, for a device tensor, the event recorded after the scan that wrote it.
KeptPart = tuple[np.ndarray | None, Any, Any]


def _host_records(num_tensors: int, parts: list[KeptPart]) -> np.ndarray:
    """A step's records on the host, in input order, from the parts the ring kept (a copy, never the kept array).
    A device part is copied after its scan's event: the scan may have run on another stream than the reader's."""
    def host(records: Any, done: Any) -> np.ndarray:
        if not isinstance(records, torch.Tensor):
            return np.array(records)
        if done is not None:
            done.synchronize()
        return records.cpu().numpy()

    if len(parts) == 1 and parts[0][0] is None:
        return host(parts[0][1], parts[0][2])
    out = L.empty_records(num_tensors)
    for rows, records, done in parts:
        out[rows] = host(records, done)
    return out


class HistoryRing:
    """The last `size` steps' records and scalars, kept by reference (NOTE: [history ring])."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"history={size!r}: keep at least 1 step (the failing one)")
        self.size = size
        # Per slot: what the step was, and its records per device (KeptPart).
        self._slots: list[tuple[RingEntry, list[KeptPart]] | None] = [None] * size
        self._count = 0  # steps appended so far; the newest is in slot (_count - 1) % size
        self._flags: torch.Tensor | None = None  # pinned float32 [size]: each slot's verdict flag, for GPU scans
        self._events: list[torch.cuda.Event] = []

    @property
    def nbytes(self) -> int:
        """Bytes of records kept (at most size x tensors x 264 x 8)."""
        return sum(records.nbytes for kept in self._slots if kept is not None for _, records, _ in kept[1])

    @property
    def device(self) -> torch.device | None:
        """Where the newest step's records are (the first device's part)."""
        if self._count == 0:
            return None
        records = self._slots[(self._count - 1) % self.size][1][0][1]
        return records.device if isinstance(records, torch.Tensor) else torch.device("cpu")

    def __len__(self) -> int:
        return min(self._count, self.size)

    def append(self, step: int, scan: StepScan, tensors: Sequence[ScannedTensor], skipped: Sequence[str], *,
               loss: Any = None, lr: Any = None, verdict: bool = False) -> int:
        """Keep one step in the next slot (the oldest step's) and return the slot. verdict=True also copies the
        scan's flag to pinned host memory (GPU scans) for `verdict(slot)`."""
        slot = self._count % self.size
        parts = []
        for rows, part_scan in scan.parts:
            if isinstance(part_scan, CompletedScan):
                parts.append((rows, part_scan.records(), None))
            else:
                parts.append((rows, part_scan.device_records, part_scan.done_event))
        if verdict and not scan.on_host:
            flag = scan.found_inf
            if self._flags is None:
                self._flags = torch.zeros(self.size, dtype=torch.float32, pin_memory=True)
                self._events = [torch.cuda.Event() for _ in range(self.size)]
            self._flags[slot].copy_(flag, non_blocking=True)
            self._events[slot].record(torch.cuda.current_stream(flag.device))
        return self._keep(RingEntry(step, tuple(tensors), tuple(skipped), scan.backend, loss, lr), parts)

    def append_host(self, step: int, tensors: tuple[ScannedTensor, ...], records: np.ndarray,
                    skipped: tuple[str, ...], backend: str, *, loss: Any = None, lr: Any = None) -> int:
        """append() for a step whose records one host scan returned (ModelScanPlan.scan_on_host): no StepScan."""
        records.setflags(write=False)  # shared by the step's report and the history (NOTE: [history ring])
        return self._keep(RingEntry(step, tensors, skipped, backend, loss, lr), [(None, records, None)])

    def _keep(self, entry: RingEntry, parts: list[KeptPart]) -> int:
        """Store a step in the next slot (the oldest step's) and return the slot."""
        slot = self._count % self.size
        self._slots[slot] = (entry, parts)
        self._count += 1
        return slot

    def verdict(self, slot: int, scan: StepScan) -> bool:
        """True when the step stored in `slot` (by append(..., verdict=True)) saw a NaN or an infinity. Waits for
        that step's flag only, not for its records and not for work enqueued after it."""
        if scan.on_host:
            return scan.nonfinite_on_host
        self._events[slot].synchronize()
        return bool(self._flags[slot].item() > 0)  # pinned host memory, written by the GPU before the event

    def entries(self) -> list[tuple[RingEntry, ScanReport]]:
        """Every kept step, oldest first, with a ScanReport that owns a host copy of its records. GPU records are
        copied to the host, which waits for the GPU."""
        count = len(self)
        out = []
        for k in range(count):
            entry, parts = self._slots[(self._count - count + k) % self.size]
            records = _host_records(len(entry.tensors), parts)
            out.append((entry, ScanReport(entry.tensors, records, skipped=entry.skipped, backend=entry.backend,
                                          step=entry.step)))
        return out
