// compact_cuda.cu: a step's stats records compacted on the GPU behind its scan (NOTE: [compact records] in
// nanscan/compact.h), so that the history ring keeps a few hundred bytes per tensor on the device, not 2 KiB.
//
// A warp per row finds its range (each lane every 32nd bin, merged with shuffles: the reads are coalesced), one
// block turns the widths into offsets and decides whether the step fits, then a warp per row copies its counts.
// Nothing waits for the GPU; the caller reads `status` with the step's verdict.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "cuda/compact_cuda.h"
#include "nanscan/compact.h"

namespace nanscan {
namespace cuda {
namespace {

using u64 = unsigned long long;  // the type CUDA's 64-bit shuffles and atomics take

constexpr int kLanes = 32;
constexpr int kRowsPerBlock = 8;  // warps of the per-row kernels
constexpr int kOffsetThreads = 1024;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(compact::kScalarSlots <= kLanes, "a lane copies each scalar slot");

__global__ void ranges_kernel(const int64_t* records, int64_t rows, int64_t* scalars, int16_t* ranges,
                              int64_t* widths, u64* row_largest) {
  const int lane = threadIdx.x % kLanes;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (r >= rows) return;  // the whole warp: r is the warp's
  const int64_t* record = records + r * record::kWidth;
  if (lane < compact::kScalarSlots) scalars[r * compact::kScalarSlots + lane] = record[compact::scalar_slot(lane)];
  compact::BinRange range = compact::scan_bins(record + record::kHist, lane, kLanes);
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    const compact::BinRange other{__shfl_xor_sync(kFullMask, range.first, offset),
                                  __shfl_xor_sync(kFullMask, range.last, offset),
                                  __shfl_xor_sync(kFullMask, static_cast<u64>(range.largest), offset)};
    range = compact::merge(range, other);
  }
  if (lane == 0) {
    ranges[2 * r] = static_cast<int16_t>(compact::stored_first(range));
    ranges[2 * r + 1] = static_cast<int16_t>(compact::stored_width(range));
    widths[r] = compact::stored_width(range);
    row_largest[r] = range.largest;
  }
}

// One block: exclusive offsets of the widths in chunks of kOffsetThreads rows, carrying the running total.
__global__ void offsets_kernel(const int64_t* widths, const u64* row_largest, int64_t rows, int64_t capacity,
                               int64_t* offsets, int64_t* status) {
  using BlockScan = cub::BlockScan<int64_t, kOffsetThreads>;
  __shared__ typename BlockScan::TempStorage temp;
  __shared__ int64_t carry;
  __shared__ u64 largest;
  if (threadIdx.x == 0) {
    carry = 0;
    largest = 0;
  }
  u64 top = 0;
  for (int64_t base = 0; base < rows; base += kOffsetThreads) {
    __syncthreads();  // carry written, temp free again
    const int64_t r = base + threadIdx.x;
    const int64_t width = r < rows ? widths[r] : 0;
    if (r < rows && row_largest[r] > top) top = row_largest[r];
    int64_t before = 0, chunk_total = 0;
    BlockScan(temp).ExclusiveSum(width, before, chunk_total);
    if (r < rows) offsets[r] = carry + before;
    __syncthreads();  // every thread has read carry
    if (threadIdx.x == 0) carry += chunk_total;
  }
  __syncthreads();
  atomicMax(&largest, top);
  __syncthreads();
  if (threadIdx.x == 0) {
    status[compact::kStatusTotal] = carry;
    status[compact::kStatusFits] = carry <= capacity && largest <= compact::kMaxFixedCount ? 1 : 0;
  }
}

__global__ void counts_kernel(const int64_t* records, int64_t rows, const int16_t* ranges, const int64_t* offsets,
                              const int64_t* status, uint32_t* counts) {
  if (status[compact::kStatusFits] == 0) return;
  const int lane = threadIdx.x % kLanes;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (r >= rows) return;
  const int64_t* hist = records + r * record::kWidth + record::kHist + ranges[2 * r];
  const int32_t width = ranges[2 * r + 1];
  uint32_t* out = counts + offsets[r];
  for (int32_t j = lane; j < width; j += kLanes) out[j] = static_cast<uint32_t>(hist[j]);
}

}  // namespace

int compact_cuda(const CompactParams& p) {
  cudaError_t err = cudaSetDevice(p.device);
  if (err != cudaSuccess) return err;
  auto stream = static_cast<cudaStream_t>(p.stream);
  int64_t* widths = p.workspace;
  u64* row_largest = reinterpret_cast<u64*>(p.workspace + p.rows);
  int64_t* offsets = p.workspace + 2 * p.rows;
  const unsigned blocks = static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  if (p.rows > 0)
    ranges_kernel<<<blocks, kRowsPerBlock * kLanes, 0, stream>>>(p.records, p.rows, p.scalars, p.ranges, widths,
                                                                 row_largest);
  offsets_kernel<<<1, kOffsetThreads, 0, stream>>>(widths, row_largest, p.rows, p.capacity, offsets, p.status);
  if (p.rows > 0)
    counts_kernel<<<blocks, kRowsPerBlock * kLanes, 0, stream>>>(p.records, p.rows, p.ranges, offsets, p.status,
                                                                 p.counts);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace nanscan
