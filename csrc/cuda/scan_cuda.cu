// scan_cuda.cu: the multi-tensor CUDA scan (NOTE: [cuda scan] in multi_tensor.cuh): record initialisation, the
// chunk-table kernel with its per-piece merge, the found_inf finalize, and a CPU run of the same per-thread code.
#include <cuda_runtime.h>

#include <climits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/multi_tensor.cuh"
#include "cuda/scan_cuda.h"

namespace nanscan {
namespace cuda {
namespace {

constexpr int kSmallKernelThreads = 256;
constexpr int kScalarCounts = 5;  // nan, posinf, neginf, zero, subnormal: record slots 0..4 in this order
static_assert(record::kNaN == 0 && record::kPosInf == 1 && record::kNegInf == 2 && record::kZero == 3 &&
                  record::kSubnormal == 4,
              "the merge adds the scalar counts to record slots 0..4 in order");

using u64 = unsigned long long;  // the type CUDA's 64-bit atomics take

struct BlockShared {
  uint32_t table[kTableWords];  // the field table (NOTE: [cuda scan], 4): 32 KiB
  uint32_t bins[kHistBins];     // subnormals, binned one by one
  uint32_t counts[kWarps][kScalarCounts];
  u64 absmax[kWarps];
  u64 absmin_minus_one[kWarps];  // ULLONG_MAX: no finite non-zero value
  double sumsq[kWarps];
  u64 fingerprint[kWarps];  // NOTE: [scan fingerprint]
  int first_row, last_row;
  bool any_subnormal;
};

// The field table and subnormal bins as seen by one thread: its own column of the table.
struct SharedHist {
  uint32_t* column;
  uint32_t* bins;
  NANSCAN_HD void add_slot(int slot) {
#if defined(__CUDA_ARCH__)
    atomicAdd(slot_counter(column, slot), 1u);
#endif
  }
  NANSCAN_HD void add_bin(int bin) {
#if defined(__CUDA_ARCH__)
    atomicAdd(bins + bin, 1u);
#endif
  }
};

__device__ __forceinline__ void add_to_record(int64_t* slot, u64 value) {
  atomicAdd(reinterpret_cast<u64*>(slot), value);
}

__device__ __forceinline__ u64 warp_max(u64 v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const u64 other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ u64 warp_min(u64 v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const u64 other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = other < v ? other : v;
  }
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// A wrapping sum mod 2^64 (the fingerprint's): exact in any order.
__device__ __forceinline__ u64 warp_sum(u64 v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// End of a piece (NOTE: [cuda scan], 5): every thread of the block calls it. Leaves the table and bins zeroed.
template <typename F>
__device__ void flush_piece(const LaneScan<F>& lane, BlockShared& sh, int64_t* rec) {
  const int warp = threadIdx.x / kWarpSize;
  const int lane_id = threadIdx.x % kWarpSize;

  uint32_t counts[kScalarCounts] = {lane.nan, lane.posinf, lane.neginf, lane.zero, lane.subnormal};
  for (int k = 0; k < kScalarCounts; ++k) counts[k] = __reduce_add_sync(0xffffffffu, counts[k]);
  const u64 absmax = warp_max(lane.absmax);
  const u64 absmin_minus_one =
      warp_min(lane.absmin_minus_one == LaneScan<F>::kNone ? ULLONG_MAX : u64(lane.absmin_minus_one));
  const double sumsq = warp_sum(lane.sumsq);
  const u64 fingerprint = warp_sum(static_cast<u64>(lane.fingerprint));
  if (lane_id == 0) {
    for (int k = 0; k < kScalarCounts; ++k) sh.counts[warp][k] = counts[k];
    sh.absmax[warp] = absmax;
    sh.absmin_minus_one[warp] = absmin_minus_one;
    sh.sumsq[warp] = sumsq;
    sh.fingerprint[warp] = fingerprint;
  }
  __syncthreads();  // the piece's table increments and the per-warp partials are all in shared memory

  if (warp == 0) {
    const bool has = lane_id < kWarps;
    uint32_t total[kScalarCounts];
    for (int k = 0; k < kScalarCounts; ++k) total[k] = __reduce_add_sync(0xffffffffu, has ? sh.counts[lane_id][k] : 0u);
    const u64 block_max = warp_max(has ? sh.absmax[lane_id] : 0ull);
    const u64 block_min_minus_one = warp_min(has ? sh.absmin_minus_one[lane_id] : ULLONG_MAX);
    const double block_sumsq = warp_sum(has ? sh.sumsq[lane_id] : 0.0);
    const u64 block_fingerprint = warp_sum(has ? sh.fingerprint[lane_id] : 0ull);
    if (lane_id == 0) {
      for (int k = 0; k < kScalarCounts; ++k)
        if (total[k] != 0) add_to_record(rec + k, total[k]);
      const bool has_min = block_min_minus_one != ULLONG_MAX;
      if (block_max != 0) atomicMax(reinterpret_cast<u64*>(rec + record::kAbsMaxBits), block_max);
      if (has_min) atomicMin(reinterpret_cast<u64*>(rec + record::kAbsMinBits), block_min_minus_one + 1);
      if (block_sumsq != 0.0) atomicAdd(reinterpret_cast<double*>(rec + record::kSumSq), block_sumsq);
      if (block_fingerprint != 0) add_to_record(rec + record::kFingerprint, block_fingerprint);
      touched_rows<F>(has_min, block_min_minus_one + 1, block_max, &sh.first_row, &sh.last_row);
      sh.any_subnormal = total[record::kSubnormal] != 0;
    }
  }
  __syncthreads();  // first_row, last_row, any_subnormal are set

  // Row 0, then rows first..last: a warp per row, a word per lane, one warp-wide sum.
  const int first = sh.first_row;
  const int rows = 1 + (sh.last_row >= first ? sh.last_row - first + 1 : 0);
  for (int i = warp; i < rows; i += kWarps) {
    const int row = i == 0 ? 0 : first + i - 1;
    uint32_t& word = sh.table[row * kWarpSize + lane_id];
    const uint32_t count = __reduce_add_sync(0xffffffffu, word);
    word = 0;
    const int index = slot_record_index<F>(row);
    if (lane_id == 0 && count != 0 && index >= 0) add_to_record(rec + index, count);
  }
  if (sh.any_subnormal) {
    for (int bin = threadIdx.x; bin < kHistBins; bin += kThreads) {
      const uint32_t count = sh.bins[bin];
      if (count != 0) {
        add_to_record(rec + record::kHist + bin, count);
        sh.bins[bin] = 0;
      }
    }
  }
  __syncthreads();  // table, bins and partials are free for the next piece
}

template <typename F>
__device__ void scan_piece(const ChunkMeta& meta, int64_t* records, BlockShared& sh) {
  const auto* data = reinterpret_cast<const typename F::Bits*>(meta.data);
  int64_t* rec = records + static_cast<int64_t>(meta.tensor) * record::kWidth;
  SharedHist hist{sh.table + threadIdx.x % kWarpSize, sh.bins};
  // One pass unless a piece is longer than the 32-bit counters allow (the host never cuts one so long).
  for (int64_t begin = meta.begin; begin < meta.end; begin += kMaxChunkElems) {
    const int64_t end = meta.end - begin > kMaxChunkElems ? begin + kMaxChunkElems : meta.end;
    LaneScan<F> lane;
    scan_range<F>(data, begin, end, static_cast<int>(threadIdx.x), lane, hist);
    flush_piece<F>(lane, sh, rec);
  }
}

__global__ void __launch_bounds__(kThreads, 2)
    scan_chunks_kernel(const ChunkMeta* __restrict__ chunks, const int64_t* __restrict__ block_begin,
                       int64_t* __restrict__ records) {
  __shared__ BlockShared sh;
  for (int i = threadIdx.x; i < kTableWords; i += kThreads) sh.table[i] = 0;
  for (int i = threadIdx.x; i < kHistBins; i += kThreads) sh.bins[i] = 0;
  __syncthreads();
  const int64_t last = block_begin[blockIdx.x + 1];
  for (int64_t c = block_begin[blockIdx.x]; c < last; ++c) {
    const ChunkMeta meta = chunks[c];
    switch (meta.dtype) {  // the same for the whole block, so no divergence
      case kFloat16: scan_piece<Float16>(meta, records, sh); break;
      case kBFloat16: scan_piece<BFloat16>(meta, records, sh); break;
      case kFloat32: scan_piece<Float32>(meta, records, sh); break;
      case kFloat64: scan_piece<Float64>(meta, records, sh); break;
      case kFloat8E4M3FN: scan_piece<Float8E4M3FN>(meta, records, sh); break;
      case kFloat8E5M2: scan_piece<Float8E5M2>(meta, records, sh); break;
      case kFloat8E4M3FNUZ: scan_piece<Float8E4M3FNUZ>(meta, records, sh); break;
      case kFloat8E5M2FNUZ: scan_piece<Float8E5M2FNUZ>(meta, records, sh); break;
      default: break;  // the host validates dtype codes before it builds the table
    }
  }
}

// Every record starts as the identity of its merge: counts 0, absmax 0, absmin "none", sumsq +0.0.
__global__ void init_records_kernel(int64_t* records, int64_t num_slots) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < num_slots; i += int64_t(gridDim.x) * blockDim.x)
    records[i] = i % record::kWidth == record::kAbsMinBits ? record::kAbsMinNone : 0;
}

__global__ void found_inf_kernel(const int64_t* records, int64_t num_tensors, float* found_inf) {
  int any = 0;
  for (int64_t t = threadIdx.x; t < num_tensors; t += blockDim.x) {
    const int64_t* rec = records + t * record::kWidth;
    any |= (rec[record::kNaN] | rec[record::kPosInf] | rec[record::kNegInf]) != 0;
  }
  any = __syncthreads_or(any);
  if (threadIdx.x == 0) *found_inf = any ? 1.0f : 0.0f;
}

// A host stand-in for SharedHist: the same column arithmetic on an ordinary array.
struct HostHist {
  uint32_t* column;
  uint32_t* bins;
  NANSCAN_HD void add_slot(int slot) { ++*slot_counter(column, slot); }
  NANSCAN_HD void add_bin(int bin) { ++bins[bin]; }
};

// One pass of scan_piece and flush_piece on the CPU: kThreads threads one after another, then the same merge,
// folding only the rows touched_rows names and checking that every other row stayed empty.
template <typename F>
void scan_pass_on_host(const ChunkMeta& meta, int64_t begin, int64_t end, int64_t* records, uint32_t* table,
                       uint32_t* bins) {
  int64_t* rec = records + static_cast<int64_t>(meta.tensor) * record::kWidth;
  const auto* data = reinterpret_cast<const typename F::Bits*>(meta.data);
  uint64_t block_max = 0, block_min_minus_one = ULLONG_MAX;
  for (int tid = 0; tid < kThreads; ++tid) {
    LaneScan<F> lane;
    HostHist hist{table + tid % kWarpSize, bins};
    scan_range<F>(data, begin, end, tid, lane, hist);
    const uint32_t counts[kScalarCounts] = {lane.nan, lane.posinf, lane.neginf, lane.zero, lane.subnormal};
    for (int k = 0; k < kScalarCounts; ++k) rec[k] += counts[k];
    if (lane.absmax > block_max) block_max = lane.absmax;
    if (lane.absmin_minus_one != LaneScan<F>::kNone && lane.absmin_minus_one < block_min_minus_one)
      block_min_minus_one = lane.absmin_minus_one;
    double sumsq;
    memcpy(&sumsq, rec + record::kSumSq, sizeof sumsq);
    sumsq += lane.sumsq;
    memcpy(rec + record::kSumSq, &sumsq, sizeof sumsq);
    add_fingerprint(rec, lane.fingerprint);
  }
  const bool has_min = block_min_minus_one != ULLONG_MAX;
  if (static_cast<int64_t>(block_max) > rec[record::kAbsMaxBits]) rec[record::kAbsMaxBits] = block_max;
  if (has_min && static_cast<int64_t>(block_min_minus_one + 1) < rec[record::kAbsMinBits])
    rec[record::kAbsMinBits] = block_min_minus_one + 1;
  int first = 0, last = 0;
  touched_rows<F>(has_min, block_min_minus_one + 1, block_max, &first, &last);
  for (int row = 0; row < kTableSlots; ++row) {
    uint64_t count = 0;
    for (int column = 0; column < kWarpSize; ++column) {
      count += table[row * kWarpSize + column];
      table[row * kWarpSize + column] = 0;
    }
    if (count == 0) continue;
    if (row != 0 && (row < first || row > last))
      throw std::logic_error("scan_on_host: table row " + std::to_string(row) + " counted outside the rows [" +
                             std::to_string(first) + ", " + std::to_string(last) + "] the merge folds");
    const int index = slot_record_index<F>(row);
    if (index < 0) throw std::logic_error("scan_on_host: a count in the table row of inf/NaN fields");
    rec[index] += static_cast<int64_t>(count);
  }
  for (int bin = 0; bin < kHistBins; ++bin) {
    rec[record::kHist + bin] += bins[bin];
    bins[bin] = 0;
  }
}

template <typename F>
void scan_piece_on_host(const ChunkMeta& meta, int64_t* records, uint32_t* table, uint32_t* bins) {
  for (int64_t begin = meta.begin; begin < meta.end; begin += kMaxChunkElems) {
    const int64_t end = meta.end - begin > kMaxChunkElems ? begin + kMaxChunkElems : meta.end;
    scan_pass_on_host<F>(meta, begin, end, records, table, bins);
  }
}

}  // namespace

int cuda_grid_blocks(int device, int* blocks) {
  static std::mutex mutex;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= 0 && device < static_cast<int>(cache.size()) && cache[device] > 0) {
    *blocks = cache[device];
    return cudaSuccess;
  }
  int sms = 0, per_sm = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, scan_chunks_kernel, kThreads, 0);
  if (err != cudaSuccess) return err;
  if (device >= static_cast<int>(cache.size())) cache.resize(device + 1, 0);
  cache[device] = sms * (per_sm > 0 ? per_sm : 1);
  *blocks = cache[device];
  return cudaSuccess;
}

int scan_cuda(const ScanParams& params) {
  cudaError_t err = cudaSetDevice(params.device);  // our runtime's current device, for the launches below
  if (err != cudaSuccess) return err;
  auto stream = static_cast<cudaStream_t>(params.stream);
  if (params.num_tensors > 0) {
    const int64_t slots = params.num_tensors * record::kWidth;
    const int64_t blocks = (slots + kSmallKernelThreads - 1) / kSmallKernelThreads;
    init_records_kernel<<<static_cast<unsigned>(blocks < 1024 ? blocks : 1024), kSmallKernelThreads, 0, stream>>>(
        params.records, slots);
  }
  if (params.num_chunks > 0 && params.num_blocks > 0) {
    scan_chunks_kernel<<<static_cast<unsigned>(params.num_blocks), kThreads, 0, stream>>>(
        params.chunks, params.block_begin, params.records);
  }
  if (params.found_inf != nullptr)
    found_inf_kernel<<<1, kSmallKernelThreads, 0, stream>>>(params.records, params.num_tensors, params.found_inf);
  return cudaGetLastError();
}

int cuda_probe(int device) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= count) return cudaErrorInvalidDevice;
  err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  // Loads the module: reports a build without code for this GPU, or PTX newer than the driver, here and not later.
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, scan_chunks_kernel);
}

const char* cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int cuda_runtime_version() { return CUDART_VERSION; }

void scan_on_host(const ChunkMeta* chunks, const int64_t* block_begin, int64_t num_blocks, int64_t* records,
                  int64_t num_tensors) {
  for (int64_t i = 0; i < num_tensors * record::kWidth; ++i)
    records[i] = i % record::kWidth == record::kAbsMinBits ? record::kAbsMinNone : 0;
  std::vector<uint32_t> table(kTableWords), bins(kHistBins);
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t c = block_begin[b]; c < block_begin[b + 1]; ++c) {
      with_format(chunks[c].dtype, [&](auto format) {
        scan_piece_on_host<decltype(format)>(chunks[c], records, table.data(), bins.data());
      });
    }
  }
}

}  // namespace cuda
}  // namespace nanscan
