"""Turning what the user passes (a list, a dict, a module, a model's gradients) into flat scan inputs without
copying: every backend then sees 1-D views of the tensors' own memory and a dtype code.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine.headroom import OVERFLOW_MIN
from nanscan.engine.stats import ScannedTensor

_SCANNED_CODES = {
    torch.float16: L.FLOAT16,
    torch.bfloat16: L.BFLOAT16,
    torch.float32: L.FLOAT32,
    torch.float64: L.FLOAT64,
}
# The float8 formats this torch has (all four since torch 2.2; looked up by name so an older torch still imports).
_SCANNED_CODES.update({getattr(torch, L.DTYPE_NAMES[code]): code for code in L.FLOAT8_CODES
                       if hasattr(torch, L.DTYPE_NAMES[code])})
_DTYPES_OF_CODES = {code: dtype for dtype, code in _SCANNED_CODES.items()}
# Complex tensors are scanned as their real and imaginary parts, in the component dtype.
_COMPLEX_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}


class UnsupportedTensorError(TypeError):
    """A tensor nanscan cannot read (meta tensor, unsupported dtype, not a tensor at all)."""


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_UNSCANNED_DTYPES = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))

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

    def host_scalar(self) -> float:
        """The value of a one-element input in host memory, read where the scan reads it: Tensor.item() goes
        through torch's dispatcher, which costs tens of microseconds in a training step (the loss, every step)."""
        if self.numel != 1 or not self.tensor.is_cpu:
            raise ValueError(f"{self.name!r}: host_scalar reads one-element CPU inputs; this one has "
                             f"{self.numel} elements on {self.tensor.device}")
        return read_host_scalar(self.data_ptr(), self.scanned_code)

    def bits(self) -> torch.Tensor:
        """The same memory reinterpreted as unsigned integers of the element width (no copy)."""
        return self.flat.view({1: torch.uint8, 2: torch.uint16, 4: torch.uint32,
                               8: torch.uint64}[self.tensor.element_size()])

    def __repr__(self) -> str:
        return f"ScanInput({self.name!r}, {self.dtype}, numel={self.numel}, layout={self.layout})"


def read_host_scalar(address: int, code: int) -> float:
    """The value of the element of format `code` (nanscan.engine._layout) at host memory `address`."""
    if code == L.FLOAT32:
        return ctypes.c_float.from_address(address).value
    if code == L.FLOAT64:
        return ctypes.c_double.from_address(address).value
    if code in L.FLOAT8_CODES:  # rare (a float8 loss): decoded by torch, which knows its own formats
        byte = torch.tensor([ctypes.c_uint8.from_address(address).value], dtype=torch.uint8)
        return float(byte.view(_DTYPES_OF_CODES[code]).float().item())
    bits = ctypes.c_uint16.from_address(address).value
    if code == L.FLOAT16:
        return struct.unpack("<e", struct.pack("<H", bits))[0]
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]  # bfloat16: the top half of a float32


_DEVICE_NAMES: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPE_NAMES = {dtype: _dtype_name(dtype) for dtype in (*_SCANNED_CODES, *_COMPLEX_PARTS)}


def is_dense_permutation(t: torch.Tensor) -> bool:
    """True when the tensor's elements fill one gap-free span of storage in some dimension order."""
    expected = 1
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def prepare(name: str, t: Any) -> ScanInput | None:
    """A ScanInput for one tensor, or None for tensors that are skipped (integer and bool tensors). A numpy array
    is read through torch.from_numpy (a view when it is contiguous)."""
    dtype = getattr(t, "dtype", None)
    code = _SCANNED_CODES.get(dtype)
    if type(t) in _PLAIN_TENSOR_TYPES and t.layout == torch.strided and not t.is_meta:
        # The every-step cases, kept short: a plain dense floating tensor, or an integer one (token ids).
        if code is not None and not t.is_neg():
            layout = CONTIGUOUS if t.is_contiguous() else PERMUTED if is_dense_permutation(t) else GAPPED
            return ScanInput(name, _DTYPE_NAMES[dtype], t, code, layout)
        if dtype in _UNSCANNED_DTYPES:
            return None
    if isinstance(t, np.ndarray):
        t = tensor_from_numpy(name, t)
    if not isinstance(t, torch.Tensor):
        raise UnsupportedTensorError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor; pass tensors only")
    if torch.nn.parameter.is_lazy(t):
        raise UnsupportedTensorError(
            f"{name!r} is an uninitialized parameter of a lazy module: it has no data to scan yet; run one forward "
            "pass (e.g. with a dummy batch) before scanning")
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
        # view_as_real refuses a lazily conjugated tensor (z.conj()); resolving copies it.
        t = torch.view_as_real(t.detach().resolve_conj())
    if t.is_neg():
        # A lazily negated view (z.conj().imag) holds -x as x in memory: read as is, +inf would count as -inf.
        t = t.resolve_neg()
    code = _SCANNED_CODES.get(t.dtype)
    if code is None:
        if not t.is_floating_point() and not t.is_complex():
            return None
        raise UnsupportedTensorError(
            f"{name!r} has dtype {own}, which nanscan cannot scan; supported: float16, bfloat16, float32, "
            "float64, the float8 formats (e4m3fn, e5m2 and their fnuz variants) and complex64/complex128 (cast "
            "the tensor, e.g. t.float(), to scan it)")
    layout = CONTIGUOUS if t.is_contiguous() else PERMUTED if is_dense_permutation(t) else GAPPED
    return ScanInput(name, own, t, code, layout)


def bind(template: ScanInput, t: torch.Tensor) -> ScanInput:
    """A ScanInput for tensor `t`, described by `template` (same name, format, element count and layout)."""
    item = ScanInput.__new__(ScanInput)
    item.name, item.dtype, item.scanned_code = template.name, template.dtype, template.scanned_code
    item.layout, item.identity, item.tensor, item._compacted = template.layout, template.identity, t, None
    return item


class ScanInputs(Sequence[ScanInput]):
    """The inputs of one scan, with the table the native backends read: a data pointer, an element count and a
    format code per input, as int64/int32 arrays (`table()`), plus each input's identity and the devices.

    NOTE: [input table]
    A training step scans hundreds of tensors, most of them the same tensors as at the step before. Building a
    ScanInput per tensor and then reading it back into a table costs microseconds per tensor, which on a small
    model is more than the kernel itself. So the every-step path (nanscan.engine.plans.ModelScanPlan) keeps the counts,
    codes and identities from the step where it first prepared the tensors, reads only the data pointers again,
    and hands the backends this object: the native ones read `table()` and never touch the ScanInput objects,
    which are made only if something iterates (the reference backend, multi-device grouping). `tensors` given,
    item i is `bind(templates[i], tensors[i])`; an item given in full has tensors[i] None. It holds the step's
    tensors (gradients included), so it is made per scan and not kept after it.
    """

    __slots__ = ("_templates", "_tensors", "_items", "_ptrs", "_numels", "_codes", "_identities", "_devices")

    def __init__(self, items: Sequence[ScanInput] = (), *, tensors: Sequence[torch.Tensor | None] | None = None,
                 ptrs: np.ndarray | None = None, numels: np.ndarray | None = None, codes: np.ndarray | None = None,
                 identities: Sequence[ScannedTensor] | None = None, devices: tuple[str, ...] | None = None):
        self._templates = items
        self._tensors = tensors
        self._items: list[ScanInput] | None = list(items) if tensors is None else None
        self._ptrs, self._numels, self._codes = ptrs, numels, codes
        self._identities = identities
        self._devices = devices

    def __len__(self) -> int:
        return len(self._templates)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ScanInputs(self.items()[index])
        return self.items()[index]

    def __iter__(self):
        return iter(self.items())

    def __repr__(self) -> str:
        return f"ScanInputs({len(self)} inputs)"

    def items(self) -> list[ScanInput]:
        if self._items is None:
            self._items = [template if t is None else bind(template, t)
                           for template, t in zip(self._templates, self._tensors)]
        return self._items

    @property
    def identities(self) -> tuple[ScannedTensor, ...]:
        """Each input's identity, as a tuple: reports and the Monitor's history share it without copying."""
        if self._identities is None:
            self._identities = tuple(item.identity for item in self._templates)
        elif type(self._identities) is not tuple:
            self._identities = tuple(self._identities)
        return self._identities

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of the inputs, each once, in order of first appearance."""
        if self._devices is None:
            self._devices = tuple(dict.fromkeys(identity.device for identity in self.identities))
        return self._devices

    def table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(data pointers int64, element counts int64, format codes int32), one entry per input."""
        if self._numels is None:
            self._numels = np.array([identity.numel for identity in self.identities], dtype=np.int64)
            self._codes = np.array([identity.scanned_code for identity in self.identities], dtype=np.int32)
        if self._ptrs is None:
            self._ptrs = np.array([item.data_ptr() for item in self.items()], dtype=np.uint64).view(np.int64)
        return self._ptrs, self._numels, self._codes

    def take(self, rows: np.ndarray) -> "ScanInputs":
        """The inputs at `rows` (int64 indices, in that order), with their table sliced rather than rebuilt: the
        inputs of one device when a check spans several (e.g. CUDA weights and AdamW's CPU step counters)."""
        ptrs, numels, codes = self.table()
        picked = rows.tolist()
        identities = self.identities
        table = {"ptrs": ptrs[rows], "numels": numels[rows], "codes": codes[rows],
                 "identities": tuple(identities[i] for i in picked)}
        if self._items is not None:  # bound items travel as they are: a compacted copy's pointer is in the table
            return ScanInputs([self._items[i] for i in picked], **table)
        return ScanInputs([self._templates[i] for i in picked], tensors=[self._tensors[i] for i in picked], **table)

    @classmethod
    def join(cls, parts: Sequence["ScanInputs"]) -> "ScanInputs":
        """The inputs of `parts`, in order, with their tables joined rather than rebuilt."""
        parts = [part for part in parts if len(part)]
        if len(parts) <= 1:
            return parts[0] if parts else cls()
        ptrs, numels, codes = (np.concatenate(column) for column in zip(*(part.table() for part in parts)))
        return cls([item for part in parts for item in part._templates],
                   tensors=[t for part in parts for t in
                            (part._tensors if part._tensors is not None else [None] * len(part))],
                   ptrs=ptrs, numels=numels, codes=codes,
                   identities=tuple(identity for part in parts for identity in part.identities),
                   devices=tuple(dict.fromkeys(device for part in parts for device in part.devices)))


def tensor_from_numpy(name: str, array: np.ndarray) -> torch.Tensor:
    """A tensor over a numpy array's memory (copied only when the array is not contiguous), for reading."""
    array = np.ascontiguousarray(array)
    try:
        if array.flags.writeable:
            return torch.from_numpy(array)
        with warnings.catch_warnings():  # a read-only array (np.load(mmap_mode="r")): nanscan only reads it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(array)
    except TypeError:
        raise UnsupportedTensorError(
            f"{name!r} is a numpy array of dtype {array.dtype}, which torch cannot read; convert it (e.g. "
            "array.astype(numpy.float64)) to scan it") from None


def as_scan_inputs(inputs: Sequence[ScanInput]) -> ScanInputs:
    return inputs if isinstance(inputs, ScanInputs) else ScanInputs(inputs)


# NOTE: [state dict names]
# A model's tensors are named as its state dict names them, which is what a bundle stores and replay loads: the
# wrappers that activation checkpointing (torch.distributed.algorithms._checkpoint.checkpoint_wrapper, which
# torchtitan applies per block) and FSDP (1) put around a module add `_checkpoint_wrapped_module.` and
# `_fsdp_wrapped_module.` to named_parameters() but remove them from state_dict(), so a scan named by
# named_parameters() would call a gradient by a name no state key, no replayed model and no reader knows. The
# infixes are removed where the names are made (at a rebuild of the plan, never per step). torch.compile's
# `_orig_mod.` of a compiled submodule stays: its state dict keeps it too.
WRAPPER_INFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def state_dict_name(name: str) -> str:
    """A parameter's named_parameters() name as the model's state dict names it (NOTE: [state dict names])."""
    if "_wrapped_module." in name:
        for infix in WRAPPER_INFIXES:
            name = name.replace(infix, "")
    return name


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """model.named_parameters() under their state dict names (NOTE: [state dict names])."""
    return [(state_dict_name(name), p) for name, p in model.named_parameters()]


def optimizer_param_names(model: torch.nn.Module, optimizer: Any) -> list[list[str]] | None:
    """Each of `optimizer`'s param groups' parameter names, in its order (NOTE: [state dict names]; a tied
    parameter under its first name, as model.named_parameters() gives it once); None when a parameter of the
    optimizer is not the model's (a framework's flat partitions) or there is no optimizer."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    names = {id(p): name for name, p in named_parameters(model)}
    found = [[names.get(id(p)) for p in group["params"]] for group in groups]
    return None if any(name is None for group in found for name in group) else found


def named_tensors(tensors: Any) -> Iterable[tuple[str, Any]]:
    """(name, tensor) pairs from a list/tuple, a mapping, a single tensor or numpy array, or a module (parameters and
    buffers)."""
    if isinstance(tensors, torch.nn.Module):
        yield from tensors.named_parameters()
        yield from tensors.named_buffers()
    elif isinstance(tensors, (torch.Tensor, np.ndarray)):
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


def iter_batch_tensors(batch: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nested dict/list/tuple/dataclass batch; paths join keys, indices and
    field names with '.'.

    numpy arrays are viewed as tensors (no copy). A bare tensor has the path "batch".
    """
    if isinstance(batch, torch.Tensor):
        yield prefix or "batch", batch
    elif isinstance(batch, np.ndarray) and batch.dtype.kind in "fciub":
        yield prefix or "batch", tensor_from_numpy(prefix or "batch", batch)
    elif type(batch) is dict or isinstance(batch, Mapping):  # the abstract-class check is slow: dicts skip it
        for key, value in batch.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, torch.Tensor):  # the usual leaf, yielded here: the Monitor walks a batch per step
                yield path or "batch", value
            else:
                yield from iter_batch_tensors(value, path)
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            path = f"{prefix}.{i}" if prefix else str(i)
            if isinstance(value, torch.Tensor):
                yield path, value
            else:
                yield from iter_batch_tensors(value, path)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from iter_batch_tensors(getattr(batch, f.name), f"{prefix}.{f.name}" if prefix else f.name)


def rows_where(batch: Any, size: int, takes: Callable[[torch.Tensor], bool],
               row_test: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
    """The rows (the leading index, `size` of them) for which `row_test` (of a tensor's rows flattened to
    (size, -1), one bool each) holds in some tensor of the batch that `takes` accepts and whose leading size is
    `size`."""
    found = torch.zeros(size, dtype=torch.bool)
    for _, t in iter_batch_tensors(batch):
        if t.dim() >= 1 and t.shape[0] == size and t.numel() and takes(t):
            found |= row_test(t.detach().reshape(size, -1)).cpu()
    return torch.nonzero(found).flatten().tolist()


def bad_rows(batch: Any, size: int) -> list[int]:
    """The rows (the leading index, `size` of them) of a batch's floating tensors that hold a NaN, an infinity or an
    overflow value (NOTE: [overflow] in nanscan/engine/headroom.py: a float32 maximum written for "missing" is one)."""
    return rows_where(batch, size, lambda t: t.is_floating_point(),
                      lambda rows: (~torch.isfinite(rows) | (rows.abs() >= OVERFLOW_MIN)).any(dim=1))



def plain_ids(sample_ids: Any) -> Any:
    """Sample ids as JSON holds them (a tensor's as a list): a rollback's record, the window's skipped steps."""
    return sample_ids.tolist() if isinstance(sample_ids, torch.Tensor) else sample_ids


def batch_size(batch: Any, sample_ids: Any = None) -> int | None:
    """The number of samples: the count of recorded sample ids when some tensor of the batch has that leading size
    (a batch may hold more rows of something else, such as a GAN's generated images), else the leading size most
    tensors of the batch share (None for a batch of scalars)."""
    sizes = [t.shape[0] for _, t in iter_batch_tensors(batch) if t.dim() > 0]
    if not sizes:
        return None
    if isinstance(sample_ids, (list, tuple)) and len(sample_ids) in sizes:
        return len(sample_ids)
    return max(set(sizes), key=sizes.count)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with fn applied to every tensor inside nested dicts, lists and tuples (other leaves kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return type(value)({k: map_tensors(v, fn) for k, v in value.items()}) if type(value) is not dict \
            else {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def take_rows(batch: Any, indices: Sequence[int], size: int | None = None) -> Any:
    """The batch restricted to sample rows `indices`: every tensor whose leading dimension is the batch size
    (`size`, else batch_size(batch)) indexed along dimension 0, other tensors and leaves kept whole."""
    size = batch_size(batch) if size is None else size

    def pick(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != size:
            return t
        return t.index_select(0, torch.tensor(list(indices), dtype=torch.long, device=t.device))

    return map_tensors(batch, pick)
