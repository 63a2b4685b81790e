// multi_tensor.cuh: the per-thread work of the CUDA scan (chunk splitting, loads, classification, counting), written
// as host+device code so that scan_on_host can run exactly these functions on a machine without a GPU.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include "cuda/scan_cuda.h"
#include "nanscan/classify.h"
#include "nanscan/stats_record.h"

namespace nanscan {
namespace cuda {

// NOTE: [cuda scan]
// One launch scans every tensor (PyTorch's _foreach_norm and MultiTensorApply are the model):
//  1. Pieces. The host cuts the bytes of all tensors, end to end, into one equal share per block (counting a fixed
//     cost per piece, so a block of many tiny tensors gets fewer bytes), and lists the pieces, a tensor's part
//     within one share, in one ChunkMeta table with each block's first row in block_begin. Every block finishes at
//     about the same time whatever the tensor sizes and dtypes (one dtype switch per piece).
//  2. Alignment. Only element alignment is assumed of a tensor (torch guarantees it; views may start anywhere).
//     split_for_vectors cuts a piece into a scalar head up to the first 16-byte boundary, whole 16-byte vectors
//     (one 128-bit load each, streamed past the caches), and a scalar tail; head and tail hold < 16 bytes each.
//  3. Fast path. A vector's largest abs bit pattern and its smallest non-zero one (needed for absmax/absmin anyway)
//     tell whether it holds an inf/NaN or a subnormal: abs bit patterns order like the values. A vector of zeros
//     and normal values only is counted without classify(); any other vector, and every head and tail element,
//     goes element by element through classify<F>() (classify.h), the same code the CPU kernel runs. 16-bit
//     formats take both extremes of a vector with packed 16x2 min/max instructions.
//  4. Field table. Normal values are counted per exponent field (NOTE: [field histogram] in classify.h; float64,
//     with 2048 fields, per clamped bin instead) in a shared-memory table of 32-bit counters: kTableSlots rows of
//     32 words, slot s in row s, column = the thread's lane. The 32 lanes of a warp always hit 32 different banks,
//     so the shared atomicAdd never conflicts inside an instruction, whatever the data (a plain per-element shared
//     histogram serialises on the few popular bins of real tensors). The warps of a block share the table; their
//     atomics are separate instructions. Zeros of formats counted per field land in slot 0 (field 0). Subnormals
//     are rare and binned one by one into a plain shared histogram of kHistBins words.
//  5. Merge. At the end of a piece the block reduces its counts and abs bit extremes, adds them to the tensor's
//     record with 64-bit integer atomics (atomicAdd; atomicMax/atomicMin on the abs bit patterns, NOTE: [stats
//     record]), then folds only the table rows between the slots of its absmin and absmax (plus slot 0), the only
//     rows any element can have touched, into the record's bins. The sum of squares takes a float64 atomicAdd,
//     the one slot whose last bits may vary with the order blocks finish. Every count is exact and the same on
//     every run, and so is the fingerprint (NOTE: [scan fingerprint] in stats_record.h): each thread sums the terms
//     of the elements it reads, placed by their index in the tensor, and the block's sum is added with a wrapping
//     64-bit atomicAdd, in whatever order blocks finish. A last one-block kernel ORs the NaN/inf counts of all
//     records into a float found_inf flag (1.0 or 0.0), the form torch's fused optimizers take, so a step can be
//     skipped without the host reading anything.

constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kVectorBytes = 16;
constexpr int kUnroll = 4;  // vectors in flight per thread: 64 bytes, enough to cover HBM latency at full occupancy
constexpr int kTableSlots = 256;  // the fields of an 8-bit exponent, or float64's kHistBins bins
constexpr int kTableWords = kTableSlots * kWarpSize;

static_assert(kThreads % kWarpSize == 0, "whole warps");
static_assert(kTableSlots == kHistBins, "float64 counts its clamped bins in the slots");
static_assert(kThreads >= kVectorBytes, "one thread per head or tail element");
// A slot counter, a per-thread count and a row total count at most the elements of one pass of a piece.
static_assert(kMaxChunkElems <= (int64_t(1) << 31), "32-bit counters must not overflow");

// A chunk [begin, end) cut for 16-byte loads: [begin, head_end) and [body_end, end) are read element by element,
// [head_end, body_end) as whole vectors starting at a 16-byte-aligned address. `base` must be element-aligned.
struct VectorSplit {
  int64_t head_end;
  int64_t body_end;
};

NANSCAN_HD VectorSplit split_for_vectors(uint64_t base, int64_t begin, int64_t end, int elem_size) {
  const uint64_t first = base + static_cast<uint64_t>(begin) * elem_size;
  const int64_t to_boundary = static_cast<int64_t>((kVectorBytes - first % kVectorBytes) % kVectorBytes) / elem_size;
  const int64_t head_end = begin + to_boundary < end ? begin + to_boundary : end;
  const int per_vector = kVectorBytes / elem_size;
  const int64_t body_end = head_end + (end - head_end) / per_vector * per_vector;
  return {head_end, body_end};
}

// Where slot `slot` lives in the field table, in bytes from the thread's column. Kept in bytes and unsigned so the
// compiler can fold it with the field extraction (for bfloat16 a single mask of the abs bits).
NANSCAN_HD uint32_t slot_offset_bytes(int slot) {
  return static_cast<uint32_t>(slot) * (kWarpSize * static_cast<uint32_t>(sizeof(uint32_t)));
}

NANSCAN_HD uint32_t* slot_counter(uint32_t* column, int slot) {
  return reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(column) + slot_offset_bytes(slot));
}

// Formats whose exponent field has at most 8 bits are counted per raw field; float64 per clamped bin.
template <typename F>
struct SlotPolicy {
  static constexpr bool kByField = F::kExpBits <= 8;
};

// The record slot a table slot's count goes to, or -1 for a slot no element can reach (inf/NaN fields).
template <typename F>
NANSCAN_HD int slot_record_index(int slot) {
  if (!SlotPolicy<F>::kByField) return record::kHist + slot;
  if (slot == 0) return record::kZero;
  if (slot > F::kMaxNormalField) return -1;
  return record::kHist + bin_of_normal_field<F>(slot);
}

// |x| (the bit pattern without its sign) as the value, exactly; the fast path squares it.
template <typename F>
NANSCAN_HD double to_double(typename F::Bits bits) {
#if defined(__CUDA_ARCH__)
  // Hardware conversions are exact for every finite value of these formats and cost one instruction.
  if constexpr (F::kBytes == 1) {
    return abs_to_double<F>(bits);  // float8: a few integer operations, exact (no conversion for all four formats)
  } else if constexpr (F::kDType == kBFloat16) {
    return static_cast<double>(__uint_as_float(static_cast<uint32_t>(bits) << 16));
  } else if constexpr (F::kDType == kFloat16) {
    return static_cast<double>(__half2float(__ushort_as_half(bits)));
  } else if constexpr (F::kDType == kFloat32) {
    return static_cast<double>(__uint_as_float(bits));
  } else {
    return __longlong_as_double(static_cast<long long>(bits));
  }
#else
  return abs_to_double<F>(bits);
#endif
}

// 16 bytes as four 32-bit words: what one 128-bit load fills, kept in registers (an array of elements indexed
// through memcpy would live in local memory).
struct Vector {
  uint32_t w[4];
};

NANSCAN_HD Vector load_vector(const void* p) {
  Vector v;
#if defined(__CUDA_ARCH__)
  const uint4 raw = __ldcs(static_cast<const uint4*>(p));  // read once: stream past L1/L2
  v.w[0] = raw.x;
  v.w[1] = raw.y;
  v.w[2] = raw.z;
  v.w[3] = raw.w;
#else
  memcpy(v.w, p, kVectorBytes);
#endif
  return v;
}

// One thread's partial statistics. 16-bit formats keep their abs bits in 32-bit registers (no 16-bit registers
// on the GPU). absmin is tracked as min(|x| - 1): a zero becomes kNone, larger than any |x| - 1 of a finite value,
// so it can never win, and no zero test is needed per element.
template <typename F>
struct LaneScan {
  using Bits = typename F::Bits;
  using Wide = typename std::conditional<sizeof(Bits) == 8, uint64_t, uint32_t>::type;
  static constexpr int kPerVector = kVectorBytes / static_cast<int>(sizeof(Bits));
  static constexpr Wide kNone = sizeof(Bits) == 2 ? Wide(0xFFFF) : ~Wide(0);  // what a zero's |x| - 1 wraps to
  // Smallest abs pattern of an inf or NaN (float8 formats: NOTE: [float8 specials] in classify.h).
  static constexpr Wide kInfAbs = static_cast<Wide>(F::kInfAbsBitsWide);
  static constexpr Wide kMinNormalAbs = Wide(1) << F::kMantBits;

  uint32_t nan = 0, posinf = 0, neginf = 0, zero = 0, subnormal = 0;
  Wide absmax = 0;
  Wide absmin_minus_one = kNone;
  double sumsq = 0.0;
  uint64_t fingerprint = 0;  // this thread's terms (NOTE: [scan fingerprint])

  // The fingerprint terms of one element, or of a whole vector whose first element is element `first` of the tensor.
  NANSCAN_HD void add_fingerprint(Bits bits, int64_t index) { fingerprint += fingerprint_term(bits, index); }
  NANSCAN_HD void add_fingerprint(const Vector& v, int64_t first) {
    uint64_t s0 = 0, s1 = 0;
#pragma unroll
    for (int j = 0; j < kPerVector; ++j) {
      const uint64_t x = fingerprint_mix(element(v, j));
      s0 += x;
      s1 += static_cast<uint64_t>(j) * x;
    }
    fingerprint += fingerprint_run(s0, s1, first);
  }

  // Any element: classify.h decides. Head and tail elements and vectors that hold special values come here.
  template <typename Hist>
  NANSCAN_HD void add_element(Bits bits, Hist& hist) {
    switch (classify<F>(bits)) {
      case kNaN: ++nan; return;
      case kPosInf: ++posinf; return;
      case kNegInf: ++neginf; return;
      case kZero: ++zero; return;
      case kSubnormal:
        ++subnormal;
        hist.add_bin(bin_of_subnormal<F>(bits));
        break;
      case kNormal:
        hist.add_slot(normal_slot(abs_bits<F>(bits)));
        break;
    }
    const Wide a = abs_bits<F>(bits);
    absmax = a > absmax ? a : absmax;
    absmin_minus_one = a - 1 < absmin_minus_one ? a - 1 : absmin_minus_one;
    const double v = to_double<F>(bits);
    sumsq += v * v;
  }

  // Element j of a 16-byte vector held as four little-endian 32-bit words.
  NANSCAN_HD static Bits element(const Vector& v, int j) {
    if constexpr (sizeof(Bits) == 1) {
      return static_cast<Bits>(v.w[j / 4] >> (8 * (j % 4)));
    } else if constexpr (sizeof(Bits) == 2) {
      return static_cast<Bits>(v.w[j / 2] >> (16 * (j % 2)));
    } else if constexpr (sizeof(Bits) == 4) {
      return static_cast<Bits>(v.w[j]);
    } else {
      return static_cast<Bits>(v.w[2 * j]) | (static_cast<Bits>(v.w[2 * j + 1]) << 32);
    }
  }

  // A whole 16-byte vector (NOTE: [cuda scan], 3).
  template <typename Hist>
  NANSCAN_HD void add_vector(const Vector& v, Hist& hist) {
    Wide a[kPerVector];
    Wide vmax, vmin_minus_one;
    if constexpr (sizeof(Bits) == 2) {
      // Two elements per word, handled as 16x2 lanes: |x| = word & 0x7FFF per half; adding 0x7FFF to a half
      // (never carrying out of it) then flipping its top bit gives |x| - 1, or 0xFFFF (kNone) for a zero.
      uint32_t abs2[4], minus_one2[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        abs2[k] = v.w[k] & 0x7FFF7FFFu;
        minus_one2[k] = (abs2[k] + 0x7FFF7FFFu) ^ 0x80008000u;
        a[2 * k] = abs2[k] & 0xFFFFu;
        a[2 * k + 1] = abs2[k] >> 16;
      }
      // Three-way 16x2 min/max (Hopper DPX instructions; host and older GPUs get an emulation).
      const uint32_t max2 = __vimax3_u16x2(__vimax3_u16x2(abs2[0], abs2[1], abs2[2]), abs2[3], abs2[3]);
      const uint32_t min2 =
          __vimin3_u16x2(__vimin3_u16x2(minus_one2[0], minus_one2[1], minus_one2[2]), minus_one2[3], minus_one2[3]);
      vmax = (max2 & 0xFFFFu) > (max2 >> 16) ? (max2 & 0xFFFFu) : (max2 >> 16);
      vmin_minus_one = (min2 & 0xFFFFu) < (min2 >> 16) ? (min2 & 0xFFFFu) : (min2 >> 16);
    } else {
      vmax = 0;
      vmin_minus_one = kNone;
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) {
        a[j] = abs_bits<F>(element(v, j));
        vmax = a[j] > vmax ? a[j] : vmax;
        vmin_minus_one = a[j] - 1 < vmin_minus_one ? a[j] - 1 : vmin_minus_one;
      }
    }
    // An fnuz NaN is the sign bit alone, whose abs pattern is a zero's (NOTE: [float8 specials]): look for it in
    // the raw bits. A byte equal to 0x80 is a zero byte of w ^ 0x80808080, found with the usual carry test.
    bool sign_alone = false;
    if constexpr (F::kNaNIsSignAlone) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t x = v.w[k] ^ 0x80808080u;
        sign_alone |= ((x - 0x01010101u) & ~x & 0x80808080u) != 0;
      }
    }
    if (sign_alone || vmax >= kInfAbs || vmin_minus_one < kMinNormalAbs - 1) {
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) add_element(element(v, j), hist);
      return;
    }
    absmax = vmax > absmax ? vmax : absmax;
    absmin_minus_one = vmin_minus_one < absmin_minus_one ? vmin_minus_one : absmin_minus_one;
#pragma unroll
    for (int j = 0; j < kPerVector; ++j) {
      if constexpr (SlotPolicy<F>::kByField) {
        hist.add_slot(static_cast<int>(a[j] >> F::kMantBits));  // a zero counts in slot 0
      } else if (a[j] == 0) {
        ++zero;
      } else {
        hist.add_slot(normal_slot(a[j]));
      }
      const double x = to_double<F>(element(v, j));
      sumsq += x * x;
    }
  }

  // The table slot of a normal value; slots grow with |x|, so the slots of a piece's absmin and absmax bound every
  // slot its elements touched (NOTE: [cuda scan], 5).
  NANSCAN_HD static int normal_slot(Wide a) {
    const int field = static_cast<int>(a >> F::kMantBits);
    return SlotPolicy<F>::kByField ? field : bin_of_normal_field<F>(field);
  }
};

// The table rows a piece can have touched (NOTE: [cuda scan], 5), from its block-wide abs extremes: row 0 (zeros)
// and rows [*first, *last]. `absmin_minus_one` is kNone-free here: pass has_min = false when no finite non-zero
// value was seen.
template <typename F>
NANSCAN_HD void touched_rows(bool has_min, uint64_t absmin, uint64_t absmax, int* first, int* last) {
  using Wide = typename LaneScan<F>::Wide;
  *first = has_min ? LaneScan<F>::normal_slot(static_cast<Wide>(absmin)) : 0;
  *last = LaneScan<F>::normal_slot(static_cast<Wide>(absmax));
  if (*first < 1) *first = 1;  // row 0 is always flushed on its own
}

// Thread `tid` of kThreads scans its share of [begin, end) of `data` (NOTE: [cuda scan], 2): head element
// begin + tid, vectors tid, tid + kThreads, ..., tail element body_end + tid.
template <typename F, typename Hist>
NANSCAN_HD void scan_range(const typename F::Bits* data, int64_t begin, int64_t end, int tid, LaneScan<F>& lane,
                           Hist& hist) {
  using Bits = typename F::Bits;
  constexpr int kPerVector = LaneScan<F>::kPerVector;
  const VectorSplit split = split_for_vectors(reinterpret_cast<uint64_t>(data), begin, end, sizeof(Bits));
  if (begin + tid < split.head_end) {
    lane.add_element(data[begin + tid], hist);
    lane.add_fingerprint(data[begin + tid], begin + tid);
  }
  const Bits* body = data + split.head_end;
  const int64_t num_vectors = (split.body_end - split.head_end) / kPerVector;
  int64_t v = tid;
  for (; v + (kUnroll - 1) * kThreads < num_vectors; v += kUnroll * kThreads) {
    Vector x[kUnroll];  // all loads first, so kUnroll of them are in flight together
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x[u] = load_vector(body + (v + u * kThreads) * kPerVector);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      lane.add_vector(x[u], hist);
      lane.add_fingerprint(x[u], split.head_end + (v + u * kThreads) * kPerVector);
    }
  }
  for (; v < num_vectors; v += kThreads) {
    const Vector x = load_vector(body + v * kPerVector);
    lane.add_vector(x, hist);
    lane.add_fingerprint(x, split.head_end + v * kPerVector);
  }
  if (split.body_end + tid < end) {
    lane.add_element(data[split.body_end + tid], hist);
    lane.add_fingerprint(data[split.body_end + tid], split.body_end + tid);
  }
}

}  // namespace cuda
}  // namespace nanscan
