// compact_cpu.h: the CPU encoder of compact records (NOTE: [compact records] in nanscan/compact.h). Plain pointers.
#pragma once

#include <cstdint>

#include "nanscan/compact.h"

namespace nanscan {
namespace compact {

// The occupied bins of one record's whole histogram (the first and last nonzero bin, the largest count), from a
// bitmap of its nonzero bins built a vector at a time. Against a scalar search from each end, compact_records of the
// demo model's 147 records went from 7.9 to 6.2 us with the records in cache (the call and its arrays included); in
// a training step, where they are not, the reads dominate (NOTE: [step summary] in csrc/plan/plan_check.cpp).
BinRange occupied_range(const int64_t* hist);

// Writes each row's scalars and (first, width) and returns the total of the widths; `largest` gets the largest
// count. records: rows x record::kWidth int64; scalars: rows x kScalarSlots; ranges: rows x 2.
int64_t compact_ranges(const int64_t* records, int64_t rows, int64_t* scalars, int16_t* ranges, uint64_t* largest);

// Writes the counts of the ranges compact_ranges wrote, in row order, as Count (uint8/16/32/64: the caller picks
// one that holds `largest`).
template <typename Count>
void compact_counts(const int64_t* records, int64_t rows, const int16_t* ranges, Count* counts);

// The CPU twin of the CUDA compaction (compact_cuda.cu), with its fixed-capacity contract: scalars and ranges
// always, the counts as uint32 into `capacity` slots only when they fit (status: kStatusTotal, kStatusFits).
void compact_fixed(const int64_t* records, int64_t rows, int64_t* scalars, int16_t* ranges, uint32_t* counts,
                   int64_t capacity, int64_t* status);

}  // namespace compact
}  // namespace nanscan
