"""The columnar fast path shared by JSON Lines and Parquet: check a whole Arrow table at once.

Vectorised passes over the columns find every row that might hold a finding (a null, an empty string or list,
a non-finite number or one too large to square in float32, too many tokens, a type Arrow cannot vouch for) and
send only those rows to the per-record definition (`records.inspect_record`). For all other rows the table's
own types, list lengths and token counts are tallied directly; they are by construction what `inspect_record`
would have tallied. A test compares the two paths on generated data.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from nanscan.data.checker import Checker
from nanscan.data.findings import ROOT_FIELD, RecordRef
from nanscan.data.numeric import as_scannable, largest_finite_element, overflow_mask, scan_tensors
from nanscan.engine.headroom import overflow_counts


def _scalar_kind(t: pa.DataType) -> str | None:
    """The kind (records.kind_of) of the Python values of an Arrow type, or None when the type is not handled."""
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "bytes"
    if pa.types.is_timestamp(t):
        return "datetime"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_time(t):
        return "time"
    if pa.types.is_duration(t):
        return "duration"
    return None


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _element_kind(t: pa.DataType) -> str | None:
    if pa.types.is_struct(t):
        return "object"
    if _is_list(t):
        return "list"
    return _scalar_kind(t)


def arrow_kind(t: pa.DataType) -> str | None:
    if pa.types.is_struct(t):
        return "object"
    if _is_list(t):
        element = _element_kind(t.value_type)
        return None if element is None else f"list[{element}]"
    return _scalar_kind(t)


def _decode(arr: pa.Array) -> pa.Array:
    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


def _float_leaves(arr: pa.Array, field: str, rows: Callable[[], np.ndarray] | None, out: list) -> None:
    """Collect (values, top-level field, element -> row mapping) for every floating array inside `arr`.

    `rows()` maps this array's positions to table rows (None: identity); it is built only when a leaf turns
    out to hold a non-finite value, an overflow value or the largest magnitude.
    """
    t = arr.type
    if pa.types.is_floating(t):
        out.append((arr, field, rows))
    elif pa.types.is_uint64(t):
        # The per-record definition checks integers past int64 as the floats they become (records.gather_numbers),
        # so this path does too. Only a leaf holding one is scanned: its smaller values, which the definition
        # skips, change neither its findings nor its largest magnitude, which lies past int64.
        top = pc.max(arr).as_py()
        if top is not None and top > np.iinfo(np.int64).max:
            out.append((pc.cast(arr, pa.float64(), safe=False), field, rows))
    elif pa.types.is_struct(t):
        for child in arr.flatten():
            _float_leaves(child, field, rows, out)
    elif _is_list(t):
        values = arr.flatten()
        if len(values) == 0 or not (pa.types.is_floating(values.type) or pa.types.is_uint64(values.type)
                                    or pa.types.is_struct(values.type) or _is_list(values.type)):
            return
        parents = arr

        def child_rows(parents=parents, rows=rows):
            local = pc.list_parent_indices(parents).to_numpy()
            return local if rows is None else rows()[local]

        _float_leaves(values, field, child_rows, out)


class TableCheck:
    """Checks one Arrow table whose rows are records `ref(i)`; `inspect_row(i)` runs the per-record definition.

    A null is an absent value, as in the per-record definition: whether Arrow filled the column for a key a JSON
    line lacks or the line says null, the row simply does not have that field.
    """

    def __init__(self, checker: Checker, table: pa.Table, ref: Callable[[int], RecordRef],
                 inspect_row: Callable[[int], None]):
        self.checker = checker
        self.table = table
        self.ref = ref
        self.inspect_row = inspect_row
        self.n = table.num_rows
        self.flagged = np.zeros(self.n, dtype=bool)

    def run(self) -> None:
        if self.n == 0:
            return
        try:
            analysis = self._analyse()
        except Exception:  # noqa: BLE001 - Arrow can hand back malformed arrays (e.g. list<null>): check row by row
            self._inspect(np.arange(self.n))
            return
        self._account(*analysis)

    def _analyse(self) -> tuple[list, np.ndarray | None, np.ndarray]:
        """Vectorised passes: flag the rows needing the full check; return (columns, token counts, rows with
        text)."""
        n, checker = self.n, self.checker
        columns = []  # (name, kind, lengths or None, valid rows or None)
        leaves: list = []
        token_parts: list[np.ndarray] = []
        id_parts: list[np.ndarray] = []  # token ids per row, of the token fields (records.inspect_record)
        text_fields, training = checker.text_fields, checker.fields
        any_value = np.zeros(n, dtype=bool)
        has_text = np.zeros(n, dtype=bool)  # rows with a text field present: only those have a token length
        has_ids = np.zeros(n, dtype=bool)  # rows with a token field present: their length is its ids
        for name, chunked in zip(self.table.column_names, self.table.columns):
            arr = _decode(chunked.combine_chunks())
            if pa.types.is_null(arr.type):
                continue  # null in every row: no row has this field
            kind = arrow_kind(arr.type)
            if kind is None:
                self.flagged[:] = True  # a type this path does not model: every row gets the full check
                continue
            valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else None
            present = np.ones(n, dtype=bool) if valid is None else valid
            any_value |= present
            lengths = None
            token_field = name in training.token_fields and kind != "string"  # a string is text, as per record
            if name in (training.labels_field, training.loss_mask_field):
                self._flag_unsupervised(name, arr, kind, present)
            if token_field and kind == "number":
                has_ids |= present
                id_parts.append(present.astype(np.int64))
            elif token_field and kind != "list[number]":
                self.flagged |= present  # ids in another form (nested lists, booleans): the per-record check counts
            if kind == "string":
                words = checker.whitespace.count_arrow(arr)
                self.flagged |= (words == 0) & present  # str.strip() == "" exactly when str.split() == []
                if text_fields is None or name in text_fields:
                    has_text |= present
                    if checker.tokenizer is checker.whitespace:
                        token_parts.append(words)
                    else:
                        token_parts.append(self._tokenize(arr))
            elif kind == "bytes":
                self.flagged |= (pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False) == 0) & present
            elif kind.startswith("list"):
                lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
                self.flagged |= (lengths == 0) & present
                values = arr.flatten()
                if values.null_count:  # [1, null] is a list of mixed kinds for the per-record check
                    parents = pc.list_parent_indices(arr).to_numpy()
                    self.flagged[parents[values.is_null().to_numpy(zero_copy_only=False)]] = True
                if token_field and kind == "list[number]":
                    has_ids |= present
                    id_parts.append(lengths)
                elif text_fields is not None and name in text_fields and kind == "list[number]":
                    has_text |= present
                    token_parts.append(lengths)
            elif kind == "object":
                children = arr.flatten()
                if not children:
                    self.flagged |= present
                else:
                    all_null = present.copy()
                    for child in children:
                        all_null &= child.is_null().to_numpy(zero_copy_only=False)
                    self.flagged |= all_null  # maybe {}: the per-record check decides
            columns.append((name, kind, lengths, valid))
            _float_leaves(arr, name, None, leaves)
        self.flagged |= ~any_value  # {} or only nulls: an empty record
        self._scan(leaves)
        tokens = None
        if token_parts or id_parts:
            tokens = np.sum(token_parts, axis=0) if token_parts else np.zeros(n, dtype=np.int64)
            if id_parts:  # a record with token ids counts them, in place of its text
                tokens = np.where(has_ids, np.sum(id_parts, axis=0), tokens)
                has_text |= has_ids
            if checker.max_tokens is not None:
                self.flagged |= tokens > checker.max_tokens
        return columns, tokens, has_text

    def _account(self, columns: list, tokens: np.ndarray | None, has_text: np.ndarray) -> None:
        """Tally the clean rows directly; send the flagged ones to the per-record check."""
        checker = self.checker
        clean = ~self.flagged
        clean_rows = np.flatnonzero(clean)
        if len(clean_rows):
            if tokens is not None:
                counted = clean_rows[has_text[clean_rows]]
                checker.note_tokens(tokens[counted], lambda i: self.ref(int(counted[i])))
            self._tally(ROOT_FIELD, "object", None, clean)  # every row is a record with fields
            for name, kind, lengths, valid in columns:
                mask = clean if valid is None else clean & valid
                self._tally(name, kind, lengths, mask)
            self._tally_keys(columns, clean_rows)
            checker.records += len(clean_rows)
        self._inspect(np.flatnonzero(self.flagged))

    def _tally_keys(self, columns: list, clean_rows: np.ndarray) -> None:
        """Key sets of the clean rows: every column a row has a value in (a null here is an absent key)."""
        tracker = self.checker.tracker
        always = [name for name, _, _, valid in columns if valid is None]
        optional = [(name, valid[clean_rows]) for name, _, _, valid in columns if valid is not None]
        if not optional:
            tracker.add_keys(always, len(clean_rows), lambda k: [self.ref(int(i)) for i in clean_rows[:k]])
            return
        patterns, inverse, counts = np.unique(np.stack([v for _, v in optional], axis=1), axis=0,
                                              return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        for p, (pattern, count) in enumerate(zip(patterns, counts.tolist())):
            keys = always + [name for (name, _), has in zip(optional, pattern) if has]
            rows = clean_rows[inverse == p]
            tracker.add_keys(keys, count, lambda k, rows=rows: [self.ref(int(i)) for i in rows[:k]])

    def _flag_unsupervised(self, name: str, arr: pa.Array, kind: str, present: np.ndarray) -> None:
        """Flag the rows whose labels are all the ignore index, or whose loss mask is all 0 (NOTE: [no supervised
        tokens]); the per-record check words the finding. Text and objects hold no labels: nothing to flag."""
        training = self.checker.fields
        ignored = training.ignore_index if name == training.labels_field else 0

        def supervised(values: pa.Array) -> np.ndarray:
            return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64) != ignored

        if kind in ("number", "bool"):
            self.flagged |= present & ~supervised(arr.fill_null(ignored))
        elif kind in ("list[number]", "list[bool]"):
            values = arr.flatten()
            parents = pc.list_parent_indices(arr).to_numpy()
            count = np.bincount(parents[supervised(values.fill_null(ignored))], minlength=self.n)
            lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
            self.flagged |= present & (lengths > 0) & (count == 0)
        elif kind == "list[list]":
            self.flagged |= present  # nested lists of numbers: the per-record check flattens them

    def _tokenize(self, arr: pa.Array) -> np.ndarray:
        try:
            return self.checker.tokenizer.count_arrow(arr)
        except Exception:  # noqa: BLE001 - a string the tokenizer refuses: let the per-record check report it
            self.flagged[:] = True
            return np.zeros(len(arr), dtype=np.int64)

    def _tally(self, name: str, kind: str, lengths: np.ndarray | None, mask: np.ndarray) -> None:
        """Kinds and shapes of one column over the rows in `mask`."""
        tracker = self.checker.tracker
        if lengths is None:
            rows = np.flatnonzero(mask)
            tracker.add_many(name, kind, None, len(rows), lambda k: [self.ref(int(i)) for i in rows[:k]])
            return
        values, counts = np.unique(lengths[mask], return_counts=True)
        for length, count in zip(values.tolist(), counts.tolist()):
            def refs(k, length=length):
                rows = np.flatnonzero(mask & (lengths == length))[:k]
                return [self.ref(int(i)) for i in rows]

            tracker.add_many(name, kind, (length,), count, refs)

    def _scan(self, leaves: list) -> None:
        """One core scan over every floating leaf; rows with a non-finite or an overflow value (NOTE: [overflow] in
        nanscan/engine/headroom.py) get the full check."""
        if not leaves:
            return
        tensors, kept = [], []
        for arr, field, rows in leaves:
            if len(arr) == 0:
                continue
            values = arr.fill_null(0) if arr.null_count else arr
            tensors.append(as_scannable(values.to_numpy(zero_copy_only=False)))
            kept.append((tensors[-1], field, rows))
        if not tensors:
            return
        report = scan_tensors(tensors)
        best = self.checker.largest_magnitude.value if self.checker.largest_magnitude else -1.0
        best_leaf = None
        huge_counts = overflow_counts(report.records)
        for stats, huge, (values, field, rows) in zip(report.stats, huge_counts, kept):
            if not stats.ok:
                bad = np.flatnonzero(~np.isfinite(values.numpy()))
                self.flagged[bad if rows is None else rows()[bad]] = True
            if huge:
                at = torch.nonzero(overflow_mask(values)).reshape(-1).numpy()
                self.flagged[at if rows is None else rows()[at]] = True
            if stats.finite and stats.absmax > best:  # without finite values, absmax 0 is no magnitude
                best, best_leaf = stats.absmax, (values, field, rows)
        if best_leaf is not None:
            values, field, rows = best_leaf
            element = largest_finite_element(values)
            row = element if rows is None else int(rows()[element])
            if not self.flagged[row]:  # a flagged row reports its own magnitude through the per-record check
                self.checker.note_magnitude(best, self.ref(row), field)

    def _inspect(self, rows: np.ndarray) -> None:
        for i in rows.tolist():
            self.inspect_row(i)
