"""Python mirror of the native layout constants (csrc/include/nanscan/classify.h and stats_record.h).

A test checks these against the compiled extension, so the two cannot drift silently.
"""

from __future__ import annotations

import numpy as np

# Dtype codes (classify.h, enum DType).
FLOAT16, BFLOAT16, FLOAT32, FLOAT64 = 0, 1, 2, 3
DTYPE_NAMES = {FLOAT16: "float16", BFLOAT16: "bfloat16", FLOAT32: "float32", FLOAT64: "float64"}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}

# Unsigned integer type holding one element's bits, per dtype code.
BITS_DTYPES = {FLOAT16: np.uint16, BFLOAT16: np.uint16, FLOAT32: np.uint32, FLOAT64: np.uint64}

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
RECORD_WIDTH = REC_HIST + HIST_BINS
ABSMIN_NONE = np.iinfo(np.int64).max

# Elements per work chunk in the native and numba backends (NOTE: [chunking] in csrc/cpu/scan_cpu.cpp).
DEFAULT_CHUNK_ELEMS = 1 << 16


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
    float_type = {FLOAT16: np.float16, FLOAT32: np.float32, FLOAT64: np.float64}[dtype_code]
    return float(np.array([bits], dtype=BITS_DTYPES[dtype_code]).view(float_type)[0])
