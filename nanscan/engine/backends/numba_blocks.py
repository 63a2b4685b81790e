"""Building blocks of the numba kernels (nanscan/engine/backends/numba_cpu.py, numba_bytes.py): typed pointers, prefetch
hints, narrow integer arithmetic, float32/float64 bit casts, rotations, byte blocks read as 8-byte words, the residue
counters of NOTE: [numba blocks] and the fingerprint's terms (NOTE: [scan fingerprint] in stats_record.h)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.codegen import get_host_cpu_features as host_cpu_features
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic, overload
from numba.np.arrayobj import populate_array

# Residue counting (NOTE: [numba blocks]): LANES independent 64-bit words of sixteen 4-bit counters, each word fed
# GROUP_ROWS elements (a 4-bit counter holds 15) before its nibbles are spread into 16-bit counters.
LANES = 64
GROUP_ROWS = 15
GROUP_ELEMS = LANES * GROUP_ROWS
RESIDUES = 16
CACHE_LINE = 64


@intrinsic
def pointer_at(typingctx, address, like):
    """A typed pointer to `address` (an int64), of the element type of the array `like`."""
    pointer_type = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer_type))

    return pointer_type(types.int64, like), codegen


@intrinsic
def prefetch(typingctx, address):
    """Start loading the cache line at `address` (an int64) into L2 and the outer caches (prefetcht1, the C++
    kernel's hint, NOTE: [prefetch] in csrc/cpu/scan_cpu.cpp); a hint that never faults. Into L1 too (prefetcht0)
    cost the streaming scans on an Intel AVX-512 machine (1 GiB, two threads): float32 13.3-13.8 GB/s against
    15.1-15.5 with this hint, bfloat16 9.0 against 10.1, float8_e5m2 7.1 against 7.8, e4m3fn 6.9 against 7.2 (no
    prefetch at all measured as this)."""

    def codegen(context, builder, signature, args):
        pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [pointer, i32, i32, i32])
        prefetch = builder.module.declare_intrinsic("llvm.prefetch", [pointer], fnty)
        # read (0), locality 2 (prefetcht1: L2 and beyond, not L1), data cache (1)
        builder.call(prefetch, [builder.inttoptr(args[0], pointer), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return types.none(types.int64), codegen


@njit(cache=True)
def prefetch_lines(address, begin, end):
    """Prefetch the cache lines of bytes [begin, end) after `address`; a prefetch never faults, so the last line may
    reach past the data."""
    for byte in range(begin, end, CACHE_LINE):
        prefetch(address + byte)


def narrow(value, like):
    """`value` converted to the element type of the array `like` (jitted code only)."""


@overload(narrow)
def _narrow_impl(value, like):
    # Numba widens integer arithmetic to 64 bits; converting back keeps 16- and 32-bit data in narrow vector lanes.
    target = like.dtype
    return lambda value, like: target(value)


@intrinsic
def float32_bits(typingctx, value):
    """The bit pattern of a float32, as a uint32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def float32_of_bits(typingctx, bits):
    """The float32 whose bit pattern is the uint32 `bits`."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def float32_of_float16_bits(typingctx, bits):
    """The float32 of the float16 whose bit pattern is the uint16 `bits`, exactly, subnormals included (LLVM's fpext
    from half: F16C's vcvtph2ps, which no float mode changes, where the CPU has it; else a call that does it in
    integers)."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def float64_of_bits(typingctx, bits):
    """The float64 whose bit pattern is the uint64 `bits`."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.uint64), codegen


@njit(cache=True)
def fingerprint_part(block, first):
    """The fingerprint terms (NOTE: [scan fingerprint] in csrc/include/nanscan/stats_record.h) of a block of raw bits
    whose element 0 is element `first` of its tensor, as a uint64: (2 first + 1) * S0 + 2 * S1 with S0 the sum of
    mix(u_k) = u_k ^ (u_k >> 32) and S1 that of k * mix(u_k), wrapping mod 2**64 (numba's uint64 arithmetic does;
    every operand is kept uint64, as a mix with int64 would turn the sum into a float64)."""
    s0 = np.uint64(0)
    s1 = np.uint64(0)
    for k in range(block.size):
        u = np.uint64(block[k])
        x = u ^ (u >> np.uint64(32))
        s0 += x
        s1 += x * np.uint64(k)
    return (np.uint64(2) * np.uint64(first) + np.uint64(1)) * s0 + np.uint64(2) * s1


@njit(cache=True)
def add_fingerprint(counts, slot, part):
    """Adds a fingerprint part (uint64) to record slot `slot` of an int64 record, wrapping mod 2**64."""
    counts[slot] = np.int64(np.uint64(counts[slot]) + part)


def count_residues(block, mant_bits):
    """Counts of the exponent field mod 16 over the block's whole groups (NOTE: [numba blocks]), as four words of
    16-bit counters: word k, slot q counts residue 4 * q + k (jitted code only)."""


@njit(cache=True, inline="always")
def spread_nibbles(c0, c1, c2, c3):
    """Four words of 4-bit counters (each at most 15) added nibble-wise into two words of 8-bit counters: the even
    nibbles' and the odd nibbles'."""
    low = np.uint64(0x0F0F0F0F0F0F0F0F)
    four = np.uint64(4)
    even = (c0 & low) + (c1 & low) + (c2 & low) + (c3 & low)
    odd = ((c0 >> four) & low) + ((c1 >> four) & low) + ((c2 >> four) & low) + ((c3 >> four) & low)
    return even, odd


@njit(cache=True, inline="always")
def add_slots(w0, w1, w2, w3, even, odd):
    """The four words of 16-bit counters that count_residues returns (word k, slot q: residue 4 * q + k) with two
    words of 8-bit counters added, the even and the odd nibbles' (spread_nibbles)."""
    slots = np.uint64(0x00FF00FF00FF00FF)
    eight = np.uint64(8)
    return w0 + (even & slots), w1 + (odd & slots), w2 + ((even >> eight) & slots), w3 + ((odd >> eight) & slots)


# NOTE: [16-bit words]
# A 16-bit block is read as 8-byte words of four elements, WORD_LANES words side by side, each lane fed GROUP_ROWS
# words: element j of a word has 4 * (field mod 16) in bits 2..5 of (word >> (16 j + mant_bits - 2)) & 0x3C, which
# shifts 1 into its nibble of counter word j, so no load widens the elements to 64-bit lanes (vpmovzxwq). Hot
# bfloat16 and float16 blocks of 1920 elements, one core of the 2-core development machine (Zen 3, AVX2): 0.16-0.17
# -> 0.12 ns per element. Counter word j's nibbles are the residues of every fourth element, so the four words are
# spread as the byte path spreads its own (spread_nibbles): the counts are those of the widening loop, exactly.
# float32 blocks are read the same way, two elements a word (_words32), 2 * WORD_LANES words side by side
# so that as many counter words are live: hot Gaussian float32 blocks of 1920 elements, one core of an Intel AVX-512
# machine, 0.133 -> 0.103 ns per element (8 words side by side: 0.108, 32: 0.122).
# NOTE: [rotated counts]
# Where the CPU rotates each 64-bit lane by its own count in one instruction (AVX-512's vprolvq: ROTATES), a word is
# first masked to its elements' four low field bits and shifted once, so that element j's 4 * (field mod 16) sits at
# bits 16 j + 2 .. 16 j + 5 (32 j for float32) with nothing between: 1 rotated left by (that >> 16 j) lands in its
# nibble, since a rotation reads the count's low 6 bits only. That is one mask and one shift a word in place of one each
# per element: 13 operations per word of four instead of 16. Hot Gaussian blocks of 1920 elements, one core of a 2-core
# AMD EPYC (Zen 4, AVX-512): bfloat16 and float16 0.093 -> 0.076 ns per element, float32 0.100 -> 0.086. The byte path
# counts its words the same way (rotated_words, rotated_count) on every CPU. AVX2 has no such rotation (LLVM makes it of
# two shifts and an or: 16-bit words counted by rotation measured 0.22 ns against the mask's 0.12 on Zen 3), so there
# each element keeps its own mask. Both forms count the same: tests/test_numba_residues.py runs each on every CPU.
WORD_LANES = 8
_WORD16_GROUP = WORD_LANES * GROUP_ROWS  # words of a group: 4 * 8 * 15 = 480 elements
_WORD32_LANES = 2 * WORD_LANES
_WORD32_GROUP = _WORD32_LANES * GROUP_ROWS  # 2 * 16 * 15 = 480 elements
assert GROUP_ELEMS % (4 * _WORD16_GROUP) == 0, "a block's whole groups are whole 16-bit word groups"
assert GROUP_ELEMS % (2 * _WORD32_GROUP) == 0, "a block's whole groups are whole 32-bit word groups"


def host_rotates() -> bool:
    """Whether the CPU numba compiles for rotates 64-bit lanes by per-lane counts in one instruction (AVX-512F's
    vprolvq; NOTE: [rotated counts]): the features numba's code generator is given (NUMBA_CPU_FEATURES, else the
    host's). Numba's cache keys its compiled code by the CPU and those features, so a kernel built under one answer
    is never loaded where the other holds."""
    features = numba.config.CPU_FEATURES
    if features is None:
        features = host_cpu_features()
    return "+avx512f" in features.split(",")


ROTATES = host_rotates()


@njit(cache=True, inline="always")
def rotated_words(q, lanes, shift):
    """A word masked to its elements' low field bits (`lanes`) and shifted once, for rotated_count (NOTE: [rotated
    counts]); the byte path (NOTE: [numba bytes]) counts its words so on every CPU."""
    return (q & lanes) >> shift


@njit(cache=True, inline="always")
def rotated_count(p, at):
    """1 in the nibble of the element whose 4 * (field mod 16) sits at bit `at` of the masked word `p`."""
    return rotate_left(np.uint64(1), p >> at)


@njit(cache=True, inline="always")
def _masked_words(q, lanes, shift):
    return q >> shift


@njit(cache=True, inline="always")
def _masked_count(p, at):
    return np.uint64(1) << ((p >> at) & np.uint64(0x3C))


@njit(cache=True, inline="always")
def four_counts(group, lane, stride, words_of, count, lanes, shift, at0, at1, at2, at3):
    """The residues of four elements of each of the GROUP_ROWS words of one lane of a group (`stride` words a row),
    those at bits at0 .. at3 of a word made by `words_of` (NOTE: [rotated counts]), as spread_nibbles' two words of
    8-bit counters (15 per element position: no carries)."""
    c0 = c1 = c2 = c3 = np.uint64(0)
    for row in range(GROUP_ROWS):
        p = words_of(group[row * stride + lane], lanes, shift)
        c0 += count(p, at0)
        c1 += count(p, at1)
        c2 += count(p, at2)
        c3 += count(p, at3)
    return spread_nibbles(c0, c1, c2, c3)


def _words16(words_of, count):
    """count_residues of a 16-bit block (NOTE: [16-bit words]) with a word's counts made by `words_of` and `count`
    (NOTE: [rotated counts])."""
    def residues(block, mant_bits):
        words = byte_words(block.view(np.uint8))
        lanes = np.uint64(0x000F000F000F000F) << np.uint64(mant_bits)
        shift = np.uint64(mant_bits - 2)
        w0 = w1 = w2 = w3 = np.uint64(0)
        for g in range(words.size // _WORD16_GROUP):
            group = words[g * _WORD16_GROUP:(g + 1) * _WORD16_GROUP]
            for lane in range(WORD_LANES):
                even, odd = four_counts(group, lane, WORD_LANES, words_of, count, lanes, shift, np.uint64(0),
                                        np.uint64(16), np.uint64(32), np.uint64(48))
                w0, w1, w2, w3 = add_slots(w0, w1, w2, w3, even, odd)
        return w0, w1, w2, w3
    return residues


def _words32(words_of, count):
    """count_residues of a float32 block (NOTE: [16-bit words]), as _words16."""
    def residues(block, mant_bits):
        words = byte_words(block.view(np.uint8))
        lanes = np.uint64(0x0000000F0000000F) << np.uint64(mant_bits)
        shift = np.uint64(mant_bits - 2)
        zero = np.uint64(0)
        w0 = w1 = w2 = w3 = np.uint64(0)
        for g in range(words.size // _WORD32_GROUP):
            group = words[g * _WORD32_GROUP:(g + 1) * _WORD32_GROUP]
            for lane in range(_WORD32_LANES):
                c0 = c1 = np.uint64(0)
                for row in range(GROUP_ROWS):
                    p = words_of(group[row * _WORD32_LANES + lane], lanes, shift)
                    c0 += count(p, np.uint64(0))
                    c1 += count(p, np.uint64(32))
                # 2 x 15 = 30 per 8-bit counter: the two words' nibbles spread into one pair of byte words.
                even, odd = spread_nibbles(c0, c1, zero, zero)
                w0, w1, w2, w3 = add_slots(w0, w1, w2, w3, even, odd)
        return w0, w1, w2, w3
    return residues


# count_residues' word forms by element width and by whether they rotate (NOTE: [rotated counts]).
_WORD_FORMS = {False: (_masked_words, _masked_count), True: (rotated_words, rotated_count)}
WORD_RESIDUES = {(bits, rotates): make(*_WORD_FORMS[rotates])
                 for bits, make in ((16, _words16), (32, _words32)) for rotates in (False, True)}


def _residues_widened(block, mant_bits):
    shift = np.uint64(mant_bits - 2)  # puts 4 * (field mod 16) at bits 2..5
    nibbles = np.uint64(0x000F000F000F000F)
    w0 = w1 = w2 = w3 = np.uint64(0)
    for g in range(block.size // GROUP_ELEMS):
        group = block[g * GROUP_ELEMS:(g + 1) * GROUP_ELEMS]
        for lane in range(LANES):
            # The row loop has a constant trip count: LLVM unrolls it, and the lane loop is vectorised with the
            # words in registers.
            word = np.uint64(0)
            for row in range(GROUP_ROWS):
                word += np.uint64(1) << ((np.uint64(group[row * LANES + lane]) >> shift) & np.uint64(0x3C))
            w0 += word & nibbles
            w1 += (word >> np.uint64(4)) & nibbles
            w2 += (word >> np.uint64(8)) & nibbles
            w3 += (word >> np.uint64(12)) & nibbles
    return w0, w1, w2, w3


@overload(count_residues)
def _count_residues_impl(block, mant_bits):
    # 16- and 32-bit blocks as words (NOTE: [16-bit words]); float64 elements each take a 64-bit lane.
    return WORD_RESIDUES.get((block.dtype.bitwidth, ROTATES), _residues_widened)


@njit(cache=True)
def count_residues_wide(block, mant_bits, field_lo):
    """Counts of d = (field - field_lo) mod 32 over the block's whole groups (NOTE: [numba blocks]), as eight words of
    16-bit counters: words 0..3 count d mod 16 over every element, as count_residues does, and words 4..7 count it
    over the elements with d >= 16 alone, so a window of 32 fields is told apart (fold_residues_wide)."""
    shift = np.uint64(mant_bits)
    base = np.uint64(field_lo)
    nibbles = np.uint64(0x000F000F000F000F)
    w0 = w1 = w2 = w3 = h0 = h1 = h2 = h3 = np.uint64(0)
    for g in range(block.size // GROUP_ELEMS):
        group = block[g * GROUP_ELEMS:(g + 1) * GROUP_ELEMS]
        for lane in range(LANES):
            word = np.uint64(0)
            high = np.uint64(0)
            for row in range(GROUP_ROWS):
                # The sign bit lands on a multiple of 32 above the field, so it never changes d mod 32.
                d = (np.uint64(group[row * LANES + lane]) >> shift) - base
                one = np.uint64(1) << ((d << np.uint64(2)) & np.uint64(0x3C))
                word += one
                high += one & (np.uint64(0) - ((d >> np.uint64(4)) & np.uint64(1)))
            w0 += word & nibbles
            w1 += (word >> np.uint64(4)) & nibbles
            w2 += (word >> np.uint64(8)) & nibbles
            w3 += (word >> np.uint64(12)) & nibbles
            h0 += high & nibbles
            h1 += (high >> np.uint64(4)) & nibbles
            h2 += (high >> np.uint64(8)) & nibbles
            h3 += (high >> np.uint64(12)) & nibbles
    return w0, w1, w2, w3, h0, h1, h2, h3


@njit(cache=True)
def wide_counts(words):
    """The 32 counts of d = 0..31 from count_residues_wide's words (word k, slot q: d mod 16 = 4 * q + k)."""
    out = np.empty(2 * RESIDUES, np.int64)
    for k in range(4):
        for q in range(4):
            r = 4 * q + k
            every = np.int64((words[k] >> np.uint64(16 * q)) & np.uint64(0xFFFF))
            high = np.int64((words[4 + k] >> np.uint64(16 * q)) & np.uint64(0xFFFF))
            out[r] = every - high
            out[r + RESIDUES] = high
    return out


@intrinsic
def rotate_left(typingctx, value, count):
    """The uint64 `value` rotated left by `count` mod 64 (llvm.fshl: one vprolvq a vector where AVX-512 has it). A
    shift by 64 or more gives 0, a rotation wraps, so a count may carry junk above its low 6 bits."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fshl = builder.module.declare_intrinsic("llvm.fshl", [i64], ir.FunctionType(i64, [i64, i64, i64]))
        return builder.call(fshl, [args[0], args[0], args[1]])

    return types.uint64(types.uint64, types.uint64), codegen


_UNALIGNED_WORDS = types.Array(types.uint64, 1, "C", aligned=False)


@intrinsic
def byte_words(typingctx, block):
    """The whole 8-byte words of the contiguous byte array `block`, as a uint64 array over the same memory (its last
    block.size % 8 bytes left out). The array is typed unaligned, so its loads claim no alignment: a block may start
    at any byte."""
    if not (isinstance(block, types.Array) and block.ndim == 1 and block.layout == "C" and block.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, value=args[0])
        words = context.make_array(_UNALIGNED_WORDS)(context, builder)
        intp = context.get_value_type(types.intp)
        (size,) = cgutils.unpack_tuple(builder, source.shape, 1)
        populate_array(words, data=builder.bitcast(source.data, ir.IntType(64).as_pointer()),
                       shape=[builder.lshr(size, intp(3))], strides=[intp(8)], itemsize=intp(8),
                       meminfo=source.meminfo)
        return impl_ret_borrowed(context, builder, _UNALIGNED_WORDS, words._getvalue())

    return _UNALIGNED_WORDS(block), codegen
