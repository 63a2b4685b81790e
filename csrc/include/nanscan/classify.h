// classify.h: per-element classification of floating-point values from their raw bits (IEEE-754 binary formats and
// the float8 formats), shared by the CPU and CUDA kernels.
//
// Everything here is decided from the integer bit pattern (never isnan/isinf/log2 on a float), so -ffast-math,
// --use_fast_math and half-precision host types cannot change an answer, and the CPU build runs exactly the
// code the GPU runs (tests call it through nanscan._C.classify_bits).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define NANSCAN_HD __host__ __device__ __forceinline__
#else
#define NANSCAN_HD inline
#endif

namespace nanscan {

// Dtype codes shared with Python (nanscan/engine/_layout.py). Stable: they travel in metadata tables and bundles, so
// new formats are appended and no code is ever renumbered.
enum DType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kFloat8E4M3FN = 4,
  kFloat8E5M2 = 5,
  kFloat8E4M3FNUZ = 6,
  kFloat8E5M2FNUZ = 7,
};
constexpr int32_t kNumDTypes = 8;

NANSCAN_HD bool is_dtype_code(int32_t code) { return code >= 0 && code < kNumDTypes; }

// NOTE: [float8 specials]
// Where a format keeps its non-finite values:
//  - kIeeeSpecials (IEEE-754 and float8_e5m2): the largest exponent field holds the infinities (mantissa 0) and
//    the NaNs (any other mantissa); every other field is finite.
//  - kNanAllOnes (float8_e4m3fn, "fn": finite): no infinity; the only NaNs are S.1111.111, the largest exponent
//    field holds normal values up to 448 with its other mantissas.
//  - kNanNegZero (float8_e4m3fnuz, float8_e5m2fnuz, "fnuz": finite, unsigned zero): no infinity and no -0; the one
//    NaN is the pattern of -0 (0x80), and the exponent bias is one more than IEEE's (8 and 16).
// So |x| bits alone cannot tell an fnuz NaN from zero: a test on abs bits must also look for kSignMask itself
// (kNaNIsSignAlone), which is why kInfAbsBits is kAbsMask + 1 (no abs pattern) there.
enum Specials : int32_t { kIeeeSpecials = 0, kNanAllOnes = 1, kNanNegZero = 2 };

// A binary format: storage width, exponent and mantissa field widths, where its NaNs and infinities are (NOTE:
// [float8 specials]) and its exponent bias.
template <typename BitsT, int kExpBitsV, int kMantBitsV, DType kDTypeV, Specials kSpecialsV = kIeeeSpecials,
          int kBiasV = (1 << (kExpBitsV - 1)) - 1>
struct FloatFormat {
  using Bits = BitsT;
  static constexpr int kExpBits = kExpBitsV;
  static constexpr int kMantBits = kMantBitsV;
  static constexpr int kBias = kBiasV;
  static constexpr int kExpMax = (1 << kExpBitsV) - 1;  // the largest exponent field (inf and NaN in IEEE formats)
  static constexpr DType kDType = kDTypeV;
  static constexpr Specials kSpecials = kSpecialsV;
  static constexpr bool kNaNIsSignAlone = kSpecialsV == kNanNegZero;
  // The largest exponent field of a normal value: IEEE formats keep their largest field for inf and NaN.
  static constexpr int kMaxNormalField = kSpecialsV == kIeeeSpecials ? kExpMax - 1 : kExpMax;
  static constexpr Bits kSignMask = Bits(Bits(1) << (kExpBitsV + kMantBitsV));
  static constexpr Bits kAbsMask = Bits(kSignMask - 1);
  static constexpr Bits kMantMask = Bits((Bits(1) << kMantBitsV) - 1);
  // Abs bit patterns order like the values they encode, so two thresholds classify a whole vector of them at once,
  // as classify() does one by one: |x| bits >= kInfAbsBits is inf or NaN, 0 < |x| bits < kSmallestNormalAbsBits
  // is subnormal. kNanNegZero formats need one more test (NOTE: [float8 specials]).
  static constexpr uint64_t kInfAbsBitsWide = kSpecialsV == kIeeeSpecials ? uint64_t(kExpMax) << kMantBitsV
                                              : kSpecialsV == kNanAllOnes ? uint64_t(kAbsMask)
                                                                          : uint64_t(kAbsMask) + 1;
  static constexpr Bits kInfAbsBits = Bits(kInfAbsBitsWide);  // for kNanNegZero formats: not an abs pattern (0x80)
  static constexpr Bits kSmallestNormalAbsBits = Bits(Bits(1) << kMantBitsV);
  static constexpr int kBytes = static_cast<int>(sizeof(BitsT));
};

using Float16 = FloatFormat<uint16_t, 5, 10, kFloat16>;
using BFloat16 = FloatFormat<uint16_t, 8, 7, kBFloat16>;
using Float32 = FloatFormat<uint32_t, 8, 23, kFloat32>;
using Float64 = FloatFormat<uint64_t, 11, 52, kFloat64>;
using Float8E4M3FN = FloatFormat<uint8_t, 4, 3, kFloat8E4M3FN, kNanAllOnes>;
using Float8E5M2 = FloatFormat<uint8_t, 5, 2, kFloat8E5M2>;
using Float8E4M3FNUZ = FloatFormat<uint8_t, 4, 3, kFloat8E4M3FNUZ, kNanNegZero, 8>;
using Float8E5M2FNUZ = FloatFormat<uint8_t, 5, 2, kFloat8E5M2FNUZ, kNanNegZero, 16>;

// Element size in bytes of a dtype code (0 for an unknown code).
NANSCAN_HD int element_bytes(int32_t dtype) {
  switch (dtype) {
    case kFloat16: case kBFloat16: return 2;
    case kFloat32: return 4;
    case kFloat64: return 8;
    case kFloat8E4M3FN: case kFloat8E5M2: case kFloat8E4M3FNUZ: case kFloat8E5M2FNUZ: return 1;
    default: return 0;
  }
}

// Calls fn(F{}) with the format type (Float16, ..) that a dtype code names; false for an unknown code. Host code only:
// the CUDA kernel switches on the code itself (a generic lambda cannot cross into device code here).
template <typename Fn>
inline bool with_format(int32_t dtype, Fn&& fn) {
  switch (dtype) {
    case kFloat16: fn(Float16{}); return true;
    case kBFloat16: fn(BFloat16{}); return true;
    case kFloat32: fn(Float32{}); return true;
    case kFloat64: fn(Float64{}); return true;
    case kFloat8E4M3FN: fn(Float8E4M3FN{}); return true;
    case kFloat8E5M2: fn(Float8E5M2{}); return true;
    case kFloat8E4M3FNUZ: fn(Float8E4M3FNUZ{}); return true;
    case kFloat8E5M2FNUZ: fn(Float8E5M2FNUZ{}); return true;
    default: return false;
  }
}

enum ValueClass : int32_t { kNormal = 0, kZero = 1, kSubnormal = 2, kPosInf = 3, kNegInf = 4, kNaN = 5 };

// The exponent histogram has 256 bins: bin = clamp(floor(log2|x|), kMinBinExponent, kMaxBinExponent) - kMinBinExponent.
constexpr int kHistBins = 256;
constexpr int kMinBinExponent = -128;
constexpr int kMaxBinExponent = 127;

template <typename F>
NANSCAN_HD int exponent_field(typename F::Bits bits) {
  return static_cast<int>((bits >> F::kMantBits) & typename F::Bits(F::kExpMax));
}

template <typename F>
NANSCAN_HD typename F::Bits abs_bits(typename F::Bits bits) {
  return bits & F::kAbsMask;
}

template <typename F>
NANSCAN_HD ValueClass classify(typename F::Bits bits) {
  const int field = exponent_field<F>(bits);
  const typename F::Bits mant = bits & F::kMantMask;
  // NOTE: [float8 specials]. The branches on F::kSpecials are decided at compile time.
  if (F::kSpecials == kIeeeSpecials && field == F::kExpMax) {
    if (mant != 0) return kNaN;
    return (bits & F::kSignMask) ? kNegInf : kPosInf;
  }
  if (F::kSpecials == kNanAllOnes && abs_bits<F>(bits) == F::kAbsMask) return kNaN;
  if (F::kSpecials == kNanNegZero && bits == F::kSignMask) return kNaN;
  if (field == 0) return mant == 0 ? kZero : kSubnormal;
  return kNormal;
}

// Index of the highest set bit of a non-zero value.
NANSCAN_HD int highest_bit(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return 63 - __clzll(static_cast<long long>(v));
#elif defined(__GNUC__) || defined(__clang__)
  return 63 - __builtin_clzll(v);
#else
  int i = -1;
  while (v) { v >>= 1; ++i; }
  return i;
#endif
}

NANSCAN_HD int clamp_to_bin(int e) {
  e = e < kMinBinExponent ? kMinBinExponent : e;
  e = e > kMaxBinExponent ? kMaxBinExponent : e;
  return e - kMinBinExponent;
}

// floor(log2|x|) of a normal value from its exponent field alone. Kernels histogram the raw field and fold it
// through this afterwards (NOTE: [field histogram]): every normal value with the same field lands in one bin.
template <typename F>
NANSCAN_HD int bin_of_normal_field(int field) {
  return clamp_to_bin(field - F::kBias);
}

// NOTE: [field histogram]
// Binning an element needs a subnormal test and a clamp; counting its raw exponent field needs one shift and mask.
// So kernels count normal values per exponent field (1 << kExpBits counters: 32 for float16, 256 for bfloat16 and
// float32, 2048 for float64) and fold those counters into the kHistBins bins once per chunk with fold_fields.
// Field 0 (zero, subnormal) and the fields above kMaxNormalField (inf, NaN) are never folded: zeros, infinities and
// NaNs are only counted, and subnormals are binned one by one with bin_of_subnormal. (A float8_e4m3fn NaN shares
// field 15 with normal values: a kernel counting fields must keep NaNs out of the counters, NOTE: [float8 specials].) float64 has more fields than bins; the fold clamps
// them exactly as exponent_bin does, so a folded histogram equals the per-element one.
template <typename F, typename FieldCount, typename BinCount>
NANSCAN_HD void fold_fields(const FieldCount* field_counts, int first_field, int last_field, BinCount* hist) {
  first_field = first_field < 1 ? 1 : first_field;
  last_field = last_field > F::kMaxNormalField ? F::kMaxNormalField : last_field;
  for (int field = first_field; field <= last_field; ++field)
    hist[bin_of_normal_field<F>(field)] += static_cast<BinCount>(field_counts[field]);
}

// floor(log2|x|) of a subnormal: the exponent is 1 - bias, the mantissa has no hidden bit, so the leading
// mantissa bit sets the binade.
template <typename F>
NANSCAN_HD int bin_of_subnormal(typename F::Bits bits) {
  const uint64_t mant = static_cast<uint64_t>(bits & F::kMantMask);
  return clamp_to_bin(1 - F::kBias - F::kMantBits + highest_bit(mant));
}

// Exponent-histogram bin of a finite, non-zero value; -1 for zero, inf and NaN (they are counted, not binned).
template <typename F>
NANSCAN_HD int exponent_bin(typename F::Bits bits) {
  switch (classify<F>(bits)) {
    case kNormal: return bin_of_normal_field<F>(exponent_field<F>(bits));
    case kSubnormal: return bin_of_subnormal<F>(bits);
    default: return -1;
  }
}

// |x| of a finite value as a double, exactly (every format here is a subset of double). Used once per tensor on
// the absmax/absmin bit patterns, and by the sum of squares.
template <typename F>
NANSCAN_HD double abs_to_double(typename F::Bits bits) {
  const uint64_t a = static_cast<uint64_t>(abs_bits<F>(bits));
  const int field = static_cast<int>(a >> F::kMantBits);
  const uint64_t mant = a & static_cast<uint64_t>(F::kMantMask);
  if (F::kDType == kFloat64) {
    union { uint64_t u; double d; } pun;  // exact reinterpretation, valid in host and device code
    pun.u = a;
    return pun.d;
  }
  // Rebuild as a double: same value, wider fields. Subnormals of the narrow format are normal in double.
  if (field == 0) {
    if (mant == 0) return 0.0;
    const int top = highest_bit(mant);
    const int e = 1 - F::kBias - F::kMantBits + top;            // floor(log2 |x|)
    const uint64_t frac = (mant << (52 - top)) & ((uint64_t(1) << 52) - 1);
    union { uint64_t u; double d; } pun;
    pun.u = (static_cast<uint64_t>(e + 1023) << 52) | frac;
    return pun.d;
  }
  union { uint64_t u; double d; } pun;
  pun.u = (static_cast<uint64_t>(field - F::kBias + 1023) << 52) | (mant << (52 - F::kMantBits));
  return pun.d;
}

}  // namespace nanscan
