"""Stored arrays: .npy files, the members of .npz archives and the tensors of safetensors files, scanned in slices
of at most SCAN_BYTES of their memory.

A record is a row along axis 0 of each array (the whole array when it is compared with the arrays of other files
or members); its identifier is the row index, the member's name, and the sha256 of the row's bytes in C order.
Arrays of a structured dtype are scanned field by field; object arrays are never loaded (that needs pickle).
"""

from __future__ import annotations

import hashlib
import math
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.data.checker import Checker, file_ref
from nanscan.data.findings import EMPTY, NONFINITE, OVERFLOW, UNREADABLE, RecordRef, overflow_detail, sha256_hex
from nanscan.data.numeric import (
    as_scannable, describe_nonfinite, describe_overflow, largest_finite_element, nonfinite_mask, overflow_mask,
    scan_tensors,
)
from nanscan.engine.headroom import OVERFLOW_EXPONENT, overflow_count, overflow_counts

SCAN_BYTES = 16 << 20  # array memory per core-scan call: enough for the thread team, little to re-read


class ArrayLeaf:
    """A floating part of every element of a stored array: the element itself (path ()), or a field of a
    structured dtype (path ("pos", "x")) holding `per_element` values (a sub-array field holds several)."""

    def __init__(self, path: tuple[str, ...] = (), per_element: int = 1):
        self.path, self.per_element = path, per_element
        # Per finding category, so that a row holding both a NaN and an overflow value gets both findings.
        self.seen_rows: dict[str, set[int]] = {}  # rows already reported (Fortran order visits a row many times)
        self.last_row: dict[str, int] = {}  # the last row reported (C order visits rows in order)

    def select(self, elements: "np.ndarray | torch.Tensor") -> "np.ndarray | torch.Tensor":
        for name in self.path:
            elements = elements[name]
        return elements


def floating_leaves(dtype: np.dtype, path: tuple[str, ...] = (), per_element: int = 1) -> list[ArrayLeaf]:
    """The floating parts of a dtype: [ArrayLeaf()] for a float or complex dtype, one per floating field (nested
    fields and sub-arrays included) for a structured dtype, none for other dtypes."""
    if dtype.subdtype is not None:
        base, sub_shape = dtype.subdtype
        return floating_leaves(base, path, per_element * math.prod(sub_shape))
    if dtype.names:
        return [leaf for name in dtype.names for leaf in floating_leaves(dtype.fields[name][0], (*path, name),
                                                                         per_element)]
    return [ArrayLeaf(path, per_element)] if dtype.kind in "fc" else []


def _leaf_values(elements: "np.ndarray | torch.Tensor", leaf: ArrayLeaf) -> torch.Tensor | None:
    """The leaf's values in a run of elements as one 1-D tensor the core scan reads (native byte order)."""
    if isinstance(elements, torch.Tensor):
        return as_scannable(elements.reshape(-1))
    return as_scannable(np.ascontiguousarray(leaf.select(elements)).reshape(-1))


class ArrayCheck:
    """One stored array: records are its rows along axis 0 (a 0-d array is one record).

    `chunks` yields (first element, elements) runs of the array's elements in storage order, each at most about
    SCAN_BYTES: a 1-D numpy array of the stored dtype, or a tensor. `row(i)` returns row i as stored (a numpy
    array of the stored dtype, or a tensor), or None when it cannot be re-read cheaply; the record's digest covers
    its bytes in C order. `leaves` are the floating parts that are scanned (see floating_leaves).
    """

    def __init__(self, checker: Checker, display: str, member: str | None, field: str, shape: tuple,
                 kind: str, fortran: bool, row: "Callable[[int], np.ndarray | torch.Tensor | None]",
                 leaves: "list[ArrayLeaf] | None" = None):
        self.checker, self.display, self.member, self.field = checker, display, member, field
        self.shape, self.kind, self.fortran, self.row = shape, kind, fortran, row
        self.leaves = [ArrayLeaf()] if leaves is None else leaves
        self.numel = math.prod(shape)
        self.row_elems = math.prod(shape[1:]) if shape else 1
        self.n_rows = shape[0] if shape else 1

    def label(self, leaf: ArrayLeaf) -> str:
        """How findings name the values of a leaf: the member or field, then the structured field's path."""
        return ".".join([self.member or self.field, *leaf.path])

    def ref(self, row: int | None) -> RecordRef:
        def digest():
            data = self.row(0 if row is None else row)
            return None if data is None else sha256_hex(_record_bytes(data))

        return RecordRef(self.display, member=self.member, index=row if self.shape else None, digest=digest)

    def start(self, whole: RecordRef) -> bool:
        """Count the records, report an empty array, and tally the array's dtype and shape under its field
        (`whole` names the entire array). False when there is nothing to scan."""
        checker = self.checker
        if self.numel == 0:
            checker.records += 1
            checker.sink.add(EMPTY, RecordRef(self.display, member=self.member, digest=sha256_hex(b"")),
                             f"zero-sized array of shape {list(self.shape)}", self.field)
            return False
        checker.records += self.n_rows
        checker.tracker.add(self.field, self.kind, self.shape, whole)
        return bool(self.leaves)

    def scan(self, chunks: "Iterator[tuple[int, np.ndarray | torch.Tensor]]",
             reread: "Callable[[int, int], np.ndarray | torch.Tensor] | None" = None) -> None:
        """Scan every chunk; report rows holding non-finite or overflow values and note the largest finite
        magnitude.

        With `reread(start, count)` (random access, e.g. a memory map) the largest value is located once at the
        end, in the one chunk that holds it; without, it is located whenever a chunk beats the previous best.
        """
        checker = self.checker
        best = (checker.largest_magnitude.value if checker.largest_magnitude else -1.0, None, 0, None)
        for start, elements in chunks:
            for leaf in self.leaves:
                values = _leaf_values(elements, leaf)
                if values is None:
                    continue
                stats = scan_tensors([values]).stats[0]
                huge = overflow_count(stats) > 0
                if not stats.ok or huge:
                    located = _locate_elements(values, nonfinite=not stats.ok, overflow=huge)
                    for category, where in located.items():
                        self._report_rows(leaf, self._rows_of(where // leaf.per_element + start), category)
                if stats.finite and stats.absmax > best[0]:  # without finite values, absmax 0 is no magnitude
                    best = (stats.absmax, start, len(elements), leaf)
                    if reread is None:
                        self._note_magnitude(stats.absmax, start, values, leaf)
        if reread is not None and best[1] is not None:
            absmax, start, count, leaf = best
            self._note_magnitude(absmax, start, _leaf_values(reread(start, count), leaf), leaf)

    def _note_magnitude(self, absmax: float, start: int, values: torch.Tensor, leaf: ArrayLeaf) -> None:
        element = _largest_element(values) // leaf.per_element + start
        row = int(self._rows_of(np.array([element]))[0])
        self.checker.note_magnitude(absmax, self.ref(row if self.shape else None), self.label(leaf))

    def _rows_of(self, elements: np.ndarray) -> np.ndarray:
        if not self.shape:
            return np.zeros(len(elements), dtype=np.int64)
        if self.fortran and len(self.shape) > 1:
            return np.unravel_index(elements, self.shape, order="F")[0]
        return elements // self.row_elems

    def _report_rows(self, leaf: ArrayLeaf, rows: np.ndarray, category: str) -> None:
        """One `category` (NONFINITE or OVERFLOW) finding for each row not yet reported in that category."""
        sink = self.checker.sink
        seen = leaf.seen_rows.setdefault(category, set())
        for row in np.unique(rows).tolist():
            if self.fortran:
                if row in seen:
                    continue
                seen.add(row)
            else:
                if row <= leaf.last_row.get(category, -1):
                    continue
                leaf.last_row[category] = row
            if len(sink.listed.get(category, ())) >= sink.max_findings:
                sink.add_uncounted_listing(category, 1)
                continue
            label = self.label(leaf)
            data = self.row(row if self.shape else 0)
            path = f"{label}[{row}]" if self.shape else label
            if data is None:
                what = ("non-finite value(s)" if category == NONFINITE
                        else f"value(s) with |x| >= 2**{OVERFLOW_EXPONENT} (the square of each overflows float32)")
                detail = (f"{what} in this row (not read again for details: the archive member is read once, "
                          "front to back, and this row is not in the part at hand)")
            else:
                values = _leaf_values(data, leaf).reshape(np.shape(leaf.select(data)))
                if category == NONFINITE:
                    count, text = describe_nonfinite(values, path)
                    detail = f"{count} non-finite value{'s' if count != 1 else ''}: {text}"
                else:
                    detail = overflow_detail(*describe_overflow(values, path))
            sink.add(category, self.ref(row if self.shape else None), detail, label)


# NOTE: [locating values] A chunk the scan flags is not searched with elementwise torch ops over its whole length
# (each allocates and writes a full-size mask). It is cut into pieces of LOCATE_ELEMS that one multi-tensor scan
# covers; only the pieces whose record shows a non-finite value, an overflow value (NOTE: [overflow] in
# nanscan/engine/headroom.py), or the largest absolute value, are searched.
LOCATE_ELEMS = 1 << 14


def _pieces(values: torch.Tensor) -> tuple[list[torch.Tensor], np.ndarray]:
    pieces = list(values.split(LOCATE_ELEMS))
    return pieces, scan_tensors(pieces).records


def _locate_elements(values: torch.Tensor, *, nonfinite: bool, overflow: bool) -> dict[str, np.ndarray]:
    """Indices of the non-finite elements, and of the overflow elements, of a 1-D chunk, for the categories asked
    for (NOTE: [locating values]): {NONFINITE: ..., OVERFLOW: ...}."""
    pieces, records = _pieces(values)
    flagged = {}  # category -> (which pieces hold such values, which elements of a piece are such values)
    if nonfinite:
        flagged[NONFINITE] = (records[:, L.REC_NAN: L.REC_NEGINF + 1].any(axis=1), nonfinite_mask)
    if overflow:
        flagged[OVERFLOW] = (overflow_counts(records) > 0, overflow_mask)
    located = {}
    for category, (in_piece, mask) in flagged.items():
        found = [torch.nonzero(mask(pieces[i])).reshape(-1).numpy() + i * LOCATE_ELEMS
                 for i in np.flatnonzero(in_piece).tolist()]
        located[category] = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    return located


def _largest_element(values: torch.Tensor) -> int:
    """Index of the element with the largest finite magnitude in a 1-D chunk (NOTE: [locating values]).

    Stored magnitudes are bit patterns of non-negative numbers of one format, which order like the numbers."""
    pieces, records = _pieces(values)
    nonfinite = records[:, L.REC_NAN: L.REC_NEGINF + 1].sum(axis=1)
    has_finite = nonfinite < np.array([p.numel() * (2 if p.is_complex() else 1) for p in pieces])  # parts scanned
    i = int(np.argmax(np.where(has_finite, records[:, L.REC_ABSMAX_BITS], -1)))
    return largest_finite_element(pieces[i]) + i * LOCATE_ELEMS


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _record_bytes(data: "np.ndarray | torch.Tensor") -> bytes:
    """A stored row's bytes in C order (a numpy row keeps its stored dtype, byte order included)."""
    return _tensor_bytes(data) if isinstance(data, torch.Tensor) else np.asarray(data).tobytes()


def _array_kind(dtype_name: str) -> str:
    return f"array[{dtype_name}]"


def _numpy_kind(dtype: np.dtype) -> str:
    # A structured dtype's name ("void64") says only its size; its fields tell two layouts apart.
    return _array_kind(str(dtype) if dtype.names else dtype.name)


def _npy_header(f) -> tuple[tuple, bool, np.dtype]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    return np.lib.format.read_array_header_2_0(f)


def _chunk_elems(itemsize: int, row_elems: int) -> int:
    """Elements per scan call: whole rows when a row fits in SCAN_BYTES, so a bad row lies in one chunk."""
    per_chunk = max(1, SCAN_BYTES // max(itemsize, 1))
    if 0 < row_elems <= per_chunk:
        per_chunk -= per_chunk % row_elems
    return per_chunk


def check_npy(checker: Checker, path: Path) -> None:
    display = str(path)
    try:
        with open(path, "rb") as f:
            shape, fortran, dtype = _npy_header(f)
            offset = f.tell()
    except Exception as exc:  # noqa: BLE001 - ValueError for a bad magic or header, OSError
        checker.records += 1
        checker.sink.add(UNREADABLE, file_ref(path), f"not a valid .npy file ({exc})")
        return
    if dtype.hasobject:
        checker.records += 1
        checker.sink.add(UNREADABLE, file_ref(path), "an object array: loading it needs pickle, which nanscan "
                         "never uses on data files; save the array with a numeric dtype")
        return
    expected = offset + math.prod(shape) * dtype.itemsize
    actual = path.stat().st_size
    if actual < expected:
        checker.records += 1
        checker.sink.add(UNREADABLE, file_ref(path), f"truncated: the header promises {expected} bytes, the file "
                         f"has {actual}")
        return
    check = ArrayCheck(checker, display, None, "array", tuple(shape), _numpy_kind(dtype), fortran,
                       row=lambda i: None, leaves=floating_leaves(dtype))
    if not check.start(file_ref(path)):
        return
    # A read-only memory map: pages come from the page cache and are dropped under memory pressure, so memory
    # stays bounded whatever the file size.
    flat = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(math.prod(shape),))
    array = flat.reshape(shape, order="F" if fortran else "C")
    # Sliced rather than indexed: an indexed element is a scalar in native byte order, no longer the stored bytes.
    check.row = lambda i: np.array(array[i:i + 1].reshape(shape[1:]) if shape else array)
    step = _chunk_elems(dtype.itemsize, check.row_elems)

    def chunks():
        for start in range(0, len(flat), step):
            yield start, flat[start:start + step]

    check.scan(chunks(), reread=lambda start, count: flat[start:start + count])


def check_npz(checker: Checker, path: Path) -> None:
    display = str(path)
    try:
        archive = zipfile.ZipFile(path)
    except Exception as exc:  # noqa: BLE001 - BadZipFile, OSError
        checker.records += 1
        checker.sink.add(UNREADABLE, file_ref(path), f"not a valid .npz (zip) file ({exc})")
        return
    with archive:
        members = [i for i in archive.infolist() if i.filename.endswith(".npy")]
        if not members:
            checker.sink.add(EMPTY, file_ref(path), "the .npz archive holds no arrays")
        for info in members:
            name = info.filename[: -len(".npy")]
            try:
                _check_npz_member(checker, archive, info, display, name)
            except Exception as exc:  # noqa: BLE001 - bad CRC, truncated or corrupt member data
                checker.sink.add(UNREADABLE, file_ref(path, member=name), f"array {name!r} unreadable ({exc})")


def _npz_field(name: str) -> str:
    # np.savez(file, *arrays) names them arr_0, arr_1, ...: a list of samples, compared as one field.
    return "arr_*" if name.startswith("arr_") and name[4:].isdigit() else name


def _check_npz_member(checker: Checker, archive: zipfile.ZipFile, info: zipfile.ZipInfo, display: str,
                      name: str) -> None:
    with archive.open(info) as f:
        shape, fortran, dtype = _npy_header(f)
        if dtype.hasobject:
            checker.records += 1
            checker.sink.add(UNREADABLE, RecordRef(display, member=name), "an object array: loading it needs "
                             "pickle, which nanscan never uses on data files; save the array with a numeric dtype",
                             name)
            return
        check = ArrayCheck(checker, display, name, _npz_field(name), tuple(shape), _numpy_kind(dtype),
                           fortran, row=lambda i: None, leaves=floating_leaves(dtype))
        whole = RecordRef(display, member=name, lazy=True,
                          digest=lambda: _zip_member_digest(archive.filename, info.filename))
        if not check.start(whole):
            return
        numel = math.prod(shape)
        step = _chunk_elems(dtype.itemsize, check.row_elems)
        current: dict = {}

        def chunks():
            for start in range(0, numel, step):
                count = min(step, numel - start)
                data = f.read(count * dtype.itemsize)
                if len(data) < count * dtype.itemsize:
                    raise EOFError(f"the data ends after {start + len(data) // dtype.itemsize} of {numel} elements")
                chunk = np.frombuffer(data, dtype=dtype)
                current["start"], current["chunk"] = start, chunk
                yield start, chunk

        def row(i: int) -> np.ndarray | None:
            # A compressed member is read once, front to back: a row can be re-read only from the chunk in hand
            # (and a row of a Fortran-order array is spread over the whole member).
            if "chunk" not in current or fortran:
                return None
            begin = i * check.row_elems - current["start"]
            chunk = current["chunk"]
            if begin < 0 or begin + check.row_elems > len(chunk):
                return None
            return chunk[begin: begin + check.row_elems].reshape(shape[1:])

        check.row = row
        check.scan(chunks())


def _zip_member_digest(archive_path: str, member: str) -> str | None:
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(archive_path) as archive, archive.open(member) as f:
            while block := f.read(1 << 20):
                h.update(block)
    except Exception:  # noqa: BLE001 - the member was readable a moment ago; no digest rather than a crash
        return None
    return h.hexdigest()


def _safetensor_digest(path: str, name: str) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            return sha256_hex(_tensor_bytes(handle.get_tensor(name)))
    except Exception:  # noqa: BLE001
        return None


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
                       "C64": "complex64", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}


def check_safetensors(checker: Checker, path: Path) -> None:
    from safetensors import safe_open

    display = str(path)
    try:
        handle = safe_open(str(path), framework="pt")
        names = list(handle.keys())
    except Exception as exc:  # noqa: BLE001 - SafetensorError for bad headers, truncated data
        checker.records += 1
        checker.sink.add(UNREADABLE, file_ref(path), f"not a valid safetensors file ({exc})")
        return
    if not names:
        checker.sink.add(EMPTY, file_ref(path), "the safetensors file holds no tensors")
    for name in names:
        try:
            _check_safetensor(checker, handle, name, display)
        except Exception as exc:  # noqa: BLE001
            checker.sink.add(UNREADABLE, file_ref(path, member=name), f"tensor {name!r} unreadable ({exc})")


def _check_safetensor(checker: Checker, handle, name: str, display: str) -> None:
    sl = handle.get_slice(name)
    shape = tuple(sl.get_shape())
    raw_dtype = sl.get_dtype()
    dtype_name = _SAFETENSORS_DTYPES.get(raw_dtype, raw_dtype.lower())

    def row(i: int) -> torch.Tensor:
        return sl[i: i + 1][0] if shape else handle.get_tensor(name)

    floating = dtype_name.startswith(("float", "bfloat", "complex"))
    check = ArrayCheck(checker, display, name, name, shape, _array_kind(dtype_name), False, row,
                       leaves=[ArrayLeaf()] if floating else [])
    whole = RecordRef(display, member=name, lazy=True,
                      digest=lambda: _safetensor_digest(display, name))
    if not check.start(whole):
        return
    itemsize = getattr(torch, dtype_name).itemsize if hasattr(torch, dtype_name) else 4
    step_rows = max(1, _chunk_elems(itemsize, check.row_elems) // max(check.row_elems, 1))

    def chunks():
        if not shape:
            yield 0, handle.get_tensor(name).reshape(-1)
            return
        for first in range(0, shape[0], step_rows):
            yield first * check.row_elems, sl[first: first + step_rows].reshape(-1)

    check.scan(chunks())
