// scan_cpu.cpp: the multi-tensor scan on the CPU: OpenMP over chunks of all tensors, one vectorised pass per 4 KiB
// block, and classify.h's exact per-element path for blocks that hold an inf or NaN; float8 chunks are looked up in
// byte tables 64 elements at a time with AVX-512 (NOTE: [byte vectors]), 32 at a time with AVX2 (NOTE: [byte vectors
// on AVX2]), else counted per bit pattern (NOTE: [byte formats]).
#include "scan_cpu.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "nanscan/classify.h"
#include "nanscan/stats_record.h"
#include "simd.h"

#if defined(__F16C__) && !NANSCAN_AVX512
#include <immintrin.h>  // F16C conversions (NOTE: [float16 widened])
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace nanscan {
namespace {

// NOTE: [chunking]
// Every tensor is cut into chunks of at most chunk_elems elements; the chunks of all tensors form one work list so that
// one large tensor and many small ones load the threads evenly. A tensor that fits one chunk (most tensors of a model:
// biases, norms, optimizer step counters) is scanned straight into its record, set to the identity just before (NOTE:
// [record writes]). The chunks of a larger tensor are added, by each thread, into one partial record per tensor it
// takes chunks of, and each chunk's sum of squares is kept apart. After the scan the partial records are merged into
// the tensor's record (counts and extremes are exact, so in any order), and the chunks' sums of squares are added in
// chunk order, so even the float64 sum of squares is the same on every run and for every thread count. Inside a
// chunk the work is cut into blocks at fixed offsets from the chunk start (never from the memory address), so the
// summation order depends on the chunk size alone. A partial record per chunk, as before, cost ~0.2 us per chunk
// (2 KiB to set and to merge), and for the bench's float8 sets (7,800 chunks of 64 KiB) 16 MB of fresh pages per
// scan, merged one after the other on one thread: with one per thread and tensor those sets went from 0.74-0.75 to
// 0.79-0.82 of the read probe (2-core development machine, interleaved runs), and one 256 MiB e4m3fn tensor at 2
// threads from 0.83-0.88 to 0.94-0.99.
struct Chunk {
  int64_t task;
  int64_t begin;
  int64_t end;
  int64_t partial;  // index of the chunk's partial record, or kOwnRecord for a task that is one chunk
};
constexpr int64_t kOwnRecord = -1;

// Per-chunk field counters are uint32 (NOTE: [field histogram]); a chunk never holds more elements than they count.
constexpr int64_t kMaxChunkElems = int64_t(1) << 30;

// A chunk's largest and smallest finite non-zero abs bit patterns into `record` (UINT64_MAX: it had none). Taken as
// a maximum and a minimum, not written over, since a thread scans consecutive chunks of a tensor into one record
// (NOTE: [chunking]).
inline void merge_extremes(int64_t* record, uint64_t absmax, uint64_t absmin) {
  record[record::kAbsMaxBits] = std::max(record[record::kAbsMaxBits], static_cast<int64_t>(absmax));
  if (absmin != UINT64_MAX)
    record[record::kAbsMinBits] = std::min(record[record::kAbsMinBits], static_cast<int64_t>(absmin));
}

// NOTE: [blocks]
// A histogram on the CPU costs a dependent load-increment-store per element, which is slower than memory. So a chunk
// is read in kBlockBytes blocks, and each block in one vectorised pass (scan_block_fast) that finds the largest abs
// bit pattern, the smallest non-zero one, whether there is a zero, the sum of squares, and counts the exponent
// fields mod 16 in registers (NOTE: [window counters]). Abs bit patterns order like the values they encode, so the
// two extremes alone say whether the block holds an inf or NaN and which fields its normal values span. Then:
//  - inf or NaN: scan_block_exact re-reads the block, deciding each element with classify().
//  - fields inside the chunk's window (NOTE: [chunk window]): the counters are kept. This is the common case. So
//    are they when no field lies above the window and a few values below it (NOTE: [low tally]).
//  - otherwise a second pass counts the fields on the block, now hot in L1: count_fields_window when they span at
//    most 2 * kWindowFields fields, count_fields_scalar beyond.
// Zeros and subnormals (field 0) take a further look at the block only when pass 1 saw some: zeros_and_min counts
// zeros and finds the smallest non-zero |x|, bin_subnormals bins subnormals one by one (they are few) and finds the
// smallest normal |x|. Chunks too short for this to pay take scan_small instead (NOTE: [small chunks]).
constexpr int64_t kBlockBytes = 4096;
// NOTE: [prefetch]
// Pass 1 asks for the bytes kPrefetchBytes ahead as it reads, into L2. Without it the hardware prefetcher fell
// behind whenever the core was busy counting, and the scan's memory traffic and arithmetic took turns instead of
// overlapping (2-core development machine, 2 threads, 200 MB of float32: 0.45 of the read limit without, 0.75
// with; distances from 2 to 16 KiB and prefetching into L1 instead measured alike). A prefetch never faults, so
// asking past the end of a tensor is harmless.
// Each tensor is a separate allocation, so the start of the next chunk is rarely where the hardware prefetcher
// looks: before a chunk is scanned, the first kChunkPrefetchBytes of each of the next kChunksAhead are asked for.
// It matters for the many small tensors of a model (biases, norms), each of which would otherwise wait for its
// few cache lines: 100 tensors of 1-256 float32 with the caches cleared before each scan, one thread, 45 -> 34 us
// (with data in cache, unchanged at 18 us). Asking for the next chunk alone, or for one two ahead alone, left
// most of the wait.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int kChunksAhead = 2;
constexpr int64_t kChunkPrefetchBytes = 1024;

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

// NOTE: [float mode]
// The fast path squares subnormals with floating-point instructions, which a flush-to-zero mode (x86 MXCSR DAZ and
// FTZ, set e.g. by torch.set_flush_denormal(True)) would turn into zeros, and only on the threads that have it set:
// results would then depend on which thread took which chunk. Each scanning thread runs with both flags clear and
// restores its own mode after. (Other architectures keep their mode: there, only a sum of squares that subnormals
// alone make up can change.)
class ExactFloatMode {
 public:
  ExactFloatMode() {
#if defined(__SSE__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(kDenormalsAreZero | kFlushToZero));
#endif
  }
  ~ExactFloatMode() {
#if defined(__SSE__)
    _mm_setcsr(saved_);
#endif
  }
  ExactFloatMode(const ExactFloatMode&) = delete;
  ExactFloatMode& operator=(const ExactFloatMode&) = delete;

 private:
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  static constexpr unsigned kFlushToZero = 0x8000;
  unsigned saved_ = 0;
};


// NOTE: [window counters]
// Sixteen 4-bit counters packed in a 64-bit word count the elements of a window of 16 consecutive exponent fields
// without touching memory: an element adds 1 << 4 * (field mod 16), which is a shift (with AVX-512, a lookup in a
// 16-entry table indexed by the field's low bits; float32 in 32-bit lanes, NOTE: [float32 lanes]) and an add for a
// whole vector of elements. Within one window the residue mod 16 names the field. Before a 4-bit counter can
// overflow, the words are split into bytes (ByteCounts), once per block the bytes are widened to 16-bit slots
// (WideCounts), and when the window closes the slots are added to the field counters. Zeros (field 0) land on
// residue 0 with the zero padding of a short tail: both are counted on the side and taken back out of the window's
// field that is 0 mod 16.
constexpr int kWindowFields = 16;
// Vectors per step, each with its own counters (independent dependency chains): a step is 128 bytes on any target,
// so the counter limits below hold for every vector width.
constexpr int kChains = 128 / kVectorBytes;
constexpr uint64_t kNibbles = 0x0f0f0f0f0f0f0f0full;
constexpr uint64_t kByteSlots = 0x00ff00ff00ff00ffull;

template <typename F>
struct Words {
  static constexpr int kPerWord = 8 / sizeof(typename F::Bits);  // elements per 64-bit word
  static constexpr int kFlushEvery = 15 / kPerWord;               // steps before a 4-bit counter could overflow
  static constexpr int64_t kStepElems = int64_t(kChains) * kVectorBytes / sizeof(typename F::Bits);
  // Each word lane of a step sees at most this many elements of a block: it must fit a byte.
  static constexpr int64_t kPerLanePerBlock = kBlockBytes / kVectorBytes / kChains * kPerWord;
  static_assert(kPerLanePerBlock <= 255, "byte counters would overflow within a block");
  static constexpr int shift(int j) { return j * 8 * static_cast<int>(sizeof(typename F::Bits)) + F::kMantBits; }
};

#if NANSCAN_AVX512
// The increments 1 << 4 * r of the 16 counters, as the two table halves that permutex2var looks up. It reads the
// low 4 bits of each index word and ignores the rest, so a word shifted to put a field at bit 0 is an index.
struct ResidueTable {
  __m512i lo = _mm512_set_epi64(1ll << 28, 1ll << 24, 1ll << 20, 1ll << 16, 1ll << 12, 1ll << 8, 1ll << 4, 1);
  __m512i hi = _mm512_set_epi64(1ll << 60, 1ll << 56, 1ll << 52, 1ll << 48, 1ll << 44, 1ll << 40, 1ll << 36,
                                1ll << 32);
  __m512i lookup(__m512i index) const { return _mm512_permutex2var_epi64(lo, index, hi); }
};
#endif

// Per word of w: the sum over its elements of 1 << 4 * (field mod 16).
template <typename F>
inline VU64 residue_increments(VU64 w) {
  using W = Words<F>;
#if NANSCAN_AVX512
  const ResidueTable table;
  const __m512i bits = bits_as<__m512i>(w);
  __m512i sum = table.lookup(_mm512_srli_epi64(bits, W::shift(0)));
  for (int j = 1; j < W::kPerWord; ++j) sum = _mm512_add_epi64(sum, table.lookup(_mm512_srli_epi64(bits, W::shift(j))));
  return bits_as<VU64>(sum);
#else
  // The field sits at bit 2 of (word >> (shift - 2)): masking bits 2..5 gives 4 * (field mod 16).
  const VU64 one = VU64{} + 1;
  VU64 sum = one << ((w >> (W::shift(0) - 2)) & 0x3c);
  for (int j = 1; j < W::kPerWord; ++j) sum += one << ((w >> (W::shift(j) - 2)) & 0x3c);
  return sum;
#endif
}

// Like residue_increments for the 32 fields from `lo`: fields lo..lo+15 count in `low` (slot field - lo), the
// others in `high` (slot field - lo - 16). Zeros land on slot (0 - lo) mod 32.
template <typename F>
inline void window32_increments(VU64 w, int lo, VU64& low, VU64& high) {
  using W = Words<F>;
#if NANSCAN_AVX512
  const ResidueTable table;
  const __m512i bits = bits_as<__m512i>(w);
  __m512i l = bits_as<__m512i>(low), h = bits_as<__m512i>(high);
  for (int j = 0; j < W::kPerWord; ++j) {
    const __m512i offset = _mm512_sub_epi64(_mm512_srli_epi64(bits, W::shift(j)), _mm512_set1_epi64(lo));
    const __m512i add = table.lookup(offset);
    const __mmask8 upper = _mm512_test_epi64_mask(offset, _mm512_set1_epi64(16));
    l = _mm512_mask_add_epi64(l, static_cast<__mmask8>(~upper), l, add);
    h = _mm512_mask_add_epi64(h, upper, h, add);
  }
  low = bits_as<VU64>(l);
  high = bits_as<VU64>(h);
#elif defined(__AVX2__)
  // vpsllvq gives 0 for a count of 64 or more, which picks the half with no select: with s = 4 * slot, the low
  // half takes 1 << s (0 for slots 16..31) and the high half 1 << (s - 64) (0 for slots 0..15, whose count wraps
  // past 64). Eight instructions an element against the portable code's twelve, and fewer live registers: chunks
  // of Adam's exp_avg_sq (squares span about 24 fields a block, so nearly every block takes this pass) went from
  // 0.74 to 0.65 ns an element (Zen 3, one thread, hot in L2, both builds in one harness).
  const __m256i one = _mm256_set1_epi64x(1);
  const __m256i bits = bits_as<__m256i>(w);
  const __m256i lo4 = _mm256_set1_epi64x(static_cast<int64_t>(lo) * 4);
  const __m256i mask = _mm256_set1_epi64x(0x7c);
  const __m256i sixty_four = _mm256_set1_epi64x(64);
  __m256i l = bits_as<__m256i>(low), h = bits_as<__m256i>(high);
  for (int j = 0; j < W::kPerWord; ++j) {
    const __m256i s = _mm256_and_si256(_mm256_sub_epi64(_mm256_srli_epi64(bits, W::shift(j) - 2), lo4), mask);
    l = _mm256_add_epi64(l, _mm256_sllv_epi64(one, s));
    h = _mm256_add_epi64(h, _mm256_sllv_epi64(one, _mm256_sub_epi64(s, sixty_four)));
  }
  low = bits_as<VU64>(l);
  high = bits_as<VU64>(h);
#else
  const VU64 one = VU64{} + 1;
  const uint64_t lo4 = static_cast<uint64_t>(lo) * 4;
  for (int j = 0; j < W::kPerWord; ++j) {
    const VU64 s = ((w >> (W::shift(j) - 2)) - lo4) & 0x7c;  // 4 * ((field - lo) mod 32)
    const VU64 upper = s >> 6;
    const VU64 add = one << (s & 63);
    low += add & (upper - 1);
    high += add & (0 - upper);
  }
#endif
}

// The 16 counters of a window over one block, as bytes: even[c] holds counters 0, 2, .., 14 of chain c, odd[c]
// counters 1, 3, .., 15.
struct ByteCounts {
  VU64 even[kChains];
  VU64 odd[kChains];

  void clear() {
    for (int c = 0; c < kChains; ++c) even[c] = odd[c] = VU64{};
  }
  void add_nibbles(const VU64 (&nibbles)[kChains]) {
    for (int c = 0; c < kChains; ++c) {
      even[c] += nibbles[c] & kNibbles;
      odd[c] += (nibbles[c] >> 4) & kNibbles;
    }
  }
};

// The 16 counters of a window over many blocks, in 16-bit slots: slot s of quad[k][c] holds counter 4 * s + k.
struct WideCounts {
  VU64 quad[4][kChains];

  void clear() {
    for (int k = 0; k < 4; ++k)
      for (int c = 0; c < kChains; ++c) quad[k][c] = VU64{};
  }
  void add(const ByteCounts& b) {
    for (int c = 0; c < kChains; ++c) {
      quad[0][c] += b.even[c] & kByteSlots;
      quad[1][c] += b.odd[c] & kByteSlots;
      quad[2][c] += (b.even[c] >> 8) & kByteSlots;
      quad[3][c] += (b.odd[c] >> 8) & kByteSlots;
    }
  }
  void totals(int64_t (&out)[kWindowFields]) const {
    for (int k = 0; k < 4; ++k) {
      for (int s = 0; s < 4; ++s) {
        int64_t total = 0;
        for (int c = 0; c < kChains; ++c)
          for (int l = 0; l < kWordsPerVector; ++l)
            total += static_cast<int64_t>((quad[k][c][l] >> (16 * s)) & 0xffff);
        out[4 * s + k] = total;
      }
    }
  }
};

// The window counters of pass 1's steps (NOTE: [window counters]): per chain a word of 16 nibbles per 64-bit lane,
// added to the block's ByteCounts every kFlushEvery steps.
template <typename F>
struct StepCounters {
  static constexpr int kFlushEvery = Words<F>::kFlushEvery;
  VU64 nibbles[kChains];

  void clear() {
    for (int c = 0; c < kChains; ++c) nibbles[c] = VU64{};
  }
  template <typename V>
  void add(int c, V raw) {
    nibbles[c] += residue_increments<F>(bits_as<VU64>(raw));
  }
  void flush_into(ByteCounts& b) const { b.add_nibbles(nibbles); }
};

#if NANSCAN_AVX512
// NOTE: [float32 lanes]
// A float32 element is one 32-bit lane, so its field's residue is one 32-bit shift away (vpsrld; permd reads the
// low 4 bits of each index lane), where a 64-bit word of two elements takes two shifts and, after GCC's register
// choice, a copy besides. Each lane counts its own element in two words of 8 nibbles: `low` the residues 0..7 and
// `high` 8..15, looked up in two 16-entry tables of 32-bit increments (vpermd, one uop, its table intact). A lane
// takes one element a step, so its nibbles hold 15 steps; then each pair of lanes is put back together as the two
// 64-bit words of 16 nibbles (residue r in nibble r) that ByteCounts takes, one word per element of the pair.
// Measured (Intel Xeon, AVX-512, one thread, both builds in turn): the demo model's 146 tensors after 60 steps
// (540k elements, float32), scanned hot, 155-158 -> 144-151 us; a hot 256K-element Gaussian float32 tensor 0.212 ->
// 0.207 ns an element, float16 (widened, NOTE: [float16 widened]) 0.241 -> 0.233.
template <>
struct StepCounters<Float32> {
  static constexpr int kFlushEvery = 15;
  __m512i low[kChains];
  __m512i high[kChains];

  void clear() {
    for (int c = 0; c < kChains; ++c) low[c] = high[c] = _mm512_setzero_si512();
  }
  void add(int c, VU32 raw) {
    const __m512i low_table = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1 << 28, 1 << 24, 1 << 20, 1 << 16, 1 << 12,
                                               1 << 8, 1 << 4, 1);
    const __m512i high_table = _mm512_set_epi32(1 << 28, 1 << 24, 1 << 20, 1 << 16, 1 << 12, 1 << 8, 1 << 4, 1, 0, 0,
                                                0, 0, 0, 0, 0, 0);
    const __m512i index = _mm512_srli_epi32(bits_as<__m512i>(raw), Float32::kMantBits);
    low[c] = _mm512_add_epi32(low[c], _mm512_permutexvar_epi32(index, low_table));
    high[c] = _mm512_add_epi32(high[c], _mm512_permutexvar_epi32(index, high_table));
  }
  void flush_into(ByteCounts& b) const {
    VU64 first[kChains], second[kChains];  // the even lanes' elements, the odd lanes'
    for (int c = 0; c < kChains; ++c) {
      first[c] = bits_as<VU64>(_mm512_mask_blend_epi32(0xaaaa, low[c], _mm512_slli_epi64(high[c], 32)));
      second[c] = bits_as<VU64>(_mm512_mask_blend_epi32(0xaaaa, _mm512_srli_epi64(low[c], 32), high[c]));
    }
    b.add_nibbles(first);
    b.add_nibbles(second);
  }
};
#endif

// NOTE: [fingerprint lanes]
// A run's part of the fingerprint (NOTE: [scan fingerprint] in stats_record.h) needs S0 = sum of mix(u_k) and
// S1 = sum of k * mix(u_k) over its elements. Per vector lane, two running sums, A += x and B += A, hold after V
// vectors A = sum of x_v and B = sum of (V - v) x_v, so sum of v x_v = V A - B: two adds a vector and no multiply.
// A chunk's blocks follow each other, so the lanes run on from block to block; every kFingerprintGroup vectors (and
// at the chunk's end) their sums, each lane's elements placed by its offset in the vector, give the group's S0 and
// S1, which the group's first index places in the tensor (fingerprint_run).
//  - float64: x = mix(u) in 64-bit lanes.
//  - narrower elements stay in 32-bit lanes, twice as many a vector, summed in 16-bit pieces (8-bit for float8): with
//    d a lane's 32 bits, the sums of d and of d >> 16 (also of d >> 8 and d >> 24 for bytes) wrap mod 2^32, yet
//    each piece's sum is their difference (the sum of d less 2^16 times that of d >> 16, and so on), exact while it
//    is below 2^32: for V <= kFingerprintGroup vectors, V (V + 1) / 2 * 65535 < 2^32. The pieces are an element's
//    halves (float32), or its elements (16-bit formats, bytes).
//  - float8 with AVX-512's byte instructions (NOTE: [byte vectors]): vpsadbw sums each 8 bytes into a 64-bit lane
//    (the A and B above), and a byte dot product (vpdpbusd) with the weights 0..7 sums each byte times its offset in
//    its 8: four instructions a vector, against eleven for four 8-bit pieces.
// Where pass 1 reads the bits the fingerprint sums (every format but widened float16), it steps the lanes itself;
// AVX-512's float8 blocks step lanes of their own, appended to the chunk's once the block is left (a block read
// again under a new window starts them over); the others read the block again, hot in L1. Measured (2-core AMD
// EPYC, Zen 4, AVX-512, one thread, 512 KiB hot in L2, min of 200-300 scans, both builds in turn), ps per element
// before -> after: float32 219 -> 264, bfloat16 206 -> 229, float16 236 -> 258, float64 277 -> 343 (N(0, 0.02)
// values); the bench's float8 sets e4m3fn 78 -> 91, e5m2 80 -> 89 (with the block read again: 97 and 105, and
// make bench's float8 cpu/read_limit 0.70 -> 0.58). The lanes' loop alone, hot in L1, is bound by issue: about 0.4 ns
// a 64-byte vector. Ending the group at every block, before the lanes ran on from block to block, had cost a third
// of float8's scan. Tried: two interleaved sets of lanes, a pair of vectors summed before the running sums, one load
// kept in a register for all of pass 1's uses of the raw bits (no gain from any).
constexpr int64_t kFingerprintGroup = 256;

// A thread's lane sums for one format's elements (NOTE: [fingerprint lanes]): step() takes one vector, sums() gives
// S0 and S1 of the `vectors` taken since clear().
template <typename Bits, typename Enable = void>
struct FingerprintSums;

template <>
struct FingerprintSums<uint64_t> {
  static constexpr int64_t kPerVector = kWordsPerVector;
  VU64 a, b;
  void clear() { a = b = VU64{}; }
  void step(const uint64_t* p) { step_value(load_bits<VU64>(p)); }
  void step_value(VU64 u) {
    u ^= u >> 32;
    a += u;
    b += a;
  }
  void sums(uint64_t vectors, uint64_t& s0, uint64_t& s1) const {
    s0 = s1 = 0;
    for (int l = 0; l < kWordsPerVector; ++l) {
      s0 += a[l];
      s1 += kPerVector * (vectors * a[l] - b[l]) + static_cast<uint64_t>(l) * a[l];
    }
  }
};

template <typename Bits>
struct FingerprintSums<Bits, std::enable_if_t<(sizeof(Bits) < 8 && !(sizeof(Bits) == 1 && NANSCAN_AVX512_BYTES))>> {
  static constexpr int64_t kPerVector = kVectorBytes / sizeof(Bits);
  static constexpr int kLanes = kVectorBytes / 4;
  static constexpr int kPieces = sizeof(Bits) == 1 ? 4 : 2;  // 8- or 16-bit pieces of a 32-bit lane
  static constexpr int kPieceBits = 32 / kPieces;
  VU32 a[kPieces], b[kPieces];
  void clear() {
    for (int k = 0; k < kPieces; ++k) a[k] = b[k] = VU32{};
  }
  void step(const Bits* p) { step_value(load_bits<VU32>(p)); }
  template <typename V>
  void step_value(V raw) {
    const VU32 d = bits_as<VU32>(raw);
#pragma GCC unroll 4
    for (int k = 0; k < kPieces; ++k) {
      a[k] += d >> (kPieceBits * k);
      b[k] += a[k];
    }
  }
  void sums(uint64_t vectors, uint64_t& s0, uint64_t& s1) const {
    s0 = s1 = 0;
    for (int l = 0; l < kLanes; ++l) {
      uint64_t x[kPieces], xb[kPieces];  // piece k's sum over the vectors, and its sum weighted by V - v
      for (int k = 0; k < kPieces; ++k) {
        const uint32_t above_a = k + 1 < kPieces ? a[k + 1][l] << kPieceBits : 0;
        const uint32_t above_b = k + 1 < kPieces ? b[k + 1][l] << kPieceBits : 0;
        x[k] = static_cast<uint32_t>(a[k][l] - above_a);
        xb[k] = static_cast<uint32_t>(b[k][l] - above_b);
      }
      if constexpr (sizeof(Bits) == 4) {  // one element of two halves
        const uint64_t sum = x[0] + (x[1] << 16), weighted = xb[0] + (xb[1] << 16);
        s0 += sum;
        s1 += kPerVector * (vectors * sum - weighted) + static_cast<uint64_t>(l) * sum;
      } else {  // kPieces elements, at kPieces * l + k
        for (int k = 0; k < kPieces; ++k) {
          s0 += x[k];
          s1 += kPerVector * (vectors * x[k] - xb[k]) + static_cast<uint64_t>(kPieces * l + k) * x[k];
        }
      }
    }
  }
};

#if NANSCAN_AVX512_BYTES
template <>
struct FingerprintSums<uint8_t> {
  static constexpr int64_t kPerVector = 64;
  __m512i a, b, w;  // per 8 bytes: their sum, its running sum; per 4 bytes: each byte times its offset in its 8
  void clear() { a = b = w = _mm512_setzero_si512(); }
  void step(const uint8_t* p) { step_value(_mm512_loadu_si512(p)); }
  void step_value(__m512i raw) {
    a = _mm512_add_epi64(a, _mm512_sad_epu8(raw, _mm512_setzero_si512()));
    b = _mm512_add_epi64(b, a);
    w = _mm512_dpbusd_epi32(w, raw, _mm512_set1_epi64(0x0706050403020100ll));
  }
  // Appends the sums of `vectors` vectors that followed these (a block summed on its own): their running sums
  // each see all of these, V - v counted from the end of both.
  void append(const FingerprintSums& next, uint64_t vectors) {
    b = _mm512_add_epi64(_mm512_add_epi64(b, next.b), _mm512_mullo_epi64(a, _mm512_set1_epi64(vectors)));
    a = _mm512_add_epi64(a, next.a);
    w = _mm512_add_epi32(w, next.w);
  }
  void sums(uint64_t vectors, uint64_t& s0, uint64_t& s1) const {
    alignas(64) uint64_t av[8], bv[8];
    _mm512_store_si512(av, a);
    _mm512_store_si512(bv, b);
    // Each 32-bit lane of w holds at most kFingerprintGroup * 255 * 22: their sum fits 64 bits whole.
    s0 = 0;
    s1 = static_cast<uint64_t>(_mm512_reduce_add_epi64(_mm512_add_epi64(
        _mm512_cvtepu32_epi64(_mm512_castsi512_si256(w)), _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(w, 1)))));
    for (int l = 0; l < 8; ++l) {
      s0 += av[l];
      s1 += kPerVector * (vectors * av[l] - bv[l]) + 8 * static_cast<uint64_t>(l) * av[l];
    }
  }
};
#endif

// The fingerprint of a chunk's elements of one format, given block by block in element order (NOTE: [fingerprint
// lanes]).
template <typename Bits>
class FingerprintLanes {
 public:
  using Sums = FingerprintSums<Bits>;
  static constexpr int64_t kPerVector = Sums::kPerVector;

  // Elements [first, first + n) of the tensor, read at p.
  void add(const Bits* p, int64_t n, int64_t first) {
    if (vectors_ > 0 && first != group_first_ + vectors_ * kPerVector) close();
    int64_t i = 0;
    while (n - i >= kPerVector) {
      if (vectors_ == 0) {
        group_first_ = first + i;
        lanes_.clear();
      }
      const int64_t take = std::min<int64_t>(kFingerprintGroup - vectors_, (n - i) / kPerVector);
      Sums lanes = lanes_;  // a local copy, kept in registers by the loop
      for (int64_t v = 0; v < take; ++v) lanes.step(p + i + v * kPerVector);
      lanes_ = lanes;
      vectors_ += take;
      i += take * kPerVector;
      if (vectors_ == kFingerprintGroup) close();
    }
    for (; i < n; ++i) total_ += fingerprint_term(p[i], first + i);
  }
  // For a pass that steps the lanes itself, vector by vector: the lanes for `vectors` vectors (at most
  // kFingerprintGroup) from element `first`, which it then reports with took(vectors).
  Sums& lanes_for(int64_t first, int64_t vectors) {
    if (vectors_ > 0 && (first != group_first_ + vectors_ * kPerVector || vectors_ + vectors > kFingerprintGroup))
      close();
    if (vectors_ == 0) {
      group_first_ = first;
      lanes_.clear();
    }
    return lanes_;
  }
  void took(int64_t vectors) {
    vectors_ += vectors;
    if (vectors_ == kFingerprintGroup) close();
  }
  // The sums of a block's `vectors` vectors from element `first`, taken on their own (Sums::append).
  void append(const Sums& block, int64_t vectors, int64_t first) {
    Sums& lanes = lanes_for(first, vectors);
    if (vectors_ == 0) lanes = block;
    else lanes.append(block, static_cast<uint64_t>(vectors));
    took(vectors);
  }
  // The sum of every element added.
  uint64_t total() {
    close();
    return total_;
  }

 private:
  void close() {
    if (vectors_ == 0) return;
    uint64_t s0, s1;
    lanes_.sums(static_cast<uint64_t>(vectors_), s0, s1);
    total_ += fingerprint_run(s0, s1, group_first_);
    vectors_ = 0;
  }
  Sums lanes_;
  int64_t vectors_ = 0;
  int64_t group_first_ = 0;
  uint64_t total_ = 0;
};

// The fingerprint part of elements [first, first + n) of a tensor, read at p (NOTE: [scan fingerprint]).
template <typename Bits>
uint64_t fingerprint_part(const Bits* p, int64_t n, int64_t first) {
  FingerprintLanes<Bits> lanes;
  lanes.add(p, n, first);
  return lanes.total();
}

// What one pass over a block found (NOTE: [blocks]).
template <typename F>
struct BlockScan {
  using Bits = typename F::Bits;
  Bits max_abs;
  Bits min_abs;     // 0 for a block with a zero, or with the zero padding of a short tail: zeros_and_min tells
  int64_t padding;  // zeros appended to a short tail, counted in `residues`
  VF64 sumsq[kChains][VectorOps<F>::kSquareVectors];
  ByteCounts residues;  // fields mod 16 (NOTE: [window counters]); used only if the block fits the chunk's window
};

// The vectors pass 1 reads of a block of n elements, zero padding included.
template <typename F>
constexpr int64_t pass1_vectors(int64_t n) {
  return (n + Words<F>::kStepElems - 1) / Words<F>::kStepElems * kChains;
}
static_assert(kBlockBytes / kVectorBytes <= kFingerprintGroup, "a block's vectors fit one group of fingerprint lanes");

// Pass 1 (NOTE: [blocks]). No lambda or variable index touches the accumulators: either would keep them in memory
// instead of registers. `fingerprint`: lanes that every vector read, zero padding included (zeros add nothing),
// steps (NOTE: [fingerprint lanes]), or null.
template <typename F>
void scan_block_fast(const typename F::Bits* p, int64_t n, BlockScan<F>& s,
                     FingerprintSums<typename F::Bits>* fingerprint) {
  using Bits = typename F::Bits;
  using Ops = VectorOps<F>;
  using V = typename Ops::V;
  using W = Words<F>;
  constexpr int64_t L = sizeof(V) / sizeof(Bits);
  constexpr Bits kAllOnes = static_cast<Bits>(~Bits(0));
  V vmin = ~V{}, vmax = V{};
  VF64 sumsq[kChains][Ops::kSquareVectors] = {};
  s.residues.clear();
  // The block in one or two runs of whole steps: the steps in place, then a short tail copied into a zero-padded
  // step.
  const int64_t full = n / W::kStepElems * W::kStepElems;
  Bits tail[W::kStepElems];
  s.padding = 0;
  if (full < n) {
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, p + full, sizeof(Bits) * (n - full));
    s.padding = W::kStepElems - (n - full);
  }
  const Bits* run_start[2] = {p, tail};
  const int64_t run_steps[2] = {full / W::kStepElems, full < n ? 1 : 0};
  FingerprintSums<Bits> lanes;  // a local copy, kept in registers
  if (fingerprint) lanes = *fingerprint;
  for (int r = 0; r < 2; ++r) {
    const Bits* elems = run_start[r];
    const int64_t steps = run_steps[r];
    for (int64_t step = 0; step < steps;) {
      StepCounters<F> counters;
      counters.clear();
      const int64_t stop = std::min(steps, step + StepCounters<F>::kFlushEvery);
      for (; step < stop; ++step) {
        for (int c = 0; c < kChains; ++c) {
          const Bits* at = elems + (step * kChains + c) * L;
          // Keep the next blocks streaming in while this one is worked on (NOTE: [prefetch]).
          __builtin_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, 0, 2);
          const V raw = load_bits<V>(at);
          const V a = raw & F::kAbsMask;
          vmin = vmin < a ? vmin : a;
          vmax = vmax > a ? vmax : a;
          Ops::add_squares(at, sumsq[c]);
          counters.add(c, raw);
          if (fingerprint) lanes.step_value(raw);
        }
      }
      counters.flush_into(s.residues);
    }
  }
  if (fingerprint) *fingerprint = lanes;
  Bits mn = kAllOnes, mx = 0;
  for (int64_t l = 0; l < L; ++l) {
    mn = std::min<Bits>(mn, vmin[l]);
    mx = std::max<Bits>(mx, vmax[l]);
  }
  s.min_abs = mn;
  s.max_abs = mx;
  for (int c = 0; c < kChains; ++c)
    for (int k = 0; k < Ops::kSquareVectors; ++k) s.sumsq[c][k] = sumsq[c][k];
}

// For a block with zeros, the look pass 1 leaves to it: how many zeros, and the smallest non-zero |x| (all ones if
// none). With b = |x| - 1, zero wraps to all ones, so the minimum of b skips zeros without a branch.
template <typename F>
void zeros_and_min(const typename F::Bits* p, int64_t n, int64_t& zeros, typename F::Bits& min_nonzero_abs) {
  using Bits = typename F::Bits;
  using V = typename VectorOps<F>::V;
  constexpr int64_t L = sizeof(V) / sizeof(Bits);
  constexpr Bits kAllOnes = static_cast<Bits>(~Bits(0));
  static_assert(kBlockBytes / kVectorBytes <= 0xffff, "each lane counts one element per vector of a block");
  V count = V{}, bmin = ~V{};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const V a = load_bits<V>(p + i) & F::kAbsMask;
    count -= bits_as<V>(a == 0);  // true is all ones, i.e. -1
    const V b = a - 1;
    bmin = bmin < b ? bmin : b;
  }
  int64_t total = 0;
  Bits mn = kAllOnes;
  for (int64_t l = 0; l < L; ++l) {
    total += count[l];
    mn = std::min<Bits>(mn, bmin[l]);
  }
  for (; i < n; ++i) {
    const Bits a = abs_bits<F>(p[i]);
    total += a == 0;
    mn = std::min(mn, static_cast<Bits>(a - 1));
  }
  zeros = total;
  min_nonzero_abs = mn == kAllOnes ? mn : static_cast<Bits>(mn + 1);
}

// For a block with subnormals (and no inf or NaN): bins each subnormal, exactly as exponent_bin does, and finds the
// smallest normal |x| (all ones if none), which pass 1 could not tell from the smallest non-zero one.
template <typename F>
int64_t bin_subnormals(const typename F::Bits* p, int64_t n, int64_t* hist, typename F::Bits& min_normal_abs) {
  using Bits = typename F::Bits;
  using V = typename VectorOps<F>::V;
  constexpr int64_t L = sizeof(V) / sizeof(Bits);
  constexpr Bits kSmallestNormal = F::kSmallestNormalAbsBits;
  int64_t count = 0;
  V min_normal = ~V{};
  auto bin_one = [&](Bits a) {
    if (a != 0 && a < kSmallestNormal) {
      ++count;
      hist[bin_of_subnormal<F>(a)]++;
    }
  };
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const V a = load_bits<V>(p + i) & F::kAbsMask;
    // Subnormals have a - 1 below kSmallestNormal - 1; zeros wrap to all ones. One test of the comparison tells
    // whether any lane needs binning.
    if (any_lane(a - 1 < static_cast<Bits>(kSmallestNormal - 1)))
      for (int64_t l = 0; l < L; ++l) bin_one(a[l]);
    const V normal_or_max = a < kSmallestNormal ? ~V{} : a;
    min_normal = min_normal < normal_or_max ? min_normal : normal_or_max;
  }
  Bits mn = static_cast<Bits>(~Bits(0));
  for (int64_t l = 0; l < L; ++l) mn = std::min<Bits>(mn, min_normal[l]);
  for (; i < n; ++i) {
    const Bits a = abs_bits<F>(p[i]);
    bin_one(a);
    if (a >= kSmallestNormal) mn = std::min(mn, a);
  }
  min_normal_abs = mn;
  return count;
}

// NOTE: [low tally]
// Most blocks that miss the chunk's window (NOTE: [chunk window]) miss it only below, by a few elements: a Gaussian
// block's smallest values sit alone in the fields under the rest (in a small model's gradients and Adam's exp_avg,
// a quarter of the blocks, each with one to four such elements). Such a block keeps its pass-1 counters: each
// element below the window was counted on the residue of its field mod 16, which the window reads as a field of its
// own, so the window takes it back out of that residue when it closes (ChunkWindow::taken) and the element is
// counted on its own field. One more look at the block, hot in L1, finds them; a block with more than kMaxTally is
// counted again by pass 2 instead. Counts are integers, so the record is the one pass 2 gives. Measured (Zen 3, one
// thread, both builds in one harness): float32 chunks shaped like an early exp_avg_sq (squares of Gaussian values,
// 24 fields a block) 0.64 -> 0.55 ns an element; Gaussian chunks, whose misses are fewer, and the demo model's
// tensors after 200 steps, hot, within the noise (0.172-0.178 -> 0.169-0.177 ms).
constexpr int kMaxTally = 32;

// The offsets of the normal values of a block below field `first` (at most kMaxTally), or -1 when there are more.
template <typename F>
int below_window(const typename F::Bits* p, int64_t n, int first, int32_t (&found)[kMaxTally]) {
  using Bits = typename F::Bits;
  using V = typename VectorOps<F>::V;
  constexpr int64_t L = sizeof(V) / sizeof(Bits);
  constexpr Bits kSmallestNormal = F::kSmallestNormalAbsBits;
  // |x| - smallest normal wraps for zeros and subnormals, so one unsigned compare finds [smallest normal, base).
  const Bits span = static_cast<Bits>((static_cast<Bits>(first) << F::kMantBits) - kSmallestNormal);
  int count = 0;
  auto look = [&](int64_t i) {
    if (static_cast<Bits>(abs_bits<F>(p[i]) - kSmallestNormal) >= span) return true;
    if (count == kMaxTally) return false;
    found[count++] = static_cast<int32_t>(i);
    return true;
  };
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const V a = load_bits<V>(p + i) & F::kAbsMask;
    if (any_lane(a - kSmallestNormal < span))
      for (int64_t l = 0; l < L; ++l)
        if (!look(i + l)) return -1;
  }
  for (; i < n; ++i)
    if (!look(i)) return -1;
  return count;
}

// Adds the counts of a window of 16 fields from `first` (counter r counts the field that is r mod 16) to `counts`,
// less `field0` elements that landed on residue 0 without being values of that field (zeros, subnormals, padding).
template <typename F>
void add_window(const int64_t (&window)[kWindowFields], int first, int64_t field0, FieldCounts& counts) {
  // Fields past the format's last finite one hold nothing but, possibly, the zeros being taken out.
  const int last = std::min(first + kWindowFields - 1, F::kExpMax - 1);
  for (int f = first; f <= last; ++f) {
    const int64_t n = window[f % kWindowFields] - (f % kWindowFields == 0 ? field0 : 0);
    counts.table[0][f] += static_cast<uint32_t>(n);
  }
  counts.touch(first, last);
}

// Pass 2 for a block whose normal fields lie in [lo, lo + kWindows * 16) but outside the chunk's window: the same
// counters, on the block, hot in L1 (NOTE: [blocks]). `field0` elements are zeros or subnormals.
template <typename F, int kWindows>
void count_fields_window(const typename F::Bits* p, int64_t n, int lo, int64_t field0, FieldCounts& counts) {
  using Bits = typename F::Bits;
  using W = Words<F>;
  static_assert(kWindows == 1 || kWindows == 2, "one or two windows of 16 fields");
  ByteCounts bytes[kWindows];
  for (auto& b : bytes) b.clear();
  const int64_t full = n / W::kStepElems * W::kStepElems;
  Bits tail[W::kStepElems];
  int64_t padding = 0;
  if (full < n) {
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, p + full, sizeof(Bits) * (n - full));
    padding = W::kStepElems - (n - full);
  }
  const Bits* run_start[2] = {p, tail};
  const int64_t run_steps[2] = {full / W::kStepElems, full < n ? 1 : 0};
  for (int r = 0; r < 2; ++r) {
    const Bits* elems = run_start[r];
    const int64_t steps = run_steps[r];
    for (int64_t step = 0; step < steps;) {
      VU64 nibbles[kWindows][kChains] = {};
      const int64_t stop = std::min(steps, step + W::kFlushEvery);
      for (; step < stop; ++step) {
        for (int c = 0; c < kChains; ++c) {
          const VU64 w = load_bits<VU64>(elems + (step * kChains + c) * (kVectorBytes / sizeof(Bits)));
          if (kWindows == 1) nibbles[0][c] += residue_increments<F>(w);
          else window32_increments<F>(w, lo, nibbles[0][c], nibbles[kWindows - 1][c]);
        }
      }
      for (int h = 0; h < kWindows; ++h) bytes[h].add_nibbles(nibbles[h]);
    }
  }
  int64_t window[kWindows][kWindowFields];
  for (int h = 0; h < kWindows; ++h) {
    WideCounts wide;
    wide.clear();
    wide.add(bytes[h]);
    wide.totals(window[h]);
  }
  if (kWindows == 1) {
    add_window<F>(window[0], lo, field0 + padding, counts);
    return;
  }
  const int zero_slot = (2 * kWindowFields - lo % (2 * kWindowFields)) % (2 * kWindowFields);
  window[zero_slot / kWindowFields][zero_slot % kWindowFields] -= field0 + padding;
  const int last = std::min(lo + 2 * kWindowFields - 1, F::kExpMax - 1);
  for (int f = lo; f <= last; ++f)
    counts.table[0][f] += static_cast<uint32_t>(window[(f - lo) / kWindowFields][(f - lo) % kWindowFields]);
  counts.touch(lo, last);
}

// Pass 2 for a block whose normal values span many fields: one load-increment-store per element, spread over
// kFieldTables tables. Zeros and subnormals count into field 0, which the fold ignores.
template <typename F>
void count_fields_scalar(const typename F::Bits* p, int64_t n, int lo, int hi, bool has_field0, FieldCounts& counts) {
  int64_t i = 0;
  for (; i + kFieldTables <= n; i += kFieldTables)
    for (int t = 0; t < kFieldTables; ++t) counts.table[t][exponent_field<F>(p[i + t])]++;
  for (; i < n; ++i) counts.table[0][exponent_field<F>(p[i])]++;
  counts.touch(has_field0 ? 0 : lo, hi);
}

// NOTE: [chunk window]
// Pass 1 counts every block into one window of 16 fields per chunk, chosen from the chunk's first block with
// normal values: from its largest field less 14 (room for the largest value to double; a block of Gaussian
// values spans about 12 fields, mostly below its maximum). A block whose fields fit the window adds its counters,
// and so does one without normal values; any other is counted again by pass 2, while its counters are dropped.
// The first block's own counters are kept when it fits the window it opened, so a chunk of a few blocks (most
// weight matrices of a small model) is read once, not its first block twice.
// Two such blocks in a row move the window to the latest one. The window's 16-bit counters are added to the field
// counters when it moves, when the chunk ends, and before they could overflow.

// Blocks whose byte counters (at most 255 per slot, Words::kPerLanePerBlock) a 16-bit slot can hold.
constexpr int kMaxWindowBlocks = 0xffff / 255;

struct ChunkWindow {
  bool open = false;
  int first = 0;
  int misfits = 0;
  int blocks = 0;
  int64_t field0 = 0;                // zeros, subnormals and padding counted on residue 0
  int64_t taken[kWindowFields] = {};  // by residue: values below the window, counted on their own fields
  WideCounts wide;

  // Opens the window so that a block whose largest field is `hi` fits it with one field to spare above.
  void open_below(int hi) { open_from(std::max(1, hi - (kWindowFields - 2))); }
  void open_from(int first_field) {
    open = true;
    first = first_field;
    misfits = 0;
    blocks = 0;
    field0 = 0;
    std::memset(taken, 0, sizeof(taken));
    wide.clear();
  }
  template <typename F>
  void close(FieldCounts& counts) {
    if (!open) return;
    int64_t window[kWindowFields];
    wide.totals(window);
    for (int r = 0; r < kWindowFields; ++r) window[r] -= taken[r];
    add_window<F>(window, first, field0, counts);
    open = false;
  }
  // NOTE: [low tally]: counts the normal values of the block at `p` that lie below the window (the lowest in field
  // `lo`, below `first`) on their own fields, to be taken back out of the window's residues; false (nothing
  // counted) when there are more than kMaxTally.
  template <typename F>
  bool tally_below(const typename F::Bits* p, int64_t n, int lo, FieldCounts& counts) {
    int32_t found[kMaxTally];
    const int k = below_window<F>(p, n, first, found);
    if (k < 0) return false;
    for (int j = 0; j < k; ++j) {
      const int field = exponent_field<F>(p[found[j]]);
      counts.table[j % kFieldTables][field]++;
      taken[field % kWindowFields]++;
    }
    counts.touch(lo, first - 1);
    return true;
  }
  // Keeps the counters of a block that fits; `uncounted` of them (on residue 0) are no normal values.
  template <typename F>
  void add(const ByteCounts& residues, int64_t uncounted, FieldCounts& counts) {
    wide.add(residues);
    field0 += uncounted;
    misfits = 0;
    if (++blocks == kMaxWindowBlocks) {
      const int keep = first;
      close<F>(counts);
      open_from(keep);
    }
  }
};

// Running state of one chunk; `record` is the record it adds into (NOTE: [chunking]).
struct ChunkState {
  int64_t* record;
  uint64_t absmax = 0;
  uint64_t absmin = UINT64_MAX;
  double exact_sumsq = 0.0;  // blocks that took scan_block_exact
};

// The per-element path, for blocks holding a subnormal, inf or NaN and for small chunks holding an inf or NaN:
// classify.h decides every element. Specials and subnormals are counted into `record` directly, each normal value's
// exponent field goes to count_normal(i, field), and the |x| extremes and the squares (in element order) of the
// finite values are accumulated.
template <typename F, typename CountNormal>
void classify_each(const typename F::Bits* p, int64_t n, int64_t* record, uint64_t& absmax, uint64_t& absmin,
                   double& sumsq, CountNormal&& count_normal) {
  using Bits = typename F::Bits;
  for (int64_t i = 0; i < n; ++i) {
    const Bits bits = p[i];
    switch (classify<F>(bits)) {
      case kNaN: record[record::kNaN]++; continue;
      case kPosInf: record[record::kPosInf]++; continue;
      case kNegInf: record[record::kNegInf]++; continue;
      case kZero: record[record::kZero]++; continue;
      case kSubnormal:
        record[record::kSubnormal]++;
        record[record::kHist + bin_of_subnormal<F>(bits)]++;
        break;
      case kNormal: count_normal(i, exponent_field<F>(bits)); break;
    }
    const uint64_t a = static_cast<uint64_t>(abs_bits<F>(bits));
    absmax = std::max(absmax, a);
    absmin = std::min(absmin, a);
    const double v = abs_to_double<F>(bits);
    sumsq += v * v;
  }
}

// A block holding a subnormal, inf or NaN: normal values count into the chunk's field tables.
template <typename F>
void scan_block_exact(const typename F::Bits* p, int64_t n, ChunkState& st, FieldCounts& counts) {
  int lo = INT_MAX, hi = -1;
  double sumsq = 0.0;
  classify_each<F>(p, n, st.record, st.absmax, st.absmin, sumsq, [&](int64_t i, int field) {
    counts.table[i % kFieldTables][field]++;
    lo = std::min(lo, field);
    hi = std::max(hi, field);
  });
  if (hi >= 0) counts.touch(lo, hi);
  st.exact_sumsq += sumsq;
}

// Where scan_chunk reads a block: in place, or (NOTE: [float16 widened]) from a buffer the block is first widened to;
// and where the block's own bits are, for the fingerprint (NOTE: [scan fingerprint]).
template <typename F>
struct InPlace {
  using RawBits = typename F::Bits;
  const typename F::Bits* data;
  const typename F::Bits* block(int64_t begin, int64_t) const { return data + begin; }
  const RawBits* raw(int64_t begin) const { return data + begin; }
};

template <typename F, typename Source>
void scan_chunk(Source source, int64_t begin, int64_t end, int64_t* record, double& sumsq_out, FieldCounts& counts) {
  using Bits = typename F::Bits;
  constexpr int64_t kBlockElems = kBlockBytes / sizeof(Bits);
  constexpr Bits kSmallestNormal = F::kSmallestNormalAbsBits;
  constexpr Bits kInfBits = F::kInfAbsBits;
  constexpr Bits kAllOnes = static_cast<Bits>(~Bits(0));
  constexpr int kSquareVectors = VectorOps<F>::kSquareVectors;
  ChunkState st{record};
  ChunkWindow window;
  VF64 lanes[kChains][kSquareVectors] = {};
  BlockScan<F> s;
  FingerprintLanes<typename Source::RawBits> fingerprint;
  for (int64_t b = begin; b < end; b += kBlockElems) {
    const int64_t n = std::min(kBlockElems, end - b);
    const Bits* p = source.block(b, n);
    if constexpr (std::is_same_v<typename Source::RawBits, Bits>) {  // pass 1 steps the fingerprint's lanes too
      const int64_t vectors = pass1_vectors<F>(n);
      scan_block_fast<F>(p, n, s, &fingerprint.lanes_for(b, vectors));
      fingerprint.took(vectors);
    } else {  // a widened block: the fingerprint reads its own bits, hot in L1 (NOTE: [fingerprint lanes])
      scan_block_fast<F>(p, n, s, nullptr);
      fingerprint.add(source.raw(b), n, b);
    }
    if (s.max_abs >= kInfBits) {
      scan_block_exact<F>(p, n, st, counts);
      continue;
    }
    for (int c = 0; c < kChains; ++c)
      for (int k = 0; k < kSquareVectors; ++k) lanes[c][k] += s.sumsq[c][k];
    int64_t zeros = 0;
    Bits min_nonzero_abs = s.min_abs;
    if (s.min_abs == 0) zeros_and_min<F>(p, n, zeros, min_nonzero_abs);
    record[record::kZero] += zeros;
    // Elements that count on field 0 (residue 0 of the window counters) without being normal values.
    int64_t field0 = zeros;
    Bits min_normal_abs = min_nonzero_abs;
    if (min_nonzero_abs != kAllOnes) {
      st.absmax = std::max<uint64_t>(st.absmax, s.max_abs);
      st.absmin = std::min<uint64_t>(st.absmin, min_nonzero_abs);
      if (min_nonzero_abs < kSmallestNormal) {
        const int64_t subnormals = bin_subnormals<F>(p, n, record + record::kHist, min_normal_abs);
        record[record::kSubnormal] += subnormals;
        field0 += subnormals;
      }
    }
    if (min_normal_abs == kAllOnes) {  // no normal value: everything counted sits on residue 0
      if (window.open) window.add<F>(s.residues, field0 + s.padding, counts);
      continue;
    }
    const int lo = exponent_field<F>(min_normal_abs);
    const int hi = exponent_field<F>(s.max_abs);
    if (!window.open) window.open_below(hi);  // the chunk's first block with normal values sets the window
    if (hi < window.first + kWindowFields && (lo >= window.first || window.tally_below<F>(p, n, lo, counts))) {
      window.add<F>(s.residues, field0 + s.padding, counts);
      continue;
    }
    if (hi - lo < kWindowFields) count_fields_window<F, 1>(p, n, lo, field0, counts);
    else if (hi - lo < 2 * kWindowFields) count_fields_window<F, 2>(p, n, lo, field0, counts);
    else count_fields_scalar<F>(p, n, lo, hi, field0 > 0, counts);
    if (++window.misfits == 2) {
      window.close<F>(counts);
      window.open_below(hi);
    }
  }
  window.close<F>(counts);
  counts.fold_into<F>(record + record::kHist);
  merge_extremes(record, st.absmax, st.absmin);
  add_fingerprint(record, fingerprint.total());
  sumsq_out = sum_lanes(lanes) + st.exact_sumsq;
}

// NOTE: [small chunks]
// A chunk of at most kSmallChunkElems elements (a bias, a norm's weight, Adam's one-element step counter) skips the
// block machinery, whose fixed cost (pass 1's residue counters, the chunk window, the thread's field counters) is
// many times what its few elements cost. scan_small reads it in two passes: a vector pass finds the largest and
// smallest non-zero abs bit patterns and the sum of squares, then a scalar pass counts each element's exponent field
// into counters that are cleared only over the fields between those two extremes, binned as fold_fields bins
// (subnormals, as in the block path, take one more pass that bins them one by one). A chunk with an inf or NaN is
// decided element by element with classify() instead (scan_small_exact, like scan_block_exact).
// The record is the one scan_chunk would give, bit for bit: counts, extremes and bins are integers, and the sum of
// squares is added in scan_chunk's order, which for a chunk of one block is pass 1's vector lanes (the same
// VectorOps::add_squares, steps and zero-padded tail, lanes added by the same sum_lanes), or element order when the
// block holds an inf or NaN. Element order alone would change the last bits of most sums; tests/test_many_tensors.py
// compares each short tensor with the same tensor padded with zeros into the block path. A small chunk is never
// longer than one block of the widest format, so there is no other case.
//
// The threshold, measured on the 2-core AVX-512 development machine, one thread, calls of 128 equal tensors of
// N(0, 0.02) values: the block path costs 0.25-0.45 us a chunk at any size below a few hundred elements,
// scan_small 0.07 us plus 0.9 ns an element (float32; 1.3 ns for float16). They cost the same at about 200
// elements (float16), 300 (float32, float64) and 330 (bfloat16).
#ifndef NANSCAN_SMALL_CHUNK_ELEMS  // set on the compiler's command line only to measure another threshold
#define NANSCAN_SMALL_CHUNK_ELEMS 256
#endif
constexpr int64_t kSmallChunkElems = NANSCAN_SMALL_CHUNK_ELEMS;
static_assert(kSmallChunkElems <= kBlockBytes / sizeof(Float64::Bits), "a small chunk must fit one block");

// Copies n < W::kStepElems elements to `tail` and fills the rest of its step with zeros. With AVX-512 each vector
// of the step is written with one full-width store of a masked load (masked-off bytes read nothing, so nothing past
// the tensor is touched): the vector loads that then read the step are forwarded from those stores, where a
// memset and a memcpy of another width left them waiting for the stores to reach the cache.
template <typename F>
void copy_padded(const typename F::Bits* p, int64_t n, typename F::Bits* tail) {
  using Bits = typename F::Bits;
  using W = Words<F>;
#if NANSCAN_AVX512
  const char* from = reinterpret_cast<const char*>(p);
  char* to = reinterpret_cast<char*>(tail);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(Bits));
  for (int64_t at = 0; at < W::kStepElems * static_cast<int64_t>(sizeof(Bits)); at += kVectorBytes) {
    const int64_t here = std::clamp<int64_t>(bytes - at, 0, kVectorBytes);
    const __mmask64 mask = here == kVectorBytes ? ~__mmask64(0) : (__mmask64(1) << here) - 1;
    _mm512_storeu_si512(to + at, _mm512_maskz_loadu_epi8(mask, from + std::min(at, bytes)));
  }
#else
  std::memset(tail, 0, sizeof(Bits) * W::kStepElems);
  std::memcpy(tail, p, sizeof(Bits) * n);
#endif
}

// A small chunk holding an inf or NaN: every element decided by classify(), squares added in element order.
template <typename F>
void scan_small_exact(const typename F::Bits* p, int64_t n, int64_t* record, double& sumsq_out) {
  int64_t* hist = record + record::kHist;
  uint64_t absmax = 0, absmin = UINT64_MAX;
  double sumsq = 0.0;
  classify_each<F>(p, n, record, absmax, absmin, sumsq,
                   [&](int64_t, int field) { hist[bin_of_normal_field<F>(field)]++; });
  merge_extremes(record, absmax, absmin);
  sumsq_out = sumsq;
}

// A small chunk (NOTE: [small chunks]), added to `record` like scan_chunk.
template <typename F>
void scan_small(const typename F::Bits* p, int64_t n, int64_t* record, double& sumsq_out) {
  using Bits = typename F::Bits;
  using Ops = VectorOps<F>;
  using V = typename Ops::V;
  using W = Words<F>;
  constexpr int64_t L = sizeof(V) / sizeof(Bits);
  constexpr Bits kAllOnes = static_cast<Bits>(~Bits(0));
  // Pass 1's steps, with the same padding: the padded zeros square to zero and wrap to all ones in `below`.
  V vmax = V{}, below = ~V{};  // below: min of |x| - 1, where zeros wrap to all ones (zeros_and_min)
  VF64 lanes[kChains][Ops::kSquareVectors] = {};
  const int64_t full = n / W::kStepElems * W::kStepElems;
  Bits tail[W::kStepElems];
  if (full < n) copy_padded<F>(p + full, n - full, tail);
  const Bits* run_start[2] = {p, tail};
  const int64_t run_steps[2] = {full / W::kStepElems, full < n ? 1 : 0};
  for (int r = 0; r < 2; ++r) {
    for (int64_t step = 0; step < run_steps[r]; ++step) {
      for (int c = 0; c < kChains; ++c) {
        const Bits* at = run_start[r] + (step * kChains + c) * L;
        const V a = load_bits<V>(at) & F::kAbsMask;
        vmax = vmax > a ? vmax : a;
        const V b = a - 1;
        below = below < b ? below : b;
        Ops::add_squares(at, lanes[c]);
      }
    }
  }
  Bits max_abs = 0, min_below = kAllOnes;
  for (int64_t l = 0; l < L; ++l) {
    max_abs = std::max<Bits>(max_abs, vmax[l]);
    min_below = std::min<Bits>(min_below, below[l]);
  }
  if (max_abs >= F::kInfAbsBits) {
    scan_small_exact<F>(p, n, record, sumsq_out);
    return;
  }
  sumsq_out = sum_lanes(lanes);  // in scan_chunk's order
  if (min_below == kAllOnes) {  // zeros only
    record[record::kZero] += n;
    return;
  }
  const Bits min_abs = static_cast<Bits>(min_below + 1);
  merge_extremes(record, max_abs, min_abs);
  // Field 0 (zeros, subnormals) and the fields from the smallest non-zero value's to the largest's.
  const int lo = exponent_field<F>(min_abs);
  const int hi = exponent_field<F>(max_abs);
  // Neighbouring elements count into different tables (kFieldTables), whose counters of one field share 16 bytes:
  // one store clears them, and the counting loads that follow are forwarded from it. Fields outside the range are
  // never touched, so they are left uninitialised.
  struct alignas(16) FieldQuad {
    uint32_t table[kFieldTables];
  };
  static_assert(sizeof(FieldQuad) == 16, "one 16-byte store clears a field's counters");
  FieldQuad fields[1 << F::kExpBits];
  fields[0] = FieldQuad{};
  for (int f = lo; f <= hi; ++f) fields[f] = FieldQuad{};
  int64_t i = 0;
  for (; i + kFieldTables <= n; i += kFieldTables)
    for (int t = 0; t < kFieldTables; ++t) fields[exponent_field<F>(p[i + t])].table[t]++;
  for (; i < n; ++i) fields[exponent_field<F>(p[i])].table[0]++;
  auto total = [&](int f) {
    const FieldQuad& q = fields[f];
    return int64_t(q.table[0]) + q.table[1] + q.table[2] + q.table[3];
  };
  int64_t subnormals = 0;
  if (min_abs < F::kSmallestNormalAbsBits) {
    for (int64_t j = 0; j < n; ++j) {
      const Bits a = abs_bits<F>(p[j]);
      if (a != 0 && a < F::kSmallestNormalAbsBits) {
        ++subnormals;
        record[record::kHist + bin_of_subnormal<F>(a)]++;
      }
    }
  }
  record[record::kSubnormal] += subnormals;
  record[record::kZero] += total(0) - subnormals;  // field 0 holds the zeros and the subnormals
  // Binned as fold_fields bins (NOTE: [field histogram]), from the summed tables.
  for (int f = std::max(lo, 1); f <= hi; ++f) record[record::kHist + bin_of_normal_field<F>(f)] += total(f);
}

// NOTE: [byte formats]
// A float8 element is one byte, so the vector machinery above (abs thresholds, field windows) is not used for it.
// Without AVX-512's byte instructions (NOTE: [byte vectors]) or AVX2 (NOTE: [byte vectors on AVX2]) a chunk, and
// with them a block that holds an inf or NaN, is counted per bit pattern, 256 counters in kByteTables interleaved
// tables (so runs of one pattern do not wait on each other's stores), and then each pattern's count goes where
// classify.h puts that pattern, through a table of 256 entries made once per format from classify(), exponent_bin()
// and abs_to_double() (ByteTable). Every slot of the record follows from the counts: the classes, the bins, the
// extremes (the largest and smallest abs patterns counted among finite values), and the sum of squares, added as
// count * square in pattern order. So the sum depends on the chunking alone (NOTE: [chunking]), not on the order of
// the elements, and each term is exact (a square has at most 8 significant bits, a count at most 30).
constexpr int kByteTables = 4;
constexpr int64_t kByteTablesFrom = 4096;  // shorter chunks count into one table: clearing four would cost more

template <typename F>
struct ByteTable {
  ValueClass cls[256];
  int16_t bin[256];
  double square[256];
  ByteTable() {
    for (int b = 0; b < 256; ++b) {
      const auto bits = static_cast<typename F::Bits>(b);
      cls[b] = classify<F>(bits);
      bin[b] = static_cast<int16_t>(exponent_bin<F>(bits));
      const double v = cls[b] == kNormal || cls[b] == kSubnormal ? abs_to_double<F>(bits) : 0.0;
      square[b] = v * v;
    }
  }
};

template <typename F>
const ByteTable<F>& byte_table() {
  static const ByteTable<F> table;  // made on first use; thread-safe initialisation
  return table;
}

// Adds the elements that `tables` pattern-count tables counted to `record` (classes and bins) and to the extremes;
// returns their sum of squares, added in pattern order (NOTE: [byte formats]).
template <typename F>
double fold_patterns(const uint32_t (*counts)[256], int tables, int64_t* record, uint64_t& absmax,
                     uint64_t& absmin) {
  const ByteTable<F>& table = byte_table<F>();
  double sumsq = 0.0;
  for (int b = 0; b < 256; ++b) {
    uint64_t c = 0;
    for (int t = 0; t < tables; ++t) c += counts[t][b];
    if (c == 0) continue;
    switch (table.cls[b]) {
      case kNaN: record[record::kNaN] += c; continue;
      case kPosInf: record[record::kPosInf] += c; continue;
      case kNegInf: record[record::kNegInf] += c; continue;
      case kZero: record[record::kZero] += c; continue;
      case kSubnormal: record[record::kSubnormal] += c; break;
      case kNormal: break;
    }
    record[record::kHist + table.bin[b]] += c;
    const uint64_t a = static_cast<uint64_t>(b & F::kAbsMask);
    absmax = std::max(absmax, a);
    absmin = std::min(absmin, a);
    sumsq += static_cast<double>(c) * table.square[b];
  }
  return sumsq;
}

// One chunk of a one-byte format counted per bit pattern (NOTE: [byte formats]), added to `record` like scan_chunk;
// `first`: the chunk's first element in its tensor (NOTE: [scan fingerprint]).
template <typename F>
void scan_bytes_by_pattern(const uint8_t* p, int64_t n, int64_t first, int64_t* record, double& sumsq_out) {
  static_assert(kMaxChunkElems <= UINT32_MAX, "the per-pattern counters are uint32");
  uint32_t counts[kByteTables][256];
  const int tables = n >= kByteTablesFrom ? kByteTables : 1;
  std::memset(counts, 0, sizeof(counts[0]) * tables);
  FingerprintLanes<uint8_t> fingerprint;
  int64_t i = 0;
  if (tables == kByteTables) {
    for (int64_t block = 0; block + 8 <= n; block = i) {
      const int64_t stop = std::min(n, block + kBlockBytes) / 8 * 8;
      for (; i < stop; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, sizeof(w));
        __builtin_prefetch(p + i + kPrefetchBytes, 0, 2);  // NOTE: [prefetch]
        for (int k = 0; k < 8; ++k) counts[k % kByteTables][(w >> (8 * k)) & 0xff]++;
      }
      fingerprint.add(p + block, i - block, first + block);  // the block, hot in L1 (NOTE: [fingerprint lanes])
    }
  }
  fingerprint.add(p + i, n - i, first + i);
  for (; i < n; ++i) counts[0][p[i]]++;
  add_fingerprint(record, fingerprint.total());
  uint64_t absmax = 0, absmin = UINT64_MAX;
  sumsq_out = fold_patterns<F>(counts, tables, record, absmax, absmin);
  merge_extremes(record, absmax, absmin);
}

#if NANSCAN_AVX512_BYTES || NANSCAN_AVX2_BYTES
// What the two vector paths for one-byte formats share (NOTE: [byte vectors], NOTE: [byte vectors on AVX2]): the
// windows of field slots, the elements tallied below a window, and the chunk's record made from the counts.
template <typename F>
struct ByteWindows {
  static constexpr int kFields = 1 << F::kExpBits;
  static constexpr int kSlots = 16;  // field slots of a window
  // Window w holds field 0 in slot 0 and fields w + 1 .. w + kSlots - 1 in slots 1 .. kSlots - 1; one window
  // holds every field of a format with 16 fields (e4m3), kMaxNormalField - 14 windows the normal fields of e5m2.
  static constexpr int kWindows = F::kMaxNormalField >= kSlots ? F::kMaxNormalField - (kSlots - 1) + 1 : 1;
  static constexpr int kMinExponent = 1 - F::kBias - F::kMantBits;
  static_assert(2 * (kFields - 1) + 8 + 30 + 1 <= 127, "the scaled sums of squares must fit __int128");

  // The field in slot `slot` of window w.
  static constexpr int field_of_slot(int w, int slot) { return slot == 0 ? 0 : w + slot; }
  // The window whose top slot holds `field` (or the lowest window, for the low fields).
  static constexpr int window_for(int field) { return std::max(0, std::min(kWindows - 1, field - (kSlots - 1))); }
  // Below this abs pattern an element is not counted by window w's slots (unless it is a zero): it is tallied.
  static constexpr int bottom_bits(int w) { return (w + 1) << F::kMantBits; }
};

// Adds the elements tallied below a window by their |x| bits (by_abs[1 .. bottom - 1]): subnormals to the record's
// count and bins, normal values to `fields`, and their squares to `total`, in units of 2^(2 kMinExponent - 3) (2 *
// 4^field * 4^(kMinExponent - 1) per unit square of the significand). Returns how many were normal values.
template <typename F>
int64_t add_low_tally(const uint32_t* by_abs, int bottom, int64_t* record, int64_t* fields, int64_t& subnormals,
                      __int128& total) {
  int64_t normals = 0;
  for (int a = 1; a < bottom; ++a) {
    const uint32_t c = by_abs[a];
    if (c == 0) continue;
    const auto bits = static_cast<typename F::Bits>(a);
    const int field = exponent_field<F>(bits);
    const int mant = a & F::kMantMask;
    int64_t s;  // |x|^2 in units of 4^field * 4^(kMinExponent - 1)
    if (field == 0) {
      record[record::kHist + bin_of_subnormal<F>(bits)] += c;
      subnormals += c;
      s = 4 * mant * mant;
    } else {
      fields[field] += c;
      normals += c;
      const int significand = mant | (1 << F::kMantBits);
      s = significand * significand;
    }
    total += (static_cast<__int128>(c) * (2 * s)) << (2 * field);
  }
  return normals;
}

// The chunk's record from what a vector path counted: `fields` (field 0 holding the zeros, the subnormals and
// `padding` zeros that were no elements), the exact sum of squares `total` (units of add_low_tally) and, for blocks
// that held an inf or NaN, their per-pattern counts (null if none).
template <typename F>
void finish_byte_chunk(const int64_t* fields, int64_t padding, int64_t subnormals, __int128 total,
                       const uint32_t (*patterns)[256], uint64_t absmax, uint64_t absmin, int64_t* record,
                       double& sumsq_out) {
  record[record::kZero] += fields[0] - padding - subnormals;
  record[record::kSubnormal] += subnormals;
  fold_fields<F>(fields, 1, F::kMaxNormalField, record + record::kHist);
  // Exact: the sum rounded once, times a power of two.
  double sumsq = std::ldexp(static_cast<double>(total), 2 * (ByteWindows<F>::kMinExponent - 1) - 1);
  if (patterns) sumsq += fold_patterns<F>(patterns, 1, record, absmax, absmin);
  merge_extremes(record, absmax, absmin);
  sumsq_out = sumsq;
}
#endif

#if NANSCAN_AVX512_BYTES
// NOTE: [byte vectors]
// Counting per bit pattern is a dependent load-increment-store per byte: 0.2-0.3 of the read limit on the 2-core
// development machine. With AVX-512's byte instructions a chunk is read 64 elements at a time instead, and each
// vector looked up in 128-entry byte tables (vpermi2b, indexed by the low 7 bits, so by |x|: the sign matters only
// to the NaN of fnuz formats, NOTE: [float8 specials]) made once per format from classify.h:
//  - windows: the vectors count 16 field slots, 4 quads of 4. Slot 0 holds field 0 (zeros and subnormals), slots
//    1 .. 15 of window w the fields w + 1 .. w + 15. A format with 16 fields (e4m3) has one window, which holds
//    them all; e5m2's 32 fields have 16 (17 for fnuz), and a chunk's window is the one whose top slot holds the
//    chunk's largest |x|: a Gaussian block spans about 16 fields, so the few elements below the window are tallied
//    one by one like the subnormals (below). The window starts where the thread's last chunk of the format left it;
//    a block above it, or a chunk's first block two or more fields below it, sends the counts so far out under the
//    old window and is read again, hot in L1, under the one that fits. (Choosing it from a first look at the
//    chunk's first block cost more than the whole vector saving when streaming: that look waited on memory.)
//  - quads: table q of window w maps an element in slot s = 4q .. 4q + 3 to its weight 4^(s mod 4), doubled in
//    odd quads, others to 0.
//  - squares: x^2 = M^2 * 4^(f - 1) * 4^kMinExponent, with M the significand (hidden bit included) and
//    2^kMinExponent the subnormals' ulp. A byte dot product (vpdpbusd: unsigned byte times signed byte, four per
//    32-bit lane, added) of quad q's weights with M^2 less kSquareOffset (128 where M^2 reaches past 127, e4m3)
//    adds the squares of quad q's elements, times 4^(1 - kMinExponent - 4q - w) (twice that in odd quads), as exact
//    integers; the offset comes back as 128 times the quad's weights summed, which the slot counts give. Field
//    0's elements are taken back out of quad 0 (NOTE: [field 0 squares]): the subnormals are squared from their
//    tally. The quads' sums, scaled by their powers of 4 in __int128 whenever the window moves and at the chunk's
//    end, and the tallied elements' squares are the chunk's sum of squares, exact, rounded once to double; so it
//    does not depend on the windows taken, nor on the order of the elements.
//  - fields: an even and an odd quad OR into one byte (their weights sit on even and odd bits), which holds one
//    bit per slot of 8. The GF(2) transpose of each 8-byte word (gf2p8affineqb) gathers one slot's bits of 8
//    elements into one byte, and a byte popcount counts them. Byte counters take kByteSteps vectors (a step),
//    16-bit ones a block, the chunk's 16-bit ones kWordBlocks blocks, then int64 per slot, then per field; the
//    squares' int32 lanes likewise take kWordBlocks blocks before they are summed. (Summing them per block, and
//    the 16-bit counters word by word, had cost ~90 ns per tensor: a fifth of the scan of a model's float8 set,
//    whose tensors are mostly small.)
//  - extremes: the byte maximum of |x| and the byte minimum of |x| - 1, where zeros wrap to 0xff (zeros_and_min).
// The minimum is checked per step: a step with an element below the window's slots 1 .. 15 (a subnormal, or a
// normal value below the window) is read again (hot in L1) and those elements tallied by |x| bits, which name
// their bin or field and their square; they are few, and most steps have none. Per block (kBlockBytes), the
// extremes tell the rest: a block with an inf or NaN (for fnuz formats, whose NaN 0x80 has |x| bits 0: a signed
// byte minimum of -128) leaves its vector counts and its tally unused and is counted per bit pattern instead (NOTE:
// [byte formats]). The zero padding of a chunk's last vector, and the subnormals, are taken back out of field 0,
// which leaves the zeros. Whole vectors are loaded unmasked; only the chunk's last, short one with a mask.
// Cost, 2-core development machine (Zen 5), one thread, a 64 KiB chunk hot in L2: e4m3fn 2.1-2.3 ns per 64-byte
// vector, e5m2 2.35 ns with windows against 3.2-3.4 before, when it counted all 8 quads of its 32 fields (8 table
// lookups and 8 dot products a vector); e4m3fn was 3.3 before the squares took the signed operand (which saved the
// shift that put an odd quad's bits in place), the unmasked loads and the per-step subnormal check (a block re-read
// for one subnormal had cost 0.4 ns per vector: about half of a Gaussian float8 tensor's blocks hold one; about 15%
// of the steps of the bench's Gaussian e5m2 and e4m3fn are read again). The loop issues about 23 vector
// instructions per vector, 7 of them byte permutes or GF(2) transforms (two ports) and 4 dot products; dropping any
// group of them (extremes, squares or counts) saves about the same time per instruction, so the loop is bound by
// issue, not by one port. Streaming 512 MiB at 2 threads (median of 15 interleaved rounds) it reaches about 0.9 of
// the read probe for e4m3fn and e5m2 alike, on a machine whose other load makes single rounds range 0.75 .. 0.98.
template <typename F>
struct ByteVectors : ByteWindows<F> {
  using Windows = ByteWindows<F>;
  using Windows::bottom_bits;
  using Windows::field_of_slot;
  using Windows::window_for;
  static constexpr int kFields = Windows::kFields;
  static constexpr int kSlots = Windows::kSlots;
  static constexpr int kQuads = kSlots / 4;
  static constexpr int kFieldBytes = kQuads / 2;  // bytes of field bits: 8 slots each
  static constexpr int kWindows = Windows::kWindows;
  static constexpr int kMinExponent = Windows::kMinExponent;
  // The squares' byte is the signed operand of vpdpbusd: M^2 less kSquareOffset, which brings e4m3's M^2
  // (64 .. 225) into -128 .. 127; the offset comes back as kSquareOffset times the quad weights, which follow from
  // the slot counts.
  // NOTE: [field 0 squares]
  // M^2 is looked up by the mantissa bits alone (vpermb reads the low 6 bits of each byte: one uop, where the
  // 128-entry vpermi2b that could tell field 0 apart is three on Intel's cores), so an element of field 0 (a zero,
  // the zero padding of a short tail, a subnormal with mantissa m) adds (kHidden + m)^2 to quad 0 at weight 1, as
  // if it were normal. flush_window takes that back out: kHidden^2 per count of slot 0, and for the subnormals,
  // whose mantissas the tally holds, (kHidden + m)^2 - kHidden^2 each; they are squared from the tally instead.
  // Measured (Intel Xeon, AVX-512, one thread, 512 KiB of Gaussian values hot in L2, both builds in turn): ns per
  // 64-byte vector e4m3fn 4.03-4.11 -> 3.53-3.94, e5m2 4.20-4.21 -> 3.73-4.15.
  static constexpr int kLargestSquare = (2 << F::kMantBits) - 1;
  static constexpr int kHidden = 1 << F::kMantBits;
  static constexpr int kSquareOffset = kLargestSquare * kLargestSquare > 127 ? 128 : 0;
  static_assert(kLargestSquare * kLargestSquare - kSquareOffset <= 127, "M^2 must fit a signed byte");

  // The quads depend on the field alone, so they are looked up (vpermb, which reads 6 index bits and leaves its
  // table intact) by the element's bits from the mantissa's top one up: shifted as 16-bit words, the neighbouring
  // byte's bits land above bit 5, where vpermb does not look.
  static constexpr int kFieldIndexShift = F::kMantBits - 1;
  static_assert(F::kMantBits >= 1 && 1 + F::kExpBits <= 6, "the field and the top mantissa bit fit 6 bits");
  __m512i quad[kWindows][kQuads];  // vpermb tables: index (|x| bits >> kFieldIndexShift) mod 64
  __m512i square;                  // vpermb table: M^2 - kSquareOffset by the low 6 bits (NOTE: [field 0 squares])

  // The weight of slot j in its quad's table: 4^(j mod 4), doubled in odd quads so that an even and an odd quad
  // OR into one byte of field bits (at most 128: the unsigned operand of vpdpbusd).
  static constexpr int weight(int slot) { return (1 << (2 * (slot % 4))) << ((slot / 4) % 2); }

  ByteVectors() {
    alignas(64) uint8_t squares[64];
    for (int i = 0; i < 64; ++i) {
      const int significand = (i & static_cast<int>(F::kMantMask)) | kHidden;
      squares[i] = static_cast<uint8_t>(significand * significand - kSquareOffset);
    }
    for (int w = 0; w < kWindows; ++w) {
      alignas(64) uint8_t quads[kQuads][128] = {};
      for (int b = 0; b < 128; ++b) {
        const auto bits = static_cast<typename F::Bits>(b);
        const ValueClass cls = classify<F>(bits);
        if (cls == kNaN || cls == kPosInf || cls == kNegInf) continue;
        const int field = exponent_field<F>(bits);
        for (int slot = 0; slot < kSlots; ++slot)
          if (field_of_slot(w, slot) == field) quads[slot / 4][b] = static_cast<uint8_t>(weight(slot));
      }
      for (int q = 0; q < kQuads; ++q) {
        alignas(64) uint8_t by_index[64];
        for (int i = 0; i < 64; ++i) by_index[i] = quads[q][(i << kFieldIndexShift) & F::kAbsMask];
        quad[w][q] = _mm512_loadu_si512(by_index);
      }
    }
    square = _mm512_loadu_si512(squares);
  }
  // The slot that bit k of field byte t counts: even bits hold quad 2t, odd bits quad 2t + 1.
  static constexpr int slot_of(int t, int k) { return 8 * t + (k % 2) * 4 + k / 2; }
};

template <typename F>
const ByteVectors<F>& byte_vectors() {
  static const ByteVectors<F> tables;  // made on first use; thread-safe initialisation
  return tables;
}

constexpr int kByteSteps = 16;   // vectors per byte counter: each adds at most 8 to one of its bytes
constexpr int kWordBlocks = 64;  // blocks per chunk 16-bit counter: a block adds at most 512 to one
constexpr int64_t kVectorsPerBlock = kBlockBytes / 64;
static_assert(kVectorsPerBlock * 8 * kWordBlocks <= 0xffff, "16-bit field counters would overflow");
static_assert(kVectorsPerBlock * 4 * 128 * 128 * kWordBlocks <= INT32_MAX,
              "kWordBlocks blocks' squares must fit int32 lane sums");

inline int reduce_max_u8(__m512i v) {
  v = _mm512_max_epu8(v, _mm512_srli_epi64(v, 32));
  v = _mm512_max_epu8(v, _mm512_srli_epi64(v, 16));
  v = _mm512_max_epu8(v, _mm512_srli_epi64(v, 8));
  return static_cast<int>(_mm512_reduce_max_epu64(_mm512_and_si512(v, _mm512_set1_epi64(0xff))));
}

// Tallies the elements of `n` bytes with 0 < |x| bits < `bottom` one by one by their |x| bits (they are few).
template <typename F>
void tally_low_bytes(const uint8_t* p, int64_t n, int bottom, uint32_t* by_abs) {
  const __m512i abs_mask = _mm512_set1_epi8(static_cast<char>(F::kAbsMask));
  const __m512i one = _mm512_set1_epi8(1);
  const __m512i below = _mm512_set1_epi8(static_cast<char>(bottom - 1));
  for (int64_t at = 0; at < n; at += 64) {
    const __mmask64 load = n - at >= 64 ? ~__mmask64(0) : (__mmask64(1) << (n - at)) - 1;
    const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi8(load, p + at), abs_mask);
    // 0 < |x| < bottom, as |x| - 1 < bottom - 1: zeros (and masked-off bytes) wrap to 0xff.
    for (uint64_t m = _mm512_cmplt_epu8_mask(_mm512_sub_epi8(a, one), below); m; m &= m - 1)
      by_abs[p[at + __builtin_ctzll(m)] & F::kAbsMask]++;
  }
}

// The per-vector accumulators of one block (NOTE: [byte vectors]).
template <typename F>
struct ByteBlock {
  static constexpr int Q = ByteVectors<F>::kQuads;
  static constexpr int T = ByteVectors<F>::kFieldBytes;
  __m512i vmax, below, smin;
  __m512i squares[Q];
  __m512i counts[T];
  FingerprintSums<uint8_t> fingerprint;  // the block's own (NOTE: [fingerprint lanes]), appended once it is left
};

// One vector of 64 elements into the block's accumulators, with window `quad`'s tables. Inlined, so the
// accumulators stay in registers (NOTE: [blocks]); the loops over quads are unrolled.
template <typename F>
__attribute__((always_inline)) inline void add_byte_vector(const __m512i* quad, __m512i square, __m512i raw,
                                                           ByteBlock<F>& acc) {
  using BV = ByteVectors<F>;
  constexpr int T = BV::kFieldBytes;
  const __m512i transpose = _mm512_set1_epi64(0x8040201008040201ll);  // byte k selects bit k of each byte
  const __m512i a = _mm512_and_si512(raw, _mm512_set1_epi8(static_cast<char>(F::kAbsMask)));
  acc.vmax = _mm512_max_epu8(acc.vmax, a);
  acc.below = _mm512_min_epu8(acc.below, _mm512_sub_epi8(a, _mm512_set1_epi8(1)));
  if constexpr (F::kNaNIsSignAlone) acc.smin = _mm512_min_epi8(acc.smin, raw);
  acc.fingerprint.step_value(raw);
  const __m512i field_index = _mm512_srli_epi16(raw, BV::kFieldIndexShift);
  const __m512i sq = _mm512_permutexvar_epi8(raw, square);  // NOTE: [field 0 squares]
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    const __m512i even = _mm512_permutexvar_epi8(field_index, quad[2 * t]);
    const __m512i odd = _mm512_permutexvar_epi8(field_index, quad[2 * t + 1]);
    acc.squares[2 * t] = _mm512_dpbusd_epi32(acc.squares[2 * t], even, sq);
    acc.squares[2 * t + 1] = _mm512_dpbusd_epi32(acc.squares[2 * t + 1], odd, sq);
    const __m512i field_bits = _mm512_or_si512(even, odd);
    acc.counts[t] =
        _mm512_add_epi8(acc.counts[t], _mm512_popcnt_epi8(_mm512_gf2p8affine_epi64_epi8(transpose, field_bits, 0)));
  }
}

// One chunk of a one-byte format (NOTE: [byte vectors]), added to `record` like scan_chunk. No lambda or variable
// index touches the per-vector accumulators (NOTE: [blocks]): the loops over quads are unrolled.
template <typename F>
void scan_bytes_vector(const uint8_t* p, int64_t n, int64_t first, int64_t* record, double& sumsq_out) {
  using BV = ByteVectors<F>;
  constexpr int Q = BV::kQuads;
  constexpr int T = BV::kFieldBytes;
  const BV& tables = byte_vectors<F>();
  const __m512i zero = _mm512_setzero_si512();
  // Word w of each 128-bit lane counts bit w % 8 of its field byte (unpacklo/hi keep a byte's place in its word).
  __m512i chunk_words[T][2];
  for (int t = 0; t < T; ++t) chunk_words[t][0] = chunk_words[t][1] = zero;
  int64_t fields[BV::kFields] = {};
  int64_t quad_sums[Q] = {};
  __int128 total = 0;  // the sum of squares in units of 2^(2 kMinExponent - 3), exact
  uint32_t patterns[1][256];
  bool by_pattern = false;
  uint64_t absmax = 0, absmin = UINT64_MAX;
  FingerprintLanes<uint8_t> fingerprint;  // a block as it is left (one may be read again under a new window)
  int64_t subnormals = 0, padding = 0;
  int word_blocks = 0;
  // The window starts where this thread's last chunk of the format left it, and follows the chunk's largest |x|
  // up; a first block two fields or more below it moves it down (NOTE: [byte vectors]).
  static thread_local int window_guess = 0;
  int window = window_guess;
  int64_t slots[BV::kSlots] = {};  // the current window's counts
  int64_t slot0_excess = 0;        // what its subnormals add to quad 0 beyond kHidden^2 (NOTE: [field 0 squares])
  // The blocks' square sums, in int32 lanes until the words are spilled: a block adds at most 2^22 to a lane
  // (kVectorsPerBlock * 4 * 128 * 128), kWordBlocks blocks 2^28.
  __m512i chunk_squares[Q];
  for (int k = 0; k < Q; ++k) chunk_squares[k] = zero;
  auto spill_words = [&]() {
    for (int t = 0; t < T; ++t) {
      // Widened to 32 bits (a sum of eight 16-bit words may not fit 16), the lanes and halves summed: lane k of
      // the 256-bit rest counts bit k.
      __m512i sum = zero;
      for (int h = 0; h < 2; ++h) {
        sum = _mm512_add_epi32(sum, _mm512_cvtepu16_epi32(_mm512_castsi512_si256(chunk_words[t][h])));
        sum = _mm512_add_epi32(sum, _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(chunk_words[t][h], 1)));
        chunk_words[t][h] = zero;
      }
      const __m256i bits = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
      alignas(32) uint32_t by_bit[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(by_bit), bits);
      for (int k = 0; k < 8; ++k) slots[BV::slot_of(t, k)] += by_bit[k];
    }
    for (int k = 0; k < Q; ++k) {
      // Summed in 64 bits: sixteen lanes of up to 2^28 would not fit an int32 sum.
      const __m512i lanes = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(chunk_squares[k])),
                                             _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(chunk_squares[k], 1)));
      quad_sums[k] += _mm512_reduce_add_epi64(lanes);
      chunk_squares[k] = zero;
    }
    word_blocks = 0;
  };
  // The current window's slot counts and quad sums into `fields` and `total`. Quad q's sum, with the offset of the
  // squares put back, counts 4^(4q) (twice that in odd quads) per unit; doubled in even quads, every quad's unit is
  // 2 * 4^(4q), and slot j > 0 of window w holds field w + j: 4^w more.
  auto flush_window = [&]() {
    spill_words();
    quad_sums[0] -= int64_t{BV::kHidden * BV::kHidden} * slots[0] + slot0_excess;  // NOTE: [field 0 squares]
    slot0_excess = 0;
    __int128 sum_all = 0;
    for (int k = 0; k < Q; ++k) {
      __int128 sum = quad_sums[k];
      for (int s = 4 * k; s < 4 * k + 4; ++s)
        sum += static_cast<__int128>(BV::kSquareOffset) * BV::weight(s) * slots[s];
      sum_all += (sum << (k % 2 == 0 ? 1 : 0)) << (8 * k);
      quad_sums[k] = 0;
    }
    total += sum_all << (2 * window);
    for (int s = 0; s < BV::kSlots; ++s) {
      fields[BV::field_of_slot(window, s)] += slots[s];
      slots[s] = 0;
    }
  };
  for (int64_t b = 0; b < n;) {
    const uint8_t* q = p + b;
    const int64_t len = std::min(kBlockBytes, n - b);
    const __m512i* quad = tables.quad[window];
    const __m512i square = tables.square;
    const int bottom = BV::bottom_bits(window);
    ByteBlock<F> acc;
    acc.vmax = zero;
    acc.below = _mm512_set1_epi8(-1);
    acc.smin = zero;
    acc.fingerprint.clear();
    __m512i words[T][2];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) words[t][0] = words[t][1] = zero;
#pragma GCC unroll 8
    for (int k = 0; k < Q; ++k) acc.squares[k] = zero;
    // Elements below the window (subnormals among them) are looked for per step, so that only the steps that hold
    // one are read again; they are tallied on the side until the block is known to be finite and in the window.
    __m512i block_below = acc.below;
    uint32_t by_abs[128];
    bool any_low = false;
    for (int64_t step = 0; step < len; step += 64 * kByteSteps) {
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc.counts[t] = zero;
      acc.below = _mm512_set1_epi8(-1);
      const int64_t stop = std::min(len, step + 64 * kByteSteps);
      int64_t at = step;
      for (; at + 64 <= stop; at += 64) {
        __builtin_prefetch(q + at + kPrefetchBytes, 0, 2);  // NOTE: [prefetch]
        add_byte_vector<F>(quad, square, _mm512_loadu_si512(q + at), acc);
      }
      // The chunk's last vector reads only its own bytes; the rest are zeros (taken out of field 0 below).
      if (at < stop)
        add_byte_vector<F>(quad, square, _mm512_maskz_loadu_epi8((__mmask64(1) << (stop - at)) - 1, q + at), acc);
      block_below = _mm512_min_epu8(block_below, acc.below);
      if (_mm512_cmplt_epu8_mask(acc.below, _mm512_set1_epi8(static_cast<char>(bottom - 1)))) {
        if (!any_low) std::memset(by_abs, 0, sizeof(by_abs[0]) * bottom);
        any_low = true;
        tally_low_bytes<F>(q + step, stop - step, bottom, by_abs);
      }
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        words[t][0] = _mm512_add_epi16(words[t][0], _mm512_unpacklo_epi8(acc.counts[t], zero));
        words[t][1] = _mm512_add_epi16(words[t][1], _mm512_unpackhi_epi8(acc.counts[t], zero));
      }
    }
    const int max_abs = reduce_max_u8(acc.vmax);
    const int min_abs = (256 - reduce_max_u8(_mm512_xor_si512(block_below, _mm512_set1_epi8(-1)))) & 0xff;  // 0: none
    bool special = max_abs >= static_cast<int>(F::kInfAbsBitsWide);
    if constexpr (F::kNaNIsSignAlone)
      special |= _mm512_cmpeq_epi8_mask(acc.smin, _mm512_set1_epi8(static_cast<char>(F::kSignMask))) != 0;
    if (special) {
      if (!by_pattern) std::memset(patterns, 0, sizeof(patterns));
      by_pattern = true;
      for (int64_t i = 0; i < len; ++i) patterns[0][q[i]]++;
      fingerprint.append(acc.fingerprint, (len + 63) / 64, first + b);
      b += len;
      continue;
    }
    const int fit = BV::window_for(exponent_field<F>(static_cast<typename F::Bits>(max_abs)));
    if (fit > window || (b == 0 && fit + 1 < window)) {
      // Above the window (or a first block well below it): the counts so far go out under the old window, and the
      // block is read again (hot in L1) under the one that fits it.
      flush_window();
      window = fit;
      continue;
    }
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < 2; ++h) chunk_words[t][h] = _mm512_add_epi16(chunk_words[t][h], words[t][h]);
    for (int k = 0; k < Q; ++k) chunk_squares[k] = _mm512_add_epi32(chunk_squares[k], acc.squares[k]);
    padding += (64 - len % 64) % 64;
    if (min_abs != 0) {
      absmax = std::max<uint64_t>(absmax, max_abs);
      absmin = std::min<uint64_t>(absmin, min_abs);
    }
    if (any_low) {
      for (int m = 1; m < BV::kHidden; ++m)
        slot0_excess += int64_t{by_abs[m]} * ((BV::kHidden + m) * (BV::kHidden + m) - BV::kHidden * BV::kHidden);
      add_low_tally<F>(by_abs, bottom, record, fields, subnormals, total);
    }
    if (++word_blocks == kWordBlocks) spill_words();
    fingerprint.append(acc.fingerprint, (len + 63) / 64, first + b);  // its vectors, the short last one padded
    b += len;
  }
  flush_window();
  window_guess = window;
  add_fingerprint(record, fingerprint.total());
  finish_byte_chunk<F>(fields, padding, subnormals, total, by_pattern ? patterns : nullptr, absmax, absmin, record,
                       sumsq_out);
}
#endif

#if NANSCAN_AVX2_BYTES
// NOTE: [byte vectors on AVX2]
// Without AVX-512's byte permutes, GF(2) transforms and byte dot products, a float8 chunk is still read 32 elements
// at a time, with the windows, the tally below a window and the per-pattern blocks of NOTE: [byte vectors]. Each
// block is read twice, the second time hot in L1, so that neither pass needs more than AVX2's 16 vector registers:
//  - the first pass finds the extremes (byte maximum of |x|, per step the byte minimum of |x| - 1, and for fnuz
//    formats the signed minimum, 0x80 being their NaN). They say whether the block goes per pattern, which window
//    fits it (a window that moves no longer makes the block read again) and which steps hold an element below it.
//  - the second pass counts and squares a block that holds neither inf nor NaN, in its window. The slot is the
//    element's field less the window's base, saturated at 0 (vpsubusb): fields w + 1 .. w + 15 of window w land
//    in slots 1 .. 15, field 0 and the fields below the window (tallied) in slot 0. Per quad q, a 16-entry table
//    (vpshufb) gives slot s the weight 4^(s mod 4) if s is in quad q (slot 0 none):
//    squares: vpmaddubsw multiplies the weight by M^2 (looked up by the mantissa bits; at most 225, unsigned), two
//    products to a 16-bit lane (at most 2 * 225 * 64), which vpmaddwd adds in pairs into int32 lanes. Quad q's sum
//    counts 4^(4q) per unit, slot s of window w 4^(w + s): doubled, the units of add_low_tally, so the sum of
//    squares is exact, the number NOTE: [byte vectors] gives;
//    fields: the weight times itself (vpmaddubsw again) is 16^(s mod 4), the increment of slot s's 4-bit counter
//    in a 16-bit lane that holds quad q's four, two elements to a lane; kNibbleVectors2 vectors fill them at most
//    to 14, then they are added into 16-bit lanes per slot, which a block fills at most to 256, and summed per
//    block. Slot 0 is what the others leave of the vectors' elements.
// The short last vector of a chunk is read from a zeroed copy (AVX2 has no masked byte load).
// Cost, 2-core development machine (Zen 3, AVX2), one thread, Gaussian e4m3fn or e5m2: 0.16 ns per element on a
// 64 KiB chunk hot in L2, 0.19-0.20 streaming 256 MiB (counted per bit pattern: 0.53 and 0.55). The first version
// counted the fields with popcounts of the slots' bit planes (vpmovmskb) on the scalar ports: 0.20 hot; asking
// for the next block in the first pass rather than in the second cost 0.21-0.34 streaming. The loop is bound by the
// number of vector instructions (about 40 a vector; vpmaddubsw, vpshufb and vpaddw issue alike on this machine).
template <typename F>
struct ByteVectors2 : ByteWindows<F> {
  static constexpr int kQuads = 4;
  static_assert((2 << F::kMantBits) - 1 <= 15 && F::kExpBits <= 5, "M^2 fits a byte, fields fit 5 bits");
  __m256i quad[kQuads];  // vpshufb tables by slot: 4^(slot mod 4) in the slot's quad, 0 elsewhere and for slot 0
  __m256i square;        // vpshufb table by mantissa bits: M^2, the significand with its hidden bit squared

  ByteVectors2() {
    alignas(16) uint8_t table[16];
    for (int q = 0; q < kQuads; ++q) {
      for (int s = 0; s < 16; ++s) table[s] = s != 0 && s / 4 == q ? static_cast<uint8_t>(1 << (2 * (s % 4))) : 0;
      quad[q] = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
    }
    for (int m = 0; m < 16; ++m) {
      const int significand = (m & F::kMantMask) | (1 << F::kMantBits);
      table[m] = static_cast<uint8_t>(significand * significand);
    }
    square = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
  }
};

template <typename F>
const ByteVectors2<F>& byte_vectors2() {
  static const ByteVectors2<F> tables;  // made on first use; thread-safe initialisation
  return tables;
}

constexpr int64_t kByteStep2 = 1024;  // bytes per look for elements below the window, as NOTE: [byte vectors]
constexpr int kSteps2 = static_cast<int>(kBlockBytes / kByteStep2);
constexpr int kSquareBlocks2 = 64;  // blocks whose square sums an int32 lane holds: each adds at most 2^23
static_assert(int64_t(kSquareBlocks2) * (kBlockBytes / 32) * 4 * 225 * 64 <= INT32_MAX, "int32 square lanes");

inline int max_byte(__m256i v) {
  __m128i m = _mm_max_epu8(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 8));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 4));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 2));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 1));
  return _mm_cvtsi128_si32(m) & 0xff;
}

// The vector at `at` of a block `len` bytes long: in place, or the short last one copied into `part`, zeros after.
inline __m256i load_bytes2(const uint8_t* q, int64_t at, int64_t len, uint8_t (&part)[32]) {
  if (len - at >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + at));
  std::memset(part, 0, sizeof(part));
  std::memcpy(part, q + at, len - at);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part));
}

// What the first pass found in a block (NOTE: [byte vectors on AVX2]).
struct ByteExtremes2 {
  int max_abs;
  int min_below[kSteps2];  // per step, the smallest |x| - 1 (zeros wrap to 0xff)
  bool nan_sign_alone;     // an fnuz NaN (0x80)
};

template <typename F>
ByteExtremes2 byte_extremes2(const uint8_t* q, int64_t len) {
  const __m256i abs_mask = _mm256_set1_epi8(static_cast<char>(F::kAbsMask));
  const __m256i all_ones = _mm256_set1_epi8(-1);
  __m256i vmax = _mm256_setzero_si256(), smin = _mm256_setzero_si256();
  ByteExtremes2 e;
  int steps = 0;
  uint8_t part[32];
  for (int64_t step = 0; step < len; step += kByteStep2) {
    __m256i below = all_ones;
    const int64_t stop = std::min(len, step + kByteStep2);
    for (int64_t at = step; at < stop; at += 32) {
      const __m256i raw = load_bytes2(q, at, len, part);
      const __m256i a = _mm256_and_si256(raw, abs_mask);
      vmax = _mm256_max_epu8(vmax, a);
      below = _mm256_min_epu8(below, _mm256_add_epi8(a, all_ones));
      if constexpr (F::kNaNIsSignAlone) smin = _mm256_min_epi8(smin, raw);
    }
    e.min_below[steps++] = 255 - max_byte(_mm256_xor_si256(below, all_ones));
  }
  for (; steps < kSteps2; ++steps) e.min_below[steps] = 255;
  e.max_abs = max_byte(vmax);
  e.nan_sign_alone =
      F::kNaNIsSignAlone &&
      _mm256_movemask_epi8(_mm256_cmpeq_epi8(smin, _mm256_set1_epi8(static_cast<char>(F::kSignMask)))) != 0;
  return e;
}

// Vectors whose slot counts 4-bit counters hold: each 16-bit lane takes two elements a vector.
constexpr int kNibbleVectors2 = 7;

// The second pass over a block that fits window `window` (NOTE: [byte vectors on AVX2]): slot counts added to
// `slots`, square sums to the int32 lanes of `squares`; returns how many it counted in slots 1 .. 15.
template <typename F>
int64_t count_byte_block2(const ByteVectors2<F>& t, const uint8_t* q, int64_t len, int window, uint64_t* slots,
                       __m256i (&squares)[4]) {
  const __m256i base = _mm256_set1_epi8(static_cast<char>(window));
  const __m256i field_mask = _mm256_set1_epi8(static_cast<char>((1 << F::kExpBits) - 1));
  const __m256i mant_mask = _mm256_set1_epi8(static_cast<char>(F::kMantMask));
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi16(0xf);
  __m256i sq0 = squares[0], sq1 = squares[1], sq2 = squares[2], sq3 = squares[3];
  __m256i wide[4][4];  // wide[q][k]: 16-bit lane counts of slot 4q + k, at most 2 * kBlockBytes / 32 = 256
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 4; ++j) wide[k][j] = _mm256_setzero_si256();
  __m256i n0, n1, n2, n3;
  // One vector: squares added, 4-bit slot counters incremented.
  auto vector = [&](__m256i raw) __attribute__((always_inline)) {
    // The field: the 16-bit shift brings the neighbouring byte's low bits above bit 4, which the mask drops.
    const __m256i slot = _mm256_subs_epu8(_mm256_and_si256(_mm256_srli_epi16(raw, F::kMantBits), field_mask), base);
    const __m256i sq = _mm256_shuffle_epi8(t.square, _mm256_and_si256(raw, mant_mask));
    // Per quad: the weights 4^(slot mod 4) times M^2 are the squares, times themselves 16^(slot mod 4), the
    // increments of four 4-bit counters in each 16-bit lane, two elements to a lane.
    const __m256i w0 = _mm256_shuffle_epi8(t.quad[0], slot), w1 = _mm256_shuffle_epi8(t.quad[1], slot);
    const __m256i w2 = _mm256_shuffle_epi8(t.quad[2], slot), w3 = _mm256_shuffle_epi8(t.quad[3], slot);
    sq0 = _mm256_add_epi32(sq0, _mm256_madd_epi16(_mm256_maddubs_epi16(sq, w0), ones));
    sq1 = _mm256_add_epi32(sq1, _mm256_madd_epi16(_mm256_maddubs_epi16(sq, w1), ones));
    sq2 = _mm256_add_epi32(sq2, _mm256_madd_epi16(_mm256_maddubs_epi16(sq, w2), ones));
    sq3 = _mm256_add_epi32(sq3, _mm256_madd_epi16(_mm256_maddubs_epi16(sq, w3), ones));
    n0 = _mm256_add_epi16(n0, _mm256_maddubs_epi16(w0, w0));
    n1 = _mm256_add_epi16(n1, _mm256_maddubs_epi16(w1, w1));
    n2 = _mm256_add_epi16(n2, _mm256_maddubs_epi16(w2, w2));
    n3 = _mm256_add_epi16(n3, _mm256_maddubs_epi16(w3, w3));
  };
  auto spill_nibbles = [&]() {
    const __m256i nibbles[4] = {n0, n1, n2, n3};
    for (int k = 0; k < 4; ++k) {
      wide[k][0] = _mm256_add_epi16(wide[k][0], _mm256_and_si256(nibbles[k], nibble));
      wide[k][1] = _mm256_add_epi16(wide[k][1], _mm256_and_si256(_mm256_srli_epi16(nibbles[k], 4), nibble));
      wide[k][2] = _mm256_add_epi16(wide[k][2], _mm256_and_si256(_mm256_srli_epi16(nibbles[k], 8), nibble));
      wide[k][3] = _mm256_add_epi16(wide[k][3], _mm256_srli_epi16(nibbles[k], 12));
    }
  };
  const int64_t whole = len / 32 * 32;
  for (int64_t group = 0; group < whole; group += kNibbleVectors2 * 32) {
    n0 = n1 = n2 = n3 = _mm256_setzero_si256();
    const int64_t stop = std::min(whole, group + kNibbleVectors2 * 32);
    for (int64_t at = group; at < stop; at += 32) {
      __builtin_prefetch(q + at + kPrefetchBytes, 0, 2);  // the next block, while this one is counted
      vector(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + at)));
    }
    spill_nibbles();
  }
  if (whole < len) {  // the chunk's short last vector, the rest of it zeros (slot 0)
    uint8_t part[32];
    n0 = n1 = n2 = n3 = _mm256_setzero_si256();
    vector(load_bytes2(q, whole, len, part));
    spill_nibbles();
  }
  int64_t counted = 0;
  for (int k = 0; k < 4; ++k) {
    for (int j = 0; j < 4; ++j) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_madd_epi16(wide[k][j], ones));
      int64_t c = 0;
      for (int l = 0; l < 8; ++l) c += lanes[l];
      slots[4 * k + j] += static_cast<uint64_t>(c);
      counted += c;  // slot 0 has no weight: its counters stay 0
    }
  }
  squares[0] = sq0;
  squares[1] = sq1;
  squares[2] = sq2;
  squares[3] = sq3;
  return counted;
}

// Tallies the elements of `n` bytes with 0 < |x| bits < `bottom` one by one by their |x| bits (they are few).
template <typename F>
void tally_low_bytes2(const uint8_t* p, int64_t n, int bottom, uint32_t* by_abs) {
  const __m256i limit = _mm256_set1_epi8(static_cast<char>(bottom - 1));
  uint8_t part[32];
  for (int64_t at = 0; at < n; at += 32) {
    const __m256i a = _mm256_and_si256(load_bytes2(p, at, n, part), _mm256_set1_epi8(static_cast<char>(F::kAbsMask)));
    // 0 < |x| < bottom, as |x| - 1 < bottom - 1: zeros (and the copy's padding) wrap to 0xff.
    const __m256i above = _mm256_subs_epu8(limit, _mm256_add_epi8(a, _mm256_set1_epi8(-1)));
    for (uint32_t m = ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(above, _mm256_setzero_si256())));
         m; m &= m - 1)
      by_abs[p[at + __builtin_ctz(m)] & F::kAbsMask]++;
  }
}

// One chunk of a one-byte format (NOTE: [byte vectors on AVX2]), added to `record` like scan_chunk.
template <typename F>
void scan_bytes_vector2(const uint8_t* p, int64_t n, int64_t first, int64_t* record, double& sumsq_out) {
  using BW = ByteWindows<F>;
  const ByteVectors2<F>& tables = byte_vectors2<F>();
  int64_t fields[BW::kFields] = {};
  uint64_t slots[BW::kSlots] = {};  // the current window's counts; slot 0 as the others leave it
  int64_t quad_sums[4] = {};
  __m256i squares[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
  __int128 total = 0;  // the sum of squares in the units of add_low_tally, exact
  uint32_t patterns[1][256];
  bool by_pattern = false;
  uint64_t absmax = 0, absmin = UINT64_MAX;
  int64_t subnormals = 0, padding = 0;
  int square_blocks = 0;
  static thread_local int window_guess = 0;  // as in NOTE: [byte vectors]
  int window = window_guess;
  auto spill_squares = [&]() {
    for (int k = 0; k < 4; ++k) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), squares[k]);
      for (int l = 0; l < 8; ++l) quad_sums[k] += lanes[l];
      squares[k] = _mm256_setzero_si256();
    }
    square_blocks = 0;
  };
  // The current window's counts into `fields` and its squares into `total`: quad q's unit is 4^(4q + w), doubled.
  auto flush_window = [&]() {
    spill_squares();
    for (int k = 0; k < 4; ++k) {
      total += (static_cast<__int128>(quad_sums[k]) * 2) << (2 * (4 * k + window));
      quad_sums[k] = 0;
    }
    for (int s = 0; s < BW::kSlots; ++s) {
      fields[BW::field_of_slot(window, s)] += static_cast<int64_t>(slots[s]);
      slots[s] = 0;
    }
  };
  FingerprintLanes<uint8_t> fingerprint;
  for (int64_t b = 0; b < n; b += kBlockBytes) {
    const uint8_t* q = p + b;
    const int64_t len = std::min(kBlockBytes, n - b);
    const ByteExtremes2 e = byte_extremes2<F>(q, len);
    fingerprint.add(q, len, first + b);  // the block, hot in L1 (NOTE: [fingerprint lanes])
    if (e.max_abs >= static_cast<int>(F::kInfAbsBitsWide) || e.nan_sign_alone) {
      if (!by_pattern) std::memset(patterns, 0, sizeof(patterns));
      by_pattern = true;
      for (int64_t i = 0; i < len; ++i) patterns[0][q[i]]++;
      continue;
    }
    const int fit = BW::window_for(exponent_field<F>(static_cast<typename F::Bits>(e.max_abs)));
    if (fit > window || (b == 0 && fit + 1 < window)) {
      flush_window();  // the counts so far go out under the old window (NOTE: [byte vectors])
      window = fit;
    }
    int min_below = 255;
    for (int k = 0; k < kSteps2; ++k) min_below = std::min(min_below, e.min_below[k]);
    if (min_below != 255) {  // a non-zero value
      absmax = std::max<uint64_t>(absmax, e.max_abs);
      absmin = std::min<uint64_t>(absmin, min_below + 1);
    }
    const int64_t counted = count_byte_block2<F>(tables, q, len, window, slots, squares);
    const int64_t elements = (len + 31) / 32 * 32;  // the vectors' elements, the short last one's zeros included
    padding += elements - len;
    // Slot 0 holds the zeros, the subnormals and the normal values below the window; the last are counted in their
    // own fields by the tally, from the steps that hold one.
    const int bottom = BW::bottom_bits(window);
    int64_t low_normals = 0;
    bool any_low = false;
    uint32_t by_abs[128];
    for (int k = 0; k < kSteps2; ++k) {
      if (e.min_below[k] >= bottom - 1) continue;
      if (!any_low) std::memset(by_abs, 0, sizeof(by_abs[0]) * bottom);
      any_low = true;
      const int64_t step = k * kByteStep2;
      tally_low_bytes2<F>(q + step, std::min(len, step + kByteStep2) - step, bottom, by_abs);
    }
    if (any_low) low_normals = add_low_tally<F>(by_abs, bottom, record, fields, subnormals, total);
    slots[0] += static_cast<uint64_t>(elements - counted - low_normals);
    if (++square_blocks == kSquareBlocks2) spill_squares();
  }
  flush_window();
  window_guess = window;
  add_fingerprint(record, fingerprint.total());
  finish_byte_chunk<F>(fields, padding, subnormals, total, by_pattern ? patterns : nullptr, absmax, absmin, record,
                       sumsq_out);
}
#endif

// One chunk of a one-byte format, added to `record` like scan_chunk.
template <typename F>
void scan_bytes(const uint8_t* p, int64_t n, int64_t first, int64_t* record, double& sumsq_out) {
  static_assert(F::kBytes == 1, "one-byte formats only");
#if NANSCAN_AVX512_BYTES
  scan_bytes_vector<F>(p, n, first, record, sumsq_out);  // NOTE: [byte vectors]
#elif NANSCAN_AVX2_BYTES
  scan_bytes_vector2<F>(p, n, first, record, sumsq_out);  // NOTE: [byte vectors on AVX2]
#else
  scan_bytes_by_pattern<F>(p, n, first, record, sumsq_out);  // NOTE: [byte formats]
#endif
}

// NOTE: [record writes]
// A record is 2 KiB (its histogram), and a Monitor's records are fresh memory every step (the history ring keeps the
// last steps' arrays), so setting all of them to the identity before the scan meant two trips to memory per record:
// the scan's reads evicted them again before it added into them. Each record is set where it is first written: by
// the chunk that scans into it, by the merge of its partials, or by scan_cpu for a tensor without elements.
inline void set_identity(int64_t* rec) {
  std::memset(rec, 0, sizeof(int64_t) * record::kWidth);
  rec[record::kAbsMinBits] = record::kAbsMinNone;
}

// NOTE: [float16 widened]
// float16 holds subnormals far more often than the wider formats: a weight of N(0, 0.02) in float16 puts a few in
// almost every 4 KiB block (|x| < 2**-14), and each such block took two more passes (zeros_and_min and
// bin_subnormals), which held float16 at 0.20-0.33 of the read limit against bfloat16's 0.52-0.71 (make bench,
// 2-core development machine). But every float16 value is exactly a float32: F16C's vcvtph2ps widens subnormals,
// infinities and NaNs exactly, whatever the float mode, and the float32 exponent of a widened subnormal is the
// binary exponent classify.h bins it by (bins are binary exponents, the same in every format). So where the CPU has
// F16C, a float16 chunk is read as float32: each block is widened into a buffer of one float32 block (hot in L1) and
// scanned there, at the same offsets from the chunk start (so the sum of squares still depends on the chunk
// size alone, NOTE: [chunking]), into a scratch record that is then added to the chunk's record as float16's: the
// same class counts, bins and squares; the subnormals, which float32 sees as normal values, are the counts of the
// bins below float16's smallest normal, 2**-14; the extremes are narrowed back to float16 bits, exactly, as they are
// float16 values. Small chunks too (NOTE: [small chunks]): their squares must be added in the block path's order.
#if defined(__F16C__)
inline uint64_t narrowed_abs_bits(int64_t float32_abs_bits) {
  float value;
  const uint32_t bits = static_cast<uint32_t>(float32_abs_bits);
  std::memcpy(&value, &bits, sizeof(value));
  return _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);  // exact: the value is a float16 value
}

// A float16 chunk's blocks, each widened to float32 into a buffer of one float32 block, hot in L1.
struct WidenedFloat16 {
  static constexpr int64_t kElems = kBlockBytes / sizeof(uint32_t);
  static_assert(kSmallChunkElems <= kElems, "a small chunk is widened into the buffer of one block");
  const uint16_t* data;
  uint32_t* buffer;

  const uint32_t* block(int64_t begin, int64_t n) const {
    const uint16_t* p = data + begin;
    int64_t i = 0;
#if NANSCAN_AVX512
    for (; i + 16 <= n; i += 16) {
      __builtin_prefetch(reinterpret_cast<const char*>(p + i) + kPrefetchBytes, 0, 2);  // NOTE: [prefetch]
      const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      _mm512_store_ps(reinterpret_cast<float*>(buffer + i), _mm512_cvtph_ps(half));
    }
#endif
    for (; i + 8 <= n; i += 8) {
      __builtin_prefetch(reinterpret_cast<const char*>(p + i) + kPrefetchBytes, 0, 2);
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
      _mm256_store_ps(reinterpret_cast<float*>(buffer + i), _mm256_cvtph_ps(half));
    }
    for (; i < n; ++i) {
      const float value = _cvtsh_ss(p[i]);
      std::memcpy(buffer + i, &value, sizeof(value));
    }
    return buffer;
  }
  // The float16 bits themselves, which block() has just read, are what the fingerprint sums (NOTE: [scan
  // fingerprint]).
  using RawBits = uint16_t;
  const RawBits* raw(int64_t begin) const { return data + begin; }
};

// Adds the scratch record of a widened chunk to `record` as float16's (NOTE: [float16 widened]). Its bins lie between
// those of its extremes: zeros, infinities and NaNs are counted, not binned.
void add_widened_float16(const int64_t* wide, int64_t* record) {
  for (const int k : {record::kNaN, record::kPosInf, record::kNegInf, record::kZero}) record[k] += wide[k];
  add_fingerprint(record, static_cast<uint64_t>(wide[record::kFingerprint]));  // of the float16 bits already
  if (wide[record::kAbsMinBits] == record::kAbsMinNone) return;  // no finite non-zero value
  const int lo = exponent_bin<Float32>(static_cast<uint32_t>(wide[record::kAbsMinBits]));
  const int hi = exponent_bin<Float32>(static_cast<uint32_t>(wide[record::kAbsMaxBits]));
  const int first_normal = bin_of_normal_field<Float16>(1);
  int64_t subnormals = 0;  // no widened float16 value is a float32 subnormal: they are the bins below 2**-14
  for (int b = lo; b <= hi; ++b) {
    record[record::kHist + b] += wide[record::kHist + b];
    if (b < first_normal) subnormals += wide[record::kHist + b];
  }
  record[record::kSubnormal] += subnormals;
  merge_extremes(record, narrowed_abs_bits(wide[record::kAbsMaxBits]), narrowed_abs_bits(wide[record::kAbsMinBits]));
}
#endif

// The record a thread adds its consecutive chunks of one tensor into (NOTE: [chunking]).
struct Partial {
  int64_t task;
  int64_t counts[record::kWidth];
};

// One chunk of a format of two bytes or more, its blocks read through `source` (InPlace, or WidenedFloat16): the
// small-chunk path or the block path, added to `record`.
template <typename F, typename Source>
void scan_words(const Source& source, const Chunk& chunk, int64_t* record, double& sumsq,
                std::unique_ptr<FieldCounts>& counts) {
  const int64_t n = chunk.end - chunk.begin;
  if (n <= kSmallChunkElems) {
    scan_small<F>(source.block(chunk.begin, n), n, record, sumsq);
    add_fingerprint(record, fingerprint_part(source.raw(chunk.begin), n, chunk.begin));
    return;
  }
  if (!counts) {
    counts.reset(new FieldCounts());  // value-initialised; fold_into keeps it zero between chunks
    counts->reset_range();
  }
  scan_chunk<F>(source, chunk.begin, chunk.end, record, sumsq, *counts);
}

// Scans one chunk and adds it to `record` (the task's own, or the thread's partial record of the task); `sumsq`
// gets the chunk's sum of squares.
// `counts` is made on the first chunk that needs it: a scan of small tensors never pays for zeroing its 32 KiB.
void scan_one_chunk(const ScanTask& task, const Chunk& chunk, int64_t* record, double& sumsq,
                    std::unique_ptr<FieldCounts>& counts) {
  with_format(task.dtype, [&](auto format) {
    using F = decltype(format);
    const auto* data = static_cast<const typename F::Bits*>(task.data);
    if constexpr (F::kBytes == 1) {
      scan_bytes<F>(data + chunk.begin, chunk.end - chunk.begin, chunk.begin, record, sumsq);
#if defined(__F16C__)
    } else if constexpr (std::is_same_v<F, Float16>) {  // read as float32 (NOTE: [float16 widened])
      alignas(64) uint32_t buffer[WidenedFloat16::kElems];
      int64_t wide[record::kWidth];
      set_identity(wide);
      scan_words<Float32>(WidenedFloat16{data, buffer}, chunk, wide, sumsq, counts);
      add_widened_float16(wide, record);
#endif
    } else {
      scan_words<F>(InPlace<F>{data}, chunk, record, sumsq, counts);
    }
  });
}

// Adds a partial record's counts and extremes to its task's record; the sum of squares is summed apart.
void merge(int64_t* rec, const Partial& p) {
  for (int k = 0; k < record::kHist + kHistBins; ++k) {
    if (k == record::kAbsMaxBits) rec[k] = std::max(rec[k], p.counts[k]);
    else if (k == record::kAbsMinBits) rec[k] = std::min(rec[k], p.counts[k]);
    else if (k != record::kSumSq) rec[k] += p.counts[k];
  }
  add_fingerprint(rec, static_cast<uint64_t>(p.counts[record::kFingerprint]));  // NOTE: [scan fingerprint]
}

// Asks for the first bytes of a chunk that is about to be scanned (NOTE: [prefetch]). Inlined: as a call it
// measured slower, apparently by the prefetches' timing.
__attribute__((always_inline)) inline void prefetch_chunk_start(const ScanTask& task, const Chunk& chunk) {
  const int64_t width = element_bytes(task.dtype);
  const char* start = static_cast<const char*>(task.data) + chunk.begin * width;
  const int64_t bytes = std::min((chunk.end - chunk.begin) * width, kChunkPrefetchBytes);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset, 0, 2);
}

// The work list (NOTE: [chunking]); `num_partials` chunks belong to tasks of more than one chunk.
struct WorkList {
  std::vector<Chunk> chunks;
  int64_t num_partials = 0;
};

WorkList make_chunks(const ScanTask* tasks, int64_t num_tasks, int64_t chunk_elems) {
  chunk_elems = std::clamp<int64_t>(chunk_elems, 1, kMaxChunkElems);
  WorkList work;
  work.chunks.reserve(num_tasks);
  for (int64_t t = 0; t < num_tasks; ++t) {
    const int64_t numel = tasks[t].numel;
    for (int64_t b = 0; b < numel; b += chunk_elems)
      work.chunks.push_back({t, b, std::min(b + chunk_elems, numel), numel > chunk_elems ? work.num_partials++
                                                                                          : kOwnRecord});
  }
  return work;
}

// Bytes of input per thread below which OpenMP's default thread count is reduced: waking a thread (tens of
// microseconds, far more on a busy machine, where the region waits for a core) costs more than reading this much.
constexpr int64_t kMinBytesPerThread = int64_t(1) << 20;

// `num_threads` as asked for, or for 0 OpenMP's default, limited by the work there is. The records do not depend on
// the thread count (NOTE: [chunking]).
int resolve_threads(int num_threads, const ScanTask* tasks, int64_t num_tasks, int64_t num_chunks) {
  int64_t threads = num_threads;
  if (threads <= 0) {
#ifdef _OPENMP
    threads = omp_get_max_threads();
#else
    threads = 1;
#endif
    int64_t bytes = 0;
    for (int64_t t = 0; t < num_tasks; ++t) bytes += tasks[t].numel * element_bytes(tasks[t].dtype);
    threads = std::min(threads, bytes / kMinBytesPerThread + 1);
  }
  threads = std::min(threads, num_chunks);
  return static_cast<int>(std::max<int64_t>(threads, 1));
}

// Spins of a waiting thread (NOTE: [wake overlap]) before it yields its core between looks: some tens of us.
constexpr int64_t kSpinsBeforeYield = 2000;

inline void cpu_relax() {
#if defined(__SSE2__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

// NOTE: [wake overlap]
// Between two training steps the scan's other threads go to sleep (OpenMP spins only briefly), and waking one takes
// tens of microseconds: 55-70 us on the 2-core development VM, where an idle virtual CPU must be rescheduled, which is
// as long as the scan's own share of a small model. With dynamic scheduling the calling thread starts on the chunks
// alone meanwhile, but the wake still shows in the scan's time. So the work that must precede the scan (for the
// Monitor, the per-step plan check that finds the data pointers) runs inside the parallel region, on the calling
// thread, while the others wake and wait for it to say go. Waiting threads spin (pause), and yield the core once the
// wait is long: on an oversubscribed machine the spinner may share the core with the thread it waits for. This
// matters only when the scan has more than one thread: where nanscan and torch load the same OpenMP runtime (torch's
// Linux wheels bring libgomp.so.1), OpenMP's default thread count is the one torch.set_num_threads sets, so a loop
// that runs torch on one thread scans on the calling thread alone.

void scan_cpu(ScanTask* tasks, int64_t num_tasks, int64_t* records, int64_t chunk_elems, int num_threads,
              const Prologue& prologue) {
  const WorkList work = make_chunks(tasks, num_tasks, chunk_elems);
  const std::vector<Chunk>& chunks = work.chunks;
  // The sums of squares of the chunks of tasks of more than one chunk, each written by its chunk.
  std::vector<double> chunk_sumsq(work.num_partials);
  const int64_t n = static_cast<int64_t>(chunks.size());
  num_threads = resolve_threads(num_threads, tasks, num_tasks, n);
  // Each thread's partial records, in the order it made them; nothing is allocated when every task is one chunk.
  std::vector<std::vector<std::unique_ptr<Partial>>> partials(work.num_partials > 0 ? num_threads : 0);
  enum : int { kWait, kGo, kCancel };
  std::atomic<int> state{prologue ? kWait : kGo};
  std::exception_ptr failure;
#pragma omp parallel num_threads(num_threads)
  {
    if (state.load(std::memory_order_acquire) == kWait) {
#ifdef _OPENMP
      const bool caller = omp_get_thread_num() == 0;
#else
      const bool caller = true;
#endif
      if (caller) {
        bool go = false;
        try {
          go = prologue(tasks);
        } catch (...) {
          failure = std::current_exception();
        }
        state.store(go ? kGo : kCancel, std::memory_order_release);
      } else {
        for (int64_t spins = 0; state.load(std::memory_order_acquire) == kWait; ++spins) {
          if (spins < kSpinsBeforeYield) cpu_relax();
          else std::this_thread::yield();
        }
      }
    }
    if (state.load(std::memory_order_acquire) == kGo) {
      const ExactFloatMode float_mode;  // NOTE: [float mode]
      std::unique_ptr<FieldCounts> counts;
#ifdef _OPENMP
      const int thread = omp_get_thread_num();
#else
      const int thread = 0;
#endif
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) {
        const Chunk& chunk = chunks[i];
        for (int64_t next = i + 1; next <= i + kChunksAhead && next < n; ++next)
          prefetch_chunk_start(tasks[chunks[next].task], chunks[next]);
        if (chunk.partial == kOwnRecord) {
          int64_t* own = records + chunk.task * record::kWidth;
          set_identity(own);
          double sumsq = 0.0;
          scan_one_chunk(tasks[chunk.task], chunk, own, sumsq, counts);
          std::memcpy(own + record::kSumSq, &sumsq, sizeof(double));
        } else {
          // A thread's chunks come in list order, so once it has left a task it never takes one of its chunks again.
          std::vector<std::unique_ptr<Partial>>& mine = partials[thread];
          if (mine.empty() || mine.back()->task != chunk.task) {
            mine.emplace_back(new Partial);
            mine.back()->task = chunk.task;
            set_identity(mine.back()->counts);
          }
          scan_one_chunk(tasks[chunk.task], chunk, mine.back()->counts, chunk_sumsq[chunk.partial], counts);
        }
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  if (state.load(std::memory_order_relaxed) != kGo) return;
  for (int64_t t = 0; t < num_tasks; ++t)
    if (tasks[t].numel == 0) set_identity(records + t * record::kWidth);  // no chunk wrote it
  if (work.num_partials == 0) return;  // every task was one chunk (a Monitor's check of a small model)
  // The chunks of a task lie next to each other in the list, in order: their sums of squares are added in that order
  // (NOTE: [chunking]); the counts and extremes, exact, in any.
  for (const Chunk& chunk : chunks)
    if (chunk.partial != kOwnRecord && chunk.begin == 0) set_identity(records + chunk.task * record::kWidth);
  for (const std::vector<std::unique_ptr<Partial>>& mine : partials)
    for (const std::unique_ptr<Partial>& p : mine) merge(records + p->task * record::kWidth, *p);
  double sumsq = 0.0;
  for (const Chunk& chunk : chunks) {
    if (chunk.partial == kOwnRecord) continue;
    if (chunk.begin == 0) sumsq = 0.0;
    sumsq += chunk_sumsq[chunk.partial];
    if (chunk.end == tasks[chunk.task].numel)
      std::memcpy(records + chunk.task * record::kWidth + record::kSumSq, &sumsq, sizeof(double));
  }
}

int64_t count_nonfinite(const int64_t* records, int64_t num_tasks) {
  int64_t nonfinite = 0;
  for (int64_t t = 0; t < num_tasks; ++t) {
    const int64_t* r = records + t * record::kWidth;
    nonfinite += (r[record::kNaN] | r[record::kPosInf] | r[record::kNegInf]) != 0;
  }
  return nonfinite;
}

const char* float8_path() {
#if NANSCAN_AVX512_BYTES
  return "avx512";
#elif NANSCAN_AVX2_BYTES
  return "avx2";
#else
  return "patterns";
#endif
}

uint64_t read_bandwidth_probe(const ScanTask* tasks, int64_t num_tasks, int64_t chunk_elems, int num_threads) {
  const std::vector<Chunk> chunks = make_chunks(tasks, num_tasks, chunk_elems).chunks;
  const int64_t n = static_cast<int64_t>(chunks.size());
  uint64_t checksum = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(resolve_threads(num_threads, tasks, num_tasks, n)) \
    reduction(^ : checksum)
  for (int64_t i = 0; i < n; ++i) {
    const ScanTask& task = tasks[chunks[i].task];
    const int64_t width = element_bytes(task.dtype);
    const auto* bytes = static_cast<const unsigned char*>(task.data) + chunks[i].begin * width;
    const int64_t size = (chunks[i].end - chunks[i].begin) * width;
    // XOR of 64-bit words in independent lanes: one cheap vector op per load, so only memory limits the loop.
    constexpr int kLanes = 16;
    VU64 acc[kLanes / kWordsPerVector] = {};
    int64_t off = 0;
    // The scan asks for the bytes kPrefetchBytes ahead (NOTE: [prefetch]), so the probe does too, or the limit
    // would be set by the hardware prefetcher alone: 512 MiB at 2 threads, median of 15 rounds, 34 GB/s without,
    // 39-40 with (the scans read up to 31, more than before).
    for (; off + 8 * kLanes <= size; off += 8 * kLanes) {
      for (int l = 0; l < 8 * kLanes; l += 64) __builtin_prefetch(bytes + off + l + kPrefetchBytes, 0, 2);
      for (int v = 0; v < kLanes / kWordsPerVector; ++v) acc[v] ^= load_bits<VU64>(bytes + off + kVectorBytes * v);
    }
    uint64_t word = 0;
    for (int v = 0; v < kLanes / kWordsPerVector; ++v)
      for (int l = 0; l < kWordsPerVector; ++l) word ^= acc[v][l];
    // Folded to one byte, the checksum is the XOR of every byte read, whatever the chunking: tests can check it.
    for (int s = 32; s >= 8; s /= 2) word ^= word >> s;
    uint64_t byte = word & 0xff;
    for (; off < size; ++off) byte ^= bytes[off];
    checksum ^= byte;
  }
  return checksum;
}

}  // namespace nanscan
