"""Turning what the user passes (a list, a dict, a module, a model's gradients) into flat scan inputs without
copying: every backend then sees 1-D views of the tensors' own memory and a dtype code.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Mapping

import torch

from nanscan import _layout as L
from nanscan.stats import ScannedTensor

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


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

# How a tensor's elements sit in memory (NOTE: [flat views]).
CONTIGUOUS, PERMUTED, GAPPED = 0, 1, 2


class ScanInput:
    """One tensor ready for a backend: its elements in a supported format, and how to read them flat.

    NOTE: [flat views]
    Element order does not matter to the statistics, so a backend only needs one pointer and a count: a contiguous
    tensor and a dense tensor whose strides are merely permuted (transposes, channels_last) both cover one gap-free
    span of storage starting at data_ptr(). Only views with gaps or overlaps (slices with steps, expanded tensors)
    are compacted with a copy, made when a backend first asks for it. Building a ScanInput is cheap (no view, no
    detach), because the Monitor builds hundreds of them every step.
    """

    __slots__ = ("name", "dtype", "tensor", "scanned_code", "layout", "identity", "_compacted")

    def __init__(self, name: str, dtype: str, tensor: torch.Tensor, scanned_code: int, layout: int):
        self.name = name
        self.dtype = dtype  # the tensor's own dtype ("complex64" for a complex tensor scanned as float32 parts)
        self.tensor = tensor  # in a supported format (complex viewed as real parts, sparse as its values)
        self.scanned_code = scanned_code
        self.layout = layout
        self.identity = ScannedTensor(name, dtype, _device_name(tensor.device), tensor.numel(), scanned_code)
        self._compacted: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.identity.numel

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def copied(self) -> bool:
        """True for strided views with gaps, which must be compacted before a flat scan."""
        return self.layout == GAPPED

    @property
    def flat(self) -> torch.Tensor:
        """A 1-D tensor over exactly the elements (a view, except for GAPPED layouts)."""
        t = self.tensor.detach()
        if self.layout == CONTIGUOUS:
            return t.reshape(-1)
        if self.layout == PERMUTED:
            return t.as_strided((t.numel(),), (1,), t.storage_offset())
        if self._compacted is None:
            self._compacted = t.contiguous().reshape(-1)
        return self._compacted

    def data_ptr(self) -> int:
        """Address of the first of numel dense elements (NOTE: [flat views])."""
        return self.tensor.data_ptr() if self.layout != GAPPED else self.flat.data_ptr()

    def bits(self) -> torch.Tensor:
        """The same memory reinterpreted as unsigned integers of the element width (no copy)."""
        return self.flat.view({2: torch.uint16, 4: torch.uint32, 8: torch.uint64}[self.tensor.element_size()])

    def __repr__(self) -> str:
        return f"ScanInput({self.name!r}, {self.dtype}, numel={self.numel}, layout={self.layout})"


_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPE_NAMES = {dtype: _dtype_name(dtype) for dtype in (*_SCANNED_CODES, *_COMPLEX_PARTS)}


def _is_dense_permutation(t: torch.Tensor) -> bool:
    """True when the tensor's elements fill one gap-free span of storage in some dimension order."""
    expected = 1
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def prepare(name: str, t: Any) -> ScanInput | None:
    """A ScanInput for one tensor, or None for tensors that are skipped (integer and bool tensors)."""
    code = _SCANNED_CODES.get(getattr(t, "dtype", None))
    if code is not None and type(t) in _PLAIN_TENSOR_TYPES and t.layout == torch.strided and not t.is_meta:
        # The every-step case, kept short: a plain dense floating tensor.
        layout = CONTIGUOUS if t.is_contiguous() else PERMUTED if _is_dense_permutation(t) else GAPPED
        return ScanInput(name, _DTYPE_NAMES[t.dtype], t, code, layout)
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensorError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor; pass tensors only")
    if t.is_meta:
        raise UnsupportedTensorError(
            f"{name!r} is a meta tensor (shape {tuple(t.shape)}): it has no data to scan; "
            "materialize the module (e.g. module.to_empty(device=...) and load weights) before scanning")
    if t.layout == torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        t = t.values()
    own = _dtype_name(t.dtype)
    if t.dtype in _COMPLEX_PARTS:
        t = torch.view_as_real(t.detach())
    code = _SCANNED_CODES.get(t.dtype)
    if code is None:
        if not t.is_floating_point() and not t.is_complex():
            return None
        raise UnsupportedTensorError(
            f"{name!r} has dtype {own}, which nanscan cannot scan; supported: float16, bfloat16, float32, "
            "float64 and complex64/complex128 (cast the tensor, e.g. t.float(), to scan it)")
    layout = CONTIGUOUS if t.is_contiguous() else PERMUTED if _is_dense_permutation(t) else GAPPED
    return ScanInput(name, own, t, code, layout)


class InputCache:
    """How each tensor was prepared at earlier steps, so the every-step path re-prepares only new tensors.

    Parameters and optimizer state are the same tensor objects step after step (and gradients too when the loop
    zeroes them instead of setting them to None). Entries hold weak references only, so a tensor the loop drops
    (a gradient set to None) is freed exactly as without nanscan, and its entry goes with it.
    """

    __slots__ = ("_seen", "__weakref__")

    def __init__(self):
        self._seen: dict[int, tuple[weakref.ref, ScanInput]] = {}

    def get(self, t: torch.Tensor) -> ScanInput | None:
        hit = self._seen.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        template = hit[1]
        if template.numel != t.numel() or (template.layout == CONTIGUOUS and not t.is_contiguous()):
            return None  # resized or restrided in place
        item = ScanInput.__new__(ScanInput)
        item.name, item.dtype, item.scanned_code = template.name, template.dtype, template.scanned_code
        item.layout, item.identity, item.tensor, item._compacted = template.layout, template.identity, t, None
        return item

    def put(self, t: torch.Tensor, item: ScanInput) -> None:
        if item.tensor is not t:
            return  # a derived tensor (complex parts, sparse values, a shard): not stable across steps
        key = id(t)
        template = ScanInput.__new__(ScanInput)
        template.name, template.dtype, template.scanned_code = item.name, item.dtype, item.scanned_code
        template.layout, template.identity, template.tensor, template._compacted = item.layout, item.identity, None, None
        seen = self._seen
        self._seen[key] = (weakref.ref(t, lambda _ref, key=key: seen.pop(key, None)), template)


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
