// simd.h: the CPU kernel's vector primitives: the instruction set chosen at compile time (AVX-512, AVX2, SSE2 or
// NEON), one-register vector types, bit loads and casts, and per format the squares of a vector added into lanes.
#pragma once

#include <cstdint>
#include <cstring>

#include "nanscan/classify.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// GCC 12's AVX-512 header trips -Wmaybe-uninitialized on its own "undefined" placeholders (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define NANSCAN_AVX512 1
#else
#define NANSCAN_AVX512 0
#endif
// The float8 vector path (NOTE: [byte vectors] in scan_cpu.cpp) also needs AVX-512's byte permutes (VBMI), GF(2)
// bit-matrix transforms (GFNI), byte popcounts (BITALG) and byte dot products (VNNI); without them float8 chunks
// are counted per bit pattern (NOTE: [byte formats]) or, with AVX2, by the path below.
#if NANSCAN_AVX512 && defined(__AVX512VBMI__) && defined(__GFNI__) && defined(__AVX512BITALG__) && \
    defined(__AVX512VNNI__)
#define NANSCAN_AVX512_BYTES 1
#else
#define NANSCAN_AVX512_BYTES 0
#endif
#if !NANSCAN_AVX512 && defined(__AVX2__)
#include <immintrin.h>  // AVX2's float8 path and bfloat16 squares (NOTE: [squares on AVX2])
#endif
// Without them, AVX2 reads float8 chunks 32 elements at a time (NOTE: [byte vectors on AVX2]).
#if !NANSCAN_AVX512_BYTES && defined(__AVX2__)
#define NANSCAN_AVX2_BYTES 1
#else
#define NANSCAN_AVX2_BYTES 0
#endif

namespace nanscan {
// Internal linkage: what this file defines depends on the instruction set of the file that includes it, and the
// linker would keep one copy of an inline function shared by files built for different ones.
namespace {

// One vector register: the width of every vector in the passes (NOTE: [vector types]).
#if NANSCAN_AVX512
constexpr int kVectorBytes = 64;
#elif defined(__AVX2__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;  // SSE2, NEON
#endif

template <typename T>
T load_bits(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The same bits seen as another type of the same size (C++20's std::bit_cast).
template <typename To, typename From>
To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as needs types of one size");
  return load_bits<To>(&from);
}

// NOTE: [vector types]
// The passes are written once with GCC/Clang vector extensions: element-wise operators on fixed-size vectors,
// which the compiler lowers to AVX-512, AVX2, SSE or NEON registers, or to scalar code where a target lacks an
// operation, so every target builds the same source. Plain loops left to the auto-vectoriser stayed scalar
// (nested lane loops, variable shifts). A vector is one register wide (kVectorBytes): GCC kept wider ones in
// memory, at half the speed. Where the lowering of an operation is poor or the instruction set offers a
// better one (widening floats to doubles; a 16-entry table lookup for the field counters), an AVX-512 version
// (NANSCAN_AVX512) replaces it; the two compute the same result. Every floating-point sum keeps one accumulator
// per lane and adds the lanes in a fixed order, so no reassociation is involved.
#if !defined(__GNUC__) && !defined(__clang__)
#error "csrc/cpu/simd.h needs GCC or Clang (vector extensions, see NOTE: [vector types])"
#endif
typedef uint16_t VU16 __attribute__((vector_size(kVectorBytes)));
typedef uint32_t VU32 __attribute__((vector_size(kVectorBytes)));
typedef uint64_t VU64 __attribute__((vector_size(kVectorBytes)));
typedef float VF32 __attribute__((vector_size(kVectorBytes)));
typedef double VF64 __attribute__((vector_size(kVectorBytes)));
// Pieces that widen into one full vector: half a vector of floats or 32-bit integers, a quarter of 16-bit ones.
typedef float VF32Half __attribute__((vector_size(kVectorBytes / 2)));
typedef uint32_t VU32Half __attribute__((vector_size(kVectorBytes / 2)));
typedef uint16_t VU16Quarter __attribute__((vector_size(kVectorBytes / 4)));
constexpr int kWordsPerVector = kVectorBytes / 8;  // 64-bit words (or doubles) per vector

// Whether any lane of `v` is non-zero (a comparison's result: lanes all ones or zero), as one test where the
// instruction set has it. The lane-by-lane OR it replaces took ~20 extracts and ORs per AVX-512 vector, which made
// it the costliest part of below_window (NOTE: [low tally] in scan_cpu.cpp), one test per vector of a block.
template <typename V>
inline bool any_lane(const V& v) {
  static_assert(sizeof(V) == kVectorBytes, "any_lane tests one full vector");
#if NANSCAN_AVX512
  const __m512i x = bits_as<__m512i>(v);
  return _mm512_test_epi64_mask(x, x) != 0;
#elif defined(__AVX2__)
  const __m256i x = bits_as<__m256i>(v);
  return !_mm256_testz_si256(x, x);
#else
  const VU64 words = bits_as<VU64>(v);
  uint64_t any = 0;
  for (int l = 0; l < kWordsPerVector; ++l) any |= words[l];
  return any != 0;
#endif
}

// NOTE: [squares on AVX2]
// The squares of bfloat16 and float32 are widened with intrinsics on AVX2 too, as on AVX-512. GCC lowers the portable
// widening below to about twice the instructions: for bfloat16 quarter vectors zero-extended, shifted and converted;
// for float32 each half vector loaded in two 64-bit pieces, converted as two 128-bit halves and joined (one vcvtps2pd
// from memory here). Measured on the 2-core development machine (Zen 3), one thread, chunks hot in L2, per element:
// bfloat16 (16384 elements) first pass 0.59-0.77 ns before, 0.34-0.36 after, the whole chunk 0.85-1.01 and 0.43-0.61;
// float32, both builds in one harness, interleaved, first pass x0.66-0.74 (0.31 -> 0.21 ns at 64K elements), the whole
// chunk x0.71-0.86 (the rest of a chunk, windows and fields, did not change). The bfloat16 lanes take the elements in
// another order than the portable code, which changes only which lane adds which square; the float32 lanes take them in
// the same order, and a product added by FMA is the exact square the portable code adds, so float32's sums are
// unchanged bit for bit. (float16 needs no version of its own: where F16C is, a float16 chunk is read as float32, NOTE:
// [float16 widened] in scan_cpu.cpp, and gains with float32.)
// Per format: the vector one load fills, and how the squares of the elements at `p` (one vector's worth) are
// added, as doubles, to kSquareVectors accumulators. Signs do not matter to a square, so the raw elements are
// read, each piece straight from memory into the width it is widened from. Finite values reach it on the fast
// path, and for them every square here is exact, subnormals included (NOTE: [float mode] in scan_cpu.cpp).
template <typename F>
struct VectorOps;

template <>
struct VectorOps<Float32> {
  using V = VU32;
  static constexpr int kSquareVectors = 2;
  static void add_squares(const uint32_t* p, VF64* acc) {
#if NANSCAN_AVX512
    const __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(reinterpret_cast<const float*>(p)));
    const __m512d hi = _mm512_cvtps_pd(_mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8));
    acc[0] = bits_as<VF64>(_mm512_fmadd_pd(lo, lo, bits_as<__m512d>(acc[0])));
    acc[1] = bits_as<VF64>(_mm512_fmadd_pd(hi, hi, bits_as<__m512d>(acc[1])));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(reinterpret_cast<const float*>(p)));
    const __m256d hi = _mm256_cvtps_pd(_mm_loadu_ps(reinterpret_cast<const float*>(p) + 4));
    acc[0] = bits_as<VF64>(_mm256_fmadd_pd(lo, lo, bits_as<__m256d>(acc[0])));
    acc[1] = bits_as<VF64>(_mm256_fmadd_pd(hi, hi, bits_as<__m256d>(acc[1])));
#else
    constexpr int kHalf = sizeof(VF32Half) / sizeof(float);
    for (int h = 0; h < 2; ++h) {
      const VF64 v = __builtin_convertvector(load_bits<VF32Half>(p + kHalf * h), VF64);
      acc[h] += v * v;  // exact: a 24-bit significand squares into 48 bits
    }
#endif
  }
};

template <>
struct VectorOps<Float64> {
  using V = VU64;
  static constexpr int kSquareVectors = 1;
  static void add_squares(const uint64_t* p, VF64* acc) {
    const VF64 v = load_bits<VF64>(p);
    acc[0] += v * v;
  }
};

template <>
struct VectorOps<BFloat16> {
  using V = VU16;
  static constexpr int kSquareVectors = 4;
  static void add_squares(const uint16_t* p, VF64* acc) {
    // bfloat16 is the top half of a float32. (The AVX-512 interleave takes the elements in another order, which
    // only changes which lane adds which square.)
#if NANSCAN_AVX512
    const __m512i bits = _mm512_loadu_si512(p);
    const __m512i zero = _mm512_setzero_si512();
    const __m512 halves[2] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, bits)),
                              _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, bits))};
    for (int h = 0; h < 2; ++h) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(halves[h]));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(halves[h]), 1)));
      acc[2 * h] = bits_as<VF64>(_mm512_fmadd_pd(lo, lo, bits_as<__m512d>(acc[2 * h])));
      acc[2 * h + 1] = bits_as<VF64>(_mm512_fmadd_pd(hi, hi, bits_as<__m512d>(acc[2 * h + 1])));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // The same interleave in 256 bits: GCC's lowering of the widening below took twice as long on AVX2 (NOTE:
    // [squares on AVX2]).
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    const __m256 halves[2] = {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits)),
                              _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits))};
    for (int h = 0; h < 2; ++h) {
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(halves[h]));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(halves[h], 1));
      acc[2 * h] = bits_as<VF64>(_mm256_fmadd_pd(lo, lo, bits_as<__m256d>(acc[2 * h])));
      acc[2 * h + 1] = bits_as<VF64>(_mm256_fmadd_pd(hi, hi, bits_as<__m256d>(acc[2 * h + 1])));
    }
#else
    constexpr int kQuarter = sizeof(VU16Quarter) / sizeof(uint16_t);
    for (int q = 0; q < 4; ++q) {
      const VU32Half widened = __builtin_convertvector(load_bits<VU16Quarter>(p + kQuarter * q), VU32Half) << 16;
      const VF64 v = __builtin_convertvector(bits_as<VF32Half>(widened), VF64);
      acc[q] += v * v;
    }
#endif
  }
};

template <>
struct VectorOps<Float16> {
  using V = VU16;
  static constexpr int kSquareVectors = 4;
  // Squares are taken in float: 11-bit significands square into 22 bits, and 65504^2 is far below float's limit.
  static void add_squares(const uint16_t* p, VF64* acc) {
#if NANSCAN_AVX512
    for (int h = 0; h < 2; ++h) {
      const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h)));
      const __m512 sq = _mm512_mul_ps(x, x);
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(sq));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1)));
      acc[2 * h] = bits_as<VF64>(_mm512_add_pd(bits_as<__m512d>(acc[2 * h]), lo));
      acc[2 * h + 1] = bits_as<VF64>(_mm512_add_pd(bits_as<__m512d>(acc[2 * h + 1]), hi));
    }
#else
    constexpr int kQuarter = sizeof(VU16Quarter) / sizeof(uint16_t);
    for (int q = 0; q < 4; ++q) {
      // The float16 fields moved into float32 positions encode |x| * 2^-112 (the bias difference): rescale exactly.
      const VU32Half moved = (__builtin_convertvector(load_bits<VU16Quarter>(p + kQuarter * q), VU32Half) & 0x7fff)
                             << 13;
      const VF32Half x = bits_as<VF32Half>(moved) * 0x1p112f;
      acc[q] += __builtin_convertvector(x * x, VF64);
    }
#endif
  }
};

// The sum of the lanes of `lanes`, one pass's per-lane sums of squares (NOTE: [vector types]): vectors in index
// order, [0][0], [0][1], .., and the lanes of each in lane order. Every caller sums through here, so the scan of a
// chunk and the scan of a small chunk add in the same order (NOTE: [small chunks] in scan_cpu.cpp). A vector whose
// lanes are all +0.0 is skipped: squares and their sums are +0.0 or more, so it would leave the sum unchanged, and a
// short chunk leaves most of them so.
template <int kRows, int kCols>
inline double sum_lanes(const VF64 (&lanes)[kRows][kCols]) {
  double sum = 0.0;
  for (int r = 0; r < kRows; ++r) {
    for (int k = 0; k < kCols; ++k) {
      if (any_lane(lanes[r][k]))
        for (int l = 0; l < kWordsPerVector; ++l) sum += lanes[r][k][l];
    }
  }
  return sum;
}

}  // namespace
}  // namespace nanscan
