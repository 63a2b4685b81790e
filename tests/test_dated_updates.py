"""An update that writes non-finite weights is dated to it by the next check, from stamps the update's hook took
(nanscan.runtime.update NOTE: [dated updates]): the same incident as the post-update scan's, one check later, and
never for a write that came after the update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import real_failures as R
from test_carried_records import train_step as step  # one checked step, then its update
from nanscan.bundle import iter_bundles, load_bundle
from nanscan.incident import SpikeWarning
from nanscan.runtime.monitor import Monitor, NonFiniteError
from nanscan.replay import replay

NOT_SPECIFIC = "not sample-specific"


def model_and_optimizer(kind: str = "sgd") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if kind == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=1e-2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})


def x_at(i: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(i))


def run_until_raised(model, optimizer, monitor, *, break_at: int, between=None, steps: int = 6):
    """Steps until the Monitor raises; the update of step `break_at` runs with lr=inf (a scheduler gone wrong);
    `between(model, optimizer)` runs after that update, before the next step."""
    with pytest.raises(NonFiniteError) as err:
        for i in range(steps):
            if i == break_at:
                lr = [g["lr"] for g in optimizer.param_groups]
                for g in optimizer.param_groups:
                    g["lr"] = float("inf")
            step(model, optimizer, monitor, x_at(i))
            if i == break_at:
                for g, value in zip(optimizer.param_groups, lr):
                    g["lr"] = value
                if between is not None:
                    between(model, optimizer)
    return err.value


@pytest.mark.parametrize("kind", ["sgd", "foreach", "fused"])
@pytest.mark.parametrize("post_update", ["auto", "date"])
def test_an_update_that_writes_inf_is_dated_to_its_step_by_the_next_check(tmp_path, kind, post_update):
    model, optimizer = model_and_optimizer(kind)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, mode="sync", post_update=post_update)
    err = run_until_raised(model, optimizer, monitor, break_at=2)
    assert (err.step, err.category) == (2, "update")
    assert "written by the optimizer update of step 2" in str(err)
    assert "seen at the check of step 3" in str(err)
    assert err.tensors and all(n.startswith(("param:", "optim:")) for n in err.tensors)
    assert monitor.first_invalid_step == 2
    bundle = load_bundle(err.bundle_path)
    assert (bundle.step, bundle.category, bundle.manifest["reason"]) == (2, "update", "optimizer_update")
    assert "dated at the check of step 3" in bundle.manifest["state"]["note"]


def test_a_dated_update_keeps_the_state_it_read_and_replay_reruns_it(tmp_path):
    # the fp16 eps trap, dated instead of scanned: the bundle holds step 0's pre-update state (kept past step 1's
    # start in the second snapshot buffer) and replay finds the same update and the same trap
    path = R.train("half_adam", tmp_path, post_update="date")
    bundle = load_bundle(path)
    assert (bundle.step, bundle.category, bundle.manifest["reason"]) == (0, "update", "optimizer_update")
    assert bundle.manifest["state"]["pre_step"]
    weights, _ = bundle.state()
    assert weights and all(torch.isfinite(t.float()).all() for t in weights.values())  # what the update read
    result = replay(path)
    assert result.reproduced and result.runs[0].category == "update" and result.same_category
    assert (result.localization.phase, result.localization.module) == ("update", "Adam")
    [trap] = result.update["traps"]
    assert (trap["setting"], trap["dtype"], trap["severity"]) == ("eps", "float16", "breaks")
    assert not result.bisect.applicable and NOT_SPECIFIC in result.bisect.reason


def test_the_kept_snapshot_is_the_one_of_the_dated_step(tmp_path):
    model, optimizer = model_and_optimizer()
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, mode="sync", post_update="date",
                      snapshot="cpu")
    before = {}

    def keep(i):
        if i == 2:
            before.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    with pytest.raises(NonFiniteError) as err:
        for i in range(6):
            keep(i)
            if i == 2:
                for g in optimizer.param_groups:
                    g["lr"] = float("inf")
            step(model, optimizer, monitor, x_at(i))
    stored, _ = load_bundle(err.value.bundle_path).state()
    assert set(stored) == set(before)
    assert all(torch.equal(stored[k], before[k]) for k in before)  # step 2's start, not step 3's


def test_a_write_after_the_update_is_not_dated_to_it(tmp_path):
    model, optimizer = model_and_optimizer()
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, mode="sync", post_update="date")

    def poison(model, optimizer):
        with torch.no_grad():  # an in-place write: moves the version counter
            model[0].weight[0, 0] = float("nan")

    with pytest.raises(NonFiniteError) as err:
        for i in range(6):
            step(model, optimizer, monitor, x_at(i))
            if i == 2:
                poison(model, optimizer)
    assert (err.value.step, err.value.category) == (3, "parameter")
    assert "optimizer update" not in str(err.value)


@pytest.mark.parametrize("kind", ["sgd", "fused"])
def test_an_unchecked_second_update_ends_the_dating(tmp_path, kind):
    # check, step, step: the second update follows no check, so nothing it writes is dated to the first (a fused
    # update moves no version counter: only the hook's dropping the stamps tells the two apart)
    model, optimizer = model_and_optimizer(kind)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, mode="sync", post_update="date")
    for i in range(3):
        step(model, optimizer, monitor, x_at(i))
    for g in optimizer.param_groups:
        g["lr"] = float("inf")
    optimizer.step()  # the gradients of step 2 again, unchecked
    with pytest.raises(NonFiniteError) as err:
        step(model, optimizer, monitor, x_at(3))
    assert (err.value.step, err.value.category) == (3, "parameter")


def test_a_dated_update_in_async_mode_is_read_with_the_next_steps_verdict(tmp_path):
    model, optimizer = model_and_optimizer()
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, mode="async", post_update="date")
    err = run_until_raised(model, optimizer, monitor, break_at=1)
    # step 2's scan (launched after the bad update of step 1) is read at step 3's check, after step 2's update
    # moved the stamps again: the stamps taken at step 2's launch date it
    assert (err.step, err.category) == (1, "update")
    assert "seen at the check of step 2" in str(err)


def test_healthy_runs_date_nothing(tmp_path):
    for kind in ("sgd", "foreach", "fused"):
        model, optimizer = model_and_optimizer(kind)
        monitor = Monitor(model, optimizer, bundle_dir=tmp_path / kind, spikes=None, mode="sync")
        reports = [step(model, optimizer, monitor, x_at(i)) for i in range(20)]
        assert all(r.ok for r in reports) and monitor.first_invalid_step is None
        assert monitor._updates.updates_dated == 20  # every update (each follows a check), stamped
        assert not list((tmp_path / kind).glob("*"))


def test_stamps_are_taken_only_for_what_the_update_could_write(tmp_path):
    # the plan's parameters that have a gradient, then every state tensor, in the check's row names: a frozen
    # weight is not among them
    model, optimizer = model_and_optimizer("foreach")
    model[2].bias.requires_grad_(False)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, mode="sync", post_update="date")
    for i in range(3):
        step(model, optimizer, monitor, x_at(i))
    tensors, names = monitor._plan.update_targets()
    trained = [f"param:{n}" for n, p in model.named_parameters() if p.requires_grad]
    assert names[:3] == trained and "param:2.bias" not in names
    assert len(names) == len(tensors) == 3 + 3 * 3  # step, exp_avg, exp_avg_sq per trained parameter
    assert all(n.startswith("optim:") for n in names[3:])
    assert all(t is p for t, p in zip(tensors, [p for p in model.parameters() if p.requires_grad]))


def test_a_nan_written_into_a_frozen_weight_is_not_dated_to_the_update(tmp_path):
    # no update writes a frozen weight: a `.data` write there (which moves no stamp) is that step's own incident
    model, optimizer = model_and_optimizer()
    model[0].bias.requires_grad_(False)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, mode="sync", post_update="date")
    with pytest.raises(NonFiniteError) as err:
        for i in range(6):
            step(model, optimizer, monitor, x_at(i))
            if i == 2:
                model[0].bias.data[0] = float("nan")
    assert (err.value.step, err.value.category) == (3, "parameter")
    assert "optimizer update" not in str(err.value)


def spike_then_inf_update(tmp_path) -> NonFiniteError:
    """45 steps: step 40's batch x1e3 (a finite loss spike) and its update with lr=inf."""
    model, optimizer = model_and_optimizer()
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="run", mode="sync", post_update="date")
    with pytest.warns(SpikeWarning), pytest.raises(NonFiniteError) as err:
        for i in range(45):
            for g in optimizer.param_groups:
                g["lr"] = float("inf") if i == 40 else 1e-2
            step(model, optimizer, monitor, x_at(i) * (1e3 if i == 40 else 1.0))
    return err.value


def test_a_spike_and_the_update_incident_of_the_same_step_each_keep_their_bundle(tmp_path):
    """Step 40's batch makes the loss spike (finite: its spike bundle is step-40) and its update runs with lr=inf
    (the update incident, dated to step 40 at the check of step 41): the incident gets its own directory,
    step-40-attempt-2, instead of losing its evidence to the spike's (NOTE: [bundle attempts])."""
    err = spike_then_inf_update(tmp_path)
    assert (err.step, err.category) == (40, "update")
    assert err.bundle_path == tmp_path / "run" / "step-40-attempt-2"
    spike, incident = load_bundle(tmp_path / "run" / "step-40"), load_bundle(err.bundle_path)
    assert (spike.category, incident.category) == ("spike", "update")
    assert [p.name for p in iter_bundles(tmp_path)] == ["step-40", "step-40-attempt-2"]
    # the same run again into the same directory writes the same names and keeps what is there
    assert spike_then_inf_update(tmp_path).bundle_path == err.bundle_path
    assert [p.name for p in iter_bundles(tmp_path)] == ["step-40", "step-40-attempt-2"]
