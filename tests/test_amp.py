"""Mixed precision under the real torch.amp.GradScaler on CPU (fp16 autocast), in both Monitor modes: overflow skips
are recorded, never bundled; a streak of them is a gradient incident naming its first step; inputs are incidents as
without a scaler; gradient statistics are unscaled exactly (nanscan.engine.stats NOTE: [unscaled gradients])."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nanscan
from nanscan import Monitor, NonFiniteError, load_bundle
from nanscan.engine import _layout as L
from nanscan.runtime.amp import MAX_SKIPS, MIN_SCALE
from nanscan.incident import SKIP_STREAK
from nanscan.review.summary import summarize
from nanscan.engine.stats import Scaling, TensorStats, unscaled_hist

MODES = ("sync", "async")
STEPS = 30


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def batch_at(step: int, seed: int = 0) -> dict:
    """Targets of magnitude ~100: at the default scale 2**16 the fp16 backward overflows for the first steps."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    return {"x": torch.randn(32, 16, generator=g), "y": 100 * torch.randn(32, 1, generator=g)}


class Run:
    """An fp16-autocast + GradScaler loop as people write it, with a Monitor checking before scaler.step()."""

    def __init__(self, mode: str, *, seed: int = 0, init_scale: float = 2.0 ** 16, tmp_path=None, **monitor):
        self.model = make_model(seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        self.seed = seed
        self.monitor = Monitor(self.model, self.opt, scaler=self.scaler, mode=mode, bundle_dir=tmp_path, **monitor)
        self.reports, self.scales, self.updated = [], [], []

    def step(self, step: int, *, nan_grad: bool = False, nan_input: bool = False):
        batch = batch_at(step, self.seed)
        if nan_input:
            batch["x"][3, 2] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            out = self.model(batch["x"])
            loss = nn.functional.mse_loss(out.float(), batch["y"])
        self.scaler.scale(loss).backward()
        if nan_grad:  # a backward-pass bug: the loss is finite, one gradient is NaN whatever the scale
            self.model[0].weight.grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in self.model.parameters()]
        report = self.monitor.check(batch=batch, loss=loss)
        scale = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.reports.append(report)
        self.scales.append((scale, self.scaler.get_scale()))
        self.updated.append(any(not torch.equal(a, p) for a, p in zip(before, self.model.parameters())))
        return report

    def scaler_skipped(self) -> list[bool]:
        """The steps GradScaler skipped, from its own scale: halved, and the weights untouched."""
        return [after < before for before, after in self.scales]


@pytest.mark.parametrize("mode", MODES)
def test_healthy_fp16_run_skips_a_few_steps_and_raises_nothing(mode, tmp_path):
    run = Run(mode, tmp_path=tmp_path)
    for step in range(STEPS):
        run.step(step)
    run.monitor.close()
    skipped = run.scaler_skipped()
    assert 2 <= sum(skipped) <= 10 and not any(skipped[15:])  # a few early skips, then it settles
    assert [not u for u in run.updated] == skipped  # GradScaler really skipped those updates
    assert run.monitor.first_invalid_step is None and run.monitor.bundle_path is None
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    history = run.monitor.history
    assert [e.report.overflow_skip for e in history] == skipped
    assert [e.report.scale for e in history] == [before for before, _ in run.scales]
    if mode == "sync":
        assert [r.overflow_skip for r in run.reports] == skipped
        assert [r.scale for r in run.reports] == [before for before, _ in run.scales]
    else:  # a PendingReport says, like its `ok`, whether the step it decided (the previous one) was skipped
        assert [r.overflow_skip for r in run.reports[1:]] == skipped[:-1]


def test_check_takes_the_scaler(tmp_path, monkeypatch):
    monkeypatch.setenv("NANSCAN_BUNDLE_DIR", str(tmp_path))
    run = Run("sync", tmp_path=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(run.model(batch_at(step)["x"]).float(), batch_at(step)["y"])
            run.scaler.scale(loss).backward()
            report = nanscan.check(run.model, run.opt, scaler=run.scaler)
            assert report.ok or report.overflow_skip
            run.scaler.step(run.opt)
            run.scaler.update()
            run.opt.zero_grad()
    assert nanscan.first_invalid(run.model) is None


@pytest.mark.parametrize("mode", MODES)
def test_nan_in_the_batch_under_a_scaler_is_an_input_incident(mode, tmp_path):
    run = Run(mode, tmp_path=tmp_path)
    with pytest.raises(NonFiniteError) as caught:
        for step in range(12):
            run.step(step, nan_input=step == 7)
        run.monitor.flush()
    assert caught.value.step == 7 and caught.value.category == "input"
    bundle = load_bundle(caught.value.bundle_path)
    assert bundle.manifest["reason"] == "nonfinite" and bundle.manifest["mixed_precision"]["streak"] is None
    assert torch.isnan(bundle.batch()["x"]).sum() == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("first_bad", [12, 20])
def test_gradients_nan_from_step_k_become_a_gradient_incident_at_k(mode, first_bad, tmp_path):
    """k after the run's early skips: a streak that continues those (no finite step between) starts with them."""
    run = Run(mode, tmp_path=tmp_path)
    with pytest.raises(NonFiniteError) as caught:
        for step in range(first_bad + MAX_SKIPS + 2):
            run.step(step, nan_grad=step >= first_bad)
        run.monitor.flush()
    error = caught.value
    assert error.step == first_bad and error.category == "gradient"
    assert run.monitor.first_invalid_step == first_bad
    assert not any(run.updated[first_bad:])  # the scaler skipped every update of the streak
    bundle = load_bundle(error.bundle_path)
    assert bundle.step == first_bad and bundle.category == "gradient"
    assert bundle.manifest["reason"] == SKIP_STREAK
    assert torch.equal(bundle.batch()["x"], batch_at(first_bad)["x"])
    streak = bundle.manifest["mixed_precision"]["streak"]
    assert streak["first_step"] == first_bad and streak["length"] <= MAX_SKIPS
    history = [s["scale_before"] for s in streak["scale_history"]]
    seen = [before for before, _ in run.scales[first_bad:]]  # sync raises inside the last check: one fewer
    assert history[:len(seen)] == seen and len(seen) >= len(history) - 1
    assert all(b == a / 2 for a, b in zip(history, history[1:]))
    assert streak["scale_history"][-1]["scale_after"] < MIN_SCALE or streak["length"] == MAX_SKIPS
    assert "streak of skipped steps" in bundle.incident_text() and "Mixed precision" in bundle.incident_text()
    summary = summarize(bundle)
    assert summary["reason"] == SKIP_STREAK and summary["mixed_precision"]["streak"]["first_step"] == first_bad
    assert summary["failing"]["step"] == first_bad


def test_max_skips_and_min_scale_are_settable(tmp_path):
    # From 2**9 this run does not overflow: its only skips are the planted ones, from step 2.
    run = Run("sync", tmp_path=tmp_path, init_scale=2.0 ** 9, max_skips=3, min_scale=0.0, on_invalid="warn")
    with pytest.warns(nanscan.NonFiniteWarning, match=r"3 consecutive overflow skips \(max_skips=3\)"):
        for step in range(6):
            run.step(step, nan_grad=step >= 2)
    assert run.monitor.first_invalid_step == 2 and run.scaler_skipped() == [False, False, True, True, True, True]
    with pytest.raises(ValueError, match="max_skips=0"):
        Monitor(make_model(), scaler=run.scaler, max_skips=0)
    with pytest.raises(TypeError, match="GradScaler"):
        Monitor(make_model(), scaler=object())


def _grad_stats(model, opt, batch, scaler=None, *, unscale_first=False, clip=None):
    """The Monitor's gradient statistics of one fp32 backward, scaled by `scaler` when given."""
    monitor = Monitor(model, opt, scaler=scaler, mode="sync", on_invalid="warn")
    loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if unscale_first:
        scaler.unscale_(opt)
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    report = monitor.check(batch=batch, loss=loss)
    monitor.close()
    return report, {s.name: s for s in report if s.name.startswith("grad:")}


@pytest.mark.parametrize("exponent", [1, 10, 24])
def test_unscaled_gradient_statistics_equal_the_unscaled_run(exponent):
    batch = batch_at(0)
    model = make_model()
    plain, plain_stats = _grad_stats(model, torch.optim.SGD(model.parameters(), lr=0.1), batch)
    model = make_model()
    scaled, scaled_stats = _grad_stats(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                       torch.amp.GradScaler("cpu", init_scale=2.0 ** exponent))
    assert scaled.scaling.grad_exponent == exponent and scaled.scale == 2.0 ** exponent
    for name, stats in plain_stats.items():
        got = scaled_stats[name]
        assert stats.subnormal == 0 and got.ok  # scaled values stayed finite and normal
        assert np.array_equal(got.exp_hist, stats.exp_hist), name
        assert (got.absmax, got.absmin, got.sumsq) == (stats.absmax, stats.absmin, stats.sumsq)
    assert np.array_equal(scaled.totals.exp_hist, plain.totals.exp_hist)
    raw = scaled.records[[i for i, t in enumerate(scaled.tensors) if t.name.startswith("grad:")],
                         L.REC_HIST:L.REC_HIST_END]
    assert not np.array_equal(raw.sum(axis=0), plain.totals.exp_hist)  # the records themselves stay scaled


def test_unscale_before_check_and_clipping_are_not_unscaled_twice():
    batch = batch_at(0)
    model = make_model()
    plain, plain_stats = _grad_stats(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, clip=1.0)
    model = make_model()
    report, stats = _grad_stats(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                                torch.amp.GradScaler("cpu", init_scale=2.0 ** 12), unscale_first=True, clip=1.0)
    assert report.scaling.scaled is False and report.scaling.grad_exponent == 0 and report.scale == 2.0 ** 12
    for name, expected in plain_stats.items():
        assert math.isclose(stats[name].sumsq, expected.sumsq, rel_tol=1e-5), name
        assert abs(int(np.argmax(stats[name].exp_hist)) - int(np.argmax(expected.exp_hist))) <= 1


def test_fused_optimizer_sees_scaled_gradients_and_skips_with_the_scaler(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    monitor = Monitor(model, opt, scaler=scaler, mode="async", bundle_dir=tmp_path)
    skipped = []
    for step in range(10):
        batch = batch_at(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(batch["x"]).float(), batch["y"])
        scaler.scale(loss).backward()
        report = monitor.check(batch=batch, loss=loss)
        assert report.scaling.scaled  # a fused step unscales inside the kernel: at the check they carry the scale
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.get_scale() < before)
    monitor.close()
    assert any(skipped) and monitor.first_invalid_step is None
    assert [e.report.overflow_skip for e in monitor.history] == skipped


def test_histogram_shift_edges():
    hist = np.zeros(L.HIST_BINS, np.int64)
    hist[[0, 1, 128, 254, 255]] = [5, 7, 11, 13, 17]
    down = unscaled_hist(hist, 3)  # x / 8: bins 1 and 0 merge into the clamped bin 0, bin 0 stays
    assert down[0] == 12 and down[125] == 11 and down[251] == 13 and down[252] == 17 and down.sum() == hist.sum()
    up = unscaled_hist(hist, -3)  # x * 8 (a scale below 1): bins 254 and 255 merge into 255
    assert up[255] == 30 and up[131] == 11 and up[3] == 5 and up[4] == 7 and up.sum() == hist.sum()
    assert np.array_equal(unscaled_hist(hist, 0), hist)


def test_unscaled_extremes_are_exact_float64_and_counts_stay():
    values = torch.tensor([2.0 ** -126, 3.0, -65504.0, 0.0, float("inf")], dtype=torch.float32)
    report = nanscan.scan({"grad:w": values}, backend="reference")
    record = report.records[0]
    stats = TensorStats.from_record("grad:w", "float32", "cpu", 5, L.FLOAT32, record, 16)
    assert stats.absmin == 2.0 ** -142 and stats.absmax == 65504.0 / 2 ** 16  # below fp32's normals, exact
    assert (stats.posinf, stats.zero, stats.subnormal) == (1, 1, 0)
    assert stats.sumsq == (2.0 ** -252 + 9.0 + 65504.0 ** 2) / 2 ** 32


def test_a_scale_that_is_no_power_of_two_leaves_statistics_scaled():
    scaling = Scaling(1000.0, True)
    assert scaling.grad_exponent == 0 and scaling.unscaled is False
    assert Scaling(2.0 ** -3, True).grad_exponent == -3 and Scaling(2.0 ** 5, False).grad_exponent == 0


def test_without_a_scaler_a_nonfinite_gradient_is_an_incident_at_once(tmp_path):
    model = make_model()
    monitor = Monitor(model, mode="sync", bundle_dir=tmp_path)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch_at(0)["x"]).float().sum()
    loss.backward()
    model[0].weight.grad[0, 0] = float("inf")
    with pytest.raises(NonFiniteError) as caught:
        monitor.check(loss=loss)
    assert caught.value.step == 0 and caught.value.category == "gradient"
    assert load_bundle(caught.value.bundle_path).manifest["mixed_precision"]["autocast"]["dtype"] == "bfloat16"


# False alarms and planted faults over several seeds: the detector's two error rates.
HEALTHY_SEEDS = range(4)
FAULTS = {"grad from 12": dict(nan_grad_from=12), "grad from 20": dict(nan_grad_from=20),
          "input at 9": dict(nan_input_at=9)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", HEALTHY_SEEDS)
def test_no_false_alarm_on_healthy_runs(mode, seed, tmp_path):
    for init_scale in (2.0 ** 16, 2.0 ** 24):
        run = Run(mode, seed=seed, init_scale=init_scale, tmp_path=tmp_path)
        for step in range(40):
            run.step(step)
        run.monitor.close()
        assert run.monitor.first_invalid_step is None and any(run.scaler_skipped())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_faults_are_caught_at_their_step(mode, fault, tmp_path):
    spec = FAULTS[fault]
    run = Run(mode, seed=1, tmp_path=tmp_path, on_invalid="warn")
    with pytest.warns(nanscan.NonFiniteWarning):
        for step in range(50):
            run.step(step, nan_grad=step >= spec.get("nan_grad_from", 10 ** 9),
                     nan_input=step == spec.get("nan_input_at"))
        run.monitor.close()
    assert run.monitor.first_invalid_step == spec.get("nan_grad_from", spec.get("nan_input_at"))


@pytest.mark.parametrize("mode", MODES)
def test_the_scale_growing_is_no_spike(mode, tmp_path):
    """GradScaler grows its scale (here 4-fold) after growth_interval finite steps, and so the scaled gradient norm in
    one step, far outside a steady run's range (here one batch over and over): spike detection (on by default)
    judges the real gradients' norm, and raises nothing on a healthy run."""
    run = Run(mode, init_scale=4.0, tmp_path=tmp_path)
    run.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_factor=4.0, growth_interval=40)
    run.monitor.scaler = run.scaler
    run.opt.param_groups[0]["lr"] = 1e-7  # the same batch, barely moving weights: a near-constant gradient norm
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanscan.SpikeWarning)
        for _ in range(90):
            run.step(0)
        run.monitor.close()
    grew = [s for s in range(90) if run.scales[s][1] > run.scales[s][0]]
    assert len(grew) == 2 and grew[0] >= 32  # grew 4-fold twice, after the spike statistic's warm-up
    assert run.monitor.spikes == []
