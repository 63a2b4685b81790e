// bindings.cpp: the only pybind11 file. Turns numpy arrays into plain pointers for the CPU and CUDA kernels;
// the CUDA entry points exist only in builds with NANSCAN_WITH_CUDA.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "cpu/scan_cpu.h"
#include "nanscan/classify.h"
#include "nanscan/stats_record.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef NANSCAN_WITH_CUDA
#include "cuda/scan_cuda.h"
#endif

namespace py = pybind11;
using namespace nanscan;

namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

void check_dtype_code(int32_t code, const char* where) {
  if (code < kFloat16 || code > kFloat64)
    throw py::value_error(std::string(where) + ": unknown dtype code " + std::to_string(code));
}

void scan_cpu_py(CArray<int64_t> ptrs, CArray<int64_t> numels, CArray<int32_t> dtypes,
                 py::array_t<int64_t, py::array::c_style> records, int64_t chunk_elems, int num_threads) {
  const py::ssize_t n = ptrs.size();
  if (numels.size() != n || dtypes.size() != n)
    throw py::value_error("scan_cpu: ptrs, numels and dtypes must have the same length");
  if (records.ndim() != 2 || records.shape(0) != n || records.shape(1) != record::kWidth)
    throw py::value_error("scan_cpu: records must have shape (len(ptrs), " + std::to_string(record::kWidth) + ")");
  std::vector<ScanTask> tasks(n);
  for (py::ssize_t i = 0; i < n; ++i) {
    check_dtype_code(dtypes.at(i), "scan_cpu");
    tasks[i] = {reinterpret_cast<const void*>(ptrs.at(i)), numels.at(i), dtypes.at(i)};
  }
  int64_t* out = records.mutable_data();
  py::gil_scoped_release release;  // the scan touches no Python object
  scan_cpu(tasks.data(), static_cast<int64_t>(n), out, chunk_elems, num_threads);
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
  switch (dtype) {
    case kFloat16: classify_all<Float16>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
    case kBFloat16: classify_all<BFloat16>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
    case kFloat32: classify_all<Float32>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
    case kFloat64: classify_all<Float64>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
  }
  return py::make_tuple(classes, bins);
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
  return info;
}

#ifdef NANSCAN_WITH_CUDA
// CUDA entry points (csrc/cuda/scan_cuda.h): pointers and a stream handle in, nothing of torch.
void register_cuda(py::module_& m) {
  (void)m;
}
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "nanscan native kernels: fused NaN/inf/zero/subnormal counts, abs min/max and exponent histograms";
  m.def("scan_cpu", &scan_cpu_py, py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"), py::arg("records"),
        py::arg("chunk_elems"), py::arg("num_threads") = 0,
        "Scan tensors given as raw pointers into a (n, record width) int64 record array.");
  m.def("classify_bits", &classify_bits_py, py::arg("bits"), py::arg("dtype"),
        "Classify bit patterns with classify.h: returns (value classes, exponent bins or -1).");
  m.def("build_info", &build_info_py, "How the extension was built.");
#ifdef NANSCAN_WITH_CUDA
  register_cuda(m);
#endif
}
