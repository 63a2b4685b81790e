// tensor_access.h: the C interface through which nanscan._C reads tensors during the plan check (NOTE: [plan
// check] in csrc/plan/plan_check.cpp) without a Python call per tensor. The optional module nanscan._torch_access
// (csrc/torch/tensor_access.cpp), built against torch's headers, exports these functions in a PyCapsule; this
// header names no torch type, so nanscan._C itself never depends on torch's ABI.
#pragma once

#include <Python.h>

#include <cstdint>

namespace nanscan {

struct TensorAccess {
  // A parameter or state tensor: sets *address to its data pointer and returns 1 when it still has `dtype` (a
  // torch.dtype object) and `nbytes` bytes, 0 when not (or when it cannot be read this way). Never raises.
  int (*stable)(PyObject* tensor, PyObject* dtype, int64_t nbytes, int64_t* address);
  // A gradient: sets *address and returns 1 when it is contiguous (and readable this way), else 0. Never raises.
  int (*contiguous)(PyObject* tensor, int64_t* address);
  // A batch or loss tensor (NOTE: [batch plan] in nanscan/engine/plans.py): returns 1 when it has `dtype` and, for one
  // that is scanned (nbytes >= 0), `nbytes` bytes in one contiguous, strided run of CPU memory without a lazy
  // negation, setting *address; else 0. Never raises.
  int (*batch_leaf)(PyObject* tensor, PyObject* dtype, int64_t nbytes, int64_t* address);
  // What a write to a tensor changes (nanscan.runtime.update NOTE: [carried records]): sets out[0] to its autograd
  // version counter, out[1] to its data pointer and out[2] to its scalar type, and returns 1; 0 (nothing set) when
  // it cannot be read this way. Never raises.
  int (*stamp)(PyObject* tensor, int64_t* out);
  // A hint: asks the caches for what the reads above will load of `n` tensors (with `with_grads`, their gradients'
  // too), so that their cache misses overlap (NOTE: [warm reads] in csrc/torch/tensor_access.cpp). Reads nothing
  // it could fault on, changes nothing, never raises.
  void (*warm)(PyObject* const* tensors, int64_t n, int with_grads);
};

// The capsule's name; the module checks the torch version it was built for before it hands the capsule out.
constexpr const char* kTensorAccessCapsule = "nanscan._torch_access.TensorAccess";

}  // namespace nanscan
