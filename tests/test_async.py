"""Monitor(mode="async"): the verdict for step s is read at step s+1's check (or flush()/close()) and still names
step s with step s's evidence; report.found_inf skips a fused optimizer's update; the history ring stays bounded.

On CPU the scans complete at once (nanscan.engine.pending.CompletedScan) but go through the same one-step-late path as
GPU scans. Tests marked `cuda` run the GPU side (CUDA kernel, device ring, no host sync) and skip without a GPU."""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import nanscan
from nanscan.engine import compact
from nanscan import Monitor, NonFiniteError, NonFiniteWarning, load_bundle
from nanscan.engine import _layout as L
from nanscan.runtime.history import HistoryRing
from nanscan.incident import CATEGORIES
from nanscan.engine.pending import CompletedScan, ScanPart, StepScan
from nanscan.engine.stats import PendingReport, ScannedTensor, ScanReport
from test_monitor import EXPECTED_TENSORS, FAULT_STEP, forward_backward, make_batch, make_model, plant

try:
    from nanscan import _C
except ImportError:
    _C = None

HAS_GPU = torch.cuda.is_available() and _C is not None and hasattr(_C, "scan_cuda")


def gpu_test(fn):
    """Marks a test `cuda` and skips it, saying why, without a GPU and a CUDA build of nanscan._C."""
    reason = "no CUDA GPU (torch.cuda.is_available() is False)" if not torch.cuda.is_available() else \
        "nanscan._C has no CUDA part"
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_GPU, reason=reason)(fn))


@pytest.fixture(autouse=True)
def _bundles_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("NANSCAN_BUNDLE_DIR", str(tmp_path / "env-bundles"))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaNs in the same places counting as equal."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def step_once(mon: Monitor, model, optimizer, step: int, fault: str | None = None, *, fused_skip: bool = False,
              losses: list | None = None):
    """One training step of test_monitor's regression loop (a `fault` planted before it); returns the report and
    appends the loss to `losses`."""
    batch, loss = forward_backward(model, optimizer, step, fault)
    if losses is not None:
        losses.append(float(loss.detach()))
    report = mon.check(batch={k: batch[k] for k in ("x", "y", "scale")}, loss=loss, sample_ids=batch["ids"])
    if report.ok:
        if fused_skip:
            optimizer.found_inf = report.found_inf
        optimizer.step()
        if fused_skip:
            del optimizer.found_inf
    return report


def train(mon, model, optimizer, steps: int, fault: str | None = None, fault_step: int = FAULT_STEP, **kwargs):
    return [step_once(mon, model, optimizer, s, fault if s == fault_step else None, **kwargs) for s in range(steps)]


def setup(seed: int = 0, **monitor_kwargs):
    model = make_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer, Monitor(model, optimizer, **monitor_kwargs)


# -- the one-step-late verdict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", CATEGORIES)
def test_verdict_arrives_one_check_later_and_names_the_failing_step(fault, tmp_path):
    model, optimizer, mon = setup(bundle_dir=tmp_path, run_id="run", mode="async", config={"fault": fault})
    reports, losses = [], []
    with pytest.raises(NonFiniteError) as caught:
        for step in range(6):
            reports.append(step_once(mon, model, optimizer, step, fault if step == FAULT_STEP else None,
                                     losses=losses))
    err = caught.value
    assert len(reports) == FAULT_STEP + 1 and mon.step == FAULT_STEP + 2, "raised inside the next step's check"
    assert all(isinstance(r, PendingReport) and r.ok for r in reports)
    assert (err.step, err.category, err.tensors) == (FAULT_STEP, fault, EXPECTED_TENSORS[fault])
    assert "mode='async'" in str(err) and mon.first_invalid_step == FAULT_STEP
    assert err.bundle_path == tmp_path / "run" / f"step-{FAULT_STEP}"
    bundle = load_bundle(err.bundle_path)
    assert bundle.manifest["category_tensors"] == EXPECTED_TENSORS[fault]
    assert [e.step for e in bundle.history()] == list(range(FAULT_STEP + 1))
    assert [e.report.ok for e in bundle.history()] == [True] * FAULT_STEP + [False]
    assert bundle.sample_ids == list(range(16 * FAULT_STEP, 16 * (FAULT_STEP + 1))), "step 3's ids, not step 4's"
    expected = make_batch(FAULT_STEP)
    if fault in ("input", "loss"):  # the faults planted in the batch itself
        plant(fault, model, optimizer, expected)
    for key in ("x", "y", "scale"):
        assert same_values(bundle.batch()[key], expected[key]), f"step {FAULT_STEP}'s {key}, not step 4's"
    assert same_values(torch.tensor(bundle.history()[-1].loss), torch.tensor(losses[FAULT_STEP]))


def test_async_and_sync_bundles_hold_the_same_evidence(tmp_path):
    bundles = {}
    for mode in ("sync", "async"):
        model, optimizer, mon = setup(bundle_dir=tmp_path / mode, run_id="r", mode=mode, snapshot="cpu")
        with pytest.raises(NonFiniteError) as caught:
            train(mon, model, optimizer, steps=6, fault="gradient")
        assert caught.value.step == FAULT_STEP
        bundles[mode] = load_bundle(caught.value.bundle_path)
    sync, late = bundles["sync"], bundles["async"]
    for key in ("category", "category_tensors", "nonfinite_tensors", "loss", "lr", "grad_norm", "first_invalid_step"):
        assert sync.manifest[key] == late.manifest[key], key
    assert late.manifest["state"]["pre_step"] is True
    for name, t in sync.batch().items():
        assert torch.equal(late.batch()[name], t), name
    (sync_model, sync_optim), (late_model, late_optim) = sync.state(), late.state()
    for key, value in sync_model.items():
        assert torch.equal(late_model[key], value), f"the pre-step snapshot of step 3 was overwritten: {key}"
    for index, state in sync_optim["state"].items():
        for key, value in state.items():
            assert torch.equal(late_optim["state"][index][key], value), (index, key)
    sync_history, late_history = sync.history(), late.history()
    assert [e.step for e in sync_history] == [e.step for e in late_history]
    for a, b in zip(sync_history, late_history):
        assert np.array_equal(a.report.records, b.report.records) and a.report.names == b.report.names
        assert (a.loss, a.lr, a.grad_norm) == (b.loss, b.lr, b.grad_norm)


def test_ok_reports_the_previous_steps_verdict_and_close_reads_the_last(tmp_path):
    model, optimizer, mon = setup(bundle_dir=tmp_path, run_id="w", on_invalid="warn", mode="async")
    with pytest.warns(NonFiniteWarning, match="non-finite values at step 3") as record:
        reports = train(mon, model, optimizer, steps=6, fault="parameter")  # the inf weight stays
        assert mon.invalid_steps == 1, "step 5's verdict is still pending"
        mon.close()
    assert len(record) == 1
    assert [r.ok for r in reports] == [True, True, True, True, False, False]
    assert [r.decided_step for r in reports] == [None, 0, 1, 2, 3, 4]
    assert [r.result().ok for r in reports] == [True, True, True, False, False, False]
    assert mon.first_invalid_step == 3 and mon.invalid_steps == 2
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["step-3"]


def test_flush_decides_before_the_update(tmp_path):
    model, optimizer, mon = setup(bundle_dir=tmp_path, mode="async")
    train(mon, model, optimizer, steps=FAULT_STEP)
    assert mon.flush().ok and mon.flush() is None, "a finite step's report, then nothing is pending"
    step_once(mon, model, optimizer, FAULT_STEP, "parameter")
    with pytest.raises(NonFiniteError) as caught:
        mon.flush()
    assert caught.value.step == FAULT_STEP and "mode='async'" not in str(caught.value)
    note = load_bundle(caught.value.bundle_path).manifest["state"]["note"]
    assert "read at flush()" in note


def test_skip_policy_drops_the_next_steps_gradients(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="async", on_invalid="skip")
    with pytest.warns(NonFiniteWarning):
        reports = train(mon, model, optimizer, steps=FAULT_STEP + 2, fault="input", fused_skip=True)
    assert [r.ok for r in reports] == [True] * (FAULT_STEP + 1) + [False]
    assert all(p.grad is None for p in model.parameters())
    assert reports[-1].result().ok, "found_inf kept step 3's NaN out of the weights, so step 4 was finite"


def test_callable_policy_gets_the_finished_report_of_the_failing_step(tmp_path):
    calls = []
    model, optimizer, mon = setup(bundle_dir=tmp_path, mode="async",
                                  on_invalid=lambda report, path: calls.append((report, path)))
    train(mon, model, optimizer, steps=5, fault="parameter")
    mon.close()
    assert [r.step for r, _ in calls] == [3, 4]
    assert all(type(r) is ScanReport and not r.ok for r, _ in calls)
    assert calls[0][0].nonfinite[0] == "param:0.weight"


def test_cpu_batch_is_kept_as_a_copy_until_the_verdict(tmp_path):
    model = nn.Linear(4, 1)
    mon = Monitor(model, bundle_dir=tmp_path, mode="async")
    buffer = {"x": torch.ones(8, 4)}  # a loader that refills one buffer in place
    ids = np.arange(8)
    buffer["x"][2, 3] = float("nan")
    model(buffer["x"]).sum().backward()
    mon.check(batch=buffer, sample_ids=ids)
    buffer["x"].fill_(7.0)
    ids += 100
    with pytest.raises(NonFiniteError) as caught:
        mon.check(batch=buffer)
    bundle = load_bundle(caught.value.bundle_path)
    assert caught.value.step == 0 and caught.value.category == "input"
    assert torch.isnan(bundle.batch()["x"][2, 3]) and bundle.batch()["x"][0, 0] == 1.0
    assert bundle.sample_ids == list(range(8))


def test_rng_of_the_failing_step_survives_the_next_forward(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    mon = Monitor(model, bundle_dir=tmp_path, on_invalid="warn", mode="async")
    x = torch.randn(8, 4)
    outputs = []
    for step in range(3):
        out = model(x)
        outputs.append(out.detach())
        out.sum().backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteWarning)
            mon.check(batch={"x": x})
        model.zero_grad()
    bundle = load_bundle(mon.bundle_path)
    assert bundle.step == 1
    assert bundle.manifest["rng"]["captured_at_by_source"] == {"torch": "step_start", "numpy": "next_check",
                                                               "python": "next_check"}
    torch.manual_seed(12345)
    bundle.restore_rng()
    assert torch.equal(model(bundle.batch()["x"]), outputs[1]), "step 1's dropout masks, not step 2's"


def test_exception_in_the_loop_still_bundles_the_last_step(tmp_path, caplog):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(KeyError, match="loader broke"):
        with Monitor(model, optimizer, bundle_dir=tmp_path, mode="async") as mon:
            train(mon, model, optimizer, steps=FAULT_STEP + 1, fault="parameter")
            raise KeyError("loader broke")
    assert mon.first_invalid_step == FAULT_STEP and load_bundle(mon.bundle_path).category == "parameter"
    assert "non-finite values at step 3" in caplog.text, "on_invalid's error is logged, not raised over the loop's"
    assert not model._forward_pre_hooks


def test_with_block_raises_for_a_last_step_that_failed(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError, match="step 3"):
        with Monitor(model, optimizer, bundle_dir=tmp_path, mode="async") as mon:
            train(mon, model, optimizer, steps=FAULT_STEP + 1, fault="parameter")


# -- found_inf -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_found_inf_makes_a_fused_optimizer_skip_the_update(mode, tmp_path):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode=mode, on_invalid=lambda *_: None)
    reports = train(mon, model, optimizer, steps=FAULT_STEP, fused_skip=True)
    assert [float(r.found_inf) for r in reports] == [0.0] * FAULT_STEP
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    report = step_once(mon, model, optimizer, FAULT_STEP, "gradient", fused_skip=True)
    flag = report.found_inf
    assert flag.dtype == torch.float32 and flag.shape == () and flag.device.type == "cpu" and float(flag) == 1.0
    if mode == "async":
        assert report.ok, "the verdict is not read yet: the loop calls optimizer.step(), found_inf skips it"
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[0][key]), key
    after = optimizer.state_dict()["state"]
    for index, state in before[1]["state"].items():
        for key, value in state.items():
            assert torch.equal(after[index][key], value), (index, key)
    later = [step_once(mon, model, optimizer, step, fused_skip=True) for step in (FAULT_STEP + 1, FAULT_STEP + 2)]
    assert [float(r.found_inf) for r in later] == [0.0, 0.0]
    assert [r.ok for r in later] == ([False, True] if mode == "async" else [True, True])  # async: step 3's verdict
    assert not torch.equal(model[0].weight, before[0]["0.weight"]), "finite steps update the weights again"


def test_sync_report_found_inf_comes_from_its_records():
    report = nanscan.scan({"a": torch.ones(3), "b": torch.tensor([1.0, float("-inf")])})
    assert float(report.found_inf) == 1.0
    assert float(nanscan.scan({"a": torch.ones(3)}).found_inf) == 0.0


# -- the pending report and the pending scan -------------------------------------------------------------------

class HeldScan:
    """A pending scan that finishes only when released, counting the waits."""

    def __init__(self, records: np.ndarray):
        self._records = records
        self.found_inf = torch.tensor(0.0)
        self.done = False
        self.waits = 0

    def ready(self) -> bool:
        return self.done

    def records(self) -> np.ndarray:
        self.waits += 1
        self.done = True
        return self._records


def test_pending_report_waits_only_for_records():
    tensors = [ScannedTensor("grad:w", "float32", "cpu", 2, L.FLOAT32)]
    records = nanscan.scan({"grad:w": torch.tensor([1.0, float("nan")])}).records
    scan = HeldScan(records)
    report = PendingReport(tensors, scan, step=7, ok=True, decided_step=6)
    assert report.ok and not report.ready() and report.names == ["grad:w"] and report.found_inf is scan.found_inf
    assert "scan still running" in repr(report) and scan.waits == 0
    assert report.nonfinite == ["grad:w"] and scan.waits == 1
    assert report.ok, "ok stays the verdict acted on at this check"
    assert not report.result().ok and report["grad:w"].nan == 1 and scan.waits == 1
    with pytest.raises(ValueError, match="records has shape"):
        PendingReport(tensors * 2, HeldScan(records)).records


def test_step_scan_joins_parts_from_several_devices():
    a = nanscan.scan({"a0": torch.ones(2), "a1": torch.zeros(3), "a2": torch.ones(1)}).records
    b = nanscan.scan({"b0": torch.tensor([float("inf")]), "b1": torch.ones(4)}).records
    tensors = tuple(ScannedTensor(f"t{i}", "float32", "cpu", 1, L.FLOAT32) for i in range(5))
    scan = StepScan(tensors, [ScanPart(np.array([0, 1, 4]), CompletedScan(a)),
                              ScanPart(np.array([2, 3]), CompletedScan(b))], "cpu")
    assert scan.num_tensors == 5
    assert scan.on_host and scan.nonfinite_on_host and float(scan.found_inf) == 1.0
    assert np.array_equal(scan.records()[[0, 1, 4]], a) and np.array_equal(scan.records()[[2, 3]], b)
    ring = HistoryRing(2)
    names = [ScannedTensor(n, "float32", "cpu", 1, L.FLOAT32) for n in ("a0", "a1", "b0", "b1", "a2")]
    slot = ring.append(9, scan, names, [], loss=1.5, lr=None, verdict=True)
    assert ring.verdict(slot, scan) is True
    (entry, report), = ring.entries()
    assert entry.step == 9 and entry.loss == 1.5 and np.array_equal(report.records, scan.records())
    assert report.nonfinite == ["b0"]


# -- the history ring ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_history_ring_memory_is_bounded_and_reports_are_not_kept(mode, tmp_path):
    model, optimizer, mon = setup(bundle_dir=tmp_path, mode=mode, history=4)
    train(mon, model, optimizer, steps=2)  # the second check also scans Adam's state: the ring's final width
    ring = mon._ring
    for step in range(2, 6):  # every slot now holds a step that scanned the state
        step_once(mon, model, optimizer, step)
    tensors = len(mon.history[-1].report)
    bound = 4 * tensors * 400  # compact records (NOTE: [history ring]): a fifth of the dense 2112 bytes at most
    assert 0 < ring.nbytes <= bound
    kept = []
    for step in range(6, 40):
        kept.append(weakref.ref(step_once(mon, model, optimizer, step)))
        assert ring.nbytes <= bound
    gc.collect()
    alive = [r() is not None for r in kept]
    assert alive == [False] * (len(kept) - (mode == "async")) + [True] * (mode == "async"), \
        "the Monitor keeps no report but the pending one"
    assert [e.step for e in mon.history] == [36, 37, 38, 39]


def test_history_entries_match_the_reports_and_the_model(tmp_path):
    model, optimizer, mon = setup(bundle_dir=tmp_path, mode="sync", history=3)
    reports = train(mon, model, optimizer, steps=5)
    history = mon.history
    assert [e.step for e in history] == [2, 3, 4]
    for entry, report in zip(history, reports[2:]):
        assert np.array_equal(entry.report.records, report.records) and entry.report.names == report.names
        assert entry.report.records is not report.records
    last = history[-1]
    assert last.lr == 1e-2 and math.isfinite(last.loss)
    expected_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert last.grad_norm == pytest.approx(expected_norm, rel=1e-9)


def test_history_keeps_steps_that_scanned_different_tensors(tmp_path):
    model, optimizer, mon = setup(bundle_dir=tmp_path, mode="sync", history=8)
    first = step_once(mon, model, optimizer, 0)  # no optimizer state yet
    second = step_once(mon, model, optimizer, 1)
    assert len(first) < len(second)
    old, new = mon.history
    assert np.array_equal(old.report.records, first.records) and np.array_equal(new.report.records, second.records)
    assert mon._ring.nbytes == sum(compact.encode(r.records).nbytes for r in (first, second))


def test_reports_records_are_read_only(tmp_path):
    model, optimizer, mon = setup(bundle_dir=tmp_path, mode="sync", history=4)
    report = step_once(mon, model, optimizer, 0)
    with pytest.raises(ValueError, match="read-only"):
        report.records[0, L.REC_NAN] = 1  # the live export writes the same array (NOTE: [shared records])
    assert mon.history[-1].report.ok and report.ok


def test_mode_is_checked_and_auto_is_sync_on_cpu(tmp_path):
    with pytest.raises(ValueError, match="mode='fast'"):
        Monitor(nn.Linear(2, 1), mode="fast")
    with pytest.raises(ValueError, match="agreement='async'"):
        Monitor(nn.Linear(2, 1), process_group=object(), mode="async")
    mon = Monitor(nn.Linear(2, 1), bundle_dir=tmp_path)
    assert mon.mode == "auto"
    assert type(mon.check(loss=1.0)) is ScanReport and mon.mode == "sync"


# -- on a GPU ----------------------------------------------------------------------------------------------------

def gpu_setup(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return model, optimizer, Monitor(model, optimizer, bundle_dir=tmp_path, **kwargs)


def gpu_step(mon, model, optimizer, x, *, nan_grad: bool = False):
    loss = (model(x) ** 2).mean()
    loss.backward()
    if nan_grad:
        model[0].weight.grad[1, 2] = float("nan")
    report = mon.check(batch={"x": x}, loss=loss)
    if report.ok:
        fused = optimizer.defaults.get("fused")  # found_inf is for fused optimizers only
        if fused:
            optimizer.found_inf = report.found_inf
        optimizer.step()
        if fused:
            del optimizer.found_inf
    optimizer.zero_grad(set_to_none=True)
    return report


@gpu_test
def test_gpu_async_training_loop_never_synchronizes(tmp_path):
    model, optimizer, mon = gpu_setup(tmp_path, on_invalid="warn")
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):  # warm-up: optimizer state, pinned pools, the backend's work lists
        gpu_step(mon, model, optimizer, x)
    assert mon.mode == "async" and mon._ring.device.type == "cuda"
    torch.cuda.set_sync_debug_mode("error")
    try:
        reports = [gpu_step(mon, model, optimizer, x) for _ in range(20)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(r.ok for r in reports) and all(r.found_inf.device.type == "cuda" for r in reports)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = gpu_step(mon, model, optimizer, x, nan_grad=True)
    assert float(bad.found_inf) == 1.0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"found_inf=1 must skip the fused update ({key})"
    with pytest.warns(NonFiniteWarning, match=f"step {bad.step}"):
        after = gpu_step(mon, model, optimizer, x)
    assert not after.ok and after.decided_step == bad.step and mon.first_invalid_step == bad.step
    bundle = load_bundle(mon.bundle_path)
    assert bundle.category == "gradient" and bundle.history()[-1].step == bad.step
    assert bundle.manifest["loss"] == pytest.approx(bundle.history()[-1].loss)


@gpu_test
def test_gpu_check_returns_while_the_gpu_is_still_busy(tmp_path):
    model, optimizer, mon = gpu_setup(tmp_path)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):
        gpu_step(mon, model, optimizer, x)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of the next check
    marker = torch.cuda.Event()
    marker.record()
    report = gpu_step(mon, model, optimizer, x)
    assert not marker.query(), "check() waited for work enqueued before it"
    assert not report.ready()
    assert mon.flush().ok and report.ready()


@gpu_test
def test_gpu_history_ring_holds_the_exact_records(tmp_path):
    model, optimizer, mon = gpu_setup(tmp_path, history=3)
    x = torch.randn(32, 64, device="cuda")
    reports = [gpu_step(mon, model, optimizer, x) for _ in range(5)]
    history = mon.history
    assert [e.step for e in history] == [2, 3, 4]
    for entry, report in zip(history, reports[2:]):
        assert np.array_equal(entry.report.records, report.records)
        assert entry.loss is not None and math.isfinite(entry.loss)
    mon.flush()  # the last step's verdict: its dense records are dropped too (NOTE: [history ring])
    assert mon._ring.nbytes <= 3 * len(reports[-1]) * 400


@gpu_test
@pytest.mark.parametrize("named", [None, "cuda"])
def test_gpu_default_adamw_keeps_its_step_counters_on_the_cpu(tmp_path, monkeypatch, named):
    """torch's default (non-fused) AdamW keeps each `step` as a CPU tensor beside CUDA weights: the check spans two
    devices, each scanned by its own backend (with NANSCAN_BACKEND=cuda, the CPU part by the host's choice)."""
    if named is not None:
        monkeypatch.setenv("NANSCAN_BACKEND", named)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, on_invalid="warn", mode="sync")
    x = torch.randn(32, 64, device="cuda")
    reports = [gpu_step(mon, model, optimizer, x) for _ in range(3)]
    report = reports[-1]
    assert all(r.ok for r in reports) and "cuda" in report.backend
    assert {t.device for t in report.tensors} == {"cuda:0", "cpu"}
    counters = [t for t in report.tensors if t.name.endswith(".step")]
    assert counters and all(t.device == "cpu" for t in counters)
    assert report[counters[0].name].absmax == 2.0  # two updates before the third check
    with pytest.warns(NonFiniteWarning):
        bad = gpu_step(mon, model, optimizer, x, nan_grad=True)
    assert not bad.ok and bad.nonfinite == ["grad:0.weight"]
    assert load_bundle(mon.bundle_path).category == "gradient"
