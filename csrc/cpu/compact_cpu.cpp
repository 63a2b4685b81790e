// compact_cpu.cpp: compact records on the CPU (NOTE: [compact records] in nanscan/compact.h), for host scans and
// for tests of the CUDA path's contract (compact_fixed).
#include "cpu/compact_cpu.h"

#include "nanscan/compact.h"

namespace nanscan {
namespace compact {

int64_t compact_ranges(const int64_t* records, int64_t rows, int64_t* scalars, int16_t* ranges, uint64_t* largest) {
  int64_t total = 0;
  uint64_t top = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* record = records + r * record::kWidth;
    for (int s = 0; s < record::kHist; ++s) scalars[r * record::kHist + s] = record[s];
    const BinRange range = trimmed_range(record + record::kHist);
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
