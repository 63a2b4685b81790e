"""The growth rule (issue 49; nanscan.runtime.spikes NOTE: [growth rule]), measured: nanoGPT's loop with a learning
rate too large for its warm-up is warned at least LEAD steps (13 to 18, by run and CPU) before its first non-finite
step, inside the spike statistic's warm-up, in both modes at the same step; healthy nanoGPT-like runs (float32, bf16 autocast, dropout 0.1,
peak learning rates up to 1e-2 with warm-up, accumulation 1 to 4) and fp16 GradScaler runs raise no warning at all;
the host, the device and the plain definition (binade_growth) agree on every step; a growth goes through the spike
policies and episodes, and its bundle's finding says "growth"."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from nanscan import demo as D
from nanscan import load_bundle
from nanscan.incident import ELEVATED, GROWTH, SPIKE, SpikeWarning
from nanscan.runtime.monitor import Monitor
from nanscan.runtime.spikes import QUANTITIES, DeviceStats, HostStats, SpikeRule, binade_growth, scores_from_verdict

import nanogpt_runs as N

# nanoGPT's DIVERGING run is warned at step 11 (bf16) and 14 (float32), 18 and 14 steps before its first
# non-finite step (29 and 28); the spike statistic alone is still warming up there (NOTE: [growth rule]). bf16
# matmuls round by the CPU's instruction set: on an EPYC without AVX-512 (Zen 3) the bf16 run is warned at step 18
# and goes non-finite at 31, 13 steps later. The least lead seen, by run:
LEAD = {"bf16": 13, "float32": 14}
ITERS = 200
FLOAT32 = {"dtype": "float32"}
LR_1E2 = {"learning_rate": 1e-2, "min_lr": 1e-3}
# Healthy runs beyond nanogpt_runs.HEALTHY_CONFIGS, checked once per step (its own are checked per micro-batch).
MORE_HEALTHY = {
    "float32-dropout": {**N.BASE, **FLOAT32, "dropout": 0.1},
    "float32-lr1e-2-warmup2": {**N.BASE, **FLOAT32, **LR_1E2, "warmup_iters": 2},
    "float32-lr1e-2-warmup100": {**N.BASE, **FLOAT32, **LR_1E2, "warmup_iters": 100},
    "bf16-lr1e-2-accum1": {**N.BASE, **LR_1E2, "accum": 1},
    "bf16-dropout-lr1e-2-accum4": {**N.BASE, **LR_1E2, "dropout": 0.1, "accum": 4},
}
DIVERGING = {"bf16": N.DIVERGING, "float32": {**N.DIVERGING, **FLOAT32}}
WARNED_STEP = re.compile(r"(?:spike|growth|elevated) at step (\d+)")
RULE = re.compile(r"(spike|growth|elevated) at step")


def warned_steps(run: N.NanoRun) -> list[int]:
    """The steps a run's warnings name (in mode="async" a warning is issued at the check after its step)."""
    return [int(WARNED_STEP.search(message).group(1)) for _, message in run.warnings]


# -- the definition ----------------------------------------------------------------------------------------------

def logs_of(values):
    return [math.log(v) if v is not None else math.nan for v in values]


@pytest.mark.parametrize("values, gained", [
    ([1, 2, 3, 4, 5, 6, 7, 8], 3.0),  # 8x in 8 steps, every one a rise
    ([1, 2, 1.5, 3, 4, 5, 6, 8], 3.0),  # one fall allowed
    ([1, 2, 1.5, 3, 2.5, 5, 6, 8], None),  # two falls
    ([1, 2, 3, 4, 5, 6, 7, 7.9], None),  # short of 3 binades
    ([9, 1, 2, 3, 4, 5, 6, 7, 8], None),  # not above an earlier value of the run
    ([0.5, 1, 2, 3, 4, 5, 6, 7, 8], 3.0),  # the earlier value is lower: growing
    ([1, 2, 3, 4, None, 5, 6, 7, 8], 3.0),  # a step without the quantity is skipped
    ([2, 3, 4, 5, 6, 7, 16], None),  # fewer than 8 finite values
])
def test_binade_growth_is_the_definition(values, gained):
    got = binade_growth(logs_of(values))
    assert got == (pytest.approx(gained, rel=1e-12) if gained is not None else None)


def test_binade_growth_takes_the_high_before_its_values():
    logs = logs_of([1, 2, 3, 4, 5, 6, 7, 8])
    assert binade_growth(logs, earlier_high=math.log(7.99)) is not None
    assert binade_growth(logs, earlier_high=math.log(8.0)) is None
    assert binade_growth(logs, steps=4, min_binades=0.5) == pytest.approx(math.log2(8 / 5))  # its last 4: 5 -> 8


def test_host_and_device_grow_by_the_definition_on_every_step():
    """Random walks with bursts of growth, some steps without a loss and some not ok (a scaler's overflow skip: not
    judged, not added): every step's growth scores are those of binade_growth over the quantity's finite history,
    on the host and on the device alike."""
    rule = SpikeRule(threshold=1e9, elevated_steps=0)  # only the growth rule fires
    rng = np.random.default_rng(7)
    steps = 800
    logs = np.cumsum(rng.normal(0.02, 0.15, size=(steps, 2)), axis=0)  # drifting up: new highs are common
    for start in rng.choice(steps - 12, 40, replace=False):  # ramps on both sides of 3 binades in 8 steps
        logs[start:start + 10] += np.linspace(0.0, rng.uniform(1.5, 5.0), 10)[:, None] * rng.uniform(0.5, 1.5, 2)
    logs[rng.choice(steps, 40, replace=False), 0] = math.nan  # no loss at these steps
    bad = np.zeros(steps, dtype=bool)
    bad[rng.choice(steps, 30, replace=False)] = True
    host, device = HostStats(rule), DeviceStats(rule, torch.device("cpu"))
    seen: list[list[float]] = [[], []]
    found = 0
    for step in range(steps):
        verdict = device.observe(torch.tensor(logs[step]), torch.tensor(bool(bad[step])))[0].numpy()
        if bad[step]:
            assert verdict[4].sum() == 0
            continue
        want = []
        for q, quantity in enumerate(QUANTITIES):
            if not math.isnan(logs[step, q]):
                seen[q].append(float(logs[step, q]))
                gained = binade_growth(seen[q])
                if gained is not None:
                    want.append((quantity, gained))
        got = [(s.quantity, s.z) for s in host.observe(list(logs[step]))]
        assert sorted(got) == sorted(want), step
        on_device = scores_from_verdict(verdict, rule)
        assert sorted((s.quantity, s.z) for s in on_device) == sorted(want), step
        assert all(s.kind == GROWTH for s in on_device)
        found += len(want)
    assert found > 20  # the comparison covered many growing steps, not only quiet ones


def test_the_rule_refuses_settings_it_cannot_use():
    with pytest.raises(ValueError, match="growth_steps"):
        SpikeRule(growth_steps=2)
    with pytest.raises(ValueError, match="growth_binades"):
        SpikeRule(growth_binades=0.0)
    assert SpikeRule(growth_steps=0).growth_steps == 0  # the rule off


# -- the Monitor: policies and episodes on a planted growth ------------------------------------------------------

GROWTH_FROM = 7  # the first step with 8 finite steps behind it


def growing_run(tmp_path, *, mode="sync", steps=GROWTH_FROM + 5, fused=False, **monitor_kwargs):
    """Regression on one batch scaled up 1.6x a step (so its loss and gradient norm 2.56x a step) with barely moving
    weights: growth from GROWTH_FROM on, long before the spike statistic's warm-up ends. Returns
    (monitor, reports)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-9, fused=fused or None)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="growing", mode=mode, **monitor_kwargs)
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    reports = []
    for step in range(steps):
        x = batch * 1.6 ** step
        optimizer.zero_grad(set_to_none=True)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        report = monitor.check(batch={"x": x}, loss=loss, step=step)
        if fused:
            optimizer.found_inf = report.found_inf
        optimizer.step()
        optimizer.__dict__.pop("found_inf", None)
        reports.append(report)
    monitor.close()
    return monitor, reports


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_growth_is_a_spike_warning_of_its_own_kind_warned_once_per_episode(tmp_path, mode):
    with pytest.warns(SpikeWarning) as caught:
        monitor, _ = growing_run(tmp_path, mode=mode)
    warned = [w.message for w in caught if issubclass(w.category, SpikeWarning)]
    assert [w.step for w in warned] == [GROWTH_FROM]  # one episode, warned once
    assert [s.step for s in monitor.spikes] == list(range(GROWTH_FROM, GROWTH_FROM + 5))  # every growing step kept
    spike = warned[0].spike
    assert spike.kind == GROWTH and spike.window == 8 and spike.to_dict()["kind"] == GROWTH
    assert {s.quantity for s in spike.scores} <= set(QUANTITIES) and spike.scores[0].z >= 3.0
    assert f"growth at step {GROWTH_FROM}" in str(warned[0]) and "binades" in str(warned[0])
    assert monitor.first_invalid_step is None


def test_a_growth_bundle_is_a_spike_bundle_whose_finding_says_growth(tmp_path):
    with pytest.warns(SpikeWarning):
        monitor, _ = growing_run(tmp_path, spikes="bundle")
    bundle = load_bundle(monitor.spike_bundle_path)
    assert bundle.category == SPIKE and bundle.step == GROWTH_FROM and bundle.nonfinite_tensors == []
    assert bundle.spike["kind"] == GROWTH
    text = bundle.incident_text()
    assert f"Growth at step {GROWTH_FROM}" in text and "binades gained" in text and "growth rule" in text
    # the report labels it as a growth, its start and the binades gained, not as a robust z over a median
    from click.testing import CliRunner
    from nanscan.cli.main import main

    out = CliRunner().invoke(main, ["report", str(monitor.spike_bundle_path)], terminal_width=200).output
    assert "growth: still rising over its last finite steps" in out and " binades" in out
    assert "(growth)" in out and "spike against the last" not in out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_skip_skips_the_growing_update_through_found_inf(tmp_path, mode):
    with pytest.warns(SpikeWarning):
        _, reports = growing_run(tmp_path, mode=mode, spikes="skip", fused=True)
    assert [float(r.found_inf) for r in reports] == [0.0] * GROWTH_FROM + [1.0] * 5


def test_raise_raises_it_and_growth_steps_0_turns_the_rule_off(tmp_path):
    with pytest.raises(SpikeWarning) as raised:
        growing_run(tmp_path / "raise", spikes="raise")
    assert raised.value.step == GROWTH_FROM and raised.value.spike.kind == GROWTH
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpikeWarning)
        monitor, _ = growing_run(tmp_path / "off", spike_rule=SpikeRule(growth_steps=0, elevated_steps=0))
    assert monitor.spikes == []


# -- measured: nanoGPT-like runs and fp16 GradScaler runs ----------------------------------------------------------

@pytest.fixture(scope="module")
def diverging(tmp_path_factory):
    root = tmp_path_factory.mktemp("nanogpt-diverging")
    return {name: N.train(config, root / name, iters=ITERS, window=None) for name, config in DIVERGING.items()}


def test_the_diverging_nanogpt_run_is_warned_before_its_nan(diverging):
    print("\n| run | first warning | its rule | first non-finite | lead |\n|---|---:|---|---:|---:|")
    for name, run in diverging.items():
        kind = RULE.search(run.warnings[0][1]).group(1) if run.warnings else None
        lead = None if run.first_warning is None else run.nonfinite_step - run.first_warning
        print(f"| nanoGPT {name} | {run.first_warning} | {kind} | {run.nonfinite_step} | {lead} |")
    for name, run in diverging.items():
        assert run.nonfinite_step is not None and run.nonfinite_step < SpikeRule().warmup, name
        assert run.first_warning is not None, f"nanoGPT {name} was never warned about"
        assert run.nonfinite_step - run.first_warning >= LEAD[name], (name, run.first_warning, run.nonfinite_step)
        # inside the spike statistic's warm-up: the growth rule, or the elevated rule (nanscan.runtime.spikes NOTE:
        # [elevated rule]: the bf16 run's loss stays 8x above its first step from its 8th check on)
        assert RULE.search(run.warnings[0][1]).group(1) in (GROWTH, ELEVATED)


def test_async_warns_the_same_steps_as_sync(tmp_path, diverging):
    run = N.train(DIVERGING["bf16"], tmp_path, iters=ITERS, window=None, mode="async")
    assert warned_steps(run) == warned_steps(diverging["bf16"])
    assert run.nonfinite_step == diverging["bf16"].nonfinite_step


@pytest.mark.parametrize("name, config, micro_checks",
                         [(name, config, True) for name, config in N.HEALTHY_CONFIGS.items()]
                         + [(name, config, False) for name, config in MORE_HEALTHY.items()])
def test_healthy_nanogpt_runs_raise_no_warning(tmp_path, name, config, micro_checks):
    run = N.train(config, tmp_path, iters=ITERS, window=None, micro_checks=micro_checks)
    assert run.nonfinite_step is None and run.steps == ITERS, f"{name} is not a healthy run"
    assert run.warnings == [], f"false alarm in healthy nanoGPT {name}: {run.warnings[0][1]}"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_healthy_fp16_gradscaler_runs_raise_no_warning(tmp_path, mode):
    """fp16 autocast with a GradScaler whose first steps overflow (targets of magnitude 100, as tests/test_amp.py
    builds them): the skipped steps are neither judged nor added, and nothing warns."""
    for seed, init_scale in ((0, 2.0 ** 16), (1, 2.0 ** 24)):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        monitor = Monitor(model, optimizer, scaler=scaler, mode=mode, bundle_dir=tmp_path, run_id=f"amp-{seed}")
        skipped = 0
        with warnings.catch_warnings(), D.torch_threads(1):
            warnings.simplefilter("error", SpikeWarning)
            for step in range(120):
                g = torch.Generator().manual_seed(1000 * seed + step)
                x, y = torch.randn(32, 16, generator=g), 100 * torch.randn(32, 1, generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                monitor.check(batch={"x": x, "y": y}, loss=loss)
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                skipped += scaler.get_scale() < scale
                optimizer.zero_grad(set_to_none=True)
            monitor.close()
        assert skipped >= 2 and monitor.first_invalid_step is None and monitor.spikes == []
