"""The post-update scan's records stand in for the next check's weights and optimizer state only while nothing wrote
them (nanscan.runtime.update NOTE: [carried records]): a run's records are the same with and without the carry, and
every kind of write between optimizer.step() and the check is seen at that check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nanscan.runtime.monitor import Monitor
from nanscan.scan import scan


def model_and_optimizer(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if kind == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})


def train_step(model, optimizer, mon, x, *, update: bool = True):
    optimizer.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    report = mon.check(batch={"x": x}, loss=loss)
    if update:
        optimizer.step()
    return report


def batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(count)]


def trained(kind: str, tmp_path, **kwargs) -> tuple[nn.Module, torch.optim.Optimizer, Monitor, torch.Tensor]:
    """A model, its optimizer and a post-update Monitor after three checked steps (the state exists, the plan is
    steady, the last update's records are carried), and the next step's batch."""
    model, optimizer = model_and_optimizer(kind)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, post_update=True, mode="sync", backend="cpu", **kwargs)
    data = batches(4)
    for x in data[:3]:
        train_step(model, optimizer, mon, x)
    return model, optimizer, mon, data[3]


@pytest.mark.parametrize("kind", ["sgd", "foreach", "fused"])
def test_a_run_has_the_same_records_with_and_without_the_carry(native, tmp_path, kind):
    runs = []
    for post_update in (True, False):
        model, optimizer = model_and_optimizer(kind)
        mon = Monitor(model, optimizer, bundle_dir=tmp_path / str(post_update), post_update=post_update,
                      mode="sync", backend="cpu")
        runs.append([np.array(train_step(model, optimizer, mon, x).records) for x in batches(6)])
        if post_update:
            # from the third check on (the first update creates the state, which rebuilds the plan) every
            # parameter and state tensor was offered
            stable = len(list(model.parameters())) + sum(
                isinstance(v, torch.Tensor) for s in optimizer.state.values() for v in s.values())
            assert mon._updates.records_offered >= 4 * stable
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def fresh_record(t: torch.Tensor) -> np.ndarray:
    return np.array(scan({"t": t}, backend="cpu").records[0])


def writes():
    """Writes a loop may make between optimizer.step() and the next check, each leaving weight 0 changed."""
    def no_grad_edit(model, optimizer):
        with torch.no_grad():
            model[0].weight.mul_(3.0)

    def data_swap(model, optimizer):
        model[0].weight.data = model[0].weight.data * 5.0

    def loaded_state(model, optimizer):
        state = {k: v * 7.0 for k, v in model.state_dict().items()}
        model.load_state_dict(state)

    def second_update(model, optimizer):  # an update without a check before it (fused: no version bump)
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()

    return [no_grad_edit, data_swap, loaded_state, second_update]


@pytest.mark.parametrize("write", writes(), ids=lambda w: w.__name__)
def test_a_write_between_the_update_and_the_check_is_seen(native, tmp_path, write):
    model, optimizer, mon, x = trained("fused", tmp_path)
    write(model, optimizer)
    report = train_step(model, optimizer, mon, x, update=False)
    index = report.names.index("param:0.weight")
    assert np.array_equal(np.array(report.records[index]), fresh_record(model[0].weight))


def test_optimizer_state_loaded_between_update_and_check_is_scanned_fresh(native, tmp_path):
    model, optimizer, mon, x = trained("foreach", tmp_path)
    state = optimizer.state_dict()
    for s in state["state"].values():
        s["exp_avg"] = s["exp_avg"] * 11.0
    optimizer.load_state_dict(state)
    report = train_step(model, optimizer, mon, x, update=False)
    exp_avg = optimizer.state[model[0].weight]["exp_avg"]
    index = report.names.index("optim:0.weight.exp_avg")
    assert np.array_equal(np.array(report.records[index]), fresh_record(exp_avg))


def test_a_nan_written_through_data_is_a_parameter_incident_at_that_check(native, tmp_path):
    """`.data` writes move no version counter: the check finds the NaN through the loss and is then scanned whole,
    so the weight itself is named (category parameter), not only what it poisoned."""
    model, optimizer, mon, x = trained("foreach", tmp_path, on_invalid="warn")
    model[0].weight.data[0, 0] = float("nan")
    with pytest.warns(Warning, match="category parameter"):
        report = train_step(model, optimizer, mon, x, update=False)
    assert mon.first_invalid_step == 3
    assert "param:0.weight" in report.nonfinite


def test_a_second_check_without_an_update_scans_everything(native, tmp_path):
    model, optimizer, mon, x = trained("foreach", tmp_path)
    train_step(model, optimizer, mon, x, update=False)
    offered = mon._updates.records_offered
    with torch.no_grad():
        model[0].weight.data.mul_(2.0)  # through .data: only a scan can see it
    report = train_step(model, optimizer, mon, x, update=False)
    assert mon._updates.records_offered == offered
    index = report.names.index("param:0.weight")
    assert np.array_equal(np.array(report.records[index]), fresh_record(model[0].weight))
