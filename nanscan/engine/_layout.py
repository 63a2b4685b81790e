"""Python mirror of the native layout constants (csrc/include/nanscan/classify.h and stats_record.h).

A test checks these against the compiled extension, so the two cannot drift silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Dtype codes (classify.h, enum DType): appended, never renumbered.
FLOAT16, BFLOAT16, FLOAT32, FLOAT64 = 0, 1, 2, 3
FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT8_E4M3FNUZ, FLOAT8_E5M2FNUZ = 4, 5, 6, 7
DTYPE_NAMES = {FLOAT16: "float16", BFLOAT16: "bfloat16", FLOAT32: "float32", FLOAT64: "float64",
               FLOAT8_E4M3FN: "float8_e4m3fn", FLOAT8_E5M2: "float8_e5m2", FLOAT8_E4M3FNUZ: "float8_e4m3fnuz",
               FLOAT8_E5M2FNUZ: "float8_e5m2fnuz"}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}
FLOAT8_CODES = (FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT8_E4M3FNUZ, FLOAT8_E5M2FNUZ)

# Where a format keeps its NaNs and infinities (classify.h, enum Specials; NOTE: [float8 specials]).
IEEE_SPECIALS, NAN_ALL_ONES, NAN_NEG_ZERO = 0, 1, 2


@dataclass(frozen=True)
class FormatTraits:
    """One format's fields (classify.h, FloatFormat): element bytes, exponent and mantissa widths, bias, specials."""

    bytes: int
    exp_bits: int
    mant_bits: int
    bias: int
    specials: int = IEEE_SPECIALS


FORMATS = {
    FLOAT16: FormatTraits(2, 5, 10, 15),
    BFLOAT16: FormatTraits(2, 8, 7, 127),
    FLOAT32: FormatTraits(4, 8, 23, 127),
    FLOAT64: FormatTraits(8, 11, 52, 1023),
    FLOAT8_E4M3FN: FormatTraits(1, 4, 3, 7, NAN_ALL_ONES),
    FLOAT8_E5M2: FormatTraits(1, 5, 2, 15),
    FLOAT8_E4M3FNUZ: FormatTraits(1, 4, 3, 8, NAN_NEG_ZERO),
    FLOAT8_E5M2FNUZ: FormatTraits(1, 5, 2, 16, NAN_NEG_ZERO),
}

# Unsigned integer type holding one element's bits, per dtype code.
BITS_DTYPES = {code: {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[f.bytes] for code, f in FORMATS.items()}

# Value classes (classify.h, enum ValueClass).
NORMAL, ZERO, SUBNORMAL, POSINF, NEGINF, NAN = 0, 1, 2, 3, 4, 5

# Exponent histogram: bin = clamp(floor(log2|x|), MIN_BIN_EXPONENT, MAX_BIN_EXPONENT) - MIN_BIN_EXPONENT.
HIST_BINS = 256
MIN_BIN_EXPONENT = -128
MAX_BIN_EXPONENT = 127

# Stats record slots (stats_record.h, NOTE: [stats record]).
REC_NAN = 0
REC_POSINF = 1
REC_NEGINF = 2
REC_ZERO = 3
REC_SUBNORMAL = 4
REC_ABSMAX_BITS = 5
REC_ABSMIN_BITS = 6
REC_SUMSQ = 7
REC_HIST = 8
REC_HIST_END = REC_HIST + HIST_BINS  # the histogram is records[:, REC_HIST:REC_HIST_END]; a slot follows it
REC_FINGERPRINT = REC_HIST_END  # a uint64's bits (NOTE: [scan fingerprint] in stats_record.h)
RECORD_WIDTH = REC_FINGERPRINT + 1
ABSMIN_NONE = np.iinfo(np.int64).max
# The record width before the fingerprint was appended: what older bundles hold (nanscan.bundle.history).
RECORD_WIDTH_WITHOUT_FINGERPRINT = REC_HIST_END
# The slots outside the histogram, in record order: the compact records' scalars (NOTE: [compact records]).
SCALAR_SLOTS = np.r_[0:REC_HIST, REC_FINGERPRINT:RECORD_WIDTH]
SCALAR_WIDTH = len(SCALAR_SLOTS)

# Elements per work chunk in the native and numba backends (NOTE: [chunking] in csrc/cpu/scan_cpu.cpp).
DEFAULT_CHUNK_ELEMS = 1 << 16


def sumsq_values(records: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The float64 sums of squares of the given rows (REC_SUMSQ holds them as their bits)."""
    return np.ascontiguousarray(records[rows, REC_SUMSQ]).view(np.float64).reshape(-1)


def fingerprints(records: np.ndarray) -> np.ndarray:
    """The records' fingerprints as uint64 (NOTE: [scan fingerprint] in stats_record.h)."""
    return np.ascontiguousarray(records[:, REC_FINGERPRINT]).view(np.uint64)


def any_nonfinite(records: np.ndarray) -> bool:
    """Whether any record counts a NaN or an infinity (asked every step: count_nonzero is the cheapest reduction)."""
    return np.count_nonzero(records[:, REC_NAN : REC_NEGINF + 1]) > 0


def empty_records(n: int) -> np.ndarray:
    """Records for n tensors in their identity state: all counts 0, absmin 'none'."""
    records = np.zeros((n, RECORD_WIDTH), dtype=np.int64)
    records[:, REC_ABSMIN_BITS] = ABSMIN_NONE
    return records


def abs_bits_to_float(bits: int, dtype_code: int) -> float:
    """The value of a non-negative bit pattern in the given format, as a Python float (exact)."""
    if dtype_code == BFLOAT16:
        return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
    if dtype_code in FLOAT8_CODES:  # numpy has no float8: from the fields (every value is exact in a float)
        f = FORMATS[dtype_code]
        field, mant = bits >> f.mant_bits, bits & ((1 << f.mant_bits) - 1)
        if field == 0:
            return math.ldexp(mant, 1 - f.bias - f.mant_bits)
        return math.ldexp(mant | (1 << f.mant_bits), field - f.bias - f.mant_bits)
    float_type = {FLOAT16: np.float16, FLOAT32: np.float32, FLOAT64: np.float64}[dtype_code]
    return float(np.array([bits], dtype=BITS_DTYPES[dtype_code]).view(float_type)[0])
