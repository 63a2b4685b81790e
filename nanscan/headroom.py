"""Mixed-precision headroom from an exponent histogram: which fraction of a tensor's values would overflow,
turn subnormal, or flush to zero if it were stored in float16, bfloat16 or float8, counted in whole binades.

A histogram bin holds every value with the same floor(log2|x|), so the answer is exact at binade granularity:
a value counts as overflowing when its binade lies above the format's largest finite binade (values inside the
top binade but above the format's maximum, e.g. 65520 in float16, are counted as fitting).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanscan import _layout as L


@dataclass(frozen=True)
class Format:
    name: str
    max_binade: int  # floor(log2(largest finite))
    min_normal_binade: int  # floor(log2(smallest normal))
    min_subnormal_binade: int  # floor(log2(smallest subnormal)); below it a value flushes to zero


FORMATS = (
    Format("float16", 15, -14, -24),
    Format("bfloat16", 127, -126, -133),
    Format("float8_e4m3fn", 8, -6, -9),
    Format("float8_e5m2", 15, -14, -16),
)


@dataclass(frozen=True)
class Headroom:
    format: str
    values: int  # finite non-zero values in the histogram
    overflow: float  # fraction that would become inf (or NaN in e4m3fn)
    subnormal: float  # fraction that would be stored as subnormals (lost precision)
    underflow: float  # fraction that would flush to zero
    top_binade: int | None  # highest occupied binade, None when the histogram is empty
    binades_to_overflow: int | None  # how many binades the largest value may still grow before overflow

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def headroom(exp_hist, formats=FORMATS) -> list[Headroom]:
    """Headroom of the values in `exp_hist` (256 bins as in TensorStats.exp_hist) for each format.

    The histogram's end bins are clamped (bin 0 holds every value below 2**-127, bin 255 every value of 2**127 and
    above), so for bfloat16 the subnormal and underflow split below 2**-127 is not resolved: those values are
    reported as subnormal.
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
        over = int(hist[binades > fmt.max_binade].sum())
        under = int(hist[binades < fmt.min_subnormal_binade].sum())
        sub = int(hist[(binades >= fmt.min_subnormal_binade) & (binades < fmt.min_normal_binade)].sum())
        if fmt.min_subnormal_binade < L.MIN_BIN_EXPONENT:  # clamped bin 0 cannot be split
            sub, under = sub + under, 0
        frac = (lambda n: n / total) if total else (lambda n: 0.0)
        out.append(Headroom(fmt.name, total, frac(over), frac(sub), frac(under), top,
                            None if top is None else fmt.max_binade - top))
    return out
