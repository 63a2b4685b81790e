// plan_check.h: the Monitor's per-step plan checks in C++ (NOTE: [plan check] in plan_check.cpp): PlanCheck for
// nanscan.engine.plans.ModelScanPlan, batch_leaves for nanscan.engine.plans.BatchPlan, and the checks of numpy scan
// arguments that they share with csrc/bindings.cpp. Python-facing: they compare Python objects, through pybind11 and
// the C API.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "cpu/scan_cpu.h"
#include "nanscan/tensor_access.h"

namespace nanscan {
namespace plan {

namespace py = pybind11;

template <typename T>
using CArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

// Raises ValueError, naming `where`, for a code that is no classify.h DType.
void check_dtype_code(int32_t code, const char* where);

// Tasks for tensors of `numels` elements in the formats `dtypes`, checked; set_data gives each its memory.
std::vector<ScanTask> make_tasks(const CArray<int64_t>& numels, const CArray<int32_t>& dtypes, const char* where);

// Points task i at `address`; a null address is refused for a tensor with elements.
void set_data(ScanTask& task, int64_t address, py::ssize_t i, const char* where);

// Tasks for the tensors at `ptrs`, checked like the two above.
std::vector<ScanTask> make_tasks(const CArray<int64_t>& ptrs, const CArray<int64_t>& numels,
                                const CArray<int32_t>& dtypes, const char* where);

// A host scan's records compacted (NOTE: [compact records] in nanscan/compact.h): (scalars, ranges, counts), the
// counts in the narrowest unsigned type that holds the largest.
py::tuple compact_arrays(const int64_t* records, py::ssize_t rows);

// The value of the element of format `code` at host `address`, for float32, float64, bfloat16 and float16 (false
// for the others).
bool host_value(int64_t address, int32_t code, double& value);

// A step's input table without pointers (NOTE: [scan table] in plan_check.cpp): each input's element count and
// format, checked once.
class ScanTable {
 public:
  // `where` names the caller in errors.
  ScanTable(const CArray<int64_t>& numels, const CArray<int32_t>& dtypes, const char* where = "ScanTable");

  py::ssize_t size() const { return static_cast<py::ssize_t>(tasks_.size()); }
  // One task per input, its data pointer unset.
  const std::vector<ScanTask>& tasks() const { return tasks_; }

 private:
  std::vector<ScanTask> tasks_;
};

// The plan's per-step check, holding what the rebuild found: the module tree (each module's child and parameter
// dicts and their values), the optimizer state's values, the parameters, which of them had no gradient, the
// scanned state tensors, and the parameters' then the state tensors' data pointers, dtypes and sizes in bytes.
// check() returns None when anything differs, else (pointers, gradients): the int64 data pointers of the extra
// inputs, parameters, present gradients and state tensors, in that order, and the present gradients.
// check_and_scan() instead scans them when nothing changed, the check running on the calling thread inside the
// scan's parallel region (NOTE: [wake overlap] in csrc/cpu/scan_cpu.cpp), and returns None or the number of
// tensors that hold a NaN or an infinity; records `carried` from a scan since (nanscan.runtime.update NOTE:
// [carried records]) stand in for the tensors whose stamps did not move, unless the step is non-finite.
// `carried` is None, one part (stable indices, stamps, records) or a list of parts, a later part's row winning
// over an earlier one's for the same tensor; a part given as (stable indices, stamps, records, True) is a
// standing one (nanscan.engine.plans NOTE: [frozen records]): its own arrays are refreshed in place with the stamps and
// records of the tensors this call scanned (those whose stamps moved, or all of them when the step was scanned
// whole), so it stands in again at the next call. check_scan_summary() is check_and_scan() over a ScanTable's
// inputs, into records it makes, that also returns them and the step's summary (NOTE: [step summary] in
// plan_check.cpp): None, or (the records, the number of non-finite tensors, the compact scalars, ranges and
// counts, the gradient rows' sum of squares, the sum of squares of the loss at extra input `loss_row` and its
// value when it has one element and a format host_value reads; None where there is none).
class PlanCheck {
 public:
  PlanCheck(py::list child_dicts, py::list children, py::list param_dicts, py::list raw_params,
            py::list state_values, py::list params, py::list grad_absent, py::list state_tensors,
            py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_ptrs, py::list stable_dtypes,
            py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_nbytes, py::object data_ptr,
            py::object is_contiguous, py::object tensor_access);

  py::object check(const py::object& optimizer_state, const py::list& extra_ptrs) const;

  py::object check_and_scan(const py::object& optimizer_state, const py::list& extra_ptrs,
                            const CArray<int64_t>& numels, const CArray<int32_t>& dtypes,
                            py::array_t<int64_t, py::array::c_style> records, int64_t chunk_elems,
                            int num_threads, const py::object& carried) const;
  py::object check_scan_summary(const py::object& optimizer_state, const py::list& extra_ptrs, const ScanTable& table,
                                int64_t chunk_elems, int num_threads, const py::object& carried,
                                int64_t loss_row) const;

 private:
  // A carried record (nanscan.runtime.update NOTE: [carried records]): the table row it fills and its 2 KiB.
  struct Reuse {
    int64_t row;
    const int64_t* record;
  };

  // A standing part's row (see check_and_scan): the table row, where its stamp and record are kept, the stamp
  // read before the scan, and whether that stamp moved (the tensor is scanned) or could not be read (kept as is).
  struct Standing {
    int64_t row;
    int64_t* stamp;
    int64_t* record;
    int64_t now[3];
    bool moved, readable;
  };

  // The rows of `carried` (its parts, each (stable indices, their (version, data pointer, dtype) stamps, their
  // records)) whose tensors still have those stamps, and the rows of its standing parts; none without
  // nanscan._torch_access's reads. `holders` keeps the arrays alive while their pointers are used.
  void carried_rows(const py::object& carried, py::ssize_t num_extra, py::list& holders, std::vector<Reuse>& reused,
                    std::vector<Standing>& standing) const;

  // One part of carried_rows.
  void carried_part(const py::handle& part, py::ssize_t num_extra, py::list& holders, std::vector<Reuse>& reused,
                    std::vector<Standing>& standing) const;

  // check_and_scan's work: the number of tensors holding a NaN or an infinity, or -1 when the plan changed and
  // nothing was scanned; `address` gets every input's data pointer. `where` names the caller in errors.
  int64_t scan_step(const py::object& optimizer_state, const py::list& extra_ptrs, const ScanTable& table,
                    py::array_t<int64_t, py::array::c_style>& records, int64_t chunk_elems, int num_threads,
                    const py::object& carried, const char* where, std::vector<int64_t>& address) const;
  py::ssize_t num_inputs() const { return num_params_ + num_grads_ + num_state_; }

  // Writes the pointers to `out` and the present gradients to `grads`; false when anything changed.
  bool run(const py::object& optimizer_state, const py::list& extra_ptrs, int64_t* out, py::list& grads) const;

  // Asks the caches for what run() reads (NOTE: [warm reads] in csrc/torch/tensor_access.cpp).
  void warm(const py::object& optimizer_state) const;

  // A parameter's or state tensor's data pointer, when it still has the dtype and size in bytes of stable tensor j.
  bool stable_address(PyObject* tensor, py::ssize_t j, int64_t& address) const;

  // A gradient's data pointer, when it is contiguous.
  bool contiguous_address(PyObject* grad, int64_t* address) const;

  py::list child_dicts_, children_, param_dicts_, raw_params_, state_values_, params_, grad_absent_, state_tensors_;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_ptrs_;
  py::list stable_dtypes_;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> stable_nbytes_;
  py::object data_ptr_, is_contiguous_;
  const TensorAccess* access_ = nullptr;  // nanscan._torch_access's reads (NOTE: [tensor access]), else Python calls
  py::object access_owner_;               // the capsule, held as long as its pointer is used
  py::ssize_t num_params_ = 0, num_state_ = 0, num_grads_ = 0;
};

// The per-step check of nanscan.engine.plans.BatchPlan (NOTE: [batch plan] in nanscan/engine/plans.py): whether `batch`
// and `loss` have the structure of the batch the plan prepared, given as the tuple (kind, keys, dtypes, nbytes,
// tensor_type, tensor_access, loss_dtype, loss_nbytes): kind 0 no batch, 1 one tensor, 2 a dict with `keys` in
// this order, 3 a list, 4 a tuple; per leaf its dtype object and, for a scanned one, its size in bytes (-1 for a
// skipped one); leaves and the loss of exactly type tensor_type (torch.Tensor); loss_dtype None for no loss.
// Returns (the scanned leaves then the loss, their data pointers), or None when anything differs.
py::object batch_leaves(const py::handle& batch, const py::handle& loss, const py::tuple& plan);

// Each tensor's (version counter, data pointer, scalar type) as an (n, 3) int64 array, read through
// nanscan._torch_access's capsule (TensorAccess::stamp), or None when one cannot be read that way.
py::object tensor_stamps(const py::list& tensors, const py::object& tensor_access);

}  // namespace plan
}  // namespace nanscan
