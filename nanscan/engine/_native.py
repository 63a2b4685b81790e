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
    """(the capsule of nanscan._torch_access, or None when it cannot be used here; how tensors are read, and why).
    The installed module when it was built for the running torch, else one built for it at first use (NOTE:
    [first-use build] in nanscan/engine/torch_access_build.py)."""
    import torch  # noqa: PLC0415 - here only: the compact history's encoder loads _C without torch (bundle reading)

    try:
        from nanscan import _torch_access  # noqa: PLC0415 - optional compiled extension
    except ImportError as exc:
        problem = f"nanscan._torch_access is not available ({exc})"
    else:
        if _torch_access.torch_version == torch.__version__:
            return _torch_access.tensor_access, ("through torch's C++ headers (nanscan._torch_access, built for torch "
                                                 f"{_torch_access.torch_version})")
        # Built against another torch, its reads would misinterpret this torch's objects: not even tried.
        problem = (f"nanscan._torch_access was built for torch {_torch_access.torch_version}, this is torch "
                   f"{torch.__version__}")
    try:
        native_module()
    except ImportError:
        # The plan checks that read through it are nanscan._C's: without them a build would buy nothing.
        return None, f"through Python calls: {problem}, and nanscan._C, whose plan checks would use it, does not load"
    # Imported here, with torch: nanscan.engine._native itself is loaded where torch may not be (bundle reading).
    from nanscan.engine import torch_access_build  # noqa: PLC0415

    built, how = torch_access_build.load_or_build()
    if built is None:
        return None, f"through Python calls: {problem}, and {how}"
    return built.tensor_access, f"through torch's C++ headers (nanscan._torch_access, {how})"


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
