"""Turning what the user passes (a list, a dict, a module, a model's gradients) into flat scan inputs without
copying: every backend then sees 1-D views of the tensors' own memory and a dtype code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from nanscan import _layout as L

_SCANNED_CODES = {
    torch.float16: L.FLOAT16,
    torch.bfloat16: L.BFLOAT16,
    torch.float32: L.FLOAT32,
    torch.float64: L.FLOAT64,
}
# Complex tensors are scanned as their real and imaginary parts, in the component dtype.
_COMPLEX_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}


class UnsupportedTensorError(TypeError):
    """A tensor nanscan cannot read (meta tensor, unsupported dtype, not a tensor at all)."""


@dataclass(frozen=True)
class ScanInput:
    """One tensor ready for a backend: `flat` is a 1-D view of its elements in a supported format."""

    name: str
    dtype: str  # the tensor's own dtype ("complex64" for a complex tensor scanned as float32 parts)
    flat: torch.Tensor
    scanned_code: int
    copied: bool  # True only for strided views with gaps, which must be compacted before a flat scan

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def bits(self) -> torch.Tensor:
        """The same memory reinterpreted as unsigned integers of the element width (no copy)."""
        return self.flat.view({2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[self.flat.element_size()])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_dense_permutation(t: torch.Tensor) -> bool:
    """True when the tensor's elements fill one gap-free span of storage in some dimension order."""
    expected = 1
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _flatten(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D view over exactly the tensor's elements; element order is irrelevant to the statistics.

    A dense tensor whose strides are merely permuted (transposes, channels_last) covers one contiguous span of
    its storage, so a flat view of that span holds the same elements. Only views with gaps or overlaps
    (slices with steps, expanded tensors) are compacted with a copy.
    """
    if t.is_contiguous():
        return t.reshape(-1), False
    if _is_dense_permutation(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset()), False
    return t.contiguous().reshape(-1), True


def prepare(name: str, t: Any) -> ScanInput | None:
    """A ScanInput for one tensor, or None for tensors that are skipped (integer and bool tensors)."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensorError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor; pass tensors only")
    if t.is_meta:
        raise UnsupportedTensorError(
            f"{name!r} is a meta tensor (shape {tuple(t.shape)}): it has no data to scan; "
            "materialize the module (e.g. module.to_empty(device=...) and load weights) before scanning")
    if t.layout == torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout != torch.strided:
        t = t.values() if hasattr(t, "values") and t.layout in (torch.sparse_csr, torch.sparse_csc) else t
    own = _dtype_name(t.dtype)
    if t.dtype in _COMPLEX_PARTS:
        t = torch.view_as_real(t)
    code = _SCANNED_CODES.get(t.dtype)
    if code is None:
        if not t.is_floating_point() and not t.is_complex():
            return None
        raise UnsupportedTensorError(
            f"{name!r} has dtype {own}, which nanscan cannot scan; supported: float16, bfloat16, float32, "
            "float64 and complex64/complex128 (cast the tensor, e.g. t.float(), to scan it)")
    flat, copied = _flatten(t.detach())
    return ScanInput(name=name, dtype=own, flat=flat, scanned_code=code, copied=copied)


def named_tensors(tensors: Any) -> Iterable[tuple[str, Any]]:
    """(name, tensor) pairs from a list/tuple, a mapping, a single tensor, or a module (parameters and buffers)."""
    if isinstance(tensors, torch.nn.Module):
        yield from tensors.named_parameters()
        yield from tensors.named_buffers()
    elif isinstance(tensors, torch.Tensor):
        yield "tensor", tensors
    elif isinstance(tensors, Mapping):
        for key, value in tensors.items():
            yield str(key), value
    elif isinstance(tensors, Iterable):
        for i, value in enumerate(tensors):
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
                yield value  # already (name, tensor) pairs, e.g. module.named_parameters()
            else:
                yield f"tensor[{i}]", value
    else:
        raise UnsupportedTensorError(
            f"cannot scan a {type(tensors).__name__}; pass a tensor, a list or dict of tensors, or a module")


def prepare_all(tensors: Any) -> tuple[list[ScanInput], list[str]]:
    """Scan inputs and the names of skipped (non-floating) tensors."""
    inputs, skipped = [], []
    for name, t in named_tensors(tensors):
        item = prepare(name, t)
        if item is None:
            skipped.append(name)
        else:
            inputs.append(item)
    return inputs, skipped
