"""on_invalid=Rollback(...) (nanscan.runtime.rollback NOTE: [rollback]) in real loops (a learning rate far too large:
tests/test_rollback_recovery.py): a corrupt record is skipped, quarantined, and
never seen by the next run through skip_quarantined; a fault in every batch stops after max_rollbacks with every
bundle named; the HF Trainer and Lightning roll back once each. Every decision is in the run's rollbacks.json and
the incident's INCIDENT.md."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import nanscan
from nanscan import Monitor, NonFiniteError, Rollback, RollbackWarning
from nanscan.bundle import load_bundle
from nanscan.bundle.quarantine import read_quarantine
from nanscan.engine.plans import ModelScanPlan
from nanscan.engine.record_digest import digest_object


def rollbacks(run_dir: Path) -> list[dict]:
    data = json.loads((run_dir / "rollbacks.json").read_text())
    assert data["format"] == "nanscan.rollbacks/1"
    return data["rollbacks"]


def finding(bundle: str) -> dict:
    (found,) = [f for f in load_bundle(bundle).findings() if f["key"] == "rollback"]
    return found


class Records(torch.utils.data.Dataset):
    """64 records (x, y) with stable ids "rec-<i>"; record `bad` holds a NaN."""

    def __init__(self, bad: int | None = 37):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
        if bad is not None:
            self.x[bad, 2] = float("nan")

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"id": f"rec-{i}", "x": self.x[i], "y": self.y[i]}


def fit_records(bundle_dir: Path, dataset, policy, *, epochs: int = 2, run_id: str = "records",
                ids: bool = True) -> tuple[Monitor, nn.Module, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, bundle_dir=bundle_dir, run_id=run_id, on_invalid=policy,
                  window=nanscan.runtime.window.Window(steps=4, every=4))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=False)
    updates = 0
    for _ in range(epochs):
        for batch in loader:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            report = mon.check(batch={"x": batch["x"], "y": batch["y"]}, loss=loss,
                               sample_ids=batch["id"] if ids else None)
            if report.ok:
                opt.step()
                updates += 1
    return mon, model, updates


def test_a_corrupt_record_is_skipped_quarantined_and_kept_out_of_the_next_run(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RollbackWarning)
        mon, model, updates = fit_records(tmp_path, Records(), Rollback(skip="step", settle_steps=2))
    said = [str(w.message) for w in caught if issubclass(w.category, RollbackWarning)]
    # record 37 is in batch 4 of each epoch: rolled back at the first, quarantined, and its step's update dropped at
    # the second, with no new incident (NOTE: [dropped update])
    assert len(said) == 2 and "rolled back: back to step 4's start" in said[0], said
    assert said[1].startswith("nanscan: the batch of step 12 holds 1 record(s) that a rollback of this run "
                              "quarantined (rec-37): the step's update is dropped"), said[1]
    (entry,) = rollbacks(tmp_path / "records")
    assert entry["at_step"] == 4 and entry["skipped_steps"] == [4] and entry["quarantined"] == ["rec-37"]
    assert entry["restored_from"] == "the live state at its check, before its update"
    outcome = entry["outcome"]
    assert outcome["status"] == "recovered" and outcome["finite_steps"] == 2 and outcome["steps"] == [5, 6]
    assert outcome["why"].endswith("the band of steps 0-3 before the restored state (median 0.6739)"), outcome
    assert mon.first_invalid_step is None
    assert updates == 14 and all(torch.isfinite(p).all() for p in model.parameters())
    quarantine = read_quarantine(tmp_path)
    assert [r.sample_id for r in quarantine.records] == ["rec-37"]
    # the next run never sees it: no incident, no rollback, one record fewer
    kept = nanscan.skip_quarantined(Records(), tmp_path, id_field="id")
    assert len(kept) == 63
    mon2, model2, updates2 = fit_records(tmp_path / "next", kept, Rollback(skip="step"), run_id="next")
    assert mon2.first_invalid_step is None and not (tmp_path / "next" / "next" / "rollbacks.json").exists()
    assert updates2 == 16


class Broken(nn.Module):
    """A linear model whose output is infinite at steps 5, 8, 11, ..., or at the steps `faults` names (set `step`
    before each forward)."""

    def __init__(self, faults: frozenset[int] | None = None):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.step = 0
        self.faults = faults

    def forward(self, x):
        out = self.fc(x)
        broken = self.step in self.faults if self.faults is not None else self.step >= 5 and self.step % 3 == 2
        return out * float("inf") if broken else out


def broken_run(tmp_path: Path, policy: Rollback, steps: int = 20, faults: frozenset[int] | None = None) -> None:
    torch.manual_seed(0)  # settle_steps=1: one step's loss is judged against the band (NOTE: [recovered])
    model = Broken(faults)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, opt, bundle_dir=tmp_path, run_id="broken", on_invalid=policy)
    for step in range(steps):
        model.step = step
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if mon.check(batch={"x": x, "y": y}, loss=loss).ok:
            opt.step()


def test_a_fault_in_every_batch_stops_after_max_rollbacks_with_every_bundle(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RollbackWarning)
        with pytest.raises(NonFiniteError, match="max_rollbacks=2") as caught:
            broken_run(tmp_path, Rollback(skip="step", max_rollbacks=2, settle_steps=1))
    assert caught.value.step == 11
    entries = rollbacks(tmp_path / "broken")
    assert [e["at_step"] for e in entries] == [5, 8]
    assert [e["outcome"]["status"] for e in entries] == ["recovered", "recovered"]  # for settle_steps=1 each
    message = str(caught.value)
    listed = message.split("the bundles of every attempt: ", 1)[1].split(", ")
    assert listed == [str(tmp_path / "broken" / f"step-{step}") for step in (5, 8, 11)]  # each once, none hidden
    for step in (5, 8, 11):
        assert (tmp_path / "broken" / f"step-{step}" / "manifest.json").exists()
    # the record ends where the run did, not on the last "recovered"
    stopped = json.loads((tmp_path / "broken" / "rollbacks.json").read_text())["stopped"]
    assert stopped["at_step"] == 11 and stopped["bundle"] == "step-11" and "max_rollbacks=2" in stopped["why"]
    found = finding(tmp_path / "broken" / "step-11")
    assert found["title"] == "Rollback: the run stopped at step 11"
    assert "step 5 (recovered), step 8 (recovered)" in found["body"]


def test_a_record_with_no_sample_id_is_quarantined_by_its_content_and_dropped_when_it_comes_back(tmp_path):
    """The NaN record comes back 8 steps after the rollback, and the loop passes no sample ids: the rollback named
    it by its content digest (NOTE: [quarantine match]), so its return is dropped, no new incident, and
    skip_quarantined keeps it out of the next run by the same digest."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RollbackWarning)
        mon, model, updates = fit_records(tmp_path, Records(), Rollback(skip="step", settle_steps=10), ids=False)
    said = [str(w.message) for w in caught if issubclass(w.category, RollbackWarning)]
    (entry,) = rollbacks(tmp_path / "records")
    (digest,) = entry["quarantined"]
    assert entry["at_step"] == 4 and digest.startswith("sha256:") and len(digest) == 71
    assert digest == "sha256:" + digest_object({"x": Records().x[37], "y": Records().y[37]})
    assert any(m.startswith(f"nanscan: the batch of step 12 holds 1 record(s) that a rollback of this run "
                            f"quarantined ({digest})") for m in said), said
    assert mon.first_invalid_step is None and updates == 14
    (record,) = read_quarantine(tmp_path).active()
    assert record.sha256 == [digest.removeprefix("sha256:")] and record.id is None
    # the records as collation stacked them into the batch the loop checked ({"x", "y"}): the same digest
    records = [{"x": r["x"], "y": r["y"]} for r in Records()]
    kept = nanscan.skip_quarantined(records, tmp_path)
    assert len(kept) == 63 and not any(torch.isnan(r["x"]).any() for r in kept)


def test_a_failure_again_within_settle_steps_raises(tmp_path):
    """A fault of the model (not of a record) at steps 5, 8, 11, ...: 3 steps after the rollback at step 5, within
    settle_steps=10, it is the same failure."""
    with pytest.raises(NonFiniteError, match="failed again at step 8, 3 step.* the same failure") as caught:
        with pytest.warns(RollbackWarning):
            broken_run(tmp_path, Rollback(skip="step", settle_steps=10))
    assert str(tmp_path / "broken" / "step-5") in str(caught.value)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="Rollback\\(skip='all'\\)"):
        Rollback(skip="all")
    with pytest.raises(ValueError, match="keeps no window"):
        Monitor(nn.Linear(2, 1), on_invalid=Rollback(), window=None)
    # a framework's tensor source that cannot load a kept state back (DeepSpeed's can: tests/test_deepspeed.py)
    with pytest.raises(ValueError, match="with a TensorSource .source=. that cannot load a state back"):
        Monitor(nn.Linear(2, 1), on_invalid=Rollback(), source=ModelScanPlan())
    # the string is the default policy; any other is refused, naming what works
    model = nn.Linear(2, 1)
    assert Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), on_invalid="rollback").on_invalid == Rollback()
    with pytest.raises(ValueError, match="'rollback' .Rollback\\(\\)."):
        Monitor(model, on_invalid="roll back")
