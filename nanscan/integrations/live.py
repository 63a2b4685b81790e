"""The live export's core, one for every sink (TensorBoard, W&B): which steps are written and when, the GPU steps
whose records are still on their way, each step's scalars, and at a logged step the per-module gradient norms and
the exponent histograms of the chosen tensors. A sink (nanscan.integrations.tensorboard, nanscan.integrations.wandb)
only turns the rows it is handed into its library's calls.

What a sink is handed, per step (StepRow):
  scalars        every step: loss, lr (when given), grad_norm (the L2 norm of every gradient: NaN or inf at a step
                 whose gradients hold a NaN or an infinity, NOTE: [non-finite norms]), nonfinite_tensors and
                 nonfinite_elements (0 on a healthy step: an incident is a spike, never a gap)
  module_norms   every `log_every` steps and at every non-finite step: the gradient norm per module (the same rule)
  histograms     the same steps: each chosen tensor's exponent histogram (NOTE: [exponent buckets]), empty for a
                 tensor with no finite non-zero value (all NaN, say), so that every chosen tensor has one
  nonfinite      at a non-finite step: the NaN, +inf and -inf counts of every tensor holding any
A tensor's group is the module owning it (nanscan.incident.owner_module), "model" for parameters of the model
itself, "input" for the batch, "loss" for the loss: the dashboards of both sinks group by it.

NOTE: [exponent buckets]
A histogram's x axis is the binary exponent e = floor(log2|x|), not x: bin b of a stats record counts the finite
non-zero values with floor(log2|x|) = b - 128 (clamped to [-128, 127]), and is written as the bucket [e, e + 1)
with e = b - 128, so one bucket is one binade and every edge is an integer (the bins of the HTML report's heat
maps). Drawn over |x| itself, bins with edges at powers of two put a 3.4e38 at the far end of a linear axis and
squeeze every other bin into a sliver; over e the same tensor reads as a bar at 127 beside its bulk near 0. A
histogram spans the occupied bins only (first to last non-empty bin, the empty ones between included) and its
counts are the records' own, exactly. Zeros, NaNs and infinities have no exponent and are never binned: a tensor
holding nothing else gets an empty histogram, and its NaN and infinity counts are the step's `nonfinite` scalars.

NOTE: [non-finite norms]
The records' sumsq sums the finite values only, so the norm computed from it over a gradient full of NaN is 0.0,
which reads as a vanishing gradient. A norm over gradients holding a NaN is written as NaN, and over gradients
holding an infinity (and no NaN) as +inf, as torch.linalg.vector_norm (and so clip_grad_norm_) returns; it is
the finite values' norm only when every gradient value is finite.

NOTE: [live export cost]
The export runs inside check(), on the training thread, so a step that writes nothing must cost next to nothing:
it copies the records' scalar slots (8 int64 per tensor, not the histograms) and counts their non-finite slots,
and nothing else. Each numpy call right after a training step costs 10-20 us, cache-cold, where a loop of them
measures 2-5, so the scalars of the kept steps are computed at the hand-off, for all of them in a few calls. A
hand-off to the sinks happens at every logged step and non-finite step, at flush and close, and otherwise after
MAX_BUFFERED_STEPS steps or MAX_BUFFERED_SECONDS seconds, whichever comes first (the live view lags by at most
that).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence

import numpy as np

from nanscan.engine import _layout as L
from nanscan.engine import compact
from nanscan.incident import LOSS, owner_module, tensor_kind
from nanscan.engine.pending import HostCopy, StepScan, completed_scan
from nanscan.engine.stats import ScannedTensor, gradient_rows

log = logging.getLogger("nanscan")

DEFAULT_LOG_EVERY = 100
DEFAULT_MAX_TENSORS = 64  # histograms per logged step, to keep the logs small for models with many tensors
MAX_BUFFERED_STEPS = 100  # NOTE: [live export cost]
MAX_BUFFERED_SECONDS = 10.0
SCALARS = ("loss", "lr", "grad_norm", "nonfinite_tensors", "nonfinite_elements")

_NONFINITE = slice(L.REC_NAN, L.REC_NEGINF + 1)
NONFINITE_STATS = ("nan", "posinf", "neginf")  # the record's slots in _NONFINITE, in order


def group_of(name: str) -> str:
    """The group of a scanned tensor in the dashboards: its owning module, "model", "input", "loss" or "other"."""
    kind = tensor_kind(name)
    if kind in ("input", LOSS, "other"):
        return kind
    return owner_module(name) or "model"


class ExponentHistogram(NamedTuple):
    """One tensor's histogram over the binary exponent of its finite non-zero values, occupied bins only (NOTE:
    [exponent buckets]); a NamedTuple, since a logged step makes dozens of them."""

    name: str  # the scanned tensor's name
    group: str  # group_of(name)
    first_exponent: int  # the exponent e of counts[0]'s bucket [e, e + 1)
    counts: list[int]  # empty: no finite non-zero value

    @property
    def num(self) -> int:
        return sum(self.counts)

    def edges(self) -> list[int]:
        """len(counts) + 1 integer bucket edges: counts[i] holds the values with floor(log2|x|) = edges[i]."""
        return list(range(self.first_exponent, self.first_exponent + len(self.counts) + 1))


class NonfiniteCounts(NamedTuple):
    """One tensor's non-finite counts at a non-finite step."""

    name: str
    group: str
    nan: int
    posinf: int
    neginf: int


@dataclass(frozen=True)
class StepRow:
    """One step as a sink receives it: its scalars and, at a logged step, its details (module docstring)."""

    step: int
    walltime: float
    scalars: dict[str, float | int | None]  # by SCALARS name; None: not known (no loss given, no gradients)
    module_norms: dict[str, float] | None = None  # None: not a logged step
    histograms: tuple[ExponentHistogram, ...] = field(default=())
    nonfinite: tuple[NonfiniteCounts, ...] = field(default=())  # the tensors holding any, at a non-finite step


class Sink(Protocol):
    """What the core hands steps to: a TensorBoard writer, a W&B run."""

    def write(self, rows: Sequence[StepRow]) -> None:
        """Some steps, oldest first."""

    def flush(self) -> None:
        """Put what was written where a crash cannot lose it (a non-finite step may end the run)."""

    def close(self) -> None:
        """Flush, and close what the sink opened itself (never what the user handed it)."""


def reported_norms(finite_norms: np.ndarray, nans: np.ndarray, infs: np.ndarray) -> np.ndarray:
    """Norms as written (NOTE: [non-finite norms]): NaN where there are NaNs, +inf where there are only
    infinities, else the finite values' norm; all three arrays of one shape."""
    return np.where(nans > 0, np.nan, np.where(infs > 0, np.inf, finite_norms))


class GradientRows:
    """Which records are gradients, and the module of each, for one list of scanned tensors (worked out once: the
    Monitor hands every step the same tuple while nothing changes)."""

    def __init__(self, tensors: Sequence[ScannedTensor]):
        self.tensors = tensors
        self.rows = gradient_rows(tensors)
        self.modules = [group_of(tensors[i].name) for i in self.rows]

    def totals(self, scalar_slots: np.ndarray) -> np.ndarray | None:
        """The L2 norm of every gradient, per step (NOTE: [non-finite norms]), from a (steps, tensors, slots) stack
        of the records' scalar slots; None without gradients."""
        if not len(self.rows):
            return None
        slots = scalar_slots[:, self.rows]
        sumsq = np.ascontiguousarray(slots[:, :, L.REC_SUMSQ]).view(np.float64)
        infs = slots[:, :, L.REC_POSINF] + slots[:, :, L.REC_NEGINF]
        return reported_norms(np.sqrt(sumsq.sum(axis=1)), slots[:, :, L.REC_NAN].sum(axis=1), infs.sum(axis=1))

    def per_module(self, records: np.ndarray) -> dict[str, float]:
        """The same norm per module, for one step's records."""
        sums: dict[str, list] = {}  # module: [sumsq, NaNs, infinities]
        infs = records[self.rows, L.REC_POSINF] + records[self.rows, L.REC_NEGINF]
        for module, sumsq, nans, inf in zip(self.modules, L.sumsq_values(records, self.rows).tolist(),
                                            records[self.rows, L.REC_NAN].tolist(), infs.tolist()):
            total = sums.setdefault(module, [0.0, 0, 0])
            total[0] += sumsq
            total[1] += nans
            total[2] += inf
        return {m: float(reported_norms(np.sqrt(s), nans, inf)) for m, (s, nans, inf) in sums.items()}


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def step_scalars(gradients: GradientRows, scalar_slots: np.ndarray, losses: Sequence[Any],
                 lrs: Sequence[Any]) -> list[dict]:
    """The scalars of several steps with the same tensors, from their stacked scalar slots (steps, tensors,
    slots) and their losses and learning rates (None: not given)."""
    per_tensor = scalar_slots[:, :, _NONFINITE].sum(axis=2)
    bad_tensors = np.count_nonzero(per_tensor, axis=1).tolist()
    bad_elements = per_tensor.sum(axis=1).tolist()
    norms = gradients.totals(scalar_slots)
    norms = [None] * len(losses) if norms is None else norms.tolist()
    return [dict(zip(SCALARS, (_float_or_none(loss), _float_or_none(lr), norm, tensors, elements)))
            for loss, lr, norm, tensors, elements in zip(losses, lrs, norms, bad_tensors, bad_elements)]


def exponent_histograms(tensors: Sequence[ScannedTensor], records: np.ndarray, rows: Sequence[int],
                        groups: Sequence[str] | None = None) -> tuple[ExponentHistogram, ...]:
    """The histograms of the given rows (NOTE: [exponent buckets]), an empty one for a tensor with no value binned
    (only zeros, NaNs or infinities). groups: group_of each row's tensor, when the caller keeps them."""
    if not len(rows):
        return ()
    if groups is None:
        groups = [group_of(tensors[i].name) for i in rows]
    hist = records[rows, L.REC_HIST:L.REC_HIST_END]
    first, width = compact.occupied_ranges(hist)
    end = (first + width).tolist()
    first = first.tolist()
    return tuple(ExponentHistogram(tensors[i].name, groups[j], first[j] + L.MIN_BIN_EXPONENT,
                                   hist[j, first[j] : end[j]].tolist()) for j, i in enumerate(rows))


def nonfinite_counts(tensors: Sequence[ScannedTensor], records: np.ndarray) -> tuple[NonfiniteCounts, ...]:
    """The NaN, +inf and -inf counts of every tensor holding any (none at a healthy step)."""
    counts = records[:, _NONFINITE]
    return tuple(NonfiniteCounts(tensors[i].name, group_of(tensors[i].name), *counts[i].tolist())
                 for i in np.flatnonzero(counts.any(axis=1)).tolist())


def step_row(step: int, tensors: Sequence[ScannedTensor], records: np.ndarray, *, loss: Any = None,
             lr: Any = None, histograms: Iterable[int] = (), module_norms: bool = False,
             gradients: GradientRows | None = None, walltime: float | None = None) -> StepRow:
    """One step's row from its records, outside a live export (a bundle's history): its scalars, its non-finite
    counts and, with module_norms, each module's gradient norm; histograms of the rows in `histograms`."""
    gradients = gradients if gradients is not None and gradients.tensors is tensors else GradientRows(tensors)
    scalars = step_scalars(gradients, records[None, :, : L.REC_HIST], [loss], [lr])[0]
    return StepRow(step, time.time() if walltime is None else walltime, scalars,
                   gradients.per_module(records) if module_norms else None,
                   exponent_histograms(tensors, records, list(histograms)), nonfinite_counts(tensors, records))


class LiveExport:
    """The live export behind Monitor(tensorboard=..., wandb=..., log_every=N): every step's scalars to every sink,
    and every `log_every` steps and at every non-finite step the per-module gradient norms and histograms.

    sinks: where the rows go (nanscan.integrations.tensorboard.TensorBoardSink, nanscan.integrations.wandb.WandbSink).
    tensors: fnmatch patterns of the tensor names to draw histograms of (default: all), e.g. ("grad:*",
        "param:blocks.0.*"); at most `max_tensors` of them, the first in scan order.
    No host sync of its own: a host scan's records are taken at once; a GPU scan's are copied to pinned memory
    behind the scan (nanscan.engine.pending.HostCopy) and step s is taken when they are back, at the Monitor's next
    check (whose wait for step s's verdict already covers the copy) or at flush() and close().
    """

    def __init__(self, sinks: Sequence[Sink], *, log_every: int = DEFAULT_LOG_EVERY,
                 tensors: Sequence[str] | str | None = None, max_tensors: int = DEFAULT_MAX_TENSORS):
        check_log_every(log_every)
        if not isinstance(max_tensors, int) or isinstance(max_tensors, bool) or max_tensors < 0:
            raise ValueError(f"max_tensors={max_tensors!r}: draw at most N histograms per step, N >= 0")
        if isinstance(tensors, str):
            tensors = (tensors,)
        self.sinks = list(sinks)
        self.log_every = log_every
        self.patterns = tuple(tensors) if tensors is not None else None
        self.max_tensors = max_tensors
        self._pending: deque[tuple[int, HostCopy]] = deque()  # GPU steps whose records are still on their way
        # Steps not yet handed to the sinks: (step, wall time, tensors, scalar slots, loss, lr)
        self._kept: list[tuple[int, float, tuple[ScannedTensor, ...], np.ndarray, Any, Any]] = []
        self._gradients: GradientRows | None = None
        # The rows drawn, and their tensors' groups, per tensor list
        self._chosen: tuple[tuple[ScannedTensor, ...], list[int], list[str]] | None = None

    def add_sink(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def record(self, step: int, scan: StepScan | np.ndarray, tensors: Sequence[ScannedTensor], *, loss: Any = None,
               lr: Any = None) -> None:
        """A checked step: its StepScan (or, for a host scan, its records). Taken now when its records are on the
        host, else when they come back (poll)."""
        if isinstance(scan, np.ndarray):
            if not self._pending:  # a host scan's records are final and never rewritten (NOTE: [shared records])
                self._take(step, tuple(tensors), scan, loss, lr)
                return
            scan = completed_scan(tuple(tensors), scan, None, "")
        self._pending.append((step, HostCopy(scan, (loss, lr))))
        self.poll()

    def poll(self, *, wait: bool = False) -> None:
        """Take every step whose records are back, oldest first (wait=True: all of them, waiting for the GPU)."""
        while self._pending and (wait or self._pending[0][1].ready()):
            step, copy = self._pending.popleft()
            loss, lr = copy.scalars()
            self._take(step, copy.tensors, copy.records(), loss, lr)

    def _take(self, step: int, tensors: tuple[ScannedTensor, ...], records: np.ndarray, loss: Any, lr: Any) -> None:
        now = time.time()
        slots = records[:, : L.REC_HIST].copy()  # NOTE: [live export cost]
        bad = np.count_nonzero(slots[:, _NONFINITE]) > 0
        self._kept.append((step, now, tensors, slots, loss, lr))
        if bad or step % self.log_every == 0:
            gradients = self._gradients_of(tensors)
            rows, groups = self._rows(tensors)
            self._hand_off(module_norms=gradients.per_module(records),
                           histograms=exponent_histograms(tensors, records, rows, groups),
                           nonfinite=nonfinite_counts(tensors, records) if bad else ())
        elif len(self._kept) >= MAX_BUFFERED_STEPS or now - self._kept[0][1] >= MAX_BUFFERED_SECONDS:
            self._hand_off()
        if bad:  # the run may end here (on_invalid="raise"): the incident must be on disk, not in a buffer
            for sink in self.sinks:
                sink.flush()

    def _gradients_of(self, tensors: tuple[ScannedTensor, ...]) -> GradientRows:
        if self._gradients is None or self._gradients.tensors is not tensors:
            self._gradients = GradientRows(tensors)
        return self._gradients

    def _hand_off(self, **details: Any) -> None:
        """The kept steps' rows to every sink; the details given (StepRow's module_norms, histograms, nonfinite)
        belong to the last of them."""
        rows: list[StepRow] = []
        start = 0
        while start < len(self._kept):  # one run of steps per tensor list
            tensors = self._kept[start][2]
            end = start + 1
            while end < len(self._kept) and self._kept[end][2] is tensors:
                end += 1
            run = self._kept[start:end]
            scalars = step_scalars(self._gradients_of(tensors), np.stack([k[3] for k in run]),
                                   [k[4] for k in run], [k[5] for k in run])
            rows += [StepRow(k[0], k[1], s) for k, s in zip(run, scalars)]
            start = end
        self._kept.clear()
        if not rows:
            return
        if details:
            rows[-1] = replace(rows[-1], **details)
        for sink in self.sinks:
            sink.write(rows)

    def _rows(self, tensors: tuple[ScannedTensor, ...]) -> tuple[list[int], list[str]]:
        """The rows to draw histograms of, and their groups: those matching the patterns, at most max_tensors
        (chosen once per tensor list, so a run's tags stay the same)."""
        if self._chosen is None or self._chosen[0] != tensors:
            rows = [i for i, t in enumerate(tensors)
                    if self.patterns is None or any(fnmatch.fnmatchcase(t.name, p) for p in self.patterns)]
            if len(rows) > self.max_tensors:
                log.info("nanscan: histograms for %d of %d matching tensors (max_tensors=%d)",
                         self.max_tensors, len(rows), self.max_tensors)
            rows = rows[: self.max_tensors]
            self._chosen = (tensors, rows, [group_of(tensors[i].name) for i in rows])
        return self._chosen[1], self._chosen[2]

    def flush(self) -> None:
        """Hand every step still on its way to the sinks (waits for the GPU) and flush them."""
        self.poll(wait=True)
        self._hand_off()
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """flush(), then close the sinks (each closes only what it opened)."""
        try:
            self.poll(wait=True)
            self._hand_off()
        finally:
            for sink in self.sinks:
                sink.close()


def check_log_every(log_every: Any) -> None:
    if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
        raise ValueError(f"log_every={log_every!r}: write histograms every N steps, N >= 1")


def monitor_export(log_every: int | None,
                   targets: Sequence[tuple[str, Any, Callable[[Any], Any]]]) -> LiveExport | None:
    """The export for Monitor(tensorboard=..., wandb=..., log_every=...), or None when no sink is asked for.

    targets: (argument name, what the user passed or None, the sink module's as_sink) per sink. as_sink turns what
    was passed into a Sink, or returns a LiveExport given as is (one with its own choice of tensors); at most one
    may be given so, and the other sinks join it.
    """
    given = [(name, target, as_sink) for name, target, as_sink in targets if target is not None]
    if not given:
        if log_every is not None:
            names = " or ".join(f"{name}=" for name, _, _ in targets)
            raise ValueError(f"log_every={log_every!r} without {names}: say where to write the statistics")
        return None
    if log_every is not None:
        check_log_every(log_every)
    made: list[Any] = []
    try:
        for _, target, as_sink in given:
            made.append(as_sink(target))
        exports = [m for m in made if isinstance(m, LiveExport)]
        if len(exports) > 1:
            raise ValueError("more than one export object given (" + ", ".join(
                name for (name, _, _), m in zip(given, made) if isinstance(m, LiveExport)) + "): pass one, with its "
                "choice of tensors, and the others as a log directory or run")
        sinks = [m for m in made if not isinstance(m, LiveExport)]
        if not exports:
            return LiveExport(sinks, log_every=DEFAULT_LOG_EVERY if log_every is None else log_every)
        export = exports[0]
        if log_every is not None and log_every != export.log_every:
            raise ValueError(f"log_every={log_every!r} beside an export with log_every={export.log_every}: set it "
                             "in one place")
        for sink in sinks:
            export.add_sink(sink)
        return export
    except BaseException:
        for m in made:  # the files opened for sinks that will never be used
            if not isinstance(m, LiveExport):
                m.close()
        raise
