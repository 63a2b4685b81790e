"""Spike detection (issue 17), measured: the suite of tests/spike_runs.py warns about every diverging run at least
LEAD steps before its first non-finite step and never in a healthy run (both error rates, printed as a table);
the host and device statistics agree; the policies (warn, bundle, skip, raise, a callable, None) do what they
say; a spike bundle is category "spike", never the first invalid step, and report and triage show it apart."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import nanscan
from nanscan import demo as D
from nanscan import load_bundle
from nanscan.cli.main import main as cli_main
from nanscan.incident import SPIKE, SpikeWarning, layer_of
from nanscan.runtime.monitor import Monitor
from nanscan.review.summary import summarize
from nanscan.runtime.spikes import (QUANTITIES, DeviceStats, HostStats, Rows, SpikeRule, device_log_values, log_values,
                                    scores_from_verdict)
from nanscan.review.triage import triage

import spike_runs as R


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every run of the suite, sync mode (the CPU default), once for the whole module."""
    root = tmp_path_factory.mktemp("spike-runs")
    return {run.name: R.drive(run, root / str(i)) for i, run in enumerate(R.RUNS)}


def test_every_diverging_run_is_warned_early_and_no_healthy_run_at_all(outcomes):
    rows = [(o.name, "healthy" if o.healthy else "diverging", o.steps, o.first_warning,
             o.spikes[0].kind if o.spikes else None, o.first_nonfinite) for o in outcomes.values()]
    healthy_steps = sum(o.steps for o in outcomes.values() if o.healthy)
    false_alarms = sum(len(o.warnings) for o in outcomes.values() if o.healthy)
    print("\n| run | kind | steps | first warning | its rule | first non-finite |\n|---|---|---:|---:|---|---:|")
    for row in rows:
        print("| " + " | ".join("-" if v is None else str(v) for v in row) + " |")
    print(f"false alarms per 10,000 healthy steps: {1e4 * false_alarms / healthy_steps:.1f} "
          f"({false_alarms} in {healthy_steps})")
    for o in outcomes.values():
        if o.healthy:
            assert o.steps >= 300 and o.first_nonfinite is None, f"{o.name} is not a healthy run of 300+ steps"
            assert o.warnings == [] and o.spikes == [], f"false alarm in {o.name}: {o.spikes[0].describe()}"
        else:
            assert o.first_nonfinite is not None, f"{o.name} never went non-finite: not a diverging run"
            assert o.first_warning is not None, f"{o.name} was never warned about"
            assert o.first_nonfinite - o.first_warning >= R.LEAD, (o.name, o.first_warning, o.first_nonfinite)


def test_async_mode_judges_on_the_device_path_and_agrees_with_sync(tmp_path, outcomes):
    for run in R.RUNS:
        if run.healthy and run.name != "noisy regression":
            continue  # the healthy runs' agreement is the same code; one keeps the module fast
        got = R.drive(run, tmp_path / run.name.replace(" ", "-"), mode="async")
        want = outcomes[run.name]
        assert [s.step for s in got.spikes] == [s.step for s in want.spikes], run.name
        assert got.warnings == want.warnings and got.first_nonfinite == want.first_nonfinite
        for a, b in zip(got.spikes, want.spikes):
            assert [s.quantity for s in a.scores] == [s.quantity for s in b.scores]
            assert a.scores[0].z == pytest.approx(b.scores[0].z, rel=1e-9)


def test_the_warning_names_step_quantity_distance_and_first_moving_layers(outcomes):
    spike = outcomes["LR warm-up without end"].spikes[0]
    text = spike.describe()
    assert f"step {spike.step}" in text and spike.quantity in text and "robust z" in text and "last 64" in text
    assert spike.first_moving, "no tensor named as moving first"
    assert all(g["layer"] == layer_of(t["name"]) for g in spike.first_moving for t in g["tensors"])
    onsets = [g["onset"] for g in spike.first_moving]
    assert onsets == sorted(onsets) and onsets[0] <= spike.step


def test_an_outlier_batch_moves_every_layer_at_its_own_step(outcomes):
    spike = outcomes["outlier record of huge magnitude"].spikes[0]
    assert spike.step == R.OutlierRecord.OUTLIER_STEP
    assert {s.quantity for s in spike.scores} == {"loss", "grad_norm"}
    assert {g["onset"] for g in spike.first_moving} == {spike.step}


# -- the statistic -----------------------------------------------------------------------------------------------

def test_host_and_device_statistics_agree():
    rule = SpikeRule(window=16, warmup=8)
    rng = np.random.default_rng(0)
    logs = rng.normal(0, 0.1, size=(60, 2))
    logs[30] += [3.0, 0.0]  # a loss spike
    logs[45] += [0.0, 5.0]  # a gradient-norm spike
    host, device = HostStats(rule), DeviceStats(rule, torch.device("cpu"))
    for step, values in enumerate(logs):
        got = scores_from_verdict(device.observe(torch.tensor(values), torch.tensor(False))[0].numpy(), rule)
        want = host.observe(list(values))
        assert [s.quantity for s in got] == [s.quantity for s in want], step
        assert [s.z for s in got] == pytest.approx([s.z for s in want], rel=1e-12), step
        assert bool(got) == (step in (30, 45))


def test_host_statistic_is_the_plain_definition_on_every_step():
    """HostStats reads the median from a sorted copy of the window and works out the MAD only above min_ratio x the
    median: on windows that wrap many times, with ties and values on both sides of the ratio, every step's scores
    equal those of the definition (lower median and MAD of the last `window` values)."""
    rule = SpikeRule(window=16, warmup=8, threshold=2.0)
    rng = np.random.default_rng(3)
    logs = np.round(rng.normal(0, 0.3, size=(400, 2)), 1)  # rounded: many equal values in a window
    logs[rng.choice(400, 60, replace=False)] += rng.choice([0.5, 0.69, 0.7, 1.0, 3.0], size=(60, 1))
    host, seen = HostStats(rule), [[], []]
    found = 0
    for values in logs:
        want = []
        for q, (quantity, v) in enumerate(zip(QUANTITIES, values)):
            window = seen[q][-rule.window:]
            if len(window) >= rule.warmup:
                m = sorted(window)[(len(window) - 1) // 2]
                mad = sorted(abs(w - m) for w in window)[(len(window) - 1) // 2]
                z = (v - m) / max(1.4826 * mad, rule.min_scale)
                if z > rule.threshold and v - m > math.log(rule.min_ratio):
                    want.append((quantity, z))
            seen[q].append(v)
        got = [(s.quantity, s.z) for s in host.observe(list(values))]
        assert sorted(got) == sorted(want)
        found += len(got)
    assert found > 20  # the comparison covered many spikes, not only quiet steps


def test_a_non_finite_step_is_neither_judged_nor_counted():
    rule = SpikeRule(window=8, warmup=4)
    device = DeviceStats(rule, torch.device("cpu"))
    for _ in range(4):
        device.observe(torch.zeros(2, dtype=torch.float64), torch.tensor(False))
    verdict, _ = device.observe(torch.full((2,), 9.0, dtype=torch.float64), torch.tensor(True))
    assert verdict[0].sum() == 0 and torch.isnan(device.window[4]).all()


def test_slow_drift_and_noise_never_warn_but_a_jump_does():
    rule = SpikeRule()
    host = HostStats(rule)
    rng = np.random.default_rng(1)
    drift = [0.01 * i + rng.normal(0, 0.3) for i in range(400)]  # +1%/step and ~35% batch noise
    assert not any(host.observe([v, v]) for v in drift)
    assert host.observe([drift[-1] + 4.0, drift[-1]])  # 55x


def test_device_values_read_the_same_records_as_the_host():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).pow(2).mean().backward()
    report = nanscan.scan({"loss": torch.tensor(2.5), **{f"grad:{n}": p.grad for n, p in model.named_parameters()}})
    rows = Rows.of(report.tensors)
    want = log_values(report.records, rows)
    got = device_log_values(torch.from_numpy(np.array(report.records)), torch.as_tensor(rows.loss),
                            torch.as_tensor(rows.grad))
    assert got.tolist() == pytest.approx(want, rel=1e-15)
    assert want[0] == pytest.approx(math.log(2.5))
    assert want[1] == pytest.approx(math.log(math.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))))


def test_rule_refuses_settings_it_cannot_use():
    with pytest.raises(ValueError, match="warmup <= window"):
        SpikeRule(window=8, warmup=16)
    with pytest.raises(ValueError, match="min_ratio"):
        SpikeRule(min_ratio=0.5)
    with pytest.raises(ValueError, match="spikes='loud'"):
        Monitor(nn.Linear(2, 2), spikes="loud")


# -- the Monitor's policies on one planted spike -----------------------------------------------------------------

SPIKE_STEP = 40


def spiky_run(tmp_path, *, mode="sync", steps=SPIKE_STEP + 3, optimizer_kwargs=None, **monitor_kwargs):
    """Regression whose batch at SPIKE_STEP is 1000x too large (finite). Returns (monitor, reports, weights seen
    after each step)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, **(optimizer_kwargs or {}))
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="spiky", mode=mode, **monitor_kwargs)
    reports, weights = [], []
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 4, generator=gen) * (1000.0 if step == SPIKE_STEP else 1.0)
        optimizer.zero_grad(set_to_none=True)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        report = monitor.check(batch={"x": x}, loss=loss, step=step)
        reports.append(report)
        if monitor_kwargs.get("spikes") == "skip" or optimizer_kwargs:
            optimizer.found_inf = report.found_inf
        optimizer.step()
        optimizer.__dict__.pop("found_inf", None)
        weights.append(model.weight.detach().clone())
    monitor.close()
    return monitor, reports, weights


def test_warn_is_the_default_and_bundles_the_first_spike(tmp_path):
    with pytest.warns(SpikeWarning) as caught:
        monitor, reports, _ = spiky_run(tmp_path)
    warning = caught[0].message
    assert warning.step == SPIKE_STEP and warning.quantity in ("loss", "grad_norm")
    assert warning.bundle_path == monitor.spike_bundle_path and str(warning.bundle_path) in str(warning)
    assert reports[SPIKE_STEP].spike is warning.spike and reports[SPIKE_STEP].ok
    assert monitor.first_invalid_step is None and nanscan.first_invalid(monitor.model) is None
    bundle = load_bundle(monitor.spike_bundle_path)
    assert bundle.category == SPIKE and bundle.step == SPIKE_STEP and bundle.nonfinite_tensors == []
    assert bundle.spike["quantity"] == warning.quantity and bundle.batch()["x"].abs().max() > 100
    assert "# Spike at step 40" in bundle.incident_text()


def test_async_reads_the_spike_with_the_next_check(tmp_path):
    with pytest.warns(SpikeWarning) as caught:
        monitor, reports, _ = spiky_run(tmp_path, mode="async")
    assert caught[0].message.step == SPIKE_STEP
    assert reports[SPIKE_STEP].spike is None and reports[SPIKE_STEP + 1].spike.step == SPIKE_STEP
    assert load_bundle(monitor.spike_bundle_path).step == SPIKE_STEP


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_skip_skips_the_spiking_update_through_found_inf(tmp_path, mode):
    with pytest.warns(SpikeWarning):
        _, reports, weights = spiky_run(tmp_path, mode=mode, spikes="skip", optimizer_kwargs={"fused": True})
    assert float(reports[SPIKE_STEP].found_inf) == 1.0 and float(reports[SPIKE_STEP - 1].found_inf) == 0.0
    assert torch.equal(weights[SPIKE_STEP], weights[SPIKE_STEP - 1])  # the fused optimizer skipped it
    assert not torch.equal(weights[SPIKE_STEP + 1], weights[SPIKE_STEP])


def test_raise_raises_the_warning_and_a_callable_is_called(tmp_path):
    with pytest.raises(SpikeWarning) as raised:
        spiky_run(tmp_path / "raise", spikes="raise")
    assert raised.value.step == SPIKE_STEP
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spiky_run(tmp_path / "call", spikes=lambda spike, path: seen.append((spike.step, path)))
    assert seen and seen[0][0] == SPIKE_STEP and seen[0][1] is not None


def test_none_turns_detection_off_and_bundle_bundles_every_episode(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor, _, _ = spiky_run(tmp_path / "off", spikes=None)
    assert monitor.spikes == [] and not (tmp_path / "off").exists()
    with pytest.warns(SpikeWarning):
        monitor, _, _ = spiky_run(tmp_path / "bundle", spikes="bundle")
    assert [p.name for p in (tmp_path / "bundle" / "spiky").iterdir()] == [f"step-{SPIKE_STEP}"]


def test_a_non_finite_step_after_a_spike_is_the_first_invalid_step_and_lists_the_spike(tmp_path):
    outcome = R.drive(R.RUNS[5], tmp_path)  # outlier record
    incident = load_bundle(tmp_path / "outlier-record-of-huge-magnitude" / f"step-{outcome.first_nonfinite}")
    assert incident.category != SPIKE and incident.step == outcome.first_nonfinite
    assert incident.spikes[0]["step"] == outcome.first_warning
    assert summarize(incident)["spikes"][0]["step"] == outcome.first_warning


# -- report, triage and the demo ---------------------------------------------------------------------------------

def test_report_and_triage_show_spikes_apart(tmp_path):
    with pytest.warns(SpikeWarning):
        monitor, _, _ = spiky_run(tmp_path)
    summary = summarize(load_bundle(monitor.spike_bundle_path))
    assert summary["spike"]["scores"][0]["quantity"] in QUANTITIES and summary["spikes"][0]["step"] == SPIKE_STEP
    result = CliRunner().invoke(cli_main, ["report", str(monitor.spike_bundle_path), "--html",
                                           str(tmp_path.parent / "spike.html")])
    assert result.exit_code == 0 and "spike at step 40" in result.output
    assert "spike" in (tmp_path.parent / "spike.html").read_text()
    triaged = triage(tmp_path)
    assert triaged.entries == [] and [e.step for e in triaged.spikes] == [SPIKE_STEP]
    assert triaged.to_dict()["spikes"][0]["category"] == SPIKE


def test_diverging_demo_warns_long_before_the_nan(tmp_path):
    result = D.run_diverging(tmp_path)
    assert result.ok and result.first_invalid_step - result.first_warning_step >= 50
    assert load_bundle(result.spike_bundle).category == SPIKE
    assert load_bundle(result.incident_bundle).spikes[0]["step"] == result.first_warning_step
