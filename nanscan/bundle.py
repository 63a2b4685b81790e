"""The evidence bundle: one directory per incident, `<bundle_dir>/<run_id>/step-<N>/`, holding everything needed
to understand and replay the first non-finite step, and `load_bundle` to read it back safely.

Layout (schema "nanscan.bundle/1"):
  manifest.json        what happened, where the code and config came from, and the sha256 of every other file
  batch.safetensors    the failing step's batch (every tensor, integer ones too); its nesting is in the manifest
  rng.safetensors      RNG states (torch CPU/CUDA, numpy, Python random) at the failing step's start, or at its
                       check where the manifest's rng.captured_at_by_source says so
  history.safetensors  stats records of the last steps; history.json names their tensors, loss, lr, grad norm
  state.safetensors    model and optimizer state; state.json holds the optimizer's non-tensor structure
  source.diff          uncommitted changes (`git diff HEAD`), when the work tree was dirty and the diff is small
  logs/                the last lines of each log file
  ledger.jsonl         one JSON record per automatic finding and reviewer note
  INCIDENT.md          the incident note: "Automatic findings" and "Reviewer notes", rendered from the ledger

Loading never runs code: tensors are safetensors, everything else JSON; `torch.load`/pickle is never used.
A bundle may come from anyone, so nothing in it is read before the manifest checks out: its fields have the types
the readers need, every file name is a plain relative path (no '..', no absolute or hidden names), no symbolic link
and no unlisted file sits in the directory, and every listed file has its recorded size and sha256.
Writing is atomic (a temporary `.tmp-*` directory renamed into place, manifest written last; one that a killed
writer left behind is removed by the next write of that bundle on the same host) and idempotent (an existing
valid bundle for the same run and step is kept as is). Later additions (findings, notes) go through
a small journal: new files are written under `.pending-*` names and the new manifest's arrival is the commit
point, so an interrupted update is either finished or discarded the next time the bundle is opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import click
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanscan import _layout as L
from nanscan._atomic import (FILE_MODE, TEMP_PREFIX, atomic_directory, atomic_write_bytes, fsync_dir, is_temp_name,
                             json_bytes, sha256_file)
from nanscan.inputs import tensor_from_numpy
from nanscan.provenance import SourceInfo, config_sha256, restore_rng, rng_from_tensors, rng_to_tensors
from nanscan.stats import ScannedTensor, ScanReport

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: updates are then not serialised between processes
    fcntl = None

log = logging.getLogger("nanscan")

SCHEMA = "nanscan.bundle/1"
MANIFEST = "manifest.json"
INCIDENT = "INCIDENT.md"
LEDGER = "ledger.jsonl"
BATCH = "batch.safetensors"
RNG = "rng.safetensors"
HISTORY = "history.safetensors"
HISTORY_INDEX = "history.json"
STATE = "state.safetensors"
STATE_STRUCTURE = "state.json"
SOURCE_DIFF = "source.diff"
LOGS = "logs"
PENDING_PREFIX = ".pending-"
RNG_METADATA_KEY = "nanscan.rng"

# A log file is copied from its end: at most this many lines and bytes.
LOG_TAIL_LINES = 200
LOG_TAIL_BYTES = 64 << 10

# Findings of the detection itself; later issues (replay, ablation) add their own keys.
DETECT_FINDING = "detect"

REQUIRED_KEYS = ("schema", "run_id", "first_invalid_step", "category", "nonfinite_tensors", "source", "config",
                 "config_sha256", "environment", "batch", "rng", "history", "state", "replay_entry", "files",
                 "incident", "ledger")

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_STEP_DIR = re.compile(r"^step-(\d+)$")

CATEGORY_EXPLANATIONS = {
    "input": "A tensor of the batch was already non-finite when it reached the model: the data (or its "
             "preprocessing) is the cause.",
    "parameter": "A weight was already non-finite before this step's update: an earlier update or an outside "
                 "write corrupted it.",
    "optimizer_state": "The optimizer state was non-finite while inputs and weights were finite: the optimizer's "
                       "moments or counters broke first.",
    "loss": "The loss was non-finite while inputs, weights and optimizer state were finite: something in the "
            "forward pass produced it.",
    "gradient": "The loss was finite but a gradient was not: something in the backward pass produced it.",
    "other_rank": "This rank's tensors were finite at this step, another rank's were not: the bundle set's "
                  "index (index.json, one directory up) names the rank that went bad first.",
}


class BundleError(ValueError):
    """A bundle that is missing, incomplete, damaged, modified or not a nanscan bundle."""


@dataclasses.dataclass(frozen=True)
class HistoryEntry:
    """One step of the Monitor's history: the scan report and the scalars that go with it."""

    step: int
    loss: float | None
    lr: float | None
    grad_norm: float | None  # L2 norm over the finite values of every gradient (from the records' sumsq)
    report: ScanReport = dataclasses.field(repr=False)


@dataclasses.dataclass
class Incident:
    """Everything a bundle records about one non-finite step; `write_bundle` turns it into files.

    Built once when the incident is detected (timestamps, environment and log tails included), so writing the
    same Incident twice yields identical bytes.
    """

    run_id: str
    step: int
    category: str
    tensors: list[str]  # the non-finite tensors that decided the category
    report: ScanReport
    detected_at: str  # ISO 8601, UTC
    history: Sequence[HistoryEntry] = ()
    batch: Any = None
    sample_ids: Any = None
    config: dict | None = None
    source: SourceInfo | None = None
    environment: dict | None = None
    rng: dict | None = None
    # per RNG source ("torch", "numpy", "python"): "step_start" (forward pre-hook) or "check"
    rng_captured_at: Mapping[str, str] = dataclasses.field(default_factory=dict)
    model_state: Mapping | None = None
    optimizer_state: Mapping | None = None
    state_pre_step: bool = False
    state_note: str = ""
    logs: Sequence[dict] = ()  # from read_log_tail
    replay_entry: str | None = None
    # One rank's part of a distributed incident (nanscan.distributed): written to step-<N>/rank-<r>/, with the
    # `distributed` mapping stored in the manifest.
    rank: int | None = None
    distributed: Mapping | None = None


# -- kinds and categories ----------------------------------------------------------------------------------

_KIND_OF_PREFIX = {"input": "input", "param": "parameter", "optim": "optimizer_state", "grad": "gradient"}


def tensor_kind(name: str) -> str:
    """The kind of a scanned tensor from its name: input, parameter, optimizer_state, loss, gradient or other."""
    if name == "loss":
        return "loss"
    prefix, sep, _ = name.partition(":")
    return _KIND_OF_PREFIX.get(prefix, "other") if sep else "other"


# -- JSON helpers -------------------------------------------------------------------------------------------

def json_float(value: float | None) -> float | str | None:
    """A float for strict JSON: non-finite values become the strings "nan", "inf", "-inf"."""
    if value is None:
        return None
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def float_from_json(value: float | str | None) -> float | None:
    return None if value is None else float(value)


def plain_json(value: Any, where: str = "value") -> Any:
    """A JSON-ready copy of `value`: numbers (non-finite as strings), strings, lists, string-keyed dicts."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, np.generic):
        return plain_json(value.item(), where)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return plain_json(value.item(), where)
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return plain_json(value.tolist(), where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): plain_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where} is a {type(value).__name__}, which cannot be stored as JSON; "
                    "pass numbers, strings, lists or dicts")


# -- nested structures with tensors inside (batches, optimizer state) ---------------------------------------
#
# A structure is stored as a JSON skeleton whose tensor leaves are {"__tensor__": name}, with the tensors in a
# safetensors file. Markers keep what JSON would lose: tuples, non-string dict keys, non-finite floats. Values
# that are neither JSON nor tensors are recorded by type name only ({"__unstored__": ...}): never pickled.

def _is_marker_dict(value: Mapping) -> bool:
    return any(isinstance(k, str) and k.startswith("__") for k in value)


class _TreeEncoder:
    def __init__(self, separator: str):
        self.separator = separator
        self.tensors: dict[str, torch.Tensor] = {}

    def _name(self, path: Sequence[str]) -> str:
        name = self.separator.join(path) or "tensor"
        unique, n = name, 1
        while unique in self.tensors:
            n += 1
            unique = f"{name}#{n}"
        return unique

    def encode(self, value: Any, path: tuple[str, ...] = ()) -> Any:
        if isinstance(value, torch.Tensor):
            name = self._name(path)
            self.tensors[name] = value
            return {"__tensor__": name}
        if isinstance(value, np.ndarray) and value.dtype.kind in "fciub":
            name = self._name(path)
            self.tensors[name] = torch.from_numpy(np.ascontiguousarray(value))
            return {"__tensor__": name, "numpy": True}
        if value is None or isinstance(value, (bool, str, int)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": json_float(value)}
        if isinstance(value, np.generic):
            return self.encode(value.item(), path)
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value) and not _is_marker_dict(value):
                return {k: self.encode(v, path + (k,)) for k, v in value.items()}
            return {"__items__": [[self.encode(k), self.encode(v, path + (str(k),))] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, path + (str(i),)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, path + (str(i),)) for i, v in enumerate(value)]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # Read back as a plain dict: rebuilding the class would mean importing code named by the bundle.
            return {"__dataclass__": f"{type(value).__module__}.{type(value).__qualname__}",
                    "fields": {f.name: self.encode(getattr(value, f.name), path + (f.name,))
                               for f in dataclasses.fields(value)}}
        return {"__unstored__": f"{type(value).__module__}.{type(value).__qualname__}"}


def _decode_tree(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [_decode_tree(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton:
        t = tensors[skeleton["__tensor__"]]
        return t.numpy() if skeleton.get("numpy") else t
    if "__float__" in skeleton:
        return float(skeleton["__float__"])
    if "__tuple__" in skeleton:
        return tuple(_decode_tree(v, tensors) for v in skeleton["__tuple__"])
    if "__items__" in skeleton:
        return {_decode_tree(k, tensors): _decode_tree(v, tensors) for k, v in skeleton["__items__"]}
    if "__dataclass__" in skeleton:
        return {k: _decode_tree(v, tensors) for k, v in skeleton["fields"].items()}
    if "__unstored__" in skeleton:
        return None
    return {k: _decode_tree(v, tensors) for k, v in skeleton.items()}


def iter_batch_tensors(batch: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nested dict/list/tuple/dataclass batch; paths join keys, indices and
    field names with '.'.

    numpy arrays are viewed as tensors (no copy). A bare tensor has the path "batch".
    """
    if isinstance(batch, torch.Tensor):
        yield prefix or "batch", batch
    elif isinstance(batch, np.ndarray) and batch.dtype.kind in "fciub":
        yield prefix or "batch", tensor_from_numpy(prefix or "batch", batch)
    elif type(batch) is dict or isinstance(batch, Mapping):  # the abstract-class check is slow: dicts skip it
        for key, value in batch.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, torch.Tensor):  # the usual leaf, yielded here: the Monitor walks a batch per step
                yield path or "batch", value
            else:
                yield from iter_batch_tensors(value, path)
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            path = f"{prefix}.{i}" if prefix else str(i)
            if isinstance(value, torch.Tensor):
                yield path, value
            else:
                yield from iter_batch_tensors(value, path)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from iter_batch_tensors(getattr(batch, f.name), f"{prefix}.{f.name}" if prefix else f.name)


# -- safetensors ----------------------------------------------------------------------------------------------

def _for_saving(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no memory (safetensors refuses shared storage, e.g. tied weights)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.numel():
            if not t.is_contiguous() or t.untyped_storage().data_ptr() in seen:
                t = t.clone(memory_format=torch.contiguous_format)
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file(_for_saving(tensors), str(path), metadata=metadata)
    # safetensors creates its files 0600 whatever the umask: a bundle is evidence to share, like its JSON files
    os.chmod(path, FILE_MODE)


@contextlib.contextmanager
def _reading(path: str | Path) -> Iterator[None]:
    """Turn a structural surprise while decoding a bundle file (a missing key, a wrong type, an index out of range)
    into a BundleError naming the file, instead of a traceback from deep inside the decoder."""
    try:
        yield
    except BundleError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise BundleError(f"{path} does not hold what its manifest describes ({type(exc).__name__}: {exc}); the "
                          "bundle is damaged or was edited, ask for a fresh copy") from None


def read_json(path: Path, *, holder: str = "bundle", object_pairs_hook=None) -> Any:
    """A JSON file of a bundle (or bundle set, `holder`), or a BundleError naming it: bytes that are not UTF-8 or
    not JSON, nesting too deep for the parser, or a file that cannot be read."""
    try:
        return json.loads(path.read_bytes(), object_pairs_hook=object_pairs_hook)
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError and JSONDecodeError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise BundleError(f"{path} is not valid JSON ({reason}): the file is truncated, damaged or was edited; ask "
                          f"for a fresh copy of the {holder}") from None
    except OSError as exc:
        raise BundleError(f"{path} cannot be read ({exc}); check its permissions") from None


def refuse_link(path: Path, *, holder: str = "bundle") -> None:
    """A BundleError when `path` is a symbolic link: bundles and bundle sets hold plain files and directories only,
    and a link in one received from someone could make a reader show (or a note replace) a file anywhere."""
    if path.is_symlink():
        raise BundleError(f"{path} is a symbolic link: a {holder} holds plain files only, and a link could point "
                          f"outside it; do not use this {holder}, ask for a copy made without links")


def _load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise BundleError(f"{path}: cannot read it as safetensors ({exc}); the bundle is damaged, "
                          "ask for a fresh copy") from exc


# -- logs -----------------------------------------------------------------------------------------------------

def read_log_tail(path: str | os.PathLike) -> dict:
    """The end of a log file (last LOG_TAIL_LINES lines within LOG_TAIL_BYTES), or the reason it is unavailable."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - LOG_TAIL_BYTES)
            f.seek(start)
            data = f.read(LOG_TAIL_BYTES)
    except OSError as exc:
        return {"source": str(path), "data": None, "error": f"{type(exc).__name__}: {exc}"}
    if start > 0:
        data = data.split(b"\n", 1)[1] if b"\n" in data else data  # drop the partial first line
    lines = data.splitlines(keepends=True)
    return {"source": str(path), "data": b"".join(lines[-LOG_TAIL_LINES:]), "error": None, "bytes_total": size}


def _log_names(logs: Sequence[dict]) -> list[str]:
    names, used = [], set()
    for i, entry in enumerate(logs):
        base = re.sub(r"[^A-Za-z0-9._-]", "_", Path(entry["source"]).name).lstrip(".") or f"log{i}"
        name = base if base not in used else f"{i}-{base}"
        used.add(name)
        names.append(name)
    return names


# -- history --------------------------------------------------------------------------------------------------

def _history_payload(entries: Sequence[HistoryEntry]) -> tuple[dict[str, torch.Tensor], dict]:
    """Records of every entry stacked into one array; entries with the same tensor list share one layout."""
    layouts: list[dict] = []
    layout_index: dict[tuple, int] = {}
    rows, offsets, index_entries = [], [0], []
    for entry in entries:
        report = entry.report
        key = (tuple((t.name, t.dtype, t.device, t.numel, t.scanned_code) for t in report.tensors),
               tuple(report.skipped))
        if key not in layout_index:
            layout_index[key] = len(layouts)
            layouts.append({
                "names": [t.name for t in report.tensors], "dtypes": [t.dtype for t in report.tensors],
                "devices": [t.device for t in report.tensors], "numels": [t.numel for t in report.tensors],
                "scanned_codes": [t.scanned_code for t in report.tensors], "skipped": list(report.skipped),
            })
        rows.append(report.records)
        offsets.append(offsets[-1] + len(report.records))
        index_entries.append({"step": entry.step, "loss": json_float(entry.loss), "lr": json_float(entry.lr),
                              "grad_norm": json_float(entry.grad_norm), "layout": layout_index[key],
                              "backend": report.backend})
    records = np.concatenate(rows) if rows else L.empty_records(0)
    tensors = {"records": torch.from_numpy(np.ascontiguousarray(records)),
               "row_offsets": torch.tensor(offsets, dtype=torch.int64)}
    index = {"record_width": L.RECORD_WIDTH, "entries": index_entries, "layouts": layouts}
    return tensors, index


_JSON_FLOAT_STRINGS = ("nan", "inf", "-inf")


def _history_from_payload(tensors: Mapping[str, torch.Tensor], index: Mapping) -> list[HistoryEntry]:
    """HistoryEntries from the stored records and index; raises ValueError (or another structural error) for a
    payload the writer could not have produced, so a damaged file never yields plausible-looking statistics."""
    if not isinstance(index, dict):
        raise ValueError(f"{HISTORY_INDEX} holds a {type(index).__name__}, not an object")
    if index.get("record_width") != L.RECORD_WIDTH:
        raise BundleError(f"{HISTORY_INDEX}: records are {index.get('record_width')} slots wide, this nanscan "
                          f"reads {L.RECORD_WIDTH}; use the nanscan version that wrote the bundle")
    records, row_offsets = tensors["records"], tensors["row_offsets"]
    if records.dtype != torch.int64 or records.dim() != 2 or records.shape[1] != L.RECORD_WIDTH:
        raise ValueError(f"records are {records.dtype} {tuple(records.shape)}, expected int64 (n, {L.RECORD_WIDTH})")
    records = records.numpy()
    if (records[:, :L.REC_ABSMAX_BITS] < 0).any() or (records[:, L.REC_HIST:] < 0).any():
        raise ValueError("records hold negative counts")
    entries, layouts = index["entries"], index["layouts"]
    if row_offsets.dtype != torch.int64 or row_offsets.dim() != 1:
        raise ValueError(f"row_offsets are {row_offsets.dtype} {tuple(row_offsets.shape)}, expected int64 (n,)")
    offsets = row_offsets.tolist()
    if (len(offsets) != len(entries) + 1 or offsets[0] != 0 or offsets[-1] != len(records)
            or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"row_offsets {offsets[:4]}... do not split {len(records)} records into {len(entries)} steps")
    out = []
    for i, entry in enumerate(entries):
        if not _is_int(entry["layout"]) or not 0 <= entry["layout"] < len(layouts) or not _is_int(entry["step"]):
            raise ValueError(f"entry {i} has layout {entry['layout']!r} and step {entry['step']!r}")
        layout = layouts[entry["layout"]]
        columns = [layout[k] for k in ("names", "dtypes", "devices", "numels", "scanned_codes")]
        if len({len(c) for c in columns}) != 1 or any(code not in L.DTYPE_NAMES for code in layout["scanned_codes"]):
            raise ValueError(f"layout {entry['layout']} has columns of different lengths or unknown dtype codes")
        scanned = [ScannedTensor(*fields) for fields in zip(*columns)]
        values = [entry[k] for k in ("loss", "lr", "grad_norm")]
        if not all(v is None or _is_int(v) or isinstance(v, float) or v in _JSON_FLOAT_STRINGS for v in values):
            raise ValueError(f"entry {i} (step {entry['step']}) has loss, lr, grad_norm {values}")
        report = ScanReport(scanned, records[offsets[i]:offsets[i + 1]].copy(), skipped=layout["skipped"],
                            backend=entry["backend"], step=entry["step"])
        out.append(HistoryEntry(entry["step"], *map(float_from_json, values), report))
    return out


# -- INCIDENT.md ----------------------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (float, str)) and not isinstance(value, bool):
        try:
            return f"{float(value):.6g}"
        except ValueError:
            return str(value)
    return str(value)


def _source_line(source: Mapping) -> str:
    if source.get("kind") == "git":
        commit = source.get("commit") or "no commit yet"
        line = f"git `{commit[:12]}` in `{source.get('root')}`"
        if source.get("dirty"):
            line += (f", dirty ({source.get('changed_files', 0)} changed, {source.get('untracked_files', 0)} "
                     f"untracked; diff sha256 `{(source.get('diff_sha256') or 'none')[:16]}`)")
        return line
    return f"not a git work tree ({source.get('reason', 'unknown')}); nanscan {source.get('nanscan_version')}"


def render_incident(manifest: Mapping, ledger: Sequence[Mapping]) -> str:
    """INCIDENT.md from the manifest and the ledger: the same inputs always give the same text."""
    state = manifest.get("state") or {}
    if not state.get("file"):
        state_line = f"not stored ({state.get('note') or 'no model given'})"
    elif state.get("pre_step"):
        state_line = "model and optimizer state from before this step (snapshot)"
    else:
        note = f" ({state['note']})" if state.get("note") else ""
        state_line = f"model and optimizer state at the failing step{note}"
    lines = [
        f"# Incident: non-finite values at step {manifest['first_invalid_step']}",
        "",
        f"- run: `{manifest['run_id']}`",
        f"- category: **{manifest['category']}**",
        f"- detected: {manifest.get('detected_at', 'n/a')}",
        f"- source: {_source_line(manifest.get('source') or {})}",
        f"- config sha256: `{manifest.get('config_sha256') or 'no config given'}`",
        f"- state: {state_line}",
        f"- replay entry: `{manifest['replay_entry']}`" if manifest.get("replay_entry") else "- replay entry: none",
        "",
        f"Every file of this bundle is listed with its sha256 in {MANIFEST}. "
        "`nanscan report <this directory>` summarises it.",
        "",
        "## Automatic findings",
        "",
    ]
    for record in ledger:
        if record.get("kind") == "finding":
            lines += [f"<!-- nanscan:finding {record['key']} -->", f"### {record['title']}", "",
                      record["body"].rstrip(), ""]
    lines += ["## Reviewer notes", ""]
    notes = [r for r in ledger if r.get("kind") == "note"]
    if not notes:
        lines += ['_No notes yet: add one with `nanscan note <this directory> "text"`._', ""]
    for record in notes:
        author = " ".join(str(record.get("author") or "anonymous").split())
        lines += [f"<!-- nanscan:note {record['key']} -->", f"**{author}**, {record['at']}:", "",
                  *_quoted(record["text"]), ""]
    return "\n".join(lines)


# A '#' that could open a heading: at the start of a line, or after block-quote and list markers only.
_HEADING = re.compile(r"^((?:[ \t]*(?:>|[-+*]|\d{1,9}[.)])(?=[ \t]|$))*[ \t]*)(#)")
_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)\s*$")


def _quoted(text: str) -> list[str]:
    """A reviewer's text as a Markdown block quote in which no line can start a heading or hide an HTML comment,
    so a note can never pose as an "Automatic findings" section or as one of its markers."""
    out = []
    for line in text.rstrip().splitlines():
        line = _HEADING.sub(r"\1\\\2", line.replace("<!--", "&lt;!--"))
        if _SETEXT_UNDERLINE.match(line):  # would turn the line above into a heading
            line = "\\" + line.lstrip()
        out.append(f"> {line}".rstrip())
    return out


def _detect_finding(inc: Incident, nonfinite: list[dict]) -> dict:
    deciding = set(inc.tensors)
    culprits = [row for row in nonfinite if row["name"] in deciding]
    others = len(nonfinite) - len(culprits)
    shown = (culprits + [row for row in nonfinite if row["name"] not in deciding])[:20]
    body = [CATEGORY_EXPLANATIONS.get(inc.category, ""), "",
            f"Non-finite tensors deciding the category: {', '.join(f'`{n}`' for n in inc.tensors[:10])}"
            + (f" and {len(inc.tensors) - 10} more" if len(inc.tensors) > 10 else "")
            + (f"; {others} other tensor(s) were non-finite too." if others else "."), "",
            "| tensor | kind | NaN | +inf | -inf | elements |", "|---|---|---:|---:|---:|---:|"]
    body += [f"| `{r['name']}` | {r['kind']} | {r['nan']} | {r['posinf']} | {r['neginf']} | {r['numel']} |"
             for r in shown]
    if len(nonfinite) > len(shown):
        body.append(f"| ... {len(nonfinite) - len(shown)} more in {MANIFEST} | | | | | |")
    last = inc.history[-1] if inc.history and inc.history[-1].step == inc.step else None
    finite_before = [e for e in inc.history if e.step < inc.step and e.report.ok]
    body += ["", f"At this step: loss {_fmt(last.loss if last else None)}, learning rate "
                 f"{_fmt(last.lr if last else None)}, gradient norm {_fmt(last.grad_norm if last else None)}."]
    if finite_before:
        prev = finite_before[-1]
        body.append(f"Last finite step in the history: {prev.step} (loss {_fmt(prev.loss)}, "
                    f"gradient norm {_fmt(prev.grad_norm)}).")
    record = {"step": inc.step, "category": inc.category, "tensors": list(inc.tensors),
              "nonfinite_count": len(nonfinite)}
    return {"kind": "finding", "key": DETECT_FINDING,
            "title": f"First non-finite step: {inc.step} ({inc.category})",
            "body": "\n".join(body), "record": record, "at": inc.detected_at}


def _valid_ledger_record(record: Any) -> bool:
    """Whether a ledger line has the fields render_incident and the readers use, with their types."""
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        return False
    if record.get("kind") == "finding":
        return (isinstance(record.get("title"), str) and isinstance(record.get("body"), str)
                and isinstance(record.get("record", {}), dict))
    if record.get("kind") == "note":
        return (isinstance(record.get("text"), str) and isinstance(record.get("at"), str)
                and (record.get("author") is None or isinstance(record.get("author"), str)))
    return False


def _ledger_bytes(records: Sequence[Mapping]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n" for r in records)


# -- writing --------------------------------------------------------------------------------------------------

def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run_id {run_id!r} cannot name a directory: use 1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return run_id


def bundle_path(bundle_dir: str | os.PathLike, run_id: str, step: int, rank: int | None = None) -> Path:
    """Where the bundle of `run_id`'s incident at `step` lives (a distributed rank's part: `rank-<r>` below it)."""
    path = Path(bundle_dir) / check_run_id(run_id) / f"step-{int(step)}"
    return path if rank is None else path / f"rank-{int(rank)}"


def write_bundle(incident: Incident, bundle_dir: str | os.PathLike) -> Path:
    """Write the incident's bundle and return its path; keep (and validate) one that already exists.

    Two processes may write the same bundle at once: exactly one rename wins, the other keeps the winner's.
    Raises BundleError if a damaged or foreign directory already occupies the path.
    """
    final = bundle_path(bundle_dir, incident.run_id, incident.step, incident.rank)
    if final.exists():
        return _keep_existing(final, incident)
    try:
        with atomic_directory(final) as temp:
            _write_contents(temp, incident)
    except FileExistsError:
        return _keep_existing(final, incident)
    return final


def _keep_existing(final: Path, incident: Incident) -> Path:
    try:
        existing = load_bundle(final, whole_set=False)
    except BundleError as exc:
        raise BundleError(f"{final} already exists but is not a valid bundle ({exc}); move it away and run "
                          "again to write a fresh one") from exc
    if existing.manifest.get("detected_at") != incident.detected_at:
        log.warning("nanscan: %s already holds a bundle (detected %s); kept it. Use a new run_id to keep both.",
                    final, existing.manifest.get("detected_at"))
    return final


def _write_contents(root: Path, inc: Incident) -> None:
    """All files of the bundle into `root`, the manifest last (its presence marks a complete bundle)."""
    nonfinite = [{"name": s.name, "kind": tensor_kind(s.name), "dtype": s.dtype, "nan": s.nan,
                  "posinf": s.posinf, "neginf": s.neginf, "numel": s.numel}
                 for s in inc.report.stats if not s.ok]
    last = inc.history[-1] if inc.history and inc.history[-1].step == inc.step else None
    manifest: dict[str, Any] = {
        "schema": SCHEMA, "run_id": inc.run_id, "first_invalid_step": inc.step, "category": inc.category,
        "category_tensors": list(inc.tensors), "nonfinite_tensors": nonfinite, "detected_at": inc.detected_at,
        "loss": json_float(last.loss) if last else None, "lr": json_float(last.lr) if last else None,
        "grad_norm": json_float(last.grad_norm) if last else None,
        "source": _write_source(root, inc.source),
        "config": inc.config, "config_sha256": config_sha256(inc.config),
        "environment": inc.environment or {},
    }
    # User data (batch, state) may hold what safetensors cannot store: such a part is recorded as an error and
    # the rest of the evidence is still written.
    manifest["batch"] = _optional_part(root, BATCH, lambda: _write_batch(root, inc), sample_ids=_sample_ids(inc))
    manifest["rng"] = _optional_part(root, RNG, lambda: _write_rng(root, inc), captured_at=None)
    manifest["history"] = _write_history(root, inc.history)
    manifest["state"] = _optional_part(root, STATE, lambda: _write_state(root, inc), structure=None,
                                       pre_step=False, optimizer=False)
    manifest["logs"] = _write_logs(root, inc.logs)
    manifest["replay_entry"] = inc.replay_entry
    if inc.distributed is not None:
        manifest["distributed"] = plain_json(inc.distributed, "distributed")
    ledger = [_detect_finding(inc, nonfinite)]
    (root / LEDGER).write_bytes(_ledger_bytes(ledger))
    manifest["ledger"] = LEDGER
    manifest["incident"] = INCIDENT
    (root / INCIDENT).write_bytes(render_incident(manifest, ledger).encode("utf-8"))
    manifest["files"] = _hash_files(root)
    (root / MANIFEST).write_bytes(json_bytes(manifest))


def _optional_part(root: Path, file: str, write, **if_failed) -> dict:
    try:
        return write()
    except Exception as exc:  # noqa: BLE001 - recorded in the manifest; the other parts are still written
        for name in (file, file.replace(".safetensors", ".json")):
            (root / name).unlink(missing_ok=True)
        return {"file": None, **if_failed, "error": f"{type(exc).__name__}: {exc}"}


def _write_source(root: Path, source: SourceInfo | None) -> dict:
    if source is None:
        return {"kind": "unknown"}
    fields = source.to_dict()
    if source.diff is not None:
        (root / SOURCE_DIFF).write_bytes(source.diff)
        fields["diff_file"] = SOURCE_DIFF
    return fields


def _sample_ids(inc: Incident) -> Any:
    if inc.sample_ids is None:
        return None
    try:
        return plain_json(inc.sample_ids, "sample_ids")
    except TypeError:
        return [str(i) for i in inc.sample_ids] if isinstance(inc.sample_ids, (list, tuple)) else str(inc.sample_ids)


def _write_batch(root: Path, inc: Incident) -> dict:
    if inc.batch is None:
        return {"file": None, "sample_ids": _sample_ids(inc), "note": "no batch was passed to check()"}
    encoder = _TreeEncoder(".")
    structure = encoder.encode(inc.batch)
    _save_tensors(root / BATCH, encoder.tensors)
    return {
        "file": BATCH, "sha256": sha256_file(root / BATCH),
        "shapes": {k: list(t.shape) for k, t in encoder.tensors.items()},
        "dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in encoder.tensors.items()},
        "sample_ids": _sample_ids(inc), "structure": structure,
    }


def _write_rng(root: Path, inc: Incident) -> dict:
    if inc.rng is None:
        return {"file": None, "captured_at": None, "captured_at_by_source": {}}
    tensors, meta = rng_to_tensors(inc.rng)
    _save_tensors(root / RNG, tensors, {RNG_METADATA_KEY: json.dumps(meta, sort_keys=True)})
    # "captured_at" is the torch generators' (they drive dropout and other random ops inside the model).
    return {"file": RNG, "captured_at": inc.rng_captured_at.get("torch"),
            "captured_at_by_source": dict(inc.rng_captured_at)}


def _write_history(root: Path, history: Sequence[HistoryEntry]) -> dict:
    tensors, index = _history_payload(history)
    _save_tensors(root / HISTORY, tensors)
    (root / HISTORY_INDEX).write_bytes(json_bytes(index))
    return {"file": HISTORY, "index": HISTORY_INDEX, "entries": len(history), "steps": [e.step for e in history]}


def _write_state(root: Path, inc: Incident) -> dict:
    if inc.model_state is None:
        return {"file": None, "structure": None, "pre_step": False, "optimizer": False,
                "note": inc.state_note or "no model state was recorded"}
    encoder = _TreeEncoder("/")
    structure = {"model": encoder.encode(dict(inc.model_state), ("model",)),
                 "optimizer": (encoder.encode(inc.optimizer_state, ("optimizer",))
                               if inc.optimizer_state is not None else None)}
    _save_tensors(root / STATE, encoder.tensors)
    (root / STATE_STRUCTURE).write_bytes(json_bytes(structure))
    return {"file": STATE, "structure": STATE_STRUCTURE, "pre_step": inc.state_pre_step,
            "optimizer": inc.optimizer_state is not None, "note": inc.state_note}


def _write_logs(root: Path, logs: Sequence[dict]) -> list[dict]:
    out = []
    if logs:
        (root / LOGS).mkdir()
    for name, entry in zip(_log_names(logs), logs):
        if entry.get("data") is None:
            out.append({"source": entry["source"], "file": None, "error": entry.get("error")})
            continue
        (root / LOGS / name).write_bytes(entry["data"])
        out.append({"source": entry["source"], "file": f"{LOGS}/{name}", "bytes_total": entry.get("bytes_total")})
    return out


def _hash_files(root: Path) -> dict[str, dict]:
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST or any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return files


# -- validation and loading -----------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(path: Path, *, exclusive: bool) -> Iterator[None]:
    """A lock on the bundle directory itself (flock on its descriptor), so no lock file joins the bundle."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError:
            pass  # file systems without flock: proceed unlocked
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _safe_member(root: Path, name: str) -> Path:
    """A file named by the manifest, refused if the name could reach outside the bundle.

    Names are what the writer produces: relative POSIX paths without '.', '..', empty or hidden parts, so each file
    has exactly one name. No part may be a symbolic link: a received bundle could otherwise make a reader show (or a
    note replace) a file anywhere on this machine while every sha256 still matches."""
    parts = name.split("/") if isinstance(name, str) else []
    if (not parts or "\\" in name or "\0" in name
            or any(not part or part in (".", "..") or part.startswith(".") for part in parts)):
        raise BundleError(f"{root / MANIFEST} lists the file {name!r}, which is not a plain relative path (it is "
                          "absolute, uses '..', or is hidden or not normalised) and could point outside the bundle; "
                          "the manifest was tampered with, do not use this bundle")
    path = root
    for part in parts:
        path = path / part
        refuse_link(path)
    return path


# The only files an update replaces (Bundle._update_ledger); anything else under a pending name is not nanscan's.
_PENDING_NAMES = (LEDGER, INCIDENT, MANIFEST)


def _finish_pending(root: Path) -> None:
    """Complete or discard an update that was interrupted (see the module docstring). Call under the lock."""
    for leftover in root.glob(f"{TEMP_PREFIX}*"):
        if leftover.is_file() and not leftover.is_symlink():  # a temporary file of an atomic write killed half way
            leftover.unlink()
    pending = sorted(p for p in root.iterdir() if p.name.startswith(PENDING_PREFIX))
    if not pending:
        return
    for p in pending:
        # Renaming them would put a received directory or link (pointing anywhere) under a bundle file's name.
        if p.name[len(PENDING_PREFIX):] not in _PENDING_NAMES or p.is_symlink() or not p.is_file():
            raise BundleError(f"{p} is not part of an interrupted nanscan update (only plain files named "
                              f"{', '.join(PENDING_PREFIX + n for n in _PENDING_NAMES)} are); the bundle was "
                              "tampered with, do not use it")
    committed = root / f"{PENDING_PREFIX}{MANIFEST}"
    if committed.exists():
        for p in pending:
            if p != committed:
                os.replace(p, root / p.name[len(PENDING_PREFIX):])
        os.replace(committed, root / MANIFEST)
    else:
        for p in pending:
            p.unlink()
    fsync_dir(root)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        # json keeps the last value silently: a file listed twice could show one sha256 and check another
        raise ValueError(f"the key(s) {', '.join(map(repr, twice))} appear twice in one object")
    return dict(pairs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _manifest_type_errors(manifest: Mapping) -> list[str]:
    """Fields whose type the readers cannot use, each as 'name (what it should be)'."""
    def optional(value, kind) -> bool:
        return value is None or isinstance(value, kind)

    errors = [f"{key} ({what})" for key, ok, what in (
        ("run_id", isinstance(manifest["run_id"], str), "a string"),
        ("first_invalid_step", _is_int(manifest["first_invalid_step"]), "an integer"),
        ("category", isinstance(manifest["category"], str), "a string"),
        ("config", optional(manifest["config"], dict), "an object or null"),
        ("config_sha256", optional(manifest["config_sha256"], str), "a string or null"),
        ("environment", isinstance(manifest["environment"], dict), "an object"),
        ("replay_entry", optional(manifest["replay_entry"], str), "a string or null"),
        ("incident", isinstance(manifest["incident"], str), "a file name"),
        ("ledger", isinstance(manifest["ledger"], str), "a file name"),
        ("detected_at", optional(manifest.get("detected_at"), str), "a string or null"),
        ("distributed", optional(manifest.get("distributed"), dict), "an object"),
        ("category_tensors", isinstance(manifest.get("category_tensors", []), list)
         and all(isinstance(n, str) for n in manifest.get("category_tensors", [])), "a list of tensor names"),
    ) if not ok]
    errors += [f"{key} (an object)" for key in ("batch", "rng", "history", "state", "source")
               if not isinstance(manifest[key], dict)]
    if not errors:
        errors += [f"{part}.{key} (a file name or null)" for part, key in (
            ("batch", "file"), ("rng", "file"), ("history", "file"), ("history", "index"), ("state", "file"),
            ("state", "structure"), ("source", "diff_file")) if not optional(manifest[part].get(key), str)]
    rows = manifest["nonfinite_tensors"]
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("name"), str)
            and all(_is_int(r.get(k)) and r[k] >= 0 for k in ("nan", "posinf", "neginf", "numel")) for r in rows):
        errors.append("nonfinite_tensors (a list of {name, nan, posinf, neginf, numel} with counts)")
    logs = manifest.get("logs", [])
    if not isinstance(logs, list) or not all(
            isinstance(e, dict) and isinstance(e.get("source"), str) and optional(e.get("file"), str) for e in logs):
        errors.append("logs (a list of {source, file})")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
            and _is_int(e.get("bytes")) and e["bytes"] >= 0 for e in files.values()):
        errors.append("files (an object mapping each file name to its sha256 and bytes)")
    return errors


def _read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    refuse_link(path)
    if not path.is_file():
        raise BundleError(f"{root} has no {MANIFEST}: it is not a bundle, or a copy that lost its manifest")
    manifest = read_json(path, object_pairs_hook=_unique_keys)
    if not isinstance(manifest, dict) or "schema" not in manifest:
        raise BundleError(f"{path} has no 'schema' key: this is not a nanscan bundle")
    schema = manifest["schema"]
    if schema != SCHEMA:
        hint = ("it was written by another nanscan version; open it with that version"
                if isinstance(schema, str) and schema.startswith("nanscan.bundle/") else "this is not a nanscan bundle")
        raise BundleError(f"{path} has schema {schema!r}, this nanscan reads {SCHEMA!r}: {hint}")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise BundleError(f"{path} lacks {', '.join(missing)}: the manifest is incomplete or was edited; "
                          "ask for a fresh copy of the bundle")
    for name in manifest["files"] if isinstance(manifest["files"], dict) else ():
        _safe_member(root, name)  # a name reaching outside the bundle says more than any type error next to it
    wrong = _manifest_type_errors(manifest)
    if wrong:
        raise BundleError(f"{path}: wrong type for {'; '.join(wrong)}: the manifest was edited or damaged; "
                          "ask for a fresh copy of the bundle")
    return manifest


def _unlisted_files(root: Path, listed: Mapping[str, Any]) -> list[str]:
    """Files and links in the bundle that the manifest does not list (hidden names aside: the writer never lists
    them, and copies pick up some, like .DS_Store)."""
    unlisted = []
    for dirpath, dirnames, filenames in os.walk(root):  # links to directories are listed, not followed
        here = Path(dirpath)
        names = filenames + [d for d in dirnames if (here / d).is_symlink()]
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (here / d).is_symlink()]
        for name in names:
            rel = (here / name).relative_to(root).as_posix()
            if not name.startswith(".") and rel != MANIFEST and rel not in listed:
                unlisted.append(rel)
    return sorted(unlisted)


def _check_files(root: Path, manifest: Mapping, only: Sequence[str] | None = None) -> None:
    for name, entry in manifest["files"].items():
        if only is not None and name not in only:
            continue
        path = _safe_member(root, name)
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "is missing"
            raise BundleError(f"{path} {what}: the bundle is incomplete (copied partially?); "
                              "ask for the whole directory again")
        size, expected = path.stat().st_size, entry["bytes"]
        if size < expected:
            raise BundleError(f"{path} is truncated ({size} of {expected} bytes): the copy was cut short; "
                              "copy the bundle again")
        if sha256_file(path) != entry["sha256"]:
            raise BundleError(f"{path} does not match its sha256 in {MANIFEST}: it was modified after the bundle "
                              "was written; do not trust it, get an untouched copy (notes belong in "
                              "`nanscan note`, not in hand edits)")
    referenced = [manifest["incident"], manifest["ledger"], manifest["batch"].get("file"),
                  manifest["rng"].get("file"), manifest["history"].get("file"), manifest["history"].get("index"),
                  manifest["state"].get("file"), manifest["state"].get("structure"),
                  manifest["source"].get("diff_file"), *[e.get("file") for e in manifest.get("logs", [])]]
    for name in referenced:
        if name and name not in manifest["files"]:
            raise BundleError(f"{root / MANIFEST} refers to {name} but lists no sha256 for it; "
                              "the manifest was edited, do not use this bundle")
    if only is None:
        unlisted = _unlisted_files(root, manifest["files"])
        if unlisted:
            shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
            raise BundleError(f"{root} holds {shown}, which {MANIFEST} does not list: it was added after the bundle "
                              "was written and is not part of the evidence; move it out of the bundle directory "
                              "(reports and notes go elsewhere, or through `nanscan note`)")


def _validate(root: Path, only: Sequence[str] | None = None) -> dict:
    """The manifest, after checking the files (all, or those named in `only`) against it."""
    manifest = _read_manifest(root)
    _check_files(root, manifest, only)
    return manifest


def _resolve_bundle_dir(path: Path) -> Path:
    if not path.exists():
        raise BundleError(f"no bundle at {path}: the path does not exist (an interrupted write leaves only a "
                          "'.tmp-*' directory, which is not a bundle)")
    if not path.is_dir():
        raise BundleError(f"{path} is a file; pass a bundle directory (<bundle_dir>/<run_id>/step-<N>)")
    if is_temp_name(path.name):
        raise BundleError(f"{path} is an incomplete bundle left by an interrupted write; delete it and use the "
                          "finished bundle beside it (or write it again)")
    if (path / MANIFEST).exists() or any(p.name.startswith(PENDING_PREFIX) for p in path.iterdir()):
        return path
    steps = sorted((p for p in path.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)),
                   key=lambda p: int(_STEP_DIR.match(p.name).group(1)))
    if len(steps) == 1:
        return steps[0]
    if steps:
        raise BundleError(f"{path} holds {len(steps)} bundles ({', '.join(p.name for p in steps[:5])}); "
                          "pass one of them")
    temps = [p.name for p in path.iterdir() if is_temp_name(p.name)]
    extra = f" (only interrupted writes: {', '.join(temps[:3])})" if temps else ""
    raise BundleError(f"{path} is not a bundle: no {MANIFEST} and no step-<N> bundle inside{extra}")


def iter_bundles(bundle_dir: str | os.PathLike) -> Iterator[Path]:
    """Every finished bundle under `bundle_dir` (run directories, then step directories in step order).

    Temporary `.tmp-*` directories of interrupted writes are skipped. Nothing is validated here: load_bundle does.
    """
    root = Path(bundle_dir)
    if not root.is_dir():
        return
    for run in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        steps = [p for p in run.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / MANIFEST).exists()]
        yield from sorted(steps, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def load_bundle(path: str | os.PathLike, *, whole_set: bool = True) -> "Bundle":
    """Open and validate a bundle: its schema, and every file's presence, size and sha256.

    `path` is the step directory, or a run directory holding exactly one bundle. Raises BundleError, naming the
    file and what to do, for a missing, truncated, modified or foreign bundle.
    A distributed incident's set (a step directory with index.json and rank-<r> parts), or one part of it, opens
    as a nanscan.distributed.BundleSet covering every part; `whole_set=False` opens just the one part.
    """
    if whole_set:
        from nanscan.distributed import bundle_set_root, load_bundle_set  # noqa: PLC0415 - distributed imports this

        found = bundle_set_root(Path(path))
        if found is not None:
            return load_bundle_set(*found)
    root = _resolve_bundle_dir(Path(path))
    if any(p.name.startswith(PENDING_PREFIX) for p in root.iterdir()):
        if not os.access(root, os.W_OK):
            raise BundleError(f"{root} has an interrupted update ({PENDING_PREFIX}* files) and is read-only; "
                              "open it once where it is writable to finish the update")
        with _locked(root, exclusive=True):
            _finish_pending(root)
    with _locked(root, exclusive=False):
        manifest = _validate(root)
    return Bundle(root, manifest)


class Bundle:
    """A validated bundle. Files are read on demand; each accessor re-reads from disk."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest

    def __repr__(self) -> str:
        return (f"Bundle({str(self.path)!r}, step={self.step}, category={self.category!r}, "
                f"run_id={self.manifest['run_id']!r})")

    # -- what happened ----------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return int(self.manifest["first_invalid_step"])

    @property
    def category(self) -> str:
        return self.manifest["category"]

    @property
    def nonfinite_tensors(self) -> list[dict]:
        return list(self.manifest["nonfinite_tensors"])

    @property
    def config(self) -> dict | None:
        return self.manifest["config"]

    @property
    def replay_entry(self) -> str | None:
        return self.manifest["replay_entry"]

    def _member(self, name: str) -> Path:
        if name not in self.manifest["files"]:
            raise BundleError(f"{self.path / MANIFEST} does not list {name}")
        return _safe_member(self.path, name)

    def _tensors_with_json(self, tensors_name: str, json_name: str) -> tuple[dict[str, torch.Tensor], Any, str]:
        """A safetensors file and the JSON file that describes it, and how to name the pair in an error."""
        tensors_path, json_path = self._member(tensors_name), self._member(json_name)
        tensors, _ = _load_tensors(tensors_path)
        return tensors, read_json(json_path), f"{tensors_path} with {json_path.name}"

    # -- stored data ------------------------------------------------------------------------------------------
    def history(self) -> list[HistoryEntry]:
        """The Monitor's history up to and including the failing step, with rebuilt ScanReports."""
        info = self.manifest["history"]
        if not info.get("file") or not info.get("index"):
            raise BundleError(f"{self.path / MANIFEST} names no history files ({HISTORY}, {HISTORY_INDEX}); "
                              "the manifest was edited, ask for a fresh copy of the bundle")
        tensors, index, pair = self._tensors_with_json(info["file"], info["index"])
        with _reading(pair):
            return _history_from_payload(tensors, index)

    @property
    def batch_structure(self) -> Any:
        """The batch's nesting as JSON, tensors replaced by {"__tensor__": name}; None without a batch."""
        return self.manifest["batch"].get("structure")

    def batch(self, *, nested: bool = False) -> Any:
        """The failing step's batch: {flattened name: tensor} (names like "tokens" or "0.x"), or with
        `nested=True` the original structure of dicts, lists and tuples rebuilt. Empty dict / None without one."""
        info = self.manifest["batch"]
        if not info.get("file"):
            return None if nested else {}
        path = self._member(info["file"])
        tensors, _ = _load_tensors(path)
        if not nested:
            return tensors
        with _reading(f"{path} with the batch structure in {MANIFEST}"):
            return _decode_tree(info["structure"], tensors)

    @property
    def sample_ids(self) -> Any:
        return self.manifest["batch"].get("sample_ids")

    def state(self) -> tuple[dict[str, torch.Tensor], dict | None]:
        """(model state_dict, optimizer state_dict or None), ready for load_state_dict. See manifest['state']
        for whether it is the pre-step snapshot."""
        info = self.manifest["state"]
        if not info.get("file"):
            raise BundleError(f"{self.path} holds no model state ({info.get('note')}); "
                              "record one with Monitor(model, ...)")
        if not info.get("structure"):
            raise BundleError(f"{self.path / MANIFEST} names {info['file']} but no {STATE_STRUCTURE} for it; the "
                              "manifest was edited, ask for a fresh copy of the bundle")
        tensors, structure, pair = self._tensors_with_json(info["file"], info["structure"])
        with _reading(pair):
            model = _decode_tree(structure["model"], tensors)
            optimizer = structure.get("optimizer")
            optimizer = _decode_tree(optimizer, tensors) if optimizer is not None else None
        return model, optimizer

    def rng_state(self) -> dict | None:
        """RNG states as nanscan.provenance.capture_rng returns them, or None if none were recorded."""
        info = self.manifest["rng"]
        if not info.get("file"):
            return None
        path = self._member(info["file"])
        tensors, metadata = _load_tensors(path)
        try:
            meta = json.loads(metadata[RNG_METADATA_KEY])
        except (KeyError, json.JSONDecodeError) as exc:
            raise BundleError(f"{path} lacks its '{RNG_METADATA_KEY}' metadata; the bundle is damaged, ask for a "
                              "fresh copy") from exc
        with _reading(path):
            return rng_from_tensors(tensors, meta)

    def restore_rng(self) -> None:
        """Put this process's RNGs into the state recorded at the start of the failing step."""
        state = self.rng_state()
        if state is None:
            raise BundleError(f"{self.path} holds no RNG state")
        try:
            restore_rng(state)
        except ValueError as exc:
            raise BundleError(f"{self.path / self.manifest['rng']['file']}: {exc}") from None

    def log_tail(self, source_or_name: str) -> bytes:
        for entry in self.manifest.get("logs", []):
            if entry.get("file") and source_or_name in (entry["source"], entry["file"], Path(entry["file"]).name):
                return self._member(entry["file"]).read_bytes()
        raise KeyError(f"no log {source_or_name!r} in {self.path}")

    def incident_text(self) -> str:
        """INCIDENT.md; bytes that are not UTF-8 (which nanscan never writes) show as U+FFFD."""
        return self._member(self.manifest["incident"]).read_bytes().decode("utf-8", errors="replace")

    def ledger(self) -> list[dict]:
        """Findings and notes, in the order they were added."""
        path = self._member(self.manifest["ledger"])
        records = []
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise BundleError(f"{path}, line {number}: not a JSON record ({exc.__class__.__name__}); the bundle "
                                  "is damaged or was edited, ask for a fresh copy") from None
            if not _valid_ledger_record(record):
                raise BundleError(f"{path}, line {number}: not a finding or note record; the bundle is damaged or "
                                  "was edited, ask for a fresh copy")
            records.append(record)
        return records

    def findings(self) -> list[dict]:
        return [r for r in self.ledger() if r.get("kind") == "finding"]

    def notes(self) -> list[dict]:
        return [r for r in self.ledger() if r.get("kind") == "note"]

    # -- additions --------------------------------------------------------------------------------------------
    def add_finding(self, key: str, title: str, body_markdown: str, record: Mapping) -> bool:
        """Record an automatic finding (ledger.jsonl and INCIDENT.md's "Automatic findings").

        The same key is stored once: adding the same title and body again changes nothing (the first record is
        kept), a different title or body replaces the earlier finding in place. Returns True when the bundle changed.
        """
        if not isinstance(key, str) or not key.strip() or "\n" in key or "--" in key:
            raise ValueError(f"finding key {key!r} must be a non-empty single-line string without '--'")
        entry = {"kind": "finding", "key": key, "title": " ".join(str(title).split()),
                 "body": str(body_markdown), "record": plain_json(dict(record), "record"), "at": _now()}

        def update(ledger: list[dict]) -> list[dict] | None:
            for i, old in enumerate(ledger):
                if old.get("kind") == "finding" and old.get("key") == key:
                    # What a reader sees (title and body) decides whether the finding changed. The record is
                    # supporting data whose floats (a replayed loss, a gradient norm) may differ in the last bits
                    # between runs on a loaded machine; rewriting for those would break idempotent reruns.
                    if all(old.get(k) == entry[k] for k in ("title", "body")):
                        return None
                    return ledger[:i] + [entry] + ledger[i + 1:]
            return ledger + [entry]

        return self._update_ledger(update)

    def add_note(self, text: str, author: str | None = None) -> bool:
        """Append a reviewer note under "Reviewer notes". The same text is stored once. Returns True if added."""
        text = str(text).strip()
        if not text:
            raise ValueError("a note needs some text")
        key = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        if author is not None:
            author = " ".join(str(author).split()) or None  # a label: on one line, it cannot start a heading
        entry = {"kind": "note", "key": key, "text": text, "author": author, "at": _now()}

        def update(ledger: list[dict]) -> list[dict] | None:
            if any(r.get("kind") == "note" and r.get("key") == key for r in ledger):
                return None
            return ledger + [entry]

        return self._update_ledger(update)

    def _update_ledger(self, update) -> bool:
        try:
            return self._update_ledger_locked(update)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                hint = ("the bundle directory must be writable; copy the whole directory somewhere writable (cp -r) "
                        "and add to the copy")
            else:
                hint = "nothing was changed; fix the cause (disk space, file system) and add it again"
            raise BundleError(f"cannot update {self.path} ({exc}): {hint}") from None

    def _update_ledger_locked(self, update) -> bool:
        with _locked(self.path, exclusive=True):
            _finish_pending(self.path)
            # Under the lock, as another process may have added something; the files rewritten here are checked
            # again, the others were checked when the bundle was opened.
            manifest = _validate(self.path, only=(LEDGER, INCIDENT))
            self.manifest = manifest
            ledger = self.ledger()
            new_ledger = update(ledger)
            if new_ledger is None:
                return False
            contents = {LEDGER: _ledger_bytes(new_ledger),
                        INCIDENT: render_incident(manifest, new_ledger).encode("utf-8")}
            new_manifest = dict(manifest)
            new_manifest["files"] = dict(manifest["files"])
            for name, data in contents.items():
                new_manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            _commit(self.path, contents, json_bytes(new_manifest))
            self.manifest = new_manifest
            return True


def _commit(root: Path, contents: Mapping[str, bytes], manifest: bytes) -> None:
    """Replace files and the manifest as one step: pending files first, then the pending manifest (the commit
    point), then the renames. _finish_pending completes or discards an interrupted commit."""
    written = []
    try:
        for name, data in contents.items():
            written.append(atomic_write_bytes(root / f"{PENDING_PREFIX}{name}", data))
        atomic_write_bytes(root / f"{PENDING_PREFIX}{MANIFEST}", manifest)
    except BaseException:
        # Before the commit point: drop the pending files, so a read-only copy of this bundle (which cannot discard
        # them on opening) does not inherit an update that never happened.
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    _finish_pending(root)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- command line ---------------------------------------------------------------------------------------------

@click.command("note")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("text")
@click.option("--author", default=None, help="Who writes the note (default: the login name).")
def note_command(bundle: Path, text: str, author: str | None):
    """Add a reviewer note to BUNDLE's INCIDENT.md (under "Reviewer notes")."""
    if author is None:
        import getpass  # noqa: PLC0415

        with contextlib.suppress(Exception):
            author = getpass.getuser()
    try:
        opened = load_bundle(bundle)
        added = opened.add_note(text, author=author)
    except (BundleError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    where = opened.path / INCIDENT
    click.echo(f"note added to {where}" if added else f"the same note is already in {where}; nothing changed")
