"""karpathy's nanoGPT train.py loop as it is (tests/karpathy_train.py: data drawn with torch's global generator,
eval forwards at iteration 0, the next batch fetched before backward, the loss divided over 2 micro-batches, a
GradScaler unscaling before clip_grad_norm_(1.0), tied weights, two AdamW groups) at learning rate 30 in float32,
with a replay entry written per the docs that declares neither clipping nor the loss scaling: caught at the step
an independent isfinite check finds, warned long before, the window rerun matching the record at every step from
what the Monitor observed (nanscan.runtime.loop_effects NOTE: [observed loop]), and the ablation over the window
judging each factor past the failing step for twice the steps it took to fail, the loss held to its level before
the divergence (nanscan.runtime.window_ablation NOTE: [window ablation])."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import karpathy_train as K
from nanscan.cli.main import main
from nanscan.replay.ablate_window import CONFIRMED, NOT_APPLIED, NOT_RECOVERED, ablate_window, horizon
from nanscan.bundle import load_bundle
from nanscan.replay.window import DEPART_REL_TOL, replay_window, window_markdown
from nanscan.runtime.window import Window

pytestmark = pytest.mark.filterwarnings("ignore::nanscan.incident.SpikeWarning")
WINDOW = Window(steps=32, every=8)


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    return K.train(K.LR30, tmp_path_factory.mktemp("mean"), window=WINDOW)


def test_caught_at_the_step_an_independent_isfinite_check_finds_and_warned_long_before(diverged):
    truth = K.train(K.LR30, None, monitor=False).truth
    assert diverged.nonfinite_step == truth == 27 and diverged.bundle is not None
    assert diverged.first_warning is not None and diverged.first_warning <= truth - 16


def test_the_window_rerun_matches_the_record_at_every_step_with_no_declaration(diverged):
    result = replay_window(diverged.bundle, K.ENTRY)
    assert result.reproduced and result.start == 0, result.headline()
    assert result.first_departure is None, result.departure_text()
    assert [s.step for s in result.steps] == list(range(diverged.nonfinite_step + 1))
    for s in result.steps[:-1]:
        assert abs(s.loss - s.recorded_loss) <= DEPART_REL_TOL * s.recorded_loss
        assert abs(s.grad_norm - s.recorded_grad_norm) <= DEPART_REL_TOL * s.recorded_grad_norm
    notes = " | ".join(result.notes)
    assert "clipping observed" in notes and "max_norm=1)" in notes
    assert "their mean (each loss x 1/2)" in notes


def test_a_loop_that_sums_its_micro_batch_losses_is_rerun_as_it_ran(tmp_path):
    run = K.train(K.LR30, tmp_path, sum_losses=True, window=WINDOW)
    assert run.nonfinite_step is not None
    result = replay_window(run.bundle, K.ENTRY)
    assert result.reproduced and result.first_departure is None, result.departure_text()
    assert any("summed over the 2 micro-batches" in note for note in result.notes)


def test_the_ablation_judges_each_factor_past_the_failure_and_finite_but_wrecked_is_not_fixed(diverged):
    result = ablate_window(diverged.bundle, K.ENTRY)
    assert result.baseline.verdict == "reproduced"
    rows = {r.factor.key: r for r in result.rows}
    # lr 15 and 3 keep the run finite but its loss in the hundreds and tens: not fixed
    for key in ("lr-x0.5", "lr-x0.1"):
        assert rows[key].verdict == NOT_RECOVERED and "before the run diverged" in rows[key].detail, rows[key].detail
        assert rows[key].beyond_run == horizon(rows[key].window, 16) == 56
    assert [r.factor.key for r in result.fixes] == ["lr-x0.01"]
    assert "the loss at" in rows["lr-x0.01"].detail
    assert rows["clip-1.0"].verdict == NOT_APPLIED and "observed" in rows["clip-1.0"].detail
    assert all(rows[k].verdict != CONFIRMED for k in ("bf16-autocast", "fp16-autocast"))


def test_what_users_type_ablates_over_the_window_and_step_keeps_the_single_step(diverged):
    """`nanscan ablate BUNDLE` runs over the window when the bundle holds one; --step is the single-step ablation."""
    out = CliRunner().invoke(main, ["ablate", str(diverged.bundle), "--entry", K.ENTRY, "--no-record", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["baseline"]["verdict"] == "reproduced" and data["fixes"] == ["lr-x0.01"]
    single = CliRunner().invoke(main, ["ablate", str(diverged.bundle), "--entry", K.ENTRY, "--no-record", "--step",
                                       "--factor", "lr-x0.1", "--holdout", "0", "--json"])
    assert single.exit_code == 0, single.output
    rows = json.loads(single.output)["rows"]  # the failing step alone: its state already wrecked by 27 steps
    assert [r["factor"] for r in rows] == ["lr-x0.1"] and rows[0]["finite"] is False
    assert "run_id" not in data and "window" in data["rows"][0]  # the window's rows name their span


def test_an_fp16_run_is_rerun_under_its_gradscaler_overflow_skips_included(tmp_path):
    """float16 autocast: the loop's GradScaler scales each micro-batch's loss, unscales before clipping and skips the
    updates whose gradients overflow. The window rerun does the same at each step's recorded scale (NOTE: [replayed
    scaling]): it matches the record at every step, skipping exactly where the run skipped (unscaled, it departed
    at step 1), and the ablation confirms a lower learning rate, not float32."""
    run = K.train({**K.LR30, "learning_rate": 5.0, "dtype": "float16"}, tmp_path, window=WINDOW)
    assert run.nonfinite_step is not None and run.bundle is not None
    skips = [entry.step for entry in load_bundle(run.bundle).history() if entry.report.overflow_skip]
    assert len(skips) >= 2 and skips[-1] < run.nonfinite_step  # the run's expected skips, no incident of theirs
    result = replay_window(run.bundle, K.ENTRY)
    assert result.reproduced and result.start == 0, result.headline()
    assert result.first_departure is None, result.departure_text()
    assert [s.step for s in result.steps if s.skipped] == [s.step for s in result.steps if s.recorded_skipped] == skips
    for s in result.steps[:-1]:
        assert abs(s.loss - s.recorded_loss) <= DEPART_REL_TOL * s.recorded_loss
    assert any("rerun at the scale its check recorded" in note for note in result.notes)
    assert "(overflow skip)" in window_markdown(result)
    rows = {r.factor.key: r for r in ablate_window(run.bundle, K.ENTRY).rows}
    assert any(rows[k].verdict == CONFIRMED for k in ("lr-x0.5", "lr-x0.1", "lr-x0.01")), rows
    assert rows["fp32"].verdict != CONFIRMED, rows["fp32"].detail
