// scan_cuda.h: the CUDA scan's entry points. Plain C++ (no CUDA, pybind11 or torch headers): raw device pointers,
// sizes, dtype codes (classify.h, enum DType) and a stream handle in, an error code out.
#pragma once

#include <cstdint>

namespace nanscan {
namespace cuda {

// One row of the chunk table (NOTE: [cuda scan] in multi_tensor.cuh): elements [begin, end) of the tensor whose
// first element is at `data`. Python builds the same 32-byte layout with numpy (nanscan/_cuda_backend.py) and
// checks it against cuda_layout() in the bindings.
struct ChunkMeta {
  uint64_t data;   // address of the tensor's element 0 (element-aligned; any 16-byte alignment is fine)
  int64_t begin;   // first element of the piece
  int64_t end;     // one past the last element; longer than kMaxChunkElems only costs extra merges
  int32_t tensor;  // row of the output record array
  int32_t dtype;   // classify.h DType code
};
static_assert(sizeof(ChunkMeta) == 32, "ChunkMeta is mirrored by a numpy dtype of 32 bytes");

// Threads per block of the scan kernel, and the most elements one piece should hold: the kernel counts in 32-bit
// counters, so it scans a longer piece in passes of this many elements, each merged on its own.
constexpr int kThreads = 512;
constexpr int64_t kMaxChunkElems = int64_t(1) << 30;

struct ScanParams {
  const ChunkMeta* chunks;     // device memory, num_chunks rows, each block's rows together
  int64_t num_chunks;
  const int64_t* block_begin;  // device memory, num_blocks + 1 rows: block b scans rows [block_begin[b], [b + 1])
  int64_t num_blocks;          // the grid; at most cuda_grid_blocks()
  int64_t* records;            // device memory, num_tensors x record::kWidth int64; the scan initialises it
  int64_t num_tensors;
  float* found_inf;            // device memory, one float: 1.0 when any record counts a NaN or an inf, else 0.0
  void* stream;                // cudaStream_t of the caller (torch.cuda.current_stream().cuda_stream)
  int device;                  // CUDA device ordinal that owns the stream and the memory
};

// Enqueues the whole scan on params.stream (initialise records, scan, finalize found_inf) and returns without
// waiting for the GPU. Returns 0 (cudaSuccess) or a cudaError_t code; cuda_error_string() explains it.
int scan_cuda(const ScanParams& params);

// How many scan blocks fit on `device` at once: the most blocks worth giving a scan (one share of bytes each).
int cuda_grid_blocks(int device, int* blocks);

// Checks that `device` can run the kernels (driver recent enough for this build, device present). 0 or an error.
int cuda_probe(int device);

const char* cuda_error_string(int code);

// CUDART_VERSION of the toolkit the kernels were compiled with, e.g. 13000.
int cuda_runtime_version();

// Runs the kernel's per-thread code (the same functions, multi_tensor.cuh) on the CPU, block by block and thread
// by thread, over a chunk table whose `data` fields are host addresses. Tests use it to check the CUDA code path
// on machines without a GPU; it initialises `records` like scan_cuda does. Not fast.
void scan_on_host(const ChunkMeta* chunks, const int64_t* block_begin, int64_t num_blocks, int64_t* records,
                  int64_t num_tensors);

}  // namespace cuda
}  // namespace nanscan
