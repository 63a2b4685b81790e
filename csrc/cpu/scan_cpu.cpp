// scan_cpu.cpp: the multi-tensor scan on the CPU: OpenMP over chunks of all tensors, vectorised passes over
// 4 KiB blocks, and classify.h's exact per-element path for blocks that hold special values.
#include "scan_cpu.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "nanscan/classify.h"
#include "nanscan/stats_record.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define NANSCAN_AVX512 1
#else
#define NANSCAN_AVX512 0
#endif

namespace nanscan {
namespace {

// NOTE: [chunking]
// Every tensor is cut into chunks of at most chunk_elems elements; the chunks of all tensors form one work list so
// that one large tensor and many small ones load the threads evenly. Each chunk produces a partial record; the
// partials are merged per tensor in chunk order, so even the float64 sum of squares is the same on every run and
// for every thread count. Inside a chunk the work is cut into blocks at fixed offsets from the chunk start (never
// from the memory address), so the summation order depends on the chunk size alone.
struct Chunk {
  int64_t task;
  int64_t begin;
  int64_t end;
};

// Per-chunk field counters are uint32 (NOTE: [field histogram]); a chunk never holds more elements than they count.
constexpr int64_t kMaxChunkElems = int64_t(1) << 30;

// NOTE: [blocks]
// A histogram on the CPU costs a dependent load-increment-store per element, which is slower than memory. So a chunk
// is read in kBlockBytes blocks, each in two passes:
//  1. summarize_block, one vectorised pass: largest abs bit pattern, smallest non-zero one, whether there is a
//     zero, and the sum of squares. Abs bit patterns order like the values they encode, so the two extremes alone
//     tell whether the block holds a subnormal, inf or NaN, and which exponent fields its normal values span.
//  2. If it holds none (the common case), its fields are counted on the block, now hot in L1: by count_fields_window
//     when they span at most 2 * kWindowFields fields (a block of Gaussian values spans about 12), else by
//     count_fields_scalar. A block with special values is re-read by scan_block_exact, the per-element classify()
//     path, which is also the only one to square subnormals (a flush-to-zero floating-point mode would drop them).
constexpr int64_t kBlockBytes = 4096;
#ifndef PFB
#define PFB 2
#endif
constexpr int64_t kPrefetchBlocks = PFB;
constexpr int kVectorBytes = 64;  // one AVX-512 register; narrower machines split each vector into several registers

// The widest exponent field is float64's; one per-thread set of counters fits every format.
constexpr int kMaxFields = 1 << Float64::kExpBits;
constexpr int kFieldTables = 4;  // neighbouring elements count into different tables, so equal fields don't stall

// Exponent-field counters of one thread, kept zero outside [lo, hi], the fields touched by the current chunk; the
// chunk's end folds that range into its record and clears it, so no chunk pays for zeroing 2048 counters.
struct FieldCounts {
  uint32_t table[kFieldTables][kMaxFields];
  int lo;
  int hi;

  void reset_range() {
    lo = INT_MAX;
    hi = -1;
  }
  void touch(int first, int last) {
    lo = std::min(lo, first);
    hi = std::max(hi, last);
  }
  template <typename F>
  void fold_into(int64_t* hist) {
    if (hi < lo) return;
    for (int t = 1; t < kFieldTables; ++t)
      for (int f = lo; f <= hi; ++f) table[0][f] += table[t][f];
    fold_fields<F>(table[0], lo, hi, hist);
    for (int t = 0; t < kFieldTables; ++t) std::memset(&table[t][lo], 0, sizeof(uint32_t) * (hi - lo + 1));
    reset_range();
  }
};

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
// (nested lane loops, variable shifts). Where the lowering of an operation is poor or the instruction set offers a
// better one (widening floats to doubles; a 16-entry table lookup for the field counters), an AVX-512 version
// (NANSCAN_AVX512) replaces it; the two compute the same result. Every floating-point sum keeps one accumulator
// per lane and adds the lanes in a fixed order, so no reassociation is involved.
#if !defined(__GNUC__) && !defined(__clang__)
#error "csrc/cpu/scan_cpu.cpp needs GCC or Clang (vector extensions, see NOTE: [vector types])"
#endif
typedef uint16_t U16x32 __attribute__((vector_size(kVectorBytes)));
typedef uint32_t U32x16 __attribute__((vector_size(kVectorBytes)));
typedef uint64_t U64x8 __attribute__((vector_size(kVectorBytes)));
typedef int16_t I16x32 __attribute__((vector_size(kVectorBytes)));
typedef int32_t I32x16 __attribute__((vector_size(kVectorBytes)));
typedef int64_t I64x8 __attribute__((vector_size(kVectorBytes)));
typedef double F64x8 __attribute__((vector_size(kVectorBytes)));
typedef float F32x16 __attribute__((vector_size(kVectorBytes)));
typedef float F32x8 __attribute__((vector_size(kVectorBytes / 2)));
typedef uint16_t U16x16 __attribute__((vector_size(kVectorBytes / 2)));

// Piece `part` of vector v as a Part (e.g. 8 of 16 floats, to widen to doubles).
template <typename Part, typename V>
Part part_of(const V& v, int part) {
  return load_bits<Part>(reinterpret_cast<const unsigned char*>(&v) + part * sizeof(Part));
}

// Per format: the unsigned and signed vectors one load fills, and how the squares of their elements are added,
// as doubles, to kSquareVectors accumulators. Only normal values and zeros reach it on the fast path, and for them
// every square here is exact; the exact path squares the rest.
template <typename F>
struct VectorOps;

template <>
struct VectorOps<Float32> {
  using V = U32x16;
  using SignedV = I32x16;
  static constexpr int kSquareVectors = 2;
  static void add_squares(V a, F64x8* acc) {
#if NANSCAN_AVX512
    const __m512 x = _mm512_castsi512_ps(bits_as<__m512i>(a));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc[0] = bits_as<F64x8>(_mm512_fmadd_pd(lo, lo, bits_as<__m512d>(acc[0])));
    acc[1] = bits_as<F64x8>(_mm512_fmadd_pd(hi, hi, bits_as<__m512d>(acc[1])));
#else
    const F32x16 x = bits_as<F32x16>(a);
    for (int h = 0; h < 2; ++h) {
      const F64x8 v = __builtin_convertvector(part_of<F32x8>(x, h), F64x8);
      acc[h] += v * v;  // exact: a 24-bit significand squares into 48 bits
    }
#endif
  }
};

template <>
struct VectorOps<Float64> {
  using V = U64x8;
  using SignedV = I64x8;
  static constexpr int kSquareVectors = 1;
  static void add_squares(V a, F64x8* acc) {
    const F64x8 v = bits_as<F64x8>(a);
    acc[0] += v * v;
  }
};

template <>
struct VectorOps<BFloat16> {
  using V = U16x32;
  using SignedV = I16x32;
  static constexpr int kSquareVectors = 4;
  static void add_squares(V a, F64x8* acc) {
    // bfloat16 is the top half of a float32. (The AVX-512 interleave takes the elements in another order, which
    // only changes which lane adds which square.)
#if NANSCAN_AVX512
    const __m512i bits = bits_as<__m512i>(a);
    const __m512i zero = _mm512_setzero_si512();
    const __m512 halves[2] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, bits)),
                              _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, bits))};
    for (int h = 0; h < 2; ++h) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(halves[h]));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(halves[h]), 1)));
      acc[2 * h] = bits_as<F64x8>(_mm512_fmadd_pd(lo, lo, bits_as<__m512d>(acc[2 * h])));
      acc[2 * h + 1] = bits_as<F64x8>(_mm512_fmadd_pd(hi, hi, bits_as<__m512d>(acc[2 * h + 1])));
    }
#else
    for (int h = 0; h < 2; ++h) {
      const U32x16 widened = __builtin_convertvector(part_of<U16x16>(a, h), U32x16) << 16;
      const F32x16 x = bits_as<F32x16>(widened);
      for (int q = 0; q < 2; ++q) {
        const F64x8 v = __builtin_convertvector(part_of<F32x8>(x, q), F64x8);
        acc[2 * h + q] += v * v;
      }
    }
#endif
  }
};

template <>
struct VectorOps<Float16> {
  using V = U16x32;
  using SignedV = I16x32;
  static constexpr int kSquareVectors = 4;
  // Squares are taken in float: 11-bit significands square into 22 bits, and 65504^2 is far below float's limit.
  static void add_squares(V a, F64x8* acc) {
#if NANSCAN_AVX512
    const __m512i bits = bits_as<__m512i>(a);
    const __m256i halves[2] = {_mm512_castsi512_si256(bits), _mm512_extracti64x4_epi64(bits, 1)};
    for (int h = 0; h < 2; ++h) {
      const __m512 x = _mm512_cvtph_ps(halves[h]);
      const __m512 sq = _mm512_mul_ps(x, x);
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(sq));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1)));
      acc[2 * h] = bits_as<F64x8>(_mm512_add_pd(bits_as<__m512d>(acc[2 * h]), lo));
      acc[2 * h + 1] = bits_as<F64x8>(_mm512_add_pd(bits_as<__m512d>(acc[2 * h + 1]), hi));
    }
#else
    for (int h = 0; h < 2; ++h) {
      // The float16 fields moved into float32 positions encode x * 2^-112 (the bias difference): rescale exactly.
      const U32x16 moved = __builtin_convertvector(part_of<U16x16>(a, h), U32x16) << 13;
      const F32x16 x = bits_as<F32x16>(moved) * 0x1p112f;
      const F32x16 sq = x * x;
      for (int q = 0; q < 2; ++q) acc[2 * h + q] += __builtin_convertvector(part_of<F32x8>(sq, q), F64x8);
    }
#endif
  }
};

template <typename F>
struct BlockSummary {
  using Bits = typename F::Bits;
  Bits max_abs;          // 0 when the block holds no non-zero value
  Bits min_nonzero_abs;  // all ones when the block holds no non-zero value
  bool has_zero;
  F64x8 sumsq[VectorOps<F>::kSquareVectors];  // added to the chunk's only if the block takes the fast path
};

// Pass 1 (NOTE: [blocks]). With b = |x| - 1 (zero wraps to all ones): the unsigned minimum of b skips zeros, the
// signed maximum of b is the largest |x| less one, and the unsigned maximum of b is all ones iff there is a zero.
template <typename F>
void summarize_block(const typename F::Bits* p, int64_t n, BlockSummary<F>& s) {
  using Bits = typename F::Bits;
  using SignedBits = std::make_signed_t<Bits>;
  using Ops = VectorOps<F>;
  using V = typename Ops::V;
  using SV = typename Ops::SignedV;
  constexpr int64_t L = sizeof(V) / sizeof(Bits);
  constexpr Bits kAllOnes = static_cast<Bits>(~Bits(0));
  V umin = ~V{}, umax = V{};
  SV smax = SV{} - 1;
  F64x8 sumsq[Ops::kSquareVectors] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const V a = load_bits<V>(p + i) & F::kAbsMask;
    const V b = a - 1;
    umin = umin < b ? umin : b;
    umax = umax > b ? umax : b;
    const SV sb = bits_as<SV>(b);
    smax = smax > sb ? smax : sb;
    Ops::add_squares(a, sumsq);
  }
  Bits mn = kAllOnes, mx_u = 0;
  SignedBits mx_s = -1;
  for (int64_t l = 0; l < L; ++l) {
    mn = std::min<Bits>(mn, umin[l]);
    mx_u = std::max<Bits>(mx_u, umax[l]);
    mx_s = std::max<SignedBits>(mx_s, smax[l]);
  }
  // The tail of a chunk, shorter than one vector. (Its squares go through a plain array: indexing the vector
  // accumulators with a variable would keep them in memory for the whole loop above.)
  double tail_squares[sizeof(F64x8) / sizeof(double)] = {};
  for (int64_t l = 0; i < n; ++i, ++l) {
    const Bits a = abs_bits<F>(p[i]);
    const Bits b = static_cast<Bits>(a - 1);
    mn = std::min(mn, b);
    mx_u = std::max(mx_u, b);
    mx_s = std::max(mx_s, static_cast<SignedBits>(b));
    const double v = abs_to_double<F>(a);
    tail_squares[l % 8] += v * v;
  }
  sumsq[0] += load_bits<F64x8>(tail_squares);
  s.min_nonzero_abs = mn == kAllOnes ? mn : static_cast<Bits>(mn + 1);
  s.max_abs = static_cast<Bits>(mx_s + 1);
  s.has_zero = mx_u == kAllOnes;
  for (int k = 0; k < Ops::kSquareVectors; ++k) s.sumsq[k] = sumsq[k];
}

template <typename F>
int64_t count_zeros(const typename F::Bits* p, int64_t n) {
  using Bits = typename F::Bits;
  using V = typename VectorOps<F>::V;
  constexpr int64_t L = sizeof(V) / sizeof(Bits);
  static_assert(kBlockBytes / kVectorBytes <= 0xffff, "each lane counts one element per vector of a block");
  V zeros = V{};
  int64_t i = 0;
  for (; i + L <= n; i += L) zeros -= bits_as<V>((load_bits<V>(p + i) & F::kAbsMask) == 0);  // true is -1
  int64_t total = 0;
  for (int64_t l = 0; l < L; ++l) total += zeros[l];
  for (; i < n; ++i) total += abs_bits<F>(p[i]) == 0;
  return total;
}

// Pass 2 for a block whose normal fields lie in [lo, lo + kWindows * kWindowFields) (NOTE: [blocks]).
// Each 64-bit word of a block holds several elements; each element adds 1 << 4 * ((field - lo) mod 16) to a word of
// sixteen 4-bit counters (the counters of its half-window when kWindows is 2), so a vector of elements is counted
// with shifts and adds and no memory traffic. The counters are widened to bytes before they can reach 16, and to
// integers once per block. Zeros (field 0) land on field lo + ((0 - lo) mod window), and the zero padding of a
// short tail with them; `zeros` says how many real zeros there are, so both are taken back out.
constexpr int kWindowFields = 16;

template <typename F, int kWindows>
void count_fields_window(const typename F::Bits* p, int64_t n, int lo, int64_t zeros, FieldCounts& counts) {
  using Bits = typename F::Bits;
  constexpr int kVectors = 2;  // independent accumulator chains per step
  constexpr int kWordsPerVector = sizeof(U64x8) / 8;
  constexpr int kPerWord = 8 / sizeof(Bits);
  constexpr int kBitsPerElem = 8 * sizeof(Bits);
  constexpr int kFlushEvery = 15 / kPerWord;  // steps before a 4-bit counter could overflow
  constexpr int64_t kStep = int64_t(kVectors) * kWordsPerVector * kPerWord;  // elements per step
  constexpr int kFields = kWindows * kWindowFields;
  // Bytes hold the counts of a whole block: each word lane sees at most this many elements of it.
  static_assert(kBlockBytes / sizeof(U64x8) / kVectors * kPerWord <= 255, "byte counters would overflow");
  static_assert(kWindows == 1 || kWindows == 2, "one or two windows of 16 fields");
  constexpr uint64_t kNibbles = 0x0f0f0f0f0f0f0f0full;
  constexpr uint64_t kBytes = 0x00ff00ff00ff00ffull;

#if NANSCAN_AVX512
  // permutex2var looks up a 16-entry table with the low 4 bits of each index and ignores the rest, so the field's
  // low bits index the table directly: with one window, entry r holds the counter increment of the field that is r
  // mod 16, which saves subtracting lo; with two, the index is field - lo and its bit 4 picks the half-window.
  __m512i table[2];
  {
    alignas(64) uint64_t entries[16];
    for (int r = 0; r < 16; ++r)
      entries[r] = uint64_t(1) << (4 * (kWindows == 1 ? ((r - lo) % 16 + 16) % 16 : r));
    table[0] = _mm512_load_si512(entries);
    table[1] = _mm512_load_si512(entries + 8);
  }
  const __m512i lo_vec = _mm512_set1_epi64(lo);
  const __m512i bit4 = _mm512_set1_epi64(16);
#else
  // 4 * ((field - lo) mod kFields): the field of element j sits at bit 2 of (word >> shift_j), so subtracting 4 * lo
  // and masking gives it; the bits outside the mask never borrow into it.
  const uint64_t lo4 = static_cast<uint64_t>(lo) * 4;
  const uint64_t shift_mask = 4 * (kFields - 1);
  const U64x8 one = U64x8{} + 1;
#endif

  U64x8 even[kWindows][kVectors] = {}, odd[kWindows][kVectors] = {};
  auto count_steps = [&](const Bits* elems, int64_t steps) {
    for (int64_t step = 0; step < steps;) {
      U64x8 nibbles[kWindows][kVectors] = {};
      const int64_t stop = std::min(steps, step + kFlushEvery);
      for (; step < stop; ++step) {
        for (int v = 0; v < kVectors; ++v) {
          const U64x8 w = load_bits<U64x8>(elems + (step * kVectors + v) * kWordsPerVector * kPerWord);
          for (int j = 0; j < kPerWord; ++j) {
            const int shift = j * kBitsPerElem + F::kMantBits;
#if NANSCAN_AVX512
            const __m512i field = _mm512_srli_epi64(bits_as<__m512i>(w), shift);
            if (kWindows == 1) {
              const __m512i add = _mm512_permutex2var_epi64(table[0], field, table[1]);
              nibbles[0][v] = bits_as<U64x8>(_mm512_add_epi64(bits_as<__m512i>(nibbles[0][v]), add));
            } else {
              const __m512i offset = _mm512_sub_epi64(field, lo_vec);
              const __m512i add = _mm512_permutex2var_epi64(table[0], offset, table[1]);
              const __mmask8 upper = _mm512_test_epi64_mask(offset, bit4);
              const __m512i n0 = bits_as<__m512i>(nibbles[0][v]);
              const __m512i n1 = bits_as<__m512i>(nibbles[kWindows - 1][v]);
              nibbles[0][v] = bits_as<U64x8>(_mm512_mask_add_epi64(n0, static_cast<__mmask8>(~upper), n0, add));
              nibbles[kWindows - 1][v] = bits_as<U64x8>(_mm512_mask_add_epi64(n1, upper, n1, add));
            }
#else
            const U64x8 s = ((w >> (shift - 2)) - lo4) & shift_mask;
            if (kWindows == 1) {
              nibbles[0][v] += one << s;
            } else {
              const U64x8 upper = s >> 6;  // 1 for the fields of the second half-window
              nibbles[0][v] += (one << (s & 63)) & (upper - 1);
              nibbles[kWindows - 1][v] += (one << (s & 63)) & (0 - upper);
            }
#endif
          }
        }
      }
      for (int h = 0; h < kWindows; ++h) {
        for (int v = 0; v < kVectors; ++v) {
          even[h][v] += nibbles[h][v] & kNibbles;
          odd[h][v] += (nibbles[h][v] >> 4) & kNibbles;
        }
      }
    }
  };
  const int64_t full = n / kStep * kStep;
  count_steps(p, full / kStep);
  int64_t padding = 0;
  if (full < n) {
    Bits tail[kStep] = {};
    std::memcpy(tail, p + full, sizeof(Bits) * (n - full));
    padding = kStep - (n - full);
    count_steps(tail, 1);
  }

  int64_t window[kFields];
  for (int h = 0; h < kWindows; ++h) {
    // Widen to 16-bit slots: slot s of sum[k] counts offset 4 * s + k of the half-window.
    uint64_t sum[4] = {};
    for (int v = 0; v < kVectors; ++v) {
      for (int l = 0; l < kWordsPerVector; ++l) {
        sum[0] += even[h][v][l] & kBytes;
        sum[1] += odd[h][v][l] & kBytes;
        sum[2] += (even[h][v][l] >> 8) & kBytes;
        sum[3] += (odd[h][v][l] >> 8) & kBytes;
      }
    }
    for (int k = 0; k < 4; ++k)
      for (int s = 0; s < 4; ++s)
        window[h * kWindowFields + 4 * s + k] = static_cast<int64_t>((sum[k] >> (16 * s)) & 0xffff);
  }
  window[(kFields - lo % kFields) % kFields] -= zeros + padding;
  const int hi = std::min(lo + kFields - 1, F::kExpMax - 1);
  for (int f = lo; f <= hi; ++f) counts.table[0][f] += static_cast<uint32_t>(window[f - lo]);
  counts.touch(lo, hi);
}

// Pass 2 for a block of normal values and zeros spanning many fields: one load-increment-store per element,
// spread over kFieldTables tables. Zeros count into field 0, which the fold ignores.
template <typename F>
void count_fields_scalar(const typename F::Bits* p, int64_t n, int lo, int hi, bool has_zero, FieldCounts& counts) {
  int64_t i = 0;
  for (; i + kFieldTables <= n; i += kFieldTables)
    for (int t = 0; t < kFieldTables; ++t) counts.table[t][exponent_field<F>(p[i + t])]++;
  for (; i < n; ++i) counts.table[0][exponent_field<F>(p[i])]++;
  counts.touch(has_zero ? 0 : lo, hi);
}

// Running state of one chunk; `record` is the chunk's partial record.
struct ChunkState {
  int64_t* record;
  uint64_t absmax = 0;
  uint64_t absmin = UINT64_MAX;
  double exact_sumsq = 0.0;  // blocks that took scan_block_exact
};

// The per-element path for a block holding a subnormal, inf or NaN: classify.h decides every element.
template <typename F>
void scan_block_exact(const typename F::Bits* p, int64_t n, ChunkState& st, FieldCounts& counts) {
  using Bits = typename F::Bits;
  int64_t* c = st.record;
  int lo = INT_MAX, hi = -1;
  double sumsq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const Bits bits = p[i];
    switch (classify<F>(bits)) {
      case kNaN: c[record::kNaN]++; continue;
      case kPosInf: c[record::kPosInf]++; continue;
      case kNegInf: c[record::kNegInf]++; continue;
      case kZero: c[record::kZero]++; continue;
      case kSubnormal:
        c[record::kSubnormal]++;
        c[record::kHist + bin_of_subnormal<F>(bits)]++;
        break;
      case kNormal: {
        const int field = exponent_field<F>(bits);
        counts.table[i % kFieldTables][field]++;
        lo = std::min(lo, field);
        hi = std::max(hi, field);
        break;
      }
    }
    const uint64_t a = static_cast<uint64_t>(abs_bits<F>(bits));
    st.absmax = std::max(st.absmax, a);
    st.absmin = std::min(st.absmin, a);
    const double v = abs_to_double<F>(bits);
    sumsq += v * v;
  }
  if (hi >= 0) counts.touch(lo, hi);
  st.exact_sumsq += sumsq;
}

template <typename F>
void scan_chunk(const typename F::Bits* data, int64_t begin, int64_t end, int64_t* record, double& sumsq_out,
                FieldCounts& counts) {
  using Bits = typename F::Bits;
  constexpr int64_t kBlockElems = kBlockBytes / sizeof(Bits);
  constexpr Bits kSmallestNormal = Bits(1) << F::kMantBits;
  constexpr Bits kInfBits = Bits(F::kExpMax) << F::kMantBits;
  ChunkState st{record};
  constexpr int kSquareVectors = VectorOps<F>::kSquareVectors;
  F64x8 lanes[kSquareVectors] = {};
  BlockSummary<F> s;
  for (int64_t b = begin; b < end; b += kBlockElems) {
    const Bits* p = data + b;
    const int64_t n = std::min(kBlockElems, end - b);
    const int64_t ahead = b + kPrefetchBlocks * kBlockElems;
    if (ahead < end) {
      const char* bytes = reinterpret_cast<const char*>(data + ahead);
      const int64_t size = std::min(kBlockElems, end - ahead) * static_cast<int64_t>(sizeof(Bits));
      for (int64_t off = 0; off < size; off += 64) __builtin_prefetch(bytes + off, 0, 3);
    }
    summarize_block<F>(p, n, s);
    const bool any_nonzero = s.min_nonzero_abs != static_cast<Bits>(~Bits(0));
    if (s.max_abs >= kInfBits || (any_nonzero && s.min_nonzero_abs < kSmallestNormal)) {
      scan_block_exact<F>(p, n, st, counts);
      continue;
    }
    for (int k = 0; k < kSquareVectors; ++k) lanes[k] += s.sumsq[k];
    const int64_t zeros = s.has_zero ? (any_nonzero ? count_zeros<F>(p, n) : n) : 0;
    record[record::kZero] += zeros;
    if (!any_nonzero) continue;
    st.absmax = std::max<uint64_t>(st.absmax, s.max_abs);
    st.absmin = std::min<uint64_t>(st.absmin, s.min_nonzero_abs);
    const int lo = exponent_field<F>(s.min_nonzero_abs);
    const int hi = exponent_field<F>(s.max_abs);
    if (hi - lo < kWindowFields) count_fields_window<F, 1>(p, n, lo, zeros, counts);
    else if (hi - lo < 2 * kWindowFields) count_fields_window<F, 2>(p, n, lo, zeros, counts);
    else count_fields_scalar<F>(p, n, lo, hi, zeros > 0, counts);
  }
  counts.fold_into<F>(record + record::kHist);
  record[record::kAbsMaxBits] = static_cast<int64_t>(st.absmax);
  if (st.absmin != UINT64_MAX) record[record::kAbsMinBits] = static_cast<int64_t>(st.absmin);
  double sumsq = 0.0;
  for (int k = 0; k < kSquareVectors; ++k)
    for (size_t l = 0; l < sizeof(F64x8) / sizeof(double); ++l) sumsq += lanes[k][l];
  sumsq_out = sumsq + st.exact_sumsq;
}

struct Partial {
  int64_t counts[record::kWidth];
  double sumsq;
};

void scan_chunk_dispatch(const ScanTask& task, const Chunk& chunk, Partial& out, FieldCounts& counts) {
  std::memset(out.counts, 0, sizeof(out.counts));
  out.counts[record::kAbsMinBits] = record::kAbsMinNone;
  switch (task.dtype) {
    case kFloat16:
      scan_chunk<Float16>(static_cast<const uint16_t*>(task.data), chunk.begin, chunk.end, out.counts, out.sumsq,
                          counts);
      break;
    case kBFloat16:
      scan_chunk<BFloat16>(static_cast<const uint16_t*>(task.data), chunk.begin, chunk.end, out.counts, out.sumsq,
                           counts);
      break;
    case kFloat32:
      scan_chunk<Float32>(static_cast<const uint32_t*>(task.data), chunk.begin, chunk.end, out.counts, out.sumsq,
                          counts);
      break;
    case kFloat64:
      scan_chunk<Float64>(static_cast<const uint64_t*>(task.data), chunk.begin, chunk.end, out.counts, out.sumsq,
                          counts);
      break;
  }
}

void merge(int64_t* rec, double& sumsq, const Partial& p) {
  for (int k = 0; k < record::kWidth; ++k) {
    if (k == record::kAbsMaxBits) rec[k] = std::max(rec[k], p.counts[k]);
    else if (k == record::kAbsMinBits) rec[k] = std::min(rec[k], p.counts[k]);
    else if (k != record::kSumSq) rec[k] += p.counts[k];
  }
  sumsq += p.sumsq;
}

int64_t element_bytes(int32_t dtype) { return dtype == kFloat64 ? 8 : dtype == kFloat32 ? 4 : 2; }

std::vector<Chunk> make_chunks(const ScanTask* tasks, int64_t num_tasks, int64_t chunk_elems) {
  chunk_elems = std::clamp<int64_t>(chunk_elems, 1, kMaxChunkElems);
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < num_tasks; ++t)
    for (int64_t b = 0; b < tasks[t].numel; b += chunk_elems)
      chunks.push_back({t, b, std::min(b + chunk_elems, tasks[t].numel)});
  return chunks;
}

int resolve_threads(int num_threads) {
#ifdef _OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
#endif
  return std::max(num_threads, 1);
}

}  // namespace

void scan_cpu(const ScanTask* tasks, int64_t num_tasks, int64_t* records, int64_t chunk_elems, int num_threads) {
  const std::vector<Chunk> chunks = make_chunks(tasks, num_tasks, chunk_elems);
  std::vector<Partial> partials(chunks.size());
  const int64_t n = static_cast<int64_t>(chunks.size());
  num_threads = resolve_threads(num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    // Value-initialised once per thread; fold_into keeps it zero between chunks.
    std::unique_ptr<FieldCounts> counts(new FieldCounts());
    counts->reset_range();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) scan_chunk_dispatch(tasks[chunks[i].task], chunks[i], partials[i], *counts);
  }
  std::vector<double> sums(num_tasks, 0.0);
  for (int64_t i = 0; i < n; ++i) merge(records + chunks[i].task * record::kWidth, sums[chunks[i].task], partials[i]);
  for (int64_t t = 0; t < num_tasks; ++t) std::memcpy(records + t * record::kWidth + record::kSumSq, &sums[t], 8);
}

uint64_t read_bandwidth_probe(const ScanTask* tasks, int64_t num_tasks, int64_t chunk_elems, int num_threads) {
  const std::vector<Chunk> chunks = make_chunks(tasks, num_tasks, chunk_elems);
  const int64_t n = static_cast<int64_t>(chunks.size());
  uint64_t checksum = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(resolve_threads(num_threads)) reduction(^ : checksum)
  for (int64_t i = 0; i < n; ++i) {
    const ScanTask& task = tasks[chunks[i].task];
    const int64_t width = element_bytes(task.dtype);
    const auto* bytes = static_cast<const unsigned char*>(task.data) + chunks[i].begin * width;
    const int64_t size = (chunks[i].end - chunks[i].begin) * width;
    // XOR of 64-bit words in independent lanes: one cheap vector op per load, so only memory limits the loop.
    constexpr int kLanes = 16;
    uint64_t acc[kLanes] = {};
    int64_t off = 0;
    for (; off + 8 * kLanes <= size; off += 8 * kLanes)
      for (int l = 0; l < kLanes; ++l) acc[l] ^= load_bits<uint64_t>(bytes + off + 8 * l);
    for (; off < size; ++off) acc[0] ^= bytes[off];
    for (int l = 0; l < kLanes; ++l) checksum ^= acc[l];
  }
  return checksum;
}

}  // namespace nanscan
