// scan_cpu.h: the CPU scan's entry point. Plain pointers and sizes only: the kernel knows nothing of torch or Python.
#pragma once

#include <cstdint>
#include <functional>

namespace nanscan {

// One tensor to scan: a dense run of `numel` elements of format `dtype` (classify.h, enum DType).
struct ScanTask {
  const void* data;
  int64_t numel;
  int32_t dtype;
};

// Work the calling thread does inside the scan's parallel region before any element is read, while the other
// threads wake up (NOTE: [wake overlap] in scan_cpu.cpp). It may set the tasks' data pointers (their counts and
// formats are final before the call), and returns false to cancel the scan. An exception it throws
// reaches the caller of scan_cpu.
using Prologue = std::function<bool(ScanTask* tasks)>;

// Scans `num_tasks` tensors into `records` (num_tasks x record::kWidth int64, NOTE: [stats record]), writing every
// slot (NOTE: [record writes]); when `prologue` cancels the scan they are left as they were.
// `chunk_elems` is the work unit (NOTE: [chunking]), clamped to [1, 2^30]; the records depend on it (the sum of
// squares, in its last bits) but never on the thread count.
// `num_threads` 0 means OpenMP's default, fewer for small inputs; any other value is used as given (at most one
// thread per chunk). Runs each thread with flush-to-zero off (NOTE: [float mode]).
void scan_cpu(ScanTask* tasks, int64_t num_tasks, int64_t* records, int64_t chunk_elems, int num_threads,
              const Prologue& prologue = {});

// How many of `num_tasks` records (as scan_cpu writes them) count a NaN or an infinity: the step's verdict, read
// while the records are in cache (asked from Python after every Monitor check, a numpy reduction over them cost
// tens of microseconds).
int64_t count_nonfinite(const int64_t* records, int64_t num_tasks);

// Reads every byte of the tasks once with the same chunking and threads as scan_cpu and does nothing else of note:
// the read speed a scan could reach at best (benchmarks compare against it). Returns the XOR of all bytes read, so
// the reads cannot be optimised away and a test can check that they covered every byte.
uint64_t read_bandwidth_probe(const ScanTask* tasks, int64_t num_tasks, int64_t chunk_elems, int num_threads);

// How the kernel reads one-byte formats, as it was compiled: "avx512" (NOTE: [byte vectors] in scan_cpu.cpp),
// "avx2" (NOTE: [byte vectors on AVX2]) or "patterns" (NOTE: [byte formats]).
const char* float8_path();

}  // namespace nanscan
