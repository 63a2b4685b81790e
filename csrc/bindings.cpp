// bindings.cpp: the only pybind11 file, registration only: the module's functions and classes, and the wrappers
// that turn numpy arrays into plain pointers for the CPU and CUDA kernels. The per-step plan checks live in
// csrc/plan; the CUDA entry points exist only in builds with NANSCAN_WITH_CUDA.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "cpu/compact_cpu.h"
#include "cpu/scan_cpu.h"
#include "nanscan/classify.h"
#include "nanscan/stats_record.h"
#include "plan/plan_check.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef NANSCAN_WITH_CUDA
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "cuda/compact_cuda.h"
#include "cuda/scan_cuda.h"
#endif

namespace py = pybind11;
using namespace nanscan;
using plan::CArray;
using plan::check_dtype_code;
using plan::make_tasks;

namespace {

// Returns how many tensors hold a NaN or an infinity (count_nonfinite).
int64_t scan_cpu_py(CArray<int64_t> ptrs, CArray<int64_t> numels, CArray<int32_t> dtypes,
                    py::array_t<int64_t, py::array::c_style> records, int64_t chunk_elems, int num_threads) {
  std::vector<ScanTask> tasks = make_tasks(ptrs, numels, dtypes, "scan_cpu");
  const py::ssize_t n = static_cast<py::ssize_t>(tasks.size());
  if (records.ndim() != 2 || records.shape(0) != n || records.shape(1) != record::kWidth)
    throw py::value_error("scan_cpu: records must have shape (len(ptrs), " + std::to_string(record::kWidth) + ")");
  int64_t* out = records.mutable_data();
  py::gil_scoped_release release;  // the scan touches no Python object
  scan_cpu(tasks.data(), static_cast<int64_t>(n), out, chunk_elems, num_threads);  // sets every slot
  return count_nonfinite(out, static_cast<int64_t>(n));
}

uint64_t read_bandwidth_probe_py(CArray<int64_t> ptrs, CArray<int64_t> numels, CArray<int32_t> dtypes,
                                 int64_t chunk_elems, int num_threads) {
  std::vector<ScanTask> tasks = make_tasks(ptrs, numels, dtypes, "read_bandwidth_probe");
  py::gil_scoped_release release;
  return read_bandwidth_probe(tasks.data(), static_cast<int64_t>(tasks.size()), chunk_elems, num_threads);
}

template <typename F>
void classify_all(const uint64_t* bits, int32_t* classes, int32_t* bins, py::ssize_t n) {
  using Bits = typename F::Bits;
  for (py::ssize_t i = 0; i < n; ++i) {
    const Bits b = static_cast<Bits>(bits[i]);
    classes[i] = classify<F>(b);
    bins[i] = exponent_bin<F>(b);
  }
}

// Runs classify.h, the exact code the kernels run, element by element: the tests compare it with the reference.
py::tuple classify_bits_py(CArray<uint64_t> bits, int32_t dtype) {
  check_dtype_code(dtype, "classify_bits");
  const py::ssize_t n = bits.size();
  py::array_t<int32_t> classes(n), bins(n);
  with_format(dtype, [&](auto format) {
    classify_all<decltype(format)>(bits.data(), classes.mutable_data(), bins.mutable_data(), n);
  });
  return py::make_tuple(classes, bins);
}

// A host scan's records compacted (NOTE: [compact records] in nanscan/compact.h): (scalars, ranges, counts), the
// counts in the narrowest unsigned type that holds the largest.
py::tuple compact_records_py(py::array_t<int64_t, py::array::c_style> records) {
  if (records.ndim() != 2 || records.shape(1) != record::kWidth)
    throw py::value_error("compact_records: records must have shape (n, " + std::to_string(record::kWidth) + ")");
  return plan::compact_arrays(records.data(), records.shape(0));
}

// compact::compact_fixed over host addresses (CPU tensors' data_ptr()): the CUDA compaction's contract on the CPU.
void compact_fixed_py(uint64_t records, int64_t rows, uint64_t scalars, uint64_t ranges, uint64_t counts,
                      int64_t capacity, uint64_t status) {
  if (rows < 0 || capacity < 0) throw py::value_error("compact_fixed: rows and capacity must be >= 0");
  if (status == 0 || (rows > 0 && (records == 0 || scalars == 0 || ranges == 0)) || (capacity > 0 && counts == 0))
    throw py::value_error("compact_fixed: every array needs an address");
  py::gil_scoped_release release;
  compact::compact_fixed(reinterpret_cast<const int64_t*>(records), rows, reinterpret_cast<int64_t*>(scalars),
                         reinterpret_cast<int16_t*>(ranges), reinterpret_cast<uint32_t*>(counts), capacity,
                         reinterpret_cast<int64_t*>(status));
}

py::dict build_info_py() {
  py::dict info;
#ifdef _OPENMP
  info["openmp"] = true;
  info["max_threads"] = omp_get_max_threads();
#else
  info["openmp"] = false;
  info["max_threads"] = 1;
#endif
#ifdef NANSCAN_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
#ifdef NANSCAN_CUDA_ARCH_LIST
  info["cuda_arch"] = NANSCAN_CUDA_ARCH_LIST;
#endif
  info["record_width"] = record::kWidth;
  info["hist_bins"] = kHistBins;
  info["min_bin_exponent"] = kMinBinExponent;
  info["max_bin_exponent"] = kMaxBinExponent;
  info["abs_min_none"] = record::kAbsMinNone;
  py::dict slots;
  slots["nan"] = record::kNaN;
  slots["posinf"] = record::kPosInf;
  slots["neginf"] = record::kNegInf;
  slots["zero"] = record::kZero;
  slots["subnormal"] = record::kSubnormal;
  slots["absmax_bits"] = record::kAbsMaxBits;
  slots["absmin_bits"] = record::kAbsMinBits;
  slots["sumsq"] = record::kSumSq;
  slots["hist"] = record::kHist;
  slots["fingerprint"] = record::kFingerprint;
  info["record_slots"] = slots;
  py::dict codes;
  codes["float16"] = static_cast<int>(kFloat16);
  codes["bfloat16"] = static_cast<int>(kBFloat16);
  codes["float32"] = static_cast<int>(kFloat32);
  codes["float64"] = static_cast<int>(kFloat64);
  codes["float8_e4m3fn"] = static_cast<int>(kFloat8E4M3FN);
  codes["float8_e5m2"] = static_cast<int>(kFloat8E5M2);
  codes["float8_e4m3fnuz"] = static_cast<int>(kFloat8E4M3FNUZ);
  codes["float8_e5m2fnuz"] = static_cast<int>(kFloat8E5M2FNUZ);
  info["dtype_codes"] = codes;
  // Each format's traits (classify.h, FloatFormat), by dtype code: nanscan/engine/_layout.py's FORMATS mirrors them.
  py::dict formats;
  for (int32_t code = 0; code < kNumDTypes; ++code) {
    with_format(code, [&](auto format) {
      using F = decltype(format);
      py::dict traits;
      traits["bytes"] = F::kBytes;
      traits["exp_bits"] = F::kExpBits;
      traits["mant_bits"] = F::kMantBits;
      traits["bias"] = F::kBias;
      traits["specials"] = static_cast<int>(F::kSpecials);
      formats[py::int_(code)] = traits;
    });
  }
  info["formats"] = formats;
  // The widest vector instructions the CPU kernel was compiled for (setup.py: NANSCAN_NATIVE_ARCH).
#if defined(__AVX512BW__)
  info["cpu_simd"] = "avx512";
#elif defined(__AVX2__)
  info["cpu_simd"] = "avx2";
#elif defined(__SSE2__) || defined(__aarch64__)
  info["cpu_simd"] = "baseline";
#else
  info["cpu_simd"] = "none";
#endif
  info["cpu_float8"] = float8_path();  // how float8 chunks are read (NOTE: [byte formats] in cpu/scan_cpu.cpp)
  return info;
}

#ifdef NANSCAN_WITH_CUDA
// CUDA entry points (csrc/cuda/scan_cuda.h): pointers and a stream handle in, nothing of torch.
void check_cuda(int code, const char* where) {
  if (code != 0)
    throw std::runtime_error(std::string(where) + ": CUDA error " + std::to_string(code) + ": " +
                             cuda::cuda_error_string(code));
}

void scan_cuda_py(uint64_t chunks, int64_t num_chunks, uint64_t block_begin, int64_t num_blocks, uint64_t records,
                  int64_t num_tensors, uint64_t found_inf, uint64_t stream, int device) {
  if (num_chunks < 0 || num_blocks < 0 || num_tensors < 0)
    throw py::value_error("scan_cuda: num_chunks, num_blocks and num_tensors must be >= 0");
  if (num_chunks > 0 && (chunks == 0 || block_begin == 0 || num_blocks == 0 || records == 0 || num_tensors == 0))
    throw py::value_error("scan_cuda: chunks need a chunk table, block_begin, at least one block and records");
  cuda::ScanParams params;
  params.chunks = reinterpret_cast<const cuda::ChunkMeta*>(chunks);
  params.num_chunks = num_chunks;
  params.block_begin = reinterpret_cast<const int64_t*>(block_begin);
  params.num_blocks = num_blocks;
  params.records = reinterpret_cast<int64_t*>(records);
  params.num_tensors = num_tensors;
  params.found_inf = reinterpret_cast<float*>(found_inf);
  params.stream = reinterpret_cast<void*>(stream);
  params.device = device;
  int code;
  {
    py::gil_scoped_release release;  // launches only; nothing waits for the GPU
    code = cuda::scan_cuda(params);
  }
  check_cuda(code, "scan_cuda");
}

void compact_cuda_py(uint64_t records, int64_t rows, uint64_t scalars, uint64_t ranges, uint64_t counts,
                     int64_t capacity, uint64_t workspace, uint64_t status, uint64_t stream, int device) {
  if (rows < 0 || capacity < 0) throw py::value_error("compact_cuda: rows and capacity must be >= 0");
  if (status == 0 || (rows > 0 && (records == 0 || scalars == 0 || ranges == 0 || workspace == 0)) ||
      (capacity > 0 && counts == 0))
    throw py::value_error("compact_cuda: every array needs a device address");
  cuda::CompactParams params;
  params.records = reinterpret_cast<const int64_t*>(records);
  params.rows = rows;
  params.scalars = reinterpret_cast<int64_t*>(scalars);
  params.ranges = reinterpret_cast<int16_t*>(ranges);
  params.counts = reinterpret_cast<uint32_t*>(counts);
  params.capacity = capacity;
  params.workspace = reinterpret_cast<int64_t*>(workspace);
  params.status = reinterpret_cast<int64_t*>(status);
  params.stream = reinterpret_cast<void*>(stream);
  params.device = device;
  int code;
  {
    py::gil_scoped_release release;  // launches only
    code = cuda::compact_cuda(params);
  }
  check_cuda(code, "compact_cuda");
}

int cuda_grid_py(int device) {
  int blocks = 0;
  check_cuda(cuda::cuda_grid_blocks(device, &blocks), "cuda_grid");
  return blocks;
}

// The constants and the chunk-table layout the Python side must agree with (nanscan/_cuda_backend.py checks them).
py::dict cuda_layout_py() {
  py::dict layout;
  layout["threads"] = cuda::kThreads;
  layout["max_chunk_elems"] = cuda::kMaxChunkElems;
  layout["chunk_meta_itemsize"] = sizeof(cuda::ChunkMeta);
  py::dict offsets;
  offsets["data"] = offsetof(cuda::ChunkMeta, data);
  offsets["begin"] = offsetof(cuda::ChunkMeta, begin);
  offsets["end"] = offsetof(cuda::ChunkMeta, end);
  offsets["tensor"] = offsetof(cuda::ChunkMeta, tensor);
  offsets["dtype"] = offsetof(cuda::ChunkMeta, dtype);
  layout["chunk_meta_offsets"] = offsets;
  layout["runtime_version"] = cuda::cuda_runtime_version();
  return layout;
}

void scan_cuda_on_host_py(py::array_t<uint8_t, py::array::c_style> chunk_table,
                          py::array_t<int64_t, py::array::c_style | py::array::forcecast> block_begin,
                          py::array_t<int64_t, py::array::c_style> records) {
  const char* where = "scan_cuda_on_host";
  if (chunk_table.ndim() != 1 || chunk_table.size() % sizeof(cuda::ChunkMeta) != 0)
    throw py::value_error(std::string(where) + ": chunk_table must be the raw bytes of whole ChunkMeta rows");
  if (records.ndim() != 2 || records.shape(1) != record::kWidth)
    throw py::value_error(std::string(where) + ": records must have shape (n, " + std::to_string(record::kWidth) + ")");
  const int64_t num_chunks = chunk_table.size() / static_cast<py::ssize_t>(sizeof(cuda::ChunkMeta));
  const int64_t num_blocks = block_begin.size() - 1;
  if (block_begin.ndim() != 1 || num_blocks < 0 || (num_blocks == 0 && num_chunks > 0))
    throw py::value_error(std::string(where) + ": block_begin must hold num_blocks + 1 row indices");
  for (int64_t b = 0; b < num_blocks; ++b)
    if (block_begin.at(b) < 0 || block_begin.at(b) > block_begin.at(b + 1) || block_begin.at(b + 1) > num_chunks)
      throw py::value_error(std::string(where) + ": block_begin must rise from 0 to at most the number of chunks");
  std::vector<cuda::ChunkMeta> chunks(num_chunks);  // a copy: the numpy buffer need not be 8-byte aligned
  if (num_chunks > 0) std::memcpy(chunks.data(), chunk_table.data(), chunks.size() * sizeof(cuda::ChunkMeta));
  for (const cuda::ChunkMeta& c : chunks) {
    if (c.tensor < 0 || c.tensor >= records.shape(0) || c.begin < 0 || c.end < c.begin)
      throw py::value_error(std::string(where) + ": chunk out of range of the records or with end < begin");
    check_dtype_code(c.dtype, where);
  }
  int64_t* out = records.mutable_data();
  const int64_t* begins = block_begin.data();
  const int64_t num_tensors = records.shape(0);
  py::gil_scoped_release release;
  cuda::scan_on_host(chunks.data(), begins, num_blocks, out, num_tensors);
}

void register_cuda(py::module_& m) {
  m.def("scan_cuda", &scan_cuda_py, py::arg("chunks"), py::arg("num_chunks"), py::arg("block_begin"),
        py::arg("num_blocks"), py::arg("records"), py::arg("num_tensors"), py::arg("found_inf"), py::arg("stream"),
        py::arg("device"),
        "Enqueue the CUDA scan on `stream` (device pointers and the stream handle as ints); returns at once.");
  m.def("compact_cuda", &compact_cuda_py, py::arg("records"), py::arg("rows"), py::arg("scalars"), py::arg("ranges"),
        py::arg("counts"), py::arg("capacity"), py::arg("workspace"), py::arg("status"), py::arg("stream"),
        py::arg("device"),
        "Enqueue the compaction of device records on `stream` (NOTE: [compact records]); returns at once.");
  m.def("cuda_grid", &cuda_grid_py, py::arg("device"), "How many scan blocks fit on CUDA device `device` at once.");
  m.def("cuda_probe", [](int device) { check_cuda(cuda::cuda_probe(device), "cuda_probe"); }, py::arg("device"),
        "Raise RuntimeError when this build's kernels cannot run on CUDA device `device`.");
  m.def("cuda_layout", &cuda_layout_py, "Kernel constants and the ChunkMeta layout of the CUDA scan.");
  m.def("scan_cuda_on_host", &scan_cuda_on_host_py, py::arg("chunk_table"), py::arg("block_begin"),
        py::arg("records"),
        "Run the CUDA kernel's per-thread code on the CPU over a chunk table of host addresses (for tests).");
}
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "nanscan native kernels: fused NaN/inf/zero/subnormal counts, abs min/max and exponent histograms";
  m.def("scan_cpu", &scan_cpu_py, py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"), py::arg("records"),
        py::arg("chunk_elems"), py::arg("num_threads") = 0,
        "Scan tensors given as raw pointers into a (n, record width) int64 record array (overwritten); returns how "
        "many of them hold a NaN or an infinity.");
  m.def("read_bandwidth_probe", &read_bandwidth_probe_py, py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"),
        py::arg("chunk_elems"), py::arg("num_threads") = 0,
        "Read the same tensors as scan_cpu with the same chunks and threads, doing nothing else (a speed ceiling).");
  m.def("classify_bits", &classify_bits_py, py::arg("bits"), py::arg("dtype"),
        "Classify bit patterns with classify.h: returns (value classes, exponent bins or -1).");
  m.def("compact_records", &compact_records_py, py::arg("records"),
        "A step's records compacted (NOTE: [compact records]): (scalars, ranges, counts in the narrowest type).");
  m.def("compact_fixed", &compact_fixed_py, py::arg("records"), py::arg("rows"), py::arg("scalars"),
        py::arg("ranges"), py::arg("counts"), py::arg("capacity"), py::arg("status"),
        "The CUDA compaction's contract over host addresses: uint32 counts into `capacity` slots when they fit.");
  m.def("build_info", &build_info_py, "How the extension was built.");
  m.def("batch_leaves", &plan::batch_leaves, py::arg("batch"), py::arg("loss"), py::arg("plan"),
        "The per-step check of nanscan.engine.plans.BatchPlan: (the scanned leaves and the loss, their data pointers), "
        "or None if the batch's structure changed.");
  m.def("tensor_stamps", &plan::tensor_stamps, py::arg("tensors"), py::arg("tensor_access"),
        "Each tensor's (version counter, data pointer, scalar type) as an (n, 3) int64 array, or None.");
  py::class_<plan::ScanTable>(m, "ScanTable",
                              "A step's input table without pointers, for PlanCheck.check_scan_summary (NOTE: [scan "
                              "table]): element counts and format codes, checked once.")
      .def(py::init([](const plan::CArray<int64_t>& numels, const plan::CArray<int32_t>& dtypes) {
             return plan::ScanTable(numels, dtypes);
           }),
           py::arg("numels"), py::arg("dtypes"))
      .def("__len__", &plan::ScanTable::size);
  py::class_<plan::PlanCheck>(m, "PlanCheck",
                              "The per-step check of nanscan.engine.plans.ModelScanPlan (NOTE: [plan check]), built at "
                              "its rebuild.")
      .def(py::init<py::list, py::list, py::list, py::list, py::list, py::list, py::list, py::list,
                    py::array_t<int64_t, py::array::c_style | py::array::forcecast>, py::list,
                    py::array_t<int64_t, py::array::c_style | py::array::forcecast>, py::object, py::object,
                    py::object>(),
           py::arg("child_dicts"), py::arg("children"), py::arg("param_dicts"), py::arg("raw_params"),
           py::arg("state_values"), py::arg("params"), py::arg("grad_absent"), py::arg("state_tensors"),
           py::arg("stable_ptrs"), py::arg("stable_dtypes"), py::arg("stable_nbytes"), py::arg("data_ptr"),
           py::arg("is_contiguous"), py::arg("tensor_access") = py::none())
      .def("check", &plan::PlanCheck::check, py::arg("optimizer_state"), py::arg("extra_ptrs"),
           "None if anything changed since the rebuild, else (pointers, gradients).")
      .def("check_and_scan", &plan::PlanCheck::check_and_scan, py::arg("optimizer_state"), py::arg("extra_ptrs"),
           py::arg("numels"), py::arg("dtypes"), py::arg("records"), py::arg("chunk_elems"),
           py::arg("num_threads") = 0, py::arg("carried") = py::none(),
           "check() and, when nothing changed, the scan of the inputs it found into records: None (changed, nothing "
           "scanned) or the number of tensors holding a NaN or an infinity. carried: (stable indices, stamps, "
           "records) standing in for tensors whose stamps did not move, or a list of such parts; a part ending in "
           "True is standing: refreshed in place with what this call scanned.")
      .def("check_scan_summary", &plan::PlanCheck::check_scan_summary, py::arg("optimizer_state"),
           py::arg("extra_ptrs"), py::arg("table"), py::arg("chunk_elems"), py::arg("num_threads") = 0,
           py::arg("carried") = py::none(), py::arg("loss_row") = -1,
           "check_and_scan() over a ScanTable's inputs, into records it makes, that also returns them and the "
           "step's summary (NOTE: [step summary]): None, or (records, non-finite tensors, compact scalars, "
           "ranges, counts, the gradients' sum of squares, the loss row's sum of squares and value, or None).");
#ifdef NANSCAN_WITH_CUDA
  register_cuda(m);
#endif
}
