// plan_check.cpp: the Monitor's per-step plan checks (NOTE: [plan check]): the comparisons of the model's, the
// optimizer's and the batch's Python objects with those the plan was built from, and the data pointers they yield.
#include "plan/plan_check.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cpu/compact_cpu.h"
#include "nanscan/classify.h"
#include "nanscan/stats_record.h"

namespace nanscan {
namespace plan {

// NOTE: [plan check]
// The per-step check of nanscan.engine.plans.ModelScanPlan (NOTE: [model scan plan] in nanscan/engine/plans.py), done
// here because in a training step the same check in Python cost more than the scan of a small model: between two checks
// the forward and backward passes evict the interpreter's code and data from the caches, so each Python function on
// the path costs tens of microseconds. Only identities are compared (the plan holds every object it compares
// with, so no id can have been reused). Tensors are read through nanscan._torch_access's functions when the caller
// passes them (NOTE: [tensor access] in csrc/torch/tensor_access.cpp), else through the methods it passes
// (Tensor.data_ptr, Tensor.is_contiguous) and attribute lookups: this file needs no torch headers either way.

void check_dtype_code(int32_t code, const char* where) {
  if (!is_dtype_code(code))
    throw py::value_error(std::string(where) + ": unknown dtype code " + std::to_string(code));
}

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

namespace {

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

// The plan check's walks over dictionaries (NOTE: [warm reads] in csrc/torch/tensor_access.cpp, for the same reason):
// their objects are asked for first, then the part of each keys table that PyDict_Next reads for a dictionary of
// that size (header, indices, entries of at most 24 bytes), then the dictionaries are walked.
constexpr Py_ssize_t kLine = 64;

void prefetch_lines(const void* at, Py_ssize_t bytes) {
  for (Py_ssize_t offset = 0; offset < bytes; offset += kLine)
    __builtin_prefetch(static_cast<const char*>(at) + offset, 0, 3);
}

void prefetch_keys(PyObject* dict) {
  if (!PyDict_Check(dict)) return;
  const auto* d = reinterpret_cast<const PyDictObject*>(dict);
  prefetch_lines(d->ma_keys, 48 + 26 * std::min<Py_ssize_t>(d->ma_used, 64));
  if (d->ma_values != nullptr) prefetch_lines(d->ma_values, 8 * std::min<Py_ssize_t>(d->ma_used, 64));
}

void prefetch_dicts(const py::list& dicts) {
  for (py::handle d : dicts) __builtin_prefetch(d.ptr(), 0, 3);
}

void prefetch_dict_keys(const py::list& dicts) {
  for (py::handle d : dicts) prefetch_keys(d.ptr());
}

// optimizer.state: its keys table, then each per-parameter dictionary, then their keys tables.
void prefetch_nested(PyObject* state) {
  if (!PyDict_Check(state)) return;
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(state, &pos, &key, &value)) __builtin_prefetch(value, 0, 3);
  pos = 0;
  while (PyDict_Next(state, &pos, &key, &value)) prefetch_keys(value);
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

}  // namespace

// NOTE: [scan table]
// The Monitor's every-step call on the CPU (check_scan_summary) scans a table that changes only when the batch's
// structure does: the batch's and the loss's inputs, then the model's. So the table is made once (nanscan.engine.plans
// keeps it with the joined identities) and checked once, and the call takes it whole instead of two arrays that
// pybind11 checks and converts again at every call, and makes the records array itself instead of being handed
// one from np.empty. Inside a step of the demo model (caches cold, ~500 us a check) those two had taken 17 us (the
// arguments' conversion) and 23-25 us; the array made here and the table's conversion, ~14 and ~6 us. (Keeping the
// last records arrays and handing one out again once nothing else held it measured slower than a new one.)
ScanTable::ScanTable(const CArray<int64_t>& numels, const CArray<int32_t>& dtypes, const char* where)
    : tasks_(make_tasks(numels, dtypes, where)) {}

py::tuple compact_arrays(const int64_t* records, py::ssize_t rows) {
  py::array_t<int64_t> scalars({rows, static_cast<py::ssize_t>(compact::kScalarSlots)});
  py::array_t<int16_t> ranges({rows, static_cast<py::ssize_t>(2)});
  uint64_t largest = 0;
  const int64_t total = compact::compact_ranges(records, rows, scalars.mutable_data(), ranges.mutable_data(),
                                                &largest);
  auto fill = [&](auto zero) -> py::array {
    using Count = decltype(zero);
    py::array_t<Count> counts(static_cast<py::ssize_t>(total));
    compact::compact_counts<Count>(records, rows, ranges.data(), counts.mutable_data());
    return counts;
  };
  py::array counts = largest <= UINT8_MAX ? fill(uint8_t{}) : largest <= UINT16_MAX ? fill(uint16_t{})
                     : largest <= UINT32_MAX ? fill(uint32_t{}) : fill(uint64_t{});
  return py::make_tuple(scalars, ranges, counts);
}

bool host_value(int64_t address, int32_t code, double& value) {
  const void* at = reinterpret_cast<const void*>(address);
  switch (code) {
    case kFloat32: {
      float v;
      std::memcpy(&v, at, sizeof(v));
      value = v;
      return true;
    }
    case kFloat64:
      std::memcpy(&value, at, sizeof(value));
      return true;
    case kBFloat16: {  // the top half of a float32
      uint16_t bits;
      std::memcpy(&bits, at, sizeof(bits));
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;
      float v;
      std::memcpy(&v, &wide, sizeof(v));
      value = v;
      return true;
    }
    case kFloat16: {
      uint16_t bits;
      std::memcpy(&bits, at, sizeof(bits));
      const int field = (bits >> 10) & 0x1F;
      const int mant = bits & 0x3FF;
      const double magnitude = field == 0x1F ? (mant ? std::numeric_limits<double>::quiet_NaN()
                                                     : std::numeric_limits<double>::infinity())
                               : field == 0 ? std::ldexp(mant, -24) : std::ldexp(mant | 0x400, field - 25);
      value = (bits & 0x8000) ? -magnitude : magnitude;
      return true;
    }
    default:  // float8: read in Python (nanscan.engine.inputs.read_host_scalar)
      return false;
  }
}

PlanCheck::PlanCheck(py::list child_dicts, py::list children, py::list param_dicts, py::list raw_params,
                     py::list state_values, py::list params, py::list grad_absent, py::list state_tensors,
                     py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_ptrs,
                     py::list stable_dtypes,
                     py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_nbytes,
                     py::object data_ptr, py::object is_contiguous, py::object tensor_access)
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

py::object PlanCheck::check(const py::object& optimizer_state, const py::list& extra_ptrs) const {
  py::array_t<int64_t> ptrs(py::len(extra_ptrs) + num_inputs());
  py::list grads;
  if (!run(optimizer_state, extra_ptrs, ptrs.mutable_data(), grads)) return py::none();
  return py::make_tuple(ptrs, grads);
}

py::object PlanCheck::check_and_scan(const py::object& optimizer_state, const py::list& extra_ptrs,
                                     const CArray<int64_t>& numels, const CArray<int32_t>& dtypes,
                                     py::array_t<int64_t, py::array::c_style> records, int64_t chunk_elems,
                                     int num_threads, const py::object& carried) const {
  const ScanTable table(numels, dtypes, "PlanCheck.check_and_scan");
  std::vector<int64_t> address;
  const int64_t nonfinite = scan_step(optimizer_state, extra_ptrs, table, records, chunk_elems, num_threads, carried,
                                      "PlanCheck.check_and_scan", address);
  return nonfinite < 0 ? py::none() : py::object(py::int_(nonfinite));
}

// NOTE: [step summary]
// What the Monitor reads of a step's records on every check, taken in the call that wrote them while they are in
// cache: their compact form for the history ring (NOTE: [compact records]), the sums of squares the spike
// statistic takes the logs of (the loss row's, and the gradient rows' added in row order from 0.0, as
// nanscan.runtime.spikes.log_values adds them), and a one-element loss's value, for the history. Measured inside a real
// step of the demo model, the same work in Python after the call cost about 70 us a check (a second native call
// for the compaction and its wrapper, a memoryview sum, a ctypes read), all of it in cold caches (NOTE: [cold
// check path] in nanscan/runtime/spikes.py); here it is a pass over records the scan just wrote: the compaction takes
// about 22 us of the call, the sums and the value under a microsecond.
py::object PlanCheck::check_scan_summary(const py::object& optimizer_state, const py::list& extra_ptrs,
                                         const ScanTable& table, int64_t chunk_elems, int num_threads,
                                         const py::object& carried, int64_t loss_row) const {
  const py::ssize_t num_extra = py::len(extra_ptrs);
  if (loss_row >= num_extra || loss_row < -1)
    throw py::value_error("PlanCheck.check_scan_summary: loss_row must name an extra input, or be -1");
  // Every slot is written by the scan (NOTE: [record writes] in csrc/cpu/scan_cpu.cpp); NOTE: [scan table].
  py::array_t<int64_t, py::array::c_style> records({table.size(), static_cast<py::ssize_t>(record::kWidth)});
  std::vector<int64_t> address;
  const int64_t nonfinite = scan_step(optimizer_state, extra_ptrs, table, records, chunk_elems, num_threads, carried,
                                      "PlanCheck.check_scan_summary", address);
  if (nonfinite < 0) return py::none();
  const int64_t* out = records.data();
  const py::ssize_t rows = records.shape(0);
  py::tuple compacted = compact_arrays(out, rows);
  auto sumsq_of = [&](int64_t row) {
    double v;
    std::memcpy(&v, out + row * record::kWidth + record::kSumSq, sizeof(v));
    return v;
  };
  double grad_sumsq = 0.0;
  for (int64_t r = num_extra + num_params_; r < num_extra + num_params_ + num_grads_; ++r) grad_sumsq += sumsq_of(r);
  py::object loss_sumsq = py::none(), loss_value = py::none();
  if (loss_row >= 0) {
    loss_sumsq = py::float_(sumsq_of(loss_row));
    double value;
    const ScanTask& loss = table.tasks()[loss_row];
    if (loss.numel == 1 && host_value(address[loss_row], loss.dtype, value)) loss_value = py::float_(value);
  }
  return py::make_tuple(records, py::int_(nonfinite), compacted[0], compacted[1], compacted[2], py::float_(grad_sumsq),
                        loss_sumsq, loss_value);
}

int64_t PlanCheck::scan_step(const py::object& optimizer_state, const py::list& extra_ptrs, const ScanTable& table,
                             py::array_t<int64_t, py::array::c_style>& records, int64_t chunk_elems, int num_threads,
                             const py::object& carried, const char* where, std::vector<int64_t>& address) const {
  const py::ssize_t n = py::len(extra_ptrs) + num_inputs();
  if (table.size() != n || records.ndim() != 2 || records.shape(0) != n || records.shape(1) != record::kWidth)
    throw py::value_error(std::string(where) + ": the table (numels, dtypes) and records need one entry per input (" +
                          std::to_string(n) + ")");
  std::vector<ScanTask> tasks = table.tasks();
  py::list holders;  // holds the carried arrays while their rows are read and written
  std::vector<Reuse> reused;
  std::vector<Standing> standing;
  carried_rows(carried, py::len(extra_ptrs), holders, reused, standing);
  for (const Reuse& r : reused) tasks[r.row].numel = 0;  // not read: its record is copied in below
  address.assign(n, 0);
  py::list grads;  // only held while the scan reads them
  bool unchanged = false;
  int64_t* out = records.mutable_data();
  // The check needs the GIL, which this thread holds throughout: the scan is short, and releasing the GIL
  // inside the parallel region would tie the kernel to Python.
  scan_cpu(tasks.data(), n, out, chunk_elems, num_threads, [&](ScanTask* to_fill) {
    if (!run(optimizer_state, extra_ptrs, address.data(), grads)) return false;
    unchanged = true;
    for (py::ssize_t i = 0; i < n; ++i) set_data(to_fill[i], address[i], i, where);
    return true;
  });
  if (!unchanged) return -1;  // nothing was scanned
  int64_t nonfinite = count_nonfinite(out, n);
  const bool whole = nonfinite > 0 && !reused.empty();
  if (whole) {  // a non-finite step's verdict never rests on a carried record: scan it whole
    tasks = table.tasks();
    for (py::ssize_t i = 0; i < n; ++i) set_data(tasks[i], address[i], i, where);
    scan_cpu(tasks.data(), n, out, chunk_elems, num_threads, Prologue());
    nonfinite = count_nonfinite(out, n);
  } else {
    for (const Reuse& r : reused)
      std::memcpy(out + r.row * record::kWidth, r.record, sizeof(int64_t) * record::kWidth);
  }
  // NOTE: [frozen records] in nanscan/engine/plans.py: what was scanned now stands in next time
  for (const Standing& s : standing) {
    if (!s.readable || !(s.moved || whole)) continue;  // nothing reused: every row was scanned now
    std::memcpy(s.stamp, s.now, sizeof(s.now));
    std::memcpy(s.record, out + s.row * record::kWidth, sizeof(int64_t) * record::kWidth);
  }
  return nonfinite;
}

void PlanCheck::carried_rows(const py::object& carried, py::ssize_t num_extra, py::list& holders,
                             std::vector<Reuse>& reused, std::vector<Standing>& standing) const {
  if (carried.is_none() || access_ == nullptr) return;
  if (PyList_Check(carried.ptr())) {
    for (py::handle part : carried.cast<py::list>()) carried_part(part, num_extra, holders, reused, standing);
    return;
  }
  carried_part(carried, num_extra, holders, reused, standing);
}

void PlanCheck::carried_part(const py::handle& part, py::ssize_t num_extra, py::list& holders,
                             std::vector<Reuse>& reused, std::vector<Standing>& standing) const {
  const auto parts = part.cast<py::tuple>();
  const bool is_standing = parts.size() == 4 && parts[3].ptr() == Py_True;
  if (parts.size() != 3 && !is_standing)
    throw py::value_error("PlanCheck.check_and_scan: a carried part is (stable, stamps, records) or (stable, "
                          "stamps, records, True)");
  const auto stable = parts[0].cast<CArray<int64_t>>();
  using Exact = py::array_t<int64_t, py::array::c_style>;
  // A standing part's arrays are written: they must be the caller's own arrays, never converted copies.
  Exact stamps, kept;
  if (is_standing) {
    stamps = Exact::ensure(parts[1]);
    kept = Exact::ensure(parts[2]);
    if (!stamps || !kept || stamps.ptr() != parts[1].ptr() || kept.ptr() != parts[2].ptr() || !stamps.writeable() ||
        !kept.writeable())
      throw py::value_error("PlanCheck.check_and_scan: a standing part's stamps and records are writable "
                            "C-ordered int64 arrays");
  } else {
    stamps = parts[1].cast<CArray<int64_t>>();
    kept = parts[2].cast<CArray<int64_t>>();
  }
  holders.append(stable);
  holders.append(stamps);
  holders.append(kept);
  const py::ssize_t k = stable.size();
  if (stamps.ndim() != 2 || stamps.shape(0) != k || stamps.shape(1) != 3 || kept.ndim() != 2 ||
      kept.shape(0) != k || kept.shape(1) != record::kWidth)
    throw py::value_error("PlanCheck.check_and_scan: carried needs one stamp (3) and one record per tensor");
  reused.reserve(reused.size() + k);
  for (py::ssize_t i = 0; i < k; ++i) {
    const int64_t j = stable.data()[i];
    if (j < 0 || j >= num_params_ + num_state_)
      throw py::value_error("PlanCheck.check_and_scan: carried names no parameter or state tensor");
    PyObject* tensor = j < num_params_ ? PyList_GET_ITEM(params_.ptr(), j)
                                       : PyList_GET_ITEM(state_tensors_.ptr(), j - num_params_);
    int64_t now[3];
    const int64_t* then = stamps.data() + 3 * i;
    const bool readable = access_->stamp(tensor, now) == 1;
    const bool same = readable && now[0] == then[0] && now[1] == then[1] && now[2] == then[2];
    const int64_t row = num_extra + (j < num_params_ ? j : num_grads_ + j);
    if (is_standing) {
      Standing s{row, stamps.mutable_data() + 3 * i, kept.mutable_data() + record::kWidth * i,
                 {now[0], now[1], now[2]}, !same, readable};
      standing.push_back(s);
    }
    if (same) reused.push_back({row, kept.data() + record::kWidth * i});
  }
}

bool PlanCheck::run(const py::object& optimizer_state, const py::list& extra_ptrs, int64_t* out,
                    py::list& grads) const {
  warm(optimizer_state);
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

void PlanCheck::warm(const py::object& optimizer_state) const {
  prefetch_dicts(child_dicts_);
  prefetch_dicts(param_dicts_);
  __builtin_prefetch(optimizer_state.ptr(), 0, 3);
  prefetch_dict_keys(child_dicts_);
  prefetch_dict_keys(param_dicts_);
  prefetch_keys(optimizer_state.ptr());
  prefetch_nested(optimizer_state.ptr());
  if (access_ == nullptr) return;
  access_->warm(reinterpret_cast<PyListObject*>(params_.ptr())->ob_item, num_params_, 1);
  access_->warm(reinterpret_cast<PyListObject*>(state_tensors_.ptr())->ob_item, num_state_, 0);
}

bool PlanCheck::stable_address(PyObject* tensor, py::ssize_t j, int64_t& address) const {
  PyObject* dtype = PyList_GET_ITEM(stable_dtypes_.ptr(), j);
  const int64_t nbytes = stable_nbytes_.data()[j];
  if (access_ != nullptr) return access_->stable(tensor, dtype, nbytes, &address) == 1;
  address = call_data_ptr(data_ptr_.ptr(), tensor);
  return same_extent(tensor, dtype, nbytes);
}

bool PlanCheck::contiguous_address(PyObject* grad, int64_t* address) const {
  if (access_ != nullptr) return access_->contiguous(grad, address) == 1;
  PyObject* contiguous = PyObject_CallOneArg(is_contiguous_.ptr(), grad);
  if (contiguous == nullptr) throw py::error_already_set();
  Py_DECREF(contiguous);
  if (contiguous != Py_True) return false;
  *address = call_data_ptr(data_ptr_.ptr(), grad);
  return true;
}

py::object tensor_stamps(const py::list& tensors, const py::object& tensor_access) {
  const auto* access = static_cast<const TensorAccess*>(PyCapsule_GetPointer(tensor_access.ptr(),
                                                                             kTensorAccessCapsule));
  if (access == nullptr) throw py::error_already_set();
  const py::ssize_t n = PyList_GET_SIZE(tensors.ptr());
  py::array_t<int64_t> out({n, py::ssize_t(3)});
  int64_t* row = out.mutable_data();
  for (py::ssize_t i = 0; i < n; ++i, row += 3)
    if (access->stamp(PyList_GET_ITEM(tensors.ptr(), i), row) != 1) return py::none();
  return std::move(out);
}

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

}  // namespace plan
}  // namespace nanscan
