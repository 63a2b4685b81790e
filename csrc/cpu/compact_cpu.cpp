// compact_cpu.cpp: compact records on the CPU (NOTE: [compact records] in nanscan/compact.h), for host scans and
// for tests of the CUDA path's contract (compact_fixed).
#include "cpu/compact_cpu.h"

#include "cpu/simd.h"

namespace nanscan {
namespace compact {

#if defined(__AVX2__) || NANSCAN_AVX512
namespace {
// Whether any of the 16 bins from 16 * group holds a count.
inline bool group_occupied(const int64_t* hist, int group) {
#if NANSCAN_AVX512
  const int64_t* v = hist + 16 * group;
  const __m512i any = _mm512_or_si512(_mm512_loadu_si512(v), _mm512_loadu_si512(v + 8));
  return _mm512_test_epi64_mask(any, any) != 0;
#else
  const __m256i* v = reinterpret_cast<const __m256i*>(hist + 16 * group);
  const __m256i any = _mm256_or_si256(_mm256_or_si256(_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)),
                                      _mm256_or_si256(_mm256_loadu_si256(v + 2), _mm256_loadu_si256(v + 3)));
  return !_mm256_testz_si256(any, any);
#endif
}
}  // namespace
#endif

BinRange occupied_range(const int64_t* hist) {
  static_assert(kHistBins == 256, "sixteen groups of 16 bins, or four words of a bitmap");
  BinRange r = empty_range();
#if defined(__AVX2__) || NANSCAN_AVX512
  // From each end, 16 bins at a time, until a group holds a count; a record's counts lie in a few tens of bins.
  // A bitmap of all 256 bins cost about 145 ns a record on a Zen 3 (AVX2, built four bins a compare; hot; about
  // 20 us of a small model's check, whose every record is compacted), this 60 ns. With AVX-512 (the bitmap eight
  // bins a compare) compact_records of the demo's records went from 84 to 79 ns a record (Intel, hot).
  int lo = 0;
  while (lo < kHistBins / 16 && !group_occupied(hist, lo)) ++lo;
  if (lo == kHistBins / 16) return r;
  int hi = kHistBins / 16 - 1;
  while (!group_occupied(hist, hi)) --hi;
  r.first = 16 * lo;
  while (hist[r.first] == 0) ++r.first;
  r.last = 16 * hi + 15;
  while (hist[r.last] == 0) --r.last;
#else
  uint64_t nonzero[4] = {0, 0, 0, 0};
  for (int b = 0; b < kHistBins; ++b) nonzero[b / 64] |= static_cast<uint64_t>(hist[b] != 0) << (b % 64);
  int lo = 0;
  while (lo < 4 && nonzero[lo] == 0) ++lo;
  if (lo == 4) return r;
  int hi = 3;
  while (nonzero[hi] == 0) --hi;
  r.first = 64 * lo + __builtin_ctzll(nonzero[lo]);
  r.last = 64 * hi + 63 - __builtin_clzll(nonzero[hi]);
#endif
  for (int32_t b = r.first; b <= r.last; ++b) {
    const uint64_t count = static_cast<uint64_t>(hist[b]);
    r.largest = count > r.largest ? count : r.largest;
  }
  return r;
}

int64_t compact_ranges(const int64_t* records, int64_t rows, int64_t* scalars, int16_t* ranges, uint64_t* largest) {
  int64_t total = 0;
  uint64_t top = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* record = records + r * record::kWidth;
    for (int s = 0; s < kScalarSlots; ++s) scalars[r * kScalarSlots + s] = record[scalar_slot(s)];
    const BinRange range = occupied_range(record + record::kHist);
    ranges[2 * r] = static_cast<int16_t>(stored_first(range));
    ranges[2 * r + 1] = static_cast<int16_t>(stored_width(range));
    total += stored_width(range);
    if (range.largest > top) top = range.largest;
  }
  *largest = top;
  return total;
}

template <typename Count>
void compact_counts(const int64_t* records, int64_t rows, const int16_t* ranges, Count* counts) {
  int64_t at = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* hist = records + r * record::kWidth + record::kHist + ranges[2 * r];
    const int32_t width = ranges[2 * r + 1];
    for (int32_t j = 0; j < width; ++j) counts[at + j] = static_cast<Count>(hist[j]);
    at += width;
  }
}

template void compact_counts<uint8_t>(const int64_t*, int64_t, const int16_t*, uint8_t*);
template void compact_counts<uint16_t>(const int64_t*, int64_t, const int16_t*, uint16_t*);
template void compact_counts<uint32_t>(const int64_t*, int64_t, const int16_t*, uint32_t*);
template void compact_counts<uint64_t>(const int64_t*, int64_t, const int16_t*, uint64_t*);

void compact_fixed(const int64_t* records, int64_t rows, int64_t* scalars, int16_t* ranges, uint32_t* counts,
                   int64_t capacity, int64_t* status) {
  uint64_t largest = 0;
  const int64_t total = compact_ranges(records, rows, scalars, ranges, &largest);
  const bool fits = total <= capacity && largest <= kMaxFixedCount;
  status[kStatusTotal] = total;
  status[kStatusFits] = fits ? 1 : 0;
  if (fits) compact_counts(records, rows, ranges, counts);
}

}  // namespace compact
}  // namespace nanscan
