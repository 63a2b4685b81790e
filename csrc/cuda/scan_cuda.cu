// scan_cuda.cu: the multi-tensor CUDA scan (NOTE: [cuda scan] in multi_tensor.cuh): record initialisation, the
// chunk-table kernel with its per-block merge, the found_inf finalize, and a CPU run of the same per-thread code.
#include <cuda_runtime.h>

#include <climits>
#include <mutex>
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
              "flush_pass adds the scalar counts to record slots 0..4 in order");

using u64 = unsigned long long;  // the type CUDA's 64-bit atomics take

struct BlockShared {
  uint32_t table[kTableWords];  // the field table (NOTE: [cuda scan], 4): 16 KiB
  uint32_t bins[kHistBins];     // subnormals, binned one by one
  uint32_t counts[kWarps][kScalarCounts];
  u64 absmax[kWarps];
  u64 absmin_minus_one[kWarps];
  double sumsq[kWarps];
};

// The field table and subnormal bins as seen by one thread: its own column of the table.
struct SharedHist {
  uint32_t* column;
  uint32_t* bins;
  NANSCAN_HD void add_slot(int slot) {
#if defined(__CUDA_ARCH__)
    atomicAdd(column + slot_word(slot), slot_increment(slot));
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

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
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

// End of a pass (NOTE: [cuda scan], 5): every thread of the block calls it. Leaves the table and bins zeroed.
template <typename F>
__device__ void flush_pass(const LaneScan<F>& lane, BlockShared& sh, int64_t* rec) {
  const int warp = threadIdx.x / kWarpSize;
  const int lane_id = threadIdx.x % kWarpSize;

  uint32_t counts[kScalarCounts] = {lane.nan, lane.posinf, lane.neginf, lane.zero, lane.subnormal};
  u64 absmax = lane.absmax;
  u64 absmin_minus_one = lane.absmin_minus_one == LaneScan<F>::kNone ? ULLONG_MAX : u64(lane.absmin_minus_one);
  double sumsq = lane.sumsq;
  for (int k = 0; k < kScalarCounts; ++k) counts[k] = warp_sum(counts[k]);
  absmax = warp_max(absmax);
  absmin_minus_one = warp_min(absmin_minus_one);
  sumsq = warp_sum(sumsq);
  if (lane_id == 0) {
    for (int k = 0; k < kScalarCounts; ++k) sh.counts[warp][k] = counts[k];
    sh.absmax[warp] = absmax;
    sh.absmin_minus_one[warp] = absmin_minus_one;
    sh.sumsq[warp] = sumsq;
  }
  __syncthreads();  // the pass's table increments and the per-warp partials are all in shared memory

  // Four threads per row, eight columns each, starting at a row-dependent column so that the eight rows a warp
  // reads at once fall in 32 different banks.
  {
    const int row = threadIdx.x / 4;
    const int quarter = threadIdx.x % 4;
    uint32_t low = 0, high = 0;
    for (int k = 0; k < kWarpSize / 4; ++k) {
      const int word = row * kWarpSize + quarter * (kWarpSize / 4) + ((k + row) % (kWarpSize / 4));
      const uint32_t packed = sh.table[word];
      sh.table[word] = 0;
      low += packed & kHalfMask;
      high += packed >> 16;
    }
    low += __shfl_xor_sync(0xffffffffu, low, 1);
    low += __shfl_xor_sync(0xffffffffu, low, 2);
    high += __shfl_xor_sync(0xffffffffu, high, 1);
    high += __shfl_xor_sync(0xffffffffu, high, 2);
    if (quarter == 0) {
      const int low_index = slot_record_index<F>(row);
      const int high_index = slot_record_index<F>(row + kTableRows);
      if (low != 0 && low_index >= 0) add_to_record(rec + low_index, low);
      if (high != 0 && high_index >= 0) add_to_record(rec + high_index, high);
    }
  }
  for (int bin = threadIdx.x; bin < kHistBins; bin += kThreads) {
    const uint32_t count = sh.bins[bin];
    if (count != 0) {
      add_to_record(rec + record::kHist + bin, count);
      sh.bins[bin] = 0;
    }
  }

  if (warp == 0) {
    const bool has = lane_id < kWarps;
    for (int k = 0; k < kScalarCounts; ++k) counts[k] = warp_sum(has ? sh.counts[lane_id][k] : 0u);
    absmax = warp_max(has ? sh.absmax[lane_id] : 0ull);
    absmin_minus_one = warp_min(has ? sh.absmin_minus_one[lane_id] : ULLONG_MAX);
    sumsq = warp_sum(has ? sh.sumsq[lane_id] : 0.0);
    if (lane_id == 0) {
      for (int k = 0; k < kScalarCounts; ++k)
        if (counts[k] != 0) add_to_record(rec + k, counts[k]);
      if (absmax != 0) atomicMax(reinterpret_cast<u64*>(rec + record::kAbsMaxBits), absmax);
      if (absmin_minus_one != ULLONG_MAX)
        atomicMin(reinterpret_cast<u64*>(rec + record::kAbsMinBits), absmin_minus_one + 1);
      if (sumsq != 0.0) atomicAdd(reinterpret_cast<double*>(rec + record::kSumSq), sumsq);
    }
  }
  __syncthreads();  // table, bins and partials are free for the next pass
}

template <typename F>
__device__ void scan_chunk(const ChunkMeta& meta, int64_t* records, BlockShared& sh) {
  const auto* data = reinterpret_cast<const typename F::Bits*>(meta.data);
  int64_t* rec = records + static_cast<int64_t>(meta.tensor) * record::kWidth;
  SharedHist hist{sh.table + threadIdx.x % kWarpSize, sh.bins};
  // One pass unless the host cut a chunk longer than kMaxChunkElems (the 16-bit counters' bound).
  for (int64_t begin = meta.begin; begin < meta.end; begin += kMaxChunkElems) {
    const int64_t end = meta.end - begin > kMaxChunkElems ? begin + kMaxChunkElems : meta.end;
    LaneScan<F> lane;
    scan_range<F>(data, begin, end, static_cast<int>(threadIdx.x), lane, hist);
    flush_pass<F>(lane, sh, rec);
  }
}

__global__ void __launch_bounds__(kThreads, 2)
    scan_chunks_kernel(const ChunkMeta* __restrict__ chunks, int64_t num_chunks, int64_t* __restrict__ records) {
  __shared__ BlockShared sh;
  for (int i = threadIdx.x; i < kTableWords; i += kThreads) sh.table[i] = 0;
  for (int i = threadIdx.x; i < kHistBins; i += kThreads) sh.bins[i] = 0;
  __syncthreads();
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const ChunkMeta meta = chunks[c];
    switch (meta.dtype) {  // the same for the whole block, so no divergence
      case kFloat16: scan_chunk<Float16>(meta, records, sh); break;
      case kBFloat16: scan_chunk<BFloat16>(meta, records, sh); break;
      case kFloat32: scan_chunk<Float32>(meta, records, sh); break;
      case kFloat64: scan_chunk<Float64>(meta, records, sh); break;
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

// Blocks that fit on the device at once: the grid of the chunk kernel (it strides over the table). Cached per device.
cudaError_t resident_blocks(int device, int* blocks) {
  static std::mutex mutex;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (device < static_cast<int>(cache.size()) && cache[device] > 0) {
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

// A host stand-in for SharedHist: the same column arithmetic on an ordinary array.
struct HostHist {
  uint32_t* column;
  uint32_t* bins;
  NANSCAN_HD void add_slot(int slot) { column[slot_word(slot)] += slot_increment(slot); }
  NANSCAN_HD void add_bin(int bin) { ++bins[bin]; }
};

template <typename F>
void scan_chunk_on_host(const ChunkMeta& meta, int64_t* records) {
  using Wide = typename LaneScan<F>::Wide;
  const auto* data = reinterpret_cast<const typename F::Bits*>(meta.data);
  int64_t* rec = records + static_cast<int64_t>(meta.tensor) * record::kWidth;
  std::vector<uint32_t> table(kTableWords), bins(kHistBins);
  for (int64_t begin = meta.begin; begin < meta.end; begin += kMaxChunkElems) {
    const int64_t end = meta.end - begin > kMaxChunkElems ? begin + kMaxChunkElems : meta.end;
    for (int tid = 0; tid < kThreads; ++tid) {
      LaneScan<F> lane;
      HostHist hist{table.data() + tid % kWarpSize, bins.data()};
      scan_range<F>(data, begin, end, tid, lane, hist);
      const uint32_t counts[kScalarCounts] = {lane.nan, lane.posinf, lane.neginf, lane.zero, lane.subnormal};
      for (int k = 0; k < kScalarCounts; ++k) rec[k] += counts[k];
      if (static_cast<int64_t>(lane.absmax) > rec[record::kAbsMaxBits])
        rec[record::kAbsMaxBits] = static_cast<int64_t>(lane.absmax);
      if (lane.absmin_minus_one != LaneScan<F>::kNone &&
          static_cast<int64_t>(Wide(lane.absmin_minus_one + 1)) < rec[record::kAbsMinBits])
        rec[record::kAbsMinBits] = static_cast<int64_t>(lane.absmin_minus_one + 1);
      double sumsq;
      memcpy(&sumsq, rec + record::kSumSq, sizeof sumsq);
      sumsq += lane.sumsq;
      memcpy(rec + record::kSumSq, &sumsq, sizeof sumsq);
    }
    for (int row = 0; row < kTableRows; ++row) {
      for (int column = 0; column < kWarpSize; ++column) {
        uint32_t& packed = table[row * kWarpSize + column];
        const int low_index = slot_record_index<F>(row);
        const int high_index = slot_record_index<F>(row + kTableRows);
        if ((packed & kHalfMask) != 0 && low_index >= 0) rec[low_index] += packed & kHalfMask;
        if ((packed >> 16) != 0 && high_index >= 0) rec[high_index] += packed >> 16;
        packed = 0;
      }
    }
    for (int bin = 0; bin < kHistBins; ++bin) {
      rec[record::kHist + bin] += bins[bin];
      bins[bin] = 0;
    }
  }
}

}  // namespace

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
  if (params.num_chunks > 0) {
    int grid = 0;
    err = resident_blocks(params.device, &grid);
    if (err != cudaSuccess) return err;
    const int64_t blocks = params.num_chunks < grid ? params.num_chunks : grid;
    scan_chunks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(params.chunks, params.num_chunks,
                                                                                params.records);
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

void scan_on_host(const ChunkMeta* chunks, int64_t num_chunks, int64_t* records, int64_t num_tensors) {
  for (int64_t i = 0; i < num_tensors * record::kWidth; ++i)
    records[i] = i % record::kWidth == record::kAbsMinBits ? record::kAbsMinNone : 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    switch (chunks[c].dtype) {
      case kFloat16: scan_chunk_on_host<Float16>(chunks[c], records); break;
      case kBFloat16: scan_chunk_on_host<BFloat16>(chunks[c], records); break;
      case kFloat32: scan_chunk_on_host<Float32>(chunks[c], records); break;
      case kFloat64: scan_chunk_on_host<Float64>(chunks[c], records); break;
      default: break;
    }
  }
}

}  // namespace cuda
}  // namespace nanscan
