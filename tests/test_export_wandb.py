"""W&B export, run for real in wandb's offline mode and read back from the run's transaction log (run-<id>.wandb):
the scalars at every step (no non-finite count before the planted NaN, the count at it, the gradient norm NaN
there), the histograms over log2|x| equal to the records' exponent bins, the non-finite counts per tensor at the
failing step, the per-module gradient norms, nanscan/step as the axis beside the user's own logging, the same steps
and tensors as the TensorBoard export when both are asked for, and the refusals."""

from __future__ import annotations

import json
import logging
import math
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

# `make test` installs wandb; a machine without it (the GPU check's) skips this file instead of failing to collect.
wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

from nanscan.engine import _layout as L  # noqa: E402
from nanscan.integrations.live import group_of  # noqa: E402
from nanscan.integrations.wandb import WandbExport  # noqa: E402
from nanscan.runtime.monitor import Monitor  # noqa: E402

import export_runs  # noqa: E402
from export_runs import FAIL_AT, small_model  # noqa: E402

LOG_EVERY = 2


# -- reading an offline run back ----------------------------------------------------------------------------------
# wandb writes a run's records to run-<id>.wandb in leveldb's log format: a 7-byte header (":W&B", magic 0xBEE1,
# version 0), then 32 KiB blocks of chunks (uint32 CRC-32 of the chunk's type byte and data, uint16 length, uint8
# type: 1 full, 2 first, 3 middle, 4 last), a block's last < 7 bytes zero. wandb up to 0.29 read it with
# wandb.sdk.internal.datastore; 0.30 dropped that module and ships no Python reader, so the framing is read here and
# each record parsed with wandb's own protobuf class.
BLOCK, CHUNK_HEADER = 32768, 7


def wandb_records(path: Path) -> tuple[list, bool]:
    """(the records, whether the log ends after a whole record)."""
    data = path.read_bytes()
    assert data[:CHUNK_HEADER] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), "not a wandb transaction log"
    records, pieces, at = [], [], CHUNK_HEADER
    while at + CHUNK_HEADER <= len(data):
        left = BLOCK - at % BLOCK
        if left < CHUNK_HEADER:  # a block's tail, too short for a chunk: zero padding
            assert data[at : at + left] == bytes(left)
            at += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, at)
        if (crc, length, kind) == (0, 0, 0):  # the rest of the block was never written
            at += left
            continue
        chunk = data[at + CHUNK_HEADER : at + CHUNK_HEADER + length]
        assert len(chunk) == length, "truncated chunk"
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt chunk at byte {at}"
        at += CHUNK_HEADER + length
        pieces.append(chunk)
        if kind in (1, 4):  # a record complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
            pieces = []
        else:
            assert kind in (2, 3), f"chunk type {kind}"
    return records, not pieces


def history_rows(records) -> list[dict]:
    """Each history row as a dict: a key's value, or for a nested value (a histogram) a dict of its fields."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            path = list(item.nested_key) or [item.key]
            value = json.loads(item.value_json)
            if len(path) == 1:
                row[path[0]] = value
            else:
                row.setdefault(path[0], {})[path[1]] = value
        rows.append(row)
    return rows


def offline_run(root: Path) -> tuple[list, list[dict]]:
    """The records and history rows of the one offline run under `root`, once wandb's service has written its last
    record (the exit record): run.finish() can return before its writer has flushed the log's last block."""
    (log,) = root.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30
    while True:
        records, whole = wandb_records(log)
        if whole and records and records[-1].WhichOneof("record_type") == "exit":
            return records, history_rows(records)
        assert time.monotonic() < deadline, f"{log} was never completed"
        time.sleep(0.05)


# -- the run --------------------------------------------------------------------------------------------------------

def train(monitor, model, optimizer, run, steps=8, fail_at=FAIL_AT):
    """The shared run with the user's own run.log after each step, on wandb's implicit step."""
    return export_runs.train(monitor, model, optimizer, steps, fail_at,
                             after_step=lambda step: run.log({"train/mine": float(step)}))


@pytest.fixture(autouse=True)
def offline(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's stdout and stderr unwrapped
    monkeypatch.setenv("WANDB_DIR", str(tmp_path_factory.mktemp("wandb-dir")))


def start(root: Path):
    return wandb.init(project="nanscan-test", dir=str(root), mode="offline")


@pytest.fixture(scope="module", params=["sync", "async"])
def live_run(request, tmp_path_factory):
    """A run logging to W&B (log_every=2) and to TensorBoard, that raises at FAIL_AT; mode="async" on the CPU takes
    the path a GPU takes (records copied behind the scan, the verdict at the next check)."""
    root = tmp_path_factory.mktemp(f"wandb-{request.param}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_CONSOLE", "off")
        mp.setenv("WANDB_DIR", str(root))
        run = start(root)
        model, optimizer = small_model()
        tensorboard = root / "tb" if _has_tensorboard() else None
        monitor = Monitor(model, optimizer, bundle_dir=root / "bundles", mode=request.param, wandb=run,
                          tensorboard=tensorboard, log_every=LOG_EVERY)
        raised = train(monitor, model, optimizer, run)
        assert raised is not None and raised.step == FAIL_AT
        history = {h.step: h for h in monitor.history}
        monitor.close()
        run.finish()
    records, rows = offline_run(root)
    return request.param, root, history, records, rows


def _has_tensorboard() -> bool:
    try:
        import google_crc32c  # noqa: F401, PLC0415
        import tensorboard  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def nanscan_rows(rows) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for row in rows:
        if "nanscan/step" in row:
            assert row["nanscan/step"] not in by_step, "one row per step"
            by_step[row["nanscan/step"]] = row
    return by_step


def test_scalars_every_step_with_the_nonfinite_count_at_the_planted_nan(live_run):
    _, _, history, _, rows = live_run
    by_step = nanscan_rows(rows)
    assert sorted(by_step) == list(range(FAIL_AT + 1))
    for step, row in by_step.items():
        report = history[step].report
        assert row["nanscan/nonfinite_elements"] == sum(s.nonfinite for s in report)
        assert row["nanscan/nonfinite_tensors"] == len(report.nonfinite)
        if step < FAIL_AT:
            assert row["nanscan/nonfinite_elements"] == 0 and row["nanscan/nonfinite_tensors"] == 0
            assert row["nanscan/loss"] == pytest.approx(history[step].loss, rel=1e-12)
            assert row["nanscan/grad_norm"] == pytest.approx(history[step].grad_norm, rel=1e-12)
    assert by_step[FAIL_AT]["nanscan/nonfinite_elements"] > 0
    assert all(row["nanscan/lr"] == history[s].lr == 1e-3 for s, row in by_step.items())  # the optimizer's


def expected_bins(record: np.ndarray) -> tuple[list[int], list[int]]:
    """NOTE: [exponent buckets], written out slowly: bin b is the bucket [b - 128, b - 127) of log2|x|."""
    hist = record[L.REC_HIST:L.REC_HIST_END]
    occupied = [b for b in range(L.HIST_BINS) if hist[b]]
    bins = range(occupied[0], occupied[-1] + 1)
    return [int(hist[b]) for b in bins], [b + L.MIN_BIN_EXPONENT for b in range(bins[0], bins[-1] + 2)]


def hist_key(name: str) -> str:
    return f"nanscan/exp_hist/{group_of(name)}/{name}"


def test_histograms_at_log_every_and_at_the_failing_step_equal_the_records(live_run):
    _, _, history, _, rows = live_run
    by_step = nanscan_rows(rows)
    name = "param:0.weight"
    assert hist_key(name) == "nanscan/exp_hist/0/param:0.weight"
    assert [s for s, row in sorted(by_step.items()) if hist_key(name) in row] == [0, 2, 4, FAIL_AT]
    for step in (0, 2, 4, FAIL_AT):
        report = history[step].report
        for i, t in enumerate(report.tensors):
            logged = by_step[step].get(hist_key(t.name))
            # only zeros, NaNs or infinities: no histogram to draw
            if not report.records[i, L.REC_HIST:L.REC_HIST_END].any():
                assert logged is None
                continue
            counts, edges = expected_bins(report.records[i])
            assert logged["_type"] == "histogram"
            assert logged["values"] == counts and logged["bins"] == edges, (step, t.name)
    assert not any(k.startswith("nanscan/exp_hist/") for k in by_step[1])


def is_count_key(key: str) -> bool:
    """nanscan/nan/<module>/<tensor>, and the same for posinf and neginf."""
    parts = key.split("/", 3)
    return len(parts) == 4 and parts[0] == "nanscan" and parts[1] in ("nan", "posinf", "neginf")


def test_the_failing_step_has_a_nan_gradient_norm_and_each_tensors_nonfinite_counts(live_run):
    _, _, history, _, rows = live_run
    by_step = nanscan_rows(rows)
    failing = history[FAIL_AT].report
    assert history[FAIL_AT].grad_norm == 0.0  # the finite values' norm: what the export must not show
    for key in ("nanscan/grad_norm", "nanscan/grad_norm/0", "nanscan/grad_norm/2"):
        assert math.isnan(by_step[FAIL_AT][key]), key  # NOTE: [non-finite norms]
    counted = {k for k in by_step[FAIL_AT] if is_count_key(k)}
    expected = set()
    for name in failing.nonfinite:
        for stat in ("nan", "posinf", "neginf"):
            key = f"nanscan/{stat}/{group_of(name)}/{name}"
            expected.add(key)
            assert by_step[FAIL_AT][key] == getattr(failing[name], stat), key
    assert counted == expected and "nanscan/nan/0/grad:0.weight" in counted  # the all-NaN gradient has its entry
    assert failing["grad:0.weight"].nan == failing["grad:0.weight"].numel
    assert not any(is_count_key(k) for s, row in by_step.items() if s != FAIL_AT for k in row)


def test_module_gradient_norms_at_logged_steps(live_run):
    _, _, history, _, rows = live_run
    by_step = nanscan_rows(rows)
    report = history[2].report
    sumsq = {}
    for s in report:
        if s.name.startswith("grad:"):
            module = group_of(s.name)
            sumsq[module] = sumsq.get(module, 0.0) + s.sumsq
    assert sorted(sumsq) == ["0", "2"]
    for module, total in sumsq.items():
        assert by_step[2][f"nanscan/grad_norm/{module}"] == pytest.approx(math.sqrt(total), rel=1e-12)
    assert "nanscan/grad_norm/0" not in by_step[3]


def test_nanscan_step_is_the_axis_and_the_users_own_rows_are_kept(live_run):
    mode, _, _, records, rows = live_run
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.name == "nanscan/step" for m in metrics)
    assert any(m.glob_name == "nanscan/*" and m.step_metric == "nanscan/step" for m in metrics)
    mine = [row["train/mine"] for row in rows if "train/mine" in row]
    # every one of the user's values, in order (async: step FAIL_AT's verdict, and the raise, came one step later)
    assert mine == [float(s) for s in range(FAIL_AT + (mode == "async"))]
    steps = [row["_step"] for row in rows]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # no row of anyone's overwritten


def test_tensorboard_beside_wandb_gets_the_same_steps_and_tensors(live_run):
    _, root, _, _, rows = live_run
    if not (root / "tb").exists():
        pytest.skip("tensorboard or google-crc32c is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415
    from tensorboard.util.tensor_util import make_ndarray  # noqa: PLC0415

    acc = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    by_step = nanscan_rows(rows)
    tb = {e.step: e.value for e in acc.Scalars("nanscan/nonfinite_elements")}
    assert tb == {s: row["nanscan/nonfinite_elements"] for s, row in by_step.items()}
    # TensorBoard's <module>/exp_hist/<tensor> is W&B's nanscan/exp_hist/<module>/<tensor>; W&B has no empty one
    drawn = {(e.step, f"nanscan/exp_hist/{tag.replace('/exp_hist/', '/', 1)}") for tag in acc.Tags()["tensors"]
             for e in acc.Tensors(tag) if len(make_ndarray(e.tensor_proto))}
    assert drawn == {(s, k) for s, row in by_step.items() for k in row if k.startswith("nanscan/exp_hist/")}
    assert len(drawn) > 10


def test_an_export_object_keeps_its_choice_of_tensors(tmp_path):
    run = start(tmp_path)
    model, optimizer = small_model()
    export = WandbExport(run, log_every=1, tensors="grad:*", max_tensors=3)
    with Monitor(model, optimizer, bundle_dir=tmp_path / "b", wandb=export) as monitor:
        assert train(monitor, model, optimizer, run, steps=2, fail_at=-1) is None
        names = monitor.history[-1].report.names
    run.finish()
    _, rows = offline_run(tmp_path)
    logged = {k for row in rows for k in row if k.startswith("nanscan/exp_hist/")}
    gradients = [n for n in names if n.startswith("grad:")]
    assert len(gradients) == 4  # more than the cap
    assert logged == {hist_key(n) for n in gradients[:3]}


def test_a_run_finished_before_the_monitor_closes_loses_the_last_steps_with_a_warning(tmp_path, caplog):
    run = start(tmp_path)
    model, optimizer = small_model()
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path / "b", wandb=run, log_every=100)
    assert train(monitor, model, optimizer, run, steps=3, fail_at=-1) is None
    run.finish()  # steps 1 and 2 are still kept by the export (step 0 was a logged step, handed off at once)
    with caplog.at_level(logging.WARNING, logger="nanscan"):
        monitor.close()
    assert "2 steps were not logged to W&B" in caplog.text
    _, rows = offline_run(tmp_path)
    assert sorted(nanscan_rows(rows)) == [0]


@pytest.mark.parametrize("kwargs, message", [
    ({"wandb": 3}, "pass a wandb run"),
    ({"wandb": "my-project"}, "pass a wandb run"),
    ({"wandb": "RUN", "log_every": 0}, "log_every=0"),
    ({"log_every": 10}, "without tensorboard= or wandb="),
    ({"wandb": "EXPORT", "tensorboard": "EXPORT"}, "more than one export object"),
    ({"wandb": "EXPORT", "log_every": 7}, "beside an export with log_every=1"),
])
def test_bad_export_settings_are_refused(tmp_path, kwargs, message):
    model, optimizer = small_model()
    run = start(tmp_path) if "RUN" in kwargs.values() or "EXPORT" in kwargs.values() else None
    given = {}
    for key, value in kwargs.items():
        if value == "RUN":
            value = run
        elif value == "EXPORT" and key == "wandb":
            value = WandbExport(run, log_every=1)
        elif value == "EXPORT":
            pytest.importorskip("tensorboard")
            pytest.importorskip("google_crc32c")
            from nanscan.integrations.tensorboard import TensorBoardExport  # noqa: PLC0415

            value = TensorBoardExport(tmp_path / "tb", log_every=1)
        given[key] = value
    try:
        with pytest.raises((ValueError, TypeError), match=message):
            Monitor(model, optimizer, bundle_dir=tmp_path, **given)
    finally:
        if run is not None:
            run.finish()
