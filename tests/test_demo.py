"""`nanscan demo` end to end: the planted corrupted record is caught at its step as an `input` incident (its
weights hold 3.4e38: finite, beyond float32's safe range, so the loss goes inf; reason input_overflow), the bundle
holds the evidence a replay needs, and a rerun into the same directory changes no byte."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from nanscan import demo as D
from nanscan.bundle import load_bundle
from nanscan.cli.main import main
from nanscan.entry import build_spec

ROOT = Path(__file__).resolve().parents[1]


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`python -m nanscan demo --out DIR` in a fresh process, as a user would run it."""
    out = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "COLUMNS": "160"}
    proc = subprocess.run([sys.executable, "-m", "nanscan", "demo", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return out, proc


def test_demo_exits_zero_and_prints_step_category_and_bundle(demo_run):
    out, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    bundle = out / "bundles" / D.RUN_ID / f"step-{D.FAULT_STEP}"
    assert f"first invalid step {D.FAULT_STEP}, category input" in proc.stdout
    assert f"bundle: {bundle}" in proc.stdout
    assert "input:weights" in proc.stdout  # the batch table shows the suspect tensor
    assert bundle.is_dir()


def test_bundle_holds_the_corrupted_batch_and_its_ids(demo_run):
    out, _ = demo_run
    bundle = load_bundle(out / "bundles" / D.RUN_ID / f"step-{D.FAULT_STEP}")
    m = bundle.manifest
    assert (m["first_invalid_step"], m["category"]) == (D.FAULT_STEP, "input")
    assert [t["name"] for t in m["nonfinite_tensors"]] == ["loss"]
    assert m["replay_entry"] == D.REPLAY_ENTRY
    assert m["state"]["pre_step"] is True
    assert bundle.config == D.demo_config(out)
    # the same config as a file, for `nanscan preflight --entry nanscan.demo:replay_entry --config ...`
    assert json.loads((out / D.CONFIG_FILE).read_text()) == bundle.config

    # the planted record, found from the data alone: the one whose weights are the float32 maximum
    records = [json.loads(line) for line in Path(bundle.config["data_path"]).read_text().splitlines()]
    planted = [r["id"] for r in records if max(r["weights"]) >= D.MISSING_SENTINEL]
    assert len(planted) == 1
    ids = bundle.sample_ids
    assert ids[D.FAULT_ROW] == planted[0] and len(ids) == D.DEFAULT_CONFIG["batch_size"]
    batch = bundle.batch()
    weights = batch["weights"]
    assert torch.all(weights[D.FAULT_ROW] == D.MISSING_SENTINEL)
    others = torch.cat([weights[:D.FAULT_ROW], weights[D.FAULT_ROW + 1:]])
    assert torch.all((others == 0) | (others == 1))
    assert batch["tokens"].dtype == torch.int64  # integer tensors are kept too, for replay

    history = bundle.history()
    assert history[-1].step == D.FAULT_STEP and history[-1].loss == float("inf")
    losses = [e.loss for e in history[:-1]]
    assert all(np.isfinite(losses))
    log_tail = bundle.log_tail("train.log").decode()
    assert f"step   {D.FAULT_STEP}  loss inf" in log_tail


def test_loss_dropped_while_healthy(demo_run):
    out, _ = demo_run
    lines = (out / "train.log").read_text().splitlines()
    losses = [float(line.split()[3]) for line in lines if line.split()[2] == "loss"]
    assert len(losses) == D.FAULT_STEP + 1
    assert losses[0] > 4.0 and max(losses[-10:-1]) < 1.5  # ln(256) = 5.5 at start, ~0.7 nats is the floor


def test_rerun_is_idempotent_and_json(demo_run):
    out, proc = demo_run
    assert proc.returncode == 0
    before = tree_digest(out)
    result = CliRunner().invoke(main, ["demo", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert tree_digest(out) == before
    data = json.loads(result.stdout)
    assert data["caught"] is True and data["ok"] is True
    assert (data["first_invalid_step"], data["category"]) == (D.FAULT_STEP, "input")
    assert [s["name"] for s in data["stages"]] == [name for name, _ in D.STAGES]
    assert all(s["ok"] for s in data["stages"])
    assert data["summary"]["inputs_at_failure"][0]["name"] == "input:weights"


def test_replay_entry_rebuilds_the_failing_step(demo_run):
    """What replay will do: the bundle's state and batch reproduce the inf, and only the planted row causes it."""
    out, _ = demo_run
    bundle = load_bundle(out / "bundles" / D.RUN_ID / f"step-{D.FAULT_STEP}")
    spec = build_spec(bundle.replay_entry, bundle.config)
    model_state, optimizer_state = bundle.state()
    spec.model.load_state_dict(model_state)
    optimizer = spec.make_optimizer()
    optimizer.load_state_dict(optimizer_state)
    batch = bundle.batch()
    with D.torch_threads(1):
        assert spec.step_fn(spec.model, batch).item() == float("inf")
        assert spec.step_fn(spec.model, {k: v[D.FAULT_ROW:D.FAULT_ROW + 1] for k, v in batch.items()}).item() == \
            float("inf")
        keep = [i for i in range(len(batch["tokens"])) if i != D.FAULT_ROW]
        assert np.isfinite(spec.step_fn(spec.model, {k: v[keep] for k, v in batch.items()}).item())
        healthy = list(spec.batches)
        assert len(healthy) == bundle.config["replay_batches"]
        assert all(np.isfinite(spec.step_fn(spec.model, b).item()) for b in healthy)


def test_planted_record_lands_at_the_fault_step(tmp_path):
    config = D.demo_config(tmp_path)
    records = D.make_records(config)
    planted = D.plant_fault(records, config)
    D.write_dataset(Path(config["data_path"]), records)
    dataset = D.TokenRecords(config["data_path"], config["seq_len"])
    for step, (batch, ids) in enumerate(D.batches(dataset, config)):
        bad_rows = [i for i, row in enumerate(batch["weights"]) if row.max() >= D.MISSING_SENTINEL]
        if step == D.FAULT_STEP:
            assert bad_rows == [D.FAULT_ROW] and ids[D.FAULT_ROW] == planted
            break
        assert bad_rows == []


def test_dataset_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"id": "a", "tokens": [1, 2, 3], "weights": [1.0, 1.0]}\n{"id": "b", "tokens": [1]}\n')
    with pytest.raises(D.DataFileError, match=r"train\.jsonl:2: not a record"):
        D.TokenRecords(path, seq_len=2)
    path.write_text('{"id": "a", "tokens": [1, 2], "weights": [1.0, 1.0]}\n')
    with pytest.raises(D.DataFileError, match=r"train\.jsonl:1: record 'a' has 2 tokens and 2 weights, expected 3"):
        D.TokenRecords(path, seq_len=2)
    with pytest.raises(D.DataFileError, match="cannot read the dataset .*missing.jsonl"):
        D.TokenRecords(tmp_path / "missing.jsonl", seq_len=2)


def test_demo_exits_one_when_nothing_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "plant_fault", lambda records, config, **kw: None)
    monkeypatch.setitem(D.DEFAULT_CONFIG, "steps", 3)
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "not caught as designed" in result.stderr
    assert "trained 3 steps and nothing went non-finite" in result.stderr


def test_demo_leaves_the_callers_rng_and_threads_alone(tmp_path, monkeypatch):
    monkeypatch.setitem(D.DEFAULT_CONFIG, "steps", 2)
    monkeypatch.setattr(D, "plant_fault", lambda records, config, **kw: None)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    threads = torch.get_num_threads()
    D.run_demo(tmp_path)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


# -- the command line around the stages: cheap stand-in stages, so these run in well under a second ---------------

def fake_stages(bundle_path: Path, *, fail: str | None = None) -> list:
    """STAGES where detection "catches" the fault at FAULT_STEP with `bundle_path`, and the stage `fail` fails."""

    def detect(ctx):
        ctx.error = SimpleNamespace(step=D.FAULT_STEP, category="loss", bundle_path=bundle_path)
        return D.StageResult("detect", True, f"non-finite at step {D.FAULT_STEP}; bundle in {bundle_path}")

    def other(name):
        return lambda ctx: D.StageResult(name, name != fail, f"{name} {'failed' if name == fail else 'went fine'}")

    return [("detect", detect)] + [(name, other(name)) for name in ("localize", "ablate", "conclude")]


def test_demo_lines_and_paths_stay_whole_in_a_narrow_pipe(tmp_path, monkeypatch):
    """Piped or in a narrow terminal, a path with a space and brackets is printed whole, on one line, and the
    suggested next command can be pasted into a shell as it is."""
    out = tmp_path / "a rather long directory name [b] for the demo output"
    bundle = out / "bundles" / D.RUN_ID / f"step-{D.FAULT_STEP}"
    monkeypatch.setattr(D, "STAGES", fake_stages(bundle))
    result = CliRunner().invoke(main, ["demo", "--out", str(out)], env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert f"[detect] non-finite at step {D.FAULT_STEP}; bundle in {bundle}" in lines
    assert f"bundle: {bundle}" in lines
    (suggested,) = [line for line in lines if line.startswith("next:")]
    assert shlex.split(suggested.removeprefix("next:")) == ["nanscan", "report", str(bundle), "--html", "report.html"]


def test_demo_exits_one_when_a_later_stage_fails(tmp_path, monkeypatch):
    """Caught at the right step is not enough: a stage that fails afterwards stops the demo, which says so."""
    monkeypatch.setattr(D, "STAGES", fake_stages(tmp_path / "bundle", fail="ablate"))
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["caught"] is True and data["ok"] is False
    assert [s["name"] for s in data["stages"]] == ["detect", "localize", "ablate"]  # conclude never ran
    assert "did not go as designed (ablate: ablate failed)" in result.stderr


def test_demo_refuses_to_overwrite_files_it_did_not_write(tmp_path, monkeypatch):
    """`nanscan demo --out .` in a project must not replace the project's own data/train.jsonl or train.log."""
    monkeypatch.setattr(D, "STAGES", [("data", D.stage_data)])
    (tmp_path / "data").mkdir()
    mine = {tmp_path / "data" / "train.jsonl": b'{"text": "my own data"}\n', tmp_path / "train.log": b"my log\n"}
    for path, content in mine.items():
        path.write_bytes(content)
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "data/train.jsonl, train.log, which `nanscan demo` did not write" in result.stderr
    assert "pass --out with a new or empty directory" in result.stderr
    assert {path: path.read_bytes() for path in mine} == mine
    assert not (tmp_path / D.CONFIG_FILE).exists()


def test_an_earlier_demo_directory_is_reused(tmp_path):
    """A directory an earlier demo wrote (known by its dataset's exact bytes) is the demo's to rewrite; any other
    content under those names is not."""
    config = D.demo_config(tmp_path)
    records = D.make_records(config)
    D.plant_fault(records, config)
    D.claim_out_dir(tmp_path, config, records)  # empty: fine
    D.write_dataset(Path(config["data_path"]), records)
    (tmp_path / D.LOG_FILE).write_text("step    0  loss 5.5\n")
    D.claim_out_dir(tmp_path, config, records)
    data = Path(config["data_path"])
    data.write_bytes(data.read_bytes().replace(b"doc-00000", b"doc-99999"))
    with pytest.raises(D.DemoOutputError, match="already holds data/train.jsonl, train.log"):
        D.claim_out_dir(tmp_path, config, records)


def test_an_unusable_out_directory_is_a_usage_error_not_a_traceback(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = CliRunner().invoke(main, ["demo", "--out", str(blocker / "demo")])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert f"cannot create the demo directory {blocker / 'demo'}" in result.stderr
    assert "pass --out with a new or empty directory that you can write to" in result.stderr

    # a read-only directory (os.access, since the tests may run as root, whom permissions do not stop)
    monkeypatch.setattr(D.os, "access", lambda path, mode: False)
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "read-only")])
    assert result.exit_code == 2
    assert f"cannot write into {tmp_path / 'read-only'}: permission denied" in result.stderr


def test_a_file_error_inside_a_command_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    """What any subcommand meets when a file is not its to read (a bundle another user wrote) or the disk is full."""
    denied = tmp_path / "bundle" / "batch.safetensors"

    def fail(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(denied))

    monkeypatch.setattr(D, "run_demo", fail)
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot use {denied}: Permission denied; check its owner and permissions, or point nanscan at a "
        "copy or a directory you may use"]


def test_replay_entry_says_where_the_demo_config_is():
    with pytest.raises(ValueError, match=r"pass the config\.json that `nanscan demo` writes into its --out directory"):
        D.replay_entry({})


def test_help_documents_the_exit_statuses():
    runner = CliRunner()
    top = runner.invoke(main, ["--help"])
    assert top.exit_code == 0
    text = " ".join(top.stdout.split())
    assert "Exit status: 0 done; 1 a check failed or the command could not finish" in text
    assert "2 a usage error" in text
    demo = " ".join(runner.invoke(main, ["demo", "--help"]).stdout.split())
    assert "Exits 0 when every stage went as designed" in demo and "2 on a usage error" in demo

