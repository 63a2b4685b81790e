"""The quarantine file of a bundle directory: the records that a bisection or a data check named, kept out of the
next runs until someone releases them, with who added and released each, when, why, and from which evidence.

NOTE: [quarantine file]
`<bundle_dir>/quarantine.json` (beside the run directories a Monitor writes its bundles into) is plain JSON, keys
sorted, two-space indent, so a reviewer can read it and a diff shows what changed. One entry per record: its
`sample_id` (the id training passed to Monitor.check(sample_ids=...), which bisection names, or a data check's
--id-field value), the `sha256` digests it is known by (nanscan.engine.record_digest.digest_object, the data checks' rule
for a Python record: NOTE: [quarantine match] in nanscan/data/quarantine.py), its `status` ("quarantined" or
"released") and its `history`, which is never shortened: every add ("added": at, by, reason, note, and the source
that named it: a bundle and its row, a data report and its record, or "by hand") and every release ("released":
at, by, note). Rules:
- written only through atomic_write_bytes (a temporary file, fsync, rename): a write that dies half way leaves the
  old file whole; writers take a lock on the bundle directory, so two adds at once both land;
- the same add twice changes nothing (the file stays byte-identical): an add is new only when no add since the
  record's last release had the same source, reason and note, and it names no new digest;
- a file that cannot be read as such (not JSON, hand-edited into another shape) is refused with QuarantineError,
  naming the file, what is wrong and what to do, and is never written over: nothing is changed until it is fixed;
- reading it runs nothing (JSON only, as a bundle is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from nanscan._atomic import atomic_write_bytes
from nanscan.bundle.format import BundleError, plain_json

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: writes are still atomic, only not serialised
    fcntl = None

QUARANTINE = "quarantine.json"
FORMAT = "nanscan.quarantine/1"
QUARANTINED, RELEASED = "quarantined", "released"
ADDED = "added"
STATUSES = (QUARANTINED, RELEASED)
# a digest given to release or add: the hex sha256, or a prefix of it (at least this long) after "sha256:"
DIGEST_PREFIX = "sha256:"
MIN_DIGEST_PREFIX = 8
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# The sample ids of the trainer adapters (nanscan.integrations.session): a position {"micro_batch", "row"}, with
# the record's own id under "id" when the adapter was given a sample id field.
POSITION_KEYS = frozenset({"micro_batch", "row"})


class QuarantineError(BundleError):
    """A quarantine file that cannot be read or changed as asked: the message names the file and what to do."""


def quarantine_path(bundle_dir: str | os.PathLike) -> Path:
    """Where the quarantine file of `bundle_dir` (the directory a Monitor writes its bundles into) lives."""
    return Path(bundle_dir) / QUARANTINE


def record_id(sample_id: Any) -> str | None:
    """The text a sample id is matched by, or None when it names no record.

    One rule for every side (NOTE: [quarantine match]): the id training passed to Monitor.check(sample_ids=...),
    the one bisection names from the bundle, a data check's --id-field value and the one a dataset wrapper reads.
    Strings and integers by their text (a CSV's "7" and a JSON Lines 7 are the same record); numpy and torch
    scalars as their Python value; a trainer adapter's {"micro_batch", "row", "id"} by its "id", and without one
    (a position in a batch, not a record) None; anything else as canonical JSON."""
    if sample_id is None:
        return None
    if isinstance(sample_id, Mapping):
        if "id" in sample_id:
            return record_id(sample_id["id"])
        if set(sample_id) <= POSITION_KEYS:
            return None
    value = plain_json(sample_id, "sample id")
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _text(note: str | None) -> str | None:
    """A note as stored: its text without surrounding space, None when there is none."""
    return (str(note).strip() or None) if note is not None else None


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass(frozen=True)
class NamedRecord:
    """A record an add names: its sample id and/or digests, and where it was named (`source`: a JSON object such as
    {"bundle": ..., "row": 5} or {"data_report": ..., "record": "train.jsonl:17"}; {"by_hand": true})."""

    sample_id: Any = None
    sha256: tuple[str, ...] = ()
    source: Mapping = dataclasses.field(default_factory=lambda: {"by_hand": True})

    def __post_init__(self):
        digests = tuple(sorted({str(d).lower().removeprefix(DIGEST_PREFIX) for d in self.sha256}))
        for d in digests:
            if not _HEX64.match(d):
                raise ValueError(f"{d!r} is not a sha256 digest (64 hexadecimal digits)")
        object.__setattr__(self, "sha256", digests)
        object.__setattr__(self, "sample_id", plain_json(self.sample_id, "sample id"))
        object.__setattr__(self, "source", plain_json(dict(self.source), "source"))
        if record_id(self.sample_id) is None and not digests:
            raise ValueError(f"a record to quarantine needs a sample id or a sha256 digest (named by {self.source})")


@dataclasses.dataclass
class QuarantinedRecord:
    """One entry of the quarantine file (NOTE: [quarantine file]); `history` is every add and release, oldest
    first."""

    sample_id: Any
    sha256: list[str]
    status: str
    history: list[dict]

    @property
    def id(self) -> str | None:
        return record_id(self.sample_id)

    @property
    def key(self) -> str:
        """How the file orders its entries, and how `list` names a record: its id, else its first digest."""
        return f"id:{self.id}" if self.id is not None else f"{DIGEST_PREFIX}{self.sha256[0]}"

    @property
    def quarantined(self) -> bool:
        return self.status == QUARANTINED

    def adds_since_release(self) -> list[dict]:
        last = max((i for i, e in enumerate(self.history) if e.get("event") == RELEASED), default=-1)
        return [e for e in self.history[last + 1:] if e.get("event") == ADDED]

    @property
    def last_add(self) -> dict:
        return [e for e in self.history if e.get("event") == ADDED][-1]

    @property
    def reason(self) -> str:
        return self.last_add.get("reason") or ""

    def notes(self) -> list[str]:
        return [e["note"] for e in self.history if e.get("note")]

    def to_dict(self) -> dict:
        return {"sample_id": self.sample_id, "sha256": list(self.sha256), "status": self.status,
                "history": list(self.history)}


@dataclasses.dataclass
class Quarantine:
    """The quarantine file of a bundle directory, read (an empty one where no file exists yet)."""

    path: Path
    records: list[QuarantinedRecord]
    exists: bool = True

    def active(self) -> list[QuarantinedRecord]:
        return [r for r in self.records if r.quarantined]

    def find(self, name: str) -> QuarantinedRecord | None:
        """The entry a name given on the command line means: a sample id, or `sha256:` and (a prefix of) a digest;
        raises QuarantineError when a digest prefix fits several."""
        if name.startswith(DIGEST_PREFIX):
            prefix = name[len(DIGEST_PREFIX):].lower()
            if len(prefix) < MIN_DIGEST_PREFIX:
                raise QuarantineError(f"{name!r}: give at least {MIN_DIGEST_PREFIX} hexadecimal digits of the digest")
            found = [r for r in self.records if any(d.startswith(prefix) for d in r.sha256)]
            if len(found) > 1:
                raise QuarantineError(f"{name!r} is the start of the digests of {len(found)} records in "
                                      f"{self.path}: give more of the digest")
            return found[0] if found else None
        return next((r for r in self.records if r.id == name), None)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "records": [r.to_dict() for r in sorted(self.records, key=lambda r: r.key)]}

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
                + "\n").encode("utf-8")


def _broken(path: Path, what: str) -> QuarantineError:
    return QuarantineError(
        f"{path} is not a readable quarantine file: {what}. Nothing was changed, and nanscan will not write over it: "
        f"fix it by hand (it is JSON: {{\"format\": \"{FORMAT}\", \"records\": [...]}}, see docs/quarantine.md) or "
        "restore it from a copy (version control, a backup); moving it away starts an empty quarantine, which "
        "releases every record it held")


def _check_record(path: Path, i: int, raw: Any) -> QuarantinedRecord:
    where = f"records[{i}]"
    if not isinstance(raw, dict):
        raise _broken(path, f"{where} is a {type(raw).__name__}, not an object")
    missing = [k for k in ("sample_id", "sha256", "status", "history") if k not in raw]
    if missing:
        raise _broken(path, f"{where} has no {', '.join(repr(k) for k in missing)}")
    digests = raw["sha256"]
    if not isinstance(digests, list) or not all(isinstance(d, str) and _HEX64.match(d) for d in digests):
        raise _broken(path, f"{where}.sha256 is not a list of sha256 digests (64 lower-case hexadecimal digits)")
    try:
        named = record_id(raw["sample_id"])
    except (TypeError, ValueError) as exc:
        raise _broken(path, f"{where}.sample_id cannot be read as an id ({exc})") from None
    if named is None and not digests:
        raise _broken(path, f"{where} names no record: its sample_id is null and it has no sha256")
    history = raw["history"]
    if not isinstance(history, list) or not history or not all(isinstance(e, dict) for e in history):
        raise _broken(path, f"{where}.history is not a non-empty list of events")
    for j, event in enumerate(history):
        if event.get("event") not in (ADDED, RELEASED) or not isinstance(event.get("at"), str):
            raise _broken(path, f"{where}.history[{j}] is not an event ({{\"event\": \"added\" or \"released\", "
                                f"\"at\": ...}})")
    if history[0]["event"] != ADDED:
        raise _broken(path, f"{where}.history starts with {history[0]['event']!r}: a record is added before it is "
                            "released")
    status = raw["status"]
    expected = QUARANTINED if history[-1]["event"] == ADDED else RELEASED
    if status != expected:
        raise _broken(path, f"{where}.status is {status!r} but its last event is {history[-1]['event']!r}; to "
                            "release a record use `nanscan quarantine release`, which records who and when")
    return QuarantinedRecord(raw["sample_id"], list(digests), status, list(history))


def read_quarantine(bundle_dir: str | os.PathLike) -> Quarantine:
    """The quarantine file of `bundle_dir`, validated (NOTE: [quarantine file]); an empty Quarantine when there is
    none. Raises QuarantineError naming the file when it cannot be read as one."""
    path = quarantine_path(bundle_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Quarantine(path, [], exists=False)
    except IsADirectoryError:
        raise _broken(path, "it is a directory") from None
    except OSError as exc:
        raise QuarantineError(f"{path} cannot be read ({exc.strerror or exc}); check its permissions") from None
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _broken(path, f"it is not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise _broken(path, f"its format is {found!r}, not {FORMAT!r}")
    if not isinstance(raw.get("records"), list):
        raise _broken(path, "it has no list of records")
    records = [_check_record(path, i, r) for i, r in enumerate(raw["records"])]
    keys = [r.key for r in records]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise _broken(path, f"{twice[0]} has more than one entry; merge their histories into one")
    return Quarantine(path, records)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on the bundle directory itself (flock on its descriptor, as a bundle's own updates take on
    theirs), so two writers of the quarantine file take turns and no lock file is left behind."""
    if fcntl is None:
        yield
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        with contextlib.suppress(OSError):  # file systems without flock: atomic, but not serialised
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _update(bundle_dir: str | os.PathLike, change) -> tuple[Quarantine, Any]:
    """Read the file under the lock, let `change(quarantine)` edit it and return (changed, result), and write it
    back atomically when it changed."""
    directory = Path(bundle_dir)
    if not directory.is_dir():
        raise QuarantineError(f"the bundle directory {directory} does not exist: give the directory a Monitor writes "
                              "its bundles into (Monitor(bundle_dir=...), default nanscan-bundles)")
    with _locked(directory):
        quarantine = read_quarantine(directory)
        changed, result = change(quarantine)
        if changed:
            atomic_write_bytes(quarantine.path, quarantine.to_bytes())
            quarantine.exists = True
    return quarantine, result


@dataclasses.dataclass
class AddResult:
    """What an add did: records newly quarantined, added again (named by a new source, or after a release), and
    those for which the same add was made already (nothing changed)."""

    added: list[QuarantinedRecord] = dataclasses.field(default_factory=list)
    again: list[QuarantinedRecord] = dataclasses.field(default_factory=list)
    unchanged: list[QuarantinedRecord] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.again)


def _matching(records: list[QuarantinedRecord], named: NamedRecord) -> QuarantinedRecord | None:
    """The entry a named record joins: the one with its sample id; else, one its digests name (when that entry has
    no sample id, or the named record has none either)."""
    rid = record_id(named.sample_id)
    if rid is not None:
        same = next((r for r in records if r.id == rid), None)
        if same is not None:
            return same
    shared = set(named.sha256)
    return next((r for r in records if shared & set(r.sha256) and (r.id is None or rid is None)), None)


def add_records(bundle_dir: str | os.PathLike, named: Sequence[NamedRecord], *, reason: str,
                note: str | None = None, by: str | None = None, at: str | None = None) -> tuple[Quarantine, AddResult]:
    """Quarantine the `named` records in `bundle_dir`'s quarantine file, each with `reason` (and the reviewer's
    `note`), recorded as added by `by` at `at` (default: now). The same add twice changes nothing (NOTE: [quarantine
    file]). Returns the quarantine as written and what changed."""
    reason = " ".join(str(reason).split())
    if not reason:
        raise ValueError("a quarantine needs a reason: say why these records are kept out of training")
    if not named:
        raise ValueError("no record to quarantine")
    note = _text(note)
    stamp = at or now()

    def change(quarantine: Quarantine) -> tuple[bool, AddResult]:
        result = AddResult()
        for item in named:
            event = {"event": ADDED, "at": stamp, "by": by, "reason": reason, "note": note,
                     "source": dict(item.source)}
            entry = _matching(quarantine.records, item)
            if entry is None:
                entry = QuarantinedRecord(item.sample_id, list(item.sha256), QUARANTINED, [event])
                quarantine.records.append(entry)
                result.added.append(entry)
                continue
            same = any(e.get("source") == event["source"] and e.get("reason") == reason and e.get("note") == note
                       for e in entry.adds_since_release())
            new_digests = set(item.sha256) - set(entry.sha256)
            if same and not new_digests and entry.quarantined and (entry.sample_id is not None
                                                                   or item.sample_id is None):
                result.unchanged.append(entry)
                continue
            if entry.sample_id is None and item.sample_id is not None:
                entry.sample_id = item.sample_id  # a record known by its digest gains the id it was named by
            entry.sha256 = sorted(set(entry.sha256) | new_digests)
            entry.history.append(event)
            entry.status = QUARANTINED
            result.again.append(entry)
        return result.changed, result

    return _update(bundle_dir, change)


@dataclasses.dataclass
class ReleaseResult:
    released: list[QuarantinedRecord] = dataclasses.field(default_factory=list)
    already: list[QuarantinedRecord] = dataclasses.field(default_factory=list)


def release_records(bundle_dir: str | os.PathLike, names: Iterable[str], *, note: str | None = None,
                    by: str | None = None, at: str | None = None) -> tuple[Quarantine, ReleaseResult]:
    """Release the records `names` (sample ids, or `sha256:` and a digest or its first digits) from `bundle_dir`'s
    quarantine: they come back in the next runs, and the release is recorded in their history. Raises
    QuarantineError, changing nothing, when a name matches no record. Releasing a released record changes nothing."""
    names = list(dict.fromkeys(str(n) for n in names))
    if not names:
        raise ValueError("name the records to release (their sample ids, or sha256:DIGEST)")
    note = _text(note)
    stamp = at or now()

    def change(quarantine: Quarantine) -> tuple[bool, ReleaseResult]:
        if not quarantine.exists:
            raise QuarantineError(f"there is no quarantine file at {quarantine.path}: nothing to release")
        found = {name: quarantine.find(name) for name in names}
        unknown = [name for name, r in found.items() if r is None]
        if unknown:
            raise QuarantineError(f"{quarantine.path} has no record {', '.join(map(repr, unknown))}; nothing was "
                                  "released (`nanscan quarantine list --all` shows every record it holds)")
        result = ReleaseResult()
        for entry in {id(r): r for r in found.values()}.values():  # two names of one record release it once
            if not entry.quarantined:
                result.already.append(entry)
                continue
            entry.history.append({"event": RELEASED, "at": stamp, "by": by, "note": note})
            entry.status = RELEASED
            result.released.append(entry)
        return bool(result.released), result

    return _update(bundle_dir, change)


def shown_path(path: str | os.PathLike, bundle_dir: str | os.PathLike) -> str:
    """How a source's path is stored: relative to the bundle directory when inside it (the file stays right when
    the directory is moved), else absolute."""
    path, root = Path(path).resolve(), Path(bundle_dir).resolve()
    with contextlib.suppress(ValueError):
        return path.relative_to(root).as_posix()
    return str(path)


__all__ = ["ADDED", "FORMAT", "QUARANTINE", "QUARANTINED", "RELEASED", "AddResult", "NamedRecord", "Quarantine",
           "QuarantineError", "QuarantinedRecord", "ReleaseResult", "add_records", "quarantine_path",
           "read_quarantine", "record_id", "release_records", "shown_path"]
