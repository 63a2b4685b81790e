// bindings.cpp: the only pybind11 file. Turns numpy arrays into plain pointers for the CPU and CUDA kernels;
// the CUDA entry points exist only in builds with NANSCAN_WITH_CUDA.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu/scan_cpu.h"
#include "nanscan/classify.h"
#include "nanscan/stats_record.h"
#include "nanscan/tensor_access.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef NANSCAN_WITH_CUDA
#include <cstddef>
#include <cstring>
#include <stdexcept>

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

// Tasks for tensors of `numels` elements in the formats `dtypes`, checked; set_data gives each its memory.
std::vector<ScanTask> make_tasks(const CArray<int64_t>& numels, const CArray<int32_t>& dtypes, const char* where) {
  const py::ssize_t n = numels.size();
  if (dtypes.size() != n) throw py::value_error(std::string(where) + ": numels and dtypes must have the same length");
  std::vector<ScanTask> tasks(n);
  for (py::ssize_t i = 0; i < n; ++i) {
    check_dtype_code(dtypes.at(i), where);
    if (numels.at(i) < 0)
      throw py::value_error(std::string(where) + ": numels[" + std::to_string(i) + "] is negative");
    tasks[i] = {nullptr, numels.at(i), dtypes.at(i)};
  }
  return tasks;
}

// Points task i at `address`; a null address is refused for a tensor with elements.
void set_data(ScanTask& task, int64_t address, py::ssize_t i, const char* where) {
  if (task.numel > 0 && address == 0)
    throw py::value_error(std::string(where) + ": ptrs[" + std::to_string(i) + "] is null for a non-empty tensor");
  task.data = reinterpret_cast<const void*>(address);
}

std::vector<ScanTask> make_tasks(const CArray<int64_t>& ptrs, const CArray<int64_t>& numels,
                                const CArray<int32_t>& dtypes, const char* where) {
  if (numels.size() != ptrs.size() || dtypes.size() != ptrs.size())
    throw py::value_error(std::string(where) + ": ptrs, numels and dtypes must have the same length");
  std::vector<ScanTask> tasks = make_tasks(numels, dtypes, where);
  for (py::ssize_t i = 0; i < ptrs.size(); ++i) set_data(tasks[i], ptrs.at(i), i, where);
  return tasks;
}

// How many tensors hold a NaN or an infinity: the step's verdict, read while the records are in cache (asked from
// Python after every Monitor check, a numpy reduction over them cost tens of microseconds).
int64_t count_nonfinite(const int64_t* out, py::ssize_t n) {
  int64_t nonfinite = 0;
  for (py::ssize_t t = 0; t < n; ++t) {
    const int64_t* r = out + t * record::kWidth;
    nonfinite += (r[record::kNaN] | r[record::kPosInf] | r[record::kNegInf]) != 0;
  }
  return nonfinite;
}

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
  return count_nonfinite(out, n);
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
  switch (dtype) {
    case kFloat16: classify_all<Float16>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
    case kBFloat16: classify_all<BFloat16>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
    case kFloat32: classify_all<Float32>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
    case kFloat64: classify_all<Float64>(bits.data(), classes.mutable_data(), bins.mutable_data(), n); break;
  }
  return py::make_tuple(classes, bins);
}

// NOTE: [plan check]
// The per-step check of nanscan.scan.ModelScanPlan (NOTE: [model scan plan] in nanscan/scan.py), done here because
// in a training step the same check in Python cost more than the scan of a small model: between two checks the
// forward and backward passes evict the interpreter's code and data from the caches, so each Python function on
// the path costs tens of microseconds. Only identities are compared (the plan holds every object it compares
// with, so no id can have been reused). Tensors are read through nanscan._torch_access's functions when the caller
// passes them (NOTE: [tensor access] in csrc/torch/tensor_access.cpp), else through the methods it passes
// (Tensor.data_ptr, Tensor.is_contiguous) and attribute lookups: this file needs no torch headers either way.

// Whether the values of the dictionaries in `dicts`, in order, are exactly the objects in `expected`. With
// `nested`, each value of each dictionary is itself a dictionary whose values are compared (optimizer.state).
bool same_dict_values(PyObject* dicts, PyObject* expected, bool nested, Py_ssize_t& k) {
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  if (!PyDict_Check(dicts)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(expected);
  while (PyDict_Next(dicts, &pos, &key, &value)) {
    if (nested) {
      if (!same_dict_values(value, expected, false, k)) return false;
    } else {
      if (k >= n || value != PyList_GET_ITEM(expected, k)) return false;
      ++k;
    }
  }
  return true;
}

bool same_values_of_all(const py::list& dicts, const py::list& expected) {
  Py_ssize_t k = 0;
  for (py::handle d : dicts)
    if (!same_dict_values(d.ptr(), expected.ptr(), false, k)) return false;
  return k == PyList_GET_SIZE(expected.ptr());
}

int64_t call_data_ptr(PyObject* data_ptr, PyObject* tensor) {
  PyObject* result = PyObject_CallOneArg(data_ptr, tensor);
  if (result == nullptr) throw py::error_already_set();
  const int64_t address = static_cast<int64_t>(reinterpret_cast<intptr_t>(PyLong_AsVoidPtr(result)));
  Py_DECREF(result);
  if (PyErr_Occurred()) throw py::error_already_set();
  return address;
}

// Whether a parameter or state tensor still holds the bytes the plan's table describes: its dtype is the same
// object and its size in bytes is the same. A `.data` swap can land at the old address (the allocator reuses
// freed blocks): `w.data = w.data[:4]`, or `model.half()` then `model.bfloat16()`; the old element count or
// format would then be read, past the tensor's end or as the wrong format.
bool same_extent(PyObject* tensor, PyObject* expected_dtype, int64_t expected_nbytes) {
  static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
  static PyObject* nbytes_name = PyUnicode_InternFromString("nbytes");
  PyObject* dtype = PyObject_GetAttr(tensor, dtype_name);
  if (dtype == nullptr) throw py::error_already_set();
  Py_DECREF(dtype);  // torch's dtype objects live as long as torch: only identity is compared
  if (dtype != expected_dtype) return false;
  PyObject* nbytes = PyObject_GetAttr(tensor, nbytes_name);
  if (nbytes == nullptr) throw py::error_already_set();
  const long long value = PyLong_AsLongLong(nbytes);
  Py_DECREF(nbytes);
  if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
  return value == expected_nbytes;
}

// The plan's per-step check, holding what the rebuild found: the module tree (each module's child and parameter
// dicts and their values), the optimizer state's values, the parameters, which of them had no gradient, the
// scanned state tensors, and the parameters' then the state tensors' data pointers, dtypes and sizes in bytes.
// check() returns None when anything differs, else (pointers, gradients): the int64 data pointers of the extra
// inputs, parameters, present gradients and state tensors, in that order, and the present gradients.
// check_and_scan() instead scans them when nothing changed, the check running on the calling thread inside the
// scan's parallel region (NOTE: [wake overlap] in csrc/cpu/scan_cpu.cpp), and returns None or the number of
// tensors that hold a NaN or an infinity.
class PlanCheck {
 public:
  PlanCheck(py::list child_dicts, py::list children, py::list param_dicts, py::list raw_params,
            py::list state_values, py::list params, py::list grad_absent, py::list state_tensors,
            py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_ptrs, py::list stable_dtypes,
            py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_nbytes, py::object data_ptr,
            py::object is_contiguous, py::object tensor_access)
      : child_dicts_(std::move(child_dicts)), children_(std::move(children)), param_dicts_(std::move(param_dicts)),
        raw_params_(std::move(raw_params)), state_values_(std::move(state_values)), params_(std::move(params)),
        grad_absent_(std::move(grad_absent)), state_tensors_(std::move(state_tensors)),
        stable_ptrs_(std::move(stable_ptrs)), stable_dtypes_(std::move(stable_dtypes)),
        stable_nbytes_(std::move(stable_nbytes)), data_ptr_(std::move(data_ptr)),
        is_contiguous_(std::move(is_contiguous)) {
    num_params_ = py::len(params_);
    num_state_ = py::len(state_tensors_);
    const py::ssize_t num_stable = num_params_ + num_state_;
    if (py::len(grad_absent_) != static_cast<size_t>(num_params_) || stable_ptrs_.size() != num_stable ||
        py::len(stable_dtypes_) != static_cast<size_t>(num_stable) || stable_nbytes_.size() != num_stable)
      throw py::value_error("PlanCheck: grad_absent needs one entry per parameter, and stable_ptrs, stable_dtypes "
                            "and stable_nbytes one per parameter and state tensor");
    num_grads_ = 0;
    for (py::handle absent : grad_absent_) num_grads_ += absent.ptr() != Py_True;
    if (!tensor_access.is_none()) {
      access_ = static_cast<const TensorAccess*>(PyCapsule_GetPointer(tensor_access.ptr(), kTensorAccessCapsule));
      if (access_ == nullptr) throw py::error_already_set();
      access_owner_ = std::move(tensor_access);
    }
  }

  py::object check(const py::object& optimizer_state, const py::list& extra_ptrs) const {
    py::array_t<int64_t> ptrs(py::len(extra_ptrs) + num_inputs());
    py::list grads;
    if (!run(optimizer_state, extra_ptrs, ptrs.mutable_data(), grads)) return py::none();
    return py::make_tuple(ptrs, grads);
  }

  py::object check_and_scan(const py::object& optimizer_state, const py::list& extra_ptrs,
                            const CArray<int64_t>& numels, const CArray<int32_t>& dtypes,
                            py::array_t<int64_t, py::array::c_style> records, int64_t chunk_elems,
                            int num_threads) const {
    const py::ssize_t n = py::len(extra_ptrs) + num_inputs();
    if (numels.size() != n || dtypes.size() != n || records.ndim() != 2 || records.shape(0) != n ||
        records.shape(1) != record::kWidth)
      throw py::value_error("PlanCheck.check_and_scan: numels, dtypes and records need one entry per input (" +
                            std::to_string(n) + ")");
    std::vector<ScanTask> tasks = make_tasks(numels, dtypes, "PlanCheck.check_and_scan");
    std::vector<int64_t> address(n);
    py::list grads;  // only held while the scan reads them
    bool unchanged = false;
    int64_t* out = records.mutable_data();
    // The check needs the GIL, which this thread holds throughout: the scan is short, and releasing the GIL
    // inside the parallel region would tie the kernel to Python.
    scan_cpu(tasks.data(), n, out, chunk_elems, num_threads, [&](ScanTask* to_fill) {
      if (!run(optimizer_state, extra_ptrs, address.data(), grads)) return false;
      unchanged = true;
      for (py::ssize_t i = 0; i < n; ++i) set_data(to_fill[i], address[i], i, "PlanCheck.check_and_scan");
      return true;
    });
    if (!unchanged) return py::none();  // nothing was scanned
    return py::int_(count_nonfinite(out, n));
  }

 private:
  py::ssize_t num_inputs() const { return num_params_ + num_grads_ + num_state_; }

  // Writes the pointers to `out` and the present gradients to `grads`; false when anything changed.
  bool run(const py::object& optimizer_state, const py::list& extra_ptrs, int64_t* out, py::list& grads) const {
    if (!same_values_of_all(child_dicts_, children_) || !same_values_of_all(param_dicts_, raw_params_)) return false;
    Py_ssize_t k = 0;  // state values matched; no optimizer has none
    if (!optimizer_state.is_none() && !same_dict_values(optimizer_state.ptr(), state_values_.ptr(), true, k))
      return false;
    if (k != static_cast<Py_ssize_t>(py::len(state_values_))) return false;
    static PyObject* grad_name = PyUnicode_InternFromString("grad");
    py::list found;
    const py::ssize_t num_extra = py::len(extra_ptrs);
    for (py::ssize_t i = 0; i < num_extra; ++i) out[i] = py::cast<int64_t>(extra_ptrs[i]);
    out += num_extra;
    int64_t* grad_out = out + num_params_;
    for (py::ssize_t i = 0; i < num_params_; ++i) {
      PyObject* grad = PyObject_GetAttr(PyList_GET_ITEM(params_.ptr(), i), grad_name);
      if (grad == nullptr) throw py::error_already_set();
      py::object owned = py::reinterpret_steal<py::object>(grad);
      const bool absent = grad == Py_None;
      if (absent != (PyList_GET_ITEM(grad_absent_.ptr(), i) == Py_True)) return false;
      if (absent) continue;
      // The plan uses this check only when every gradient was contiguous at the rebuild.
      if (!contiguous_address(grad, grad_out)) return false;
      ++grad_out;
      found.append(owned);
    }
    const int64_t* expected = stable_ptrs_.data();
    for (py::ssize_t j = 0; j < num_params_ + num_state_; ++j) {
      PyObject* tensor = j < num_params_ ? PyList_GET_ITEM(params_.ptr(), j)
                                         : PyList_GET_ITEM(state_tensors_.ptr(), j - num_params_);
      int64_t& address = j < num_params_ ? out[j] : out[num_grads_ + j];
      if (!stable_address(tensor, j, address) || address != expected[j]) return false;
    }
    grads = std::move(found);
    return true;
  }

  // A parameter's or state tensor's data pointer, when it still has the dtype and size in bytes of stable tensor j.
  bool stable_address(PyObject* tensor, py::ssize_t j, int64_t& address) const {
    PyObject* dtype = PyList_GET_ITEM(stable_dtypes_.ptr(), j);
    const int64_t nbytes = stable_nbytes_.data()[j];
    if (access_ != nullptr) return access_->stable(tensor, dtype, nbytes, &address) == 1;
    address = call_data_ptr(data_ptr_.ptr(), tensor);
    return same_extent(tensor, dtype, nbytes);
  }

  // A gradient's data pointer, when it is contiguous.
  bool contiguous_address(PyObject* grad, int64_t* address) const {
    if (access_ != nullptr) return access_->contiguous(grad, address) == 1;
    PyObject* contiguous = PyObject_CallOneArg(is_contiguous_.ptr(), grad);
    if (contiguous == nullptr) throw py::error_already_set();
    Py_DECREF(contiguous);
    if (contiguous != Py_True) return false;
    *address = call_data_ptr(data_ptr_.ptr(), grad);
    return true;
  }

  py::list child_dicts_, children_, param_dicts_, raw_params_, state_values_, params_, grad_absent_, state_tensors_;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_ptrs_;
  py::list stable_dtypes_;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_nbytes_;
  py::object data_ptr_, is_contiguous_;
  const TensorAccess* access_ = nullptr;  // nanscan._torch_access's reads (NOTE: [tensor access]), else Python calls
  py::object access_owner_;               // the capsule, held as long as its pointer is used
  py::ssize_t num_params_ = 0, num_state_ = 0, num_grads_ = 0;
};

// The per-step check of nanscan.inputs.BatchPlan (NOTE: [batch plan] in nanscan/inputs.py): whether `batch` and
// `loss` have the structure of the batch the plan prepared, given as the tuple (kind, keys, dtypes, nbytes,
// tensor_type, tensor_access, loss_dtype, loss_nbytes): kind 0 no batch, 1 one tensor, 2 a dict with `keys` in
// this order, 3 a list, 4 a tuple; per leaf its dtype object and, for a scanned one, its size in bytes (-1 for a
// skipped one); leaves and the loss of exactly type tensor_type (torch.Tensor); loss_dtype None for no loss.
// Returns (the scanned leaves then the loss, their data pointers), or None when anything differs.
py::object batch_leaves(const py::handle& batch, const py::handle& loss, const py::tuple& plan) {
  if (plan.size() != 8) throw py::value_error("batch_leaves: the plan is an 8-tuple");
  const int kind = plan[0].cast<int>();
  PyObject* keys = plan[1].ptr();
  PyObject* dtypes = plan[2].ptr();
  PyObject* nbytes = plan[3].ptr();
  PyObject* tensor_type = plan[4].ptr();
  const auto* access = static_cast<const TensorAccess*>(PyCapsule_GetPointer(plan[5].ptr(), kTensorAccessCapsule));
  if (access == nullptr) throw py::error_already_set();
  if (!PyTuple_Check(dtypes) || !PyTuple_Check(nbytes) || PyTuple_GET_SIZE(dtypes) != PyTuple_GET_SIZE(nbytes))
    throw py::value_error("batch_leaves: dtypes and nbytes are tuples of one length");
  const Py_ssize_t n = PyTuple_GET_SIZE(dtypes);
  py::list scanned, addresses;
  int64_t address = 0;
  auto leaf = [&](PyObject* value, PyObject* dtype, PyObject* size) {
    if (Py_TYPE(value) != reinterpret_cast<PyTypeObject*>(tensor_type)) return false;
    const long long expected = PyLong_AsLongLong(size);
    if (expected == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (access->batch_leaf(value, dtype, expected, &address) != 1) return false;
    if (expected >= 0) {
      scanned.append(value);
      addresses.append(py::int_(address));
    }
    return true;
  };
  PyObject* root = batch.ptr();
  switch (kind) {
    case 0:
      if (root != Py_None) return py::none();
      break;
    case 1:
      if (n != 1 || !leaf(root, PyTuple_GET_ITEM(dtypes, 0), PyTuple_GET_ITEM(nbytes, 0))) return py::none();
      break;
    case 2: {
      if (!PyDict_CheckExact(root) || PyDict_GET_SIZE(root) != n || !PyTuple_Check(keys)) return py::none();
      PyObject *key, *value;
      Py_ssize_t pos = 0, i = 0;
      while (PyDict_Next(root, &pos, &key, &value)) {
        PyObject* expected_key = PyTuple_GET_ITEM(keys, i);
        if (key != expected_key) {
          const int same = PyObject_RichCompareBool(key, expected_key, Py_EQ);
          if (same < 0) throw py::error_already_set();
          if (!same) return py::none();
        }
        if (!leaf(value, PyTuple_GET_ITEM(dtypes, i), PyTuple_GET_ITEM(nbytes, i))) return py::none();
        ++i;
      }
      break;
    }
    case 3:
    case 4: {
      const bool is_list = kind == 3;
      if (is_list ? !PyList_CheckExact(root) : !PyTuple_CheckExact(root)) return py::none();
      if ((is_list ? PyList_GET_SIZE(root) : PyTuple_GET_SIZE(root)) != n) return py::none();
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* value = is_list ? PyList_GET_ITEM(root, i) : PyTuple_GET_ITEM(root, i);
        if (!leaf(value, PyTuple_GET_ITEM(dtypes, i), PyTuple_GET_ITEM(nbytes, i))) return py::none();
      }
      break;
    }
    default:
      throw py::value_error("batch_leaves: unknown batch kind " + std::to_string(kind));
  }
  PyObject* loss_dtype = plan[6].ptr();
  if ((loss_dtype == Py_None) != loss.is_none()) return py::none();
  if (loss_dtype != Py_None && !leaf(loss.ptr(), loss_dtype, plan[7].ptr())) return py::none();
  return py::make_tuple(scanned, addresses);
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
  info["record_slots"] = slots;
  py::dict codes;
  codes["float16"] = static_cast<int>(kFloat16);
  codes["bfloat16"] = static_cast<int>(kBFloat16);
  codes["float32"] = static_cast<int>(kFloat32);
  codes["float64"] = static_cast<int>(kFloat64);
  info["dtype_codes"] = codes;
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
  m.def("build_info", &build_info_py, "How the extension was built.");
  m.def("batch_leaves", &batch_leaves, py::arg("batch"), py::arg("loss"), py::arg("plan"),
        "The per-step check of nanscan.inputs.BatchPlan: (the scanned leaves and the loss, their data pointers), or "
        "None if the batch's structure changed.");
  py::class_<PlanCheck>(m, "PlanCheck",
                        "The per-step check of nanscan.scan.ModelScanPlan (NOTE: [plan check]), built at its rebuild.")
      .def(py::init<py::list, py::list, py::list, py::list, py::list, py::list, py::list, py::list,
                    py::array_t<int64_t, py::array::c_style | py::array::forcecast>, py::list,
                    py::array_t<int64_t, py::array::c_style | py::array::forcecast>, py::object, py::object,
                    py::object>(),
           py::arg("child_dicts"), py::arg("children"), py::arg("param_dicts"), py::arg("raw_params"),
           py::arg("state_values"), py::arg("params"), py::arg("grad_absent"), py::arg("state_tensors"),
           py::arg("stable_ptrs"), py::arg("stable_dtypes"), py::arg("stable_nbytes"), py::arg("data_ptr"),
           py::arg("is_contiguous"), py::arg("tensor_access") = py::none())
      .def("check", &PlanCheck::check, py::arg("optimizer_state"), py::arg("extra_ptrs"),
           "None if anything changed since the rebuild, else (pointers, gradients).")
      .def("check_and_scan", &PlanCheck::check_and_scan, py::arg("optimizer_state"), py::arg("extra_ptrs"),
           py::arg("numels"), py::arg("dtypes"), py::arg("records"), py::arg("chunk_elems"),
           py::arg("num_threads") = 0,
           "check() and, when nothing changed, the scan of the inputs it found into records: None (changed, nothing "
           "scanned) or the number of tensors holding a NaN or an infinity.");
#ifdef NANSCAN_WITH_CUDA
  register_cuda(m);
#endif
}
