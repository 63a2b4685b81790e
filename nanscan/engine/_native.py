"""The compiled extensions, each loaded in one place: nanscan._C (the scan kernels, the plan checks) and
nanscan._torch_access (tensor reads through torch's headers). Everything else asks here, so a missing or stale
build is explained once, with what to do about it."""

from __future__ import annotations

import importlib.util
from typing import Any


def native_module():
    """nanscan._C, or ImportError saying whether it is missing or broken and how to get it."""
    try:
        from nanscan import _C  # noqa: PLC0415 - optional compiled extension
    except ImportError as exc:
        # What `nanscan info` shows for a missing cpu backend: the import error alone does not say what to do.
        state = "does not load" if importlib.util.find_spec("nanscan._C") is not None else "is not built"
        raise ImportError(f"the native extension nanscan._C {state} ({exc}); reinstall nanscan where a C++ compiler "
                          "is available (with NANSCAN_REQUIRE_NATIVE=1 a failed build stops and says why)") from exc
    return _C


def _look_up_tensor_access() -> tuple[Any, str]:
    """(the capsule of nanscan._torch_access, or None when it cannot be used here; how tensors are read, and why)."""
    import torch  # noqa: PLC0415 - here only: the compact history's encoder loads _C without torch (bundle reading)

    try:
        from nanscan import _torch_access  # noqa: PLC0415 - optional compiled extension
    except ImportError as exc:
        return None, f"through Python calls: nanscan._torch_access is not available ({exc})"
    if _torch_access.torch_version != torch.__version__:
        # Built against another torch, its reads would misinterpret this torch's objects: not even tried.
        return None, (f"through Python calls: nanscan._torch_access was built for torch "
                      f"{_torch_access.torch_version}, this is torch {torch.__version__} (reinstall nanscan to "
                      "rebuild it)")
    return _torch_access.tensor_access, ("through torch's C++ headers (nanscan._torch_access, built for torch "
                                         f"{_torch_access.torch_version})")


_tensor_access: Any = False  # _look_up_tensor_access()'s answer, once asked


def tensor_access():
    """The capsule of nanscan._torch_access (NOTE: [tensor access] in csrc/torch/tensor_access.cpp) when it was
    built for the running torch, else None: the plan checks then read tensors through Python calls."""
    global _tensor_access
    if _tensor_access is False:
        _tensor_access = _look_up_tensor_access()
    return _tensor_access[0]


def tensor_access_status() -> str:
    """How the per-step plan checks read tensors here, and why (`nanscan info`)."""
    tensor_access()
    return _tensor_access[1]


def native_function(name: str) -> Any:
    """nanscan._C's `name` (a function or class), or None without the compiled extension."""
    try:
        from nanscan import _C  # noqa: PLC0415 - optional compiled extension
    except ImportError:
        return None
    return getattr(_C, name, None)
