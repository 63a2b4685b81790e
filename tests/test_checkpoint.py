"""A bundle as a checkpoint a trainer resumes from (`nanscan checkpoint`, nanscan.bundle.checkpoint NOTE: [bundle
checkpoint]): karpathy's train.py loop at learning rate 30, its bundle's window state at step 8 written as a
torch.distributed.checkpoint directory, loaded by plain DCP and set_state_dict into a fresh model and optimizer (the
two AdamW groups, the tied weight) bit for bit; a step trained from it with the recorded batches gives the run's
recorded loss at the next step (the optimizer's moments and step count came with it); written twice, the same
tensors; bad input refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import karpathy_train as K
from nanscan import load_bundle
from nanscan.bundle.checkpoint import RESUME_FILE, write_checkpoint
from nanscan.bundle.format import BundleError
from nanscan.cli.main import main
from nanscan.runtime.window import Window

pytestmark = pytest.mark.filterwarnings("ignore::nanscan.incident.SpikeWarning")
START = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return K.train(K.LR30, tmp_path_factory.mktemp("run"), window=Window(steps=32, every=8))


def _load(path):
    return K.load_checkpoint(path, K.LR30)


def test_the_window_state_loads_by_plain_dcp_and_trains_on_as_the_run_did(run, tmp_path):
    bundle = load_bundle(run.bundle)
    out = tmp_path / "ckpt"
    written = write_checkpoint(bundle, out, step=START)
    assert written.step == START and written.keys == ["model", "optimizer", "rng"] and not written.notes
    model, optimizer = _load(out)
    kept_model, kept_optimizer = bundle.window_state(START)
    for name, t in model.state_dict().items():
        assert torch.equal(t, kept_model[name]), name
    names = {id(p): n for n, p in model.named_parameters()}
    for index, p in enumerate(q for group in optimizer.param_groups for q in group["params"]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], kept_optimizer["state"][index][key]), (names[id(p)], key)
    resume = json.loads((out / RESUME_FILE).read_text())
    assert resume["step"] == START and resume["pre_step"] is True and resume["run_id"] == "train-py"
    # step START from the checkpoint, with the recorded micro-batches and learning rates, then step START + 1's
    # forward: the loss the run recorded there
    records = [r for r in bundle.window_records() if r.step in (START, START + 1)]
    for group, lr in zip(optimizer.param_groups, records[0].lrs):
        group["lr"] = lr
    for record in (r for r in records if r.step == START):
        _, loss = model(record.batch["x"], record.batch["y"])
        (loss / 2).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    with torch.no_grad():
        losses = [float(model(r.batch["x"], r.batch["y"])[1]) / 2 for r in records if r.step == START + 1]
    recorded = {e.step: e.loss for e in bundle.history()}[START + 1]
    assert math.isclose(sum(losses), recorded, rel_tol=1e-6), (sum(losses), recorded)


def test_the_failing_steps_state_by_the_command_and_twice_the_same(run, tmp_path):
    out = tmp_path / "ckpt"
    first = CliRunner().invoke(main, ["checkpoint", str(run.bundle), str(out)])
    assert first.exit_code == 0, first.output
    assert f"step {run.nonfinite_step}" in first.output and "model, optimizer, rng" in first.output
    model, _ = _load(out)
    bundle_model, _ = load_bundle(run.bundle).state()
    assert all(torch.equal(t, bundle_model[name]) for name, t in model.state_dict().items())
    again = CliRunner().invoke(main, ["checkpoint", str(run.bundle), str(out)])
    assert again.exit_code != 0 and "already exists" in again.output and "--overwrite" in again.output
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".distcp"}
    replaced = CliRunner().invoke(main, ["checkpoint", str(run.bundle), str(out), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".distcp"} == before


def test_a_step_with_no_kept_state_is_refused_with_the_ones_kept(run, tmp_path):
    with pytest.raises(BundleError, match=r"keeps no state at step 3: its window keeps \[0, 8, 16, 24\]"):
        write_checkpoint(load_bundle(run.bundle), tmp_path / "x", step=3)
    assert not (tmp_path / "x").exists()
