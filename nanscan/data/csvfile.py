"""CSV and TSV files (optionally gzip-compressed), read record by record.

A record is a row after the header; its identifier is the number of its first line and the sha256 of its lines
(several when quoted text spans lines) without the final line break. Cells that spell numbers are checked as
numbers ("nan" and "1e999" are non-finite). A cell of a token, labels or loss-mask field (TrainingFields) that is a
JSON list, "[101, 2023, 102]", is that list, so its length counts as tokens and its labels are checked. A line
longer than --max-record-bytes is not parsed: it is reported `unreadable` and hashed in passing.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import zipfile
from pathlib import Path

from nanscan.data.checker import Checker, file_ref
from nanscan.data.findings import EMPTY, INCONSISTENT, UNREADABLE, UTF8_BOM, RecordRef, sha256_hex
from nanscan.data.records import inspect_record


class _CsvLines:
    """Decoded lines for csv.reader that remember the raw bytes and line numbers of the record being read."""

    def __init__(self, stream, limit: int):
        self.stream = stream
        self.limit = limit
        self.line = 0
        self.record_first_line = 1
        self.parts: list[bytes] = []
        self.problem: str | None = None
        self.digest: str | None = None  # set for an over-long line, hashed while skipped

    def start_record(self) -> None:
        self.record_first_line = self.line + 1
        self.parts, self.problem, self.digest = [], None, None

    def raw(self) -> bytes:
        return b"".join(self.parts).rstrip(b"\r\n")

    def __iter__(self):
        return self

    def __next__(self) -> str:
        raw = self.stream.readline(self.limit + 1)
        if not raw:
            raise StopIteration
        self.line += 1
        if self.line == 1 and raw.startswith(UTF8_BOM):
            raw = raw[len(UTF8_BOM):]  # the file's encoding mark, not part of the first column's name
        if len(raw) > self.limit and not raw.endswith(b"\n"):
            h, size = hashlib.sha256(raw), len(raw)
            while rest := self.stream.readline(1 << 20):
                size += len(rest)
                if rest.endswith(b"\n"):
                    h.update(rest[:-1])
                    break
                h.update(rest)
            self.problem = f"line of {size} bytes exceeds --max-record-bytes {self.limit}; not parsed"
            self.digest = h.hexdigest()
            return "\n"
        self.parts.append(raw)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.problem = self.problem or f"not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}"
            return raw.decode("utf-8", "replace")


def _csv_value(cell: str):
    """A CSV cell as the number it spells (int or float, so "nan" and "1e999" are non-finite), else the text."""
    try:
        return int(cell)
    except ValueError:
        pass
    try:
        return float(cell)
    except ValueError:
        return cell


def _csv_list(cell: str):
    """A cell of a list field: the JSON list it spells, else the cell as any other (_csv_value)."""
    if cell.lstrip().startswith("["):
        try:
            value = json.loads(cell)
        except ValueError:  # not JSON after all: the text, as in any other field
            return cell
        if isinstance(value, list):
            return value
    return _csv_value(cell)


def check_csv(checker: Checker, path: Path) -> None:
    display = str(path)
    delimiter = "\t" if ".tsv" in [s.lower() for s in path.suffixes] else ","
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    csv.field_size_limit(max(checker.max_record_bytes, 1 << 20))
    try:
        with opener(path, "rb") as stream:
            lines = _CsvLines(stream, checker.max_record_bytes)
            reader = csv.reader(lines, delimiter=delimiter)
            header = None
            while True:
                lines.start_record()
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:
                    checker.records += 1
                    checker.sink.add(UNREADABLE, _csv_ref(display, lines), f"CSV syntax error: {exc}")
                    continue
                ref = _csv_ref(display, lines)
                if lines.problem:
                    checker.records += 1
                    checker.sink.add(UNREADABLE, ref, lines.problem)
                    continue
                if header is None:
                    header = row
                    if not row:
                        header = None  # blank lines before the header
                    continue
                _csv_record(checker, header, row, ref)
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        checker.sink.add(UNREADABLE, file_ref(path), f"cannot read the file ({type(exc).__name__}: {exc})")
    except Exception as exc:  # noqa: BLE001 - e.g. zlib.error from a corrupt gzip stream
        checker.sink.add(UNREADABLE, file_ref(path), f"cannot read the file ({type(exc).__name__}: {exc})")


def _csv_ref(display: str, lines: _CsvLines) -> RecordRef:
    digest = lines.digest if lines.digest is not None else sha256_hex(lines.raw())
    return RecordRef(display, line=lines.record_first_line, digest=digest)


def _csv_record(checker: Checker, header: list[str], row: list[str], ref: RecordRef) -> None:
    if not row:
        checker.records += 1
        checker.sink.add(EMPTY, ref, "blank line")
        return
    if len(row) != len(header):
        checker.records += 1
        checker.sink.add(INCONSISTENT, ref, f"{len(row)} cells where the header has {len(header)}")
        return
    names = _unique_names(header)
    lists = checker.fields.list_fields()
    record = {name: (_csv_list if name in lists else _csv_value)(cell) for name, cell in zip(names, row)}
    inspect_record(checker, record, ref)


def _unique_names(header: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for i, name in enumerate(header):
        name = name or f"column {i + 1}"
        if name in seen:
            seen[name] += 1
            name = f"{name}#{seen[name]}"
        else:
            seen[name] = 1
        out.append(name)
    return out
