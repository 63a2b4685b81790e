"""The history window's on-disk encoding (NOTE: [sparse history records] in nanscan.bundle.history): exact round
trips of adversarial and scanned records, the same bytes twice, damaged payloads refused by name, dense bundles
written before the sparse encoding and sparse ones written before the fingerprint still loading (their fingerprints
absent, not 0), and the size per tensor-step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

import nanscan
from nanscan.engine import _layout as L
from nanscan._atomic import json_bytes
from nanscan.bundle.format import BundleError, HistoryEntry
from nanscan.bundle.history import (RECORDS_FORMAT, decode_records, encode_records, history_from_payload,
                                    history_payload)
from nanscan.bundle.tree import load_tensors, reading_tensors
from nanscan.demo import DEFAULT_CONFIG, build_model
from nanscan.engine.stats import ScannedTensor, ScanReport
from record_cases import adversarial_records, random_records

# Written by the dense writer (nanscan.bundle.history at commit 06e20bb) from dense_fixture_entries().
DENSE_FIXTURE = Path(__file__).parent / "fixtures" / "history-dense"
# Written by the sparse writer before records carried the fingerprint (record width 264; nanscan.bundle.history at
# commit e680c82) from dense_fixture_entries().
UNFINGERPRINTED_FIXTURE = Path(__file__).parent / "fixtures" / "history-sparse-264"
SIZE_BOUND = 400  # bytes per tensor-step, history.safetensors and history.json together (issue 19)


def entries_of(records_per_step: list[np.ndarray], names: list[str], dtype: str = "float32") -> list[HistoryEntry]:
    tensors = [ScannedTensor(name, dtype, "cpu", 1000 + i, L.DTYPE_CODES[dtype]) for i, name in enumerate(names)]
    return [HistoryEntry(step, 1.5 + step, 1e-3, 0.25, ScanReport(tensors, records, step=step))
            for step, records in enumerate(records_per_step)]


def round_trip(entries: list[HistoryEntry]) -> list[HistoryEntry]:
    tensors, index = history_payload(entries)
    data = safetensors_save(tensors)
    return history_from_payload(safetensors_load(data), json.loads(json.dumps(index)))


@pytest.mark.parametrize("records", [adversarial_records(), random_records(200, 1), L.empty_records(0)],
                         ids=["adversarial", "random", "no-rows"])
def test_records_round_trip_exactly(records):
    half = len(records) // 2
    entries = entries_of([records[:half], records[half:]], [f"t{i}" for i in range(half)]) if half and \
        len(records) % 2 == 0 else entries_of([records], [f"t{i}" for i in range(len(records))])
    stored = round_trip(entries)
    assert [e.step for e in stored] == [e.step for e in entries]
    assert np.array_equal(np.concatenate([e.report.records for e in stored]),
                          np.concatenate([e.report.records for e in entries]))
    assert all(e.report.records.dtype == np.int64 for e in stored)


def test_counts_take_the_narrowest_dtype_that_holds_them():
    records = L.empty_records(2)
    for largest, dtype in [(255, torch.uint8), (256, torch.uint16), (1 << 16, torch.uint32),
                           ((1 << 32) + 1, torch.uint64)]:
        records[1, L.REC_HIST + 3] = largest
        encoded = encode_records(records)
        assert encoded["hist_counts"].dtype == dtype
        assert encoded["hist_ranges"].tolist() == [[0, 0], [3, 1]]
        assert np.array_equal(decode_records(encoded), records)


def test_the_same_entries_give_the_same_bytes():
    entries = entries_of([adversarial_records(), adversarial_records()[::-1].copy()], [f"t{i}" for i in range(9)])
    (a, index_a), (b, index_b) = history_payload(entries), history_payload(entries)
    assert safetensors_save(a) == safetensors_save(b) and json.dumps(index_a) == json.dumps(index_b)
    assert index_a["records_format"] == RECORDS_FORMAT


def _damaged(change) -> dict[str, torch.Tensor]:
    tensors, _ = history_payload(entries_of([adversarial_records()], [f"t{i}" for i in range(9)]))
    change(tensors)
    return tensors


@pytest.mark.parametrize("change, match", [
    (lambda t: t.update(hist_ranges=t["hist_ranges"][:-1]), "hist_ranges are .* expected int16 \\(9, 2\\)"),
    (lambda t: t.update(hist_ranges=t["hist_ranges"].int()), "expected int16"),
    (lambda t: t["hist_ranges"].__setitem__((3, 1), 2), "hist_ranges row 3 is \\(first 255, bins 2\\)"),
    (lambda t: t["hist_ranges"].__setitem__((2, 0), -1), "hist_ranges row 2"),
    (lambda t: t.update(hist_counts=t["hist_counts"][:-1]), "hist_ranges cover 2\\d\\d bins, hist_counts holds"),
    (lambda t: t.update(hist_counts=t["hist_counts"].view(torch.int64)), "hist_counts are int64"),
    (lambda t: t.update(hist_counts=torch.full_like(t["hist_counts"], -1)), "count beyond int64"),
    (lambda t: t.update(scalars=t["scalars"][:, :7].contiguous()), "scalars are"),
    (lambda t: t.update(scalars=t["scalars"][:, :L.REC_HIST].contiguous()),
     "scalars are .* expected int64 \\(n, 9\\)"),  # a fingerprinted index, scalars without the fingerprint
    (lambda t: t.update(scalars=t["scalars"][:-1].contiguous()), "expected int16 \\(8, 2\\)"),
    (lambda t: t["scalars"].__setitem__((0, L.REC_NAN), -4), "negative counts"),
    (lambda t: t.pop("hist_counts"), "hist_counts"),
])
def test_a_damaged_payload_is_refused_naming_the_file(change, match):
    entries = entries_of([adversarial_records()], [f"t{i}" for i in range(9)])
    tensors = _damaged(change)
    _, index = history_payload(entries)
    with pytest.raises(BundleError, match=f"history.safetensors.*{match}"):
        with reading_tensors("history.safetensors"):
            history_from_payload(tensors, index)


def test_an_unknown_records_format_is_refused():
    tensors, index = history_payload(entries_of([adversarial_records()], [f"t{i}" for i in range(9)]))
    with pytest.raises(BundleError, match="stored as 'sparse-hist/9'"):
        history_from_payload(tensors, {**index, "records_format": "sparse-hist/9"})


def dense_fixture_entries() -> list[HistoryEntry]:
    """The entries DENSE_FIXTURE was written from: two steps of the adversarial records."""
    records = adversarial_records()
    return entries_of([records, records[::-1].copy()], [f"layer.{i}.weight" for i in range(len(records))])


def test_a_dense_history_written_before_the_sparse_encoding_still_loads():
    index = json.loads((DENSE_FIXTURE / "history.json").read_text())
    tensors, _ = load_tensors(DENSE_FIXTURE / "history.safetensors")
    assert "records_format" not in index and set(tensors) == {"records", "row_offsets"}
    stored, expected = history_from_payload(tensors, index), dense_fixture_entries()
    assert [(e.step, e.loss, e.lr, e.grad_norm) for e in stored] == [(e.step, e.loss, e.lr, e.grad_norm)
                                                                     for e in expected]
    for s, e in zip(stored, expected):
        assert np.array_equal(s.report.records, e.report.records) and s.report.names == e.report.names
        assert not s.report.fingerprinted and s.report.fingerprints is None  # written before the fingerprint


def test_a_history_written_before_the_fingerprint_loads_without_one():
    """Its fingerprints are absent, not 0: no TensorStats claims a fingerprint the scan never took, and writing the
    entries again keeps them absent."""
    index = json.loads((UNFINGERPRINTED_FIXTURE / "history.json").read_text())
    tensors, _ = load_tensors(UNFINGERPRINTED_FIXTURE / "history.safetensors")
    assert index["record_width"] == L.RECORD_WIDTH_WITHOUT_FINGERPRINT and tensors["scalars"].shape[1] == L.REC_HIST
    stored, expected = history_from_payload(tensors, index), dense_fixture_entries()
    for s, e in zip(stored, expected):
        assert np.array_equal(s.report.records, e.report.records) and s.report.names == e.report.names
        assert not s.report.fingerprinted and s.report.fingerprints is None
        assert all(stats.fingerprint is None for stats in s.report)
        assert s.report["layer.8.weight"].absmax == e.report["layer.8.weight"].absmax  # the rest decodes as before
    again, again_index = history_payload(stored)
    assert again_index["record_width"] == L.RECORD_WIDTH_WITHOUT_FINGERPRINT
    assert all(not e.report.fingerprinted for e in history_from_payload(again, again_index))


def test_fingerprints_survive_the_history_and_an_unknown_width_is_refused():
    entries = demo_like_entries(2)
    tensors, index = history_payload(entries)
    assert index["record_width"] == L.RECORD_WIDTH and tensors["scalars"].shape[1] == L.SCALAR_WIDTH
    stored = history_from_payload(safetensors_load(safetensors_save(tensors)), json.loads(json.dumps(index)))
    for s, e in zip(stored, entries):
        assert s.report.fingerprinted and s.report.fingerprints == e.report.fingerprints
        assert len(set(e.report.fingerprints.values())) > len(e.report) // 2  # real ones (zero biases share 0)
    with pytest.raises(BundleError, match="records are 300 slots wide"):
        history_from_payload(tensors, {**index, "record_width": 300})


def demo_like_entries(steps: int) -> list[HistoryEntry]:
    """Real scans of the demo model's parameters, gradients and Adam moments, drifting from step to step."""
    torch.manual_seed(0)
    params = dict(build_model(DEFAULT_CONFIG).named_parameters())
    out = []
    for step in range(steps):
        tensors = {}
        for name, p in params.items():
            grad = torch.randn_like(p) * 1e-3 / (1 + step)
            tensors |= {f"param:{name}": p.detach() + 1e-3 * step * torch.randn_like(p), f"grad:{name}": grad,
                        f"exp_avg:{name}": 0.1 * grad, f"exp_avg_sq:{name}": 0.001 * grad * grad}
        report = nanscan.scan(tensors)
        out.append(HistoryEntry(step, 5.0 - step * 0.01, 1e-2, 0.5, report))
    return out


def test_a_demo_like_history_stays_within_the_size_bound():
    entries = demo_like_entries(8)
    tensors, index = history_payload(entries)
    size = len(safetensors_save(tensors)) + len(json_bytes(index))
    tensor_steps = sum(len(e.report.records) for e in entries)
    assert tensor_steps >= 8 * 100
    assert size / tensor_steps <= SIZE_BOUND
    stored = round_trip(entries)
    assert all(np.array_equal(s.report.records, e.report.records) for s, e in zip(stored, entries))
