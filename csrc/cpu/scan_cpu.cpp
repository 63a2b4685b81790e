// scan_cpu.cpp: the multi-tensor scan on the CPU, OpenMP over chunks of all tensors; classification from classify.h.
#include "scan_cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "nanscan/classify.h"
#include "nanscan/stats_record.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace nanscan {
namespace {

// NOTE: [chunking]
// Every tensor is cut into chunks of at most chunk_elems elements; the chunks of all tensors form one work list so
// that one large tensor and many small ones load the threads evenly. Each chunk produces a partial record; the
// partials are merged per tensor in chunk order, so even the float64 sum of squares is the same on every run and
// for every thread count.
struct Chunk {
  int64_t task;
  int64_t begin;
  int64_t end;
};

struct Partial {
  int64_t counts[record::kWidth];
  double sumsq;
};

void init_partial(Partial& p) {
  std::memset(p.counts, 0, sizeof(p.counts));
  p.counts[record::kAbsMinBits] = record::kAbsMinNone;
  p.sumsq = 0.0;
}

template <typename F>
void scan_chunk(const typename F::Bits* data, int64_t begin, int64_t end, Partial& out) {
  using Bits = typename F::Bits;
  int64_t* c = out.counts;
  uint64_t absmax = 0;
  uint64_t absmin = UINT64_MAX;
  double sumsq = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    const Bits bits = data[i];
    const ValueClass cls = classify<F>(bits);
    switch (cls) {
      case kNaN: c[record::kNaN]++; continue;
      case kPosInf: c[record::kPosInf]++; continue;
      case kNegInf: c[record::kNegInf]++; continue;
      case kZero: c[record::kZero]++; continue;
      case kSubnormal:
        c[record::kSubnormal]++;
        c[record::kHist + bin_of_subnormal<F>(bits)]++;
        break;
      case kNormal:
        c[record::kHist + bin_of_normal_field<F>(exponent_field<F>(bits))]++;
        break;
    }
    const uint64_t a = static_cast<uint64_t>(abs_bits<F>(bits));
    absmax = std::max(absmax, a);
    absmin = std::min(absmin, a);
    const double v = abs_to_double<F>(bits);
    sumsq += v * v;
  }
  c[record::kAbsMaxBits] = static_cast<int64_t>(absmax);
  if (absmin != UINT64_MAX) c[record::kAbsMinBits] = static_cast<int64_t>(absmin);
  out.sumsq = sumsq;
}

void scan_chunk_dispatch(const ScanTask& task, const Chunk& chunk, Partial& out) {
  switch (task.dtype) {
    case kFloat16: scan_chunk<Float16>(static_cast<const uint16_t*>(task.data), chunk.begin, chunk.end, out); break;
    case kBFloat16: scan_chunk<BFloat16>(static_cast<const uint16_t*>(task.data), chunk.begin, chunk.end, out); break;
    case kFloat32: scan_chunk<Float32>(static_cast<const uint32_t*>(task.data), chunk.begin, chunk.end, out); break;
    case kFloat64: scan_chunk<Float64>(static_cast<const uint64_t*>(task.data), chunk.begin, chunk.end, out); break;
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

}  // namespace

void scan_cpu(const ScanTask* tasks, int64_t num_tasks, int64_t* records, int64_t chunk_elems, int num_threads) {
  chunk_elems = std::max<int64_t>(chunk_elems, 1);
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < num_tasks; ++t)
    for (int64_t b = 0; b < tasks[t].numel; b += chunk_elems)
      chunks.push_back({t, b, std::min(b + chunk_elems, tasks[t].numel)});
  std::vector<Partial> partials(chunks.size());
  const int64_t n = static_cast<int64_t>(chunks.size());
#ifdef _OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t i = 0; i < n; ++i) {
    init_partial(partials[i]);
    scan_chunk_dispatch(tasks[chunks[i].task], chunks[i], partials[i]);
  }
  std::vector<double> sums(num_tasks, 0.0);
  for (int64_t i = 0; i < n; ++i) merge(records + chunks[i].task * record::kWidth, sums[chunks[i].task], partials[i]);
  for (int64_t t = 0; t < num_tasks; ++t) std::memcpy(records + t * record::kWidth + record::kSumSq, &sums[t], 8);
}

}  // namespace nanscan
