"""Sample ids for data findings (`nanscan data --id-field`): the value of one field of each listed record, so a
finding names the record the way training, Monitor.check(sample_ids=...) and replay do, not only by file line."""

from __future__ import annotations

import csv
import dataclasses
import gzip
import io
import json
from pathlib import Path
from typing import Any

from nanscan.data.findings import DataReport, Finding

_JSONL = (".jsonl", ".ndjson", ".json")
_CSV = (".csv", ".tsv")


def _format(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    return "jsonl" if last in _JSONL else "csv" if last in _CSV else "parquet" if last == ".parquet" else None


def _open_text(path: Path):
    raw = gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="")


def _jsonl_ids(path: Path, lines: set[int], field: str) -> dict[int, Any]:
    found = {}
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            if number in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # the line is the finding (unreadable): it has no id to read
                if isinstance(record, dict) and field in record:
                    found[number] = record[field]
            if number >= max(lines):
                break
    return found


def _csv_ids(path: Path, lines: set[int], field: str) -> dict[int, Any]:
    found = {}
    with _open_text(path) as f:
        reader = csv.DictReader(f, delimiter="\t" if ".tsv" in [s.lower() for s in path.suffixes] else ",")
        start = 2  # the header is line 1; a record starts on the line after the previous one ended
        for row in reader:
            if start in lines and field in row:
                found[start] = row[field]
            start = reader.line_num + 1
            if start > max(lines):
                break
    return found


def _parquet_ids(path: Path, rows: set[int], field: str) -> dict[int, Any]:
    import pyarrow.parquet as pq  # noqa: PLC0415 - a reader dependency, loaded only for Parquet

    table = pq.read_table(path, columns=[field])
    column = table.column(field)
    return {i: column[i].as_py() for i in rows if 0 <= i < len(column)}


def with_sample_ids(report: DataReport, field: str) -> tuple[DataReport, list[str]]:
    """The report with each listed finding's `sample_id` read from `field` of its record, and notes on the
    inputs where it could not be read (a format without named fields, or the field missing)."""
    wanted: dict[tuple[str, str], set[int]] = {}
    for f in report.findings:
        kind = _format(Path(f.record.file))
        position = f.record.index if kind == "parquet" else f.record.line
        if kind is not None and position is not None:
            wanted.setdefault((f.record.file, kind), set()).add(position)
    ids: dict[tuple[str, int], Any] = {}
    notes = []
    for (file, kind), positions in wanted.items():
        reader = {"jsonl": _jsonl_ids, "csv": _csv_ids, "parquet": _parquet_ids}[kind]
        try:
            found = reader(Path(file), positions, field)
        except Exception as exc:  # noqa: BLE001 - ids are an aid: the findings stand without them
            notes.append(f"--id-field {field!r}: cannot read ids from {file} ({type(exc).__name__}: {exc})")
            continue
        if len(found) < len(positions):
            notes.append(f"--id-field {field!r}: {len(positions) - len(found)} listed record(s) of {file} have no "
                         f"field {field!r}")
        ids.update({(file, p): v for p, v in found.items()})

    def sample_id(f: Finding) -> Any:
        kind = _format(Path(f.record.file))
        return ids.get((f.record.file, f.record.index if kind == "parquet" else f.record.line))

    findings = [dataclasses.replace(f, sample_id=sample_id(f)) for f in report.findings]
    return dataclasses.replace(report, findings=findings), notes

