// scan_cuda.h: the CUDA scan's entry points. Plain C++ (no CUDA, pybind11 or torch headers): raw device pointers,
// sizes, dtype codes (classify.h, enum DType) and a stream handle in, an error code out.
#pragma once

#include <cstdint>

namespace nanscan {
namespace cuda {

// One row of the chunk table (NOTE: [cuda scan] in multi_tensor.cuh): elements [begin, end) of the tensor whose
// first element is at `data`. Python builds the same 32-byte layout with numpy (nanscan/_cuda_backend.py) and
// checks it against chunk_meta_layout() in the bindings.
struct ChunkMeta {
  uint64_t data;   // device address of the tensor's element 0 (element-aligned; any 16-byte alignment is fine)
  int64_t begin;   // first element of the chunk
  int64_t end;     // one past the last element; end - begin <= kMaxChunkElems
  int32_t tensor;  // row of the output record array
  int32_t dtype;   // classify.h DType code
};
static_assert(sizeof(ChunkMeta) == 32, "ChunkMeta is mirrored by a numpy dtype of 32 bytes");

// Threads per block of the scan kernel, and the longest chunk the host should cut. A longer chunk is still scanned
// correctly (the kernel splits it into passes), it only loads the blocks less evenly.
constexpr int kThreads = 512;
constexpr int64_t kMaxChunkElems = int64_t(1) << 20;

struct ScanParams {
  const ChunkMeta* chunks;  // device memory, num_chunks rows, in any order
  int64_t num_chunks;
  int64_t* records;         // device memory, num_tensors x record::kWidth int64; the scan initialises it
  int64_t num_tensors;
  float* found_inf;         // device memory, one float: 1.0 when any record counts a NaN or an infinity, else 0.0
  void* stream;             // cudaStream_t of the caller (torch.cuda.current_stream().cuda_stream)
  int device;               // CUDA device ordinal that owns the stream and the memory
};

// Enqueues the whole scan on params.stream (initialise records, scan, finalize found_inf) and returns without
// waiting for the GPU. Returns 0 (cudaSuccess) or a cudaError_t code; cuda_error_string() explains it.
int scan_cuda(const ScanParams& params);

// Checks that `device` can run the kernels (driver recent enough for this build, device present). 0 or an error.
int cuda_probe(int device);

const char* cuda_error_string(int code);

// CUDART_VERSION of the toolkit the kernels were compiled with, e.g. 13000.
int cuda_runtime_version();

// Runs the kernel's per-thread code (the same functions, multi_tensor.cuh) on the CPU, thread by thread, over a
// chunk table whose `data` fields are host addresses. Tests use it to check the CUDA code path on machines
// without a GPU; it initialises `records` like scan_cuda does. Not fast.
void scan_on_host(const ChunkMeta* chunks, int64_t num_chunks, int64_t* records, int64_t num_tensors);

}  // namespace cuda
}  // namespace nanscan
