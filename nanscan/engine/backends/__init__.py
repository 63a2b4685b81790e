"""Backend selection: which implementation scans a group of tensors, and why.

Policy (one place): the `backend=` argument, else the NANSCAN_BACKEND environment variable, else auto.
Auto picks the best available backend for each device (CPU: cpu > numba > reference; CUDA: cuda > numba-cuda >
reference)
and says once, through the `nanscan` logger, which one it chose and why a better one is missing. A backend asked
for by name that cannot run raises BackendUnavailable chained to the original error.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol, Sequence

import numpy as np
import torch

from nanscan.engine._native import native_module, tensor_access_status
from nanscan.engine.backends.cpu import CpuBackend
from nanscan.engine.inputs import ScanInput

log = logging.getLogger("nanscan")

ENV_VAR = "NANSCAN_BACKEND"
AUTO_ORDER = {"cpu": ("cpu", "numba", "reference"), "cuda": ("cuda", "numba-cuda", "reference")}


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run here; `__cause__` holds the original error."""


class Backend(Protocol):
    name: str

    def supports(self, device: torch.device) -> bool: ...

    def scan_records(self, inputs: Sequence[ScanInput]) -> np.ndarray: ...


def _load_numba():
    from nanscan.engine.backends.numba_cpu import NumbaBackend  # noqa: PLC0415 - numba is optional
    return NumbaBackend()


def _load_cuda():
    from nanscan.engine.backends.cuda import CudaBackend  # noqa: PLC0415 - needs the CUDA build and a GPU
    return CudaBackend()


def _load_numba_cuda():
    from nanscan.engine.backends.numba_cuda import NumbaCudaBackend  # noqa: PLC0415 - needs numba's CUDA target and a GPU
    return NumbaCudaBackend()


def _load_reference():
    from nanscan.engine.backends.reference import ReferenceBackend  # noqa: PLC0415
    return ReferenceBackend()


_LOADERS = {"cpu": CpuBackend, "numba": _load_numba, "cuda": _load_cuda, "numba-cuda": _load_numba_cuda,
            "reference": _load_reference}
BACKEND_NAMES = tuple(_LOADERS)

# What a user who set NANSCAN_BACKEND to a backend that cannot run here should do about it.
_ENV_HINT = f"unset {ENV_VAR} (or set it to auto) to let nanscan choose, or see `nanscan info` for what runs here"

_loaded: dict[str, Backend] = {}
_load_errors: dict[str, BaseException] = {}
_announced: set[str] = set()


def load(name: str) -> Backend:
    """The backend called `name`, loaded once; raises BackendUnavailable with the original error as cause."""
    if name not in _LOADERS:
        raise BackendUnavailable(f"unknown nanscan backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name in _loaded:
        return _loaded[name]
    if name not in _load_errors:
        try:
            _loaded[name] = _LOADERS[name]()
            return _loaded[name]
        except Exception as exc:  # noqa: BLE001 - any import/build failure makes the backend unavailable
            _load_errors[name] = exc
    exc = _load_errors[name]
    raise BackendUnavailable(f"nanscan backend {name!r} is unavailable: {type(exc).__name__}: {exc}") from exc


def requested_name(backend: str | None) -> str | None:
    """The explicitly requested backend name (argument, then environment), or None for auto."""
    name = backend if backend is not None else os.environ.get(ENV_VAR, "").strip() or None
    return None if name == "auto" else name


def select(device: torch.device, backend: "str | Backend | None" = None) -> Backend:
    """The backend that will scan tensors on `device`."""
    if backend is not None and not isinstance(backend, str):
        return backend  # a Backend instance (tests use this to force small chunks)
    name = requested_name(backend)
    if name is not None:
        from_env = backend is None
        try:
            chosen = load(name)
        except BackendUnavailable as exc:
            if not from_env:
                raise
            # Nothing in the caller's code names this backend: say where the choice came from and how to undo it.
            if name not in _LOADERS:
                raise BackendUnavailable(f"unknown nanscan backend {name!r} in {ENV_VAR}; set it to auto or one of "
                                         f"{', '.join(BACKEND_NAMES)}, or unset it") from None
            raise BackendUnavailable(f"{ENV_VAR}={name}: {exc}; {_ENV_HINT}") from exc.__cause__
        if not chosen.supports(device):
            problem = f"nanscan backend {name!r} cannot scan tensors on {device}"
            raise BackendUnavailable(f"{ENV_VAR}={name}: {problem}; {_ENV_HINT}" if from_env else problem)
        return chosen
    order = AUTO_ORDER.get(device.type, ("reference",))
    for candidate in order:
        try:
            chosen = load(candidate)
        except BackendUnavailable:
            continue
        if chosen.supports(device):
            _announce(device, candidate, order)
            return chosen
    raise BackendUnavailable(f"no nanscan backend can scan tensors on {device}")  # reference always loads


def _announce(device: torch.device, chosen: str, order: Sequence[str]) -> None:
    if device.type in _announced:
        return
    _announced.add(device.type)
    missing = [f"{name} ({type(err).__name__}: {err})" for name in order[: order.index(chosen)]
               if (err := _load_errors.get(name)) is not None]
    if missing:
        log.warning("nanscan: scanning %s tensors with the %r backend; unavailable: %s",
                    device.type, chosen, "; ".join(missing))
    else:
        log.info("nanscan: scanning %s tensors with the %r backend", device.type, chosen)


def cuda_build_note(compiled: bool, torch_cuda: str | None, gpu_visible: bool) -> str:
    """What build_info()'s "cuda" flag means here: it says the extension's CUDA part was compiled, not that it can
    run. torch_cuda: torch.version.cuda (None for a CPU-only torch); gpu_visible: torch.cuda.is_available()."""
    if not compiled:
        return "the cuda backend needs a build with nvcc"
    if torch_cuda is None:
        return "torch has no CUDA: not usable here"
    if not gpu_visible:
        return f"torch (CUDA {torch_cuda}) sees no GPU: not usable here"
    return "usable here"


def backend_info() -> dict:
    """What is built, what can run, and what auto would choose, per backend and device. info["build"] is the
    extension's build_info(), whose "cuda" says its CUDA part was compiled (cuda_build_note: whether it runs)."""
    info: dict = {"backends": {}, "active": {}, "env": {ENV_VAR: os.environ.get(ENV_VAR)},
                  "requested": requested_name(None)}  # None: auto, the best available per device
    for name in BACKEND_NAMES:
        try:
            load(name)
            info["backends"][name] = {"available": True}
        except BackendUnavailable as exc:
            info["backends"][name] = {"available": False, "error": str(exc.__cause__ or exc)}
    try:
        info["build"] = dict(native_module().build_info())
    except Exception as exc:  # noqa: BLE001
        info["build"] = {"error": f"{type(exc).__name__}: {exc}"}
    info["tensor_reads"] = tensor_access_status()  # the Monitor's per-step plan checks (NOTE: [tensor access])
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        try:
            info["active"][device.type] = select(device).name
        except BackendUnavailable as exc:
            info["active"][device.type] = f"error: {exc}"
    return info
