"""The core scan as the dataset checks use it: the tensors it reads, and finding and describing the non-finite and
overflow values (NOTE: [overflow] in nanscan/engine/headroom.py) it counts.

Every reader and the record check scan through `scan_tensors`; only a tensor the scan flags is searched element by
element, with the masks and descriptions here.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

import nanscan
from nanscan.engine import backends
from nanscan.engine.headroom import OVERFLOW_MIN


_SCANNED_TORCH = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)


def as_scannable(array: Any) -> torch.Tensor | None:
    """A floating tensor view of an array for nanscan.scan, or None when it cannot hold non-finite values."""
    if isinstance(array, torch.Tensor):
        t = array.detach()
        if not (t.is_floating_point() or t.is_complex()):
            return None
        # float8 and other narrow formats are not scanned natively; widening keeps NaN and inf as they are.
        return t if t.dtype in _SCANNED_TORCH else t.to(torch.complex128 if t.is_complex() else torch.float32)
    a = np.asarray(array)
    if a.dtype.kind not in "fc":
        return None
    if not a.dtype.isnative:  # e.g. big-endian data from another machine: torch reads native byte order only
        a = a.astype(a.dtype.newbyteorder("="))
    if a.dtype not in (np.float16, np.float32, np.float64, np.complex64, np.complex128):
        a = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)  # e.g. longdouble
    with warnings.catch_warnings():
        # Read-only arrays (memory maps, Arrow buffers) are only read by the scan.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


_SMALL_SCAN_BYTES = 1 << 20
_one_thread: list = []


def scan_tensors(tensors: list[torch.Tensor]):
    """nanscan.scan for the data checks. A scan of under 1 MiB takes microseconds on one thread, less than waking
    the native backend's thread team (and far less on a busy machine, where a sleeping team member can delay the
    call by a scheduler tick), so small CPU scans run single-threaded unless a backend was chosen explicitly."""
    backend = None
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total < _SMALL_SCAN_BYTES and backends.requested_name(None) is None and all(
            t.device.type == "cpu" for t in tensors):
        if not _one_thread:
            try:
                _one_thread.append(backends.CpuBackend(num_threads=1))
            except Exception:  # noqa: BLE001 - no native extension: auto selection picks the fallback
                _one_thread.append(None)
        backend = _one_thread[0]
    return nanscan.scan(tensors, backend=backend)


def _real_parts(values: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The values as a flat real tensor (complex: real and imaginary parts), and the shape its indices unravel in."""
    if values.is_complex():
        return torch.view_as_real(values).reshape(-1), tuple(values.shape) + (2,)
    return values.reshape(-1), tuple(values.shape)


def _element_path(path: str, i: int, shape: tuple) -> str:
    return path + ("".join(f"[{j}]" for j in np.unravel_index(i, shape)) if shape else "")


def describe_nonfinite(values: torch.Tensor, path: str, limit: int = 5) -> tuple[int, str]:
    """(count, "NaN at x[3], +inf at x[7] ...") for the non-finite elements of one array."""
    flat, shape = _real_parts(values)
    bad = torch.nonzero(~torch.isfinite(flat)).reshape(-1)
    parts = []
    for i in bad[:limit].tolist():
        v = float(flat[i])
        label = "NaN" if math.isnan(v) else ("+inf" if v > 0 else "-inf")
        parts.append(f"{label} at {_element_path(path, i, shape)}")
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return len(bad), ", ".join(parts) + more


def nonfinite_mask(values: torch.Tensor) -> torch.Tensor:
    """Which elements are NaN or infinite. A complex element is one when either of its parts is."""
    if values.is_complex():
        return ~torch.view_as_real(values).isfinite().all(-1)
    return ~torch.isfinite(values)


def largest_finite_element(values: torch.Tensor) -> int:
    """The flat index of the element of largest finite magnitude (the first, on ties); the caller knows that the
    values hold a finite one."""
    magnitude = values.reshape(-1).abs()
    return int(torch.argmax(torch.where(torch.isfinite(magnitude), magnitude, torch.full_like(magnitude, -1.0))))


def overflow_mask(values: torch.Tensor) -> torch.Tensor:
    """Which elements are overflow values (NOTE: [overflow] in nanscan/engine/headroom.py): finite with |x| >= 2**64. A
    complex element is one when either of its parts is."""
    if values.is_complex():
        return overflow_mask(torch.view_as_real(values)).any(-1)
    magnitude = values.abs()
    return (magnitude >= OVERFLOW_MIN) & torch.isfinite(magnitude)


def describe_overflow(values: torch.Tensor, path: str, limit: int = 5) -> tuple[int, list[str], float]:
    """(count, ["3.403e+38 at x[3]", ...] for the first `limit`, the value of largest magnitude) for the overflow
    values of one array (see findings.overflow_detail)."""
    flat, shape = _real_parts(values)
    hits = torch.nonzero(overflow_mask(flat)).reshape(-1)
    if len(hits) == 0:
        return 0, [], 0.0
    found = flat[hits].to(torch.float64)
    largest = float(found[int(torch.argmax(found.abs()))])
    parts = [f"{float(found[k]):.4g} at {_element_path(path, i, shape)}"
             for k, i in enumerate(hits[:limit].tolist())]
    return len(hits), parts, largest
