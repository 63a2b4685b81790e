"""Checks of a folder of run records (JSON files written by training jobs): empty files, files that are not valid
JSON, non-finite numbers, and records missing required keys. Each problem names the file it was found in.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

EMPTY_FILE = "empty"
INVALID_JSON = "invalid_json"
MISSING_KEY = "missing_key"
UNREADABLE_FILE = "unreadable"
NONFINITE_VALUE = "nonfinite"
RUN_CATEGORIES = (EMPTY_FILE, INVALID_JSON, NONFINITE_VALUE, MISSING_KEY, UNREADABLE_FILE)
UTF8_BOM = b"\xef\xbb\xbf"
NONFINITE_LISTED = 5  # non-finite numbers named per file


@dataclass(frozen=True)
class RunProblem:
    category: str
    path: str
    detail: str

    def to_dict(self) -> dict:
        return {"category": self.category, "path": self.path, "detail": self.detail}


@dataclass
class RunsReport:
    root: str
    files: int
    problems: list[RunProblem] = field(default_factory=list)
    required: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        return {c: sum(p.category == c for p in self.problems) for c in RUN_CATEGORIES}

    def to_dict(self) -> dict:
        return {"ok": self.ok, "root": self.root, "files": self.files, "required": self.required,
                "counts": self.counts(), "problems": [p.to_dict() for p in self.problems]}


def _lookup(record: Any, dotted: str) -> bool:
    """True when the dotted key path ("metrics.loss") exists in nested objects."""
    node = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _nonfinite_numbers(record: Any) -> list[tuple[str, float]]:
    """(dotted path, value) of every non-finite number, in document order (iterative: records may nest deeply)."""
    found, stack = [], [("", record)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                found.append((path or "(top level)", value))
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return found


def check_run_file(path: Path, required: Iterable[str], display: str) -> list[RunProblem]:
    """The problems of one run record (none when it is fine)."""
    required = list(required)
    try:
        data = path.read_bytes()
    except OSError as exc:
        return [RunProblem(UNREADABLE_FILE, display, f"cannot read the file ({exc})")]
    # A byte order mark says the file is UTF-8; it is not part of the JSON text.
    skipped = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    data = data[skipped:]
    if not data.strip():
        return [RunProblem(EMPTY_FILE, display, "the file is empty" if not data else "the file holds only whitespace")]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [RunProblem(INVALID_JSON, display,
                           f"not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start + skipped}")]
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return [RunProblem(INVALID_JSON, display, f"{exc.msg} at line {exc.lineno}, column {exc.colno}")]
    except (ValueError, RecursionError) as exc:
        return [RunProblem(INVALID_JSON, display, f"{type(exc).__name__}: {exc}")]
    problems = []
    # Python's json reads NaN and Infinity (which are not JSON) and numbers past the float range (as inf).
    nonfinite = _nonfinite_numbers(record)
    if nonfinite:
        shown = ", ".join(f"{where} = {'NaN' if math.isnan(value) else f'{value:+}'}"
                          for where, value in nonfinite[:NONFINITE_LISTED])
        more = f" and {len(nonfinite) - NONFINITE_LISTED} more" if len(nonfinite) > NONFINITE_LISTED else ""
        problems.append(RunProblem(NONFINITE_VALUE, display, f"non-finite number(s): {shown}{more} (NaN and Infinity "
                                                             "are not valid JSON; 1e999 and the like overflow to inf)"))
    if not required:
        return problems
    if not isinstance(record, dict):
        problems.append(RunProblem(MISSING_KEY, display, f"the top level is a JSON {type(record).__name__}, not an "
                                                         f"object, so it has none of the required keys {required}"))
        return problems
    missing = [key for key in required if not _lookup(record, key)]
    if missing:
        problems.append(RunProblem(MISSING_KEY, display, "missing required key(s): " + ", ".join(missing)))
    return problems


def check_runs(root: str | Path, required: Iterable[str] = ()) -> RunsReport:
    """Check every *.json file under `root` (recursively, hidden and temporary files skipped); a folder without
    any is a problem too."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"run-record folder {str(root)!r} is not a directory")
    required = list(required)
    report = RunsReport(str(root), 0, required=required)
    files = sorted(p for p in root.rglob("*.json")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    for path in files:
        report.files += 1
        report.problems.extend(check_run_file(path, required, str(path)))
    if not files:
        # Most likely the wrong folder: a check of nothing must not read as a pass.
        report.problems.append(RunProblem(EMPTY_FILE, str(root), "no run records (*.json) under this folder"))
    return report
