"""The numba backend's scan of the one-byte (float8) formats, in blocks counted in registers (NOTE: [numba bytes]).

NOTE: [numba bytes]
Counting each byte into a table of 256 patterns waits on a load and a store per byte (0.15-0.2 of the read limit).
So a chunk is read in blocks of _BYTE_BLOCK bytes, each with vectorised passes of narrow integer arithmetic:
  - bounds (_byte_bounds, one loop per kind of format): the smallest non-zero and largest |x| bits, in byte lanes;
    for 5-bit fields the number of zeros too (a 16-bit counter, two thirds of the pass), and in the fnuz formats
    (whose NaN is 0x80) whether a 0x80 is there (a byte minimum of the bytes xor 0x80). A block whose largest |x| bits
    reach the format's first inf or NaN pattern, or (fnuz) that holds a 0x80, is counted per pattern instead.
  - fields: every other element is zero, subnormal or normal, and a normal value's bin depends on its exponent field
    alone. The fields are counted mod 16 in residue words as count_residues does (NOTE: [numba blocks]), but fed
    8-byte words (_word_residues): byte j of a word, masked to its field's low 4 bits and the word shifted right by
    8 * j, holds 4 * (field mod 16) in its low 6 bits, and a rotation of 1 by it (llvm.fshl, which ignores the bits
    above) makes the nibble: no widening load, 3 vector operations per 8 elements. A block's elements past its whole
    groups (a chunk's last 256 bytes, a tensor's tail) are copied into a zeroed group and counted the same way, the
    padding taken off residue 0. Residue r names field window_lo + ((r - window_lo) mod 16): 4-bit fields each have
    their own; 5-bit fields take the window from field_lo when the non-zero fields span fewer than 16, else the top
    16 fields, with the 1 to 4 fields below it counted by thresholds in one pass (_below_window) and taken out of
    the residues they share; wider blocks take the two-word window (count_residues_wide). Where a field below the
    window is field 0 beneath field_lo, its elements are the zeros, known by their number. Field 0 (zeros and
    subnormals) is never read from these counts.
  - zeros and subnormals: for 4-bit fields residue 0 counts field 0 alone, the zeros where the block has no
    subnormals (so the bounds pass needs no zero count). In a block whose smallest non-zero |x| bits lie below the
    smallest normal, the elements below 2**j (one pass, several bounds in 16-bit lanes) split the subnormals by their
    leading mantissa bit, as classify.h bins them; for 4-bit fields the bounds 1, 2 and 4 (the zeros are the elements
    below 1, field 0's the elements below 8), for 5-bit fields 2 and 4.
  - squares: each |x| becomes d = |x| * 2**(bias + 1), a float64, exactly: the byte, moved by shifts from its 8-byte
    word straight into float64's fields and or-ed with the exponent field 1024 (one shift and one ternary logic
    operation), is 2**(field + 1) * (1 + m / 2**mant), a normal value's d; a zero is taken as d = 2 and 4 per zero
    taken off the sum; in a block with subnormals, d becomes min(d, 2 * d - 4), a field-0 value's d and 0 for a
    zero (_square_of_bits). Its square (at most 8 significant bits, exact) is added by one fused multiply-add
    (reassociated, so vectorised; deterministic, as in _block_sumsq of numba_cpu.py). For e4m3 formats the sum is
    exact besides: every d**2 is a multiple of 2**-2 and a block's sum below 2**46.
Measured on 240 blocks of the bench's Gaussian float8 sets (amax scaled to the format's largest), hot in L2, one
core, per element (e4m3fn / e5m2; the machine shared, +-10%): bounds 0.007 / 0.020 ns (0.019 / 0.021 with the zero
count they had), residues 0.034-0.043 ns (0.060 / 0.067 ns from widened bytes; the two-word window 0.11 ns, now
taken by under 2% of the bench's e5m2 blocks where it was a fifth of them), squares 0.039-0.042 ns (0.054 / 0.061
before), 0.054-0.062 ns with subnormals (0.085 / 0.10), in 72 of 220 e4m3fn blocks; the subnormal thresholds 0.028 ns
for three bounds (three passes of one: 0.042), 0.019-0.023 for two. The whole fast path 0.11-0.13 ns (0.156 / 0.177
before). On the bench set, two threads, in-process against the previous code: e4m3fn 25.3-37.9 ms -> 18.9-23.8 ms,
e5m2 24.5-36.2 ms -> 18.0-23.9 ms (numba/read_limit ~0.21-0.30 -> ~0.32-0.41, the read probe itself varying
5.9-8.8 ms). Tried and dropped: residue words split into two 32-bit words of 8 nibbles (0.08-0.12 ns against 0.065:
numba's shifts widen back to 64 bits, and with 32-bit shifts the selects cost more than they save), a byte-wide
pre-pass of the residue shift amounts (no clear gain), squares summed exactly in two 32-bit integer pieces (0.15 ns
with subnormals) or in one int64 (0.13 ns), field thresholds counted in byte lanes, four a pass (0.17 ns a pass; a
lanes-by-rows layout of 8-bit counters, 0.075 ns for four, is no better: LLVM widens the counters to 16 bits), blocks
of 1920 or 7680 bytes (both slower), the word residues with all eight bytes in one row loop (0.13-0.21 ns: too long
for LLVM to unroll, it vectorises the row loop with gathers), the zero count of 5-bit fields summed as min(|x|, 1)
in 32- or 64-bit counters (0.035 / 0.07 ns against 0.020: no psadbw), and the scaling by 2**(-2 * (bias + 1)) made
from its bits in place of a power (no measurable gain).
Every count is exact by construction; bins, classes and the patterns' values come from the format's table
(byte_formats.byte_table), which the per-pattern blocks are folded through in pattern order. A block is far below
2**16 elements, so its 16-bit counters never wrap. The 8-byte words may start at any byte: their array is typed
unaligned (byte_words), so no load claims an alignment it lacks.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from nanscan.engine import _layout as L
from nanscan.engine.backends.byte_formats import TABLE_BIN, TABLE_CLASS, TABLE_SQUARE
from nanscan.engine.backends.numba_blocks import (CACHE_LINE, GROUP_ELEMS, GROUP_ROWS, RESIDUES, WORD_LANES,
                                                  add_fingerprint, add_slots, byte_words, count_residues_wide,
                                                  fingerprint_part, float64_of_bits, four_counts, pointer_at,
                                                  prefetch_lines, rotated_count, rotated_words, wide_counts)

_BYTE_BLOCK = 4 * GROUP_ELEMS  # 3840 bytes: whole residue groups, in L1 between the passes
_BYTE_TABLES = 4  # pattern counters in interleaved tables, as the C++ kernel's kByteTables
# Residue words fed 8-byte words (NOTE: [numba bytes]): WORD_LANES words of a group side by side (one vector), each
# fed GROUP_ROWS of them, so a group is GROUP_ELEMS bytes as in count_residues.
_WORD_GROUP = WORD_LANES * GROUP_ROWS
# A block of 5-bit fields spanning 16 + k fields (k < _BELOW_WINDOW) is counted in the window of its top 16 fields and
# the k fields below it by thresholds; a wider one in the two-word window (count_residues_wide).
_BELOW_WINDOW = 5

_REC_NAN, _REC_POSINF, _REC_NEGINF = L.REC_NAN, L.REC_POSINF, L.REC_NEGINF
_REC_ZERO, _REC_SUBNORMAL, _REC_HIST = L.REC_ZERO, L.REC_SUBNORMAL, L.REC_HIST
_REC_ABSMAX, _REC_ABSMIN, _REC_FINGERPRINT = L.REC_ABSMAX_BITS, L.REC_ABSMIN_BITS, L.REC_FINGERPRINT
_ABSMIN_NONE = L.ABSMIN_NONE
_NORMAL, _ZERO, _SUBNORMAL, _POSINF, _NEGINF, _NAN = L.NORMAL, L.ZERO, L.SUBNORMAL, L.POSINF, L.NEGINF, L.NAN


def byte_traits(code: int, table: np.ndarray) -> np.ndarray:
    """[exp_bits, mant_bits, bias, first |x| bits that are inf or NaN (128: none), whether 0x80 is NaN] of a
    one-byte format, read from its traits and its pattern table."""
    f = L.FORMATS[code]
    special = [b for b in range(128) if table[TABLE_CLASS, b] in (_NAN, _POSINF, _NEGINF)]
    return np.array([f.exp_bits, f.mant_bits, f.bias, min(special, default=128),
                     int(table[TABLE_CLASS, 0x80] == _NAN)], dtype=np.int64)


def _byte_bounds(block, count_zeros, find_nan80):
    """(zeros, smallest |x| bits minus one (wrapping: 0xff when all are zero), largest |x| bits, smallest byte xor
    0x80: 0 where the block holds a 0x80, the NaN of the fnuz formats) of a block; `count_zeros` and `find_nan80` are
    literal flags: a reduction left out gives 0 or 0xff (jitted code only)."""


@overload(_byte_bounds, prefer_literal=True)
def _byte_bounds_impl(block, count_zeros, find_nan80):
    # The flags are compile-time constants, one loop per pair: each reduction left out keeps the loop in narrower
    # lanes (the 16-bit zero counter is two thirds of the pass). e4m3 formats take their zeros from residue 0, and
    # only the fnuz formats look for a 0x80 (NOTE: [numba bytes]).
    if not (isinstance(count_zeros, types.BooleanLiteral) and isinstance(find_nan80, types.BooleanLiteral)):
        return None
    with_zeros, with_nan80 = count_zeros.literal_value, find_nan80.literal_value

    def bounds(block, count_zeros, find_nan80):
        zeros = np.uint16(0)
        lo = np.uint8(0xFF)
        hi = np.uint8(0)
        flipped = np.uint8(0xFF)
        for i in range(block.size):
            b = block[i]
            a = np.uint8(b & np.uint8(0x7F))
            if with_zeros:
                zeros = np.uint16(zeros + np.uint16(a == np.uint8(0)))
            lo = min(lo, np.uint8(a - np.uint8(1)))
            hi = max(hi, a)
            if with_nan80:
                flipped = min(flipped, np.uint8(b ^ np.uint8(0x80)))
        return np.int64(zeros), np.int64(lo), np.int64(hi), np.int64(flipped)
    return bounds


@njit(cache=True)
def _count_below(block, bound):
    """Number of elements whose |x| bits lie below `bound` (at most 0x80), in 16-bit lanes."""
    k = np.uint16(0)
    t = np.uint8(bound - 1)
    for i in range(block.size):
        k = np.uint16(k + np.uint16(np.uint8(block[i] & np.uint8(0x7F)) <= t))
    return np.int64(k)


@njit(cache=True)
def _count_below2(block, bound0, bound1):
    """Numbers of elements whose |x| bits lie below each bound (at most 0x80), in 16-bit lanes, in one pass."""
    k0 = k1 = np.uint16(0)
    t0, t1 = np.uint8(bound0 - 1), np.uint8(bound1 - 1)
    for i in range(block.size):
        a = np.uint8(block[i] & np.uint8(0x7F))
        k0 = np.uint16(k0 + np.uint16(a <= t0))
        k1 = np.uint16(k1 + np.uint16(a <= t1))
    return np.int64(k0), np.int64(k1)


@njit(cache=True)
def _count_below3(block, bound0, bound1, bound2):
    """_count_below2 for three bounds."""
    k0 = k1 = k2 = np.uint16(0)
    t0, t1, t2 = np.uint8(bound0 - 1), np.uint8(bound1 - 1), np.uint8(bound2 - 1)
    for i in range(block.size):
        a = np.uint8(block[i] & np.uint8(0x7F))
        k0 = np.uint16(k0 + np.uint16(a <= t0))
        k1 = np.uint16(k1 + np.uint16(a <= t1))
        k2 = np.uint16(k2 + np.uint16(a <= t2))
    return np.int64(k0), np.int64(k1), np.int64(k2)


@njit(cache=True)
def _count_below4(block, bound0, bound1, bound2, bound3):
    """_count_below2 for four bounds."""
    k0 = k1 = k2 = k3 = np.uint16(0)
    t0, t1, t2, t3 = np.uint8(bound0 - 1), np.uint8(bound1 - 1), np.uint8(bound2 - 1), np.uint8(bound3 - 1)
    for i in range(block.size):
        a = np.uint8(block[i] & np.uint8(0x7F))
        k0 = np.uint16(k0 + np.uint16(a <= t0))
        k1 = np.uint16(k1 + np.uint16(a <= t1))
        k2 = np.uint16(k2 + np.uint16(a <= t2))
        k3 = np.uint16(k3 + np.uint16(a <= t3))
    return np.int64(k0), np.int64(k1), np.int64(k2), np.int64(k3)


@njit(cache=True)
def _below_window(block, field_lo, n, mant_bits, zeros):
    """The numbers of elements of fields field_lo .. field_lo + n - 1 (1 <= n < _BELOW_WINDOW), counted below each
    field's upper bound in one pass; `zeros`: the block's zeros, the elements below field_lo's lower bound where
    field_lo is not 0."""
    b = (field_lo + 1) << mant_bits
    step = 1 << mant_bits
    if n == 1:
        k0 = _count_below(block, b)
        k1 = k2 = k3 = k0
    elif n == 2:
        k0, k1 = _count_below2(block, b, b + step)
        k2 = k3 = k1
    elif n == 3:
        k0, k1, k2 = _count_below3(block, b, b + step, b + 2 * step)
        k3 = k2
    else:
        k0, k1, k2, k3 = _count_below4(block, b, b + step, b + 2 * step, b + 3 * step)
    base = zeros if field_lo > 0 else 0
    return k0 - base, k1 - k0, k2 - k1, k3 - k2


@njit(cache=True, inline="always")
def _word_residues(words, shift, mask):
    """count_residues over 8-byte words (NOTE: [numba bytes]), inlined where `shift` and `mask` are constants: byte j
    of a word masked to its field's low 4 bits, the word shifted right by 8 * j + `shift`, has 4 * (field mod 16) in
    its low 6 bits (zeros below), and the rotation by it ignores the bits above (rotated_words and rotated_count,
    NOTE: [rotated counts])."""
    w0 = w1 = w2 = w3 = np.uint64(0)
    for g in range(words.size // _WORD_GROUP):
        group = words[g * _WORD_GROUP:(g + 1) * _WORD_GROUP]
        for lane in range(WORD_LANES):
            # Bytes 0-3 and 4-7 of the rows in two loops: a row loop of all eight is too long for LLVM to unroll,
            # and then it vectorises the row loop (gathers) in place of the lane loop.
            even, odd = four_counts(group, lane, WORD_LANES, rotated_words, rotated_count, mask, shift,
                                    np.uint64(0), np.uint64(8), np.uint64(16), np.uint64(24))
            even_high, odd_high = four_counts(group, lane, WORD_LANES, rotated_words, rotated_count, mask, shift,
                                              np.uint64(32), np.uint64(40), np.uint64(48), np.uint64(56))
            # 8 x 15 = 120 per 8-bit counter: no carries; then the 8-bit counters are spread into 16-bit ones.
            w0, w1, w2, w3 = add_slots(w0, w1, w2, w3, even + even_high, odd + odd_high)
    return w0, w1, w2, w3


@njit(cache=True)
def _byte_residues(block, mant_bits):
    """Counts of the exponent field mod 16 over the block's whole groups, as count_residues gives them (word k, slot
    q: residue 4 * q + k), counted from 8-byte words (NOTE: [numba bytes])."""
    words = byte_words(block)
    if mant_bits == 3:
        return _word_residues(words, np.uint64(1), np.uint64(0x7878787878787878))
    return _word_residues(words, np.uint64(0), np.uint64(0x3C3C3C3C3C3C3C3C))


def _byte_sumsq(block, mant_bits, bias, small, zeros):
    """Sum of squares of a block of zeros and finite values of a one-byte format, `zeros` of them zeros; `small`:
    whether the block may hold subnormals (jitted code only)."""


@overload(_byte_sumsq, jit_options={"fastmath": {"reassoc", "contract"}})
def _byte_sumsq_impl(block, mant_bits, bias, small, zeros):
    # Reassociation lets the sum vectorise; the same compiled loop always adds in the same order. Only finite values
    # reach it. Each |x| becomes d = |x| * 2**(bias + 1), a float64, exactly, by moving its bits into float64's fields
    # (_word_sumsq), and its square (at most 8 significant bits) is exact, so contracting the square and the add into
    # one fused multiply-add rounds only the sum, as a separate add would (NOTE: [numba bytes]). No subnormal float64
    # is ever made, so a flush-to-zero mode cannot change it.
    def widen_and_sum(block, mant_bits, bias, small, zeros):
        # Constant shifts and masks (one loop per mantissa width) keep them immediate: the |x| bits land on float64's
        # bits 49 (e4m3) or 50 (e5m2) up to 55, the top of the field on bit 55.
        if mant_bits == 3:
            s = _word_sumsq(block, np.uint64(49), np.uint64(0x00FE000000000000), small)
        else:
            s = _word_sumsq(block, np.uint64(50), np.uint64(0x01FC000000000000), small)
        if not small:
            s -= 4.0 * zeros  # each zero was taken as d = 2 (field 0 read as field 1024)
        return s * 2.0 ** (-2 * (bias + 1))
    return widen_and_sum


@njit(cache=True, fastmath={"reassoc", "contract"}, inline="always")
def _square_of_bits(bits, small):
    """The square of d for |x| bits moved into a float64's fields (_word_sumsq); `small`: field 0 is a subnormal's."""
    # Or-ing the exponent field 1024 (its low bits clear, so the field's bits add to it) makes d = 2**(field + 1) *
    # (1 + m / 2**mant): |x| * 2**(bias + 1) for a normal value. For field 0 (d below 4) that is m * 2**(2 - mant) =
    # 2 * d - 4 (0 for a zero), and a normal value's d is at least 4, so the smaller of d and 2 * d - 4 is the value
    # either way: a min in place of a compare and a select.
    d = float64_of_bits(bits | np.uint64(1 << 62))
    if small:
        e = 2.0 * d - 4.0
        d = d if d < e else e
    return d * d


@njit(cache=True, fastmath={"reassoc", "contract"}, inline="always")
def _word_sumsq(block, shift, mask, small):
    """Sum of d**2, d = |x| * 2**(bias + 1), over a block of zeros and finite one-byte values (a zero as d = 2 unless
    `small`), inlined where `shift` and `mask` are constants. The block is read in 8-byte words: byte j shifted right
    by 8 * j and left by `shift`, then masked, puts its |x| bits in a float64's fields with no widening load."""
    words = byte_words(block)
    s = 0.0
    for i in range(words.size):
        q = words[i]
        for j in range(8):
            s += _square_of_bits(((q >> np.uint64(8 * j)) << shift) & mask, small)
    for i in range(8 * words.size, block.size):
        s += _square_of_bits((np.uint64(block[i]) << shift) & mask, small)
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
def _fast_byte_block(block, zeros, lo, hi, traits, table, counts, fields, pad):
    """Counts the zeros, the fields (into `fields`) and the subnormals of a block of zeros and finite values whose
    non-zero |x| bits lie in [lo, hi]; `zeros`: their number, or -1 for a format of 4-bit fields, where residue 0
    tells it; `pad`: GROUP_ELEMS zero bytes, for the elements past the block's whole groups (NOTE: [numba bytes]);
    returns the block's sum of squares."""
    exp_bits, mant_bits, bias = traits[0], traits[1], traits[2]
    small = lo < (1 << mant_bits)
    grouped = block.size - block.size % GROUP_ELEMS
    rest = block.size - grouped
    field_lo, field_hi = lo >> mant_bits, hi >> mant_bits
    # The window of 16 fields the residues name: from field_lo, or, for 5-bit fields spanning 16 or more, the top 16,
    # the few fields below it counted by thresholds.
    window_lo = max(field_lo, field_hi - (RESIDUES - 1))
    narrow = window_lo - field_lo < _BELOW_WINDOW
    if narrow:
        words = _byte_residues(block[:grouped], mant_bits)
        if rest:
            # The elements past the whole groups, zero-padded to a group: the padding sits on residue 0.
            pad[:rest] = block[grouped:]
            tail = _byte_residues(pad, mant_bits)
            pad[:rest] = 0
            words = (words[0] + tail[0] - np.uint64(GROUP_ELEMS - rest), words[1] + tail[1], words[2] + tail[2],
                     words[3] + tail[3])
    else:
        wide = wide_counts(count_residues_wide(block[:grouped], mant_bits, 0))
        if rest:
            pad[:rest] = block[grouped:]
            wide += wide_counts(count_residues_wide(pad, mant_bits, 0))  # the padding on field 0, never read
            pad[:rest] = 0
        fields[:2 * RESIDUES] += wide
        words = (np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0))
    # The one-byte formats are e4m3 and e5m2: 4-bit fields go with 3 mantissa bits.
    if exp_bits <= 4:
        # Field 0 has residue 0 to itself: its count is the zeros and subnormals, and the zeros where there are no
        # subnormals. The subnormals are split by their leading bit by the elements below 1, 2 and 4 (below 8: field
        # 0), which tell the zeros too.
        low = np.int64(words[0] & np.uint64(0xFFFF))
        if small:
            zeros, below2, below4 = _count_below3(block, 1, 2, 4)
            edges = (zeros, below2, below4, low)
        else:
            zeros = low
            edges = (zeros, zeros, zeros, zeros)
    elif small:
        below2, below4 = _count_below2(block, 2, 4)
        edges = (zeros, below2, below4, below4)
    else:
        edges = (zeros, zeros, zeros, zeros)
    counts[_REC_ZERO] += zeros
    if small:
        for j in range(mant_bits):
            counts[_REC_HIST + np.int64(table[TABLE_BIN, 1 << j])] += edges[j + 1] - edges[j]
        counts[_REC_SUBNORMAL] += edges[mant_bits] - zeros
    if narrow:
        below = (np.int64(0), np.int64(0), np.int64(0), np.int64(0))
        if window_lo > field_lo:
            below = _below_window(block, field_lo, window_lo - field_lo, mant_bits, zeros)
            for i in range(window_lo - field_lo):
                fields[field_lo + i] += below[i]
        # Residue r names field f = window_lo + ((r - window_lo) mod 16) and every field f - 16 below the window:
        # those fields' counts are taken out (field 0 below field_lo holds the zeros alone). Field 0, zeros and
        # subnormals, is never read.
        for k in range(4):
            for q in range(4):
                r = 4 * q + k
                f = window_lo + ((r - window_lo) & (RESIDUES - 1))
                c = np.int64((words[k] >> np.uint64(16 * q)) & np.uint64(0xFFFF))
                alias = f - RESIDUES
                if alias >= field_lo:
                    c -= below[alias - field_lo]
                elif alias == 0:
                    c -= zeros
                if c:
                    fields[f] += c
    return _byte_sumsq(block, mant_bits, bias, small, zeros)


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
def scan_byte_chunks(addresses, numels, firsts, groups, segments, table, traits, partial_counts, partial_sumsq):
    """Each group of chunks of a one-byte format (groups[g] .. groups[g + 1] - 1) is scanned by one thread, in order,
    each chunk added to its segment's partial record and its sum of squares kept apart (NOTE: [chunking], NOTE:
    [numba bytes]); firsts[c] is chunk c's first element in its tensor (NOTE: [scan fingerprint]). `table` is
    byte_formats.byte_table of the format, `traits` its byte_traits."""
    bits_like = np.empty(0, np.uint8)
    exp_bits, mant_bits = traits[0], traits[1]
    special_lo, sign_only_nan = traits[3], traits[4]
    for g in prange(groups.size - 1):
        # Pattern counts are folded per chunk (their squares are part of the chunk's sum), field counts per segment.
        patterns = np.zeros((_BYTE_TABLES, 256), np.int32)  # a chunk is below 2**31 elements
        fields = np.zeros(2 * RESIDUES, np.int64)
        pad = np.zeros(GROUP_ELEMS, np.uint8)
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
            fingerprint = np.uint64(0)
            for begin in range(0, data.size, _BYTE_BLOCK):
                block = data[begin:begin + _BYTE_BLOCK]
                fingerprint += fingerprint_part(block, firsts[c] + begin)  # the block's raw bits, any path
                # As in numba_cpu's _scan_chunks: the next block is asked for in halves, before each pass.
                ahead = addresses[c] + min(begin + _BYTE_BLOCK, data.size)
                ahead_size = addresses[c] + min(begin + 2 * _BYTE_BLOCK, data.size) - ahead
                half = -(-ahead_size // (2 * CACHE_LINE)) * CACHE_LINE
                prefetch_lines(ahead, 0, half)
                # The flags must be literals (_byte_bounds): one call per kind of format.
                if exp_bits <= 4:
                    if sign_only_nan:
                        _, lo_minus_one, hi, flipped = _byte_bounds(block, False, True)
                    else:
                        _, lo_minus_one, hi, flipped = _byte_bounds(block, False, False)
                    zeros = np.int64(-1)  # 4-bit fields: counted on residue 0 (_fast_byte_block)
                elif sign_only_nan:
                    zeros, lo_minus_one, hi, flipped = _byte_bounds(block, True, True)
                else:
                    zeros, lo_minus_one, hi, flipped = _byte_bounds(block, True, False)
                # A block with an inf or NaN, or (fnuz formats: flipped is 0 where a 0x80, their NaN, is there) a 0x80,
                # is counted per pattern.
                if hi < special_lo and flipped != 0:
                    prefetch_lines(ahead, half, ahead_size)
                    if lo_minus_one == 0xFF:  # zeros alone
                        counts[_REC_ZERO] += block.size
                        continue
                    absmax = max(absmax, hi)
                    absmin = min(absmin, lo_minus_one + 1)
                    s += _fast_byte_block(block, zeros, lo_minus_one + 1, hi, traits, table, counts, fields, pad)
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
            add_fingerprint(counts, _REC_FINGERPRINT, fingerprint)
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
