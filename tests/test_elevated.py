"""The elevated rule (nanscan.runtime.spikes NOTE: [elevated rule]; issue 59): a loss or gradient norm that jumped
and stays 3+ binades above its first step for 8 finite steps warns, where the spike statistic (still warming up)
and the growth rule (nothing rises step after step) are silent: karpathy's train.py at a learning rate of 15 with
no warm-up. The host and the device follow the plain definition on every step; healthy runs raise nothing
(tests/test_growth.py, tests/test_spikes.py and tests/test_amp.py run their healthy suites with the rule on)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from nanscan.incident import ELEVATED
from nanscan.runtime.spikes import QUANTITIES, DeviceStats, HostStats, SpikeRule, scores_from_verdict

import karpathy_train as K

RULE_OF = re.compile(r"(spike|growth|elevated) at step (\d+)")
# train.py at lr 15 without a warm-up: the loss goes 4.2 -> about 6000 at iteration 1 and stays at 900-3500
JUMPED = {"learning_rate": 15.0, "warmup_iters": 0}


def plain_definition(values: list[float], rule: SpikeRule) -> list[int]:
    """The indices (among a quantity's finite values) where the rule fires, from its words: the value has been at
    least elevated_binades above the first for elevated_steps values in a row, counted anew after a value below,
    within the first warmup + elevated_steps values."""
    fired, run = [], 0
    for i, v in enumerate(values):
        run = run + 1 if (v - values[0]) / math.log(2) >= rule.elevated_binades else 0
        if run == rule.elevated_steps and i < rule.warmup + rule.elevated_steps:
            fired.append(i)
    return fired


def test_host_and_device_follow_the_definition_on_every_step():
    """Random walks with jumps that stay, come back and go up again, some steps without a loss and some not ok (a
    scaler's overflow skip: neither judged nor counted); the spike statistic and the growth rule off."""
    rule = SpikeRule(threshold=1e9, growth_steps=0, warmup=48, window=64)
    rng = np.random.default_rng(3)
    total = 0
    for trial in range(40):
        steps = 70
        logs = rng.normal(0.0, 0.4, size=(steps, 2))
        for _ in range(3):  # jumps of 2 to 5 binades, for 4 to 19 steps
            start = int(rng.integers(1, steps - 4))
            logs[start:start + int(rng.integers(4, 20))] += math.log(2) * rng.uniform(2.0, 5.0, 2)
        logs[rng.choice(steps, 6, replace=False), 0] = math.nan
        bad = np.zeros(steps, dtype=bool)
        bad[rng.choice(steps, 5, replace=False)] = True
        host, device = HostStats(rule), DeviceStats(rule, torch.device("cpu"))
        kept: list[list[float]] = [[], []]
        for step in range(steps):
            verdict, fired = device.observe(torch.tensor(logs[step]), torch.tensor(bool(bad[step])))
            if bad[step]:
                assert not bool(fired), (trial, step)
                continue
            want = []
            for q, quantity in enumerate(QUANTITIES):
                if not math.isnan(logs[step, q]):
                    kept[q].append(float(logs[step, q]))
                    if len(kept[q]) - 1 in plain_definition(kept[q], rule):
                        want.append(quantity)
            got = host.observe(list(logs[step]))
            assert sorted(s.quantity for s in got) == sorted(want), (trial, step)
            on_device = scores_from_verdict(verdict.numpy(), rule)
            assert sorted(s.quantity for s in on_device) == sorted(want), (trial, step)
            assert bool(fired) == bool(want)
            assert all(s.kind == ELEVATED for s in got + on_device)
            for score in on_device:
                q = QUANTITIES.index(score.quantity)
                assert score.median == pytest.approx(math.exp(kept[q][0]))
            total += len(want)
    assert total > 20  # many firing steps compared, not only quiet ones


def test_it_fires_once_per_entry_and_only_early():
    rule = SpikeRule(threshold=1e9, growth_steps=0)
    host = HostStats(rule)
    fired = [step for step, v in enumerate([0.0] + [3.0] * 30 + [0.0] + [3.0] * 12) if host.observe([v, math.nan])]
    assert fired == [8, 39]  # the 8th step up, and again after it came down; not every step it stays up
    late = HostStats(rule)
    values = [0.0] * 40 + [3.0] * 20  # up only after warmup + elevated_steps steps: the spike statistic's case
    assert not any(late.observe([v, math.nan]) for v in values[:-1])


def test_a_jump_that_stays_up_in_train_py_is_warned_where_no_other_rule_speaks(tmp_path):
    run = K.train(JUMPED, tmp_path / "on")
    warned = [RULE_OF.search(message).groups() for _, message in run.warnings]
    assert run.losses[1] > 100 * run.losses[0] and min(run.losses[1:20]) > 8 * run.losses[0]
    assert warned and warned[0] == (ELEVATED, "8"), warned  # its 8th step at 8x or more above its first
    off = K.train(JUMPED, tmp_path / "off", spike_rule=SpikeRule(elevated_steps=0))
    assert off.warnings == []  # the gap the rule closes: neither the spike statistic nor the growth rule saw it


def test_the_rule_refuses_settings_it_cannot_use():
    with pytest.raises(ValueError, match="elevated_steps"):
        SpikeRule(elevated_steps=-1)
    with pytest.raises(ValueError, match="elevated_binades"):
        SpikeRule(elevated_binades=0.0)
