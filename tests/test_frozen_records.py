"""Frozen parameters are read when they change and at a period, their last records standing in otherwise
(nanscan.engine.plans NOTE: [frozen records]): a run's records are the same as a fresh scan's at every check, every
write that moves a stamp is seen at the next check, a NaN written through `.data` is still named at that check, and
parameters frozen or unfrozen between steps are handled."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nanscan.runtime.monitor import Monitor
from nanscan.engine.plans import BatchPlan, ModelScanPlan
from nanscan.scan import scan


class Adapted(nn.Module):
    """A linear layer frozen as a base, with a trainable low-rank adapter beside it (LoRA's shape)."""

    def __init__(self, width: int = 16, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def lora_model(optimize_all: bool = False, fused: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(Adapted(), nn.ReLU(), Adapted(), nn.Linear(16, 1))
    params = model.parameters() if optimize_all else [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2, fused=fused)


def batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(count)]


def step(model, optimizer, mon, x, *, update: bool = True, fresh: bool = True):
    """One checked training step; with `fresh`, also the records a new plan reads of everything at that check."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    expected = None
    if fresh:  # a new plan reads every tensor at its first check
        scanned = ModelScanPlan().launch(model, optimizer, extra=BatchPlan().prepare({"x": x}, loss),
                                         backend_for=mon.backend_for)
        expected = (scanned.tensors, np.array(scanned.records()))
    report = mon.check(batch={"x": x}, loss=loss)
    if update:
        optimizer.step()
    return report, expected


def monitor(model, optimizer, tmp_path, **kwargs) -> Monitor:
    return Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="cpu", **kwargs)


def record(report, name: str) -> np.ndarray:
    return np.array(report.records[report.names.index(name)])


def fresh_record(t: torch.Tensor) -> np.ndarray:
    return np.array(scan({"t": t}, backend="cpu").records[0])


FROZEN = "param:0.base.weight"


@pytest.mark.parametrize("post_update,optimize_all", [("date", False), ("scan", False), ("scan", True), (False, True)])
def test_records_are_a_fresh_scans_at_every_check(native, tmp_path, post_update, optimize_all):
    model, optimizer = lora_model(optimize_all)
    mon = monitor(model, optimizer, tmp_path, post_update=post_update)
    for x in batches(8):
        report, (tensors, expected) = step(model, optimizer, mon, x)
        assert report.tensors == tensors
        assert np.array_equal(np.array(report.records), expected)
    plan = mon._plan
    assert len(plan._frozen) == 4  # both bases' weights and biases
    # read at the rebuild, then once more after Adam's state rebuilt the plan; carried at every other check
    assert plan.frozen_rescans == 1 and plan._frozen_checks >= 5


def frozen_writes():
    """Writes to a frozen weight between two checks that move its stamp, each changing its values."""
    def no_grad_edit(model):
        with torch.no_grad():
            model[0].base.weight.mul_(3.0)

    def copied(model):
        with torch.no_grad():
            model[0].base.weight.copy_(torch.full_like(model[0].base.weight, 0.25))

    def loaded_state(model):
        model.load_state_dict({k: v * 7.0 if k == "0.base.weight" else v for k, v in model.state_dict().items()})

    def data_swap(model):
        model[0].base.weight.data = model[0].base.weight.data * 5.0

    def dtype_round_trip(model):  # a dtype change and back: the address moves, the version may not
        model[0].base.weight.data = model[0].base.weight.data.double().float() * 2.0

    return [no_grad_edit, copied, loaded_state, data_swap, dtype_round_trip]


@pytest.mark.parametrize("write", frozen_writes(), ids=lambda w: w.__name__)
def test_a_frozen_weight_written_between_checks_is_read_again(native, tmp_path, write):
    model, optimizer = lora_model()
    mon = monitor(model, optimizer, tmp_path)
    data = batches(6)
    for x in data[:4]:
        step(model, optimizer, mon, x, fresh=False)
    before = record(step(model, optimizer, mon, data[4], fresh=False)[0], FROZEN)
    write(model)
    report, (tensors, expected) = step(model, optimizer, mon, data[5])
    assert np.array_equal(record(report, FROZEN), fresh_record(model[0].base.weight))
    assert not np.array_equal(record(report, FROZEN), before)
    assert np.array_equal(np.array(report.records), expected)
    # and the new record stands in from then on: the next check still agrees with a fresh scan
    report, (_, expected) = step(model, optimizer, mon, data[0])
    assert np.array_equal(np.array(report.records), expected)


def test_a_frozen_weight_read_again_stands_in_from_the_next_check(native, tmp_path):
    """The read after a stamp moved refreshes the standing part in place (nanscan._C.PlanCheck): the check after
    it carries the new record, which a `.data` write (moving no stamp) in between makes visible."""
    model, optimizer = lora_model()
    mon = monitor(model, optimizer, tmp_path)
    data = batches(6)
    for x in data[:4]:
        step(model, optimizer, mon, x, fresh=False)
    with torch.no_grad():
        model[0].base.weight.mul_(3.0)
    edited = fresh_record(model[0].base.weight)
    assert np.array_equal(record(step(model, optimizer, mon, data[4], fresh=False)[0], FROZEN), edited)
    model[0].base.weight.data.mul_(2.0)
    assert np.array_equal(record(step(model, optimizer, mon, data[5], fresh=False)[0], FROZEN), edited)
    assert mon._plan.frozen_rescans == 1  # carried since the first read: the edit was one row read again


def test_a_finite_data_write_is_seen_at_the_period(native, tmp_path):
    """The blind spot, as NOTE: [frozen records] states it: a `.data` write moves no stamp, so until the frozen
    tensors are read again the weight's record is the one from before the write."""
    model, optimizer = lora_model()
    mon = monitor(model, optimizer, tmp_path, source=ModelScanPlan(frozen_period=3))
    data = batches(8)
    for x in data[:3]:  # the rebuild, Adam's state (a rebuild), and the first check that reads the frozen weights
        step(model, optimizer, mon, x, fresh=False)
    stale = fresh_record(model[0].base.weight)
    model[0].base.weight.data.mul_(4.0)  # finite; the forward reads it, but nothing becomes non-finite
    seen = [np.array_equal(record(step(model, optimizer, mon, x, fresh=False)[0], FROZEN), stale) for x in data[3:7]]
    assert seen == [True, True, True, False]  # three checks carried, the fourth read every frozen tensor
    assert np.array_equal(record(mon.history[-1].report, FROZEN), fresh_record(model[0].base.weight))


@pytest.mark.parametrize("post_update", ["scan", False])
def test_a_nan_written_through_data_into_a_frozen_weight_is_named_at_that_check(native, tmp_path, post_update):
    model, optimizer = lora_model()
    mon = monitor(model, optimizer, tmp_path, on_invalid="warn", post_update=post_update)
    data = batches(5)
    for x in data[:4]:
        step(model, optimizer, mon, x, fresh=False)
    model[0].base.weight.data[3, 2] = float("nan")  # no version bump: the stamp says unchanged
    with pytest.warns(Warning, match="category parameter"):
        report, _ = step(model, optimizer, mon, data[4], update=False, fresh=False)
    assert mon.first_invalid_step == 4
    assert FROZEN in report.nonfinite  # the loss went NaN, so the step was scanned whole
    assert report.stats[report.names.index(FROZEN)].nan == 1
    assert "loss" in report.nonfinite


def test_a_nan_in_a_frozen_weight_no_forward_reads_is_caught_at_the_period(native, tmp_path):
    model, optimizer = lora_model()
    model[0].add_module("unused", nn.Linear(4, 4).requires_grad_(False))  # in the model, never in its forward
    mon = monitor(model, optimizer, tmp_path, on_invalid="warn", post_update=False,
                  source=ModelScanPlan(frozen_period=3))
    data = batches(8)
    for x in data[:3]:
        step(model, optimizer, mon, x, fresh=False)
    model[0].unused.weight.data[0, 0] = float("nan")
    reports = []
    with pytest.warns(Warning, match="category parameter"):
        for x in data[3:7]:
            reports.append(step(model, optimizer, mon, x, fresh=False)[0])
    assert [r.ok for r in reports] == [True, True, True, False]
    assert mon.first_invalid_step == 6
    assert reports[-1].nonfinite == ["param:0.unused.weight"]


def test_a_parameter_unfrozen_between_steps_is_trained_and_scanned(native, tmp_path):
    model, optimizer = lora_model(optimize_all=True, fused=True)  # fused: an update moves no version counter
    mon = monitor(model, optimizer, tmp_path)
    data = batches(8)
    for x in data[:4]:
        step(model, optimizer, mon, x, fresh=False)
    rebuilds = mon._plan.rebuilds
    model[0].base.weight.requires_grad_(True)
    for x in data[4:8]:
        report, (tensors, expected) = step(model, optimizer, mon, x)
        assert np.array_equal(np.array(report.records), expected)
    assert mon._plan.rebuilds > rebuilds  # its gradient appeared
    assert not any(t is model[0].base.weight for t in mon._plan._frozen)
    assert "grad:0.base.weight" in report.names


def test_a_parameter_frozen_between_steps_is_carried_once_its_gradient_is_gone(native, tmp_path):
    model, optimizer = lora_model()
    mon = monitor(model, optimizer, tmp_path)
    data = batches(8)
    for x in data[:3]:
        step(model, optimizer, mon, x, fresh=False)
    adapter = model[0].up.weight
    adapter.requires_grad_(False)
    for x in data[3:8]:
        report, (tensors, expected) = step(model, optimizer, mon, x)
        assert np.array_equal(np.array(report.records), expected)
    assert any(t is adapter for t in mon._plan._frozen)
    assert "grad:0.up.weight" not in report.names
    with torch.no_grad():
        adapter.add_(1.0)
    report, (_, expected) = step(model, optimizer, mon, data[0])
    assert np.array_equal(np.array(report.records), expected)


def test_without_the_native_path_every_frozen_tensor_is_read(tmp_path):
    """The numba backend has no one-call host scan: the records are a fresh scan's, and nothing is kept."""
    pytest.importorskip("numba")
    model, optimizer = lora_model()
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="numba")
    for x in batches(5):
        report, (tensors, expected) = step(model, optimizer, mon, x)
        assert np.array_equal(np.array(report.records), expected)
    assert mon._plan._frozen_part is None and mon._plan.frozen_rescans == 0


def test_a_frozen_parameter_with_a_stale_gradient_is_read_every_step(native, tmp_path):
    """requires_grad=False does not stop an optimizer that still finds a gradient (zero_grad(set_to_none=False)
    leaves zeros, and Adam's momentum keeps moving the weight; fused, without moving its version counter): such a
    parameter is not frozen for the plan, even when the Monitor first sees it that way."""
    model, optimizer = lora_model(fused=True)
    data = batches(7)
    for x in data[:3]:  # trained without a Monitor: Adam has momentum for the adapter
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()
    adapter = model[0].up.weight
    adapter.requires_grad_(False)
    mon = monitor(model, optimizer, tmp_path)
    for x in data[3:7]:
        optimizer.zero_grad(set_to_none=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        fresh = ModelScanPlan().launch(model, optimizer, extra=BatchPlan().prepare({"x": x}, loss),
                                       backend_for=mon.backend_for)
        report = mon.check(batch={"x": x}, loss=loss)
        assert np.array_equal(np.array(report.records), np.array(fresh.records()))
        before = adapter.detach().clone()
        optimizer.step()
        assert not torch.equal(adapter, before)  # the update wrote it


def test_frozen_period_zero_reads_every_frozen_tensor_at_every_check(native, tmp_path):
    model, optimizer = lora_model()
    mon = monitor(model, optimizer, tmp_path, source=ModelScanPlan(frozen_period=0))
    data = batches(5)
    for x in data[:3]:
        step(model, optimizer, mon, x, fresh=False)
    model[0].base.weight.data.mul_(4.0)  # a .data write: only a read sees it
    report, (_, expected) = step(model, optimizer, mon, data[3])
    assert np.array_equal(np.array(report.records), expected)
    assert mon._plan._frozen_part is None
    with pytest.raises(ValueError, match="frozen_period=-1"):
        ModelScanPlan(frozen_period=-1)
