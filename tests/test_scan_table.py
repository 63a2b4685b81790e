"""nanscan._C.ScanTable (NOTE: [scan table] in csrc/plan/plan_check.cpp): the one-call host scan's input table, checked
once when it is made, and the records that PlanCheck.check_scan_summary makes over it: a new array every call, so a
report that a caller keeps never sees its records change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nanscan.engine import _layout as L
from nanscan.engine.backends.cpu import CpuBackend
from nanscan.runtime.monitor import Monitor
from nanscan.engine.plans import BatchPlan, ModelScanPlan


def test_the_table_refuses_what_a_scan_refuses(native):
    assert len(native.ScanTable(np.arange(1, 6), np.full(5, L.FLOAT32, dtype=np.int32))) == 5
    with pytest.raises(ValueError, match="ScanTable: numels and dtypes must have the same length"):
        native.ScanTable(np.array([1, 2]), np.array([L.FLOAT32], dtype=np.int32))
    with pytest.raises(ValueError, match=r"ScanTable: numels\[0\] is negative"):
        native.ScanTable(np.array([-1]), np.array([L.FLOAT32], dtype=np.int32))
    with pytest.raises(ValueError, match="ScanTable"):
        native.ScanTable(np.array([1]), np.array([99], dtype=np.int32))


def test_each_call_makes_its_own_records_equal_to_a_scan_of_the_same_tensors(native):
    """check_scan_summary over the plan's table returns new records every call, equal (`==`) to scan_cpu's over
    the same tensors; the records of an earlier call are left as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan, batches = ModelScanPlan(), BatchPlan()
    backend = CpuBackend()
    kept = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(4, 5)
        if step == 2:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        extra = batches.prepare({"x": x}, loss)
        host = plan.scan_on_host(model, optimizer, extra=extra, backend_for=lambda devices: backend)
        if host is None:  # no plan yet: the first inputs() builds it
            plan.inputs(model, optimizer, extra=extra)
            host = plan.scan_on_host(model, optimizer, extra=extra, backend_for=lambda devices: backend)
        assert host is not None
        inputs = plan.inputs(model, optimizer, extra=extra)
        ptrs, numels, codes = inputs.table()
        expected = L.empty_records(len(numels))
        native.scan_cpu(ptrs, numels, codes, expected, backend.chunk_elems, 0)
        assert host.records.shape == (len(numels), L.RECORD_WIDTH) and host.records.dtype == np.int64
        assert np.array_equal(host.records, expected)
        assert host.nonfinite == (step == 2)
        kept.append((host.records, expected))
        optimizer.step()
    assert len({id(records) for records, _ in kept}) == len(kept)
    for records, expected in kept:
        assert np.array_equal(records, expected)


def test_the_monitor_never_overwrites_a_report_it_returned(native, tmp_path):
    """Reports kept by the caller keep their records through the checks after them (a reuse of records arrays
    would have to prove that nothing holds them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, backend="cpu", on_invalid="raise", spikes=None)
    kept, copies = [], []
    for step in range(8):
        optimizer.zero_grad(set_to_none=True)
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        report = monitor.check(loss=loss)
        assert report.ok and report.backend == "cpu"
        if step % 2 == 0:  # half of them kept with a copy of what they held; the others dropped at once
            kept.append(report)
            copies.append(report.records.copy())
        optimizer.step()
        del report
    monitor.close()
    for report, copy in zip(kept, copies):
        assert np.array_equal(report.records, copy)
