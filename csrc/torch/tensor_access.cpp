// tensor_access.cpp: nanscan._torch_access, the plan check's tensor reads through torch's C++ headers (NOTE:
// [tensor access]). A plain CPython module: it exports one PyCapsule (csrc/include/nanscan/tensor_access.h) and
// the torch version it was compiled against.
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstddef>

#include "nanscan/tensor_access.h"

// NOTE: [tensor access]
// The per-step plan check reads every parameter's, gradient's and optimizer state tensor's data pointer, dtype, size
// and contiguity, and the batch plan (nanscan/engine/plans.py) each batch tensor's. Through Python each read is a
// method call or attribute lookup (about 0.1 us, several times that in a training step, where the interpreter's caches
// are cold): 465 of them cost 89 us of a 0.45 ms check on the demo model, against 42 us for the same reads here. The
// price is torch's ABI: the object layouts below (THPVariable, THPDtype, TensorImpl) change between torch releases, so
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

// NOTE: [warm reads]
// Each read above is a chain of dependent loads: the Python object, its TensorImpl, the StorageImpl that holds the
// data pointer; for a parameter's gradient also the AutogradMeta, the gradient's TensorImpl, its Python object and
// its StorageImpl. Between two checks the forward and backward passes evict all of them from the caches, so each
// load is a miss that the next one waits on, and one tensor after another the chains run end to end. warm() walks the
// same chains kWarmBatch tensors at a time, level by level: it asks for one level of every tensor of the batch before
// it reads that level, so a batch's misses overlap instead of queueing. Besides prefetches (which never fault) it
// reads only what torch's own accessors behind the reads above load (a TensorImpl's storage and autograd meta, the
// meta's gradient, the gradient's Python object slot), so it is as safe as they are. Inside a step of the demo
// model (145 tensors; 2-core development machine, timed with the TSC in PlanCheck::run): the dictionary walks 25-28
// -> 14-17 us, the gradients' reads 31-37 -> 15-20 us, the parameters' and state's 19-39 -> 5-6 us, for 12-14 us of
// warm-up (the plan check's dictionaries included, csrc/plan/plan_check.cpp); the whole PlanCheck.check call, timed
// from Python, 158-160 -> 121-122 us; the Monitor's whole check, warmed and unwarmed checks alternating in one
// process (5 runs of 1,000 steps), 14-32 us less. With its objects in cache the plan check takes ~6 us either way.
constexpr int64_t kWarmBatch = 32;
constexpr std::size_t kCacheLine = 64;

template <typename T>
void prefetch_object(const T* object) {
  const char* bytes = reinterpret_cast<const char*>(object);
  for (std::size_t at = 0; at < sizeof(T); at += kCacheLine) __builtin_prefetch(bytes + at, 0, 3);
}

void prefetch_storage(const c10::TensorImpl* impl) {
  if (impl->has_storage()) prefetch_object(impl->unsafe_storage().unsafeGetStorageImpl());
}

// A tensor's autograd meta (torch::autograd::impl::get_autograd_meta's cast: every autograd meta torch makes is an
// AutogradMeta), or nullptr.
const torch::autograd::AutogradMeta* autograd_meta(const c10::TensorImpl* impl) {
  return static_cast<const torch::autograd::AutogradMeta*>(impl->autograd_meta());
}

void warm(PyObject* const* tensors, int64_t n, int with_grads) {
  const c10::TensorImpl* impls[kWarmBatch];
  const torch::autograd::AutogradMeta* metas[kWarmBatch];
  const c10::TensorImpl* grads[kWarmBatch];
  try {
    for (int64_t first = 0; first < n; first += kWarmBatch) {
      const int64_t m = std::min(kWarmBatch, n - first);
      PyObject* const* batch = tensors + first;
      for (int64_t i = 0; i < m; ++i) prefetch_object(reinterpret_cast<const THPVariable*>(batch[i]));
      for (int64_t i = 0; i < m; ++i) {
        impls[i] = THPVariable_Unpack(batch[i]).unsafeGetTensorImpl();
        prefetch_object(impls[i]);
      }
      for (int64_t i = 0; i < m; ++i) {
        prefetch_storage(impls[i]);
        metas[i] = with_grads ? autograd_meta(impls[i]) : nullptr;
        if (metas[i] != nullptr) prefetch_object(metas[i]);
      }
      if (!with_grads) continue;
      for (int64_t i = 0; i < m; ++i) {
        const bool has_grad = metas[i] != nullptr && metas[i]->grad_.defined();
        grads[i] = has_grad ? metas[i]->grad_.unsafeGetTensorImpl() : nullptr;
        if (grads[i] != nullptr) prefetch_object(grads[i]);
      }
      for (int64_t i = 0; i < m; ++i) {
        if (grads[i] == nullptr) continue;
        if (PyObject* object = grads[i]->pyobj_slot()->load_pyobj(); object != nullptr)
          prefetch_object(reinterpret_cast<const THPVariable*>(object));
        prefetch_storage(grads[i]);
      }
    }
  } catch (...) {
    // A hint only: a tensor torch will not read this way is reported by the reads themselves.
  }
}

nanscan::TensorAccess tensor_access{stable, contiguous, batch_leaf, stamp, warm};

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
