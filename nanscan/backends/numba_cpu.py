"""The numba backend: the multi-tensor scan of csrc/cpu/scan_cpu.cpp for machines without the C++ extension.

It states the definitions of classify.h again on raw bits (exponent field, subnormals binned by their leading
mantissa bit, bins clamped to [-128, 127]; never isnan or log2) and chunks like the C++ kernel (NOTE: [chunking] in
scan_cpu.cpp): one partial record per chunk, merged per tensor in chunk order, so the counts are exact and the
float64 sum of squares is the same on every run and for every thread count.

NOTE: [numba blocks]
A chunk is read in blocks of _BLOCK_ELEMS elements. A vectorised pass counts the block's zeros and finds its smallest
non-zero and largest |x| bits. When these show that the block holds no inf, NaN or subnormal, every other element is
a normal value whose bin depends on its exponent field alone, so the block is summed (squares, vectorised) and only
its exponent fields are counted; any other block is classified element by element, mirroring classify.h. (float16
blocks with subnormals stay fast too: each value is widened to the float32 of the same magnitude, exactly, and the
float32 fields are counted, which bin a subnormal by its leading bit as classify.h does.) Counting, not memory,
bounds the speed: a table increment per element waits on the previous one's store whenever fields repeat, as they
do in real data. So the fields are counted in registers, as the C++ kernel does (NOTE: [window counters]):
  - residues: each element adds 1 << 4 * (field mod 16) to one of _LANES 64-bit words, a word taking one element of
    each of _GROUP_ROWS rows of a group (a 4-bit counter holds 15); the row loop has a constant trip count, so LLVM
    unrolls it and vectorises the lane loop with the words in registers. At the end of a group the nibbles are spread
    into four words of 16-bit counters. When the block's non-zero fields span fewer than 16 fields, residue r names
    one field; zeros sat on residue 0 and are taken out again from their known number.
  - fields: for a block spanning 16 fields or more, and for the elements past a chunk's last whole group, each
    element's exponent field is counted, into _NUM_TABLES tables filled in turn so that runs of equal exponents do
    not wait on each other's stores.
Both are added into the tables, folded into bins once per chunk. Their int32 counters hold any chunk below 2**31
elements. (Measured on one hot block of Gaussian float32, per element: bounds 0.08 ns, squares 0.07 ns, residues 0.11
ns; the pair table this replaced, 0.35 ns.)
The one-byte formats (float8) take none of this: a chunk is counted per bit pattern and the counts are folded through
the format's table of 256 patterns (nanscan/backends/byte_formats.py), in pattern order, as the C++ kernel does
without AVX-512 (NOTE: [byte formats] in csrc/cpu/scan_cpu.cpp), so the two give the same records. (With AVX-512 the
C++ kernel sums the squares as exact integers, rounded once, NOTE: [byte vectors]: the same sum wherever the pattern
order's is exact, as for float8_e4m3fn chunks below 2**17 elements, else one within rounding of it.)

Numba caches the compiled kernels on disk (cache=True) but cannot see when the constants imported from
nanscan/_layout.py change: after such a change, delete the cache (nanscan/backends/__pycache__/numba_cpu*.nbi/.nbc).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from nanscan import _layout as L
from nanscan.backends.byte_formats import TABLE_BIN, TABLE_CLASS, TABLE_SQUARE, byte_table
from nanscan.inputs import ScanInput, as_scan_inputs

# Residue counting (NOTE: [numba blocks]): _LANES independent 64-bit words of sixteen 4-bit counters, each word fed
# _GROUP_ROWS elements (a 4-bit counter holds 15) before its nibbles are spread into 16-bit counters.
_LANES = 64
_GROUP_ROWS = 15
_GROUP_ELEMS = _LANES * _GROUP_ROWS
_RESIDUES = 16
# A whole number of groups; 1920 float32 are 7.5 KiB, so a block stays in L1 between the passes over it.
_BLOCK_ELEMS = 2 * _GROUP_ELEMS
_NUM_TABLES = 4
_CACHE_LINE = 64
# 16-bit formats are counted, and summed, as the float32 values of the same magnitude (_widen): 8 exponent bits.
_WIDE_EXP_BITS, _WIDE_MANT_BITS = 8, 23

# Record slots and histogram geometry as plain globals: numba freezes them into the compiled code.
_REC_NAN, _REC_POSINF, _REC_NEGINF = L.REC_NAN, L.REC_POSINF, L.REC_NEGINF
_REC_ZERO, _REC_SUBNORMAL, _REC_HIST = L.REC_ZERO, L.REC_SUBNORMAL, L.REC_HIST
_REC_ABSMAX, _REC_ABSMIN = L.REC_ABSMAX_BITS, L.REC_ABSMIN_BITS
_MIN_BIN, _MAX_BIN = L.MIN_BIN_EXPONENT, L.MAX_BIN_EXPONENT
_ABSMIN_NONE = L.ABSMIN_NONE


@dataclass(frozen=True)
class _Format:
    """The fields of one binary format (classify.h, FloatFormat) and the constants the kernels derive from them."""

    code: int
    exp_bits: int
    mant_bits: int
    # How a zero or normal 16-bit value becomes the float32 with the same magnitude: (|bits| << shift) + offset.
    widen_shift: int = 0
    widen_offset: int = 0

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
    L.FLOAT16: _Format(L.FLOAT16, 5, 10, widen_shift=13, widen_offset=(127 - 15) << 23),
    L.BFLOAT16: _Format(L.BFLOAT16, 8, 7, widen_shift=16),
    L.FLOAT32: _Format(L.FLOAT32, 8, 23),
    L.FLOAT64: _Format(L.FLOAT64, 11, 52),
}


# -- numba building blocks ---------------------------------------------------------------------------------------

@intrinsic
def _pointer_at(typingctx, address, like):
    """A typed pointer to `address` (an int64), of the element type of the array `like`."""
    pointer_type = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer_type))

    return pointer_type(types.int64, like), codegen


@intrinsic
def _prefetch(typingctx, address):
    """Start loading the cache line at `address` (an int64) into every cache level; a hint that never faults."""

    def codegen(context, builder, signature, args):
        pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [pointer, i32, i32, i32])
        prefetch = builder.module.declare_intrinsic("llvm.prefetch", [pointer], fnty)
        # read (0), keep in all cache levels (locality 3), data cache (1)
        builder.call(prefetch, [builder.inttoptr(args[0], pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(types.int64), codegen


@njit(cache=True)
def _prefetch_lines(address, begin, end):
    """Prefetch the cache lines of bytes [begin, end) after `address`; a prefetch never faults, so the last line may
    reach past the data."""
    for byte in range(begin, end, _CACHE_LINE):
        _prefetch(address + byte)


def _narrow(value, like):
    """`value` converted to the element type of the array `like` (jitted code only)."""


@overload(_narrow)
def _narrow_impl(value, like):
    # Numba widens integer arithmetic to 64 bits; converting back keeps 16- and 32-bit data in narrow vector lanes.
    target = like.dtype
    return lambda value, like: target(value)


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


@intrinsic
def _float32_bits(typingctx, value):
    """The bit pattern of a float32, as a uint32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _float32_of_bits(typingctx, bits):
    """The float32 whose bit pattern is the uint32 `bits`."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def _widened_sumsq(block, widened, shift, offset, exact_small):
    """Sum of squares of a 16-bit block of zeros and finite values, each taken as the float32 of the same magnitude
    (_widen_one); with `exact_small` the float32 bits are also stored in `widened` for counting (jitted code
    only)."""


@overload(_widened_sumsq, jit_options={"fastmath": {"reassoc", "contract"}})
def _widened_sumsq_impl(block, widened, shift, offset, exact_small):
    # One loop that widens and squares: the widened values never make a round trip through memory unless they are
    # counted afterwards (float16, whose subnormals have no exponent field of their own). Reassociation as in
    # _block_sumsq.
    def widen_and_sum(block, widened, shift, offset, exact_small):
        n = block.size
        s = 0.0
        if exact_small:
            for i in range(n):
                w = _widen_one(block[i] & np.uint16(0x7FFF), shift, offset, True)
                widened[i] = w
                v = np.float64(_float32_of_bits(w))
                s += v * v
        else:
            for i in range(n):
                w = _widen_one(block[i] & np.uint16(0x7FFF), shift, offset, False)
                v = np.float64(_float32_of_bits(w))
                s += v * v
        return s
    return widen_and_sum


@njit(cache=True)
def _widen_one(a, shift, offset, exact_small):
    """The float32 bits of the magnitude that the 16-bit |x| bits `a` encode, for zeros and normal values; with
    `exact_small` (float16) for subnormals too, as float32(mantissa) * 2**-24, a normal float32 computed exactly
    (no subnormal ever enters the float arithmetic, so a flush-to-zero mode cannot change it)."""
    a32 = np.uint32(a)
    normal = (a32 << shift) + offset
    if exact_small:
        small = _float32_bits(np.float32(a32) * np.float32(2.0 ** -24))
        return normal if a32 >= np.uint32(0x400) else small
    return normal if a32 != 0 else np.uint32(0)


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
    zeros = _narrow(0, block)  # in the block's own width, like everything here (blocks are far below 2**16)
    lo_nonzero = abs_mask
    hi = _narrow(0, block)
    for i in range(block.size):
        a = _narrow(block[i] & abs_mask, block)
        zeros = _narrow(zeros + _narrow(a == 0, block), block)
        lo_nonzero = min(lo_nonzero, a if a != 0 else abs_mask)
        hi = max(hi, a)
    return zeros, lo_nonzero, hi  # converting zeros to int64 here would widen the whole loop to 64-bit lanes


@njit(cache=True)
def _count_residues(block, mant_bits):
    """Counts of the exponent field mod 16 over the block's whole groups (NOTE: [numba blocks]), as four words of
    16-bit counters: word k, slot q counts residue 4 * q + k."""
    shift = np.uint64(mant_bits - 2)  # puts 4 * (field mod 16) at bits 2..5
    nibbles = np.uint64(0x000F000F000F000F)
    w0 = w1 = w2 = w3 = np.uint64(0)
    for g in range(block.size // _GROUP_ELEMS):
        group = block[g * _GROUP_ELEMS:(g + 1) * _GROUP_ELEMS]
        for lane in range(_LANES):
            # The row loop has a constant trip count: LLVM unrolls it, and the lane loop is vectorised with the
            # words in registers.
            word = np.uint64(0)
            for row in range(_GROUP_ROWS):
                word += np.uint64(1) << ((np.uint64(group[row * _LANES + lane]) >> shift) & np.uint64(0x3C))
            w0 += word & nibbles
            w1 += (word >> np.uint64(4)) & nibbles
            w2 += (word >> np.uint64(8)) & nibbles
            w3 += (word >> np.uint64(12)) & nibbles
    return w0, w1, w2, w3


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
            field_table[field_lo + ((r - field_lo) & (_RESIDUES - 1))] += c


@njit(cache=True)
def _count_zeros(block, abs_mask):
    z = 0
    for i in range(block.size):
        z += (block[i] & abs_mask) == 0
    return z


@njit(cache=True)
def _count_below(block, abs_mask, min_normal):
    """Number of elements whose |x| bits lie below the smallest normal: zeros and subnormals."""
    k = _narrow(0, block)
    for i in range(block.size):
        k = _narrow(k + _narrow((block[i] & abs_mask) < min_normal, block), block)
    return k


@njit(cache=True)
def _count_fields(block, mant_bits, exp_bits, field_tables):
    """Count each element's exponent field into _NUM_TABLES interleaved tables of 2**exp_bits entries."""
    shift = _narrow(mant_bits, block)
    field_mask = _narrow((1 << exp_bits) - 1, block)
    stride = 1 << exp_bits
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
def _fold_fields(field_tables, exp_bits, counts):
    """Histogram bins of normal values from their exponent-field counts. Field 0 is skipped: those are zeros, counted
    by _block_bounds (blocks with subnormals never reach the tables)."""
    bias = (1 << (exp_bits - 1)) - 1
    stride = 1 << exp_bits
    for field in range(1, stride - 1):
        c = 0
        for t in range(_NUM_TABLES):
            c += field_tables[t * stride + field]
        if c:
            counts[_REC_HIST + _bin(field - bias)] += c


@njit(cache=True)
def _count_block(values, zeros, field_lo, field_hi, mant_bits, exp_bits, field_tables):
    """Counts the exponent fields of a block of zeros and normal values (float32 or float64 bits), `zeros` of them
    zeros, whose non-zero fields span [field_lo, field_hi] (NOTE: [numba blocks])."""
    if field_hi - field_lo >= _RESIDUES:
        _count_fields(values, mant_bits, exp_bits, field_tables)
        return
    grouped = values.size - values.size % _GROUP_ELEMS
    tail = values[grouped:]
    if tail.size:  # only the last block of a chunk; its zeros land in field 0 of the tables, never read
        _count_fields(tail, mant_bits, exp_bits, field_tables)
        zeros -= _count_zeros(tail, _narrow((1 << (exp_bits + mant_bits)) - 1, values))
    if grouped:
        _fold_residues(_count_residues(values[:grouped], mant_bits), field_lo, zeros, field_tables)


def _fast_block(block, widened, zeros, lo_nonzero, hi, min_normal, shift, offset, exact_small, exp_bits, mant_bits,
                counts, field_tables):
    """Counts the exponent fields of a block of zeros and finite values that are normal (or, with `exact_small`,
    subnormal too), `zeros` of them zeros, their non-zero |x| bits in [lo_nonzero, hi]; returns the block's sum of
    squares (jitted code only)."""


@overload(_fast_block)
def _fast_block_impl(block, widened, zeros, lo_nonzero, hi, min_normal, shift, offset, exact_small, exp_bits,
                     mant_bits, counts, field_tables):
    if block.dtype.bitwidth == 16:
        def widen_then_count(block, widened, zeros, lo_nonzero, hi, min_normal, shift, offset, exact_small,
                             exp_bits, mant_bits, counts, field_tables):
            if lo_nonzero < min_normal:
                counts[_REC_SUBNORMAL] += np.int64(_count_below(block, _narrow(0x7FFF, block), min_normal)) - zeros
            s = _widened_sumsq(block, widened, shift, offset, exact_small)
            if exact_small:
                # Counted as float32: a subnormal's bin is its widened value's exponent field.
                field_lo = np.int64(_widen_one(lo_nonzero, shift, offset, True) >> np.uint32(_WIDE_MANT_BITS))
                field_hi = np.int64(_widen_one(hi, shift, offset, True) >> np.uint32(_WIDE_MANT_BITS))
                _count_block(widened[:block.size], zeros, field_lo, field_hi, _WIDE_MANT_BITS, _WIDE_EXP_BITS,
                             field_tables)
            else:
                # Normal values only: the raw exponent field is the widened one (bfloat16 shares float32's).
                field_shift = _narrow(mant_bits, block)
                _count_block(block, zeros, np.int64(lo_nonzero >> field_shift), np.int64(hi >> field_shift),
                             mant_bits, exp_bits, field_tables)
            return s
        return widen_then_count

    def count(block, widened, zeros, lo_nonzero, hi, min_normal, shift, offset, exact_small, exp_bits, mant_bits,
              counts, field_tables):
        field_shift = _narrow(mant_bits, block)
        _count_block(block, zeros, np.int64(lo_nonzero >> field_shift), np.int64(hi >> field_shift), mant_bits,
                     exp_bits, field_tables)
        return _block_sumsq(block)
    return count


@njit(parallel=True, cache=True)
def _scan_chunks(addresses, numels, bits_like, masks, exp_bits, mant_bits, scale, widen_shift, widen_offset,
                 partial_counts, partial_sumsq):
    """One partial record per chunk (NOTE: [chunking], NOTE: [numba blocks]); chunks are scanned in parallel."""
    abs_mask, min_normal, inf_bits = masks[0], masks[1], masks[2]
    shift = np.uint32(widen_shift)
    offset = np.uint32(widen_offset)
    # float16's subnormals widen to normal float32 values (_widen_one): its blocks with subnormals stay fast.
    exact_small = bits_like.itemsize == 2 and exp_bits == 5
    count_exp_bits = _WIDE_EXP_BITS if bits_like.itemsize == 2 else exp_bits
    for c in prange(addresses.size):
        data = numba.carray(_pointer_at(addresses[c], bits_like), numels[c])
        counts = partial_counts[c]
        absmax = np.int64(0)
        absmin = np.int64(_ABSMIN_NONE)
        s = 0.0
        # Small chunks go element by element: zeroing and folding the tables would cost more than they save.
        use_tables = data.size >= _NUM_TABLES << count_exp_bits
        field_tables = np.zeros(_NUM_TABLES << count_exp_bits if use_tables else 0, np.int32)
        widened = np.empty(_BLOCK_ELEMS if use_tables and data.itemsize == 2 else 0, np.uint32)
        for begin in range(0, data.size, _BLOCK_ELEMS):
            block = data[begin:begin + _BLOCK_ELEMS]
            # The passes over this block read only it, so the hardware prefetcher stops running ahead: ask for the
            # next block meanwhile, a quarter before each pass (a whole block's lines at once would stall on the
            # core's few slots for outstanding misses).
            ahead = addresses[c] + min(begin + _BLOCK_ELEMS, data.size) * data.itemsize
            ahead_size = addresses[c] + min(begin + 2 * _BLOCK_ELEMS, data.size) * data.itemsize - ahead
            quarter = -(-ahead_size // (4 * _CACHE_LINE)) * _CACHE_LINE
            _prefetch_lines(ahead, 0, quarter)
            if use_tables:
                block_zeros, lo_nonzero, hi = _block_bounds(block, abs_mask)
                zeros = np.int64(block_zeros)
                _prefetch_lines(ahead, quarter, 2 * quarter)
                if hi < inf_bits and (lo_nonzero >= min_normal or exact_small):
                    counts[_REC_ZERO] += zeros
                    if zeros == block.size:
                        _prefetch_lines(ahead, 2 * quarter, ahead_size)
                        continue
                    absmax = max(absmax, np.int64(hi))
                    absmin = min(absmin, np.int64(lo_nonzero))
                    s += _fast_block(block, widened, zeros, lo_nonzero, hi, min_normal, shift, offset, exact_small,
                                     exp_bits, mant_bits, counts, field_tables)
                    _prefetch_lines(ahead, 3 * quarter, ahead_size)
                    continue
            _prefetch_lines(ahead, quarter, ahead_size)
            absmax, absmin, block_sumsq = _scan_exact(block, exp_bits, mant_bits, scale, counts, absmax, absmin)
            s += block_sumsq
        if use_tables:
            _fold_fields(field_tables, count_exp_bits, counts)
        counts[_REC_ABSMAX] = absmax
        counts[_REC_ABSMIN] = absmin
        partial_sumsq[c] = s


_NORMAL, _ZERO, _SUBNORMAL, _POSINF, _NEGINF, _NAN = L.NORMAL, L.ZERO, L.SUBNORMAL, L.POSINF, L.NEGINF, L.NAN
_BYTE_TABLES = 4  # pattern counters in interleaved tables, as the C++ kernel's kByteTables


@njit(parallel=True, cache=True)
def _scan_byte_chunks(addresses, numels, table, partial_counts, partial_sumsq):
    """One partial record per chunk of a one-byte format: counts per bit pattern, folded through `table`
    (byte_formats.byte_table) in pattern order."""
    bits_like = np.empty(0, np.uint8)
    for c in prange(addresses.size):
        data = numba.carray(_pointer_at(addresses[c], bits_like), numels[c])
        pattern_counts = np.zeros((_BYTE_TABLES, 256), np.int64)
        n = data.size
        m = n - n % _BYTE_TABLES
        for i in range(0, m, _BYTE_TABLES):
            for t in range(_BYTE_TABLES):
                pattern_counts[t, data[i + t]] += 1
        for i in range(m, n):
            pattern_counts[0, data[i]] += 1
        counts = partial_counts[c]
        absmax = np.int64(0)
        absmin = np.int64(_ABSMIN_NONE)
        s = 0.0
        for b in range(256):
            k = pattern_counts[:, b].sum()
            if k == 0:
                continue
            cls = np.int64(table[TABLE_CLASS, b])
            if cls == _NAN:
                counts[_REC_NAN] += k
            elif cls == _POSINF:
                counts[_REC_POSINF] += k
            elif cls == _NEGINF:
                counts[_REC_NEGINF] += k
            elif cls == _ZERO:
                counts[_REC_ZERO] += k
            else:
                if cls == _SUBNORMAL:
                    counts[_REC_SUBNORMAL] += k
                counts[_REC_HIST + np.int64(table[TABLE_BIN, b])] += k
                absmax = max(absmax, np.int64(b & 0x7F))
                absmin = min(absmin, np.int64(b & 0x7F))
                s += np.float64(k) * table[TABLE_SQUARE, b]
        counts[_REC_ABSMAX] = absmax
        counts[_REC_ABSMIN] = absmin
        partial_sumsq[c] = s


@njit(cache=True)
def _merge(chunk_task, partial_counts, partial_sumsq, records, sumsq):
    """Merge partial records into their tensors' records in chunk order (NOTE: [chunking])."""
    for c in range(chunk_task.size):
        t = chunk_task[c]
        for k in range(records.shape[1]):
            if k == _REC_ABSMAX:
                records[t, k] = max(records[t, k], partial_counts[c, k])
            elif k == _REC_ABSMIN:
                records[t, k] = min(records[t, k], partial_counts[c, k])
            else:
                records[t, k] += partial_counts[c, k]
        sumsq[t] += partial_sumsq[c]


# -- the backend ---------------------------------------------------------------------------------------------------

class NumbaBackend:
    """The scan compiled by numba, for CPUs without the C++ extension (NOTE: [numba blocks])."""

    name = "numba"
    # Numba's workqueue threading layer (used where neither TBB nor OpenMP is installed) aborts the process when two
    # threads launch parallel kernels at once; one scan at a time already has every core.
    _launch_lock = threading.Lock()

    def __init__(self, *, chunk_elems: int = L.DEFAULT_CHUNK_ELEMS):
        if not 1 <= chunk_elems < 2**31:
            raise ValueError(f"chunk_elems must be a number of elements from 1 to 2**31 - 1 (the per-chunk counters "
                             f"are int32), got {chunk_elems}")
        self.chunk_elems = int(chunk_elems)

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray:
        inputs = as_scan_inputs(inputs)
        for device in inputs.devices:
            if torch.device(device).type != "cpu":
                name = next(item.name for item in inputs if item.identity.device == device)
                raise ValueError(f"the numba backend scans CPU tensors only; {name!r} is on {device}")
        records = L.empty_records(len(inputs))
        sumsq = np.zeros(len(inputs), dtype=np.float64)
        ptrs, numels, codes = inputs.table()
        for code in np.unique(codes[numels > 0]).tolist():
            tasks = np.flatnonzero((codes == code) & (numels > 0))
            self._scan_format(code, ptrs[tasks], numels[tasks], tasks, records, sumsq)
        records[:, L.REC_SUMSQ] = sumsq.view(np.int64)
        return records

    def _scan_format(self, code: int, bases: np.ndarray, numels: np.ndarray, tasks: np.ndarray,
                     records: np.ndarray, sumsq: np.ndarray) -> None:
        chunks_per_task = -(-numels // self.chunk_elems)
        chunk_task = np.repeat(np.arange(len(numels)), chunks_per_task)
        first_chunk = np.cumsum(chunks_per_task) - chunks_per_task
        begins = (np.arange(chunk_task.size) - first_chunk[chunk_task]) * self.chunk_elems
        chunk_numels = np.minimum(numels[chunk_task] - begins, self.chunk_elems)
        addresses = bases[chunk_task] + begins * L.FORMATS[code].bytes
        partial_counts = L.empty_records(chunk_task.size)
        partial_sumsq = np.zeros(chunk_task.size, dtype=np.float64)
        with self._launch_lock:
            if L.FORMATS[code].bytes == 1:
                _scan_byte_chunks(addresses, chunk_numels, byte_table(code), partial_counts, partial_sumsq)
            else:
                fmt = _FORMATS[code]
                _scan_chunks(addresses, chunk_numels, np.empty(0, fmt.bits_dtype), fmt.masks, fmt.exp_bits,
                             fmt.mant_bits, fmt.scale, fmt.widen_shift, fmt.widen_offset, partial_counts,
                             partial_sumsq)
        _merge(tasks[chunk_task], partial_counts, partial_sumsq, records, sumsq)
