"""The Monitor's history ring: the last N steps' records and scalars, kept where each scan left them.

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
from nanscan.pending import CompletedScan, StepScan
from nanscan.stats import ScannedTensor, ScanReport, Scaling


class RingEntry(NamedTuple):
    """What the ring keeps about one step besides its records. `loss` and `lr` are floats, None, or 0-dim tensor
    copies on the GPU, read only when the history is read. `scaling`: the GradScaler's scale at the check (None
    without one; nanscan.amp)."""

    step: int
    tensors: tuple[ScannedTensor, ...]  # shared with the step's report (ScanReport keeps a tuple), not copied
    skipped: tuple[str, ...]
    backend: str
    loss: Any
    lr: Any
    scaling: Scaling | None = None


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
        # Per slot: whether the step was a GradScaler overflow skip (NOTE: [overflow skips] in nanscan.amp), set
        # once its verdict is read, which in mode="async" is one step after the slot was filled.
        self._overflow_skips = [False] * size
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
               loss: Any = None, lr: Any = None, verdict: bool = False, scaling: Scaling | None = None) -> int:
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
        return self._keep(RingEntry(step, tuple(tensors), tuple(skipped), scan.backend, loss, lr, scaling), parts)

    def append_host(self, step: int, tensors: tuple[ScannedTensor, ...], records: np.ndarray,
                    skipped: tuple[str, ...], backend: str, *, loss: Any = None, lr: Any = None,
                    scaling: Scaling | None = None) -> int:
        """append() for a step whose records one host scan returned (ModelScanPlan.scan_on_host): no StepScan."""
        records.setflags(write=False)  # shared by the step's report and the history (NOTE: [history ring])
        return self._keep(RingEntry(step, tensors, skipped, backend, loss, lr, scaling), [(None, records, None)])

    def _keep(self, entry: RingEntry, parts: list[KeptPart]) -> int:
        """Store a step in the next slot (the oldest step's) and return the slot."""
        slot = self._count % self.size
        self._slots[slot] = (entry, parts)
        self._overflow_skips[slot] = False
        self._count += 1
        return slot

    def mark_overflow_skip(self, slot: int) -> None:
        """Record that the step in `slot` was a GradScaler overflow skip."""
        self._overflow_skips[slot] = True

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
            slot = (self._count - count + k) % self.size
            entry, parts = self._slots[slot]
            records = _host_records(len(entry.tensors), parts)
            out.append((entry, ScanReport(entry.tensors, records, skipped=entry.skipped, backend=entry.backend,
                                          step=entry.step, scaling=entry.scaling,
                                          overflow_skip=self._overflow_skips[slot])))
        return out
