"""The numba backend: the multi-tensor scan of csrc/cpu/scan_cpu.cpp for machines without the C++ extension.

It states the definitions of classify.h again on raw bits (exponent field, subnormals binned by their leading
mantissa bit, bins clamped to [-128, 127]; never isnan or log2) and chunks like the C++ kernel (NOTE: [chunking] in
scan_cpu.cpp), so the counts are exact and the float64 sum of squares is the same on every run and for every thread
count. Each thread scans a run of consecutive chunks (thread_groups) into one partial record per tensor, as the C++
kernel does.

NOTE: [numba blocks]
A chunk is read in blocks of _BLOCK_ELEMS elements. A vectorised pass counts the block's zeros and finds its smallest
non-zero and largest |x| bits. When these show that the block holds no inf, NaN or subnormal, every other element is
a normal value whose bin depends on its exponent field alone, so the block is summed (squares, vectorised) and only
its exponent fields are counted; any other block is classified element by element, mirroring classify.h. (float16
blocks with subnormals stay fast too: each value is widened to the float32 of the same magnitude, exactly, and the
float32 fields are counted, which bin a subnormal by its leading bit as classify.h does; float16 blocks of normal
values are counted on their own fields, into the float32 tables from field 112.) 16-bit values are widened to float32
and squared in float64 by fused multiply-adds (NOTE: [float64 squares]). Counting, not memory, bounds the speed: a
table increment per element waits on the previous one's store whenever fields repeat, as they do in real data. So
the fields are counted in registers, as the C++ kernel does (NOTE: [window counters]):
  - residues: each element adds 1 << 4 * (field mod 16) to one of LANES 64-bit words, a word taking one element of
    each of GROUP_ROWS rows of a group (a 4-bit counter holds 15); the row loop has a constant trip count, so LLVM
    unrolls it and vectorises the lane loop with the words in registers. At the end of a group the nibbles are spread
    into four words of 16-bit counters. 16- and 32-bit blocks feed them four or two elements a word (NOTE: [16-bit
    words] in numba_blocks.py). When the block's non-zero fields span fewer than 16 fields, residue r names
    one field; zeros sat on residue 0 and are taken out again from their known number.
  - a wide window: a block spanning 16 to 31 fields is counted relative to its lowest field, d = field - field_lo,
    in a second set of words fed only the elements with d >= 16 (count_residues_wide), so 32 fields are told apart.
  - fields: for a block spanning 32 fields or more, and for the elements past a chunk's last whole group, each
    element's exponent field is counted, into _NUM_TABLES tables filled in turn so that runs of equal exponents do
    not wait on each other's stores.
All are added into the tables, folded into bins once per segment (a thread's run of chunks of one tensor,
thread_groups), or sooner when they would reach 2**31 elements (_MAX_TABLED), more than their int32 counters hold.
(Measured on one hot block of Gaussian float32, per element: bounds 0.08 ns, squares 0.07 ns, residues 0.11 ns; the
pair table this replaced, 0.35 ns. On one hot block of Gaussian bfloat16 or float16, one core: bounds 0.018 ns,
residues 0.06 ns (the two-word window 0.115 ns; float16 subnormals 0.013 ns more), squares 0.065-0.11 ns (NOTE:
[float64 squares]). Residue words of 32 bits, eight 4-bit counters and a second word for the fields with bit 3
set, measured slower: 0.09 ns.)
The one-byte formats (float8) are counted in blocks of their own (nanscan/engine/backends/numba_bytes.py, NOTE: [numba
bytes]).

NOTE: [numba threads]
A scan runs on as many threads as torch does (torch.set_num_threads), at most numba's own limit, as the C++ kernel
takes OpenMP's default, which is torch's (NOTE: [wake overlap] in csrc/cpu/scan_cpu.cpp): a loop that runs torch on
one thread is not given a second. And numba's OpenMP threading layer, when it starts its threads (at the first
parallel kernel or set_num_threads), sets the OpenMP thread count that torch shares with it (both load libgomp):
the demo loop, on one torch thread, ran on two after its first check with NANSCAN_BACKEND=numba. So torch's count
is put back after the scan wherever it moved. numba.set_num_threads is called only when the count differs from the
one the backend last gave it on the calling thread (asking numba cost ~30 us a check in a training step): a call of
the user's own in between stands until then, which changes no record (NOTE: [chunking] in csrc/cpu/scan_cpu.cpp).

Numba caches the compiled kernels on disk (cache=True) but cannot see when the constants imported from
nanscan/engine/_layout.py change: after such a change, delete the cache
(nanscan/engine/backends/__pycache__/numba_*.nbi/.nbc). Nor does it see how they were compiled: kernels compiled under
NUMBA_ENABLE_PROFILING=1 are cached too, and ran bfloat16 scans 20 times slower until that cache was deleted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numba
import numpy as np
import torch
from numba import njit, prange
from numba.extending import overload

from nanscan.engine import _layout as L
from nanscan.engine.backends.byte_formats import byte_table
from nanscan.engine.backends.numba_bytes import byte_traits, scan_byte_chunks
from nanscan.engine.backends.numba_blocks import (CACHE_LINE, GROUP_ELEMS, RESIDUES, add_fingerprint, count_residues,
                                                  count_residues_wide, fingerprint_part, float32_bits,
                                                  float32_of_bits, float32_of_float16_bits, narrow, pointer_at,
                                                  prefetch_lines, wide_counts)
from nanscan.engine.inputs import ScanInput, as_scan_inputs

# A whole number of groups; 1920 float32 are 7.5 KiB, so a block stays in L1 between the passes over it.
_BLOCK_ELEMS = 2 * GROUP_ELEMS
_NUM_TABLES = 4
# 16-bit formats are counted, and summed, as the float32 values of the same magnitude (_widen): 8 exponent bits.
_WIDE_EXP_BITS, _WIDE_MANT_BITS = 8, 23
_TABLE_STRIDE = 1 << _WIDE_EXP_BITS
# float16 field f is float32 field f + 112 (both biased exponents of the same power of two).
_F16_FIELD_BASE = 127 - 15

# Record slots and histogram geometry as plain globals: numba freezes them into the compiled code.
_REC_NAN, _REC_POSINF, _REC_NEGINF = L.REC_NAN, L.REC_POSINF, L.REC_NEGINF
_REC_ZERO, _REC_SUBNORMAL, _REC_HIST = L.REC_ZERO, L.REC_SUBNORMAL, L.REC_HIST
_REC_ABSMAX, _REC_ABSMIN = L.REC_ABSMAX_BITS, L.REC_ABSMIN_BITS
_REC_SUMSQ, _RECORD_WIDTH, _REC_FINGERPRINT = L.REC_SUMSQ, L.RECORD_WIDTH, L.REC_FINGERPRINT
_MIN_BIN, _MAX_BIN = L.MIN_BIN_EXPONENT, L.MAX_BIN_EXPONENT
_ABSMIN_NONE = L.ABSMIN_NONE


@dataclass(frozen=True)
class _Format:
    """The fields of one binary format (classify.h, FloatFormat) and the constants the kernels derive from them."""

    code: int
    exp_bits: int
    mant_bits: int

    @property
    def bits_dtype(self):
        return L.BITS_DTYPES[self.code]

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @cached_property
    def masks(self) -> np.ndarray:
        """abs mask, smallest normal, +inf: in the format's own unsigned type, so bit operations keep its width."""
        return np.array([(1 << (self.exp_bits + self.mant_bits)) - 1, 1 << self.mant_bits,
                         ((1 << self.exp_bits) - 1) << self.mant_bits], dtype=self.bits_dtype)

    @cached_property
    def scale(self) -> np.ndarray:
        """scale[field] = 2**(field - bias - mant_bits), scale[0] that of field 1: |x| = significand * scale[field]."""
        fields = np.maximum(np.arange(1 << self.exp_bits), 1)
        return np.ldexp(1.0, fields - self.bias - self.mant_bits)


_FORMATS = {
    L.FLOAT16: _Format(L.FLOAT16, 5, 10),
    L.BFLOAT16: _Format(L.BFLOAT16, 8, 7),
    L.FLOAT32: _Format(L.FLOAT32, 8, 23),
    L.FLOAT64: _Format(L.FLOAT64, 11, 52),
}


# -- numba building blocks ---------------------------------------------------------------------------------------

def _block_sumsq(block):
    """Sum of squares of a block of zeros and finite values, float32 or float64 bits, in float64 (jitted code
    only)."""


@overload(_block_sumsq, jit_options={"fastmath": {"reassoc", "contract"}})
def _block_sumsq_impl(block):
    # Reassociation lets the sum vectorise. It changes which rounding the sum sees, not whether it is
    # deterministic: the same compiled loop always adds in the same order. Only finite values reach it.
    float_type = numba.float32 if block.dtype.bitwidth == 32 else numba.float64

    def view_then_sum(block):
        values = block.view(float_type)
        s = 0.0
        for i in range(values.size):
            v = np.float64(values[i])
            s += v * v
        return s
    return view_then_sum


# NOTE: [float64 squares]
# The sum of squares is the most expensive pass of a 16-bit block. What it must pay is one float32-to-float64 conversion
# and one fused multiply-add per element (8 to a vector), the floor of any float64 sum: each element is widened to the
# float32 of the same value in 32-bit lanes (bfloat16: its bits moved up by one constant shift; float16, subnormals
# included: LLVM's conversion from half, float32_of_float16_bits, F16C's vcvtph2ps, exact whatever the float mode),
# converted to float64 and squared into the sum by one FMA. A square of any bfloat16 or float16 value is exact in
# float64 (a significand of at most 11 bits, so at most 22 in the square, between 2**-266 and 2**256), so the FMA rounds
# only the sum, as a float64 square and a separate add would: no range to check first, and no float32 or float64
# subnormal made (a flush-to-zero mode cannot change it). The sign is not cleared: it does not change a square. Measured
# on one hot block of N(0, 0.02), one core of a 2-core AMD EPYC (Zen 4, AVX-512), per element: bfloat16 0.110 -> 0.090
# ns, float16 0.111 -> 0.094 ns against the squares taken in float32 first (exact while they stayed normal float32
# values, else the float64 square) and then converted: a float32 multiply and an `and` more per vector. On Zen 5 those
# float32 squares had measured 0.065 ns (bfloat16) and 0.08 ns (float16), the float64 squares before them 0.10 ns; this
# form was not measured there. An exact integer sum needs 64-bit lanes per element (a square's bits and its shift) and
# measured slower (0.14 ns for float8).


@njit(cache=True, fastmath={"reassoc", "contract"})
def _bf16_sumsq(block):
    """Sum of squares of a bfloat16 block of zeros and finite values (NOTE: [float64 squares]). Reassociation as in
    _block_sumsq."""
    s = 0.0
    for i in range(block.size):
        v = np.float64(float32_of_bits(np.uint32(block[i]) << np.uint32(16)))
        s += v * v
    return s


@njit(cache=True, fastmath={"reassoc", "contract"})
def _f16_sumsq(block):
    """Sum of squares of a float16 block of zeros and finite values, subnormals included (NOTE: [float64
    squares])."""
    s = 0.0
    for i in range(block.size):
        v = np.float64(float32_of_float16_bits(np.uint16(block[i])))
        s += v * v
    return s


@njit(cache=True, fastmath={"reassoc", "contract"})
def _f16_widen_sumsq(block, widened):
    """_f16_sumsq, storing each |x| widened to float32 bits (_widen_one) in `widened` for counting."""
    s = 0.0
    for i in range(block.size):
        v = float32_of_float16_bits(np.uint16(block[i] & np.uint16(0x7FFF)))
        widened[i] = float32_bits(v)
        w = np.float64(v)
        s += w * w
    return s


@njit(cache=True)
def _widen_one(a):
    """The float32 bits of the magnitude that the float16 |x| bits `a` encode, as _f16_widen_sumsq widens them."""
    return float32_bits(float32_of_float16_bits(np.uint16(a)))


@njit(cache=True)
def _bin(exponent):
    """Histogram bin of floor(log2|x|) (classify.h, clamp_to_bin)."""
    return min(max(exponent, _MIN_BIN), _MAX_BIN) - _MIN_BIN


@njit(cache=True)
def _highest_bit(v):
    """Index of the highest set bit of a non-zero uint64 (classify.h, highest_bit)."""
    top = 0
    for shift in (32, 16, 8, 4, 2, 1):
        if v >> np.uint64(shift):
            v >>= np.uint64(shift)
            top += shift
    return top


@njit(cache=True)
def _scan_exact(block, exp_bits, mant_bits, scale, counts, absmax, absmin):
    """Classify each element as classify.h does; returns the updated (absmax, absmin) and the block's sum of squares."""
    bias = (1 << (exp_bits - 1)) - 1
    exp_max = (1 << exp_bits) - 1
    shift = np.uint64(mant_bits)
    mant_mask = (np.uint64(1) << shift) - np.uint64(1)
    hidden = np.uint64(1) << shift
    sign_mask = np.uint64(1) << np.uint64(exp_bits + mant_bits)
    abs_mask = sign_mask - np.uint64(1)
    s = 0.0
    for i in range(block.size):
        bits = np.uint64(block[i])
        field = np.int64((bits >> shift) & np.uint64(exp_max))
        mant = bits & mant_mask
        if field == exp_max:
            if mant != 0:
                counts[_REC_NAN] += 1
            elif bits & sign_mask:
                counts[_REC_NEGINF] += 1
            else:
                counts[_REC_POSINF] += 1
            continue
        if field == 0:
            if mant == 0:
                counts[_REC_ZERO] += 1
                continue
            counts[_REC_SUBNORMAL] += 1
            counts[_REC_HIST + _bin(1 - bias - mant_bits + _highest_bit(mant))] += 1
            value = np.float64(mant) * scale[0]
        else:
            counts[_REC_HIST + _bin(field - bias)] += 1
            value = np.float64(mant | hidden) * scale[field]
        a = np.int64(bits & abs_mask)
        absmax = max(absmax, a)
        absmin = min(absmin, a)
        s += value * value
    return absmax, absmin, s


@njit(cache=True)
def _block_bounds(block, abs_mask):
    """Number of zeros, smallest non-zero |x| bits (abs_mask when none) and largest |x| bits of a block."""
    zeros = narrow(0, block)  # in the block's own width, like everything here (blocks are far below 2**16)
    lo_nonzero = abs_mask
    hi = narrow(0, block)
    for i in range(block.size):
        a = narrow(block[i] & abs_mask, block)
        zeros = narrow(zeros + narrow(a == 0, block), block)
        lo_nonzero = min(lo_nonzero, a if a != 0 else abs_mask)
        hi = max(hi, a)
    return zeros, lo_nonzero, hi  # converting zeros to int64 here would widen the whole loop to 64-bit lanes


@njit(cache=True)
def _fold_residues(words, field_lo, zeros, field_table):
    """Adds residue counts to the fields they stand for, the block's non-zero fields lying in [field_lo, field_lo +
    15]; `zeros` of the counted elements sat on residue 0 (field 0) and are taken out."""
    for k in range(4):
        w = words[k]
        for q in range(4):
            r = 4 * q + k
            c = np.int64((w >> np.uint64(16 * q)) & np.uint64(0xFFFF))
            if r == 0:
                c -= zeros
            field_table[field_lo + ((r - field_lo) & (RESIDUES - 1))] += c


@njit(cache=True)
def _count_zeros(block, abs_mask):
    z = 0
    for i in range(block.size):
        z += (block[i] & abs_mask) == 0
    return z


@njit(cache=True)
def _count_below(block, abs_mask, min_normal):
    """Number of elements whose |x| bits lie below the smallest normal: zeros and subnormals."""
    k = narrow(0, block)
    for i in range(block.size):
        k = narrow(k + narrow((block[i] & abs_mask) < min_normal, block), block)
    return k


@njit(cache=True)
def _count_fields(block, mant_bits, exp_bits, field_tables, stride):
    """Count each element's exponent field into _NUM_TABLES interleaved tables `stride` entries apart."""
    shift = narrow(mant_bits, block)
    field_mask = narrow((1 << exp_bits) - 1, block)
    n = block.size
    m = n - n % 4
    for i in range(0, m, 4):
        field_tables[np.int64((block[i] >> shift) & field_mask)] += 1
        field_tables[stride + np.int64((block[i + 1] >> shift) & field_mask)] += 1
        field_tables[2 * stride + np.int64((block[i + 2] >> shift) & field_mask)] += 1
        field_tables[3 * stride + np.int64((block[i + 3] >> shift) & field_mask)] += 1
    for i in range(m, n):
        field_tables[np.int64((block[i] >> shift) & field_mask)] += 1


@njit(cache=True)
def _table_field(bits, itemsize, exp_bits, mant_bits):
    """The table entry (exponent field) of a normal value's |x| bits: float16's is its widened float32 field, as
    _fast_block counts it; the others' their own (bfloat16's is float32's)."""
    if itemsize == 2 and exp_bits == 5:
        return np.int64(_widen_one(bits) >> np.uint32(_WIDE_MANT_BITS))
    return np.int64(bits) >> mant_bits


@njit(cache=True)
def _fold_fields(field_tables, exp_bits, counts, field_lo, field_hi):
    """Histogram bins of normal values from their exponent-field counts, then the tables cleared for the next
    segment (NOTE: [folded range]). Field 0 is skipped: those are zeros, counted by _block_bounds (blocks with
    subnormals never reach the tables)."""
    bias = (1 << (exp_bits - 1)) - 1
    stride = 1 << exp_bits
    for field in range(max(field_lo, 1), min(field_hi, stride - 2) + 1):
        c = 0
        for t in range(_NUM_TABLES):
            c += field_tables[t * stride + field]
            field_tables[t * stride + field] = 0
        if c:
            counts[_REC_HIST + _bin(field - bias)] += c
    for t in range(_NUM_TABLES):  # the zeros' entries (_count_block), whose counts add up to 0 over the tables
        field_tables[t * stride] = 0
        if exp_bits == _WIDE_EXP_BITS:
            field_tables[t * stride + _F16_FIELD_BASE] = 0


# NOTE: [folded range]
# A segment's tables hold counts only on the fields of its normal values, between those of its smallest non-zero and
# its largest |x| (its record's extremes, final when it is folded), and on the zeros' entries (field 0, and
# float16's field 0 among the float32 fields: _count_block adds the zeros there and takes them back out of the
# first table, so those entries add up to 0 but each table's is not 0). So only that range is folded and cleared,
# not every entry of four tables of 2**exp_bits: 240 ns a segment for float32 (of 116 in the demo's check) and
# eight times more for float64 before.
@njit(cache=True)
def _fold_segment(field_tables, count_exp_bits, counts, itemsize, exp_bits, mant_bits):
    """_fold_fields over the fields the segment's extremes bound (NOTE: [folded range])."""
    if counts[_REC_ABSMIN] == _ABSMIN_NONE:  # no non-zero value: only the zeros' entries may have moved
        _fold_fields(field_tables, count_exp_bits, counts, 1, 0)
        return
    _fold_fields(field_tables, count_exp_bits, counts,
                 _table_field(counts[_REC_ABSMIN], itemsize, exp_bits, mant_bits),
                 _table_field(counts[_REC_ABSMAX], itemsize, exp_bits, mant_bits))


@njit(cache=True)
def _count_block(values, zeros, field_lo, field_hi, mant_bits, exp_bits, field_tables, stride):
    """Counts the exponent fields of a block of zeros and normal values, `zeros` of them zeros, whose non-zero
    fields span [field_lo, field_hi] (NOTE: [numba blocks]), into tables `stride` entries apart whose entry 0 is
    field 0 (float16 fields count into the float32 tables from field 112 on: the same bins)."""
    if field_hi - field_lo >= 2 * RESIDUES:
        _count_fields(values, mant_bits, exp_bits, field_tables, stride)
        field_tables[0] -= zeros  # zeros sit in field 0; taken out, as that entry may be a field's bin
        return
    grouped = values.size - values.size % GROUP_ELEMS
    tail = values[grouped:]
    if tail.size:  # only the last block of a chunk
        _count_fields(tail, mant_bits, exp_bits, field_tables, stride)
        tail_zeros = _count_zeros(tail, narrow((1 << (exp_bits + mant_bits)) - 1, values))
        field_tables[0] -= tail_zeros
        zeros -= tail_zeros
    if not grouped:
        return
    if field_hi - field_lo < RESIDUES:
        _fold_residues(count_residues(values[:grouped], mant_bits), field_lo, zeros, field_tables)
        return
    # A window of 32 fields: d = field - field_lo, zeros at d = -field_lo mod 32.
    wide = wide_counts(count_residues_wide(values[:grouped], mant_bits, field_lo))
    wide[(-field_lo) & (2 * RESIDUES - 1)] -= zeros
    for d in range(2 * RESIDUES):
        if wide[d]:
            field_tables[field_lo + d] += wide[d]


def _fast_block(block, widened, zeros, lo_nonzero, hi, min_normal, exact_small, exp_bits, mant_bits, counts,
                field_tables):
    """Counts the exponent fields of a block of zeros and finite values that are normal (or, with `exact_small`,
    subnormal too), `zeros` of them zeros, their non-zero |x| bits in [lo_nonzero, hi]; returns the block's sum of
    squares (jitted code only)."""


@overload(_fast_block)
def _fast_block_impl(block, widened, zeros, lo_nonzero, hi, min_normal, exact_small, exp_bits, mant_bits, counts,
                     field_tables):
    if block.dtype.bitwidth == 16:
        def widen_then_count(block, widened, zeros, lo_nonzero, hi, min_normal, exact_small, exp_bits, mant_bits,
                             counts, field_tables):
            field_shift = narrow(mant_bits, block)
            field_lo = np.int64(lo_nonzero >> field_shift)
            field_hi = np.int64(hi >> field_shift)
            if not exact_small:
                # bfloat16, normal values only: its exponent field is float32's.
                s = _bf16_sumsq(block)
                _count_block(block, zeros, field_lo, field_hi, mant_bits, exp_bits, field_tables, _TABLE_STRIDE)
                return s
            if lo_nonzero >= min_normal:
                # float16, normal values only: its own fields, counted into the float32 tables from field 112.
                _count_block(block, zeros, field_lo, field_hi, mant_bits, exp_bits, field_tables[_F16_FIELD_BASE:],
                             _TABLE_STRIDE)
                return _f16_sumsq(block)
            # float16 with subnormals: counted as float32, a subnormal's bin being its widened value's field.
            counts[_REC_SUBNORMAL] += np.int64(_count_below(block, narrow(0x7FFF, block), min_normal)) - zeros
            s = _f16_widen_sumsq(block, widened)
            field_lo = np.int64(_widen_one(lo_nonzero) >> np.uint32(_WIDE_MANT_BITS))
            field_hi = np.int64(_widen_one(hi) >> np.uint32(_WIDE_MANT_BITS))
            _count_block(widened[:block.size], zeros, field_lo, field_hi, _WIDE_MANT_BITS, _WIDE_EXP_BITS,
                         field_tables, _TABLE_STRIDE)
            return s
        return widen_then_count

    def count(block, widened, zeros, lo_nonzero, hi, min_normal, exact_small, exp_bits, mant_bits, counts,
              field_tables):
        field_shift = narrow(mant_bits, block)
        _count_block(block, zeros, np.int64(lo_nonzero >> field_shift), np.int64(hi >> field_shift), mant_bits,
                     exp_bits, field_tables, field_tables.size // _NUM_TABLES)
        return _block_sumsq(block)
    return count


# int32 table counters (and the numba backend's chunk limit) hold fewer than 2**31 elements: the tables are folded
# before they would reach it.
_MAX_TABLED = 2**31 - 1


@njit(parallel=True, cache=True)
def _scan_chunks(addresses, numels, firsts, groups, segments, bits_like, masks, exp_bits, mant_bits, scale,
                 partial_counts, partial_sumsq):
    """Each group of chunks (groups[g] .. groups[g + 1] - 1) is scanned by one thread, in order, each chunk added to
    its segment's partial record and its sum of squares kept apart (NOTE: [chunking], NOTE: [numba blocks]); firsts[c]
    is chunk c's first element in its tensor (the fingerprint's index, NOTE: [scan fingerprint])."""
    abs_mask, min_normal, inf_bits = masks[0], masks[1], masks[2]
    # float16's subnormals widen to normal float32 values (_widen_one): its blocks with subnormals stay fast.
    exact_small = bits_like.itemsize == 2 and exp_bits == 5
    count_exp_bits = _WIDE_EXP_BITS if bits_like.itemsize == 2 else exp_bits
    table_size = _NUM_TABLES << count_exp_bits
    for g in prange(groups.size - 1):
        # The group's tables, folded into a segment's record when the segment ends (or before they could overflow).
        field_tables = np.zeros(table_size, np.int32)
        widened = np.empty(_BLOCK_ELEMS if bits_like.itemsize == 2 else 0, np.uint32)
        tabled = np.int64(0)
        tabled_segment = np.int64(-1)
        for c in range(groups[g], groups[g + 1]):
            data = numba.carray(pointer_at(addresses[c], bits_like), numels[c])
            if tabled and (segments[c] != tabled_segment or tabled + data.size > _MAX_TABLED):
                _fold_segment(field_tables, count_exp_bits, partial_counts[tabled_segment], bits_like.itemsize,
                              exp_bits, mant_bits)
                tabled = 0
            counts = partial_counts[segments[c]]
            absmax = np.int64(0)
            absmin = np.int64(_ABSMIN_NONE)
            s = 0.0
            fingerprint = np.uint64(0)
            # Small chunks go element by element: folding the tables would cost more than they save.
            use_tables = data.size >= table_size
            if use_tables:
                tabled += data.size
                tabled_segment = segments[c]
            for begin in range(0, data.size, _BLOCK_ELEMS):
                block = data[begin:begin + _BLOCK_ELEMS]
                fingerprint += fingerprint_part(block, firsts[c] + begin)  # the block's raw bits, any path
                # The passes over this block read only it, so the hardware prefetcher stops running ahead: ask for
                # the next block meanwhile, a quarter before each pass (a whole block's lines at once would stall on
                # the core's few slots for outstanding misses).
                ahead = addresses[c] + min(begin + _BLOCK_ELEMS, data.size) * data.itemsize
                ahead_size = addresses[c] + min(begin + 2 * _BLOCK_ELEMS, data.size) * data.itemsize - ahead
                quarter = -(-ahead_size // (4 * CACHE_LINE)) * CACHE_LINE
                prefetch_lines(ahead, 0, quarter)
                if use_tables:
                    block_zeros, lo_nonzero, hi = _block_bounds(block, abs_mask)
                    zeros = np.int64(block_zeros)
                    prefetch_lines(ahead, quarter, 2 * quarter)
                    if hi < inf_bits and (lo_nonzero >= min_normal or exact_small):
                        counts[_REC_ZERO] += zeros
                        if zeros == block.size:
                            prefetch_lines(ahead, 2 * quarter, ahead_size)
                            continue
                        absmax = max(absmax, np.int64(hi))
                        absmin = min(absmin, np.int64(lo_nonzero))
                        prefetch_lines(ahead, 2 * quarter, 3 * quarter)
                        s += _fast_block(block, widened, zeros, lo_nonzero, hi, min_normal, exact_small, exp_bits,
                                         mant_bits, counts, field_tables)
                        prefetch_lines(ahead, 3 * quarter, ahead_size)
                        continue
                prefetch_lines(ahead, quarter, ahead_size)
                absmax, absmin, block_sumsq = _scan_exact(block, exp_bits, mant_bits, scale, counts, absmax, absmin)
                s += block_sumsq
            counts[_REC_ABSMAX] = max(counts[_REC_ABSMAX], absmax)
            counts[_REC_ABSMIN] = min(counts[_REC_ABSMIN], absmin)
            add_fingerprint(counts, _REC_FINGERPRINT, fingerprint)
            partial_sumsq[c] = s
        if tabled:
            _fold_segment(field_tables, count_exp_bits, partial_counts[tabled_segment], bits_like.itemsize, exp_bits,
                          mant_bits)


@njit(cache=True)
def _merge(segment_task, partial_counts, chunk_task, partial_sumsq, records, sumsq):
    """Merge the segments' partial records into their tensors' records, and the chunks' sums of squares in chunk
    order (NOTE: [chunking])."""
    for g in range(segment_task.size):
        t = segment_task[g]
        for k in range(records.shape[1]):
            if k == _REC_ABSMAX:
                records[t, k] = max(records[t, k], partial_counts[g, k])
            elif k == _REC_ABSMIN:
                records[t, k] = min(records[t, k], partial_counts[g, k])
            elif k == _REC_FINGERPRINT:  # a wrapping sum (NOTE: [scan fingerprint])
                add_fingerprint(records[t], k, np.uint64(partial_counts[g, k]))
            else:
                records[t, k] += partial_counts[g, k]
    for c in range(chunk_task.size):
        sumsq[chunk_task[c]] += partial_sumsq[c]


# NOTE: [numba call]
# In a training step every numpy call and every call of a compiled function starts cold (NOTE: [cold check path] in
# nanscan/runtime/spikes.py): inside a step of the demo model, the numba backend's Python between its kernels (the split
# by format, the chunk plan's arguments, the partial records, the merge and a call for each) took ~330 us of a 1.2 ms
# check, against ~40 us hot. So a format's scan is one compiled call, its chunks planned, scanned and merged inside,
# and the split by format is kept for the table it was made from.
@njit(cache=True)
def _format_plan(ptrs, numels, tasks, itemsize, chunk_elems, threads):
    """chunk_plan of the inputs `tasks`, with their identity partial records and the chunks' sums."""
    addresses, chunk_numels, chunk_first, chunk_task, groups, segments, segment_task = chunk_plan(
        ptrs[tasks], numels[tasks], itemsize, chunk_elems, threads)
    partial_counts = np.zeros((segment_task.size, _RECORD_WIDTH), np.int64)
    partial_counts[:, _REC_ABSMIN] = _ABSMIN_NONE
    return addresses, chunk_numels, chunk_first, tasks[chunk_task], groups, segments, tasks[segment_task], \
        partial_counts, np.zeros(chunk_task.size, np.float64)


@njit(cache=True)
def _merge_format(segment_task, partial_counts, chunk_task, partial_sumsq, records):
    """_merge into `records`, each of the format's rows then holding its sum of squares (as its bits)."""
    sumsq = np.zeros(records.shape[0], np.float64)
    _merge(segment_task, partial_counts, chunk_task, partial_sumsq, records, sumsq)
    bits = sumsq.view(np.int64)
    for t in segment_task:
        records[t, _REC_SUMSQ] = bits[t]


@njit(cache=True)
def _scan_word_format(ptrs, numels, tasks, chunk_elems, threads, bits_like, masks, exp_bits, mant_bits, scale,
                      records):
    """The inputs `tasks` of one format of 2, 4 or 8 bytes scanned into their rows of `records` (NOTE: [numba
    call])."""
    addresses, chunk_numels, chunk_first, chunk_task, groups, segments, segment_task, partial_counts, \
        partial_sumsq = _format_plan(ptrs, numels, tasks, bits_like.itemsize, chunk_elems, threads)
    _scan_chunks(addresses, chunk_numels, chunk_first, groups, segments, bits_like, masks, exp_bits, mant_bits, scale,
                 partial_counts, partial_sumsq)
    _merge_format(segment_task, partial_counts, chunk_task, partial_sumsq, records)


@njit(cache=True)
def _scan_byte_format(ptrs, numels, tasks, chunk_elems, threads, table, traits, records):
    """The inputs `tasks` of one one-byte format scanned into their rows of `records` (NOTE: [numba call])."""
    addresses, chunk_numels, chunk_first, chunk_task, groups, segments, segment_task, partial_counts, \
        partial_sumsq = _format_plan(ptrs, numels, tasks, 1, chunk_elems, threads)
    scan_byte_chunks(addresses, chunk_numels, chunk_first, groups, segments, table, traits, partial_counts,
                     partial_sumsq)
    _merge_format(segment_task, partial_counts, chunk_task, partial_sumsq, records)


@njit(cache=True)
def thread_groups(chunk_task, chunk_numels, threads):
    """The work of a scan's threads (NOTE: [chunking]): `threads` runs of consecutive chunks of about equal elements
    (group g is chunks groups[g] .. groups[g + 1] - 1), and each chunk's segment, the chunks of one tensor in one
    group, which share a partial record: (groups, segments, the task of each segment). The records do not depend on
    the grouping: counts are exact, and sums of squares stay per chunk. Compiled: in numpy it cost ~20 us a scan,
    5% of a small model's."""
    n = chunk_task.size
    total = np.int64(0)
    for c in range(n):
        total += chunk_numels[c]
    groups = np.empty(threads + 1, np.int64)
    segments = np.empty(n, np.int64)
    segment_task = np.empty(n, np.int64)
    g = 0
    groups[0] = 0
    start = np.int64(0)  # elements before chunk c
    num_segments = 0
    for c in range(n):
        # Group g + 1 begins at the first chunk that starts at or past (g + 1) / threads of the elements.
        while g + 1 < threads and start * threads >= (g + 1) * total:
            g += 1
            groups[g] = c
        if c == 0 or chunk_task[c] != chunk_task[c - 1] or groups[g] == c:
            segment_task[num_segments] = chunk_task[c]
            num_segments += 1
        segments[c] = num_segments - 1
        start += chunk_numels[c]
    for k in range(g + 1, threads + 1):
        groups[k] = n
    return groups, segments, segment_task[:num_segments]


@njit(cache=True)
def chunk_plan(bases, numels, itemsize, chunk_elems, threads):
    """The chunks of the tensors at `bases` (NOTE: [chunking]), each at most chunk_elems elements, and their threads'
    work (thread_groups): (chunk addresses, chunk element counts, each chunk's first element in its tensor, each
    chunk's tensor index, groups, segments, each segment's tensor index). Compiled, with thread_groups in the same
    call: in numpy the cutting alone cost ~12 us a scan, about a fifth of the numba backend's fixed cost per call."""
    n = 0
    for t in range(numels.size):
        n += (numels[t] + chunk_elems - 1) // chunk_elems
    addresses = np.empty(n, np.int64)
    chunk_numels = np.empty(n, np.int64)
    chunk_first = np.empty(n, np.int64)
    chunk_task = np.empty(n, np.int64)
    c = 0
    for t in range(numels.size):
        for begin in range(0, numels[t], chunk_elems):
            addresses[c] = bases[t] + begin * itemsize
            chunk_numels[c] = min(chunk_elems, numels[t] - begin)
            chunk_first[c] = begin
            chunk_task[c] = t
            c += 1
    groups, segments, segment_task = thread_groups(chunk_task, chunk_numels, threads)
    return addresses, chunk_numels, chunk_first, chunk_task, groups, segments, segment_task


# -- the backend ---------------------------------------------------------------------------------------------------

# The thread count the backend last gave numba.set_num_threads, per calling thread (NOTE: [numba threads]).
_set_threads = threading.local()


class NumbaBackend:
    """The scan compiled by numba, for CPUs without the C++ extension (NOTE: [numba blocks])."""

    name = "numba"
    # Numba's workqueue threading layer (used where neither TBB nor OpenMP is installed) aborts the process when two
    # threads launch parallel kernels at once; one scan at a time already has every core.
    _launch_lock = threading.Lock()

    def __init__(self, *, chunk_elems: int = L.DEFAULT_CHUNK_ELEMS, num_threads: int = 0):
        """num_threads: threads a scan runs on, at most numba's limit (NUMBA_NUM_THREADS); 0, the default, as many
        as torch runs on (NOTE: [numba threads]), as CpuBackend's 0 takes OpenMP's default."""
        if not 1 <= chunk_elems < 2**31:
            raise ValueError(f"chunk_elems must be a number of elements from 1 to 2**31 - 1 (the per-chunk counters "
                             f"are int32), got {chunk_elems}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads must be 0 (as many as torch runs on) or a number of threads, got "
                             f"{num_threads!r}")
        self.chunk_elems = int(chunk_elems)
        self.num_threads = num_threads
        self._kept_formats: tuple | None = None  # (numels, codes, _formats() of them)

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray:
        inputs = as_scan_inputs(inputs)
        for device in inputs.devices:
            if device.partition(":")[0] != "cpu":  # a name: torch.device costs ~15 us cold (NOTE: [numba call])
                name = next(item.name for item in inputs if item.identity.device == device)
                raise ValueError(f"the numba backend scans CPU tensors only; {name!r} is on {device}")
        records = L.empty_records(len(inputs))
        ptrs, numels, codes = inputs.table()
        torch_threads = torch.get_num_threads()  # NOTE: [numba threads]
        threads = min(self.num_threads or torch_threads, numba.config.NUMBA_NUM_THREADS)
        try:
            with self._launch_lock:
                if getattr(_set_threads, "count", None) != threads:  # numba's setting is the calling thread's
                    numba.set_num_threads(threads)
                    _set_threads.count = threads
                for kernel, tasks, args in self._formats(numels, codes):
                    kernel(ptrs, numels, tasks, self.chunk_elems, threads, *args, records)
        finally:
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
        return records

    def _formats(self, numels: np.ndarray, codes: np.ndarray) -> list[tuple]:
        """Per format in the table: its compiled scan, its inputs' indices, and the format's arguments. Kept for
        the arrays it was made from (NOTE: [numba call]): a Monitor's plan hands the same ones every step."""
        kept = self._kept_formats
        if kept is not None and kept[0] is numels and kept[1] is codes:
            return kept[2]
        formats = []
        for code in np.unique(codes[numels > 0]).tolist():
            tasks = np.flatnonzero((codes == code) & (numels > 0))
            if L.FORMATS[code].bytes == 1:
                table = byte_table(code)
                formats.append((_scan_byte_format, tasks, (table, byte_traits(code, table))))
            else:
                fmt = _FORMATS[code]
                formats.append((_scan_word_format, tasks, (np.empty(0, fmt.bits_dtype), fmt.masks, fmt.exp_bits,
                                                           fmt.mant_bits, fmt.scale)))
        self._kept_formats = (numels, codes, formats)
        return formats
