"""Writing a bundle: atomically (a temporary `.tmp-*` directory renamed into place, manifest written last; one that
a killed writer left behind is removed by the next write of that bundle on the same host) and idempotently (an
existing valid bundle for the same run and step is kept as is).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

from nanscan._atomic import atomic_directory, json_bytes, sha256_file
from nanscan.bundle.format import (BATCH, HISTORY, HISTORY_INDEX, INCIDENT, LEDGER, LOG_TAIL_BYTES, LOG_TAIL_LINES,
                                   LOGS, MANIFEST, RNG, RNG_METADATA_KEY, SCHEMA, SOURCE_DIFF, STATE, STATE_STRUCTURE,
                                   BundleError, HistoryEntry, Incident, bundle_path, json_float, plain_json)
from nanscan.bundle.history import history_payload
from nanscan.bundle.incident_md import (detect_finding, ledger_bytes, mixed_precision_finding, render_incident,
                                        spike_finding, step_entry)
from nanscan.bundle.read import open_single
from nanscan.bundle.tree import TreeEncoder, save_tensors
from nanscan.incident import SPIKE, tensor_kind
from nanscan.provenance import SourceInfo, config_sha256, rng_to_tensors

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
        existing = open_single(final)
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
    last = step_entry(inc)
    manifest: dict[str, Any] = {
        "schema": SCHEMA, "run_id": inc.run_id, "first_invalid_step": inc.step, "category": inc.category,
        "category_tensors": list(inc.tensors), "nonfinite_tensors": nonfinite, "detected_at": inc.detected_at,
        "loss": json_float(last.loss) if last else None, "lr": json_float(last.lr) if last else None,
        "grad_norm": json_float(last.grad_norm) if last else None,
        "reason": inc.reason,
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
    manifest["spikes"] = plain_json(list(inc.spikes), "spikes")
    if inc.distributed is not None:
        manifest["distributed"] = plain_json(inc.distributed, "distributed")
    if inc.mixed_precision is not None:
        manifest["mixed_precision"] = plain_json(inc.mixed_precision, "mixed_precision")
    ledger = [spike_finding(inc) if inc.category == SPIKE else detect_finding(inc, nonfinite)]
    if inc.mixed_precision is not None:
        ledger.append(mixed_precision_finding(inc))
    (root / LEDGER).write_bytes(ledger_bytes(ledger))
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
    encoder = TreeEncoder(".")
    structure = encoder.encode(inc.batch)
    save_tensors(root / BATCH, encoder.tensors)
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
    save_tensors(root / RNG, tensors, {RNG_METADATA_KEY: json.dumps(meta, sort_keys=True)})
    # "captured_at" is the torch generators' (they drive dropout and other random ops inside the model).
    return {"file": RNG, "captured_at": inc.rng_captured_at.get("torch"),
            "captured_at_by_source": dict(inc.rng_captured_at)}


def _write_history(root: Path, history: Sequence[HistoryEntry]) -> dict:
    tensors, index = history_payload(history)
    save_tensors(root / HISTORY, tensors)
    (root / HISTORY_INDEX).write_bytes(json_bytes(index))
    return {"file": HISTORY, "index": HISTORY_INDEX, "entries": len(history), "steps": [e.step for e in history]}


def _write_state(root: Path, inc: Incident) -> dict:
    if inc.model_state is None:
        return {"file": None, "structure": None, "pre_step": False, "optimizer": False,
                "note": inc.state_note or "no model state was recorded"}
    encoder = TreeEncoder("/")
    structure = {"model": encoder.encode(dict(inc.model_state), ("model",)),
                 "optimizer": (encoder.encode(inc.optimizer_state, ("optimizer",))
                               if inc.optimizer_state is not None else None)}
    save_tensors(root / STATE, encoder.tensors)
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
