// compact.h: a stats record's histogram trimmed to its occupied bins (NOTE: [compact records]), the per-row
// logic shared by the CPU encoder (csrc/cpu/compact_cpu.cpp) and the CUDA kernels (csrc/cuda/compact_cuda.cu).
//
// NOTE: [compact records]
// A step's records compact into three arrays:
//   scalars  int64 (rows, kScalarSlots): the slots outside the histogram, as they are, in record order (the slots
//            before it, then the fingerprint after it: scalar_slot);
//   ranges   int16 (rows, 2): the row's first occupied bin and the number of bins from it to its last occupied
//            one, the empty bins between included; (0, 0) for a row whose histogram is empty (a tensor of zeros,
//            NaNs or infinities only);
//   counts   the bins of those ranges, concatenated in row order, as unsigned integers.
// Decoding puts every count back at its bin and zeros elsewhere, so it gives exactly the int64 records (counts are
// never negative). The ranges are always trimmed to the first and last nonzero bin, so the same records give the
// same arrays. nanscan/engine/compact.py holds the numpy reference of both directions.
#pragma once

#include <cstdint>

#include "nanscan/classify.h"
#include "nanscan/stats_record.h"

namespace nanscan {
namespace compact {

// A record's slots outside its histogram, which the scalars hold as they are: s < record::kHist before it, the
// others (the fingerprint, NOTE: [scan fingerprint]) after it.
constexpr int kScalarSlots = record::kWidth - kHistBins;
NANSCAN_HD int scalar_slot(int s) { return s < record::kHist ? s : s + kHistBins; }

// The occupied part of a histogram seen so far: bins [first, last] hold every nonzero count, `largest` is the
// largest count. Empty: first > last.
struct BinRange {
  int32_t first;
  int32_t last;
  uint64_t largest;
};

NANSCAN_HD BinRange empty_range() { return BinRange{kHistBins, -1, 0}; }

// The range of bins begin, begin + stride, ... below kHistBins (a CUDA lane takes every 32nd bin).
NANSCAN_HD BinRange scan_bins(const int64_t* hist, int32_t begin, int32_t stride) {
  BinRange r = empty_range();
  for (int32_t b = begin; b < kHistBins; b += stride) {
    const uint64_t count = static_cast<uint64_t>(hist[b]);
    if (count != 0) {
      if (b < r.first) r.first = b;
      r.last = b;
      if (count > r.largest) r.largest = count;
    }
  }
  return r;
}

NANSCAN_HD BinRange merge(BinRange a, BinRange b) {
  return BinRange{a.first < b.first ? a.first : b.first, a.last > b.last ? a.last : b.last,
                  a.largest > b.largest ? a.largest : b.largest};
}

// The stored (first, width) of a range: (0, 0) when it is empty.
NANSCAN_HD int32_t stored_first(BinRange r) { return r.last < r.first ? 0 : r.first; }
NANSCAN_HD int32_t stored_width(BinRange r) { return r.last < r.first ? 0 : r.last + 1 - r.first; }

// Where the compacted step's totals live (the `status` array, int64): how many counts the ranges hold, and
// whether they were written (1) or did not fit the counts array given (0: more bins than its capacity, or a count
// beyond uint32; the caller then keeps the dense records).
constexpr int kStatusTotal = 0;
constexpr int kStatusFits = 1;
constexpr int kStatusSlots = 2;
constexpr uint64_t kMaxFixedCount = 0xFFFFFFFFull;

}  // namespace compact
}  // namespace nanscan
