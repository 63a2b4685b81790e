"""Writes survive faults (NOTE: [write faults] in nanscan/bundle/write.py): ENOSPC and EIO at each file of a bundle,
at fsync, in the ledger and note updates and the exports; a real full disk and a read-only directory (tmpfs mounts,
skipped where mounting is not allowed); two processes writing the same run and step; a writer killed with SIGKILL
at random points. In each, the training process gets its NonFiniteError saying what was saved and what was not, no
partial bundle looks whole, a later retry writes a complete bundle, and INCIDENT.md says why a part is missing."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import nanscan
import nanscan._atomic as atomic
import nanscan.bundle.read as bundle_read
from fault_writer import train
from nanscan.bundle import BundleError, load_bundle
from nanscan.bundle.format import (BATCH, HISTORY, HISTORY_INDEX, INCIDENT, LEDGER, LOGS, MANIFEST, RNG, STATE,
                                   STATE_STRUCTURE, WINDOW_STEPS, WINDOW_STEPS_INDEX)
from nanscan.bundle.write import BundleFiles
from nanscan.cli.main import main

WRITER = Path(__file__).resolve().parent / "fault_writer.py"
ERRORS = {errno.ENOSPC: "No space left on device", errno.EIO: "Input/output error"}
# file -> the manifest part it belongs to; None: the core, without which no bundle is renamed into place
# (the window's: its state kept at step 0, the run's first, and its steps; nanscan.runtime.window)
FILES = {BATCH: "batch", RNG: "rng", HISTORY: "history", HISTORY_INDEX: "history", STATE: "state",
         STATE_STRUCTURE: "state", f"{LOGS}/train.log": "logs", "window/state-0.safetensors": "window",
         "window/state-0.json": "window", WINDOW_STEPS: "window", WINDOW_STEPS_INDEX: "window", LEDGER: None,
         INCIDENT: None, MANIFEST: None}


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(f"{atomic.TEMP_PREFIX}*"))


def _log(tmp_path: Path) -> Path:
    path = tmp_path / "train.log"
    path.write_text("step 0 ok\nstep 1 ok\n")
    return path


@contextlib.contextmanager
def _failing(monkeypatch, name: str, code: int, times: int | None = None):
    """Every write of the bundle file `name` raises OSError(code) (the first `times` writes, when given)."""
    calls = {"n": 0}

    def guard(method):
        def wrapper(self, file, *args, **kwargs):
            if file == name and (times is None or calls["n"] < times):
                calls["n"] += 1
                raise OSError(code, os.strerror(code), str(self.root / file))
            return method(self, file, *args, **kwargs)
        return wrapper

    with monkeypatch.context() as m:
        m.setattr(BundleFiles, "write_bytes", guard(BundleFiles.write_bytes))
        m.setattr(BundleFiles, "write_tensors", guard(BundleFiles.write_tensors))
        yield calls


def _complete(path: Path) -> None:
    bundle = load_bundle(path)
    assert not bundle.manifest.get("write_errors"), bundle.manifest.get("write_errors")
    assert bundle.manifest["state"]["file"] and bundle.manifest["batch"]["file"] and bundle.history()
    assert bundle.window is not None and bundle.window_records()
    assert "not saved" not in (path / INCIDENT).read_text()


@pytest.mark.parametrize("code", sorted(ERRORS))
@pytest.mark.parametrize("name", [n for n, part in FILES.items() if part is not None])
def test_a_part_that_cannot_be_written_is_named_and_the_rest_is_kept(tmp_path, monkeypatch, name, code):
    log_file = _log(tmp_path)
    with _failing(monkeypatch, name, code):
        error = train(tmp_path / "b", "r", log_file=log_file)
    part = FILES[name]
    assert error.bundle_path is not None and error.category == "input"
    assert f"not saved: {part}: OSError: [Errno {code}] {ERRORS[code]}" in str(error)
    bundle = load_bundle(error.bundle_path)  # what is there verifies
    assert [e["part"] for e in bundle.manifest["write_errors"]] == [part]
    assert not any((Path(error.bundle_path) / f).exists() for f, p in FILES.items() if p == part)
    note = (Path(error.bundle_path) / INCIDENT).read_text()
    assert "**not saved**" in note and f"{part}: OSError: [Errno {code}] {ERRORS[code]}" in note
    if part == "state":
        assert f"- state: not stored (OSError: [Errno {code}] {ERRORS[code]}" in note
    code_, out = _report(error.bundle_path)
    assert code_ == 0, out
    # A later run of the same incident, with the fault gone, replaces it with a complete bundle.
    again = train(tmp_path / "b", "r", log_file=log_file)
    assert again.bundle_path == error.bundle_path and "not saved" not in str(again)
    _complete(Path(again.bundle_path))
    assert _leftovers(tmp_path / "b") == []


def _report(path) -> tuple[int, str]:
    out = CliRunner().invoke(main, ["report", str(path)])
    return out.exit_code, out.output


@pytest.mark.parametrize("code", sorted(ERRORS))
@pytest.mark.parametrize("name", [n for n, part in FILES.items() if part is None])
def test_a_core_file_failing_once_leaves_the_core_alone(tmp_path, monkeypatch, name, code):
    with _failing(monkeypatch, name, code, times=1):
        error = train(tmp_path / "b", "r", log_file=_log(tmp_path))
    assert error.bundle_path is not None
    bundle = load_bundle(error.bundle_path)
    parts = [e["part"] for e in bundle.manifest["write_errors"] if e["part"] != "source_diff"]  # a dirty checkout's
    assert parts == ["batch", "rng", "history", "state", "logs", "window"]
    assert all(f"the whole bundle failed first (OSError: [Errno {code}]" in e["error"]
               for e in bundle.manifest["write_errors"])
    assert "not saved: " in str(error) and "batch, rng, history, state, logs, window: not written" in str(error)
    assert _leftovers(tmp_path / "b") == []
    _complete(Path(train(tmp_path / "b", "r").bundle_path))


@pytest.mark.parametrize("name", [n for n, part in FILES.items() if part is None])
def test_a_core_file_that_never_writes_leaves_nothing_and_says_why(tmp_path, monkeypatch, name):
    with _failing(monkeypatch, name, errno.EIO):
        error = train(tmp_path / "b", "r")
    assert error.bundle_path is None
    text = str(error)
    assert "non-finite values at step 2 (category input" in text
    assert "no evidence bundle could be written" in text and "Input/output error" in text
    assert "nothing partial was left there" in text and "check the file system" in text
    assert not (tmp_path / "b" / "r" / "step-2").exists() and _leftovers(tmp_path / "b") == []
    _complete(Path(train(tmp_path / "b", "r").bundle_path))


@pytest.mark.parametrize("failing_call", [1, 4, 9])
def test_eio_at_fsync_leaves_no_bundle_that_looks_whole(tmp_path, monkeypatch, failing_call):
    """An I/O error reported by fsync (where a failing disk reports it) at the n-th file of the write."""
    calls = {"n": 0}
    real = atomic.fsync_file

    def fsync_file(path):
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real(path)

    monkeypatch.setattr(atomic, "fsync_file", fsync_file)
    error = train(tmp_path / "b", "r")
    monkeypatch.setattr(atomic, "fsync_file", real)
    assert error.bundle_path is not None  # the core alone, on the second try
    assert load_bundle(error.bundle_path).manifest["write_errors"] and "not saved" in str(error)
    assert _leftovers(tmp_path / "b") == []
    _complete(Path(train(tmp_path / "b", "r").bundle_path))


# -- a real full disk and a read-only directory -------------------------------------------------------------------

@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def test_a_full_disk_keeps_the_small_parts_and_names_the_missing_state(tmp_path):
    with _tmpfs(tmp_path / "disk", "size=160k") as disk:
        error = train(disk, "full", width=256)  # the state alone is about 790 KB
        assert error.bundle_path is not None
        bundle = load_bundle(error.bundle_path)
        missing = {e["part"]: e["error"] for e in bundle.manifest["write_errors"]}
        assert "state" in missing and "No space left on device" in missing["state"]
        note = (Path(error.bundle_path) / INCIDENT).read_text()
        assert "- state: not stored (" in note and "No space left on device" in note
        assert "no model given" not in note
        assert "not saved: " in str(error) and "No space left on device" in str(error)
        assert _leftovers(disk) == []
        _remount(disk, "size=16m")
        _complete(Path(train(disk, "full", width=256).bundle_path))


def test_a_read_only_directory_says_so_and_what_to_do(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        error = train(ro / "bundles", "r")
        assert error.bundle_path is None
        text = str(error)
        assert "Read-only file system" in text and "give a writable one" in text and "NANSCAN_BUNDLE_DIR" in text


def test_a_note_on_a_read_only_bundle_changes_nothing_and_says_why(tmp_path):
    with _tmpfs(tmp_path / "disk", "size=4m") as disk:
        path = Path(train(disk, "r").bundle_path)
        _remount(disk, "ro")
        out = CliRunner().invoke(main, ["note", str(path), "looked at it"])
        assert out.exit_code == 1 and "must be writable" in out.output, out.output
        _remount(disk, "rw")
        assert load_bundle(path).notes() == []


@pytest.mark.parametrize("failing_write", [1, 2, 3])
@pytest.mark.parametrize("code", sorted(ERRORS))
def test_a_ledger_update_that_fails_changes_nothing(tmp_path, monkeypatch, failing_write, code):
    """add_note writes the ledger, INCIDENT.md and the manifest as pending files, then commits: a failure at any
    of the three leaves the bundle exactly as it was, and the note can be added again."""
    path = Path(train(tmp_path / "b", "r").bundle_path)
    before = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    calls = {"n": 0}
    real = bundle_read.atomic_write_bytes

    def write(target, data):
        calls["n"] += 1
        if calls["n"] == failing_write:
            raise OSError(code, os.strerror(code), str(target))
        return real(target, data)

    monkeypatch.setattr(bundle_read, "atomic_write_bytes", write)
    with pytest.raises(BundleError, match=f"cannot update {path}.*{ERRORS[code]}"):
        load_bundle(path).add_note("first look")
    monkeypatch.setattr(bundle_read, "atomic_write_bytes", real)
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()} == before
    bundle = load_bundle(path)
    assert bundle.add_note("first look") and [n["text"] for n in load_bundle(path).notes()] == ["first look"]


@pytest.mark.parametrize("flag, name", [("--csv", "h.csv"), ("--parquet", "h.parquet"), ("--tensorboard", "tb")])
def test_an_export_that_fails_leaves_nothing_and_says_why(tmp_path, monkeypatch, flag, name):
    path = Path(train(tmp_path / "b", "r").bundle_path)

    def fsync_file(target):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(target))

    monkeypatch.setattr(atomic, "fsync_file", fsync_file)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = CliRunner().invoke(main, ["export", str(path), flag, str(out_dir / name)])
    assert result.exit_code == 1, result.output
    assert f"cannot write {flag}" in result.output and "Input/output error" in result.output
    assert list(out_dir.iterdir()) == []


def test_export_regression_on_a_full_disk_leaves_nothing(tmp_path):
    import replay_entries as E  # noqa: PLC0415

    bundle = E.train("poisoned_sample", tmp_path / "b")
    with _tmpfs(tmp_path / "disk", "size=24k") as disk:
        result = CliRunner().invoke(main, ["export-regression", str(bundle), str(disk / "reg"),
                                           "--samples", str(E.POISON_ROW), "--with-state"])
        assert result.exit_code != 0 and "No space left on device" in result.output, result.output
        assert _leftovers(disk) == [] and not (disk / "reg" / "test_nanscan_poisoned_sample_step3.py").exists()


# -- processes ------------------------------------------------------------------------------------------------------

def _writer(bundle_dir: Path, run_id: str, width: int = 64) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WRITER.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(WRITER), str(bundle_dir), run_id, str(width)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # make test's 15 minutes (a subprocess run or a long training); make test-slow runs it
def test_two_processes_writing_the_same_run_and_step_agree_on_one_bundle(tmp_path):
    writers = [_writer(tmp_path / "b", "same") for _ in range(2)]
    outputs = [w.communicate(timeout=240) for w in writers]
    assert [w.returncode for w in writers] == [3, 3], outputs
    paths = {out.splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1, outputs
    _complete(Path(paths.pop()))
    assert _leftovers(tmp_path / "b") == []


def _write_started(run_dir: Path, writer: subprocess.Popen, limit: float = 120.0) -> bool:
    """Wait until the writer's temporary bundle directory appears (its write has begun); False if it ended first."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if run_dir.is_dir() and any(p.name.startswith(atomic.TEMP_PREFIX) for p in run_dir.iterdir()):
            return True
        if writer.poll() is not None:
            return False
        time.sleep(0.0005)
    return False


@pytest.mark.slow  # a writer process started and killed again and again
def test_a_writer_killed_at_random_points_leaves_no_bundle_that_looks_whole(tmp_path):
    """SIGKILL at random moments of the bundle write (a 1.2 MB state, every file fsynced), timed from the moment its
    temporary directory appears: after each, the bundle is absent or loads and verifies; a later run writes a
    complete one and removes the dead writer's leftovers."""
    width = 320
    timing = _writer(tmp_path / "timing", "t", width)
    assert _write_started(tmp_path / "timing" / "t", timing)
    started = time.monotonic()
    timing.stdout.readline()  # "ready"
    timing.stdout.readline()  # the bundle's path: the write is done
    write_time = time.monotonic() - started
    timing.communicate(timeout=240)
    rng = random.Random(0)
    seen = {"absent": 0, "whole": 0}
    kills = 5
    for i in range(kills):
        run_id = f"kill{i}"
        writer = _writer(tmp_path / "b", run_id, width)
        assert _write_started(tmp_path / "b" / run_id, writer), "the writer ended before its bundle write began"
        # the first kill at once (inside the write for sure), the others spread over the rest of it
        time.sleep(0 if i == 0 else write_time * (i - 1 + rng.random()) / (kills - 1))
        writer.send_signal(signal.SIGKILL)
        writer.communicate(timeout=60)
        final = tmp_path / "b" / run_id / "step-2"
        if final.exists():
            load_bundle(final)  # whole: every file present and matching its sha256
            seen["whole"] += 1
        else:
            seen["absent"] += 1
        again = _writer(tmp_path / "b", run_id, width)
        out, err = again.communicate(timeout=240)
        assert again.returncode == 3 and out.splitlines()[-1] == str(final), (out, err)
        _complete(final)
        assert _leftovers(tmp_path / "b" / run_id) == []
    assert seen["absent"] >= 1, seen  # the first kill landed inside the write
