// stats_record.h: the layout of one tensor's statistics record, shared by the CPU and CUDA kernels and Python.
//
// NOTE: [stats record]
// A record is kRecordWidth int64 slots. Counts are exact integers, so merging partial records (threads, chunks,
// blocks) is order-independent and deterministic. absmax/absmin hold the *raw abs bit pattern* of the tensor's own
// format: for non-negative finite IEEE values integer order equals numeric order, so max/min (and CUDA's integer
// atomicMax/atomicMin) on the bits is exact; Python turns them into doubles once. kAbsMinNone means "no finite
// non-zero value". sumsq holds the bits of a double (the only slot whose merge order can change the last bits).
// kFingerprint, the last slot (after the histogram, so that no other slot moved when it came), holds the bits of a
// uint64: the tensor's fingerprint (NOTE: [scan fingerprint]), merged by a wrapping add.
// Python mirrors these constants in nanscan/engine/_layout.py; a test checks that they agree.
#pragma once

#include <cstdint>

#include "nanscan/classify.h"

namespace nanscan {
namespace record {
constexpr int kNaN = 0;
constexpr int kPosInf = 1;
constexpr int kNegInf = 2;
constexpr int kZero = 3;
constexpr int kSubnormal = 4;
constexpr int kAbsMaxBits = 5;
constexpr int kAbsMinBits = 6;
constexpr int kSumSq = 7;
constexpr int kHist = 8;
constexpr int kFingerprint = kHist + kHistBins;
constexpr int kWidth = kFingerprint + 1;
constexpr int64_t kAbsMinNone = INT64_MAX;
}  // namespace record

// NOTE: [scan fingerprint]
// Every record carries an exact fingerprint of the tensor's bits, taken in the same pass as its statistics:
//   fingerprint = sum over i of mix(u_i) * (2 i + 1)   mod 2^64,   mix(u) = u ^ (u >> 32),
// where u_i is element i's raw bit pattern zero-extended to 64 bits and i its index in the flat view the scan reads
// (NOTE: [flat views] in nanscan/engine/inputs.py), counted over the whole tensor, never from a chunk's start.
// The reference (nanscan/engine/backends/reference.py) states it in numpy; every backend gives the same bits.
//  - Order-independent: a sum mod 2^64 is associative and commutative, so threads, chunks, blocks and CUDA blocks
//    add their parts (a wrapping uint64 add; atomicAdd on unsigned long long) in any order, on every run.
//  - Any change of one element changes it, a flipped bit included: mix is a bijection of 64-bit words (it is its
//    own inverse: the top half passes through), zero-extension is injective, and multiplying by an odd number is a
//    bijection mod 2^64, so each term is an injective function of its element's bits.
//  - Position-aware: swapping unequal a and b at positions i and j changes the sum by
//    (mix(a) - mix(b)) * (2 i - 2 j), which is 0 mod 2^64 only when v(mix(a) - mix(b)) + 1 + v(i - j) >= 64 (v: the
//    number of trailing zero bits). A format of w <= 32 bits has mix(u) = u < 2^w, so v(mix(a) - mix(b)) <= w - 1,
//    and v(i - j) <= log2 |i - j|: every swap is seen in a tensor of fewer than 2^(64 - w) elements (float32 2^32,
//    16-bit formats 2^48, float8 2^56). For float64 the low half of mix(u) is lo(u) ^ hi(u): unless a ^ b has equal
//    halves, those differ, v(mix(a) - mix(b)) <= 31, and every swap is seen in a tensor of fewer than 2^32
//    elements (a value and its negation included). No fingerprint that sums one term per element mod 2^64 can see
//    every swap of 64-bit values: at positions p and q that needs f_p - f_q to be a bijection of Z/2^64, whose
//    values sum to 2^63; for three positions (f_0 - f_1) + (f_1 - f_2) = f_0 - f_2 would give 2^63 + 2^63 = 2^63.
//  - Bits, not values: +0.0 and -0.0, or two NaN payloads, fingerprint differently; equal bits always alike.
//  - Not cryptographic: changes of several elements can cancel, and anyone can build a tensor with a chosen
//    fingerprint. Two different tensors agree by chance with probability about 2^-64.
// A run of elements [first, first + n) adds (2 first + 1) * S0 + 2 * S1 with S0 = sum of mix(u_k), S1 = sum of
// k * mix(u_k), k counted from the run's start: kernels sum S0 and S1 over a block in vector lanes and place the
// block with one multiply (fingerprint_run).
NANSCAN_HD uint64_t fingerprint_mix(uint64_t u) { return u ^ (u >> 32); }

// One element's term: raw bits (zero-extended) and its index in the tensor.
NANSCAN_HD uint64_t fingerprint_term(uint64_t bits, int64_t index) {
  return fingerprint_mix(bits) * (2 * static_cast<uint64_t>(index) + 1);
}

// The terms of a run [first, first + n) from its sums S0 = sum of mix(u_k) and S1 = sum of k * mix(u_k).
NANSCAN_HD uint64_t fingerprint_run(uint64_t s0, uint64_t s1, int64_t first) {
  return (2 * static_cast<uint64_t>(first) + 1) * s0 + 2 * s1;
}

// Adds a fingerprint part to a record's slot, wrapping (a signed add could overflow).
NANSCAN_HD void add_fingerprint(int64_t* rec, uint64_t part) {
  rec[record::kFingerprint] = static_cast<int64_t>(static_cast<uint64_t>(rec[record::kFingerprint]) + part);
}

}  // namespace nanscan
