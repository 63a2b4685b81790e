"""Compact records (NOTE: [compact records] in csrc/include/nanscan/compact.h) and the history ring that keeps them
(NOTE: [history ring]): the native encoder equal to the numpy reference with `==` (arrays and dtypes), exact round
trips of adversarial and scanned records, the fixed-capacity contract of the device compaction (its CPU twin here,
the CUDA kernels on a GPU), the ring's exact history and its bytes per tensor-step on the demo model and on
GPT-2-small shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import nanscan
from nanscan import Monitor
from nanscan.engine import _layout as L
from nanscan.engine import compact
from nanscan.demo import (TokenRecords, batches, build_model, build_optimizer, demo_config, make_records, step_fn,
                          write_dataset)
from nanscan.runtime.history import DEVICE_BINS_PER_ROW, DeviceRecords, HistoryRing
from nanscan.engine.pending import CompletedScan, ScanPart, StepScan
from nanscan.engine.stats import ScannedTensor
from record_cases import adversarial_records, random_records

try:
    from nanscan import _C
except ImportError:  # the numba-only build: the reference encoder is the one in use
    _C = None

needs_native = pytest.mark.skipif(_C is None, reason="nanscan._C is not built")
HAS_GPU = torch.cuda.is_available() and _C is not None and hasattr(_C, "compact_cuda")
RING_BOUND = 400  # bytes per tensor-step in memory, on the GPU ring and in bundles (the history's size budget)


def gpu_test(fn):
    reason = "no CUDA GPU (torch.cuda.is_available() is False)" if not torch.cuda.is_available() else \
        "nanscan._C has no CUDA part"
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_GPU, reason=reason)(fn))


def boundary_records() -> np.ndarray:
    """One row per count-dtype boundary: the encoder's dtype choice must flip exactly there."""
    largest = [0, 1, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, np.iinfo(np.int64).max]
    records = L.empty_records(len(largest))
    for r, count in enumerate(largest):
        records[r, L.REC_HIST + 3 * r] = count
    return records


def scanned_records() -> np.ndarray:
    """Real scans: every fp16 and bf16 bit pattern (NaN payloads, subnormals, +-0, +-inf), wide and narrow floats."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    tensors = {"fp16": bits.view(torch.float16), "bf16": bits.view(torch.bfloat16),
               "normal": torch.randn(10_000), "tiny": torch.randn(100) * 1e-30, "zeros": torch.zeros(7),
               "mixed": torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 3e38]),
               "f64": torch.randn(1000, dtype=torch.float64) * 1e200}
    return nanscan.scan(tensors, backend="reference").records


def fingerprinted_records() -> np.ndarray:
    """Random records with fingerprints over the whole uint64 range (NOTE: [scan fingerprint]): stored as int64
    bits, half of them negative. The compact scalars must keep them as they are."""
    records = random_records(200, seed=5)
    rng = np.random.default_rng(6)
    records[:, L.REC_FINGERPRINT] = rng.integers(0, 2**64, size=len(records), dtype=np.uint64).view(np.int64)
    records[0, L.REC_FINGERPRINT] = np.iinfo(np.int64).min
    records[1, L.REC_FINGERPRINT] = -1
    return records


CASES = {"adversarial": adversarial_records, "boundaries": boundary_records, "scanned": scanned_records,
         "random": lambda: random_records(300, seed=3), "empty": lambda: L.empty_records(0),
         "fingerprinted": fingerprinted_records}


@pytest.mark.parametrize("case", CASES)
def test_reference_round_trip_is_exact(case):
    records = CASES[case]()
    encoded = compact.encode_reference(records)
    assert np.array_equal(encoded.decode(), records)
    widths = encoded.ranges[:, 1].astype(np.int64)
    assert int(widths.sum()) == encoded.counts.size
    nonempty = widths > 0  # trimmed: every stored range starts and ends on a nonzero bin
    starts = (np.cumsum(widths) - widths)[nonempty]
    assert (encoded.counts[starts] != 0).all() and (encoded.counts[starts + widths[nonempty] - 1] != 0).all()


@needs_native
@pytest.mark.parametrize("case", CASES)
def test_native_encoder_equals_the_reference(case):
    records = CASES[case]()
    native, reference = compact.encode(records), compact.encode_reference(records)
    for got, want in zip(native, reference):
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


@needs_native
def test_count_dtype_flips_at_each_boundary():
    dtypes = [compact.encode(boundary_records()[r:r + 1]).counts.dtype for r in range(9)]
    assert dtypes == [np.uint8] * 3 + [np.uint16] * 2 + [np.uint32] * 2 + [np.uint64] * 2


def device_records(records: np.ndarray, device: str = "cpu") -> DeviceRecords:
    kept = DeviceRecords(len(records), torch.device(device))
    kept.launch(torch.from_numpy(records.copy()).to(device), None)
    assert kept.resolve(wait=True)
    return kept


@needs_native
@pytest.mark.parametrize("case", ["adversarial", "boundaries", "scanned", "empty", "fingerprinted"])
def test_fixed_capacity_compaction_fits_or_keeps_the_dense_records(case):
    records = CASES[case]()
    kept = device_records(records)
    total = int(compact.encode_reference(records).ranges[:, 1].astype(np.int64).sum())
    largest = records[:, L.REC_HIST:L.REC_HIST_END].max(initial=0)
    fits = total <= len(records) * DEVICE_BINS_PER_ROW and largest < (1 << 32)
    assert kept.fits == fits and (kept.dense is None) == fits
    assert np.array_equal(kept.host_records(), records)
    assert kept.nbytes == kept.buffer.nbytes + (0 if fits else records.nbytes)


@needs_native
def test_fixed_capacity_is_exact_at_its_edge():
    """A step whose ranges fill the counts exactly fits; one more bin does not."""
    rows = 4
    records = L.empty_records(rows)
    records[:, L.REC_HIST:L.REC_HIST + DEVICE_BINS_PER_ROW] = 3
    assert device_records(records).fits
    records[0, L.REC_HIST + DEVICE_BINS_PER_ROW] = 1
    kept = device_records(records)
    assert kept.fits is False and np.array_equal(kept.host_records(), records)
    records[0, L.REC_HIST + DEVICE_BINS_PER_ROW] = 0
    records[1, L.REC_HIST] = 1 << 32  # a count uint32 cannot hold
    kept = device_records(records)
    assert kept.fits is False and np.array_equal(kept.host_records(), records)


@needs_native
def test_compact_fixed_writes_no_count_past_its_capacity():
    records = random_records(50, seed=7)
    counts = torch.full((10,), -1, dtype=torch.int32)
    out = [torch.empty(50 * L.SCALAR_WIDTH, dtype=torch.int64), torch.empty(100, dtype=torch.int16),
           torch.empty(2, dtype=torch.int64)]
    source = torch.from_numpy(records)
    _C.compact_fixed(source.data_ptr(), 50, out[0].data_ptr(), out[1].data_ptr(), counts.data_ptr(), 10,
                     out[2].data_ptr())
    assert out[2].tolist() == [int(compact.encode_reference(records).counts.size), 0]
    assert (counts == -1).all()


class DevicePart:
    """A scan part whose records sit in a torch tensor, as a GPU scan's do (AsyncScan's fields): on the CPU here,
    so the ring's device path runs with the kernels' CPU twin."""

    def __init__(self, records: np.ndarray):
        self.device_records = torch.from_numpy(records.copy())
        self.done_event = None

    def ready(self) -> bool:
        return True


@needs_native
def test_ring_device_path_keeps_exact_records_and_drops_the_dense_ones():
    ordinary = nanscan.scan({f"w{i}": torch.randn(100 * (i + 1)) * 10.0 ** -i for i in range(6)}).records
    steps = [scanned_records(), ordinary, random_records(7, seed=2)]
    names = [tuple(ScannedTensor(f"t{i}", "float32", "cpu", 1, L.FLOAT32) for i in range(len(s))) for s in steps]
    ring = HistoryRing(2)
    for step, (records, tensors) in enumerate(zip(steps, names)):
        scan = StepScan(tensors, [ScanPart(None, DevicePart(records))], "test", on_host=False)
        slot = ring.append(step, scan, tensors, [])
        assert slot == step % 2
    (old, old_report), (new, new_report) = ring.entries()
    assert (old.step, new.step) == (1, 2)
    assert np.array_equal(old_report.records, steps[1]) and np.array_equal(new_report.records, steps[2])
    first, last = (ring._slots[s][1][0][1] for s in (1, 0))
    assert first.fits and first.dense is None, "a step that fits keeps only its compact records"
    assert last.fits is False and last.dense is not None, "random records span more bins than the capacity"
    assert ring._device[1][0] is first, "the slot's buffer is reused by its next step of the same shape"


def test_ring_joins_host_parts_in_input_order():
    a, b = adversarial_records(), boundary_records()
    rows_a, rows_b = np.arange(0, 18, 2), np.arange(1, 18, 2)
    tensors = tuple(ScannedTensor(f"t{i}", "float32", "cpu", 1, L.FLOAT32) for i in range(18))
    scan = StepScan(tensors, [ScanPart(rows_a, CompletedScan(a)), ScanPart(rows_b, CompletedScan(b))], "cpu")
    ring = HistoryRing(1)
    ring.append(0, scan, tensors, [])
    (_, report), = ring.entries()
    assert np.array_equal(report.records[rows_a], a) and np.array_equal(report.records[rows_b], b)


def demo_monitor_steps(tmp_path, steps: int):
    config = demo_config(tmp_path)
    write_dataset(Path(config["data_path"]), make_records(config))
    torch.manual_seed(0)
    model, dataset = build_model(config), TokenRecords(config["data_path"], config["seq_len"])
    optimizer = build_optimizer(model, config)
    mon = Monitor(model, optimizer=optimizer, bundle_dir=tmp_path, history=64)
    reports = []
    for step, (batch, _) in zip(range(steps), batches(dataset, config)):
        optimizer.zero_grad()
        loss = step_fn(model, batch)
        loss.backward()
        optimizer.step()
        reports.append(mon.check(loss=loss, batch=batch))
    return mon, reports


def test_demo_ring_is_exact_and_within_its_size_budget(tmp_path):
    mon, reports = demo_monitor_steps(tmp_path, steps=12)
    history = mon.history
    assert [e.step for e in history] == list(range(12))
    for entry, report in zip(history, reports):
        assert np.array_equal(entry.report.records, report.records)
    tensor_steps = sum(len(r) for r in reports)
    dense = sum(r.records.nbytes for r in reports)
    per_tensor_step = mon._ring.nbytes / tensor_steps
    assert per_tensor_step <= RING_BOUND and mon._ring.nbytes * 5 < dense


@gpu_test
@pytest.mark.parametrize("case", ["adversarial", "boundaries", "scanned", "random", "empty"])
def test_cuda_compaction_equals_its_cpu_twin(case):
    records = CASES[case]()
    on_gpu, on_cpu = device_records(records, "cuda"), device_records(records)
    assert on_gpu.fits == on_cpu.fits
    assert np.array_equal(on_gpu.host_records(), records)
    if on_cpu.fits:
        total = int(on_cpu.host_status[0])
        assert on_gpu.host_status.tolist() == on_cpu.host_status.tolist()
        assert torch.equal(on_gpu.scalars.cpu(), on_cpu.scalars) and torch.equal(on_gpu.ranges.cpu(), on_cpu.ranges)
        assert torch.equal(on_gpu.counts[:total].cpu(), on_cpu.counts[:total])


@gpu_test
def test_cuda_compaction_of_many_rows_crosses_the_offset_chunks():
    """More rows than the offsets kernel's block (1024): the running total carries across its chunks."""
    records = np.concatenate([scanned_records()[2:4]] * 1500)
    kept = device_records(records, "cuda")
    assert kept.fits and np.array_equal(kept.host_records(), records)


def test_without_a_compaction_for_the_device_the_dense_records_are_kept(monkeypatch):
    """A build without the device's compaction (no CUDA part beside a GPU scan): exact, only larger."""
    monkeypatch.setattr("nanscan.runtime.history.native_function", lambda name: None)
    records = adversarial_records()
    kept = DeviceRecords(len(records), torch.device("cpu"))
    kept.launch(torch.from_numpy(records.copy()), None)
    assert kept.fits is False and kept.buffer is None and kept.resolve(wait=False)
    assert np.array_equal(kept.host_records(), records) and kept.nbytes == records.nbytes
