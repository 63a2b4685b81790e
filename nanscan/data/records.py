"""The definition of a record check, on plain Python values: which fields are empty, which hold non-finite
numbers or finite ones too large to square in float32, how many tokens the record has (its token ids, else its
text), whether its labels or loss mask leave any token supervised, and each field's kind and shape.

Every format reader either calls `inspect_record` on each record or (for JSON Lines and Parquet) runs a columnar
fast path that must reach the same findings; rows the fast path cannot vouch for are sent here. Numbers found in a
record are not tested one by one: they are gathered into the checker's `NumericBatch` (checker.py) and scanned in
bulk by the core scan (`nanscan.scan`).
"""

from __future__ import annotations

import datetime as _dt
import decimal
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from nanscan.data.checker import Checker, NumericBatch
from nanscan.engine.record_digest import is_pil_image
from nanscan.engine.targets import all_ignored
from nanscan.data.findings import (
    EMPTY, NO_SUPERVISED_TOKENS, ROOT_FIELD, TOO_LONG, UNREADABLE, RecordRef, TrainingFields,
)


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
    if is_pil_image(value):
        return f"image[{value.mode}]"
    return type(value).__name__


def shape_of(value: Any) -> tuple | None:
    if isinstance(value, (list, tuple)):
        return (len(value),)
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return tuple(int(s) for s in value.shape)
    if is_pil_image(value):
        return (value.height, value.width)
    return None


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


# -- numbers: gathered per record ---------------------------------------------------------------------------------
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
        elif is_pil_image(v) and v.mode == "F":
            batch.add_array(ref, p, np.asarray(v))


# -- token ids, labels and loss masks ----------------------------------------------------------------------------
def flat_numbers(value: Any) -> np.ndarray | None:
    """The numbers of a list (nested lists too), array, tensor or lone number, flattened; None when it holds
    anything else (text, None among the numbers, lists of unequal lengths)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().reshape(-1).to(torch.float64).numpy()
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, OverflowError):  # ragged, or numbers past every numpy type
            return None
        return arr.reshape(-1) if arr.dtype.kind in "biuf" else None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return np.asarray([value])
    return None


def unsupervised_detail(name: str, value: Any, fields: TrainingFields) -> str | None:
    """Why field `name` leaves no token supervised (NOTE: [no supervised tokens]), or None."""
    if name not in (fields.labels_field, fields.loss_mask_field):
        return None
    numbers = flat_numbers(value)
    if numbers is None or not numbers.size:
        return None
    if name == fields.labels_field and all_ignored(numbers, fields.ignore_index):
        what = (f"the label is the ignore index {fields.ignore_index}" if numbers.size == 1 else
                f"all {numbers.size} labels are the ignore index {fields.ignore_index}")
        return f"{what}: no token is supervised, so a mean loss over it is 0/0 (NaN)"
    if name == fields.loss_mask_field and not np.any(numbers):
        return (f"the loss mask is 0 at all {numbers.size} positions: no token is supervised, so a loss divided by "
                "the mask's sum is 0/0 (NaN)")
    return None


# -- one record ---------------------------------------------------------------------------------------------------
def inspect_record(checker: Checker, record: Any, ref: RecordRef) -> None:
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
    text_fields, training = checker.text_fields, checker.fields
    texts: list[str] = []
    pretokenized = 0
    ids: int | None = None  # the count of token ids, when the record has a token field
    for name, value in fields:
        reason = empty_reason(value)
        if reason is not None:
            checker.sink.add(EMPTY, ref, f"{reason} in field {name!r}", name)
            continue
        tracker.add(name, kind_of(value), shape_of(value), ref)
        gather_numbers(value, name, ref, checker.numbers)
        detail = unsupervised_detail(name, value, training)
        if detail is not None:
            checker.sink.add(NO_SUPERVISED_TOKENS, ref, detail, name)
        numbers = flat_numbers(value) if name in training.token_fields and not isinstance(value, str) else None
        if numbers is not None:
            ids = (ids or 0) + numbers.size  # already tokens: what the model sees, in place of the text
        elif text_fields is None:
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
    if ids is not None:
        tokens = ids
    elif texts or pretokenized:
        try:
            tokens = int(checker.tokenizer.count(texts).sum()) + pretokenized
        except Exception as exc:  # noqa: BLE001 - e.g. a lone surrogate the tokenizer cannot encode
            checker.sink.add(UNREADABLE, ref, f"text cannot be tokenized ({type(exc).__name__}: {exc})")
            return
    else:
        return
    checker.note_tokens(np.array([tokens]), lambda i: ref)
    if checker.max_tokens is not None and tokens > checker.max_tokens:
        checker.sink.add(TOO_LONG, ref, f"{tokens} tokens > --max-tokens {checker.max_tokens}")
