"""Result types of a scan: per-tensor statistics (TensorStats) and the report over many tensors (ScanReport)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from nanscan import _layout as L


@dataclass(frozen=True)
class TensorStats:
    """What one scan found in one tensor. Counts are exact; `sumsq` is a float64 accumulation."""

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
    sumsq: float  # sum of x*x over finite values, accumulated in float64
    exp_hist: np.ndarray = field(repr=False)  # int64[256], bin = clamp(floor(log2|x|), -128, 127) + 128

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
        """L2 norm over the finite values."""
        return float(np.sqrt(self.sumsq))

    def to_dict(self, *, hist: bool = True) -> dict:
        out = {
            "name": self.name, "dtype": self.dtype, "device": self.device, "numel": self.numel,
            "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf, "zero": self.zero,
            "subnormal": self.subnormal, "finite": self.finite, "absmax": self.absmax,
            "absmin": self.absmin, "sumsq": self.sumsq,
        }
        if hist:
            out["exp_hist"] = [int(c) for c in self.exp_hist]
        return out

    @classmethod
    def from_record(cls, name: str, dtype: str, device: str, numel: int, scanned_code: int,
                    record: np.ndarray) -> "TensorStats":
        """Decode one stats record (NOTE: [stats record] in stats_record.h)."""
        absmin_bits = int(record[L.REC_ABSMIN_BITS])
        return cls(
            name=name, dtype=dtype, device=device, numel=numel,
            nan=int(record[L.REC_NAN]), posinf=int(record[L.REC_POSINF]), neginf=int(record[L.REC_NEGINF]),
            zero=int(record[L.REC_ZERO]), subnormal=int(record[L.REC_SUBNORMAL]),
            absmax=L.abs_bits_to_float(int(record[L.REC_ABSMAX_BITS]), scanned_code),
            absmin=0.0 if absmin_bits == L.ABSMIN_NONE else L.abs_bits_to_float(absmin_bits, scanned_code),
            sumsq=float(record[L.REC_SUMSQ : L.REC_SUMSQ + 1].view(np.float64)[0]),
            exp_hist=record[L.REC_HIST:].copy(),
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
    scanned_code: int  # the format its elements were scanned as (nanscan._layout dtype code)


class ScanReport:
    """Statistics of every tensor of one scan, kept as the raw records; TensorStats are decoded on demand.

    The every-step path asks only `.ok` and `.nonfinite`, which read the record array directly, so a healthy step
    never builds hundreds of Python objects.
    """

    def __init__(self, tensors: Sequence[ScannedTensor], records: np.ndarray, *, skipped: Sequence[str] = (),
                 backend: str = "", step: int | None = None):
        if records.shape != (len(tensors), L.RECORD_WIDTH):
            raise ValueError(f"records has shape {records.shape}, expected ({len(tensors)}, {L.RECORD_WIDTH})")
        self.tensors = list(tensors)
        self.records = records
        self.skipped = list(skipped)
        self.backend = backend
        self.step = step
        self._index = {t.name: i for i, t in enumerate(self.tensors)}

    # -- every-step questions: vectorised over the record array --------------------------------------------
    @property
    def ok(self) -> bool:
        """True when no scanned tensor holds a NaN or an infinity."""
        return not self.records[:, L.REC_NAN : L.REC_NEGINF + 1].any()

    @property
    def nonfinite(self) -> list[str]:
        """Names of the tensors holding a NaN or an infinity, in scan order."""
        bad = np.flatnonzero(self.records[:, L.REC_NAN : L.REC_NEGINF + 1].any(axis=1))
        return [self.tensors[i].name for i in bad]

    # -- decoded views -------------------------------------------------------------------------------------
    @cached_property
    def stats(self) -> list[TensorStats]:
        return [TensorStats.from_record(t.name, t.dtype, t.device, t.numel, t.scanned_code, r)
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
            exp_hist=r[:, L.REC_HIST:].sum(axis=0) if len(r) else np.zeros(L.HIST_BINS, np.int64),
        )

    def to_dict(self, *, hist: bool = True) -> dict:
        t = self.totals
        return {
            "ok": self.ok, "step": self.step, "backend": self.backend, "nonfinite": self.nonfinite,
            "skipped": self.skipped,
            "totals": {"tensors": t.tensors, "numel": t.numel, "nan": t.nan, "posinf": t.posinf,
                       "neginf": t.neginf, "zero": t.zero, "subnormal": t.subnormal, "finite": t.finite,
                       "absmax": t.absmax, "sumsq": t.sumsq},
            "tensors": [s.to_dict(hist=hist) for s in self.stats],
        }

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"non-finite in {len(self.nonfinite)} tensor(s): {self.nonfinite[:5]}"
        return f"ScanReport({len(self)} tensors, {state}, backend={self.backend!r}, step={self.step})"
