"""TensorBoard export of nanscan's statistics: every step's scalars and, every `log_every` steps, each tensor's
binary-exponent histogram, live from a Monitor (`Monitor(..., tensorboard=LOG_DIR, log_every=N)`) or after the
fact from a bundle's history (`nanscan export BUNDLE --tensorboard DIR`). What is written, and when, is the live
export's core (nanscan.integrations.live); this module turns its rows into TensorBoard events.

The one module that imports tensorboard (its protobuf classes, or torch.utils.tensorboard for a SummaryWriter the
user hands in), and only when a writer is opened: importing it costs nothing.

What is written (tags):
  nanscan/loss, nanscan/lr, nanscan/grad_norm     every step (the step's loss and learning rate when given; the L2
                                                  norm of every gradient, NaN or inf at a step whose gradients hold
                                                  a NaN or an infinity: NOTE: [non-finite norms])
  nanscan/nonfinite_tensors, nanscan/nonfinite_elements
                                                  every step, 0 on a healthy step
  <module>/grad_norm                              every log_every steps and at every non-finite step: the gradient
                                                  norm per module (the same rule)
  <module>/exp_hist/<tensor name>                 the same steps: each tensor's histogram over log2|x| (NOTE:
                                                  [exponent buckets]), empty for a tensor with no finite non-zero
                                                  value, with a description saying what the axis is
  <module>/nan/<tensor name>, <module>/posinf/<tensor name>, <module>/neginf/<tensor name>
                                                  at a non-finite step, for every tensor holding a NaN or infinity
<module> is a tensor's group (nanscan.integrations.live.group_of); TensorBoard's dashboards group tags by their
first part, so a module's weights, gradients and optimizer state sit together. A histogram is written in
TensorBoard's own form, a float64 tensor of (left edge, right edge, count) rows with the histogram plugin's
metadata, as tf.summary.histogram writes it: the edges are the integers e and e + 1 and the counts exact (the
older HistogramProto is read back through float32, exact only up to 2**24). A writer without add_summary
(tensorboardX's) gets add_histogram_raw with the same buckets and no description.

NOTE: [event file]
A log directory given as a path is written by EventFile, not by torch's SummaryWriter: SummaryWriter writes through
tensorboard's RecordWriter, whose masked CRC32C is pure Python, a loop per byte, on a writer thread that holds the
GIL while it runs. On the demo model's step (benchmarks/bench_overhead.py) the export through SummaryWriter cost
+4.9% at log_every=100 and +105% at log_every=1; through EventFile and the live core, +2.0% (within that
benchmark's noise; the export's own time inside check() is about 57 us a step) and +13%. tensorboardX's writer,
which uses a native CRC too (the crc32c package), measured +79% at log_every=1 against +22% for EventFile on the
same core then: its multiprocessing queue pickles every event. EventFile serializes tensorboard's own Event protos
and frames them as TensorBoard reads them: per event the uint64 length, the masked CRC32C of those 8 bytes, the
data, the masked CRC32C of the data (little-endian; masked = ((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32),
the CRC computed in C by google-crc32c. It writes on the calling thread into a buffered file, flushed at each
hand-off of the live export (a few KB), so no thread contends for the GIL. The file is named
events.out.tfevents.<time>.<host>.<pid>.<n> like SummaryWriter's, and opens
with the file_version event "brain.Event:2".
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nanscan.engine import _layout as L
from nanscan.integrations.live import (
    DEFAULT_LOG_EVERY,
    DEFAULT_MAX_TENSORS,
    NONFINITE_STATS,
    SCALARS,
    ExponentHistogram,
    LiveExport,
    StepRow,
    group_of,
)

SCALAR_PREFIX = "nanscan/"
EVENT_FILE_PREFIX = "events.out.tfevents."
_FILE_NUMBERS = itertools.count()  # two files opened in one second by one process still get two names
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_INSTALL = "install them with `pip install nanscan[tensorboard]` (tensorboard and google-crc32c)"


class EventFile:
    """A TensorBoard event file in `log_dir`, written directly (NOTE: [event file]), with the part of
    SummaryWriter's interface that nanscan uses: add_scalar, add_histogram_raw, flush, close."""

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from google_crc32c import value as crc32c  # noqa: PLC0415 - only when a log directory is written
            from tensorboard.compat.proto.event_pb2 import Event  # noqa: PLC0415
            from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary  # noqa: PLC0415
        except ImportError as exc:
            raise ImportError(f"TensorBoard export needs the tensorboard and google-crc32c packages ({exc}); "
                              f"{_INSTALL}") from None
        self._crc32c, self._event, self._summary, self._histogram = crc32c, Event, Summary, HistogramProto
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = (f"{EVENT_FILE_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_FILE_NUMBERS)}")
        self.path = self.log_dir / name
        self._file = open(self.path, "xb")  # noqa: SIM115 - open until close(); "x": never another writer's file
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()  # TensorBoard lists the run at once

    def _masked_crc(self, data: bytes) -> int:
        crc = self._crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    def _write(self, event: Any) -> None:
        data = event.SerializeToString()
        length = _LENGTH.pack(len(data))
        self._file.write(b"".join((length, _CRC.pack(self._masked_crc(length)), data,
                                   _CRC.pack(self._masked_crc(data)))))

    def add_summary(self, summary: Any, global_step: int | None = None, walltime: float | None = None) -> None:
        """One event holding a tensorboard Summary (of one or more values)."""
        self._write(self._event(wall_time=time.time() if walltime is None else walltime, step=global_step or 0,
                                summary=summary))

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None,
                   walltime: float | None = None) -> None:
        self.add_summary(self._summary(value=[self._summary.Value(tag=tag, simple_value=float(scalar_value))]),
                         global_step, walltime)

    def add_histogram_raw(self, tag: str, min: float, max: float, num: int, sum: float, sum_squares: float,  # noqa: A002
                          bucket_limits: Sequence[float], bucket_counts: Sequence[int],
                          global_step: int | None = None, walltime: float | None = None) -> None:
        histogram = self._histogram(min=min, max=max, num=num, sum=sum, sum_squares=sum_squares,
                                    bucket_limit=bucket_limits, bucket=bucket_counts)
        self.add_summary(self._summary(value=[self._summary.Value(tag=tag, histo=histogram)]), global_step, walltime)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def open_writer(target: Any) -> tuple[Any, bool]:
    """(writer, whether nanscan opened it): a SummaryWriter (anything with add_scalar and add_histogram_raw) as
    given, or an EventFile opened in a log directory (NOTE: [event file])."""
    if hasattr(target, "add_scalar") and hasattr(target, "add_histogram_raw"):
        return target, False
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"tensorboard={target!r}: pass a log directory or a torch.utils.tensorboard.SummaryWriter")
    return EventFile(target), True


HISTOGRAM_DESCRIPTION = (
    "nanscan's exponent histogram: the x axis is log2|x|, the binary exponent of the tensor's finite non-zero "
    "values. The bucket [e, e+1) counts, exactly, the values with 2^e <= |x| < 2^(e+1) (e clamped to [-128, 127]). "
    "Zeros, NaN and infinities have no exponent and are not drawn: a tensor holding nothing else has an empty "
    "histogram, and its counts are the scalars <module>/nan/<tensor>, <module>/posinf/<tensor> and "
    "<module>/neginf/<tensor> at a non-finite step.")


def histogram_tag(name: str, group: str | None = None) -> str:
    """The tag of a tensor's exponent histograms: its group (group_of(name) unless given), exp_hist, its name."""
    return f"{group_of(name) if group is None else group}/exp_hist/{name}"


def step_tags(row: StepRow) -> list[tuple[str, float]]:
    """(tag, value) of a row's own scalars, written every step."""
    return [(SCALAR_PREFIX + name, float(row.scalars[name])) for name in SCALARS if row.scalars.get(name) is not None]


def detail_tags(row: StepRow) -> list[tuple[str, float]]:
    """(tag, value) of a logged or non-finite step's other scalars: the module norms, the non-finite counts."""
    tags = [(f"{module}/grad_norm", norm) for module, norm in (row.module_norms or {}).items()]
    for c in row.nonfinite:
        tags += [(f"{c.group}/{stat}/{c.name}", float(getattr(c, stat))) for stat in NONFINITE_STATS]
    return tags


def _summary_adder(writer: Any) -> Any:
    """The writer's add_summary(summary, step, walltime) taking a tensorboard Summary of several values in one
    event, or None: an EventFile's, or torch's SummaryWriter's file writer (whose events are tensorboard's protos);
    another writer (tensorboardX's, with protos of its own) is written one add_scalar or add_histogram_raw per tag."""
    if isinstance(writer, EventFile):
        return writer.add_summary
    file_writer = getattr(writer, "file_writer", None)
    if type(writer).__module__.startswith("torch.utils.tensorboard") and file_writer is not None:
        return file_writer.add_summary
    return None


# Row b: the edges (e, e + 1) of bin b's bucket, e = b - 128 (NOTE: [exponent buckets]).
_BUCKET_EDGES = np.stack([np.arange(L.HIST_BINS, dtype=np.float64) + L.MIN_BIN_EXPONENT,
                          np.arange(L.HIST_BINS, dtype=np.float64) + L.MIN_BIN_EXPONENT + 1], axis=1)


class _HistogramValues:
    """Summary values of exponent histograms in TensorBoard's tensor form (module docstring), the description
    written with a tag's first histogram only (TensorBoard keeps the first metadata of a tag)."""

    def __init__(self) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: PLC0415 - only when events are written
        from tensorboard.compat.proto.tensor_pb2 import TensorProto  # noqa: PLC0415
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto  # noqa: PLC0415
        from tensorboard.compat.proto.types_pb2 import DT_DOUBLE  # noqa: PLC0415
        from tensorboard.plugins.histogram.metadata import create_summary_metadata  # noqa: PLC0415

        self._value, self._tensor, self._shape, self._double = Summary.Value, TensorProto, TensorShapeProto, DT_DOUBLE
        self._metadata = create_summary_metadata(display_name="", description=HISTOGRAM_DESCRIPTION)
        self._described: set[str] = set()
        self._shapes: dict[int, Any] = {}  # (k, 3) TensorShapeProto per bucket count k

    def __call__(self, h: ExponentHistogram) -> Any:
        tag = histogram_tag(h.name, h.group)
        k, first = len(h.counts), h.first_exponent - L.MIN_BIN_EXPONENT
        buckets = np.empty((k, 3))  # rows of (left, right, count): slices of a table, a third of the time of a stack
        buckets[:, :2] = _BUCKET_EDGES[first : first + k]
        buckets[:, 2] = h.counts
        shape = self._shapes.get(k)
        if shape is None:
            shape = self._shapes[k] = self._shape(dim=[self._shape.Dim(size=k), self._shape.Dim(size=3)])
        tensor = self._tensor(dtype=self._double, tensor_shape=shape, tensor_content=buckets.tobytes())
        if tag in self._described:
            return self._value(tag=tag, tensor=tensor)
        self._described.add(tag)
        return self._value(tag=tag, tensor=tensor, metadata=self._metadata)


def _raw(h: ExponentHistogram) -> dict:
    """add_histogram_raw's arguments for one histogram (NOTE: [exponent buckets]): TensorBoard reads bucket i as
    (limit i-1, limit i], the first from `min` and the last up to `max`. sum and sum_squares are those of nothing
    TensorBoard draws: 0."""
    edges = h.edges()
    return {"min": float(edges[0]), "max": float(edges[-1]), "num": h.num, "sum": 0.0, "sum_squares": 0.0,
            "bucket_limits": [float(e) for e in edges[1:]], "bucket_counts": h.counts}


def write_rows(writer: Any, rows: Sequence[StepRow], histogram_values: _HistogramValues | None = None) -> None:
    """Each row's scalars as one event and, for a logged step, its module norms, non-finite counts and histograms
    as another (one event per value through a writer without add_summary). histogram_values: the writer's own,
    kept across calls so that each tag is described once."""
    add_summary = _summary_adder(writer)
    if add_summary is not None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: PLC0415

        value = Summary.Value
        histogram_values = histogram_values or _HistogramValues()
    for row in rows:
        scalars, details = step_tags(row), detail_tags(row)
        if add_summary is None:
            for tag, v in scalars + details:
                writer.add_scalar(tag, v, global_step=row.step, walltime=row.walltime)
            for h in row.histograms:
                writer.add_histogram_raw(histogram_tag(h.name, h.group), global_step=row.step, walltime=row.walltime,
                                         **_raw(h))
            continue
        add_summary(Summary(value=[value(tag=tag, simple_value=v) for tag, v in scalars]), row.step, row.walltime)
        if details or row.histograms:
            values = [value(tag=tag, simple_value=v) for tag, v in details]
            values += [histogram_values(h) for h in row.histograms]
            add_summary(Summary(value=values), row.step, row.walltime)


class TensorBoardSink:
    """The live export's TensorBoard sink: a log directory (an EventFile, closed by close()) or a SummaryWriter
    (written into, so the events join the user's run, and left open)."""

    def __init__(self, target: Any):
        self.writer, self._owned = open_writer(target)
        self._histogram_values = _HistogramValues() if _summary_adder(self.writer) is not None else None

    def write(self, rows: Sequence[StepRow]) -> None:
        write_rows(self.writer, rows, self._histogram_values)
        if self._owned:  # a few KB into the OS's hands at each hand-off (NOTE: [event file])
            self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.flush()
        if self._owned:
            self.writer.close()


class TensorBoardExport(LiveExport):
    """A live export to TensorBoard with a choice of tensors: Monitor(tensorboard=TensorBoardExport(LOG_DIR or
    SummaryWriter, log_every=N, tensors=("grad:*",), max_tensors=M)); see nanscan.integrations.live.LiveExport."""

    def __init__(self, target: Any, *, log_every: int = DEFAULT_LOG_EVERY, tensors: Sequence[str] | None = None,
                 max_tensors: int = DEFAULT_MAX_TENSORS):
        sink = TensorBoardSink(target)
        try:
            super().__init__([sink], log_every=log_every, tensors=tensors, max_tensors=max_tensors)
        except BaseException:
            sink.close()
            raise
        self.writer = sink.writer


def as_sink(target: Any) -> TensorBoardSink | LiveExport:
    """What Monitor(tensorboard=target) writes through: a TensorBoardExport as given, else a TensorBoardSink."""
    return target if isinstance(target, LiveExport) else TensorBoardSink(target)
