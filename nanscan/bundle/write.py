"""Writing a bundle: atomically (a temporary `.tmp-*` directory renamed into place, manifest written last; one that
a killed writer left behind is removed by the next write of that bundle on the same host) and idempotently (an
existing valid bundle for the same run and step is kept as is, unless a write error left it incomplete).

NOTE: [write faults]
A bundle is written in parts. The optional ones (source diff, batch, RNG states, history, state, logs) may fail on
their own (a full disk, an I/O error, a tensor safetensors cannot store): the part's files are removed, the
manifest records the error under the part and in `write_errors`, INCIDENT.md says what is missing and why, and the
rest is still written. The core (ledger, INCIDENT.md, manifest, then fsync and the rename) cannot: when it fails,
nothing is renamed into place, and the write is tried once more with the core alone (on a nearly full disk the
parts used the space); when that fails too, BundleWriteError says where and why and what to do. A later write of
the same incident replaces a bundle that write errors left incomplete, as long as no one has added to it since.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

from nanscan._atomic import atomic_directory, atomic_write_bytes, atomic_write_with, json_bytes, sha256_file
from nanscan.bundle.format import (DETECT_FINDING, BATCH, HISTORY, HISTORY_INDEX, INCIDENT, LEDGER, LOG_TAIL_BYTES, LOG_TAIL_LINES,
                                   LOGS, MANIFEST, RNG, RNG_METADATA_KEY, SCHEMA, SOURCE_DIFF, STATE, STATE_STRUCTURE,
                                   WINDOW, WINDOW_STEPS, WINDOW_STEPS_INDEX, BundleError, HistoryEntry, Incident,
                                   RunWindow, bundle_path, json_float, plain_json)
from nanscan.bundle.frozen import split_frozen
from nanscan.bundle.history import history_payload
from nanscan.bundle.divergence import DIVERGENCE_FINDING
from nanscan.bundle.incident_md import (MIXED_PRECISION_FINDING, detect_finding, divergence_finding, ledger_bytes,
                                        mixed_precision_finding, render_incident, spike_finding, step_entry,
                                        unsaved_lines)
from nanscan.bundle.read import open_single
from nanscan.bundle.tree import TreeEncoder, save_tensors
from nanscan.incident import SPIKE, tensor_kind
from nanscan.bundle.provenance import SourceInfo, config_sha256, rng_to_tensors

log = logging.getLogger("nanscan")


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


class BundleWriteError(BundleError, OSError):
    """No bundle could be written (NOTE: [write faults]): the message names the directory, the cause and what to
    do. An OSError too, so code that catches file-system errors catches it."""


class BundleFiles:
    """The one way a file enters a bundle being written (NOTE: [write faults]): bytes, tensors or a finished file,
    by name."""

    def __init__(self, root: Path):
        self.root = root

    def write_bytes(self, name: str, data: bytes) -> None:
        (self.root / name).write_bytes(data)

    def write_tensors(self, name: str, tensors: Any, metadata: dict[str, str] | None = None) -> None:
        save_tensors(self.root / name, tensors, metadata)

    def take_file(self, name: str, source: str | os.PathLike) -> None:
        """A finished file from elsewhere (a state the window spilled): hard-linked where the file system allows
        (its writer only ever replaces, never rewrites, a file), else copied."""
        try:
            os.link(source, self.root / name)
        except OSError:
            shutil.copyfile(source, self.root / name)


def write_bundle(incident: Incident, bundle_dir: str | os.PathLike) -> Path:
    """Write the incident's bundle and return its path; keep (and validate) one that already exists.

    Two processes may write the same bundle at once: exactly one rename wins, the other keeps the winner's.
    Raises BundleError if a damaged or foreign directory already occupies the path, BundleWriteError when no
    bundle could be written (NOTE: [write faults]); unsaved_parts(path) lists what a written one lacks.
    """
    final = bundle_path(bundle_dir, incident.run_id, incident.step, incident.rank, incident.attempt)
    replace = False
    if final.exists():
        if not _replaceable(final, incident):
            return final
        replace = True
    try:
        return _write_at(final, incident, replace=replace)
    except FileExistsError:
        return _keep_existing(final, incident)
    except OSError as exc:
        failed = exc
    log.warning("nanscan: writing the bundle %s failed (%s: %s); writing its core alone (manifest, ledger, "
                "INCIDENT.md)", final, type(failed).__name__, failed)
    try:
        return _write_at(final, incident, replace=replace, core_only=f"{type(failed).__name__}: {failed}")
    except FileExistsError:
        return _keep_existing(final, incident)
    except OSError as exc:
        raise BundleWriteError(exc.errno, _write_failure(final, exc, failed)) from exc


def _write_failure(final: Path, exc: OSError, first: OSError) -> str:
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        todo = ("the directory is not writable: give a writable one (Monitor(bundle_dir=...), or the "
                "NANSCAN_BUNDLE_DIR environment variable)")
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = "the disk is full: free space there or give another directory (Monitor(bundle_dir=...))"
    else:
        todo = "check the file system (an I/O error), or give another directory (Monitor(bundle_dir=...))"
    again = "" if exc is first else f"; the full bundle had failed first ({type(first).__name__}: {first})"
    return (f"no evidence bundle could be written at {final} ({type(exc).__name__}: {exc}){again}; nothing "
            f"partial was left there; {todo}")


def _write_at(final: Path, incident: Incident, *, replace: bool, core_only: str | None = None) -> Path:
    with atomic_directory(final, replace=replace) as temp:
        _write_contents(BundleFiles(temp), incident, core_only=core_only)
    return final


def unsaved_parts(path: str | os.PathLike) -> list[str]:
    """What a written bundle lacks because a write failed (NOTE: [write faults]), as "part: error" lines."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return []
    return unsaved_lines(manifest.get("write_errors") if isinstance(manifest, dict) else None)


def _replaceable(final: Path, incident: Incident) -> bool:
    """Whether the bundle at `final` is one that write errors left incomplete and that no one has added to since
    (a note, a finding, a hand edit), so a new write of the same incident may replace it; else it is kept."""
    existing = _open_existing(final)
    if existing.manifest.get("write_errors"):
        created = {DETECT_FINDING, DIVERGENCE_FINDING, MIXED_PRECISION_FINDING}
        if not (existing.notes() or existing.note_review().hand_written
                or any(f.get("key") not in created for f in existing.findings())):
            return True
        log.warning("nanscan: %s is incomplete (%s) but was added to since; kept it", final,
                    "; ".join(unsaved_parts(final)))
    _kept(final, existing, incident)
    return False


def _keep_existing(final: Path, incident: Incident) -> Path:
    _kept(final, _open_existing(final), incident)
    return final


def _open_existing(final: Path):
    try:
        return open_single(final)
    except BundleError as exc:
        raise BundleError(f"{final} already exists but is not a valid bundle ({exc}); move it away and run "
                          "again to write a fresh one") from exc


def _kept(final: Path, existing, incident: Incident) -> None:
    if existing.manifest.get("detected_at") != incident.detected_at:
        log.warning("nanscan: %s already holds a bundle (detected %s); kept it. Use a new run_id to keep both.",
                    final, existing.manifest.get("detected_at"))


def _write_contents(files: BundleFiles, inc: Incident, *, core_only: str | None = None) -> None:
    """All files of the bundle, the manifest last (its presence marks a complete bundle). core_only: why the
    optional parts are left out (NOTE: [write faults])."""
    root = files.root
    nonfinite = [{"name": s.name, "kind": tensor_kind(s.name), "dtype": s.dtype, "nan": s.nan,
                  "posinf": s.posinf, "neginf": s.neginf, "numel": s.numel}
                 for s in inc.report.stats if not s.ok]
    last = step_entry(inc)
    errors: list[dict] = []
    part = _Parts(root, errors, core_only)
    manifest: dict[str, Any] = {
        "schema": SCHEMA, "run_id": inc.run_id, "first_invalid_step": inc.step, "category": inc.category,
        "category_tensors": list(inc.tensors), "nonfinite_tensors": nonfinite, "detected_at": inc.detected_at,
        "loss": json_float(last.loss) if last else None, "lr": json_float(last.lr) if last else None,
        "grad_norm": json_float(last.grad_norm) if last else None,
        "reason": inc.reason,
        "source": _write_source(files, inc.source, part),
        "config": inc.config, "config_sha256": config_sha256(inc.config),
        "environment": inc.environment or {},
    }
    # User data (batch, state) may hold what safetensors cannot store, and any part may meet a full disk: such a
    # part is recorded as an error and the rest of the evidence is still written.
    manifest["batch"] = part("batch", (BATCH,), lambda: _write_batch(files, inc), sample_ids=_sample_ids(inc))
    manifest["rng"] = part("rng", (RNG,), lambda: _write_rng(files, inc), captured_at=None)
    manifest["history"] = part("history", (HISTORY, HISTORY_INDEX), lambda: _write_history(files, inc.history),
                               index=None, entries=0, steps=[])
    manifest["state"] = part("state", (STATE, STATE_STRUCTURE), lambda: _write_state(files, inc), structure=None,
                             pre_step=False, optimizer=False)
    manifest["logs"] = part("logs", (LOGS,), lambda: _write_logs(files, inc.logs), as_list=True)
    if inc.window is not None:
        manifest["window"] = part("window", (WINDOW,), lambda: _write_window(files, inc.window), states=[],
                                  index=None, records=0, span=None)
    manifest["replay_entry"] = inc.replay_entry
    if inc.rerun is not None:
        manifest["rerun"] = plain_json(dict(inc.rerun), "rerun")
    manifest["spikes"] = plain_json(list(inc.spikes), "spikes")
    if inc.distributed is not None:
        manifest["distributed"] = plain_json(inc.distributed, "distributed")
    if inc.mixed_precision is not None:
        manifest["mixed_precision"] = plain_json(inc.mixed_precision, "mixed_precision")
    if inc.micro_batch is not None:
        manifest["micro_batch"] = int(inc.micro_batch)
        if inc.micro_batch_observed:
            manifest["micro_batch_observed"] = True
    if errors:
        manifest["write_errors"] = errors
    ledger = [spike_finding(inc) if inc.category == SPIKE else detect_finding(inc, nonfinite)]
    diverged = _divergence(inc)
    if diverged is not None:
        ledger.append(diverged)
    if inc.mixed_precision is not None:
        ledger.append(mixed_precision_finding(inc))
    files.write_bytes(LEDGER, ledger_bytes(ledger))
    manifest["ledger"] = LEDGER
    manifest["incident"] = INCIDENT
    files.write_bytes(INCIDENT, render_incident(manifest, ledger).encode("utf-8"))
    manifest["files"] = _hash_files(root)
    files.write_bytes(MANIFEST, json_bytes(manifest))


def _divergence(inc: Incident) -> dict | None:
    """The divergence finding (NOTE: [divergence onset] in nanscan.bundle.divergence), or None: where no tensor grew,
    and where the analysis failed, which is logged; an analysis is never a reason to lose the core of the bundle
    (NOTE: [write faults])."""
    try:
        return divergence_finding(inc)
    except Exception as exc:  # noqa: BLE001 - logged; the ledger keeps the detection
        log.warning("nanscan: the divergence before step %s could not be worked out (%s: %s); the bundle is written "
                    "without it", inc.step, type(exc).__name__, exc)
        return None


class _Parts:
    """Writes one optional part, or records why it is missing (NOTE: [write faults])."""

    def __init__(self, root: Path, errors: list[dict], core_only: str | None):
        self.root, self.errors, self.core_only = root, errors, core_only

    def __call__(self, name: str, paths: Sequence[str], write, *, as_list: bool = False, **if_failed) -> Any:
        if self.core_only is not None:
            error = f"not written: the whole bundle failed first ({self.core_only}), so only its core was kept"
        else:
            try:
                return write()
            except Exception as exc:  # noqa: BLE001 - recorded in the manifest; the other parts are still written
                error = f"{type(exc).__name__}: {exc}"
                for path in paths:
                    target = self.root / path
                    if target.is_dir():
                        shutil.rmtree(target, ignore_errors=True)
                    else:
                        target.unlink(missing_ok=True)
        self.errors.append({"part": name, "error": error})
        return [] if as_list else {"file": None, **if_failed, "error": error}


def _write_source(files: BundleFiles, source: SourceInfo | None, part: _Parts) -> dict:
    if source is None:
        return {"kind": "unknown"}
    fields = source.to_dict()
    if source.diff is not None:
        def write() -> dict:
            files.write_bytes(SOURCE_DIFF, source.diff)
            return {"diff_file": SOURCE_DIFF}

        written = part("source_diff", (SOURCE_DIFF,), write)
        if written.get("diff_file"):
            fields["diff_file"] = SOURCE_DIFF
        else:
            fields["diff_error"] = written["error"]
    return fields


def _sample_ids(inc: Incident) -> Any:
    return _json_ids(inc.sample_ids)


def _json_ids(ids: Any) -> Any:
    """Sample ids as JSON: as they are where JSON holds them, else as strings."""
    if ids is None:
        return None
    try:
        return plain_json(ids, "sample_ids")
    except TypeError:
        return [str(i) for i in ids] if isinstance(ids, (list, tuple)) else str(ids)


def _write_batch(files: BundleFiles, inc: Incident) -> dict:
    if inc.batch is None:
        return {"file": None, "sample_ids": _sample_ids(inc), "note": "no batch was passed to check()"}
    encoder = TreeEncoder(".")
    structure = encoder.encode(inc.batch)
    files.write_tensors(BATCH, encoder.tensors)
    return {
        "file": BATCH, "sha256": sha256_file(files.root / BATCH),
        "shapes": {k: list(t.shape) for k, t in encoder.tensors.items()},
        "dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in encoder.tensors.items()},
        "sample_ids": _sample_ids(inc), "structure": structure,
    }


def _write_rng(files: BundleFiles, inc: Incident) -> dict:
    if inc.rng is None:
        return {"file": None, "captured_at": None, "captured_at_by_source": {}}
    tensors, meta = rng_to_tensors(inc.rng)
    files.write_tensors(RNG, tensors, {RNG_METADATA_KEY: json.dumps(meta, sort_keys=True)})
    # "captured_at" is the torch generators' (they drive dropout and other random ops inside the model).
    return {"file": RNG, "captured_at": inc.rng_captured_at.get("torch"),
            "captured_at_by_source": dict(inc.rng_captured_at)}


def _write_history(files: BundleFiles, history: Sequence[HistoryEntry]) -> dict:
    tensors, index = history_payload(history)
    files.write_tensors(HISTORY, tensors)
    files.write_bytes(HISTORY_INDEX, json_bytes(index))
    return {"file": HISTORY, "index": HISTORY_INDEX, "entries": len(history), "steps": [e.step for e in history]}


def _write_state(files: BundleFiles, inc: Incident) -> dict:
    if inc.model_state is None:
        return {"file": None, "structure": None, "pre_step": False, "optimizer": False,
                "note": inc.state_note or "no model state was recorded"}
    model_state, frozen = dict(inc.model_state), {}
    if inc.frozen and inc.distributed is None:  # NOTE: [frozen references]: a rank's shards are kept whole
        model_state, frozen = split_frozen(model_state, inc.frozen)
    _write_state_files(files, STATE, STATE_STRUCTURE, model_state, inc.optimizer_state)
    written = {"file": STATE, "structure": STATE_STRUCTURE, "pre_step": inc.state_pre_step,
               "optimizer": inc.optimizer_state is not None, "note": inc.state_note,
               "optimizer_params": [list(group) for group in inc.optimizer_params]
               if inc.optimizer_params is not None else None}
    if frozen:
        written["frozen"] = frozen
    return written


def _state_payload(model_state: Any, optimizer_state: Any) -> tuple[dict, bytes]:
    """A model and optimizer state as the tensors of a safetensors file and the JSON of its structure."""
    encoder = TreeEncoder("/")
    structure = {"model": encoder.encode(model_state, ("model",)),
                 "optimizer": (encoder.encode(optimizer_state, ("optimizer",))
                               if optimizer_state is not None else None)}
    return encoder.tensors, json_bytes(structure)


def _write_state_files(files: BundleFiles, tensors_name: str, structure_name: str, model_state: Any,
                       optimizer_state: Any) -> None:
    """A model and optimizer state as a safetensors file and the JSON of its structure (state.*, the window's)."""
    tensors, structure = _state_payload(model_state, optimizer_state)
    files.write_tensors(tensors_name, tensors)
    files.write_bytes(structure_name, structure)


def save_state_files(tensors_path: Path, structure_path: Path, model_state: Any, optimizer_state: Any) -> None:
    """The same two files outside a bundle, each written atomically (a state the window spills to its directory,
    which a bundle then takes as they are: WindowState.files)."""
    tensors, structure = _state_payload(model_state, optimizer_state)
    atomic_write_with(tensors_path, lambda temp: save_tensors(temp, tensors))
    atomic_write_bytes(structure_path, structure)


def _write_window(files: BundleFiles, window: RunWindow | None) -> dict | None:
    """The run's window (nanscan.runtime.window NOTE: [run window]): each kept state as state.* is written, and every
    recorded step's batch and torch RNG state in one safetensors file, indexed by a JSON file."""
    if window is None:
        return None
    (files.root / WINDOW).mkdir()
    states = []
    for kept in window.states:
        name = f"{WINDOW}/state-{int(kept.step)}"
        if kept.files is not None:  # spilled to the window's directory in this format: taken as it is
            files.take_file(f"{name}.safetensors", kept.files[0])
            files.take_file(f"{name}.json", kept.files[1])
            has_optimizer = bool(kept.has_optimizer)
        else:
            _write_state_files(files, f"{name}.safetensors", f"{name}.json", kept.model_state, kept.optimizer_state)
            has_optimizer = kept.optimizer_state is not None
        states.append({"step": int(kept.step), "file": f"{name}.safetensors", "structure": f"{name}.json",
                       "pre_step": bool(kept.pre_step), "optimizer": has_optimizer})
    encoder = TreeEncoder(".")
    records = [{"step": int(r.step), "micro_batch": r.micro_batch, "batch": encoder.encode(r.batch, (str(i), "batch")),
                "sample_ids": _json_ids(r.sample_ids), "lr": [json_float(lr) for lr in r.lrs],
                "loss_scale": json_float(r.loss_scale), "autocast": plain_json(r.autocast, "autocast"),
                "rng": encoder.encode(r.rng, (str(i), "rng")) if r.rng is not None else None, "note": r.note,
                "loss": json_float(r.loss), "update_factor": json_float(r.update_factor)}
               for i, r in enumerate(window.records)]
    files.write_tensors(WINDOW_STEPS, encoder.tensors)
    files.write_bytes(WINDOW_STEPS_INDEX, json_bytes({"records": records}))
    steps = [r["step"] for r in records]
    return {"dir": WINDOW, "steps": int(window.steps), "every": int(window.every), "states": states,
            "file": WINDOW_STEPS, "index": WINDOW_STEPS_INDEX, "records": len(records),
            "span": [min(steps), max(steps)] if steps else None}


def _write_logs(files: BundleFiles, logs: Sequence[dict]) -> list[dict]:
    out = []
    if logs:
        (files.root / LOGS).mkdir()
    for name, entry in zip(_log_names(logs), logs):
        if entry.get("data") is None:
            out.append({"source": entry["source"], "file": None, "error": entry.get("error")})
            continue
        files.write_bytes(f"{LOGS}/{name}", entry["data"])
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
