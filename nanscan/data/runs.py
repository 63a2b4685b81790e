"""Checks of a folder of run records (JSON files written by training jobs): empty files, files that are not valid
JSON, and records missing required keys. Each problem names the file it was found in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

EMPTY_FILE = "empty"
INVALID_JSON = "invalid_json"
MISSING_KEY = "missing_key"
UNREADABLE_FILE = "unreadable"
RUN_CATEGORIES = (EMPTY_FILE, INVALID_JSON, MISSING_KEY, UNREADABLE_FILE)


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


def check_run_file(path: Path, required: Iterable[str], display: str) -> RunProblem | None:
    required = list(required)
    try:
        data = path.read_bytes()
    except OSError as exc:
        return RunProblem(UNREADABLE_FILE, display, f"cannot read the file ({exc})")
    if not data.strip():
        return RunProblem(EMPTY_FILE, display, "the file is empty" if not data else "the file holds only whitespace")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RunProblem(INVALID_JSON, display, f"not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start}")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return RunProblem(INVALID_JSON, display, f"{exc.msg} at line {exc.lineno}, column {exc.colno}")
    except (ValueError, RecursionError) as exc:
        return RunProblem(INVALID_JSON, display, f"{type(exc).__name__}: {exc}")
    if not required:
        return None
    if not isinstance(record, dict):
        return RunProblem(MISSING_KEY, display, f"the top level is a JSON {type(record).__name__}, not an object, "
                                                f"so it has none of the required keys {required}")
    missing = [key for key in required if not _lookup(record, key)]
    if missing:
        return RunProblem(MISSING_KEY, display, "missing required key(s): " + ", ".join(missing))
    return None


def check_runs(root: str | Path, required: Iterable[str] = ()) -> RunsReport:
    """Check every *.json file under `root` (recursively, hidden and temporary files skipped)."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"run-record folder {str(root)!r} is not a directory")
    required = list(required)
    report = RunsReport(str(root), 0, required=required)
    files = sorted(p for p in root.rglob("*.json")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    for path in files:
        report.files += 1
        problem = check_run_file(path, required, str(path))
        if problem is not None:
            report.problems.append(problem)
    return report
