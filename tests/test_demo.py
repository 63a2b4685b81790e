"""`nanscan demo` end to end: the planted corrupted record is caught at its step as a `loss` incident, the bundle
holds the evidence a replay needs, and a rerun into the same directory changes no byte."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from nanscan import demo as D
from nanscan.bundle import load_bundle
from nanscan.cli import main
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
    assert f"first invalid step {D.FAULT_STEP}, category loss" in proc.stdout
    assert f"bundle: {bundle}" in proc.stdout
    assert "input:weights" in proc.stdout  # the batch table shows the suspect tensor
    assert bundle.is_dir()


def test_bundle_holds_the_corrupted_batch_and_its_ids(demo_run):
    out, _ = demo_run
    bundle = load_bundle(out / "bundles" / D.RUN_ID / f"step-{D.FAULT_STEP}")
    m = bundle.manifest
    assert (m["first_invalid_step"], m["category"]) == (D.FAULT_STEP, "loss")
    assert [t["name"] for t in m["nonfinite_tensors"]] == ["loss"]
    assert m["replay_entry"] == D.REPLAY_ENTRY
    assert m["state"]["pre_step"] is True
    assert bundle.config == D.demo_config(out)

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
    assert data["caught"] is True
    assert (data["first_invalid_step"], data["category"]) == (D.FAULT_STEP, "loss")
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
