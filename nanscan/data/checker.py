"""What one check accumulates across records and files: the Checker (findings, token lengths, field tallies,
boundary records, counts), the numbers it has yet to scan (NumericBatch), and how a reader names a whole file
(`file_ref`).

Every reader and the record check write into a Checker; `Checker.finish` turns it into the DataReport.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

try:
    import pyarrow  # noqa: F401 - the columnar readers and the token counter need it
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("nanscan's dataset checks need pyarrow (and Pillow for images, tokenizers for --tokenizer); "
                      "install them with: pip install 'nanscan[data]'") from exc

from nanscan._atomic import sha256_file
from nanscan.data.findings import (
    CATEGORIES, NONFINITE, OVERFLOW, SAMPLES_PER_SIGNATURE, Boundary, DataReport, FieldTracker, FindingSink,
    RecordRef, TokenLengths, TrainingFields, overflow_detail,
)
from nanscan.data.numeric import (
    as_scannable, describe_nonfinite, describe_overflow, largest_finite_element, overflow_mask, scan_tensors,
)
from nanscan.engine.headroom import overflow_counts
from nanscan.data.tokens import WhitespaceTokenizer, load_tokenizer

DEFAULT_MAX_FINDINGS = 1000
DEFAULT_MAX_RECORD_BYTES = 64 << 20
MAX_SKIPPED_LISTED = 100


class NullProgress:
    """The progress interface readers report to; the CLI supplies a rich progress bar."""

    enabled = False  # when True, the check first walks the paths to learn the total size

    def add_total(self, nbytes: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def describe(self, text: str) -> None:
        pass


class Checker:
    """Accumulates findings, token lengths, field tallies and boundary records over one check."""

    def __init__(self, *, max_tokens: int | None = None, tokenizer: Any = None,
                 text_fields: Iterable[str] | None = None, max_findings: int = DEFAULT_MAX_FINDINGS,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, progress: Any = None,
                 fields: TrainingFields | None = None):
        """fields: which fields hold token ids, labels and a loss mask (default: input_ids, labels with ignore
        index -100, loss_mask)."""
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if max_record_bytes <= 0:
            raise ValueError(f"max_record_bytes must be > 0, got {max_record_bytes}")
        self.max_tokens = max_tokens
        self.whitespace = WhitespaceTokenizer()
        loaded = load_tokenizer(tokenizer)
        self.tokenizer = self.whitespace if isinstance(loaded, WhitespaceTokenizer) else loaded
        self.text_fields = frozenset(text_fields) if text_fields else None
        self.fields = fields if fields is not None else TrainingFields()
        self.max_record_bytes = max_record_bytes
        self.sink = FindingSink(max_findings)
        self._samples = max(1, min(SAMPLES_PER_SIGNATURE, max_findings))
        # Fields are compared within one dataset: one path given to the check, one family of formats.
        self._trackers: dict[tuple[str, str], FieldTracker] = {}
        self.scope: tuple[str, str] = ("", "")
        self.tokens = TokenLengths()
        self.numbers = NumericBatch(self)
        self.progress = progress if progress is not None else NullProgress()
        self.records = 0
        self.files = 0
        self.bytes = 0
        self.longest: Boundary | None = None
        self.largest_magnitude: Boundary | None = None
        self.skipped: list[str] = []  # the first MAX_SKIPPED_LISTED files of unknown format met in folders
        self.skipped_count = 0
        self._report: DataReport | None = None

    @property
    def tracker(self) -> FieldTracker:
        tracker = self._trackers.get(self.scope)
        if tracker is None:
            tracker = self._trackers[self.scope] = FieldTracker(self._samples)
        return tracker

    def note_tokens(self, lengths: np.ndarray, ref_of: Callable[[int], RecordRef]) -> None:
        """Token counts of some records; `ref_of(i)` names the record of lengths[i] (asked only for the longest)."""
        if len(lengths) == 0:
            return
        self.tokens.add(lengths)
        i = int(np.argmax(lengths))
        if self.longest is None or lengths[i] > self.longest.value:
            self.longest = Boundary(int(lengths[i]), ref_of(i).id())

    def skip(self, path: Path) -> None:
        self.skipped_count += 1
        if len(self.skipped) < MAX_SKIPPED_LISTED:
            self.skipped.append(str(path))

    def note_magnitude(self, value: float, ref: RecordRef, field: str | None) -> None:
        if self.largest_magnitude is None or value > self.largest_magnitude.value:
            self.largest_magnitude = Boundary(float(value), ref.id(), field)

    def finish(self) -> DataReport:
        """Flush pending scans, decide the inconsistent records, and build the report (once)."""
        if self._report is None:
            self.numbers.flush()
            for tracker in self._trackers.values():
                tracker.report(self.sink)
            findings = sorted(self.sink.findings(), key=_finding_order)
            self._report = DataReport(
                findings=findings, counts={c: self.sink.counts.get(c, 0) for c in CATEGORIES},
                records=self.records, files=self.files, bytes=self.bytes, tokens=self.tokens.summary(),
                longest=self.longest, largest_magnitude=self.largest_magnitude, max_tokens=self.max_tokens,
                tokenizer=self.tokenizer.name, fields=self.fields, listed_per_category=self.sink.max_findings,
                skipped=list(self.skipped), skipped_count=self.skipped_count,
                unreadable_inputs=list(self.sink.unreadable_inputs),
                unreadable_input_count=self.sink.unreadable_input_count)
        return self._report


def _finding_order(f) -> tuple:
    r = f.record
    return (r.file, r.line if r.line is not None else -1, r.member or "",
            r.index if r.index is not None else -1, CATEGORIES.index(f.category), f.field or "")


def file_digest(path: Path) -> str | None:
    """sha256 of a whole file, or None when it cannot be read (any more)."""
    try:
        return sha256_file(path)
    except OSError:
        return None


def file_ref(path: Path, member: str | None = None) -> RecordRef:
    """A whole file (or an archive member) as a record: its digest is the file's, taken only when a finding
    names it."""
    return RecordRef(str(path), member=member, digest=lambda: file_digest(path), lazy=True)


# -- numbers: gathered per record, scanned in bulk ----------------------------------------------------------------
def _top_field(path: str) -> str:
    for i, ch in enumerate(path):
        if ch in ".[" and i:
            return path[:i]
    return path


class NumericBatch:
    """Numbers from many records, scanned with one nanscan.scan call per batch.

    Python floats found while walking records are pooled into one float64 array; arrays and tensors are scanned
    in place. Non-finite values become one `nonfinite` finding per (record, top-level field), overflow values
    (NOTE: [overflow] in nanscan/engine/headroom.py) one `overflow` finding per (record, top-level field).
    """

    MAX_ITEMS = 4096
    MAX_BYTES = 64 << 20
    # Pending records: a reference may hold its record until the digest is taken, so few are kept waiting.
    MAX_RECORDS = 1024

    def __init__(self, checker: Checker):
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
