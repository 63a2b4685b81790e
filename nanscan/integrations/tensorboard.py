"""TensorBoard export of nanscan's statistics: every step's scalars and, every `log_every` steps, each tensor's
binary-exponent histogram, live from a Monitor (`Monitor(..., tensorboard=LOG_DIR, log_every=N)`) or after the
fact from a bundle's history (`nanscan export BUNDLE --tensorboard DIR`).

The one module that imports tensorboard (through torch.utils.tensorboard), and only when a writer is opened from
a directory: importing it costs nothing.

What is written (tags):
  nanscan/loss, nanscan/lr, nanscan/grad_norm     every step (the step's loss and learning rate when given; the L2
                                                  norm over the finite values of every gradient)
  nanscan/nonfinite_tensors, nanscan/nonfinite_elements
                                                  every step, 0 on a healthy step: an incident is a spike, never a gap
  <module>/grad_norm                              every log_every steps: the gradient norm per module
  <module>/<tensor name>                          every log_every steps and at every non-finite step: histograms
                                                  of |x| (TensorBoard's dashboards group tags by their first part, so
                                                  a module's weights, gradients and optimizer state sit together)
<module> is the module owning a parameter, gradient or optimizer state (nanscan.incident.owner_module), "model" for
parameters of the model itself, "input" for the batch, "loss" for the loss.

NOTE: [exponent buckets]
Bin b of a stats record counts the finite non-zero values with floor(log2|x|) = b - 128 (clamped to [-128, 127]),
i.e. |x| in [2**(b-128), 2**(b-127)). TensorBoard's bucket i holds the values above bucket_limit[i-1] up to
bucket_limit[i], so bin b is written as the bucket whose limit is 2**(b-127), over the occupied bins only (first to
last non-empty bin, the empty ones between included): the counts are the records' own, exactly. min and max are
the tensor's smallest and largest finite non-zero |x|, sum_squares its sumsq; the records hold no sum of values,
so `sum` is 0 (TensorBoard's charts do not use it). Zeros, NaNs and infinities are counted, never binned: they
show in the nonfinite scalars, not in a histogram (TensorBoard's own histogram summary rejects them).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from typing import Any, Iterable, Sequence

import numpy as np

from nanscan import _layout as L
from nanscan.incident import LOSS, owner_module, tensor_kind
from nanscan.pending import HostCopy, StepScan, completed_scan
from nanscan.stats import ScannedTensor, gradient_rows

log = logging.getLogger("nanscan")

DEFAULT_LOG_EVERY = 100
DEFAULT_MAX_TENSORS = 64  # histograms per logged step, to keep event files small for models with many tensors
# The live export hands its per-step scalars to the writer in batches of at most this many steps (and at every
# logged step, non-finite step, flush and close), each step's scalars as one event: a SummaryWriter event costs
# about 70 us on the development machine (the hand-off to its writer thread), and five of them a step, one per
# scalar, measured +7.7% on the demo model's step.
MAX_BUFFERED_STEPS = 100
SCALAR_PREFIX = "nanscan/"

_BIN_UPPER_LIMITS = [2.0 ** (b + L.MIN_BIN_EXPONENT + 1) for b in range(L.HIST_BINS)]  # NOTE: [exponent buckets]
_SUMSQ = slice(L.REC_SUMSQ, L.REC_SUMSQ + 1)


def open_writer(target: Any) -> tuple[Any, bool]:
    """(writer, whether nanscan opened it): a SummaryWriter (anything with add_scalar and add_histogram_raw) as
    given, or a torch.utils.tensorboard.SummaryWriter opened on a log directory."""
    if hasattr(target, "add_scalar") and hasattr(target, "add_histogram_raw"):
        return target, False
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"tensorboard={target!r}: pass a log directory or a torch.utils.tensorboard.SummaryWriter")
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard only when asked for
    except ImportError as exc:
        raise ImportError(f"TensorBoard export needs the tensorboard package ({exc}); install it with "
                          "`pip install tensorboard` or `pip install nanscan[tensorboard]`") from None
    return SummaryWriter(log_dir=os.fspath(target)), True


def group_of(name: str) -> str:
    """The TensorBoard group of a scanned tensor: its owning module, "model", "input", "loss" or "other"."""
    kind = tensor_kind(name)
    if kind in ("input", LOSS, "other"):
        return kind
    return owner_module(name) or "model"


def histogram_tag(name: str) -> str:
    return f"{group_of(name)}/{name}"


def exponent_histogram(record: np.ndarray, scanned_code: int) -> dict | None:
    """add_histogram_raw's arguments for one stats record (NOTE: [exponent buckets]); None when no value was
    binned (the tensor holds only zeros, NaNs or infinities)."""
    hist = record[L.REC_HIST:]
    occupied = np.flatnonzero(hist)
    if not len(occupied):
        return None
    first, last = int(occupied[0]), int(occupied[-1]) + 1
    absmin_bits = int(record[L.REC_ABSMIN_BITS])
    return {
        "min": 0.0 if absmin_bits == L.ABSMIN_NONE else L.abs_bits_to_float(absmin_bits, scanned_code),
        "max": L.abs_bits_to_float(int(record[L.REC_ABSMAX_BITS]), scanned_code),
        "num": int(hist.sum()), "sum": 0.0,
        "sum_squares": float(record[_SUMSQ].view(np.float64)[0]),
        "bucket_limits": _BIN_UPPER_LIMITS[first:last], "bucket_counts": [int(c) for c in hist[first:last]],
    }


def nonfinite_counts(records: np.ndarray) -> tuple[int, int]:
    """(tensors holding a NaN or an infinity, NaN and infinite elements in all)."""
    per_tensor = records[:, L.REC_NAN : L.REC_NEGINF + 1].sum(axis=1)
    return int(np.count_nonzero(per_tensor)), int(per_tensor.sum())


class GradientRows:
    """Which records are gradients, and the module of each, for one list of scanned tensors (worked out once: the
    Monitor hands every step the same tuple while nothing changes)."""

    def __init__(self, tensors: Sequence[ScannedTensor]):
        self.tensors = tensors
        self.rows = gradient_rows(tensors)
        self.modules = [group_of(tensors[i].name) for i in self.rows]

    def sumsq(self, records: np.ndarray) -> np.ndarray:
        return L.sumsq_values(records, self.rows)

    def total(self, records: np.ndarray) -> float | None:
        """The L2 norm over every gradient's finite values, from the records' sumsq."""
        return float(np.sqrt(self.sumsq(records).sum())) if len(self.rows) else None

    def per_module(self, records: np.ndarray) -> dict[str, float]:
        """The same norm per module."""
        sums: dict[str, float] = {}
        for module, s in zip(self.modules, self.sumsq(records)):
            sums[module] = sums.get(module, 0.0) + float(s)
        return {m: float(np.sqrt(s)) for m, s in sums.items()}


def grad_norms(tensors: Sequence[ScannedTensor], records: np.ndarray) -> tuple[float | None, dict[str, float]]:
    """(the L2 norm over every gradient's finite values, the same per module), from the records' sumsq."""
    rows = GradientRows(tensors)
    return rows.total(records), rows.per_module(records)


def _finite_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def step_scalars(gradients: GradientRows, records: np.ndarray, *, loss: Any = None, lr: Any = None) -> dict:
    """One step's scalars by tag: loss, lr, grad norm, non-finite tensors and elements (None: not known)."""
    bad_tensors, bad_elements = nonfinite_counts(records)
    return {SCALAR_PREFIX + "loss": _finite_or_none(loss), SCALAR_PREFIX + "lr": _finite_or_none(lr),
            SCALAR_PREFIX + "grad_norm": gradients.total(records), SCALAR_PREFIX + "nonfinite_tensors": bad_tensors,
            SCALAR_PREFIX + "nonfinite_elements": bad_elements}


def add_scalars(writer: Any, step: int, scalars: dict, walltime: float | None = None) -> None:
    """A step's scalars, as one event where the writer is torch's SummaryWriter (its file writer takes a summary of
    several values), else one add_scalar per tag."""
    shown = {tag: float(value) for tag, value in scalars.items() if value is not None}
    file_writer = getattr(writer, "file_writer", None)
    if file_writer is not None and hasattr(file_writer, "add_summary"):
        from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: PLC0415 - tensorboard only when exporting

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in shown.items()])
        file_writer.add_summary(summary, step, walltime)
        return
    for tag, value in shown.items():
        writer.add_scalar(tag, value, global_step=step, walltime=walltime)


def write_step(writer: Any, step: int, tensors: Sequence[ScannedTensor], records: np.ndarray, *, loss: Any = None,
               lr: Any = None, histograms: Iterable[int] = (), layer_norms: bool = False,
               gradients: GradientRows | None = None) -> None:
    """One step's scalars (step_scalars) and, for the rows in `histograms`, exponent histograms; with layer_norms,
    each module's gradient norm. `gradients`: GradientRows of `tensors`, when the caller keeps one."""
    gradients = gradients if gradients is not None and gradients.tensors is tensors else GradientRows(tensors)
    add_scalars(writer, step, step_scalars(gradients, records, loss=loss, lr=lr))
    write_details(writer, step, tensors, records, gradients, histograms=histograms, layer_norms=layer_norms)


def write_details(writer: Any, step: int, tensors: Sequence[ScannedTensor], records: np.ndarray,
                  gradients: GradientRows, *, histograms: Iterable[int] = (), layer_norms: bool = False) -> None:
    """A logged step's per-module gradient norms (layer_norms) and the exponent histograms of `histograms`."""
    if layer_norms:
        for module, norm in gradients.per_module(records).items():
            writer.add_scalar(f"{module}/grad_norm", norm, global_step=step)
    for i in histograms:
        t = tensors[i]
        raw = exponent_histogram(records[i], t.scanned_code)
        if raw is not None:
            writer.add_histogram_raw(histogram_tag(t.name), global_step=step, **raw)


class TensorBoardExport:
    """The live export behind Monitor(tensorboard=..., log_every=N): scalars every step, histograms and per-module
    gradient norms every `log_every` steps and at every non-finite step.

    target: a log directory (a SummaryWriter is opened there and closed by close()) or a SummaryWriter.
    tensors: fnmatch patterns of the tensor names to draw histograms of (default: all), e.g. ("grad:*",
        "param:blocks.0.*"); at most `max_tensors` of them, the first in scan order.
    No host sync of its own: a host scan's records are written at once; a GPU scan's are copied to pinned memory
    behind the scan (nanscan.pending.HostCopy) and step s is written when they are back, at the Monitor's next
    check (whose wait for step s's verdict already covers the copy) or at flush() and close().
    """

    def __init__(self, target: Any, *, log_every: int = DEFAULT_LOG_EVERY, tensors: Sequence[str] | None = None,
                 max_tensors: int = DEFAULT_MAX_TENSORS):
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
            raise ValueError(f"log_every={log_every!r}: write histograms every N steps, N >= 1")
        if max_tensors < 0:
            raise ValueError(f"max_tensors={max_tensors!r}: draw at most N histograms per step, N >= 0")
        if isinstance(tensors, str):
            tensors = (tensors,)
        self.writer, self._owned = open_writer(target)
        self.log_every = log_every
        self.patterns = tuple(tensors) if tensors is not None else None
        self.max_tensors = max_tensors
        self._pending: list[tuple[int, HostCopy]] = []  # GPU steps whose records are still on their way
        self._scalars: list[tuple[int, dict, float]] = []  # (step, scalars, wall time) not yet given to the writer
        self._gradients: GradientRows | None = None
        self._chosen: tuple[tuple[ScannedTensor, ...], list[int]] | None = None  # the rows drawn, per tensor list

    def record(self, step: int, scan: StepScan | np.ndarray, tensors: Sequence[ScannedTensor], *, loss: Any = None,
               lr: Any = None) -> None:
        """A checked step: its StepScan (or, for a host scan, its records). Written now when its records are on
        the host, else when they come back (poll)."""
        if isinstance(scan, np.ndarray):
            scan = completed_scan(tuple(tensors), scan, None, "")
        self._pending.append((step, HostCopy(scan, (loss, lr))))
        self.poll()

    def poll(self, *, wait: bool = False) -> None:
        """Write every step whose records are back, oldest first (wait=True: all of them, waiting for the GPU)."""
        while self._pending and (wait or self._pending[0][1].ready()):
            step, copy = self._pending.pop(0)
            records = copy.records()
            loss, lr = copy.scalars()
            self._write(step, copy.tensors, records, loss, lr)

    def _write(self, step: int, tensors: tuple[ScannedTensor, ...], records: np.ndarray, loss: Any, lr: Any) -> None:
        if self._gradients is None or self._gradients.tensors is not tensors:
            self._gradients = GradientRows(tensors)
        bad = L.any_nonfinite(records)
        full = bad or step % self.log_every == 0
        self._scalars.append((step, step_scalars(self._gradients, records, loss=loss, lr=lr), time.time()))
        if full or len(self._scalars) >= MAX_BUFFERED_STEPS:
            self._emit_scalars()
        if full:
            write_details(self.writer, step, tensors, records, self._gradients, histograms=self._rows(tensors),
                          layer_norms=True)
        if bad:  # the run may end here (on_invalid="raise"): the incident must be on disk, not in a buffer
            self.writer.flush()

    def _emit_scalars(self) -> None:
        """Hand the buffered steps' scalars to the writer, each at its own step and wall time."""
        for step, scalars, walltime in self._scalars:
            add_scalars(self.writer, step, scalars, walltime)
        self._scalars.clear()

    def _rows(self, tensors: tuple[ScannedTensor, ...]) -> list[int]:
        """The rows to draw histograms of: those matching the patterns, at most max_tensors (chosen once per tensor
        list, so a run's tags stay the same)."""
        if self._chosen is None or self._chosen[0] != tensors:
            rows = [i for i, t in enumerate(tensors)
                    if self.patterns is None or any(fnmatch.fnmatchcase(t.name, p) for p in self.patterns)]
            if len(rows) > self.max_tensors:
                log.info("nanscan: TensorBoard histograms for %d of %d matching tensors (max_tensors=%d)",
                         self.max_tensors, len(rows), self.max_tensors)
            self._chosen = (tensors, rows[: self.max_tensors])
        return self._chosen[1]

    def flush(self) -> None:
        """Write every step still on its way (waits for the GPU) and flush the writer."""
        self.poll(wait=True)
        self._emit_scalars()
        self.writer.flush()

    def close(self) -> None:
        """flush(), then close the writer if this export opened it."""
        self.flush()
        if self._owned:
            self.writer.close()


def monitor_export(tensorboard: Any, log_every: int | None) -> TensorBoardExport:
    """The export for Monitor(tensorboard=..., log_every=...): a TensorBoardExport as given, or one on a log
    directory or SummaryWriter."""
    if isinstance(tensorboard, TensorBoardExport):
        if log_every is not None and log_every != tensorboard.log_every:
            raise ValueError(f"log_every={log_every!r} beside a TensorBoardExport with log_every="
                             f"{tensorboard.log_every}: set it in one place")
        return tensorboard
    return TensorBoardExport(tensorboard, log_every=DEFAULT_LOG_EVERY if log_every is None else log_every)
