"""Ablation: one factor at a time from a bundle's state and batch, rows that do not fix kept, fixes confirmed on
held-out batches, an idempotent ledger, and the command line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import replay_entries as E
from nanscan.replay.ablate import FACTOR_KEYS, ablate, record_ablation, select_factors
from nanscan.bundle import load_bundle
from nanscan.cli.main import main
from nanscan.entry import ReplaySpec, replay_entry
from nanscan.replay import ReplayError


@pytest.fixture(scope="module")
def fp16_ablation(tmp_path_factory):
    path = E.train("fp16_overflow", tmp_path_factory.mktemp("fp16"))
    return path, ablate(path)


def test_fp16_overflow_table_keeps_every_row(fp16_ablation):
    _, result = fp16_ablation
    assert [r.factor.key for r in result.rows] == list(FACTOR_KEYS)
    baseline = result.baseline
    assert not baseline.outcome.finite
    assert baseline.first_bad == "proj (Linear, forward)"
    fp32 = result.row("fp32")
    assert fp32.outcome.finite and fp32.fixes
    assert fp32.outcome.param_dtypes == ["float32"] and fp32.outcome.autocast is None
    # the overflow is in this step's forward pass: a smaller learning rate cannot touch it
    lr = result.row("lr-x0.01")
    assert lr.applied and not lr.outcome.finite and not lr.fixes
    assert lr.first_bad == "proj (Linear, forward)"
    assert not result.row("lr-x0.1").outcome.finite
    fp16 = result.row("fp16-autocast")
    assert not fp16.outcome.finite and fp16.outcome.autocast == "float16"
    assert result.row("bf16-autocast").outcome.finite and result.row("bf16-autocast").outcome.autocast == "bfloat16"
    assert not result.row("clip-1.0").outcome.finite
    # every sample is too large for float16: bisection blames none of them, so there is nothing to drop
    drop = result.row("drop-suspicious")
    assert not drop.applied and not drop.dropped
    assert "not sample-specific: every sample fails on its own" in drop.note
    assert {r.factor.key for r in result.fixes} == {"fp32", "bf16-autocast"}


def test_a_fix_is_confirmed_on_held_out_batches(fp16_ablation):
    _, result = fp16_ablation
    confirmation = result.row("fp32").confirmation
    assert confirmation.source == "ReplaySpec.batches" and confirmation.batches == 3
    assert confirmation.finite_with_factor == 3 and confirmation.confirmed
    assert confirmation.finite_baseline == 3  # the healthy batches were fine anyway ...
    assert "specific to the failing batch" in confirmation.describe()  # ... and the report says what that means
    assert result.row("lr-x0.01").confirmation is None  # only fixes are confirmed
    listed = result.to_dict()["fixes"]
    assert {"factor": "fp32", "confirmed": True} in listed


def test_ablation_is_recorded_once_per_factor(fp16_ablation):
    path, result = fp16_ablation
    assert record_ablation(result) == 1 + len(FACTOR_KEYS)
    assert record_ablation(result) == 0
    bundle = load_bundle(path)
    keys = [f["key"] for f in bundle.findings() if f["key"].startswith("ablate:")]
    assert sorted(keys) == sorted(["ablate:baseline"] + [f"ablate:{k}" for k in FACTOR_KEYS])
    text = bundle.incident_text()
    assert text.count("### Ablation: learning rate x0.01: still non-finite (loss, first bad proj") == 1
    assert "### Ablation: precision: float32, autocast off: finite (confirmed on held-out batches)" in text


def test_dropping_the_poisoned_sample_fixes_it(tmp_path):
    path = E.train("poisoned_sample", tmp_path)
    result = ablate(path, factors=["drop-suspicious", "lr-x0.1", "clip-1.0"], holdout=2)
    drop = result.row("drop-suspicious")
    assert drop.fixes and drop.dropped == [E.POISON_ROW] and drop.dropped_ids == [f"s003-{E.POISON_ROW}"]
    assert drop.confirmation.batches == 2 and drop.confirmation.confirmed
    assert not result.row("lr-x0.1").outcome.finite and not result.row("clip-1.0").outcome.finite
    assert [r.factor.key for r in result.fixes] == ["drop-suspicious"]


def test_cli_ablate_json_with_chosen_factors(tmp_path):
    path = E.train("fp16_overflow", tmp_path)
    out = CliRunner().invoke(main, ["ablate", str(path), "--factor", "fp32", "--factor", "lr-x0.01", "--json",
                                    "--holdout", "1"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    rows = {r["factor"]: r for r in data["rows"]}
    assert set(rows) == {"fp32", "lr-x0.01"}
    assert rows["fp32"]["finite"] is True and rows["fp32"]["confirmation"]["batches"] == 1
    assert rows["lr-x0.01"]["finite"] is False and rows["lr-x0.01"]["loss"] == "nan"
    assert data["baseline"]["first_bad_module"] == "proj (Linear, forward)"
    assert data["recorded_changes"] == 3
    text = CliRunner().invoke(main, ["ablate", str(path), "--factor", "fp32", "--holdout", "0"],
                              env={"COLUMNS": "250"})
    assert text.exit_code == 0, text.output
    assert "precision: float32" in text.output and "not confirmed: held-out confirmation turned off" in text.output


def test_unknown_factor_is_refused():
    with pytest.raises(ValueError, match="unknown factor.*lr-x10"):
        select_factors(["lr-x10"])
    assert CliRunner().invoke(main, ["ablate", ".", "--factor", "lr-x10"]).exit_code == 2


@replay_entry
def autocast_inside(config: dict) -> ReplaySpec:
    """fp16_overflow's model in float32 whose step function turns on float16 autocast itself."""
    import torch

    spec = E.fp16_overflow(config)
    spec.model.float()

    def step(model, batch):
        with torch.autocast("cpu", dtype=torch.float16):
            return E.half_step(model, batch)

    return ReplaySpec(spec.model, spec.optimizer, step, None)


def test_a_precision_row_that_step_fn_overrides_is_not_counted(tmp_path):
    path = E.train("fp16_overflow", tmp_path)
    result = ablate(path, f"{__name__}:autocast_inside", factors=["fp32"])
    row = result.row("fp32")
    assert not row.applied and not row.fixes
    assert "step_fn sets its own autocast (float16)" in row.note


def test_no_held_out_batches_is_said(tmp_path):
    path = E.train("fp16_overflow", tmp_path)
    result = ablate(path, f"{__name__}:without_batches", factors=["fp32"])
    confirmation = result.row("fp32").confirmation
    assert confirmation.confirmed is None and "ReplaySpec.batches" in confirmation.reason


@replay_entry
def without_batches(config: dict) -> ReplaySpec:
    spec = E.fp16_overflow(config)
    return ReplaySpec(spec.model, spec.optimizer, spec.step_fn, None)


def test_a_learning_rate_factor_without_a_learning_rate_is_not_applied(tmp_path):
    path = E.train("no_learning_rate", tmp_path)
    result = ablate(path, factors=["lr-x0.1", "clip-1.0"])
    lr = result.row("lr-x0.1")
    assert not lr.applied and not lr.fixes and "no non-zero 'lr'" in lr.note
    assert result.row("clip-1.0").applied
    record_ablation(result)
    assert "### Ablation: learning rate x0.1: not applied" in load_bundle(path).incident_text()


def test_a_fix_is_not_credited_when_the_unchanged_step_does_not_fail_again(tmp_path):
    E.arm_transient(fail_at=5)
    path = E.train("transient", tmp_path)
    E.arm_transient(fail_at=0)  # the baseline's forward fails, and nothing after it
    result = ablate(path, factors=["lr-x0.1", "clip-1.0"])
    assert not result.baseline.outcome.finite
    assert [r.outcome.finite for r in result.rows] == [True, True]
    assert result.fixes == [] and all(r.confirmation is None for r in result.rows)
    assert "not deterministic here" in result.baseline.note and result.notes[-1] == result.baseline.note
    assert "not credited as a fix" in result.row("lr-x0.1").uncredited
    record_ablation(result)
    text = load_bundle(path).incident_text()
    assert "- finite, but the unchanged step is not deterministic here: not credited as a fix" in text


def test_an_unchanged_step_that_raises_stops_the_ablation(tmp_path):
    path = E.train("poisoned_sample", tmp_path)
    with pytest.raises(ReplayError, match="the unchanged step .* raised an error instead of running"):
        ablate(path, f"{E.MODULE}:loss_not_a_tensor", factors=["fp32"])
    out = CliRunner().invoke(main, ["ablate", str(path), "--entry", f"{E.MODULE}:loss_not_a_tensor"])
    assert out.exit_code == 1 and "fix the replay entry" in out.output
    assert not [f for f in load_bundle(path).findings() if f["key"].startswith("ablate:")]
