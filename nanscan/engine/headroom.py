"""Mixed-precision headroom from an exponent histogram: which fraction of a tensor's values would overflow,
turn subnormal, or flush to zero if it were stored in float16, bfloat16 or float8, counted in whole binades.

A histogram bin holds every value with the same floor(log2|x|), so each binade is counted on the side where a cast
(round to nearest, ties to even) puts almost all of it. The fractions agree with such a cast except here (torch
casts float64 through float32, which can move a float64 value within half a float32 ulp of an edge across it):
- values in the format's top binade that round above its largest finite value are counted as fitting: float16
  [65520, 65536), bfloat16 [2**128 - 2**119, 2**128), float8_e4m3fn (464, 512), float8_e5m2 [61440, 65536) (the
  last two are 3/16 and 1/8 of their binade);
- values in the binade just below the smallest normal that round up to it are counted as subnormal: float16
  [2**-14 - 2**-25, 2**-14), bfloat16 [2**-126 - 2**-134, 2**-126), float8_e4m3fn [1.875 * 2**-7, 2**-6),
  float8_e5m2 [1.75 * 2**-15, 2**-14) (1/16 and 1/4 of their binade);
- the binade just below the smallest subnormal rounds up to the smallest subnormal, all but its lower end, which
  is a tie that rounds to zero: that one value (2**-25 in float16) is counted as subnormal with the rest;
- the histogram's clamped end bins (see `headroom`).
Only finite non-zero values are counted: zeros stay zero and non-finite values are not in the histogram.

float8_e4m3fn has no infinity, and what a cast does with an overflowing value depends on the torch release: torch
2.11 (CPU and CUDA) makes it NaN, torch 2.13's CPU cast saturates it, and an infinity, to +-448.

Saturating casts (float8 training recipes such as torchao's and Transformer Engine's clamp to +-largest finite
before the cast) turn overflow into values pinned at the largest finite magnitude (448, 57344), and a scale that
drifts too low shows as values below the smallest subnormal. For the float8 formats `saturated` and
`saturated_at_most` bound the share of values at or beyond the largest finite magnitude: its top binade holds
values on both sides of it (e4m3fn [256, 512) around 448), which a histogram cannot split, so the lower bound
counts the binades above it and the upper bound the top binade too (with `absmax`, a tensor whose largest value is
below it has none there). `below_smallest_subnormal` is the share below the smallest subnormal magnitude, which a
cast rounds up to that subnormal or to zero (`underflow` is its part that becomes zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from nanscan.engine import _layout as L
from nanscan.incident import tensor_kind


# NOTE: [overflow] A finite value with |x| >= 2**64 is an overflow value: its square is past the float32 maximum
# (just under 2**128), so a squared error or an L2 norm computed over it in float32 is inf, and so is any such
# square in bfloat16, which has float32's exponent range; under float16 autocast any |x| above 65504, float16's
# largest finite value, is already out of range. The scan counts the first kind for free: the finite non-zero values
# in the exponent histogram's bins for exponents 64 and up. Infinities and NaN are never counted here. `nanscan
# data` reports such values as `overflow`; the Monitor names an input holding them as the likely cause of a step
# that then goes non-finite (nanscan.incident.INPUT_OVERFLOW).
OVERFLOW_EXPONENT = 64
OVERFLOW_MIN = 2.0 ** OVERFLOW_EXPONENT
FLOAT16_MAX = 65504.0
_OVERFLOW_BINS = slice(OVERFLOW_EXPONENT - L.MIN_BIN_EXPONENT, L.HIST_BINS)


def overflow_count(stats) -> int:
    """How many values of a scanned tensor (a nanscan TensorStats) are overflow values (NOTE: [overflow])."""
    return int(stats.exp_hist[_OVERFLOW_BINS].sum())


def overflow_counts(records: np.ndarray) -> np.ndarray:
    """overflow_count for raw stats records (one row per scanned tensor, laid out as in nanscan.engine._layout)."""
    return records[:, L.REC_HIST:L.REC_HIST_END][:, _OVERFLOW_BINS].sum(axis=1)


def out_of_range(stats, compute_dtype: str | None = None) -> bool:
    """Whether a scanned tensor holds finite values beyond the range a step computing in `compute_dtype` (the
    autocast dtype; None: float32) can square or hold (NOTE: [overflow])."""
    absmax = stats.absmax
    if absmax is None or not np.isfinite(absmax):
        return overflow_count(stats) > 0
    return absmax >= OVERFLOW_MIN or (compute_dtype == "float16" and absmax > FLOAT16_MAX)


def range_limit_text(compute_dtype: str | None = None) -> str:
    return "above 65504, float16's largest value" if compute_dtype == "float16" else \
        "|x| >= 2**64, whose squares overflow float32"


def overflowing_inputs(stats: Iterable, compute_dtype: str | None = None) -> list[str]:
    """The batch tensors (input:) among `stats` (TensorStats) that are out_of_range."""
    return [s.name for s in stats if tensor_kind(s.name) == "input" and out_of_range(s, compute_dtype)]


@dataclass(frozen=True)
class Format:
    name: str
    max_binade: int  # floor(log2(largest finite))
    min_normal_binade: int  # floor(log2(smallest normal))
    # floor(log2(smallest subnormal)); the binade below it still rounds up to it, the binades below that flush to 0
    min_subnormal_binade: int
    # The largest finite magnitude, for formats that are cast with saturation (float8): see `saturated`.
    max_finite: float | None = None


FORMATS = (
    Format("float16", 15, -14, -24),
    Format("bfloat16", 127, -126, -133),
    Format("float8_e4m3fn", 8, -6, -9, 448.0),
    Format("float8_e5m2", 15, -14, -16, 57344.0),
)


@dataclass(frozen=True)
class Headroom:
    format: str
    values: int  # finite non-zero values in the histogram: the fractions below are shares of these
    overflow: float  # fraction above the format's range: inf, or in e4m3fn NaN or +-448 (see the module docstring)
    subnormal: float  # fraction that would be stored as subnormals (lost precision)
    underflow: float  # fraction that would flush to zero
    top_binade: int | None  # highest occupied binade (at most 127: bin 255 is clamped), None for an empty histogram
    binades_to_overflow: int | None  # how many binades the largest value may still grow before overflow
    # Share of values at or beyond the largest finite magnitude, which a saturating cast pins there: at least
    # `saturated`, at most `saturated_at_most` (the module docstring says why two); None for formats without
    # max_finite.
    saturated: float | None = None
    saturated_at_most: float | None = None
    below_smallest_subnormal: float = 0.0  # fraction below the smallest subnormal: rounds up to it or to zero

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def headroom(exp_hist, formats=FORMATS, *, absmax: float | None = None) -> list[Headroom]:
    """Headroom of the values in `exp_hist` (256 bins as in TensorStats.exp_hist) for each format, in whole
    binades (the module docstring lists where that differs from a cast). `absmax` (TensorStats.absmax of the same
    tensor), when given, sharpens the bounds on the saturated share.

    The histogram's end bins are clamped, and the formats whose range reaches them cannot be resolved there:
    - bin 0 holds every value below 2**-127, so for bfloat16 its subnormal and underflow split is unknown: those
      values are reported as subnormal;
    - bin 255 holds every value of 2**127 and above, so for a format whose top binade is 127 (bfloat16; float32
      as nanscan.review.summary adds it) a float64 tensor's values of 2**128 and above, which overflow it, are counted as
      fitting, and top_binade stays 127; TensorStats.absmax tells them apart.
    """
    hist = np.asarray(exp_hist, dtype=np.int64)
    if hist.shape != (L.HIST_BINS,):
        raise ValueError(f"exp_hist must have {L.HIST_BINS} bins, got shape {hist.shape}")
    binades = np.arange(L.HIST_BINS) + L.MIN_BIN_EXPONENT
    total = int(hist.sum())
    occupied = np.flatnonzero(hist)
    top = int(binades[occupied[-1]]) if len(occupied) else None
    out = []
    for fmt in formats:
        # Half the smallest subnormal is the tie between it and zero: the binade it opens rounds up (but for that
        # one value), the ones below round to zero. Bin 0 lands on the rounding-up side whenever the format's
        # subnormals reach below 2**-127 (bfloat16), which is how the unresolved clamped bin becomes "subnormal".
        flushes_below = fmt.min_subnormal_binade - 1
        over = int(hist[binades > fmt.max_binade].sum())
        under = int(hist[binades < flushes_below].sum())
        sub = int(hist[(binades >= flushes_below) & (binades < fmt.min_normal_binade)].sum())
        frac = (lambda n: n / total) if total else (lambda n: 0.0)
        below = int(hist[binades < fmt.min_subnormal_binade].sum())
        saturated = saturated_at_most = None
        if fmt.max_finite is not None:
            at_least, at_most = over, over + int(hist[binades == fmt.max_binade].sum())
            if absmax is not None and total:
                if absmax < fmt.max_finite:
                    at_least = at_most = 0
                else:  # the largest value itself is at or beyond it
                    at_least = max(at_least, 1)
            saturated, saturated_at_most = frac(at_least), frac(at_most)
        out.append(Headroom(fmt.name, total, frac(over), frac(sub), frac(under), top,
                            None if top is None else fmt.max_binade - top, saturated, saturated_at_most,
                            frac(below)))
    return out


MIXED_PRECISION_KINDS = ("input", "parameter", "gradient")


def headroom_by_kind(report, kinds=MIXED_PRECISION_KINDS, formats=FORMATS) -> dict[str, list[Headroom]]:
    """Headroom per kind of scanned tensor (activations, weights, gradients: NOTE: [tensor names]) of a report,
    its tensors' histograms summed; a report's gradient histograms are unscaled (NOTE: [unscaled gradients]).
    Kinds with no tensor in the report are left out."""
    sums: dict[str, np.ndarray] = {}
    for stats in report:
        kind = tensor_kind(stats.name)
        if kind in kinds:
            sums[kind] = sums.get(kind, 0) + stats.exp_hist
    return {kind: headroom(sums[kind], formats) for kind in kinds if kind in sums}
