"""Evidence bundles: round trip of batch, state, RNG and history; refusal of missing, truncated, tampered and
foreign bundles, and of hostile ones (links, unlisted files, wrong types, forged pending updates, damaged files
with matching sha256s); atomic and idempotent writes (kill -9 mid-write, concurrent writers, read-only and full
disks); findings, notes (which cannot pose as findings) and the `nanscan note` command."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import nn

import hashlib

import nanscan.bundle as B
import nanscan.bundle.format as F
import nanscan.bundle.read as R
from nanscan import BundleError, Monitor, NonFiniteWarning, load_bundle
from nanscan._atomic import atomic_directory, remove_dead_writers_temps
from nanscan.cli.main import main as cli_main
from nanscan.entry import EntryWarning
from nanscan.bundle.provenance import capture_rng


@pytest.fixture(autouse=True)
def _bundles_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("NANSCAN_BUNDLE_DIR", str(tmp_path / "env-bundles"))


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class Run:
    """A tiny model trained until a planted input NaN; keeps what the bundle should hold."""

    def __init__(self, tmp_path: Path, *, snapshot: str = "none", log_files=(), steps: int = 3):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        self.incidents: list[B.Incident] = []
        # The entry is only recorded here: the Monitor says at once that it cannot be imported.
        with pytest.warns(EntryWarning, match="my_pkg.train"):
            self.mon = Monitor(self.model, self.optimizer, bundle_dir=tmp_path / "bundles", run_id="r1",
                               config={"lr": 1e-3, "layers": [3, 4, 2]}, log_files=log_files, on_invalid="warn",
                               snapshot=snapshot, replay_entry="my_pkg.train:replay")
        for step in range(steps + 1):
            g = torch.Generator().manual_seed(step)
            self.batch = {"x": torch.randn(5, 3, generator=g), "extra": (torch.arange(5), [torch.ones(2, 2)]),
                          "mask": torch.ones(5, dtype=torch.bool), "name": "shard-7"}
            if step == steps:
                self.batch["x"][2, 0] = float("nan")
            if step == steps:
                self.rng_at_start = capture_rng()
            loss = self.model(self.batch["x"]).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            if step == steps:
                self.model_state = {k: v.clone() for k, v in self.model.state_dict().items()}
                self.optimizer_state = self.optimizer.state_dict()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NonFiniteWarning)
                report = self.mon.check(batch=self.batch, loss=loss, sample_ids=[10 * step + i for i in range(5)])
            if report.ok:
                self.optimizer.step()
        self.path = self.mon.bundle_path


@pytest.fixture
def run(tmp_path):
    return Run(tmp_path)


def test_layout_and_manifest_keys(run):
    assert run.path == run.mon.bundle_dir / "r1" / "step-3"
    names = set(_files(run.path))
    assert {"manifest.json", "batch.safetensors", "rng.safetensors", "history.safetensors", "history.json",
            "state.safetensors", "state.json", "INCIDENT.md", "ledger.jsonl"} <= names
    manifest = json.loads((run.path / "manifest.json").read_text())
    for key in F.REQUIRED_KEYS:
        assert key in manifest
    assert manifest["schema"] == "nanscan.bundle/1"
    assert (manifest["first_invalid_step"], manifest["category"]) == (3, "input")
    assert manifest["nonfinite_tensors"][0] == {"name": "input:x", "kind": "input", "dtype": "float32", "nan": 1,
                                                "posinf": 0, "neginf": 0, "numel": 15}
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert manifest["batch"]["sample_ids"] == [30, 31, 32, 33, 34]
    assert manifest["batch"]["shapes"]["x"] == [5, 3]
    assert manifest["batch"]["dtypes"]["extra.0"] == "int64"
    assert manifest["config_sha256"] == hashlib.sha256(b'{"layers":[3,4,2],"lr":0.001}').hexdigest()
    assert manifest["replay_entry"] == "my_pkg.train:replay"
    assert manifest["environment"]["torch"] == torch.__version__
    assert math.isnan(float(manifest["loss"]))  # strict JSON: non-finite floats are written as strings
    text = (run.path / "INCIDENT.md").read_text()
    assert text.index("## Automatic findings") < text.index("### First non-finite step: 3 (input)") \
        < text.index("## Reviewer notes")


def test_round_trip_batch_state_rng_history(run):
    bundle = load_bundle(run.path)
    flat = bundle.batch()
    assert set(flat) == {"x", "extra.0", "extra.1.0", "mask"}
    assert torch.equal(flat["x"].view(torch.int32), run.batch["x"].view(torch.int32))
    nested = bundle.batch(nested=True)
    assert isinstance(nested["extra"], tuple) and isinstance(nested["extra"][1], list)
    assert torch.equal(nested["extra"][0], run.batch["extra"][0]) and nested["mask"].dtype == torch.bool
    assert nested["name"] == "shard-7"

    model_state, optimizer_state = bundle.state()
    for key, value in run.model_state.items():
        assert torch.equal(model_state[key], value)
    assert optimizer_state["param_groups"] == run.optimizer_state["param_groups"]
    assert isinstance(optimizer_state["param_groups"][0]["betas"], tuple)
    assert optimizer_state["state"].keys() == run.optimizer_state["state"].keys()
    for index, state in run.optimizer_state["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer_state["state"][index][key], value)
    torch.optim.AdamW(run.model.parameters()).load_state_dict(optimizer_state)

    history = bundle.history()
    assert [e.step for e in history] == [e.step for e in run.mon.history] == [0, 1, 2, 3]
    for stored, live in zip(history, run.mon.history):
        assert np.array_equal(stored.report.records, live.report.records)
        assert stored.report.names == live.report.names and stored.report.skipped == live.report.skipped
        assert stored.grad_norm == live.grad_norm and stored.lr == live.lr
        assert stored.loss == live.loss or (math.isnan(stored.loss) and math.isnan(live.loss))
    assert history[-1].report.nonfinite[:2] == ["input:x", "loss"]
    assert history[-1].report["input:x"].nan == 1

    rng, start = bundle.rng_state(), run.rng_at_start
    assert torch.equal(rng["torch_cpu"], start["torch_cpu"]) and rng["python"] == start["python"]
    assert rng["numpy"][0] == start["numpy"][0] and np.array_equal(rng["numpy"][1], start["numpy"][1])
    assert rng["numpy"][2:] == start["numpy"][2:] and rng["torch_cuda"] == []
    expected = torch.Generator()
    expected.set_state(start["torch_cpu"])
    torch.manual_seed(4321)
    bundle.restore_rng()
    assert torch.equal(torch.rand(4), torch.rand(4, generator=expected))


def test_load_accepts_run_dir_with_one_bundle_and_lists_several(run, tmp_path):
    assert load_bundle(run.path.parent).path == run.path
    (run.path.parent / "step-9").mkdir()
    with pytest.raises(BundleError, match="holds 2 bundles"):
        load_bundle(run.path.parent)
    with pytest.raises(BundleError, match="does not exist"):
        load_bundle(tmp_path / "nowhere")


@pytest.mark.parametrize("damage, match", [
    (lambda p: (p / "state.safetensors").unlink(), "state.safetensors is missing"),
    (lambda p: (p / "history.safetensors").write_bytes((p / "history.safetensors").read_bytes()[:100]),
     r"history.safetensors is truncated \(100 of"),
    (lambda p: _flip_last_byte(p / "batch.safetensors"), "batch.safetensors does not match its sha256"),
    (lambda p: (p / "ledger.jsonl").write_text((p / "ledger.jsonl").read_text() + "\n"),
     "ledger.jsonl does not match its sha256"),
    (lambda p: (p / "manifest.json").write_text('{"schema": "nanscan.bundle/1", "run'), "not valid JSON"),
    (lambda p: _edit_manifest(p, schema="other.tool/3"), "not a nanscan bundle"),
    (lambda p: _edit_manifest(p, schema="nanscan.bundle/2"), "another nanscan version"),
    (lambda p: _edit_manifest(p, files={"../../etc/passwd": {"sha256": "0" * 64}}), "outside the bundle"),
    (lambda p: _edit_manifest(p, history=None), "lacks history"),
])
def test_damaged_bundle_is_refused_with_file_name(run, damage, match):
    damage(run.path)
    with pytest.raises(BundleError, match=match):
        load_bundle(run.path)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(root: Path, **changes) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    for key, value in changes.items():
        if value is None:
            del manifest[key]
        else:
            manifest[key] = value
    (root / "manifest.json").write_text(json.dumps(manifest))


def _capture_incident(monkeypatch, tmp_path) -> tuple[B.Incident, Path]:
    captured = []
    real = B.write_bundle

    def spy(incident, bundle_dir):
        captured.append(incident)
        return real(incident, bundle_dir)

    monkeypatch.setattr("nanscan.runtime.verdict.write_bundle", spy)  # where the Monitor writes its incidents
    run = Run(tmp_path)
    return captured[0], run.path


def test_same_incident_writes_identical_bytes_and_keeps_existing(monkeypatch, tmp_path):
    incident, first = _capture_incident(monkeypatch, tmp_path)
    original = _files(first)
    mtime = (first / "manifest.json").stat().st_mtime_ns
    assert B.write_bundle(incident, first.parent.parent) == first  # already there: kept as is
    assert _files(first) == original and (first / "manifest.json").stat().st_mtime_ns == mtime
    second = B.write_bundle(incident, tmp_path / "elsewhere")
    assert _files(second) == original  # a fresh write of the same incident is byte-identical


def test_concurrent_writers_agree_on_one_bundle(monkeypatch, tmp_path):
    incident, _ = _capture_incident(monkeypatch, tmp_path)
    target, results, errors = tmp_path / "shared", [], []

    def write():
        try:
            results.append(B.write_bundle(incident, target))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(p.name for p in (target / "r1").iterdir()) == ["step-3"]
    load_bundle(results[0])


def test_occupied_invalid_path_is_not_overwritten(monkeypatch, tmp_path):
    incident, _ = _capture_incident(monkeypatch, tmp_path)
    squatter = tmp_path / "other" / "r1" / "step-3"
    squatter.mkdir(parents=True)
    (squatter / "notes.txt").write_text("not a bundle")
    with pytest.raises(BundleError, match="move it away"):
        B.write_bundle(incident, tmp_path / "other")
    assert (squatter / "notes.txt").read_text() == "not a bundle"


KILLED_WRITER = r"""
import sys, time, torch, nanscan, nanscan.bundle.write as W
bundle_dir, sentinel = sys.argv[1], sys.argv[2]
real = W.save_tensors
def stall_after_history(path, tensors, metadata=None):
    real(path, tensors, metadata)
    if path.name == W.HISTORY:
        open(sentinel, "w").close()
        time.sleep(120)
W.save_tensors = stall_after_history
model = torch.nn.Linear(3, 1)
mon = nanscan.Monitor(model, bundle_dir=bundle_dir, run_id="killed", on_invalid="warn")
x = torch.ones(2, 3)
x[0, 0] = float("nan")
loss = model(x).sum()
loss.backward()
mon.check(batch={"x": x}, loss=loss)
"""


@pytest.mark.slow  # a subprocess that imports torch: a few seconds
def test_kill_during_write_leaves_no_valid_looking_bundle(tmp_path):
    bundle_dir, sentinel = tmp_path / "bundles", tmp_path / "stalled"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(bundle_dir), str(sentinel)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not sentinel.exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the writer never reached the middle of the bundle"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    run_dir = bundle_dir / "killed"
    leftovers = list(run_dir.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-step-0-")
    assert (leftovers[0] / "history.safetensors").exists() and not (leftovers[0] / "manifest.json").exists()
    with pytest.raises(BundleError, match="does not exist"):
        load_bundle(run_dir / "step-0")
    with pytest.raises(BundleError, match="interrupted"):
        load_bundle(run_dir)
    with pytest.raises(BundleError, match="interrupted write"):
        load_bundle(leftovers[0])
    assert list(B.iter_bundles(bundle_dir)) == []

    model = nn.Linear(3, 1)
    mon = Monitor(model, bundle_dir=bundle_dir, run_id="killed", on_invalid="warn")
    with pytest.warns(NonFiniteWarning):
        mon.check(loss=float("nan"))
    assert load_bundle(run_dir).path == run_dir / "step-0" == mon.bundle_path
    assert list(B.iter_bundles(bundle_dir)) == [run_dir / "step-0"]
    # The next write of the same bundle removed the dead writer's leftover (NOTE: [dead writers]).
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-0"]
    assert leftovers[0].name.startswith(f".tmp-step-0-{proc.pid}@")


def test_only_dead_writers_leftovers_are_removed(tmp_path):
    final = tmp_path / "step-3"
    host = socket.gethostname()
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead_pid = int(finished.stdout)
    dead = tmp_path / f".tmp-step-3-{dead_pid}@{host}-abc123"
    alive = tmp_path / f".tmp-step-3-{os.getpid()}@{host}-def456"  # a write still running (this process)
    elsewhere = tmp_path / f".tmp-step-3-{dead_pid}@not-{host}-ghi789"  # another host on a shared file system
    neighbour = tmp_path / f".tmp-step-30-{dead_pid}@{host}-jkl012"  # a leftover of another bundle
    old_style = tmp_path / ".tmp-step-3-mno345"  # written before writers were named: its writer is unknown
    for d in (dead, alive, elsewhere, neighbour, old_style):
        d.mkdir()
        (d / "history.safetensors").write_bytes(b"partial")
    assert remove_dead_writers_temps(final) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(d.name for d in (alive, elsewhere, neighbour,
                                                                                 old_style))
    with atomic_directory(final) as temp:
        assert temp.name.startswith(f".tmp-step-3-{os.getpid()}@{host}-")
        (temp / "a").write_bytes(b"x")
    assert (final / "a").read_bytes() == b"x" and alive.exists()


def test_findings_are_stored_once_per_key(run):
    bundle = load_bundle(run.path)
    assert bundle.add_finding("replay", "Replay reproduces the NaN", "Replayed **3** times.", {"runs": 3})
    snapshot = _files(run.path)
    assert not bundle.add_finding("replay", "Replay reproduces the NaN", "Replayed **3** times.", {"runs": 3})
    assert _files(run.path) == snapshot
    assert bundle.add_finding("ablate", "Ablation", "lr / 10 stays finite.", {"lr": 1e-4, "loss": float("nan")})
    assert bundle.add_finding("replay", "Replay reproduces the NaN", "Replayed **5** times.", {"runs": 5})
    reopened = load_bundle(run.path)
    assert [f["key"] for f in reopened.findings()] == ["detect", "replay", "ablate"]
    assert reopened.findings()[1]["record"] == {"runs": 5}
    assert reopened.findings()[2]["record"]["loss"] == "nan"
    text = reopened.incident_text()
    assert text.count("<!-- nanscan:finding replay -->") == 1 and "Replayed **5** times." in text
    assert text.index("### Ablation") < text.index("## Reviewer notes")


def test_notes_are_separate_and_not_duplicated(run):
    bundle = load_bundle(run.path)
    bundle.add_finding("replay", "Replay", "body", {})
    assert bundle.add_note("Shard 7 was re-encoded on the 3rd.", author="ana")
    assert not bundle.add_note("  Shard 7 was re-encoded on the 3rd.  ", author="bo")
    assert bundle.add_note("Second thought.")
    text = load_bundle(run.path).incident_text()
    notes = text[text.index("## Reviewer notes"):]
    assert notes.count("Shard 7 was re-encoded") == 1 and "**ana**" in notes and "**anonymous**" in notes
    assert "Shard 7" not in text[:text.index("## Reviewer notes")]
    assert [n["author"] for n in load_bundle(run.path).notes()] == ["ana", None]
    with pytest.raises(ValueError, match="text"):
        bundle.add_note("   ")


def test_interrupted_update_is_finished_or_discarded(run, monkeypatch):
    bundle = load_bundle(run.path)
    monkeypatch.setattr(R, "_finish_pending", lambda root: None)  # die right after the commit point
    bundle.add_note("committed but not renamed")
    monkeypatch.undo()
    assert any(p.name.startswith(".pending-") for p in run.path.iterdir())
    assert "committed but not renamed" in load_bundle(run.path).incident_text()
    assert not any(p.name.startswith(".pending-") for p in run.path.iterdir())

    (run.path / ".pending-INCIDENT.md").write_text("half of an update that never reached its commit point")
    reopened = load_bundle(run.path)
    assert "half of an update" not in reopened.incident_text()
    assert not (run.path / ".pending-INCIDENT.md").exists()


def test_note_command(run):
    runner = CliRunner()
    result = runner.invoke(cli_main, ["note", str(run.path), "Looks like a bad shard.", "--author", "cy"])
    assert result.exit_code == 0, result.output
    assert "note added" in result.output
    again = runner.invoke(cli_main, ["note", str(run.path), "Looks like a bad shard."])
    assert again.exit_code == 0 and "already" in again.output
    assert load_bundle(run.path).incident_text().count("Looks like a bad shard.") == 1
    _flip_last_byte(run.path / "rng.safetensors")
    refused = runner.invoke(cli_main, ["note", str(run.path), "another"])
    assert refused.exit_code == 1 and "rng.safetensors does not match its sha256" in refused.output


def test_log_tails_are_copied(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(f"line {i}\n" for i in range(500)))
    run = Run(tmp_path, log_files=[log, tmp_path / "missing.log"], steps=1)
    bundle = load_bundle(run.path)
    lines = bundle.log_tail("train.log").decode().splitlines()
    assert lines[0] == "line 300" and lines[-1] == "line 499" and len(lines) == F.LOG_TAIL_LINES
    missing = bundle.manifest["logs"][1]
    assert missing["file"] is None and "FileNotFoundError" in missing["error"]


def test_log_tail_is_bounded_in_bytes(tmp_path):
    log = tmp_path / "wide.log"
    log.write_bytes(b"x" * 1000 + b"\n" + (b"y" * 999 + b"\n") * 100)
    tail = B.read_log_tail(log)
    assert len(tail["data"]) <= F.LOG_TAIL_BYTES and tail["data"].startswith(b"y") and tail["data"].endswith(b"\n")


def test_snapshot_cpu_bundle_is_marked_pre_step(tmp_path):
    run = Run(tmp_path, snapshot="cpu")
    state = load_bundle(run.path).manifest["state"]
    assert state["pre_step"] is True and state["file"] == "state.safetensors"
    assert "before this step (snapshot)" in load_bundle(run.path).incident_text()


def test_tied_weights_are_saved(tmp_path):
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied input and output embeddings share one tensor
    mon = Monitor(model, bundle_dir=tmp_path, on_invalid="warn")
    with pytest.warns(NonFiniteWarning):
        mon.check(loss=float("nan"))
    model_state, _ = load_bundle(mon.bundle_path).state()
    assert torch.equal(model_state["0.weight"], model[0].weight.detach())
    assert torch.equal(model_state["1.weight"], model[0].weight.detach())


def test_batch_safetensors_cannot_hold_is_recorded_and_the_rest_written(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized dtypes are deprecated, which is the point here
        quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    model = nn.Linear(2, 1)
    mon = Monitor(model, bundle_dir=tmp_path, on_invalid="warn")
    with pytest.warns(NonFiniteWarning):
        mon.check(batch={"q": quantized, "x": torch.ones(1, 2)}, loss=float("nan"), sample_ids=[object()])
    bundle = load_bundle(mon.bundle_path)
    assert bundle.manifest["batch"]["file"] is None and "quint8" in bundle.manifest["batch"]["error"]
    assert bundle.batch() == {} and not (bundle.path / "batch.safetensors").exists()
    assert bundle.manifest["batch"]["sample_ids"][0].startswith("<object object")
    assert bundle.state()[0].keys() == {"weight", "bias"}


def test_dataclass_batch_is_scanned_and_stored_as_fields(tmp_path):
    @dataclasses.dataclass
    class Batch:
        pixels: torch.Tensor
        labels: torch.Tensor

    batch = Batch(torch.ones(2, 3), torch.tensor([0, 1]))
    batch.pixels[1, 2] = float("inf")
    mon = Monitor(nn.Linear(3, 1), bundle_dir=tmp_path, on_invalid="warn")
    with pytest.warns(NonFiniteWarning, match="input:pixels"):
        report = mon.check(batch=batch)
    assert report.skipped == ["input:labels"]
    bundle = load_bundle(mon.bundle_path)
    assert bundle.category == "input" and bundle.batch()["pixels"][1, 2] == float("inf")
    assert torch.equal(bundle.batch(nested=True)["labels"], batch.labels)
    assert bundle.batch_structure["__dataclass__"].endswith("Batch")


def test_existing_bundle_of_another_incident_is_kept_with_a_warning(monkeypatch, tmp_path, caplog):
    incident, first = _capture_incident(monkeypatch, tmp_path)
    original = _files(first)
    later = dataclasses.replace(incident, detected_at="2099-01-01T00:00:00+00:00")
    assert B.write_bundle(later, first.parent.parent) == first
    assert _files(first) == original and "already holds a bundle" in caplog.text


def test_concurrent_notes_are_all_kept(run):
    bundles = [load_bundle(run.path) for _ in range(4)]  # separate handles, as separate processes would hold
    threads = [threading.Thread(target=b.add_note, args=(f"note {i}",)) for i, b in enumerate(bundles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(n["text"] for n in load_bundle(run.path).notes()) == [f"note {i}" for i in range(4)]


# -- bundles received from elsewhere: damaged or hostile -----------------------------------------------------

def _replace_member(root: Path, name: str, data: bytes) -> None:
    """Change a bundle file and record its new sha256, as a hostile sender (or a buggy writer) would."""
    (root / name).write_bytes(data)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("changes, match", [
    ({"first_invalid_step": "3"}, "first_invalid_step"),
    ({"first_invalid_step": None}, "first_invalid_step"),
    ({"category": ["input"]}, "category"),
    ({"run_id": 7}, "run_id"),
    ({"nonfinite_tensors": "input:x"}, "nonfinite_tensors"),
    ({"nonfinite_tensors": [{"name": "input:x", "nan": "1", "posinf": 0, "neginf": 0, "numel": 15}]},
     "nonfinite_tensors"),
    ({"logs": ["train.log"]}, "logs"),
    ({"distributed": "rank 0"}, "distributed"),
    ({"files": {"bytes": "12"}}, "files"),
])
def test_manifest_with_wrong_types_is_refused_naming_the_field(run, changes, match):
    manifest = json.loads((run.path / "manifest.json").read_text())
    if "files" in changes:
        manifest["files"]["INCIDENT.md"].update(changes.pop("files"))
    manifest.update(changes)  # a null cannot go through _edit_manifest, which deletes on None
    (run.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"manifest.json: wrong type for {match}"):
        load_bundle(run.path)
    result = CliRunner().invoke(cli_main, ["report", str(run.path), "--json"])
    assert result.exit_code == 2 and "wrong type" in result.stderr and "Traceback" not in result.output


def test_manifest_listing_a_file_twice_or_nested_absurdly_is_refused(run):
    text = (run.path / "manifest.json").read_text()
    twice = text.replace('"files": {', '"files": {"INCIDENT.md": {"sha256": "' + "0" * 64 + '", "bytes": 1},', 1)
    (run.path / "manifest.json").write_text(twice)
    with pytest.raises(BundleError, match="'INCIDENT.md' appear twice"):
        load_bundle(run.path)
    (run.path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BundleError, match="nested too deeply"):
        load_bundle(run.path)


@pytest.mark.parametrize("name", ["./INCIDENT.md", "logs//x", ".hidden", "a\\..\\b"])
def test_file_names_must_be_plain_relative_paths(run, name):
    """One file, one name: a second spelling of a listed file (or a name the writer never lists) is refused even
    when its sha256 matches."""
    path = run.path / name
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        path.write_bytes(b"x")
    _replace_member(run.path, name, path.read_bytes())
    with pytest.raises(BundleError, match="outside the bundle"):
        load_bundle(run.path)


def test_links_inside_the_bundle_are_refused(run, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("a file of the receiver's, outside the bundle")
    (run.path / "INCIDENT.md").unlink()
    (run.path / "INCIDENT.md").symlink_to(secret)
    _replace_member(run.path, "INCIDENT.md", secret.read_bytes())  # writes through the link: the hash matches
    with pytest.raises(BundleError, match="INCIDENT.md is a symbolic link"):
        load_bundle(run.path)
    result = CliRunner().invoke(cli_main, ["report", str(run.path), "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 2 and "symbolic link" in result.stderr and not (tmp_path / "r.html").exists()
    note = CliRunner().invoke(cli_main, ["note", str(run.path), "hello"])
    assert note.exit_code == 1 and "symbolic link" in note.output
    assert secret.read_text() == "a file of the receiver's, outside the bundle"


def test_a_linked_manifest_is_refused(run, tmp_path):
    elsewhere = tmp_path / "manifest.json"
    (run.path / "manifest.json").rename(elsewhere)
    (run.path / "manifest.json").symlink_to(elsewhere)
    with pytest.raises(BundleError, match="manifest.json is a symbolic link"):
        load_bundle(run.path)


def test_a_linked_directory_is_refused(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("line\n")
    run = Run(tmp_path, log_files=[log], steps=1)
    outside = tmp_path / "outside"
    (run.path / "logs").rename(outside)
    (run.path / "logs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BundleError, match="logs is a symbolic link"):
        load_bundle(run.path)


def test_unlisted_files_are_refused_and_hidden_ones_ignored(run):
    (run.path / ".DS_Store").write_bytes(b"\0")  # copies pick these up; the writer never lists hidden names
    assert load_bundle(run.path).path == run.path
    (run.path / "fix.py").write_text("import os\n")
    with pytest.raises(BundleError, match="holds fix.py, which manifest.json does not list"):
        load_bundle(run.path)


@pytest.mark.parametrize("name, data, read, match", [
    ("history.json", b"{", "history", "history.json is not valid JSON"),
    ("history.json", b"[]", "history", "history.json holds a list"),
    ("history.json", lambda p: p.replace(b'"layout": 0', b'"layout": 9', 1), "history", "layout 9"),
    ("history.json", lambda p: p.replace(b'"grad_norm": ', b'"grad_norm": "big", "x": ', 1), "history",
     "loss, lr, grad_norm"),
    ("history.safetensors", lambda p: _resave(p, scalars=lambda t: t.float()), "history", "expected int64"),
    ("history.safetensors", lambda p: _resave(p, hist_counts=lambda t: t[1:]), "history", "hist_counts holds"),
    ("history.safetensors", lambda p: _resave(p, row_offsets=lambda t: t * 2), "history", "row_offsets"),
    ("history.safetensors", lambda p: _resave(p, scalars=lambda t: t.index_fill(1, torch.tensor([0]), -1)),
     "history", "negative counts"),
    ("history.safetensors", lambda p: p[:200], "history", "history.safetensors: cannot read it as safetensors"),
    ("history.safetensors", lambda p: (1 << 60).to_bytes(8, "little") + p[8:], "history",
     "history.safetensors: cannot read it as safetensors"),  # a header that claims an exabyte
    ("ledger.jsonl", lambda p: p + b"{not json\n", "ledger", r"ledger.jsonl, line 2: not a JSON record"),
    ("ledger.jsonl", lambda p: p + b"[1]\n", "ledger", r"ledger.jsonl, line 2: not a finding or note"),
    ("ledger.jsonl", lambda p: p + b'"\xff"\n', "ledger", r"ledger.jsonl, line 2: not a JSON record"),
    ("state.json", b'{"model": {"w": {"__tensor__": "nope"}}}', "state", "state.json does not hold what"),
    ("rng.safetensors", lambda p: _resave(p, metadata={"nanscan.rng": "{}"}), "rng_state",
     "rng.safetensors does not hold what"),
])
def test_damaged_member_with_matching_sha256_names_the_file(run, name, data, read, match):
    original = (run.path / name).read_bytes()
    _replace_member(run.path, name, data(original) if callable(data) else data)
    bundle = load_bundle(run.path)  # every sha256 matches: the damage shows only when the file is decoded
    with pytest.raises(BundleError, match=match):
        getattr(bundle, read)()


def _resave(data: bytes, metadata: dict | None = None, **changes) -> bytes:
    """The safetensors file `data` with some tensors changed, keeping its metadata unless `metadata` is given."""
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    tensors = safetensors_load(data)
    for key, change in changes.items():
        tensors[key] = change(tensors[key]).contiguous()
    return safetensors_save(tensors, metadata=header.get("__metadata__") if metadata is None else metadata)


def test_damaged_rng_state_is_refused_before_any_generator_changes(run):
    _replace_member(run.path, "rng.safetensors",
                    _resave((run.path / "rng.safetensors").read_bytes(), torch_cpu=lambda t: t[:100]))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(BundleError, match="rng.safetensors: cannot restore the recorded RNG state: torch_cpu"):
        load_bundle(run.path).restore_rng()
    assert torch.equal(torch.get_rng_state(), before)


def test_incident_note_with_bytes_that_are_not_utf8_still_reads(run):
    _replace_member(run.path, "INCIDENT.md", (run.path / "INCIDENT.md").read_bytes() + b"\xff\xfe trailing\n")
    assert load_bundle(run.path).incident_text().endswith("\ufffd\ufffd trailing\n")


def test_pending_entries_nanscan_never_writes_are_refused(run, tmp_path):
    (run.path / ".pending-x").mkdir()
    with pytest.raises(BundleError, match=r"\.pending-x is not part of an interrupted nanscan update"):
        load_bundle(run.path)
    (run.path / ".pending-x").rmdir()
    outside = tmp_path / "planted.md"
    outside.write_text("planted")
    (run.path / ".pending-INCIDENT.md").symlink_to(outside)
    (run.path / ".pending-manifest.json").write_bytes((run.path / "manifest.json").read_bytes())
    with pytest.raises(BundleError, match="not part of an interrupted nanscan update"):
        load_bundle(run.path)
    assert not (run.path / "INCIDENT.md").is_symlink()  # nothing was renamed into place


NOTE_POSING_AS_FINDING = """## Automatic findings

<!-- nanscan:finding detect -->
### First non-finite step: 3 (parameter)
> ## nested
- # in a list
Looks official
---"""


def test_a_note_cannot_pose_as_an_automatic_finding(run):
    bundle = load_bundle(run.path)
    findings = bundle.findings()
    assert bundle.add_note(NOTE_POSING_AS_FINDING, author="eve\n## Automatic findings")
    assert not bundle.add_note(NOTE_POSING_AS_FINDING, author="eve")  # the same text is stored once
    reopened = load_bundle(run.path)  # still valid: the manifest's sha256s follow the update
    assert reopened.findings() == findings and len(reopened.notes()) == 1
    text = reopened.incident_text()
    lines = text.splitlines()
    assert lines.count("## Automatic findings") == 1 and text.count("<!-- nanscan:finding detect -->") == 1
    notes = lines[lines.index("## Reviewer notes") + 1:]
    assert not [line for line in notes if line.startswith("#")]
    quoted = [line for line in notes if line.startswith(">")]
    assert len(quoted) == len(NOTE_POSING_AS_FINDING.splitlines())
    assert r"> \## Automatic findings" in quoted and r"> > \## nested" in quoted and r"> - \# in a list" in quoted
    assert r"> \---" in quoted  # not a setext underline that would make "Looks official" a heading
    assert "**eve ## Automatic findings**" in text


def test_note_on_a_read_only_bundle_is_a_clear_error(run, monkeypatch):
    before = _files(run.path)

    def read_only(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr("nanscan._atomic.tempfile.mkstemp", read_only)
    result = CliRunner().invoke(cli_main, ["note", str(run.path), "seen on the 3rd"])
    assert result.exit_code == 1 and "must be writable" in result.output and "copy the whole directory" in result.output
    assert not isinstance(result.exception, PermissionError)
    assert _files(run.path) == before


def test_update_failing_before_its_commit_point_leaves_nothing_pending(run, monkeypatch):
    real, calls = R.atomic_write_bytes, []

    def disk_full_on_the_manifest(path, data):
        calls.append(Path(path).name)
        if Path(path).name == ".pending-manifest.json":
            raise OSError(28, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(R, "atomic_write_bytes", disk_full_on_the_manifest)
    with pytest.raises(BundleError, match="No space left.*nothing was changed"):
        load_bundle(run.path).add_note("lost")
    assert ".pending-ledger.jsonl" in calls
    assert not [p.name for p in run.path.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    assert load_bundle(run.path).notes() == []


def test_bundle_files_follow_the_umask_like_any_file(tmp_path):
    """safetensors writes 0600 files whatever the umask; a bundle is evidence to hand to others, so its tensor
    files get the same mode as its JSON files."""
    import stat

    from nanscan._atomic import FILE_MODE

    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="run", on_invalid="warn")
    model(torch.ones(4, 3)).sum().backward()
    with pytest.warns(NonFiniteWarning):
        mon.check(batch={"x": torch.full((2,), float("nan"))})
    tensor_files = sorted(mon.bundle_path.rglob("*.safetensors"))
    assert tensor_files
    for path in tensor_files + [mon.bundle_path / "manifest.json"]:
        assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE, path
