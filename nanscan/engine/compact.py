"""Compact stats records: each record's scalar slots and only the occupied bins of its exponent histogram
(NOTE: [compact records] in csrc/include/nanscan/compact.h), for the history kept in memory and in bundles.

A tensor's values span a few dozen binades at most, so most of a record's 256 bins are zero: the dense int64
record is 2120 bytes, its compact form about 75 to 145 (scalars 72, range 4, a few dozen counts). The scalars are
the slots outside the histogram (SCALAR_SLOTS: those before it and the fingerprint after it). `encode` is the
native encoder when nanscan._C is built, else `encode_reference`, the numpy reference the tests hold it to; both
give the same arrays, and `decode` gives back exactly the int64 records.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nanscan.engine import _layout as L
from nanscan.engine._native import native_function

# Narrowest first: counts take the first that holds the largest.
COUNT_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)


class CompactRecords(NamedTuple):
    """One or more steps' records, compacted (NOTE: [compact records])."""

    scalars: np.ndarray  # int64 (rows, SCALAR_WIDTH): the slots outside the histogram (_layout.SCALAR_SLOTS)
    ranges: np.ndarray  # int16 (rows, 2): first bin, width
    counts: np.ndarray  # the ranges' counts in row order, unsigned

    @property
    def rows(self) -> int:
        return len(self.scalars)

    @property
    def nbytes(self) -> int:
        return self.scalars.nbytes + self.ranges.nbytes + self.counts.nbytes

    def decode(self) -> np.ndarray:
        return decode(self.scalars, self.ranges, self.counts)


def narrowest(largest: int) -> type:
    """The narrowest unsigned dtype that holds `largest`."""
    return next(d for d in COUNT_DTYPES if largest <= np.iinfo(d).max)


def occupied_ranges(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first occupied bin, width) per histogram row; (0, 0) for an empty one."""
    occupied = hist != 0
    any_bin = occupied.any(axis=1)
    first = np.where(any_bin, occupied.argmax(axis=1), 0)
    last = np.where(any_bin, L.HIST_BINS - 1 - occupied[:, ::-1].argmax(axis=1), -1)
    return first, last + 1 - first


def encode_reference(records: np.ndarray) -> CompactRecords:
    """The int64 (rows, RECORD_WIDTH) records compacted, in numpy: the reference the native encoder matches."""
    hist = records[:, L.REC_HIST:L.REC_HIST_END]
    first, width = occupied_ranges(hist)
    bins = np.arange(L.HIST_BINS)
    counts = hist[(bins >= first[:, None]) & (bins < (first + width)[:, None])]  # row-major: ranges in row order
    largest = int(counts.max()) if counts.size else 0
    return CompactRecords(np.ascontiguousarray(records[:, L.SCALAR_SLOTS]),
                          np.stack([first, width], axis=1).astype(np.int16), counts.astype(narrowest(largest)))


_native_encode = native_function("compact_records")


def encode(records: np.ndarray) -> CompactRecords:
    """The records compacted: by nanscan._C when it is built (a few microseconds for a model's step), else by the
    reference."""
    if _native_encode is None or records.dtype != np.int64 or not records.flags.c_contiguous:
        return encode_reference(records)
    return CompactRecords(*_native_encode(records))


def decode(scalars: np.ndarray, ranges: np.ndarray, counts: np.ndarray, *,
           scalar_slots: np.ndarray = L.SCALAR_SLOTS) -> np.ndarray:
    """The int64 records back from their compact arrays; ValueError naming the array for arrays whose shapes,
    ranges or counts do not fit together (what a damaged file gives), so they never decode to plausible records.
    `scalar_slots`: the record slots the scalars' columns hold (older bundles' scalars stop before the fingerprint,
    whose slot then stays 0: nanscan.bundle.history)."""
    width = len(scalar_slots)
    if scalars.dtype != np.int64 or scalars.ndim != 2 or scalars.shape[1] != width:
        raise ValueError(f"scalars are {scalars.dtype} {scalars.shape}, expected int64 (n, {width})")
    rows = scalars.shape[0]
    if ranges.dtype != np.int16 or ranges.shape != (rows, 2):
        raise ValueError(f"hist_ranges are {ranges.dtype} {ranges.shape}, expected int16 ({rows}, 2)")
    if counts.ndim != 1 or counts.dtype not in COUNT_DTYPES:
        raise ValueError(f"hist_counts are {counts.dtype} {counts.shape}, expected one unsigned row")
    first, width = ranges[:, 0].astype(np.int64), ranges[:, 1].astype(np.int64)
    outside = (first < 0) | (width < 0) | (first + width > L.HIST_BINS)
    if outside.any():
        bad = int(np.flatnonzero(outside)[0])
        raise ValueError(f"hist_ranges row {bad} is (first {first[bad]}, bins {width[bad]}), outside the "
                         f"{L.HIST_BINS} bins")
    if int(width.sum()) != counts.size:
        raise ValueError(f"hist_ranges cover {int(width.sum())} bins, hist_counts holds {counts.size}")
    if counts.dtype == np.uint64 and counts.size and counts.max() > np.iinfo(np.int64).max:
        raise ValueError("hist_counts hold a count beyond int64")
    records = np.zeros((rows, L.RECORD_WIDTH), dtype=np.int64)
    records[:, scalar_slots] = scalars
    row_of = np.repeat(np.arange(rows), width)
    starts = np.cumsum(width) - width
    records[row_of, L.REC_HIST + first[row_of] + np.arange(counts.size) - starts[row_of]] = counts.astype(np.int64)
    return records

