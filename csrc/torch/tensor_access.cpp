// tensor_access.cpp: nanscan._torch_access, the plan check's tensor reads through torch's C++ headers (NOTE:
// [tensor access]). A plain CPython module: it exports one PyCapsule (csrc/include/nanscan/tensor_access.h) and
// the torch version it was compiled against.
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include "nanscan/tensor_access.h"

// NOTE: [tensor access]
// The per-step plan check reads every parameter's, gradient's and optimizer state tensor's data pointer, dtype, size
// and contiguity, and the batch plan (nanscan/inputs.py) each batch tensor's. Through Python each read is a method call
// or attribute lookup (about 0.1 us, several times that in a training step, where the interpreter's caches are cold):
// 465 of them cost 89 us of a 0.45 ms check on the demo model, against 42 us for the same reads here. The price is
// torch's ABI: the object layouts below (THPVariable, THPDtype, TensorImpl) change between torch releases, so
// nanscan.scan uses this module only when `torch_version` equals the running torch.__version__ (a rebuild of nanscan
// fixes a mismatch), and otherwise reads through Python. The objects given are the plan's own tensors (torch.Tensor
// instances, subclasses included) and gradients (which torch's .grad setter keeps tensors); a read torch refuses (a
// tensor without storage, a sparse one) reports "changed", and the plan then prepares everything again the ordinary
// way.

namespace {

int stable(PyObject* tensor, PyObject* dtype, int64_t nbytes, int64_t* address) {
  try {
    const at::Tensor& t = THPVariable_Unpack(tensor);
    if (t.scalar_type() != reinterpret_cast<THPDtype*>(dtype)->scalar_type) return 0;
    if (static_cast<int64_t>(t.nbytes()) != nbytes) return 0;
    *address = static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
    return 1;
  } catch (...) {
    return 0;
  }
}

int contiguous(PyObject* tensor, int64_t* address) {
  try {
    const at::Tensor& t = THPVariable_Unpack(tensor);
    if (!t.is_contiguous()) return 0;
    *address = static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
    return 1;
  } catch (...) {
    return 0;
  }
}

int batch_leaf(PyObject* tensor, PyObject* dtype, int64_t nbytes, int64_t* address) {
  try {
    const at::Tensor& t = THPVariable_Unpack(tensor);
    if (t.scalar_type() != reinterpret_cast<THPDtype*>(dtype)->scalar_type) return 0;
    if (nbytes < 0) return 1;  // a skipped (integer) tensor: only its dtype matters
    if (t.layout() != at::kStrided || !t.device().is_cpu() || t.is_neg() || !t.is_contiguous() ||
        static_cast<int64_t>(t.nbytes()) != nbytes)
      return 0;
    *address = static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
    return 1;
  } catch (...) {
    return 0;
  }
}

int stamp(PyObject* tensor, int64_t* out) {
  try {
    const at::Tensor& t = THPVariable_Unpack(tensor);
    out[0] = static_cast<int64_t>(t._version());
    out[1] = static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
    out[2] = static_cast<int64_t>(t.scalar_type());
    return 1;
  } catch (...) {
    return 0;
  }
}

nanscan::TensorAccess tensor_access{stable, contiguous, batch_leaf, stamp};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_torch_access",
                          "nanscan's plan-check tensor reads through torch's C++ headers (see csrc/torch).",
                          -1, nullptr};

}  // namespace

#ifndef NANSCAN_TORCH_VERSION
#error "setup.py defines NANSCAN_TORCH_VERSION as the torch.__version__ this module is built against"
#endif

PyMODINIT_FUNC PyInit__torch_access() {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  PyObject* capsule = PyCapsule_New(&tensor_access, nanscan::kTensorAccessCapsule, nullptr);
  if (capsule == nullptr) {
    Py_DECREF(module);
    return nullptr;
  }
  const int added = PyModule_AddObjectRef(module, "tensor_access", capsule);
  Py_DECREF(capsule);
  if (added < 0 || PyModule_AddStringConstant(module, "torch_version", NANSCAN_TORCH_VERSION) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
