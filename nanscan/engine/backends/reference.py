"""The reference scan: plain torch code that states each definition directly. It is the test oracle for every
other backend and the last-resort fallback on any device (it runs wherever torch runs).

It deliberately shares nothing with the kernels: it classifies with torch.isnan/isinf and floating comparisons
and takes floor(log2|x|) from torch.frexp, where the kernels work on raw bits (classify.h). The fingerprint is
defined here, as the one formula over every element (NOTE: [scan fingerprint] in stats_record.h), where the kernels
sum it in pieces.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine.inputs import ScanInput

# Smallest positive normal value of each scanned format (torch.finfo states it for the float8 formats too).
_SMALLEST_NORMAL = {
    L.FLOAT16: torch.finfo(torch.float16).tiny,
    L.BFLOAT16: torch.finfo(torch.bfloat16).tiny,
    L.FLOAT32: torch.finfo(torch.float32).tiny,
    L.FLOAT64: torch.finfo(torch.float64).tiny,
    **{code: torch.finfo(getattr(torch, L.DTYPE_NAMES[code])).tiny for code in L.FLOAT8_CODES
       if hasattr(torch, L.DTYPE_NAMES[code])},
}


def _abs_bits(value: torch.Tensor, dtype: torch.dtype) -> int:
    """Bit pattern of a non-negative 0-d value in its own format, as the stats record stores it."""
    bits_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    raw = int(value.to(dtype).reshape(1).view(bits_type).item())
    return raw & ((1 << (8 * value.to(dtype).element_size())) - 1)


_BITS_TYPES = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def fingerprint(bits: np.ndarray) -> int:
    """The fingerprint of a tensor given as its elements' raw bits in flat order, an unsigned integer array (NOTE:
    [scan fingerprint] in stats_record.h): the sum over i of mix(u_i) * (2 i + 1) mod 2**64, mix(u) = u ^ (u >> 32),
    u_i element i's bits zero-extended to 64. numpy's uint64 products and sums wrap mod 2**64."""
    u = np.asarray(bits).reshape(-1).astype(np.uint64)
    mixed = u ^ (u >> np.uint64(32))
    odd = np.arange(u.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return int(np.sum(mixed * odd, dtype=np.uint64))


def scan_one(flat: torch.Tensor, dtype_code: int) -> np.ndarray:
    """One stats record (NOTE: [stats record]) for a 1-D tensor of a supported floating dtype."""
    record = L.empty_records(1)[0]
    # float64 is exact for every supported format, so classification and frexp see the true values (torch's own
    # conversion decodes the float8 formats: their NaNs become NaN, an fnuz 0x80 included).
    x = flat.to(torch.float64)
    nan = torch.isnan(x)
    posinf = torch.isposinf(x)
    neginf = torch.isneginf(x)
    finite = torch.isfinite(x)
    a = x.abs()
    zero = a == 0
    nonzero_finite = finite & ~zero
    subnormal = nonzero_finite & (a < _SMALLEST_NORMAL[dtype_code])
    record[L.REC_NAN] = int(nan.sum())
    record[L.REC_POSINF] = int(posinf.sum())
    record[L.REC_NEGINF] = int(neginf.sum())
    record[L.REC_ZERO] = int(zero.sum())
    record[L.REC_SUBNORMAL] = int(subnormal.sum())
    finite_abs = a[finite]
    if finite_abs.numel():
        record[L.REC_ABSMAX_BITS] = _abs_bits(finite_abs.max(), flat.dtype)
    values = a[nonzero_finite]
    if values.numel():
        record[L.REC_ABSMIN_BITS] = _abs_bits(values.min(), flat.dtype)
        # frexp: |x| = m * 2**e with m in [0.5, 1), so floor(log2|x|) = e - 1, exactly.
        _, e = torch.frexp(values)
        bins = (e.to(torch.int64) - 1).clamp(L.MIN_BIN_EXPONENT, L.MAX_BIN_EXPONENT) - L.MIN_BIN_EXPONENT
        record[L.REC_HIST:L.REC_HIST_END] = torch.bincount(bins, minlength=L.HIST_BINS).cpu().numpy()
    sumsq = float((x[finite] * x[finite]).sum()) if finite.any() else 0.0
    record[L.REC_SUMSQ : L.REC_SUMSQ + 1] = np.array([sumsq], dtype=np.float64).view(np.int64)
    bits = flat.detach().view(_BITS_TYPES[flat.element_size()]).cpu().numpy()
    record[L.REC_FINGERPRINT] = np.array([fingerprint(bits)], dtype=np.uint64).view(np.int64)[0]
    return record


def _flushes_denormals() -> bool:
    """Whether this thread's CPU float ops read subnormals as zero (torch.set_flush_denormal(True)). torch has
    no getter for the mode, so the smallest subnormal double is put through one operation and looked at. It is
    made from its bits: a float literal would be parsed under the mode too (and kept so in the .pyc)."""
    smallest = torch.ones(1, dtype=torch.int64).view(torch.float64)
    return bool((smallest * 1.0).item() == 0.0)


@contextlib.contextmanager
def _denormals_kept() -> Iterator[None]:
    """Runs the block with subnormals read as themselves, then restores the caller's mode. Under flush-to-zero
    every subnormal would be classified, binned and squared as a zero (the kernels keep them too: NOTE: [float
    mode] in csrc/cpu/scan_cpu.cpp)."""
    flushing = _flushes_denormals()
    if flushing:
        torch.set_flush_denormal(False)
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(True)


class ReferenceBackend:
    """Slow and obvious; runs on any torch device."""

    name = "reference"

    def supports(self, device: torch.device) -> bool:
        return True

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray:
        records = L.empty_records(len(inputs))
        with _denormals_kept():
            for i, item in enumerate(inputs):
                if item.numel:
                    records[i] = scan_one(item.flat, item.scanned_code)
        return records
