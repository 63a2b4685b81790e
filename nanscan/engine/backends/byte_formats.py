"""The one-byte (float8) formats as tables of their 256 bit patterns, for the numba and numba-cuda backends: per
pattern its value class, its histogram bin and the square of its magnitude.

Stated again from the bits and the format traits (classify.h, NOTE: [float8 specials]; nanscan.engine._layout.FORMATS),
as the numba backends state the wider formats: never from torch's own float8 conversions, which the reference
backend uses. The C++ kernel builds the same tables from classify.h itself (NOTE: [byte formats] in
csrc/cpu/scan_cpu.cpp).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from nanscan.engine import _layout as L

# Rows of the table: the value class (nanscan.engine._layout NORMAL .. NAN), the bin (-1 for zero, inf and NaN), the
# square.
TABLE_CLASS, TABLE_BIN, TABLE_SQUARE = 0, 1, 2


def classify_byte(bits: int, f: L.FormatTraits) -> tuple[int, int, float]:
    """(value class, histogram bin or -1, |x|) of one pattern of the one-byte format `f`."""
    sign = 1 << (f.exp_bits + f.mant_bits)
    a = bits & (sign - 1)
    field, mant = a >> f.mant_bits, a & ((1 << f.mant_bits) - 1)
    field_max = (1 << f.exp_bits) - 1
    if f.specials == L.IEEE_SPECIALS and field == field_max:
        return (L.NAN if mant else L.NEGINF if bits & sign else L.POSINF), -1, 0.0
    if (f.specials == L.NAN_ALL_ONES and a == sign - 1) or (f.specials == L.NAN_NEG_ZERO and bits == sign):
        return L.NAN, -1, 0.0
    if a == 0:
        return L.ZERO, -1, 0.0
    if field == 0:  # subnormal: exponent 1 - bias, no hidden bit
        exponent = 1 - f.bias - f.mant_bits + mant.bit_length() - 1
        value, cls = math.ldexp(mant, 1 - f.bias - f.mant_bits), L.SUBNORMAL
    else:
        exponent = field - f.bias
        value, cls = math.ldexp(mant | (1 << f.mant_bits), field - f.bias - f.mant_bits), L.NORMAL
    exponent = min(max(exponent, L.MIN_BIN_EXPONENT), L.MAX_BIN_EXPONENT)
    return cls, exponent - L.MIN_BIN_EXPONENT, value


@functools.cache
def byte_table(code: int) -> np.ndarray:
    """A (3, 256) float64 table of the format `code`: rows TABLE_CLASS, TABLE_BIN and TABLE_SQUARE. One float64
    array serves every row (classes and bins are small integers, exact in float64) so that a kernel takes one
    constant array whatever the format. Read-only: it is cached and shared."""
    f = L.FORMATS[code]
    if f.bytes != 1:
        raise ValueError(f"{L.DTYPE_NAMES[code]} is not a one-byte format")
    table = np.empty((3, 256), dtype=np.float64)
    for bits in range(256):
        cls, bin_, value = classify_byte(bits, f)
        table[:, bits] = cls, bin_, value * value
    table.setflags(write=False)
    return table
