"""Reading a bundle back safely: validation before anything is read, the Bundle's accessors, and later additions.

Loading never runs code: tensors are safetensors, everything else JSON; `torch.load`/pickle is never used.
A bundle may come from anyone, so nothing in it is read before the manifest checks out: its fields have the types
the readers need, every file name is a plain relative path (no '..', no absolute or hidden names), no symbolic link
and no unlisted file sits in the directory, every listed file has its recorded size and sha256 (but
INCIDENT.md, which reviewers edit: its automatic part is compared with its rendering from the ledger, see
NOTE: [editable incident note]), and the digests the manifest holds about its own fields (config_sha256)
match them. Later additions (findings, notes) go through a small journal: new files are written under
`.pending-*` names and the new manifest's arrival is the commit point, so an interrupted update is either
finished or discarded the next time the bundle is opened.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from nanscan._atomic import TEMP_PREFIX, atomic_write_bytes, fsync_dir, is_temp_name, json_bytes, sha256_file
from nanscan.bundle.format import (HISTORY, HISTORY_INDEX, INCIDENT, LEDGER, MANIFEST, PENDING_PREFIX, REQUIRED_KEYS,
                                   RNG_METADATA_KEY, SCHEMA, STATE_STRUCTURE, STEP_DIR, BundleError, HistoryEntry,
                                   WindowStep, float_from_json, is_int, plain_json, read_json, refuse_link,
                                   step_dir_order)
from nanscan.bundle.frozen import reference_errors
from nanscan.bundle.history import history_from_payload
from nanscan.bundle.incident_md import NoteReview, ledger_bytes, render_incident, review_incident, valid_ledger_record
from nanscan.bundle.tree import decode_tree, load_tensors, reading_tensors
from nanscan.incident import SPIKE
from nanscan.bundle.provenance import config_sha256, restore_rng, rng_from_tensors

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: updates are then not serialised between processes
    fcntl = None

log = logging.getLogger("nanscan")

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


def _manifest_type_errors(manifest: Mapping) -> list[str]:
    """Fields whose type the readers cannot use, each as 'name (what it should be)'."""
    def optional(value, kind) -> bool:
        return value is None or isinstance(value, kind)

    errors = [f"{key} ({what})" for key, ok, what in (
        ("run_id", isinstance(manifest["run_id"], str), "a string"),
        ("first_invalid_step", is_int(manifest["first_invalid_step"]), "an integer"),
        ("category", isinstance(manifest["category"], str), "a string"),
        ("config", optional(manifest["config"], dict), "an object or null"),
        ("config_sha256", optional(manifest["config_sha256"], str), "a string or null"),
        ("environment", isinstance(manifest["environment"], dict), "an object"),
        ("replay_entry", optional(manifest["replay_entry"], str), "a string or null"),
        ("rerun", optional(manifest.get("rerun"), dict) and isinstance((manifest.get("rerun") or {}).get(
            "step_fn", ""), str), "an object naming its step_fn"),
        ("incident", isinstance(manifest["incident"], str), "a file name"),
        ("ledger", isinstance(manifest["ledger"], str), "a file name"),
        ("detected_at", optional(manifest.get("detected_at"), str), "a string or null"),
        ("distributed", optional(manifest.get("distributed"), dict), "an object"),
        ("reason", optional(manifest.get("reason"), str), "a string"),
        ("mixed_precision", optional(manifest.get("mixed_precision"), dict), "an object"),
        ("spikes", isinstance(manifest.get("spikes", []), list)
         and all(isinstance(s, dict) and is_int(s.get("step")) for s in manifest.get("spikes", [])),
         "a list of spikes, each with its step"),
        ("category_tensors", isinstance(manifest.get("category_tensors", []), list)
         and all(isinstance(n, str) for n in manifest.get("category_tensors", [])), "a list of tensor names"),
    ) if not ok]
    errors += [f"{key} (an object)" for key in ("batch", "rng", "history", "state", "source")
               if not isinstance(manifest[key], dict)]
    if not errors:
        errors += [f"{part}.{key} (a file name or null)" for part, key in (
            ("batch", "file"), ("rng", "file"), ("history", "file"), ("history", "index"), ("state", "file"),
            ("state", "structure"), ("source", "diff_file")) if not optional(manifest[part].get(key), str)]
        errors += reference_errors(manifest["state"].get("frozen"))
    errors += _window_type_errors(manifest.get("window"))
    rows = manifest["nonfinite_tensors"]
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("name"), str)
            and all(is_int(r.get(k)) and r[k] >= 0 for k in ("nan", "posinf", "neginf", "numel")) for r in rows):
        errors.append("nonfinite_tensors (a list of {name, nan, posinf, neginf, numel} with counts)")
    logs = manifest.get("logs", [])
    if not isinstance(logs, list) or not all(
            isinstance(e, dict) and isinstance(e.get("source"), str) and optional(e.get("file"), str) for e in logs):
        errors.append("logs (a list of {source, file})")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
            and is_int(e.get("bytes")) and e["bytes"] >= 0 for e in files.values()):
        errors.append("files (an object mapping each file name to its sha256 and bytes)")
    return errors


def _window_type_errors(window: Any) -> list[str]:
    """The window's fields (nanscan.runtime.window NOTE: [run window]) the readers cannot use; none without one."""
    if window is None:
        return []
    if not isinstance(window, dict):
        return ["window (an object)"]
    states = window.get("states")
    errors = [] if isinstance(states, list) and all(
        isinstance(e, dict) and is_int(e.get("step")) and isinstance(e.get("file"), str)
        and isinstance(e.get("structure"), str) for e in states) else \
        ["window.states (a list of {step, file, structure})"]
    errors += [f"window.{key} (a file name or null)" for key in ("file", "index")
               if not (window.get(key) is None or isinstance(window.get(key), str))]
    return errors


def window_files(window: Any) -> list[str]:
    """The files a manifest's window names (none without one)."""
    if not isinstance(window, dict):
        return []
    return [window.get("file"), window.get("index"),
            *[name for e in window.get("states") or () for name in (e["file"], e["structure"])]]


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
    stale = _stale_digests(manifest)
    if stale:
        raise BundleError(f"{path}: {'; '.join(stale)}: the manifest was edited after the bundle was written (replay "
                          "would use the edited values); do not use it, get an untouched copy (a changed config "
                          "is tried with `nanscan replay --entry` on the original bundle, or a new run)")
    return manifest


def _stale_digests(manifest: Mapping) -> list[str]:
    """The digests the manifest holds about its own fields that no longer match them: the config's, and the batch
    file's and source diff's, which must agree with the files list that _check_files verifies."""
    stale = []
    try:
        config_digest = config_sha256(manifest["config"])
    except ValueError:  # a NaN token, which nanscan never writes
        config_digest = None
    if config_digest != manifest["config_sha256"]:
        stale.append("config does not match config_sha256")
    files = manifest["files"]
    for part, file_key, digest_key in (("batch", "file", "sha256"), ("source", "diff_file", "diff_sha256")):
        name, digest = manifest[part].get(file_key), manifest[part].get(digest_key)
        if name and digest is not None and files.get(name, {}).get("sha256") != digest:
            stale.append(f"{part}.{digest_key} does not match the sha256 listed for {name}")
    return stale


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
        if name == manifest["incident"]:
            continue  # an edited note is compared with its rendering instead (NOTE: [editable incident note])
        size, expected = path.stat().st_size, entry["bytes"]
        if size < expected:
            raise BundleError(f"{path} is truncated ({size} of {expected} bytes): the copy was cut short; "
                              "copy the bundle again")
        if sha256_file(path) != entry["sha256"]:
            raise BundleError(f"{path} does not match its sha256 in {MANIFEST}: it was modified after the bundle "
                              f"was written; do not trust it, get an untouched copy (notes belong in {INCIDENT}'s "
                              "\"Reviewer notes\" or `nanscan note`)")
    referenced = [manifest["incident"], manifest["ledger"], manifest["batch"].get("file"),
                  manifest["rng"].get("file"), manifest["history"].get("file"), manifest["history"].get("index"),
                  manifest["state"].get("file"), manifest["state"].get("structure"),
                  manifest["source"].get("diff_file"), *[e.get("file") for e in manifest.get("logs", [])],
                  *window_files(manifest.get("window"))]
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
    steps = sorted((p for p in path.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_dir_order)
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
        steps = [p for p in run.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / MANIFEST).exists()]
        yield from sorted(steps, key=step_dir_order)


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
    def micro_batch(self) -> int | None:
        """The micro-batch of the step whose check found it (gradient accumulation), or None."""
        value = self.manifest.get("micro_batch")
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    @property
    def category(self) -> str:
        return self.manifest["category"]

    @property
    def spikes(self) -> list[dict]:
        """The run's spikes up to this bundle's step (nanscan.runtime.spikes.Spike.to_dict); [] from before spikes."""
        return list(self.manifest.get("spikes", []))

    @property
    def spike(self) -> dict | None:
        """A spike bundle's own spike (category "spike"), else None."""
        if self.category != SPIKE:
            return None
        return next((s for s in reversed(self.spikes) if s["step"] == self.step), None)

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
        tensors, _ = load_tensors(tensors_path)
        return tensors, read_json(json_path), f"{tensors_path} with {json_path.name}"

    # -- stored data ------------------------------------------------------------------------------------------
    def history(self) -> list[HistoryEntry]:
        """The Monitor's history up to and including the failing step, with rebuilt ScanReports."""
        info = self.manifest["history"]
        if not info.get("file") and info.get("error"):
            return []  # not written (NOTE: [write faults] in nanscan/bundle/write.py); the manifest says why
        if not info.get("file") or not info.get("index"):
            raise BundleError(f"{self.path / MANIFEST} names no history files ({HISTORY}, {HISTORY_INDEX}); "
                              "the manifest was edited, ask for a fresh copy of the bundle")
        tensors, index, pair = self._tensors_with_json(info["file"], info["index"])
        with reading_tensors(pair):
            return history_from_payload(tensors, index)

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
        tensors, _ = load_tensors(path)
        if not nested:
            return tensors
        with reading_tensors(f"{path} with the batch structure in {MANIFEST}"):
            return decode_tree(info["structure"], tensors)

    @property
    def sample_ids(self) -> Any:
        return self.manifest["batch"].get("sample_ids")

    def frozen_references(self) -> dict[str, dict]:
        """The frozen tensors this bundle holds by reference only ({state key: {dtype, shape, sha256}}), which
        state() leaves out: a replay takes them from the model its entry builds, checked against these
        (nanscan.bundle.frozen NOTE: [frozen references]). Empty when every tensor is stored."""
        return dict(self.manifest["state"].get("frozen") or {})

    def state(self) -> tuple[dict[str, torch.Tensor], dict | None]:
        """(model state_dict, optimizer state_dict or None), ready for load_state_dict, but for the frozen tensors
        held by reference (frozen_references()). See manifest['state'] for whether it is the pre-step snapshot."""
        info = self.manifest["state"]
        if not info.get("file"):
            raise BundleError(f"{self.path} holds no model state ({info.get('note')}); "
                              "record one with Monitor(model, ...)")
        if not info.get("structure"):
            raise BundleError(f"{self.path / MANIFEST} names {info['file']} but no {STATE_STRUCTURE} for it; the "
                              "manifest was edited, ask for a fresh copy of the bundle")
        tensors, structure, pair = self._tensors_with_json(info["file"], info["structure"])
        with reading_tensors(pair):
            model = decode_tree(structure["model"], tensors)
            optimizer = structure.get("optimizer")
            optimizer = decode_tree(optimizer, tensors) if optimizer is not None else None
        return model, optimizer

    # -- the run's window (nanscan.runtime.window NOTE: [run window]) ------------------------------------------------
    @property
    def window(self) -> dict | None:
        """The window's description (steps, every, states, records, span), None when the run kept no window or it
        could not be written (then manifest["window"]["error"] says why)."""
        info = self.manifest.get("window")
        return info if isinstance(info, dict) and info.get("file") else None

    def window_state(self, step: int) -> tuple[dict[str, torch.Tensor], dict | None]:
        """(model state, optimizer state or None) the window kept at `step`'s start: the model's frozen parameters
        are not in it (frozen_references() names them, state() does not hold them either)."""
        window = self._window_or_error()
        entry = next((e for e in window["states"] if e["step"] == step), None)
        if entry is None:
            raise BundleError(f"{self.path}'s window keeps no state at step {step}; it keeps "
                              f"{[e['step'] for e in window['states']] or 'none'}")
        tensors, structure, pair = self._tensors_with_json(entry["file"], entry["structure"])
        with reading_tensors(pair):
            model = decode_tree(structure["model"], tensors)
            optimizer = structure.get("optimizer")
            return model, (decode_tree(optimizer, tensors) if optimizer is not None else None)

    def window_records(self) -> list[WindowStep]:
        """Every check the window recorded, oldest first, its batch rebuilt as check() received it."""
        window = self._window_or_error()
        tensors, index, pair = self._tensors_with_json(window["file"], window["index"])
        with reading_tensors(pair):
            return [WindowStep(step=int(r["step"]), micro_batch=r.get("micro_batch"),
                               batch=decode_tree(r["batch"], tensors), sample_ids=r.get("sample_ids"),
                               lrs=[float_from_json(lr) for lr in r.get("lr") or ()],
                               loss_scale=float_from_json(r.get("loss_scale")), autocast=r.get("autocast"),
                               rng=decode_tree(r["rng"], tensors) if r.get("rng") is not None else None,
                               note=r.get("note"), loss=float_from_json(r.get("loss")),
                               update_factor=float_from_json(r.get("update_factor")))
                    for r in index["records"]]

    def _window_or_error(self) -> dict:
        window = self.window
        if window is None:
            info = self.manifest.get("window")
            why = info.get("error") if isinstance(info, dict) else None
            raise BundleError(f"{self.path} holds no window of the run"
                              + (f" (it could not be written: {why})" if why else
                                 " (the Monitor kept none: Monitor(window=...))"))
        return window

    def rng_state(self) -> dict | None:
        """RNG states as nanscan.bundle.provenance.capture_rng returns them, or None if none were recorded."""
        info = self.manifest["rng"]
        if not info.get("file"):
            return None
        path = self._member(info["file"])
        tensors, metadata = load_tensors(path)
        try:
            meta = json.loads(metadata[RNG_METADATA_KEY])
        except (KeyError, json.JSONDecodeError) as exc:
            raise BundleError(f"{path} lacks its '{RNG_METADATA_KEY}' metadata; the bundle is damaged, ask for a "
                              "fresh copy") from exc
        with reading_tensors(path):
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
            if not valid_ledger_record(record):
                raise BundleError(f"{path}, line {number}: not a finding or note record; the bundle is damaged or "
                                  "was edited, ask for a fresh copy")
            records.append(record)
        return records

    def note_review(self) -> NoteReview:
        """What INCIDENT.md holds beyond its rendering from the ledger: reviewer text typed by hand, and the
        automatic sections edited by hand (NOTE: [editable incident note]); `rebuild_note` renders them anew."""
        path = self._member(self.manifest["incident"])
        pinned = sha256_file(path) == self.manifest["files"][self.manifest["incident"]]["sha256"]
        return review_incident(self.incident_text(), self.manifest, self.ledger(), pinned=pinned)

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

    def rebuild_note(self) -> bool:
        """Render INCIDENT.md's automatic part again from the ledger, keeping the reviewer section; a hand edit of
        an automatic section is moved there, quoted, so nothing typed is lost. Returns True when the file changed."""
        return self._update_ledger(lambda ledger: None, rebuild=True)

    def _update_ledger(self, update, *, rebuild: bool = False) -> bool:
        try:
            return self._update_ledger_locked(update, rebuild)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                hint = ("the bundle directory must be writable; copy the whole directory somewhere writable (cp -r) "
                        "and add to the copy")
            else:
                hint = "nothing was changed; fix the cause (disk space, file system) and add it again"
            raise BundleError(f"cannot update {self.path} ({exc}): {hint}") from None

    def _update_ledger_locked(self, update, rebuild: bool) -> bool:
        with _locked(self.path, exclusive=True):
            _finish_pending(self.path)
            # Under the lock, as another process may have added something; the files rewritten here are checked
            # again, the others were checked when the bundle was opened.
            manifest = _validate(self.path, only=(LEDGER, INCIDENT))
            self.manifest = manifest
            ledger = self.ledger()
            new_ledger = update(ledger)
            if new_ledger is None and not rebuild:
                return False
            kept = self.note_review()
            note = render_incident(manifest, ledger if new_ledger is None else new_ledger, kept).encode("utf-8")
            if new_ledger is None and note == self._member(manifest["incident"]).read_bytes():
                return False
            for name in kept.edited:
                log.warning("nanscan: %s: %s was edited by hand; it is rendered again from the ledger and the edit "
                            "is kept, quoted, under \"Reviewer notes\"", self.path / INCIDENT, name)
            contents = {LEDGER: ledger_bytes(ledger if new_ledger is None else new_ledger), INCIDENT: note}
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



def open_single(path: str | os.PathLike) -> "Bundle":
    """Open and validate one bundle directory (a step directory, a run directory holding exactly one bundle, or one
    rank's part of a set), finishing an interrupted update first. nanscan.bundle.load_bundle also opens sets."""
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
