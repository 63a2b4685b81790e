"""The step summary of the Monitor's one-call host scan (NOTE: [step summary] in csrc/plan/plan_check.cpp): its
compact records, gradient and loss sums of squares and loss value equal what Python works out from the records
(`==`), for every loss dtype and for carried and frozen records, and the Monitor's history, spike statistic and
bundle take them."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from torch import nn

from nanscan.engine import _layout as L
from nanscan.engine import compact
from nanscan.engine.inputs import read_host_scalar
from nanscan.runtime.monitor import Monitor
from nanscan.engine.pending import HostScan
from nanscan.engine.plans import BatchPlan, ModelScanPlan
from nanscan.runtime.spikes import Rows, log_values, logs_of_sums
from nanscan.engine.stats import Scaling, ScannedTensor

LOSS_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
# Loss values that matter: ordinary, negative, signed zeros, subnormal in float16, huge, inf, NaN.
LOSS_VALUES = [2.5, -3.75, 0.0, -0.0, 3e-6, 6e4, math.inf, -math.inf, math.nan]


def model_and_optimizer(frozen: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if frozen:
        model[0].requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def backward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def python_summary(host: HostScan) -> tuple:
    """What the summary stands in for, worked out from the records in Python."""
    records = np.asarray(host.records)
    rows = Rows.of(host.tensors)
    sumsq = records[:, L.REC_SUMSQ].view(np.float64)
    grad = 0.0
    for r in rows.grad:  # row order, from 0.0, as nanscan.runtime.spikes.log_values adds them
        grad += float(sumsq[r])
    loss = float(sumsq[rows.loss[0]]) if len(rows.loss) else None
    return compact.encode_reference(records), grad, loss


def same_float(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b) or (math.isnan(a) and math.isnan(b))


def assert_summary_matches(host: HostScan) -> None:
    want_compact, want_grad, want_loss = python_summary(host)
    got = host.summary
    for part in ("scalars", "ranges", "counts"):
        g, w = getattr(got.compact, part), getattr(want_compact, part)
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), part
    assert np.array_equal(got.compact.decode(), np.asarray(host.records))
    assert same_float(got.grad_sumsq, want_grad)
    assert same_float(got.loss_sumsq, want_loss)


def scan_with(plan: ModelScanPlan, model, optimizer, batch, loss, backend_for) -> HostScan:
    if not plan.stable_tensors():  # a new plan: its first launch rebuilds it
        plan.launch(model, optimizer, extra=BatchPlan().prepare(batch, loss), backend_for=backend_for)
    host = plan.scan_on_host(model, optimizer, extra=BatchPlan().prepare(batch, loss), backend_for=backend_for)
    assert host is not None, "the plan's one-call host scan did not run"
    return host


@pytest.mark.parametrize("dtype", LOSS_DTYPES, ids=str)
def test_summary_equals_the_records_for_every_loss_dtype_and_value(native, tmp_path, dtype):
    model, optimizer = model_and_optimizer()
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="cpu")
    x = torch.randn(5, 6)
    backward(model, x)
    optimizer.step()  # creates the optimizer state, so the state rows are in the scan
    optimizer.zero_grad(set_to_none=True)
    backward(model, x)
    plan = ModelScanPlan()
    for value in LOSS_VALUES:
        loss = torch.tensor(value, dtype=torch.float32).to(dtype)
        host = scan_with(plan, model, optimizer, {"x": x}, loss, mon.backend_for)
        assert_summary_matches(host)
        assert [t.name for t in host.tensors].count("loss") == 1
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert host.summary.loss_value is None  # read in Python instead
        else:
            want = read_host_scalar(loss.data_ptr(), L.DTYPE_CODES[str(dtype).removeprefix("torch.")])
            assert same_float(host.summary.loss_value, want), (value, host.summary.loss_value, want)
            assert same_float(host.summary.loss_value, float(loss))


def test_summary_without_a_loss_or_gradients(native, tmp_path):
    model, optimizer = model_and_optimizer()
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="cpu")
    x = torch.randn(5, 6)
    host = scan_with(ModelScanPlan(), model, optimizer, {"x": x}, None, mon.backend_for)
    assert host.summary.loss_sumsq is None and host.summary.loss_value is None
    assert host.summary.grad_sumsq == 0.0  # no gradient row: the log norm is NaN, as log_values gives
    assert math.isnan(logs_of_sums(host.summary.loss_sumsq, host.summary.grad_sumsq)[1])
    assert_summary_matches(host)


def test_a_multi_element_loss_has_its_sum_but_no_value(native, tmp_path):
    model, optimizer = model_and_optimizer()
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="cpu")
    x = torch.randn(5, 6)
    backward(model, x)
    plan = ModelScanPlan()
    loss = torch.tensor([1.0, -2.0])
    host = scan_with(plan, model, optimizer, {"x": x}, loss, mon.backend_for)
    assert host.summary.loss_value is None and host.summary.loss_sumsq == 5.0
    assert_summary_matches(host)


@pytest.mark.parametrize("post_update", ["date", "scan"])
@pytest.mark.parametrize("frozen", [False, True])
def test_the_monitor_keeps_what_the_summary_gives(native, tmp_path, post_update, frozen):
    """Carried post-update records and a frozen layer's standing records are in the summary as in the records;
    the history's compact records, loss and the spike statistic's logs are the summary's."""
    model, optimizer = model_and_optimizer(frozen=frozen)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="cpu", post_update=post_update)
    seen: list[HostScan] = []
    scan_on_host = mon._plan.scan_on_host

    def recording(*args, **kwargs):
        host = scan_on_host(*args, **kwargs)
        if host is not None:
            seen.append(host)
        return host

    mon._plan.scan_on_host = recording
    g = torch.Generator().manual_seed(3)
    losses = []
    for step in range(8):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(5, 6, generator=g)
        loss = backward(model, x)
        losses.append(float(loss.detach()))
        report = mon.check(batch={"x": x}, loss=loss)
        assert report.ok
        if seen and seen[-1].records is report.records:
            host = seen[-1]
            assert_summary_matches(host)
            assert logs_of_sums(host.summary.loss_sumsq, host.summary.grad_sumsq, report.scaling) == \
                log_values(report.records, Rows.of(report.tensors), report.scaling)
        optimizer.step()
    assert len(seen) >= 6, "the Monitor's checks did not take the one-call host scan"
    history = mon.history
    assert [h.loss for h in history] == losses
    for entry, host in zip(history[-len(seen):], seen):
        assert np.array_equal(np.asarray(entry.report.records), np.asarray(host.records))


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("loss_sumsq", [None, 0.0, 4.0, math.inf, math.nan])
@pytest.mark.parametrize("grad_sumsq", [0.0, 1e-300, 9.0, math.inf, math.nan])
def test_summed_logs_equal_the_logs_of_the_records(loss_sumsq, grad_sumsq, scaled):
    """logs_of_sums gives what log_values reads from records holding those sums, under a GradScaler too."""
    tensors = [ScannedTensor("loss", "float32", "cpu", 1, L.FLOAT32)] if loss_sumsq is not None else []
    tensors.append(ScannedTensor("grad:w", "float32", "cpu", 4, L.FLOAT32))
    records = L.empty_records(len(tensors))
    sums = ([loss_sumsq] if loss_sumsq is not None else []) + [grad_sumsq]
    records[:, L.REC_SUMSQ] = np.array(sums, dtype=np.float64).view(np.int64)
    scaling = Scaling(1024.0, scaled)
    got = logs_of_sums(loss_sumsq, grad_sumsq, scaling)
    want = log_values(records, Rows.of(tensors), scaling)
    assert all(same_float(g, w) for g, w in zip(got, want)), (got, want)


def adversarial_batch() -> dict[str, torch.Tensor]:
    """Batch tensors whose records cover the histogram's corners: every bfloat16 pattern (bins from the lowest to
    the highest, NaN payloads, +-inf, subnormals), zeros only, NaN only, an empty tensor, subnormal float32."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    return {"bf16": bits.view(torch.bfloat16), "zeros": torch.zeros(9), "nan": torch.full((3,), math.nan),
            "empty": torch.empty(0), "tiny": torch.full((11,), 1e-45), "huge": torch.full((2,), 3e38)}


@pytest.mark.parametrize("chunk_elems", [5, 4096, L.DEFAULT_CHUNK_ELEMS])
def test_the_summary_of_corner_records_is_the_reference_compaction(native, tmp_path, chunk_elems):
    """Records of one chunk and merged from many, of empty tensors, zeros, NaNs and every bfloat16 pattern compact
    in the summary exactly as the reference compacts them."""
    from nanscan.engine.backends.cpu import CpuBackend

    model, optimizer = model_and_optimizer()
    x = torch.randn(5, 6)
    backward(model, x)
    optimizer.step()
    backward(model, x)
    backend = CpuBackend(chunk_elems=chunk_elems)
    host = scan_with(ModelScanPlan(), model, optimizer, {"x": x, **adversarial_batch()}, torch.tensor(0.5),
                     lambda devices: backend)
    assert host.nonfinite
    assert_summary_matches(host)


def test_a_non_finite_step_with_carried_records_is_summarised_whole(native, tmp_path):
    """A NaN at a step whose weights' records were carried: the step is scanned whole, and its summary is that of
    the whole scan's records."""
    model, optimizer = model_and_optimizer()
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", backend="cpu", post_update="scan",
                  on_invalid="warn")
    seen: list[HostScan] = []
    scan_on_host = mon._plan.scan_on_host

    def recording(*args, **kwargs):
        host = scan_on_host(*args, **kwargs)
        seen.append(host)
        return host

    mon._plan.scan_on_host = recording
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(5, 6, generator=g)
        if step == 4:
            x[0, 0] = math.nan
        loss = backward(model, x)
        with pytest.warns(Warning) if step == 4 else contextlib.nullcontext():
            report = mon.check(batch={"x": x}, loss=loss)
        if step < 4:
            optimizer.step()
    assert not report.ok and seen[-1] is not None and seen[-1].records is report.records
    assert_summary_matches(seen[-1])
    assert np.array_equal(np.asarray(report.records), np.asarray(mon.history[-1].report.records))
