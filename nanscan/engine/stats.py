"""Result types of a scan: per-tensor statistics (TensorStats), the report over many tensors (ScanReport), the
report of a scan that may still be running on a GPU (PendingReport) and the loss scale its gradients carried
(Scaling).

NOTE: [shared records]
A host scan's records array is handed out as it is, not copied: the step's ScanReport, its StepScan and the live
export (nanscan.integrations) read the same array, so it is made read-only where the scan returns it. The history
ring keeps its own compact copy (NOTE: [history ring] in nanscan.runtime.history).

NOTE: [unscaled gradients]
Under a GradScaler the scanned gradients are the real ones times the loss scale S. The records keep what the scan
saw (the scaled tensors); every decoded view of a `grad:` row (TensorStats, totals, to_dict, headroom and grad
norms built on them) describes the real gradients x / S, whenever S = 2**e is a power of two (GradScaler's
defaults keep it one: init 2**16, growth 2, backoff 0.5). Dividing by 2**e is exact, so:
- the exponent histogram moves down by e bins: bin b's count goes to clamp(b - e, 0, 255), counts that land
  beyond an end merge into it exactly as clamp(floor(log2|x / S|), -128, 127) would put them;
- absmax and absmin are the scaled extremes times 2**-e, as float64 (exact: no fp16, bf16 or fp32 extreme times a
  float32 power of two leaves float64's range), not rounded back into the tensor's dtype;
- sumsq is divided by 4**e (exact in float64, it is a power of two);
- the counts (NaN, +-inf, zero, subnormal) stay the scanned tensor's: a power-of-two division keeps a value
  non-finite, zero or non-zero, and `subnormal` tells how the stored tensor holds its values.
The one inexact case is an end bin whose values have unknown binades: it moves as if they sat at the clamp's edge.
Bin 0 (values below 2**-127) is exact under e >= 0 (it stays bin 0) but under a scale below 1 (e < 0) moves up by
-e from -128 although its values may lie lower (fp32 subnormals reach 2**-149); bin 255 is exact for fp16, bf16 and
fp32 (no value reaches 2**128), and for a float64 tensor under e > 0 it moves down to 127 - e, the lower bound of
its values. A scale that is not a power of two leaves the views scaled (Scaling.unscaled is False and the report
says so), as does a scaler whose unscale_() already ran (the gradients are real then: Scaling.scaled is False).
The fingerprint (NOTE: [scan fingerprint] in csrc/include/nanscan/stats_record.h) is always that of the bits the
scan read: of the scaled gradients, which no division undoes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.incident import is_kind


def gradient_rows(tensors: Sequence["ScannedTensor"]) -> np.ndarray:
    """The rows of a scan's records that hold gradients (`grad:` tensors), in record order."""
    return np.array([i for i, t in enumerate(tensors) if is_kind(t.name, "gradient")], dtype=np.int64)


def lower_median(values: Sequence[float]) -> float:
    """The lower median (of an even count, the smaller middle value), as torch.nanmedian takes it: the spike
    statistic's host and device medians agree on it (nanscan.runtime.spikes NOTE: [spike statistic])."""
    return sorted(values)[(len(values) - 1) // 2]


def unscaled_hist(exp_hist: np.ndarray, exponent: int) -> np.ndarray:
    """The exponent histogram of x / 2**exponent from that of x (NOTE: [unscaled gradients])."""
    if exponent == 0:
        return exp_hist.copy()
    out = np.zeros(L.HIST_BINS, dtype=np.int64)
    np.add.at(out, np.clip(np.arange(L.HIST_BINS) - exponent, 0, L.HIST_BINS - 1), exp_hist)
    return out


def _times_power_of_two(value: float, exponent: int) -> float:
    try:
        return math.ldexp(value, exponent)
    except OverflowError:  # a float64 sumsq near its ceiling under a scale below 1
        return math.inf


def power_of_two_exponent(value: float) -> int | None:
    """e when value == 2**e exactly, else None (a scale of 1000 cannot be divided out exactly)."""
    if not (value > 0 and math.isfinite(value)):
        return None
    mantissa, exponent = math.frexp(value)
    return exponent - 1 if mantissa == 0.5 else None


class Scaling:
    """The loss scale at one check and whether the scanned gradients carry it (NOTE: [unscaled gradients]).

    `value`: a float, or for a GPU scaler a 0-dim pinned host tensor that a non-blocking copy fills before `event`
    (so reading it waits for that copy only, which the verdict of its step has already waited for). `scaled`:
    False when GradScaler.unscale_() ran before the check, so the gradients are already the real ones."""

    __slots__ = ("_value", "_event", "scaled", "backoff", "tensor")

    def __init__(self, value: Any, scaled: bool, *, event: Any = None, backoff: float = 0.5,
                 tensor: torch.Tensor | None = None):
        self._value, self._event, self.scaled, self.backoff = value, event, scaled, backoff
        # The scaler's own scale tensor, for device-side use in stream order (spike statistics), None for a float.
        self.tensor = tensor

    @property
    def scale(self) -> float:
        """The scale, read from host memory (a GPU scaler's after its copy's event)."""
        if not isinstance(self._value, float):
            if self._event is not None:
                self._event.synchronize()
            self._value, self._event = float(self._value), None
        return self._value

    @property
    def grad_exponent(self) -> int:
        """e where the scanned gradients are the real ones times 2**e; 0 when they are not scaled or cannot be
        unscaled exactly (see `unscaled`)."""
        if not self.scaled:
            return 0
        return power_of_two_exponent(self.scale) or 0

    @property
    def unscaled(self) -> bool:
        """Whether the decoded gradient statistics describe the real gradients."""
        return not self.scaled or power_of_two_exponent(self.scale) is not None

    def to_dict(self) -> dict:
        return {"scale": self.scale, "grads_scaled": self.scaled, "grad_exponent": self.grad_exponent,
                "stats_unscaled": self.unscaled}


@dataclass(frozen=True)
class TensorStats:
    """What one scan found in one tensor. Counts are exact; `sumsq` is a float64 accumulation.

    `fingerprint`: an exact 64-bit fingerprint of the tensor's bits, as an unsigned int (NOTE: [scan fingerprint] in
    csrc/include/nanscan/stats_record.h; docs/scan.md): equal tensors, bit for bit and element for element, give equal
    ones; one changed element, or two unequal ones swapped, gives another. None for a record stored without it (a
    bundle written before fingerprints were).

    The squares of float16, bfloat16 and float32 values are exact in float64 and their sum cannot leave its range.
    A float64 tensor's can: `sumsq` (and `norm`) is +inf once the sum passes the float64 maximum (about 1.8e308,
    e.g. from two values of 1e154, or one above 2**512) although every value is finite, and a square below about
    2**-1075 (values under about 2**-537) adds 0. Whether values are finite is told by the counts, never by sumsq.
    """

    name: str
    dtype: str  # the tensor's own dtype, e.g. "bfloat16" or "complex64"
    device: str
    numel: int  # scanned elements (a complex tensor counts its real and imaginary parts)
    nan: int
    posinf: int
    neginf: int
    zero: int
    subnormal: int
    absmax: float  # largest |x| over finite values (0.0 if none)
    absmin: float  # smallest |x| over finite non-zero values (0.0 if none)
    sumsq: float  # sum of x*x over finite values, accumulated in float64 (float64 tensors: may be inf, see above)
    exp_hist: np.ndarray = field(repr=False)  # int64[256], bin = clamp(floor(log2|x|), -128, 127) + 128
    fingerprint: int | None = None  # unsigned 64-bit (NOTE: [scan fingerprint])

    @property
    def finite(self) -> int:
        return self.numel - self.nan - self.posinf - self.neginf

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0

    @property
    def norm(self) -> float:
        """L2 norm over the finite values, sqrt(sumsq): +inf where a float64 tensor's sumsq overflowed."""
        return float(np.sqrt(self.sumsq))

    def to_dict(self, *, hist: bool = True) -> dict:
        out = {
            "name": self.name, "dtype": self.dtype, "device": self.device, "numel": self.numel,
            "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf, "zero": self.zero,
            "subnormal": self.subnormal, "finite": self.finite, "absmax": self.absmax,
            "absmin": self.absmin, "sumsq": self.sumsq, "fingerprint": self.fingerprint,
        }
        if hist:
            out["exp_hist"] = [int(c) for c in self.exp_hist]
        return out

    @classmethod
    def from_record(cls, name: str, dtype: str, device: str, numel: int, scanned_code: int,
                    record: np.ndarray, scale_exponent: int = 0, fingerprinted: bool = True) -> "TensorStats":
        """Decode one stats record (NOTE: [stats record] in stats_record.h); `scale_exponent`: e of a record
        scanned from x * 2**e, decoded as x (NOTE: [unscaled gradients]); `fingerprinted`: False for a record
        stored without its fingerprint (its slot is 0 and means nothing)."""
        absmin_bits = int(record[L.REC_ABSMIN_BITS])
        absmax = L.abs_bits_to_float(int(record[L.REC_ABSMAX_BITS]), scanned_code)
        absmin = 0.0 if absmin_bits == L.ABSMIN_NONE else L.abs_bits_to_float(absmin_bits, scanned_code)
        sumsq = float(record[L.REC_SUMSQ : L.REC_SUMSQ + 1].view(np.float64)[0])
        return cls(
            name=name, dtype=dtype, device=device, numel=numel,
            nan=int(record[L.REC_NAN]), posinf=int(record[L.REC_POSINF]), neginf=int(record[L.REC_NEGINF]),
            zero=int(record[L.REC_ZERO]), subnormal=int(record[L.REC_SUBNORMAL]),
            absmax=_times_power_of_two(absmax, -scale_exponent), absmin=_times_power_of_two(absmin, -scale_exponent),
            sumsq=_times_power_of_two(sumsq, -2 * scale_exponent),
            exp_hist=unscaled_hist(record[L.REC_HIST:L.REC_HIST_END], scale_exponent),
            fingerprint=int(record[L.REC_FINGERPRINT : L.REC_FINGERPRINT + 1].view(np.uint64)[0]) if fingerprinted
            else None,
        )


@dataclass(frozen=True)
class Totals:
    """Counts summed over every scanned tensor of a report."""

    tensors: int
    numel: int
    nan: int
    posinf: int
    neginf: int
    zero: int
    subnormal: int
    finite: int
    absmax: float
    sumsq: float
    exp_hist: np.ndarray = field(repr=False)

    @property
    def norm(self) -> float:
        return float(np.sqrt(self.sumsq))


class ScannedTensor(NamedTuple):
    """Identity of one scanned tensor, in record order (a tuple: hundreds are made every step)."""

    name: str
    dtype: str
    device: str
    numel: int
    scanned_code: int  # the format its elements were scanned as (nanscan.engine._layout dtype code)


def _check_records(records: np.ndarray, tensors: Sequence[ScannedTensor]) -> np.ndarray:
    if records.shape != (len(tensors), L.RECORD_WIDTH):
        raise ValueError(f"records has shape {records.shape}, expected ({len(tensors)}, {L.RECORD_WIDTH})")
    return records


def _flag(nonfinite: bool) -> torch.Tensor:
    return torch.tensor(1.0 if nonfinite else 0.0, dtype=torch.float32)


class ScanReport:
    """Statistics of every tensor of one scan, kept as the raw records; TensorStats are decoded on demand.

    The every-step path asks only `.ok` and `.nonfinite`, which read the record array directly, so a healthy step
    never builds hundreds of Python objects.

    `found_inf`: a float32 tensor of shape (), 1.0 when any scanned value is NaN or infinite, else 0.0, in the form
    torch's fused optimizers take to skip an update without a host sync (see `Monitor`): the CUDA kernel's device
    flag when the Monitor scanned on a GPU, else a CPU tensor made from the records.

    `tensors` is kept as a tuple, so the identities of a step are shared by its report and the Monitor's history
    rather than copied. `any_nonfinite`: the verdict when the scan already gave it (the native CPU backend does),
    else it is read from the records when asked.

    Under a GradScaler (nanscan.runtime.amp): `scaling` is the loss scale the gradients were scanned under, `scale` its
    value, and the decoded gradient statistics are unscaled (NOTE: [unscaled gradients]); `overflow_skip` is True
    when this step's only non-finite tensors were gradients, which GradScaler skips (NOTE: [overflow skips] in
    nanscan.runtime.amp). Without a scaler: None, None and False.
    `spike`: the nanscan.runtime.spikes.Spike the Monitor found at this check (a finite step far outside its recent
    range), else None.
    `fingerprinted`: False for records stored without their fingerprints (a bundle written before they were): each
    TensorStats.fingerprint is then None, and so is `fingerprints`.
    """

    spike = None
    fingerprinted = True

    def __init__(self, tensors: Sequence[ScannedTensor], records: np.ndarray, *, skipped: Sequence[str] = (),
                 backend: str = "", step: int | None = None, found_inf: torch.Tensor | None = None,
                 any_nonfinite: bool | None = None, scaling: Scaling | None = None, overflow_skip: bool = False,
                 fingerprinted: bool = True):
        self.tensors = tuple(tensors)
        self.records = _check_records(records, self.tensors)
        self.fingerprinted = fingerprinted
        self.skipped = list(skipped)
        self.backend = backend
        self.step = step
        self._found_inf = found_inf
        self._any_nonfinite = any_nonfinite
        self.scaling = scaling
        self.overflow_skip = overflow_skip

    @cached_property
    def _index(self) -> dict[str, int]:  # built on first lookup by name, not on the every-step path
        return {t.name: i for i, t in enumerate(self.tensors)}

    # -- every-step questions: vectorised over the record array --------------------------------------------
    @property
    def ok(self) -> bool:
        """True when no scanned tensor holds a NaN or an infinity."""
        if self._any_nonfinite is None:
            self._any_nonfinite = L.any_nonfinite(self.records)
        return not self._any_nonfinite

    @property
    def found_inf(self) -> torch.Tensor:
        """1.0 (float32, shape ()) when this scan saw a NaN or an infinity, else 0.0; see the class docstring."""
        if self._found_inf is None:
            self._found_inf = _flag(not self.ok)
        return self._found_inf

    @property
    def fingerprints(self) -> dict[str, int] | None:
        """Each tensor's fingerprint by name, as unsigned 64-bit ints (NOTE: [scan fingerprint] in
        csrc/include/nanscan/stats_record.h), read from the records without decoding them; None when the records
        were stored without them."""
        if not self.fingerprinted:
            return None
        return {t.name: int(f) for t, f in zip(self.tensors, L.fingerprints(self.records))}

    @property
    def nonfinite(self) -> list[str]:
        """Names of the tensors holding a NaN or an infinity, in scan order."""
        bad = np.flatnonzero(self.records[:, L.REC_NAN : L.REC_NEGINF + 1].any(axis=1))
        return [self.tensors[i].name for i in bad]

    # -- decoded views -------------------------------------------------------------------------------------
    @property
    def scale(self) -> float | None:
        """The loss scale at this check (nanscan.runtime.amp), or None without a scaler."""
        return None if self.scaling is None else self.scaling.scale

    @property
    def _grad_exponent(self) -> int:
        return 0 if self.scaling is None else self.scaling.grad_exponent

    @cached_property
    def stats(self) -> list[TensorStats]:
        exponent = self._grad_exponent
        return [TensorStats.from_record(t.name, t.dtype, t.device, t.numel, t.scanned_code, r,
                                        exponent if exponent and is_kind(t.name, "gradient") else 0,
                                        self.fingerprinted)
                for t, r in zip(self.tensors, self.records)]

    def __getitem__(self, name: str) -> TensorStats:
        try:
            return self.stats[self._index[name]]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this scan report") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[TensorStats]:
        return iter(self.stats)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @cached_property
    def totals(self) -> Totals:
        r = self.records
        counts = r[:, : L.REC_SUBNORMAL + 1].sum(axis=0) if len(r) else np.zeros(L.REC_SUBNORMAL + 1, np.int64)
        numel = sum(t.numel for t in self.tensors)
        nan, posinf, neginf, zero, subnormal = (int(c) for c in counts)
        return Totals(
            tensors=len(self.tensors), numel=numel, nan=nan, posinf=posinf, neginf=neginf, zero=zero,
            subnormal=subnormal, finite=numel - nan - posinf - neginf,
            absmax=max((s.absmax for s in self.stats), default=0.0),
            sumsq=float(sum(s.sumsq for s in self.stats)),
            exp_hist=self._total_hist(),
        )

    def _total_hist(self) -> np.ndarray:
        if not len(self.records):
            return np.zeros(L.HIST_BINS, np.int64)
        if self._grad_exponent:  # the gradients' rows decoded unscaled (NOTE: [unscaled gradients])
            return np.sum([s.exp_hist for s in self.stats], axis=0)
        return self.records[:, L.REC_HIST:L.REC_HIST_END].sum(axis=0)

    def to_dict(self, *, hist: bool = True) -> dict:
        t = self.totals
        out = {
            "ok": self.ok, "step": self.step, "backend": self.backend, "nonfinite": self.nonfinite,
            "skipped": self.skipped,
            "totals": {"tensors": t.tensors, "numel": t.numel, "nan": t.nan, "posinf": t.posinf,
                       "neginf": t.neginf, "zero": t.zero, "subnormal": t.subnormal, "finite": t.finite,
                       "absmax": t.absmax, "sumsq": t.sumsq},
            "tensors": [s.to_dict(hist=hist) for s in self.stats],
        }
        if self.scaling is not None:
            out["scaler"] = {**self.scaling.to_dict(), "overflow_skip": self.overflow_skip}
        return out

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"non-finite in {len(self.nonfinite)} tensor(s): {self.nonfinite[:5]}"
        return f"ScanReport({len(self)} tensors, {state}, backend={self.backend!r}, step={self.step})"


class PendingScan(Protocol):
    """A launched scan (nanscan.engine.pending): its flag at once, `ready()` without blocking, `records()` waiting."""

    found_inf: torch.Tensor

    def ready(self) -> bool: ...

    def records(self) -> np.ndarray: ...


class PendingReport(ScanReport):
    """What Monitor.check returns in mode="async": the report of a scan that may still be running on the GPU.
    Nothing here waits for the GPU unless asked to.

    Known at once: `step`, `tensors`, `names`, `skipped`, `backend`, `found_inf` (this step's flag, on the GPU
    for a GPU scan: pass it to a fused optimizer; `found_inf` given here replaces the scan's, e.g. the Monitor's
    flag that also holds a spike), `ready()`, `ok`, `overflow_skip` and `spike` (the spike of `decided_step`, if it
    was one).

    `ok` is the verdict the Monitor acted on at this check: False when the step it decided here (`decided_step`,
    the previous one, whose scan has finished by now) was non-finite and on_invalid did not raise, else True.
    `overflow_skip` is, like `ok`, about `decided_step`: True when that step was a GradScaler overflow skip.
    This step's own verdict arrives at the next check, or at Monitor.flush(); `scale` is this step's (for a GPU
    scaler, reading it waits for its copy).

    Waiting for the scan (a host sync on a GPU): `records` and all that is decoded from it (`stats`, `nonfinite`,
    `totals`, `report[name]`, `to_dict()`), and `result()`, the finished ScanReport of this step.
    """

    def __init__(self, tensors: Sequence[ScannedTensor], scan: PendingScan, *, skipped: Sequence[str] = (),
                 backend: str = "", step: int | None = None, ok: bool = True, decided_step: int | None = None,
                 scaling: Scaling | None = None, overflow_skip: bool = False,
                 found_inf: torch.Tensor | None = None):
        self.tensors = tuple(tensors)
        self.skipped = list(skipped)
        self.backend = backend
        self.step = step
        self.decided_step = decided_step
        self._scan = scan
        self._records: np.ndarray | None = None
        self._verdict_ok = ok
        self.scaling = scaling
        self.overflow_skip = overflow_skip
        self._found_inf = found_inf

    @property
    def records(self) -> np.ndarray:
        """This step's records, waiting for the scan if it is still running."""
        if self._records is None:
            self._records = _check_records(self._scan.records(), self.tensors)
        return self._records

    @property
    def ok(self) -> bool:
        return self._verdict_ok

    @property
    def found_inf(self) -> torch.Tensor:
        return self._scan.found_inf if self._found_inf is None else self._found_inf

    def ready(self) -> bool:
        """True once the scan has finished, so reading `records` will not wait (never blocks)."""
        return self._records is not None or self._scan.ready()

    def result(self) -> ScanReport:
        """This step's finished report (waits for the scan); its `ok` is this step's own verdict."""
        return ScanReport(self.tensors, self.records, skipped=self.skipped, backend=self.backend, step=self.step,
                          found_inf=self.found_inf, scaling=self.scaling)

    def __repr__(self) -> str:
        if self.ready():
            bad = self.nonfinite
            scan = f"non-finite in {len(bad)} tensor(s): {bad[:5]}" if bad else "finite"
        else:
            scan = "scan still running"
        return (f"PendingReport({len(self)} tensors, step {self.step}: {scan}; ok={self.ok} (decided step "
                f"{self.decided_step}), backend={self.backend!r})")
