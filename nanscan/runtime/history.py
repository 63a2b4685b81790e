"""The Monitor's history ring: the last N steps' records, compacted, and their scalars.

NOTE: [history ring]
The Monitor keeps its last `size` steps, each step's records compacted (NOTE: [compact records] in
csrc/include/nanscan/compact.h): about 75 to 145 bytes per tensor where the dense record is 2120, so a GPT-2-sized
model's 64 steps take a few MiB, not 200. A host scan's records are compacted by nanscan._C when the ring takes
them (a few microseconds: the step's report keeps the dense array the scan returned, the ring copies nothing
else). A GPU scan's are compacted on the device, behind the scan on the same stream (csrc/cuda/compact_cuda.cu):
nothing leaves the GPU and nothing waits for it. The device compaction writes into a buffer of fixed size, made
once per slot (DEVICE_BINS_PER_ROW bins a row on average); whether the step fitted is known only once its scan
has run, so the ring keeps a reference to the dense device records too, until the step's status is back in
pinned host memory (read with the step's verdict, one step later in mode="async", or as soon as its event has
passed): then it drops the dense records if the compact ones fitted, else the compact ones. Each step also copies
its verdict flag (4 bytes) to pinned host memory and records an event after it. Reading the history
(Monitor.history, a bundle) decodes each kept step on the host once; a device step is copied after the event its
compaction recorded (the scan may have run on another stream than the reader's).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine import compact
from nanscan.engine._native import native_function
from nanscan.engine.pending import CompletedScan, StepScan
from nanscan.engine.stats import ScannedTensor, ScanReport, Scaling

# The device compaction's room: this many histogram bins a row on average (NOTE: [history ring]). With the scalars,
# the ranges and the kernels' workspace, 72 + 4 + 24 + 4 x 64 = 356 bytes a tensor-step; a step whose tensors span
# more binades on average keeps its dense records (2120 bytes a tensor) instead, still exact.
DEVICE_BINS_PER_ROW = 64
STATUS_TOTAL, STATUS_FITS = 0, 1  # slots of a device compaction's status (compact.h: kStatusTotal, kStatusFits)


def read_scalar(value: Any) -> float | None:
    """A kept loss or learning rate (kept_scalar) as a float, or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach()) if value.numel() == 1 else None
    return float(value)


def kept_scalar(value: Any, step_inputs: Any = None) -> Any:
    """A loss or learning rate as the history keeps it: a float, or for a GPU scalar a device copy (reading it
    would wait for the GPU; read_scalar reads it when the history is read). `step_inputs`: the check's inputs (a
    nanscan.engine.plans.StepInputs), whose loss is read from host memory for a one-element CPU tensor
    (StepInputs.loss_value), not through .item()."""
    if value is None or type(value) is float:  # the every-step learning rate
        return value
    if isinstance(value, torch.Tensor):
        if not value.is_cpu:
            return value.detach().reshape(()).clone() if value.numel() == 1 else None
        if step_inputs is not None:
            read = step_inputs.loss_value()
            if read is not None:
                return read
    return read_scalar(value)


class RingEntry(NamedTuple):
    """What the ring keeps about one step besides its records. `loss` and `lr` are floats, None, or 0-dim tensor
    copies on the GPU, read only when the history is read. `scaling`: the GradScaler's scale at the check (None
    without one; nanscan.runtime.amp)."""

    step: int
    tensors: tuple[ScannedTensor, ...]  # shared with the step's report (ScanReport keeps a tuple), not copied
    skipped: tuple[str, ...]
    backend: str
    loss: Any
    lr: Any
    scaling: Scaling | None = None


class DeviceRecords:
    """One device part of a step, compacted on its device (NOTE: [history ring]). Its buffer is one int64 tensor
    holding the scalars, the status, the compaction's workspace, the ranges (as int16) and the counts (as uint32),
    reused by the ring slot's next step of the same shape; the dense records stay referenced until `resolve`
    knows whether the compact ones fitted. Device tensors on the CPU run the CPU twin of the kernels (tests)."""

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.device = rows, device
        self.capacity = rows * DEVICE_BINS_PER_ROW
        on_gpu = device.type == "cuda"
        # None without a compaction for this device (a build without CUDA): the dense records are kept.
        self._compact = native_function("compact_cuda" if on_gpu else "compact_fixed")
        self.buffer = None
        if self._compact is not None:
            self.buffer = torch.empty(sum(self._sizes()), dtype=torch.int64, device=device)
            self.scalars, self.status, self.workspace, self.ranges, self.counts = self._views(self.buffer)
            self.host_status = torch.zeros(2, dtype=torch.int64, pin_memory=on_gpu)
        self.event = torch.cuda.Event() if on_gpu else None
        self.dense: torch.Tensor | None = None  # the scan's records, until resolved
        self.done: Any = None  # the scan's event, for reading `dense` from another stream
        self.fits: bool | None = None  # None: not known yet

    def _sizes(self) -> list[int]:
        """int64 slots of the buffer's parts: scalars, status, workspace, ranges (int16), counts (uint32)."""
        rows = self.rows
        return [rows * L.SCALAR_WIDTH, 2, 3 * rows, (2 * rows + 3) // 4, (self.capacity + 1) // 2]

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The parts of `buffer` (the device buffer, or its host copy), each in its shape and dtype."""
        parts, at = [], 0
        for size in self._sizes():
            parts.append(buffer[at:at + size])
            at += size
        scalars, status, workspace, ranges, counts = parts
        return [scalars.view(self.rows, L.SCALAR_WIDTH), status, workspace,
                ranges.view(torch.int16)[: 2 * self.rows].view(self.rows, 2), counts.view(torch.int32)[: self.capacity]]

    def fits_shape(self, records: torch.Tensor) -> bool:
        return records.shape[0] == self.rows and records.device == self.device

    def launch(self, records: torch.Tensor, done: Any) -> None:
        """Compact `records` (written by a scan that recorded `done`) on the current stream, and copy the status
        to pinned host memory behind it. Returns at once."""
        self.dense, self.done = records, done
        if self._compact is None:
            self.fits = False
            return
        addresses = (records.data_ptr(), self.rows, self.scalars.data_ptr(), self.ranges.data_ptr(),
                     self.counts.data_ptr(), self.capacity)
        if self.event is None:
            self._compact(*addresses, self.status.data_ptr())
            self.host_status.copy_(self.status)
            self.fits = None
            return
        stream = torch.cuda.current_stream(self.device)
        if done is not None:
            stream.wait_event(done)
        if self.fits is None:  # the buffer's last step (`size` steps ago) never resolved: let its work finish
            stream.wait_event(self.event)
        self.fits = None
        self._compact(*addresses, self.workspace.data_ptr(), self.status.data_ptr(), stream.cuda_stream,
                      self.device.index)
        self.host_status.copy_(self.status, non_blocking=True)
        self.event.record(stream)

    def resolve(self, *, wait: bool) -> bool:
        """Whether the status is back (waiting for it with wait=True); then the dense records are dropped if the
        compact ones fitted."""
        if self.fits is None:
            if self.event is not None and not (wait or self.event.query()):
                return False
            if self.event is not None:
                self.event.synchronize()
            self.fits = bool(self.host_status[STATUS_FITS].item())
            if self.fits:
                self.dense = None
        return True

    @property
    def nbytes(self) -> int:
        """The buffer (kept for the slot's next step even when this one did not fit) and any dense records held."""
        dense = self.dense.nbytes if self.dense is not None else 0
        return dense + (self.buffer.nbytes if self.buffer is not None else 0)

    def host_records(self) -> np.ndarray:
        """The records on the host (waits for the compaction, then copies what was kept)."""
        self.resolve(wait=True)
        if not self.fits:
            if self.done is not None:
                self.done.synchronize()
            return self.dense.cpu().numpy()
        total = int(self.host_status[STATUS_TOTAL].item())
        scalars, _, _, ranges, counts = self._views(self.buffer.cpu())  # one copy of a few hundred bytes a tensor
        return compact.decode(scalars.numpy(), ranges.numpy(), counts[:total].numpy().view(np.uint32))


# What the ring keeps of one device's part of a step: its rows (None: all) and its records, compact on the host
# or on their device.
KeptPart = tuple[np.ndarray | None, "compact.CompactRecords | DeviceRecords"]


def _host_records(num_tensors: int, parts: list[KeptPart]) -> np.ndarray:
    """A step's records on the host, in input order, decoded from the parts the ring kept."""
    def host(kept: Any) -> np.ndarray:
        return kept.host_records() if isinstance(kept, DeviceRecords) else kept.decode()

    if len(parts) == 1 and parts[0][0] is None:
        return host(parts[0][1])
    out = L.empty_records(num_tensors)
    for rows, kept in parts:
        out[rows] = host(kept)
    return out


class HistoryRing:
    """The last `size` steps' records, compacted, and their scalars (NOTE: [history ring])."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"history={size!r}: keep at least 1 step (the failing one)")
        self.size = size
        # Per slot: what the step was, and its records per device (KeptPart).
        self._slots: list[tuple[RingEntry, list[KeptPart]] | None] = [None] * size
        # Per slot: the DeviceRecords of its device parts, reused by the slot's next step of the same shape.
        self._device: list[list[DeviceRecords]] = [[] for _ in range(size)]
        self._unresolved: list[DeviceRecords] = []  # device parts whose dense records are still kept
        # Per slot: whether the step was a GradScaler overflow skip (NOTE: [overflow skips] in nanscan.runtime.amp), set
        # once its verdict is read, which in mode="async" is one step after the slot was filled.
        self._overflow_skips = [False] * size
        self._count = 0  # steps appended so far; the newest is in slot (_count - 1) % size
        self.first_loss: Any = None  # the first step's loss as kept (kept_scalar), long after its slot is reused
        self._flags: torch.Tensor | None = None  # pinned float32 [size]: each slot's verdict flag, for GPU scans
        self._events: list[torch.cuda.Event] = []

    @property
    def nbytes(self) -> int:
        """Bytes of records kept: compact records, and the dense device records not yet resolved."""
        return sum(kept.nbytes for slot in self._slots if slot is not None for _, kept in slot[1])

    @property
    def device(self) -> torch.device | None:
        """Where the newest step's records are (the first device's part)."""
        if self._count == 0:
            return None
        kept = self._slots[(self._count - 1) % self.size][1][0][1]
        return kept.device if isinstance(kept, DeviceRecords) else torch.device("cpu")

    def __len__(self) -> int:
        return min(self._count, self.size)

    def append(self, step: int, scan: StepScan, tensors: Sequence[ScannedTensor], skipped: Sequence[str], *,
               loss: Any = None, lr: Any = None, verdict: bool = False, scaling: Scaling | None = None) -> int:
        """Keep one step in the next slot (the oldest step's) and return the slot. verdict=True also copies the
        scan's flag to pinned host memory (GPU scans) for `verdict(slot)`."""
        slot = self._count % self.size
        self._resolve(wait=False)
        host = scan.host_records
        if host is not None:  # already read on the host (mode="sync"): compacted there
            parts: list[KeptPart] = [(None, compact.encode(host))]
        else:
            parts = [(rows, compact.encode(part.records()) if isinstance(part, CompletedScan)
                      else self._on_device(slot, i, part)) for i, (rows, part) in enumerate(scan.parts)]
        if verdict and not scan.on_host:  # after the compaction: its status is back once the flag is
            flag = scan.found_inf
            if self._flags is None:
                self._flags = torch.zeros(self.size, dtype=torch.float32, pin_memory=True)
                self._events = [torch.cuda.Event() for _ in range(self.size)]
            self._flags[slot].copy_(flag, non_blocking=True)
            self._events[slot].record(torch.cuda.current_stream(flag.device))
        return self._keep(RingEntry(step, tuple(tensors), tuple(skipped), scan.backend, loss, lr, scaling), parts)

    def _on_device(self, slot: int, index: int, part: Any) -> DeviceRecords:
        """A device part compacted into the slot's buffer for it (made when the slot has none of its shape)."""
        records, reusable = part.device_records, self._device[slot]
        if index < len(reusable) and reusable[index].fits_shape(records):
            kept = reusable[index]
            if kept in self._unresolved:
                self._unresolved.remove(kept)
        else:
            kept = DeviceRecords(records.shape[0], records.device)
            del reusable[index:]
            reusable.append(kept)
        kept.launch(records, part.done_event)
        if kept.fits is None:
            self._unresolved.append(kept)
        return kept

    def _resolve(self, *, wait: bool) -> None:
        """Drop the dense records of every device part whose compaction status is back (all, with wait=True)."""
        self._unresolved = [kept for kept in self._unresolved if not kept.resolve(wait=wait)]

    def append_host(self, step: int, tensors: tuple[ScannedTensor, ...], records: np.ndarray,
                    skipped: tuple[str, ...], backend: str, *, loss: Any = None, lr: Any = None,
                    scaling: Scaling | None = None, compacted: compact.CompactRecords | None = None) -> int:
        """append() for a step whose records one host scan returned (ModelScanPlan.scan_on_host): no StepScan.
        `compacted`: the records already compacted, by the scan's call (NOTE: [step summary] in
        csrc/plan/plan_check.cpp); else they are compacted here."""
        records.setflags(write=False)  # the step's report and the live export share them (NOTE: [shared records])
        return self._keep(RingEntry(step, tensors, skipped, backend, loss, lr, scaling),
                          [(None, compacted if compacted is not None else compact.encode(records))])

    def _keep(self, entry: RingEntry, parts: list[KeptPart]) -> int:
        """Store a step in the next slot (the oldest step's) and return the slot."""
        slot = self._count % self.size
        if self.first_loss is None and entry.loss is not None:
            self.first_loss = entry.loss  # a rollback's yardstick (NOTE: [recovered]); a device copy is not read here
        self._slots[slot] = (entry, parts)
        self._overflow_skips[slot] = False
        self._count += 1
        return slot

    def mark_overflow_skip(self, slot: int) -> None:
        """Record that the step in `slot` was a GradScaler overflow skip."""
        self._overflow_skips[slot] = True

    def verdict(self, slot: int, scan: StepScan) -> bool:
        """True when the step stored in `slot` (by append(..., verdict=True)) saw a NaN or an infinity. Waits for
        that step's flag only, not for its records and not for work enqueued after it; the step's compaction
        was enqueued before the flag, so its status is back too and its dense records are dropped."""
        if scan.on_host:
            return scan.nonfinite_on_host
        self._events[slot].synchronize()
        self._resolve(wait=False)
        return bool(self._flags[slot].item() > 0)  # pinned host memory, written by the GPU before the event

    def entries(self) -> list[tuple[RingEntry, ScanReport]]:
        """Every kept step, oldest first, with a ScanReport that owns a host copy of its records. Device records
        are copied to the host, which waits for the GPU."""
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
