"""The definition of a record check, on plain Python values: which fields are empty, which hold non-finite
numbers or finite ones too large to square in float32, how many tokens the text has, and each field's kind and
shape.

Every format reader either calls `inspect_record` on each record or (for JSON Lines and Parquet) runs a columnar
fast path that must reach the same findings; rows the fast path cannot vouch for are sent here. Numbers found in a
record are not tested one by one: they are gathered into arrays and scanned in bulk by the core scan
(`nanscan.scan`) in `NumericBatch`.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import hashlib
import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nanscan.data.findings import (
    EMPTY, NONFINITE, OVERFLOW, OVERFLOW_MIN, ROOT_FIELD, TOO_LONG, UNREADABLE, RecordRef, overflow_counts,
    overflow_detail,
)

if TYPE_CHECKING:
    from nanscan.data.api import Checker


# -- kinds and shapes --------------------------------------------------------------------------------------------
def _scalar_kind(value: Any) -> str | None:
    if value is None:
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, float, decimal.Decimal, np.integer, np.floating)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(value, _dt.datetime):
        return "datetime"
    if isinstance(value, _dt.date):
        return "date"
    if isinstance(value, _dt.time):
        return "time"
    if isinstance(value, _dt.timedelta):
        return "duration"
    return None


def _element_kind(value: Any) -> str:
    """The kind of a list element, one level deep (a nested list is "list", a mapping "object")."""
    return "list" if isinstance(value, (list, tuple)) else kind_of(value)


def kind_of(value: Any) -> str:
    """The type name used to compare a field across records (numbers of any width are all "number")."""
    kind = _scalar_kind(value)
    if kind is not None:
        return kind
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        kinds = {_element_kind(v) for v in value}
        return f"list[{kinds.pop() if len(kinds) == 1 else 'mixed'}]" if kinds else "list"
    if isinstance(value, np.ndarray):
        return f"array[{value.dtype.name}]"
    if isinstance(value, torch.Tensor):
        return f"array[{str(value.dtype).removeprefix('torch.')}]"
    if _is_pil_image(value):
        return f"image[{value.mode}]"
    return type(value).__name__


def shape_of(value: Any) -> tuple | None:
    if isinstance(value, (list, tuple)):
        return (len(value),)
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return tuple(int(s) for s in value.shape)
    if _is_pil_image(value):
        return (value.height, value.width)
    return None


def _is_pil_image(value: Any) -> bool:
    cls = type(value)
    return cls.__module__.startswith("PIL.") and hasattr(value, "mode") and hasattr(value, "getbands")


def empty_reason(value: Any) -> str | None:
    """Why a value counts as empty, or None. (A null field is not empty but absent: see inspect_record.)"""
    if value is None:
        return "null"
    if isinstance(value, str):
        return ("empty text" if not value else "whitespace-only text") if not value.strip() else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "zero bytes" if len(value) == 0 else None
    if isinstance(value, Mapping):
        return "empty object" if len(value) == 0 else None
    if isinstance(value, (list, tuple)):
        return "zero-length sequence" if len(value) == 0 else None
    if isinstance(value, torch.Tensor):
        return f"zero-sized array of shape {list(value.shape)}" if value.numel() == 0 else None
    if isinstance(value, np.ndarray):
        return f"zero-sized array of shape {list(value.shape)}" if value.size == 0 else None
    return None


def record_fields(record: Any) -> list[tuple[str, Any]]:
    """A record's top-level fields: a mapping's items, a tuple's positions ("[0]", "[1]"), else the record itself."""
    if isinstance(record, Mapping):
        return [(str(k), v) for k, v in record.items()]
    if isinstance(record, tuple):
        return [(f"[{i}]", v) for i, v in enumerate(record)]
    return [(ROOT_FIELD, record)]


# -- canonical digest of Python values ---------------------------------------------------------------------------
def digest_object(value: Any) -> str:
    """sha256 of a canonical, type-tagged encoding of a Python value (mappings by sorted key, arrays as dtype,
    shape and C-order bytes), for records that have no byte form of their own (Parquet rows, Python datasets)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    def put(tag: bytes, payload: bytes) -> None:
        h.update(tag + len(payload).to_bytes(8, "little") + payload)

    if value is None:
        put(b"N", b"")
    elif isinstance(value, (bool, np.bool_)):
        put(b"B", b"1" if value else b"0")
    elif isinstance(value, (int, np.integer)):
        put(b"I", str(int(value)).encode())
    elif isinstance(value, (float, np.floating)):
        put(b"F", float(value).hex().encode())
    elif isinstance(value, str):
        put(b"S", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        put(b"Y", bytes(value))
    elif isinstance(value, Mapping):
        items = sorted(((str(k), v) for k, v in value.items()), key=lambda kv: kv[0])
        put(b"D", str(len(items)).encode())
        for k, v in items:
            put(b"K", k.encode("utf-8", "surrogatepass"))
            _feed(h, v)
    elif isinstance(value, (list, tuple)):
        put(b"L", str(len(value)).encode())
        for v in value:
            _feed(h, v)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.dim() and t.numel() else t.reshape(-1).view(torch.uint8)
        put(b"T", f"{t.dtype}{tuple(t.shape)}".encode())
        put(b"R", raw.numpy().tobytes())
    elif isinstance(value, np.ndarray):
        put(b"A", f"{value.dtype.str}{value.shape}".encode())
        put(b"R", np.ascontiguousarray(value).tobytes())
    elif _is_pil_image(value):
        put(b"P", f"{value.mode}{value.size}".encode())
        put(b"R", value.tobytes())
    else:
        put(b"O", f"{type(value).__qualname__}:{value!r}".encode("utf-8", "surrogatepass"))


# -- numbers: gathered per record, scanned in bulk ----------------------------------------------------------------
def _top_field(path: str) -> str:
    for i, ch in enumerate(path):
        if ch in ".[" and i:
            return path[:i]
    return path


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
    import nanscan
    from nanscan import backends

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
    """Which elements are overflow values (NOTE: [overflow] in findings.py): finite with |x| >= 2**64. A complex
    element is one when either of its parts is."""
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


class NumericBatch:
    """Numbers from many records, scanned with one nanscan.scan call per batch.

    Python floats found while walking records are pooled into one float64 array; arrays and tensors are scanned
    in place. Non-finite values become one `nonfinite` finding per (record, top-level field), overflow values
    (NOTE: [overflow] in findings.py) one `overflow` finding per (record, top-level field).
    """

    MAX_ITEMS = 4096
    MAX_BYTES = 64 << 20
    # Pending records: a reference may hold its record until the digest is taken, so few are kept waiting.
    MAX_RECORDS = 1024

    def __init__(self, checker: "Checker"):
        self.checker = checker
        self._arrays: list[tuple[RecordRef, str, torch.Tensor]] = []
        self._scalars: list[float] = []
        self._scalar_owners: list[tuple[RecordRef, str]] = []
        self._bytes = 0
        self._records = 0
        self._last_ref: RecordRef | None = None
        self._order: dict[int, int] = {}  # id(ref) -> the record's position in this batch

    def _owner(self, ref: RecordRef) -> None:
        """Flush when full, but only between records, so that one record's numbers are judged together."""
        if ref is not self._last_ref:
            if (self._records >= self.MAX_RECORDS or len(self._arrays) >= self.MAX_ITEMS
                    or self._bytes >= self.MAX_BYTES or len(self._scalars) >= self.MAX_ITEMS * 16):
                self.flush()
            self._last_ref = ref
            self._order.setdefault(id(ref), len(self._order))
            self._records += 1

    def add_array(self, ref: RecordRef, path: str, array: Any) -> None:
        t = as_scannable(array)
        if t is None or t.numel() == 0:
            return
        self._owner(ref)
        self._arrays.append((ref, path, t))
        self._bytes += t.numel() * t.element_size()

    def add_scalar(self, ref: RecordRef, path: str, value: float) -> None:
        self._owner(ref)
        self._scalars.append(value)
        self._scalar_owners.append((ref, path))

    def flush(self) -> None:
        if not self._arrays and not self._scalars:
            return
        arrays, scalars, owners = self._arrays, self._scalars, self._scalar_owners
        self._arrays, self._scalars, self._scalar_owners, self._bytes = [], [], [], 0
        order = self._order
        self._records, self._last_ref, self._order = 0, None, {}
        tensors = [t for _, _, t in arrays]
        if scalars:
            tensors.append(torch.tensor(scalars, dtype=torch.float64))
        report = scan_tensors(tensors)
        found: dict[tuple[str, int, str], _Found] = {}  # (category, id(ref), field) -> what that field holds

        def entry(category: str, ref: RecordRef, path: str) -> _Found:
            key = (category, id(ref), _top_field(path))
            if key not in found:
                found[key] = _Found(ref)
            return found[key]

        largest = (self.checker.largest_magnitude.value if self.checker.largest_magnitude else -1.0)
        # One reduction for the whole batch: a batch of many tiny arrays would pay more per array.
        huge_counts = overflow_counts(report.records)
        for i, stats in enumerate(report.stats):
            in_arrays = i < len(arrays)
            # A tensor without finite values has absmax 0: it has no largest finite magnitude to report.
            if stats.finite and stats.absmax > largest:
                if in_arrays:
                    ref, path, _ = arrays[i]
                else:
                    ref, path = owners[largest_finite_element(tensors[i])]
                largest = stats.absmax
                self.checker.note_magnitude(stats.absmax, ref, _top_field(path))
            huge = huge_counts[i] > 0
            if stats.ok and not huge:
                continue
            if in_arrays:
                ref, path, t = arrays[i]
                if not stats.ok:
                    count, text = describe_nonfinite(t, path)
                    entry(NONFINITE, ref, path).add(count, [text])
                if huge:
                    count, parts, extreme = describe_overflow(t, path)
                    entry(OVERFLOW, ref, path).add(count, parts, extreme)
                continue
            values = tensors[i]
            if not stats.ok:
                for j in torch.nonzero(~torch.isfinite(values)).reshape(-1).tolist():
                    ref, path = owners[j]
                    v = float(values[j])
                    label = "NaN" if math.isnan(v) else ("+inf" if v > 0 else "-inf")
                    entry(NONFINITE, ref, path).add(1, [f"{label} at {path}"])
            if huge:
                for j in torch.nonzero(overflow_mask(values)).reshape(-1).tolist():
                    ref, path = owners[j]
                    v = float(values[j])
                    entry(OVERFLOW, ref, path).add(1, [f"{v:.4g} at {path}"], v)
        # In the records' order, not arrays first: past --max-findings, the first records are the ones listed.
        for (category, _, field), f in sorted(found.items(), key=lambda item: order[id(item[1].ref)]):
            if category == OVERFLOW:
                detail = overflow_detail(f.count, f.parts, f.extreme)
            else:
                detail = f"{f.count} non-finite value{'s' if f.count != 1 else ''}: " + ", ".join(f.parts[:5])
                if len(f.parts) > 5:
                    detail += f" and {len(f.parts) - 5} more"
            self.checker.sink.add(category, f.ref, detail, field)


class _Found:
    """The values of one category in one (record, field): their count, descriptions, the largest in magnitude."""

    __slots__ = ("ref", "count", "parts", "extreme")

    def __init__(self, ref: RecordRef):
        self.ref, self.count, self.parts, self.extreme = ref, 0, [], 0.0

    def add(self, count: int, parts: list[str], extreme: float = 0.0) -> None:
        self.count += count
        self.parts.extend(parts)
        if abs(extreme) > abs(self.extreme):
            self.extreme = extreme


# Integers this far from zero fit no integer tensor: readers (Arrow's JSON reader, torch.tensor) turn them into
# floats, which can be past 2**64 or even infinite, so they are checked as the floats they become.
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _int_as_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:  # past the float64 maximum: it becomes an infinity, as in Arrow
        return math.inf if value > 0 else -math.inf


def gather_numbers(value: Any, path: str, ref: RecordRef, batch: NumericBatch) -> None:
    """Send every floating number inside `value` to the batch: scalars one by one, lists and arrays whole."""
    stack = [(path, value)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, float):
            batch.add_scalar(ref, p, v)
        elif type(v) is int and not _INT64_MIN <= v <= _INT64_MAX:
            batch.add_scalar(ref, p, _int_as_float(v))
        elif v is None or isinstance(v, (bool, int, str, bytes, bytearray, decimal.Decimal)):
            continue
        elif isinstance(v, Mapping):
            stack.extend((f"{p}.{k}", x) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            if v and isinstance(v[0], (int, float)) and not isinstance(v[0], bool):
                try:
                    arr = np.array(v)  # C-speed conversion; never dtype=float, which would turn None into NaN
                except (ValueError, TypeError, OverflowError):
                    arr = None
                if arr is not None and arr.dtype == np.uint64:
                    # numpy keeps ints past int64 as uint64 when they fit it; they fit no int64 tensor and are
                    # checked as the floats they become, as a lone int is (2**64 - 1 is 2**64).
                    arr = arr.astype(np.float64)
                if arr is not None and arr.dtype.kind in "iub":
                    continue
                if arr is not None and arr.dtype.kind == "f":
                    batch.add_array(ref, p, arr)
                    continue
            stack.extend((f"{p}[{i}]", x) for i, x in enumerate(v))
        elif isinstance(v, (np.ndarray, torch.Tensor)):
            if isinstance(v, np.ndarray) and v.dtype == object:
                stack.extend((f"{p}[{i}]", x) for i, x in enumerate(v.reshape(-1)))
            else:
                batch.add_array(ref, p, v)
        elif isinstance(v, np.floating):
            batch.add_scalar(ref, p, float(v))
        elif _is_pil_image(v) and v.mode == "F":
            batch.add_array(ref, p, np.asarray(v))


# -- one record ---------------------------------------------------------------------------------------------------
def inspect_record(checker: "Checker", record: Any, ref: RecordRef) -> None:
    """Check one record: empty fields, numbers (via the batch), token length, field kinds and shapes, keys."""
    checker.records += 1
    # A null field is absent, like a missing key (Arrow cannot tell them apart, and neither matters by itself): it
    # is reported only when most records have that field (`inconsistent`), or when no field is left.
    fields = [(name, value) for name, value in record_fields(record) if value is not None]
    reason = empty_reason(record) or (None if fields else "every field is null")
    if reason is not None:
        checker.sink.add(EMPTY, ref, f"empty record ({reason})")
        return
    tracker = checker.tracker
    if isinstance(record, (Mapping, tuple)):
        # The record's own kind, so that a JSON line that is a list or a number among objects is inconsistent
        # (a record that is neither is tallied under ROOT_FIELD below, as its only field).
        tracker.add(ROOT_FIELD, "object" if isinstance(record, Mapping) else "tuple", None, ref)
    text_fields = checker.text_fields
    texts: list[str] = []
    pretokenized = 0
    for name, value in fields:
        reason = empty_reason(value)
        if reason is not None:
            checker.sink.add(EMPTY, ref, f"{reason} in field {name!r}", name)
            continue
        tracker.add(name, kind_of(value), shape_of(value), ref)
        gather_numbers(value, name, ref, checker.numbers)
        if text_fields is None:
            if isinstance(value, str):
                texts.append(value)
        elif name in text_fields:
            if isinstance(value, str):
                texts.append(value)
            elif kind_of(value) == "list[number]" or (
                    isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 1):
                pretokenized += len(value)  # already token ids
    if isinstance(record, (Mapping, tuple)):
        tracker.add_keys([name for name, _ in fields], 1, lambda k: [ref])
    if texts or pretokenized:
        try:
            tokens = int(checker.tokenizer.count(texts).sum()) + pretokenized
        except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate the tokenizer cannot encode
            checker.sink.add(UNREADABLE, ref, f"text cannot be tokenized ({type(exc).__name__}: {exc})")
            return
        checker.note_tokens(np.array([tokens]), lambda i: ref)
        if checker.max_tokens is not None and tokens > checker.max_tokens:
            checker.sink.add(TOO_LONG, ref, f"{tokens} tokens > --max-tokens {checker.max_tokens}")
