"""The two entry points of the dataset checks: `check(dataset)` over Python records (a torch map-style or
iterable Dataset, a list of dicts, any iterable) and `check_paths(paths)` over files and folders; both return a
DataReport.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nanscan.data.checker import DEFAULT_MAX_FINDINGS, DEFAULT_MAX_RECORD_BYTES, Checker
from nanscan.data.findings import UNREADABLE, DataReport, RecordRef, TrainingFields
from nanscan.data.records import inspect_record
from nanscan.engine.record_digest import digest_object
from nanscan.data.walk import check_path, walk_total_bytes


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
          name: str = "dataset", limit: int | None = None, fields: TrainingFields | None = None) -> DataReport:
    """Check every record of a dataset for non-finite numbers, finite numbers too large to square in float32
    (|x| >= 2**64: `overflow`), empty fields, over-long text and inconsistent field types or shapes.

    `dataset`: a map-style dataset (len() and [i], e.g. a torch Dataset or a list of dicts), any iterable of
    records, or a path (str or Path) or a list of Path objects (then the same as `check_paths`). A record may
    be a dict, a tuple, a tensor, an array, a string or a number; arrays and tensors are scanned by the core scan.
    `max_tokens`: report records with more tokens (whitespace tokens, or `tokenizer`: a tokenizer.json path).
    `text_fields`: the fields whose text is counted (default: every top-level string field).
    `limit`: check only the first `limit` records.
    `fields`: a TrainingFields naming the fields of token ids (counted as the record's tokens, in place of its
    text), labels and loss mask (`no_supervised_tokens`); default input_ids, labels (ignore index -100), loss_mask.
    A record that raises when loaded is reported `unreadable` and the check goes on (for an iterable, the
    iteration cannot go on and the check stops there).
    """
    if isinstance(dataset, (str, os.PathLike)) or (
            isinstance(dataset, (list, tuple)) and dataset and all(isinstance(p, os.PathLike) for p in dataset)):
        paths = [dataset] if isinstance(dataset, (str, os.PathLike)) else list(dataset)
        return check_paths(paths, max_tokens=max_tokens, tokenizer=tokenizer, text_fields=text_fields,
                           max_findings=max_findings, fields=fields)
    checker = Checker(max_tokens=max_tokens, tokenizer=tokenizer, text_fields=text_fields,
                      max_findings=max_findings, fields=fields)
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
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, progress: Any = None,
                fields: TrainingFields | None = None) -> DataReport:
    """Check data files and folders (JSON Lines, CSV, Parquet, .npy/.npz, safetensors, images; .gz for the text
    formats). A missing path raises FileNotFoundError naming it; broken content is reported, never raised.
    `fields`: as for `check`."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    checker = Checker(max_tokens=max_tokens, tokenizer=tokenizer, text_fields=text_fields,
                      max_findings=max_findings, max_record_bytes=max_record_bytes, progress=progress,
                      fields=fields)
    if getattr(checker.progress, "enabled", True):
        for p in paths:
            checker.progress.add_total(walk_total_bytes(p))
    for p in paths:
        check_path(checker, p)
    return checker.finish()
