"""The two entry points of the dataset checks: `check(dataset)` over Python records (a torch map-style or
iterable Dataset, a list of dicts, any iterable) and `check_paths(paths)` over files and folders; both return a
DataReport. The Checker holds what a check accumulates across records and files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import numpy as np

try:
    import pyarrow  # noqa: F401 - the columnar readers and the token counter need it
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("nanscan's dataset checks need pyarrow (and Pillow for images, tokenizers for --tokenizer); "
                      "install them with: pip install 'nanscan[data]'") from exc

from nanscan.data.findings import (
    CATEGORIES, SAMPLES_PER_SIGNATURE, UNREADABLE, Boundary, DataReport, FieldTracker, FindingSink, RecordRef,
    TokenLengths,
)
from nanscan.data.records import NumericBatch, digest_object, inspect_record
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
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, progress: Any = None):
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if max_record_bytes <= 0:
            raise ValueError(f"max_record_bytes must be > 0, got {max_record_bytes}")
        self.max_tokens = max_tokens
        self.whitespace = WhitespaceTokenizer()
        loaded = load_tokenizer(tokenizer)
        self.tokenizer = self.whitespace if isinstance(loaded, WhitespaceTokenizer) else loaded
        self.text_fields = frozenset(text_fields) if text_fields else None
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
                tokenizer=self.tokenizer.name, listed_per_category=self.sink.max_findings,
                skipped=list(self.skipped), skipped_count=self.skipped_count,
                unreadable_inputs=list(self.sink.unreadable_inputs),
                unreadable_input_count=self.sink.unreadable_input_count)
        return self._report


def _finding_order(f) -> tuple:
    r = f.record
    return (r.file, r.line if r.line is not None else -1, r.member or "",
            r.index if r.index is not None else -1, CATEGORIES.index(f.category), f.field or "")


def file_digest(path: Path) -> str | None:
    from nanscan._atomic import sha256_file

    try:
        return sha256_file(path)
    except OSError:
        return None


def _is_map_style(dataset: Any) -> bool:
    try:
        from torch.utils.data import IterableDataset

        if isinstance(dataset, IterableDataset):
            return False
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        return False
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def check(dataset: Any, *, max_tokens: int | None = None, tokenizer: Any = None,
          text_fields: Iterable[str] | None = None, max_findings: int = DEFAULT_MAX_FINDINGS,
          name: str = "dataset", limit: int | None = None) -> DataReport:
    """Check every record of a dataset for non-finite numbers, finite numbers too large to square in float32
    (|x| >= 2**64: `overflow`), empty fields, over-long text and inconsistent field types or shapes.

    `dataset`: a map-style dataset (len() and [i], e.g. a torch Dataset or a list of dicts), any iterable of
    records, or a path (str or Path) or a list of Path objects (then the same as `check_paths`). A record may
    be a dict, a tuple, a tensor, an array, a string or a number; arrays and tensors are scanned by the core scan.
    `max_tokens`: report records with more tokens (whitespace tokens, or `tokenizer`: a tokenizer.json path).
    `text_fields`: the fields whose text is counted (default: every top-level string field).
    `limit`: check only the first `limit` records.
    A record that raises when loaded is reported `unreadable` and the check goes on (for an iterable, the
    iteration cannot go on and the check stops there).
    """
    if isinstance(dataset, (str, os.PathLike)) or (
            isinstance(dataset, (list, tuple)) and dataset and all(isinstance(p, os.PathLike) for p in dataset)):
        paths = [dataset] if isinstance(dataset, (str, os.PathLike)) else list(dataset)
        return check_paths(paths, max_tokens=max_tokens, tokenizer=tokenizer, text_fields=text_fields,
                           max_findings=max_findings)
    checker = Checker(max_tokens=max_tokens, tokenizer=tokenizer, text_fields=text_fields,
                      max_findings=max_findings)
    if _is_map_style(dataset):
        n = len(dataset) if limit is None else min(limit, len(dataset))
        for i in range(n):
            try:
                record = dataset[i]
            except Exception as exc:  # noqa: BLE001 - a record that fails to load is a finding, not a crash
                checker.records += 1
                checker.sink.add(UNREADABLE, RecordRef(name, index=i), f"loading the record raised "
                                                                        f"{type(exc).__name__}: {exc}")
                continue
            inspect_record(checker, record, RecordRef(name, index=i, digest=lambda r=record: digest_object(r)))
    else:
        iterator = iter(dataset)
        i = 0
        while limit is None or i < limit:
            try:
                record = next(iterator)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001
                checker.records += 1
                checker.sink.add(UNREADABLE, RecordRef(name, index=i),
                                 f"the iterator raised {type(exc).__name__}: {exc}; records after this one were "
                                 "not checked")
                break
            inspect_record(checker, record, RecordRef(name, index=i, digest=lambda r=record: digest_object(r)))
            i += 1
    return checker.finish()


def check_paths(paths: Iterable[str | os.PathLike], *, max_tokens: int | None = None, tokenizer: Any = None,
                text_fields: Iterable[str] | None = None, max_findings: int = DEFAULT_MAX_FINDINGS,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, progress: Any = None) -> DataReport:
    """Check data files and folders (JSON Lines, CSV, Parquet, .npy/.npz, safetensors, images; .gz for the text
    formats). A missing path raises FileNotFoundError naming it; broken content is reported, never raised."""
    from nanscan.data.formats import check_path, walk_total_bytes

    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    checker = Checker(max_tokens=max_tokens, tokenizer=tokenizer, text_fields=text_fields,
                      max_findings=max_findings, max_record_bytes=max_record_bytes, progress=progress)
    if getattr(checker.progress, "enabled", True):
        for p in paths:
            checker.progress.add_total(walk_total_bytes(p))
    for p in paths:
        check_path(checker, p)
    return checker.finish()
