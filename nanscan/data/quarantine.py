"""The next run without the quarantined records: a dataset wrapper that skips every record the bundle directory's
quarantine file holds (nanscan.bundle.quarantine), for torch map-style and iterable datasets and HF `datasets`.

    train = nanscan.skip_quarantined(dataset, "nanscan-bundles", id_field="id")

NOTE: [quarantine match]
A record is skipped when the quarantine holds its sample id or its digest; positions (a row index, a file line) are
kept in the file for the reader but never matched, as they move when the data is reordered, filtered or appended.
- Its sample id is read as nanscan data's --id-field reads it (`id_field`: a field of a mapping record, or a
  position of a tuple) or by a function (`sample_id`), and compared by nanscan.bundle.quarantine.record_id, the one
  rule for the ids training passes to Monitor.check(sample_ids=...), which bisection names.
- Its digest is nanscan.engine.record_digest.digest_object of the record as the dataset returns it: the rule the data checks
  name a Python dataset's records by (nanscan.data.check), and the one a bisection's rows are digested by when the
  bundle's batch is what collation stacked from such records (a dict of tensors; nanscan quarantine add --from).
  So a record quarantined by its digest is skipped wherever it moved. A file's digest in a `nanscan data` report
  covers the bytes of its line or row as stored, which a dataset hands over parsed: such a record is skipped by its
  sample id (run nanscan data with --id-field).
Digests are taken only when some quarantined record is known by one, ids only when some is known by one.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from nanscan.bundle.quarantine import Quarantine, QuarantineError, read_quarantine, record_id
from nanscan.engine.record_digest import digest_object

log = logging.getLogger("nanscan")

SampleId = Callable[[Any], Any]


class QuarantineMatch:
    """Whether a record is quarantined (NOTE: [quarantine match]), from one reading of the quarantine file."""

    def __init__(self, bundle_dir: str | os.PathLike, *, id_field: str | int | None = None,
                 sample_id: SampleId | None = None):
        if id_field is not None and sample_id is not None:
            raise ValueError("give id_field= or sample_id=, not both")
        self.quarantine: Quarantine = read_quarantine(bundle_dir)
        self.id_field, self.sample_id = id_field, sample_id
        active = self.quarantine.active()
        self.ids = {r.id for r in active if r.id is not None}
        self.digests = {d for r in active for d in r.sha256}
        self.knows_ids = id_field is not None or sample_id is not None
        # records named by an id alone cannot be found without a way to read each record's id
        self.unmatchable = 0 if self.knows_ids else sum(1 for r in active if not r.sha256)
        self.needs_ids = self.knows_ids and bool(self.ids)
        self.needs_digests = bool(self.digests)

    @property
    def empty(self) -> bool:
        return not (self.needs_ids or self.needs_digests)

    def id_of(self, record: Any, where: str) -> str | None:
        if self.sample_id is not None:
            return record_id(self.sample_id(record))
        try:
            return record_id(record[self.id_field])
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"{where} has no field {self.id_field!r} to read its sample id from; give the field "
                             "that holds it (id_field=), or a function that reads it (sample_id=)") from None

    def __call__(self, record: Any, where: str = "a record") -> bool:
        if self.needs_ids and self.id_of(record, where) in self.ids:
            return True
        return self.needs_digests and digest_object(record) in self.digests

    def warn_unmatchable(self) -> None:
        if self.unmatchable:
            log.warning("nanscan: %d record(s) in %s are quarantined by their sample id only, which this dataset "
                        "wrapper was not told how to read: they are NOT skipped; pass id_field= (the field holding "
                        "the sample id) or sample_id= (a function of the record)", self.unmatchable,
                        self.quarantine.path)

    def say_skipped(self, skipped: int, total: int | None, what: str = "") -> None:
        where = self.quarantine.path if self.quarantine.exists else f"{self.quarantine.path} (no such file)"
        of = f" of {total}" if total is not None else ""
        # a warning when records were left out: skipped training data is never hidden (the count, and where to see
        # why: `nanscan quarantine list`)
        log.log(logging.WARNING if skipped else logging.INFO,
                "nanscan: skipped %d quarantined record(s)%s%s; %d record(s) are quarantined in %s", skipped, of, what,
                len(self.quarantine.active()), where)


class QuarantinedDataset(torch.utils.data.Dataset):
    """A map-style dataset without its quarantined records (NOTE: [quarantine match]).

    Item j is the dataset's item `kept_indices[j]`. Which records are kept is decided once, here: every record is
    loaded once when the quarantine holds any (none when it is empty). `skipped` counts the records left out, and
    `skipped_indices` says which; the count is logged once (logger "nanscan": a warning when any was skipped)."""

    def __init__(self, dataset: Any, bundle_dir: str | os.PathLike, *, id_field: str | int | None = None,
                 sample_id: SampleId | None = None):
        self.dataset = dataset
        match = QuarantineMatch(bundle_dir, id_field=id_field, sample_id=sample_id)
        match.warn_unmatchable()
        total = len(dataset)
        if match.empty:
            self.kept_indices: Sequence[int] = range(total)
            self.skipped_indices: list[int] = []
        else:
            flags = [match(dataset[i], f"record {i}") for i in range(total)]
            self.kept_indices = [i for i, out in enumerate(flags) if not out]
            self.skipped_indices = [i for i, out in enumerate(flags) if out]
        self.quarantine_path = match.quarantine.path
        match.say_skipped(self.skipped, total)

    @property
    def skipped(self) -> int:
        return len(self.skipped_indices)

    def __len__(self) -> int:
        return len(self.kept_indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.kept_indices[index]]


class QuarantinedIterableDataset(torch.utils.data.IterableDataset):
    """An iterable dataset without its quarantined records (NOTE: [quarantine match]), filtered as it streams.

    `skipped` counts the records left out by the current (or last) pass in this process; the first pass logs its
    count once, when it ends or is closed early. Under a DataLoader with workers, each worker filters its own share
    and logs its own count; the main process's wrapper counts nothing then."""

    def __init__(self, dataset: Any, bundle_dir: str | os.PathLike, *, id_field: str | int | None = None,
                 sample_id: SampleId | None = None):
        self.dataset = dataset
        self.match = QuarantineMatch(bundle_dir, id_field=id_field, sample_id=sample_id)
        self.match.warn_unmatchable()
        self.quarantine_path = self.match.quarantine.path
        self.skipped = 0
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        self.skipped, seen = 0, 0
        self.passes += 1
        first = self.passes == 1
        try:
            for record in self.dataset:
                if not self.match.empty and self.match(record, f"record {seen}"):
                    self.skipped += 1
                else:
                    yield record
                seen += 1
            if first:
                self.match.say_skipped(self.skipped, seen)
                first = False
        finally:
            if first:  # closed before the end: what was skipped so far
                self.match.say_skipped(self.skipped, None, f" in the first {seen} record(s), a pass left early")


def _hf_dataset(dataset: Any) -> bool:
    """An HF `datasets.Dataset`, told without importing `datasets`: if the object is one, its module is loaded."""
    hf = sys.modules.get("datasets")
    return hf is not None and isinstance(dataset, getattr(hf, "Dataset", ()))


def _skip_hf(dataset: Any, bundle_dir: str | os.PathLike, id_field: str | None, sample_id: SampleId | None):
    """An HF `datasets.Dataset` without its quarantined rows, still a `datasets.Dataset` (dataset.select of the kept
    rows, so a Trainer keeps reading its columns). The ids come from the `id_field` column, read whole; the rows are
    read (in the dataset's format) only when some quarantined record is known by its digest alone or no id rule was
    given."""
    match = QuarantineMatch(bundle_dir, id_field=id_field, sample_id=sample_id)
    match.warn_unmatchable()
    total = len(dataset)
    if match.empty:
        match.say_skipped(0, total)
        return dataset
    if match.needs_digests or sample_id is not None:
        flags = [match(row, f"row {i}") for i, row in enumerate(dataset)]
    else:
        if id_field not in dataset.column_names:
            raise ValueError(f"the dataset has no column {id_field!r} to read sample ids from (its columns: "
                             f"{', '.join(dataset.column_names)}); give id_field= the column that holds them")
        flags = [record_id(value) in match.ids for value in dataset[id_field]]
    kept = [i for i, out in enumerate(flags) if not out]
    match.say_skipped(total - len(kept), total)
    return dataset if len(kept) == total else dataset.select(kept)


def skip_quarantined(dataset: Any, bundle_dir: str | os.PathLike, *, id_field: str | int | None = None,
                     sample_id: SampleId | None = None) -> Any:
    """`dataset` without the records quarantined in `bundle_dir` (`nanscan quarantine add`), for the next run.

    A record is skipped when the quarantine holds its sample id (read from `id_field` of each record, or by the
    function `sample_id(record)`) or its digest, wherever it moved (NOTE: [quarantine match]). Returns, for an HF
    `datasets.Dataset`, the Dataset of the kept rows (`len(dataset) - len(result)` were skipped); for a map-style
    dataset (len() and [i]), a QuarantinedDataset; for any other iterable (a torch IterableDataset, an HF
    IterableDataset), a QuarantinedIterableDataset. How many were skipped is logged once (logger "nanscan", a
    warning when any was) and the wrappers count it (`skipped`). A released record comes back. A quarantine file that cannot be read
    raises nanscan.bundle.quarantine.QuarantineError: training on records someone quarantined is never silent; so
    does a `bundle_dir` that is no directory (a mistyped path would otherwise skip nothing, quietly). A directory
    with no quarantine file yet (a first run) skips nothing."""
    if not Path(bundle_dir).is_dir():
        raise QuarantineError(f"skip_quarantined: {bundle_dir} is no directory; give the directory the Monitor writes "
                              "its bundles into (its bundle_dir=), whose quarantine file lists the records to skip "
                              "(`nanscan quarantine list --bundle-dir DIR` shows it)")
    if _hf_dataset(dataset):
        return _skip_hf(dataset, bundle_dir, id_field, sample_id)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (hasattr(dataset, "__getitem__")
                                                                     and hasattr(dataset, "__len__")):
        return QuarantinedIterableDataset(dataset, bundle_dir, id_field=id_field, sample_id=sample_id)
    return QuarantinedDataset(dataset, bundle_dir, id_field=id_field, sample_id=sample_id)


__all__ = ["QuarantineMatch", "QuarantinedDataset", "QuarantinedIterableDataset", "skip_quarantined"]
