"""The numba backend's scan of the one-byte (float8) formats, in blocks counted in registers (NOTE: [numba bytes]).

NOTE: [numba bytes]
Counting each byte into a table of 256 patterns waits on a load and a store per byte (0.15-0.2 of the read limit).
So a chunk is read in blocks of _BYTE_BLOCK bytes, each with vectorised passes of narrow integer arithmetic:
  - bounds: the number of zeros, the smallest non-zero and largest |x| bits and, in the fnuz formats (whose NaN is
    0x80) alone, the number of 0x80 bytes. A block whose largest |x| bits reach the format's first inf or NaN
    pattern, or (fnuz) that holds a 0x80, is counted per pattern instead, as is any block shorter than one residue
    group.
  - fields: every other element is zero, subnormal or normal, and a normal value's bin depends on its exponent field
    alone. The fields are counted in residue words (NOTE: [numba blocks]): 4-bit fields (e4m3) name one residue each;
    5-bit ones (e5m2) do too when the block's non-zero fields span fewer than 16 (residue r names field field_lo +
    ((r - field_lo) mod 16); zeros, on residue 0, are taken out by their number), and otherwise take the two-word
    window of 32 from field 0 (count_residues_wide, twice the cost). The elements past a chunk's last whole group are
    counted field by field. Field 0 (zeros and subnormals) is never read from these counts.
  - subnormals: only in a block whose smallest non-zero |x| bits lie below the smallest normal: the elements below
    2**j for j = 1 .. mant_bits, counted in 16-bit lanes, split them by their leading mantissa bit, as classify.h bins
    them; the zeros are the elements below 2**0.
  - squares: each |x| becomes a float64 of its value times a power of two, exactly, by moving its bits into
    float64's fields (a normal by scaling by 2**(1023 - bias); in a block with subnormals, all over the exponent
    field 1024, field 0 then mended by 2 * d - 4, as _small_sumsq says), and its square (at most 8 significant bits,
    exact) is added in float64 by one fused multiply-add (reassociated, so vectorised; deterministic, as in
    _block_sumsq of numba_cpu.py). For e4m3 formats the sum is exact besides: every square is a multiple of the
    smallest subnormal's and a block's sum is below 2**48 of them. Constant shifts (one loop per mantissa width)
    keep the shifts immediate; a block without subnormals skips their select.
Measured on 240 blocks of the bench's Gaussian float8 sets (amax scaled to the format's largest), hot in L2, one
core, per element (e4m3fn / e5m2): bounds 0.019 / 0.022 ns (0.027 / 0.031 with the 0x80 count, still taken for the
fnuz formats), residues 0.060 / 0.067 ns (the two-word window 0.11 ns, taken by a fifth of the e5m2 blocks),
squares 0.054 / 0.061 ns (0.085 / 0.10 ns with subnormals, in a third of the e4m3fn blocks; the float32 squares
they replaced, converted to float64 and added, took 0.090 / 0.096 ns, 0.114 / 0.113 ns with subnormals), each
subnormal threshold 0.015 ns; the whole fast path 0.156 / 0.177 ns (0.206 / 0.190 before both changes). Tried and
dropped: residue words split into two 32-bit words of 8 nibbles (0.08-0.12 ns against 0.065: numba's shifts widen
back to 64 bits, and with 32-bit shifts the selects cost more than they save), a byte-wide pre-pass of the residue
shift amounts (no clear gain: the pass is bound by its widening loads and variable shifts, not its arithmetic),
squares summed exactly in two 32-bit integer pieces (0.15 ns with subnormals) or in one int64 (0.13 ns), field
thresholds counted in byte lanes, four a pass (0.17 ns a pass), and blocks of 1920 or 7680 bytes (both slower).
Every count is exact by construction; bins, classes and the patterns' values come from the format's table
(byte_formats.byte_table), which the per-pattern blocks are folded through in pattern order. A block is far below
2**16 elements, so its 16-bit counters never wrap.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange
from numba.extending import overload

from nanscan import _layout as L
from nanscan.backends.byte_formats import TABLE_BIN, TABLE_CLASS, TABLE_SQUARE
from nanscan.backends.numba_blocks import (CACHE_LINE, GROUP_ELEMS, RESIDUES, count_residues, count_residues_wide,
                                          float64_of_bits, pointer_at, prefetch_lines, wide_counts)

_BYTE_BLOCK = 4 * GROUP_ELEMS  # 3840 bytes: whole residue groups, in L1 between the passes
_BYTE_TABLES = 4  # pattern counters in interleaved tables, as the C++ kernel's kByteTables

_REC_NAN, _REC_POSINF, _REC_NEGINF = L.REC_NAN, L.REC_POSINF, L.REC_NEGINF
_REC_ZERO, _REC_SUBNORMAL, _REC_HIST = L.REC_ZERO, L.REC_SUBNORMAL, L.REC_HIST
_REC_ABSMAX, _REC_ABSMIN = L.REC_ABSMAX_BITS, L.REC_ABSMIN_BITS
_ABSMIN_NONE = L.ABSMIN_NONE
_NORMAL, _ZERO, _SUBNORMAL, _POSINF, _NEGINF, _NAN = L.NORMAL, L.ZERO, L.SUBNORMAL, L.POSINF, L.NEGINF, L.NAN


def byte_traits(code: int, table: np.ndarray) -> np.ndarray:
    """[exp_bits, mant_bits, bias, first |x| bits that are inf or NaN (128: none), whether 0x80 is NaN] of a
    one-byte format, read from its traits and its pattern table."""
    f = L.FORMATS[code]
    special = [b for b in range(128) if table[TABLE_CLASS, b] in (_NAN, _POSINF, _NEGINF)]
    return np.array([f.exp_bits, f.mant_bits, f.bias, min(special, default=128),
                     int(table[TABLE_CLASS, 0x80] == _NAN)], dtype=np.int64)


@njit(cache=True)
def _byte_bounds(block):
    """Zeros, 0x80 bytes, smallest |x| bits minus one (wrapping: 0xff when all are zero) and largest |x| bits."""
    zeros = np.uint16(0)
    sign_only = np.uint16(0)
    lo = np.uint8(0xFF)
    hi = np.uint8(0)
    for i in range(block.size):
        b = block[i]
        a = np.uint8(b & np.uint8(0x7F))
        zeros = np.uint16(zeros + np.uint16(a == np.uint8(0)))
        sign_only = np.uint16(sign_only + np.uint16(b == np.uint8(0x80)))
        lo = min(lo, np.uint8(a - np.uint8(1)))
        hi = max(hi, a)
    return np.int64(zeros), np.int64(sign_only), np.int64(lo), np.int64(hi)


@njit(cache=True)
def _byte_extremes(block):
    """_byte_bounds less the count of 0x80 bytes, for the formats where 0x80 is -0 and need not be told apart: its
    16-bit counter was a third of the pass."""
    zeros = np.uint16(0)
    lo = np.uint8(0xFF)
    hi = np.uint8(0)
    for i in range(block.size):
        a = np.uint8(block[i] & np.uint8(0x7F))
        zeros = np.uint16(zeros + np.uint16(a == np.uint8(0)))
        lo = min(lo, np.uint8(a - np.uint8(1)))
        hi = max(hi, a)
    return np.int64(zeros), np.int64(lo), np.int64(hi)


@njit(cache=True)
def _count_below(block, bound):
    """Number of elements whose |x| bits lie below `bound` (at most 0x80), in 16-bit lanes."""
    k = np.uint16(0)
    t = np.uint8(bound - 1)
    for i in range(block.size):
        k = np.uint16(k + np.uint16(np.uint8(block[i] & np.uint8(0x7F)) <= t))
    return np.int64(k)


def _byte_sumsq(block, mant_bits, bias, small):
    """Sum of squares of a block of zeros and finite values of a one-byte format; `small`: whether the block may hold
    subnormals (jitted code only)."""


@overload(_byte_sumsq, jit_options={"fastmath": {"reassoc", "contract"}})
def _byte_sumsq_impl(block, mant_bits, bias, small):
    # Reassociation lets the sum vectorise; the same compiled loop always adds in the same order. Only finite values
    # reach it. Each |x| becomes the float64 of its value (times a power of two) by moving its bits into float64's
    # fields, exactly, and its square (at most 8 significant bits) is exact, so contracting the square and the add
    # into one fused multiply-add rounds only the sum, as a separate add would; 8 float64 lanes then take one
    # conversion-free operation per element where float32 squares needed a square, a conversion and an add (NOTE:
    # [numba bytes]). No subnormal float64 is ever made, so a flush-to-zero mode cannot change it.
    def widen_and_sum(block, mant_bits, bias, small):
        # Constant shifts (one loop per mantissa width) keep the shifts immediate: the mantissa's top bit lands on
        # float64's bit 51.
        if mant_bits == 3:
            if small:
                return _small_sumsq(block, np.uint64(49), np.uint8(8)) * 2.0 ** (-2 * (bias + 1))
            return _normal_sumsq(block, np.uint64(49), 2.0 ** (1023 - bias))
        if small:
            return _small_sumsq(block, np.uint64(50), np.uint8(4)) * 2.0 ** (-2 * (bias + 1))
        return _normal_sumsq(block, np.uint64(50), 2.0 ** (1023 - bias))
    return widen_and_sum


@njit(cache=True, fastmath={"reassoc", "contract"}, inline="always")
def _normal_sumsq(block, shift, scale):
    """Sum of squares of a block of zeros and normal one-byte values (_byte_sumsq), inlined where `shift` is a
    constant: the |x| bits moved into a float64's fields make a normal float64 (or zero) whose exponent is short by
    1023 - bias, restored by the exact scaling by `scale` = 2**(1023 - bias) before the square (the square of the
    unscaled value would underflow)."""
    s = 0.0
    for i in range(block.size):
        v = float64_of_bits(np.uint64(np.uint64(block[i] & np.uint8(0x7F)) << shift)) * scale
        s += v * v
    return s


@njit(cache=True, fastmath={"reassoc", "contract"}, inline="always")
def _small_sumsq(block, shift, min_normal):
    """Sum of squares of a block of zeros, subnormal and normal one-byte values (_byte_sumsq) times 4**(bias + 1),
    inlined where `shift` is a constant. The |x| bits moved into a float64's fields and or-ed with the exponent
    field 1024 (whose low bits are clear, so the field's bits add to it) make d = 2**(field + 1) * (1 + m / 2**mant):
    |x| * 2**(bias + 1) for a normal value. For field 0, where |x| * 2**(bias + 1) = m * 2**(2 - mant), that is
    2 * d - 4 (0 for a zero), exactly. No integer conversion and no subnormal float64."""
    s = 0.0
    for i in range(block.size):
        a = block[i] & np.uint8(0x7F)
        d = float64_of_bits(np.uint64(np.uint64(a) << shift) | np.uint64(1 << 62))
        v = d if a >= min_normal else 2.0 * d - 4.0
        s += v * v
    return s


@njit(cache=True)
def _count_patterns(block, patterns):
    """Counts each byte into _BYTE_TABLES interleaved pattern tables (runs of one pattern do not wait on each other's
    stores)."""
    n = block.size
    m = n - n % _BYTE_TABLES
    for i in range(0, m, _BYTE_TABLES):
        for t in range(_BYTE_TABLES):
            patterns[t, block[i + t]] += 1
    for i in range(m, n):
        patterns[0, block[i]] += 1


@njit(cache=True)
def _fast_byte_block(block, zeros, lo, hi, traits, table, counts, fields):
    """Counts the fields (into `fields`) and the subnormals of a block of zeros and finite values whose non-zero
    |x| bits lie in [lo, hi], `zeros` of them zeros; returns the block's sum of squares (NOTE: [numba bytes])."""
    exp_bits, mant_bits, bias = traits[0], traits[1], traits[2]
    if lo < (1 << mant_bits):
        below = zeros
        for j in range(mant_bits):
            upto = _count_below(block, 2 << j)
            counts[_REC_HIST + np.int64(table[TABLE_BIN, 1 << j])] += upto - below
            below = upto
        counts[_REC_SUBNORMAL] += below - zeros
    grouped = block.size - block.size % GROUP_ELEMS
    field_mask = (1 << exp_bits) - 1
    tail_zeros = 0
    for i in range(grouped, block.size):
        fields[(np.int64(block[i]) >> mant_bits) & field_mask] += 1
        tail_zeros += (block[i] & np.uint8(0x7F)) == 0
    field_lo, field_hi = lo >> mant_bits, hi >> mant_bits
    if grouped:
        if exp_bits <= 4 or field_hi - field_lo < RESIDUES:
            # Residue r names field field_lo + ((r - field_lo) mod 16) (every field, for 4-bit fields). Field 0,
            # zeros and subnormals, is never read; when it lies below the window its elements are zeros alone,
            # counted on residue 0 and taken out.
            words = count_residues(block[:grouped], mant_bits)
            for k in range(4):
                for q in range(4):
                    r = 4 * q + k
                    c = np.int64((words[k] >> np.uint64(16 * q)) & np.uint64(0xFFFF))
                    if r == 0 and field_lo > 0:
                        c -= zeros - tail_zeros
                    if c:
                        fields[field_lo + ((r - field_lo) & (RESIDUES - 1))] += c
        else:
            fields[:2 * RESIDUES] += wide_counts(count_residues_wide(block[:grouped], mant_bits, 0))
    return _byte_sumsq(block, mant_bits, bias, lo < (1 << mant_bits))


@njit(cache=True)
def _fold_patterns(patterns, table, counts, absmax, absmin):
    """Adds the pattern counts to the record through the format's table, in pattern order; returns the updated
    extremes and the patterns' sum of squares."""
    s = 0.0
    for b in range(256):
        k = np.int64(0)
        for t in range(_BYTE_TABLES):
            k += patterns[t, b]
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
    return absmax, absmin, s


@njit(parallel=True, cache=True)
def scan_byte_chunks(addresses, numels, groups, segments, table, traits, partial_counts, partial_sumsq):
    """Each group of chunks of a one-byte format (groups[g] .. groups[g + 1] - 1) is scanned by one thread, in order,
    each chunk added to its segment's partial record and its sum of squares kept apart (NOTE: [chunking], NOTE:
    [numba bytes]). `table` is byte_formats.byte_table of the format, `traits` its byte_traits."""
    bits_like = np.empty(0, np.uint8)
    mant_bits = traits[1]
    special_lo, sign_only_nan = traits[3], traits[4]
    for g in prange(groups.size - 1):
        # Pattern counts are folded per chunk (their squares are part of the chunk's sum), field counts per segment.
        patterns = np.zeros((_BYTE_TABLES, 256), np.int32)  # a chunk is below 2**31 elements
        fields = np.zeros(2 * RESIDUES, np.int64)
        fields_segment = np.int64(-1)
        for c in range(groups[g], groups[g + 1]):
            if fields_segment >= 0 and segments[c] != fields_segment:
                _fold_byte_fields(fields, table, mant_bits, partial_counts[fields_segment])
            fields_segment = segments[c]
            data = numba.carray(pointer_at(addresses[c], bits_like), numels[c])
            counts = partial_counts[segments[c]]
            absmax = np.int64(0)
            absmin = np.int64(_ABSMIN_NONE)
            s = 0.0
            by_pattern = False
            for begin in range(0, data.size, _BYTE_BLOCK):
                block = data[begin:begin + _BYTE_BLOCK]
                # As in numba_cpu's _scan_chunks: the next block is asked for in halves, before each pass.
                ahead = addresses[c] + min(begin + _BYTE_BLOCK, data.size)
                ahead_size = addresses[c] + min(begin + 2 * _BYTE_BLOCK, data.size) - ahead
                half = -(-ahead_size // (2 * CACHE_LINE)) * CACHE_LINE
                prefetch_lines(ahead, 0, half)
                if block.size >= GROUP_ELEMS:
                    if sign_only_nan:  # fnuz formats: a 0x80 is a NaN, so the block is counted per pattern
                        zeros, sign_only, lo_minus_one, hi = _byte_bounds(block)
                    else:
                        zeros, lo_minus_one, hi = _byte_extremes(block)
                        sign_only = 0
                    if hi < special_lo and sign_only == 0:
                        prefetch_lines(ahead, half, ahead_size)
                        counts[_REC_ZERO] += zeros
                        if zeros == block.size:
                            continue
                        absmax = max(absmax, hi)
                        absmin = min(absmin, lo_minus_one + 1)
                        s += _fast_byte_block(block, zeros, lo_minus_one + 1, hi, traits, table, counts, fields)
                        continue
                prefetch_lines(ahead, half, ahead_size)
                _count_patterns(block, patterns)
                by_pattern = True
            if by_pattern:
                absmax, absmin, pattern_sumsq = _fold_patterns(patterns, table, counts, absmax, absmin)
                s += pattern_sumsq
                patterns[:] = 0
            counts[_REC_ABSMAX] = max(counts[_REC_ABSMAX], absmax)
            counts[_REC_ABSMIN] = min(counts[_REC_ABSMIN], absmin)
            partial_sumsq[c] = s
        if fields_segment >= 0:
            _fold_byte_fields(fields, table, mant_bits, partial_counts[fields_segment])


@njit(cache=True)
def _fold_byte_fields(fields, table, mant_bits, counts):
    """Adds the normal values' field counts to a record's bins and clears them; field 0 holds the zeros and
    subnormals, counted apart."""
    for f in range(1, fields.size):
        if fields[f]:
            counts[_REC_HIST + np.int64(table[TABLE_BIN, f << mant_bits])] += fields[f]
            fields[f] = 0
