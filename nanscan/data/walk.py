"""The walk over the files and folders given to a check: each file's format, chosen by suffix (".jsonl",
".csv.gz", ".parquet", ".npy", ".png", ...) or, for a file named explicitly with an unknown suffix, by its first
bytes, and the reader of that format (one module each: jsonl, csvfile, parquet, arrays, images).

Each reader streams, and whatever is wrong with a file becomes a finding; no reader raises on bad content.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from nanscan.data.arrays import check_npy, check_npz, check_safetensors
from nanscan.data.checker import Checker, file_ref
from nanscan.data.csvfile import check_csv
from nanscan.data.findings import EMPTY, UNREADABLE
from nanscan.data.images import Images
from nanscan.data.jsonl import check_jsonl
from nanscan.data.parquet import check_parquet

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"})
TEXT_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "csv"}
BINARY_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".npy": "npy", ".npz": "npz",
                   ".safetensors": "safetensors"}


def format_of(path: Path) -> str | None:
    """The format implied by the file name, or None."""
    suffixes = [s.lower() for s in path.suffixes]
    if not suffixes:
        return None
    last = suffixes[-1]
    if last == ".gz" and len(suffixes) >= 2 and suffixes[-2] in TEXT_SUFFIXES:
        return TEXT_SUFFIXES[suffixes[-2]]
    if last in TEXT_SUFFIXES:
        return TEXT_SUFFIXES[last]
    if last in BINARY_SUFFIXES:
        return BINARY_SUFFIXES[last]
    if last in IMAGE_SUFFIXES:
        return "image"
    return None


def sniff_format(path: Path) -> str | None:
    """The format implied by a file's first bytes, for files named explicitly with an unknown suffix."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"PK\x03\x04"):
        return "npz"
    if head.startswith((b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"II*\x00", b"MM\x00*")) or (
            head.startswith(b"RIFF") and head[8:12] == b"WEBP"):
        return "image"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
        return "safetensors"
    if head.lstrip()[:1] in (b"{", b"["):
        return "jsonl"
    return None


def _visible_files(root: Path) -> Iterator[Path]:
    """Files under a folder in a stable (sorted) order, skipping hidden and temporary names."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath) / name


def walk_total_bytes(path: Path) -> int:
    if path.is_dir():
        total = 0
        for p in _visible_files(path):
            if format_of(p) is not None:
                try:
                    total += p.stat().st_size
                except OSError:
                    pass
        return total
    try:
        return path.stat().st_size
    except OSError:
        return 0


# Formats whose records have comparable fields: records (dicts), stored arrays, images.
FAMILIES = {"jsonl": "records", "csv": "records", "parquet": "records", "npy": "arrays", "npz": "arrays",
            "safetensors": "arrays", "image": "images"}


def check_path(checker: Checker, path: Path) -> None:
    """Check a file or every known file under a folder (files of unknown formats in folders are skipped).

    A path given to the check is one dataset: its records are compared field by field with each other (per family
    of formats), not with the records of another path.
    """
    with Images(checker, (str(path), FAMILIES["image"])) as images:
        if path.is_dir():
            for p in _visible_files(path):
                fmt = format_of(p)
                if fmt is None:
                    checker.skip(p)
                elif fmt == "image":
                    images.add(p)
                else:
                    checker.scope = (str(path), FAMILIES[fmt])
                    check_file(checker, p, fmt)
        else:
            fmt = format_of(path) or sniff_format(path)
            checker.scope = (str(path), FAMILIES.get(fmt, ""))
            if fmt == "image":
                images.add(path)
            elif fmt is None:
                _count_file(checker, path)
                checker.records += 1
                checker.sink.add(UNREADABLE, file_ref(path), "format not recognised from the file name or its "
                                 "first bytes; name it .jsonl, .csv, .parquet, .npy, .npz, .safetensors or an image "
                                 "suffix")
            else:
                check_file(checker, path, fmt)


def _count_file(checker: Checker, path: Path) -> int:
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    checker.files += 1
    checker.bytes += size
    return size


def check_file(checker: Checker, path: Path, fmt: str) -> None:
    size = _count_file(checker, path)
    checker.progress.describe(str(path))
    records_before = checker.records
    if fmt == "jsonl":
        check_jsonl(checker, path, str(path))
    elif fmt == "csv":
        check_csv(checker, path)
        checker.progress.advance(size)
    elif fmt == "parquet":
        check_parquet(checker, path, size)
    elif fmt == "npy":
        check_npy(checker, path)
        checker.progress.advance(size)
    elif fmt == "npz":
        check_npz(checker, path)
        checker.progress.advance(size)
    elif fmt == "safetensors":
        check_safetensors(checker, path)
        checker.progress.advance(size)
    else:  # pragma: no cover - format_of and sniff_format return only the formats above
        raise ValueError(f"unknown format {fmt!r}")
    if fmt in ("jsonl", "csv", "parquet") and checker.records == records_before:
        checker.sink.add(EMPTY, file_ref(path), "the file holds no records")
