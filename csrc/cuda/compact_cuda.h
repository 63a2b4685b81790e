// compact_cuda.h: the CUDA compaction of a step's stats records (NOTE: [compact records] in nanscan/compact.h).
// Plain C++ (no CUDA, pybind11 or torch headers): raw device pointers, sizes and a stream handle in, an error code
// out.
#pragma once

#include <cstdint>

namespace nanscan {
namespace cuda {

struct CompactParams {
  const int64_t* records;  // device memory, rows x record::kWidth int64, as the scan wrote them
  int64_t rows;
  int64_t* scalars;        // device memory, rows x compact::kScalarSlots int64
  int16_t* ranges;         // device memory, rows x 2 int16: (first bin, width)
  uint32_t* counts;        // device memory, `capacity` uint32: written only when the step fits
  int64_t capacity;
  int64_t* workspace;      // device memory, 3 x rows int64, the caller's (freed or reused after the launches)
  int64_t* status;         // device memory, compact::kStatusSlots int64: total bins, fits (1) or not (0)
  void* stream;            // cudaStream_t of the caller, after the scan that wrote `records`
  int device;
};

// Enqueues the compaction on params.stream (three small kernels: each row's range, the offsets and the status, the
// counts) and returns without waiting. Same contract as the CPU's compact::compact_fixed. 0 or a cudaError_t code.
int compact_cuda(const CompactParams& params);

}  // namespace cuda
}  // namespace nanscan
