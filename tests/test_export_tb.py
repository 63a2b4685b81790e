"""TensorBoard and table export, read back with the real readers: the Monitor's live export (tensorboard's own
EventAccumulator: tags, steps, the non-finite count, exponent buckets equal to the records; the event file's
framing checked by tensorboard's own record reader, CRCs included), `nanscan export` of a bundle's history
(TensorBoard, CSV and Parquet through pyarrow) against load_bundle's history, and its refusals."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from click.testing import CliRunner

# `make test` installs both; a machine with only torch (the GPU check's) skips this file instead of failing to collect.
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from nanscan import _layout as L  # noqa: E402
from nanscan.integrations import live  # noqa: E402
from nanscan.bundle import load_bundle  # noqa: E402
from nanscan.cli import main  # noqa: E402
from nanscan.integrations.tensorboard import EventFile, TensorBoardExport, histogram_tag  # noqa: E402
from nanscan.monitor import Monitor  # noqa: E402

import export_runs  # noqa: E402
from export_runs import FAIL_AT, small_model  # noqa: E402

LONG_INPUT = "features_of_the_sample_with_a_rather_long_name_for_the_table"


def events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def train(monitor, model, optimizer, steps=8, fail_at=FAIL_AT):
    return export_runs.train(monitor, model, optimizer, steps, fail_at, input_name=LONG_INPUT)


def expected_buckets(record: np.ndarray) -> tuple[list[float], list[int]]:
    """NOTE: [exponent buckets], written out slowly: bin b holds |x| in [2**(b-128), 2**(b-127))."""
    hist = record[L.REC_HIST:]
    occupied = [b for b in range(L.HIST_BINS) if hist[b]]
    bins = range(occupied[0], occupied[-1] + 1)
    return [math.ldexp(1.0, b - 127) for b in bins], [int(hist[b]) for b in bins]


@pytest.fixture(scope="module", params=["sync", "async"])
def live_run(request, tmp_path_factory):
    """A run with the live export (log_every=2) that raises at FAIL_AT; mode="async" on the CPU takes the path a
    GPU takes (the verdict, and the raise, at the next check)."""
    root = tmp_path_factory.mktemp(f"live-{request.param}")
    model, optimizer = small_model()
    monitor = Monitor(model, optimizer, bundle_dir=root / "bundles", run_id="tb", mode=request.param,
                      tensorboard=root / "tb", log_every=2)
    raised = train(monitor, model, optimizer)
    assert raised is not None and raised.step == FAIL_AT
    history = monitor.history
    monitor.close()
    return request.param, root, history, raised.bundle_path


def test_live_scalars_every_step_and_the_spike_at_the_failing_step(live_run):
    _, root, history, _ = live_run
    acc = events(root / "tb")
    scalars = acc.Tags()["scalars"]
    for tag in ("nanscan/loss", "nanscan/lr", "nanscan/grad_norm", "nanscan/nonfinite_tensors",
                "nanscan/nonfinite_elements"):
        assert tag in scalars
    # async: the next check raised on reading the failing step's verdict, before scanning its own step
    elements = {e.step: e.value for e in acc.Scalars("nanscan/nonfinite_elements")}
    assert sorted(elements) == list(range(FAIL_AT + 1))
    assert all(elements[s] == 0 for s in range(FAIL_AT))
    by_step = {h.step: h for h in history}
    failing = by_step[FAIL_AT].report
    assert elements[FAIL_AT] == sum(s.nonfinite for s in failing) > 0
    tensors = {e.step: e.value for e in acc.Scalars("nanscan/nonfinite_tensors")}
    assert tensors[FAIL_AT] == len(failing.nonfinite) and tensors[0] == 0
    losses = {e.step: e.value for e in acc.Scalars("nanscan/loss")}
    norms = {e.step: e.value for e in acc.Scalars("nanscan/grad_norm")}
    for s in range(FAIL_AT):
        assert losses[s] == pytest.approx(by_step[s].loss, rel=1e-6)  # TensorBoard stores float32
        assert norms[s] == pytest.approx(by_step[s].grad_norm, rel=1e-6)
    assert "0/grad_norm" in scalars and "2/grad_norm" in scalars


def test_live_histograms_at_log_every_and_at_the_failing_step_equal_the_records(live_run):
    _, root, history, _ = live_run
    acc = events(root / "tb")
    by_step = {h.step: h.report for h in history}
    name = "param:0.weight"  # finite at the failing step (its gradient is all NaN there: nothing to bin)
    tag = histogram_tag(name)
    assert tag == "0/param:0.weight" and tag in acc.Tags()["histograms"]
    assert histogram_tag(f"input:{LONG_INPUT}") in acc.Tags()["histograms"]
    assert [e.step for e in acc.Histograms(tag)] == [0, 2, 4, FAIL_AT]
    for event in acc.Histograms(tag):
        report = by_step[event.step]
        row = report.names.index(name)
        limits, counts = expected_buckets(report.records[row])
        value = event.histogram_value
        assert list(value.bucket_limit) == limits and list(value.bucket) == counts
        stats = report[name]
        assert value.num == int(stats.exp_hist.sum()) and value.max == stats.absmax and value.min == stats.absmin


def test_a_given_writer_stays_open_and_the_tensor_choice_is_honoured(tmp_path):
    model, optimizer = small_model()
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    export = TensorBoardExport(writer, log_every=1, tensors=["grad:*", "param:2.*"], max_tensors=3)
    with Monitor(model, optimizer, bundle_dir=tmp_path / "b", tensorboard=export) as monitor:
        assert train(monitor, model, optimizer, steps=3, fail_at=-1) is None
        names = monitor.history[-1].report.names
    writer.add_scalar("mine", 1.0, global_step=0)  # the Monitor did not close the user's writer
    writer.close()
    acc = events(tmp_path / "tb")
    matching = [n for n in names if n.startswith("grad:") or n.startswith("param:2.")]
    assert len(matching) == 6  # four gradients, two weights of the second layer: more than the cap
    assert sorted(acc.Tags()["histograms"]) == sorted(histogram_tag(n) for n in matching[:3])
    assert "mine" in acc.Tags()["scalars"]


def tensorboard_records(path) -> list[bytes]:
    """Every record of an event file through tensorboard's own reader, which checks both CRCs of each record."""
    from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow  # noqa: PLC0415

    reader = pywrap_tensorflow.PyRecordReader_New(str(path))
    out = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return out
        out.append(reader.record())


def test_an_event_file_passes_tensorboards_own_record_checks(tmp_path):
    from tensorboard.compat.proto.event_pb2 import Event  # noqa: PLC0415
    from tensorboard.compat.tensorflow_stub import errors  # noqa: PLC0415

    first, second = EventFile(tmp_path), EventFile(tmp_path)  # one process, one second: two files all the same
    first.add_scalar("a", 1.5, global_step=3)
    first.add_histogram_raw("h", min=0.25, max=2.0, num=3, sum=0.0, sum_squares=4.0625, bucket_limits=[0.5, 4.0],
                            bucket_counts=[1, 2], global_step=4)
    first.close()
    second.close()
    assert first.path != second.path and first.path.name.startswith("events.out.tfevents.")
    events = [Event.FromString(r) for r in tensorboard_records(first.path)]
    assert events[0].file_version == "brain.Event:2"
    assert (events[1].step, events[1].summary.value[0].tag, events[1].summary.value[0].simple_value) == (3, "a", 1.5)
    assert list(events[2].summary.value[0].histo.bucket) == [1, 2] and events[2].step == 4
    data = bytearray(first.path.read_bytes())
    data[-5] ^= 1  # a bit of the last event's data: its CRC no longer matches, and the reader says so
    first.path.write_bytes(bytes(data))
    with pytest.raises(errors.DataLossError, match="crc32"):
        tensorboard_records(first.path)


def test_min_and_max_are_exact_in_every_format():
    rng = np.random.default_rng(0)
    for code, fmt in L.FORMATS.items():
        bits = rng.integers(0, 1 << (8 * fmt.bytes - 1), 300, dtype=np.int64)
        one_at_a_time = [L.abs_bits_to_float(int(b), code) for b in bits]
        keep = [i for i, v in enumerate(one_at_a_time) if not math.isnan(v)]
        assert L.abs_bits_to_floats(bits[keep], code) == [one_at_a_time[i] for i in keep], L.DTYPE_NAMES[code]


def test_kept_steps_reach_the_event_file_before_close(tmp_path, monkeypatch):
    """NOTE: [live export cost]: between logged steps the scalars are handed off every MAX_BUFFERED_STEPS steps."""
    monkeypatch.setattr(live, "MAX_BUFFERED_STEPS", 2)
    model, optimizer = small_model()
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path / "b", tensorboard=tmp_path / "tb", log_every=1000)
    assert train(monitor, model, optimizer, steps=6, fail_at=-1) is None
    on_disk = [e.step for e in events(tmp_path / "tb").Scalars("nanscan/grad_norm")]
    monitor.close()
    assert on_disk == [0, 1, 2, 3, 4]  # 0 logged at once, then pairs; step 5 still kept
    assert [e.step for e in events(tmp_path / "tb").Scalars("nanscan/grad_norm")] == list(range(6))


@pytest.mark.parametrize("kwargs, message", [
    ({"tensorboard": "tb", "log_every": 0}, "log_every=0"),
    ({"log_every": 10}, "without tensorboard="),
    ({"tensorboard": 3}, "log directory or a torch.utils.tensorboard.SummaryWriter"),
])
def test_bad_export_settings_are_refused(tmp_path, kwargs, message):
    model, optimizer = small_model()
    if isinstance(kwargs.get("tensorboard"), str):
        kwargs = {**kwargs, "tensorboard": tmp_path / kwargs["tensorboard"]}
    with pytest.raises((ValueError, TypeError), match=message):
        Monitor(model, optimizer, bundle_dir=tmp_path, **kwargs)


# -- nanscan export ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundle_path(live_run):
    return live_run[3]


def test_export_tensorboard_holds_every_tensor_of_every_kept_step(bundle_path, tmp_path):
    result = CliRunner().invoke(main, ["export", str(bundle_path), "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 0, result.output
    history = load_bundle(bundle_path).history()
    acc = events(tmp_path / "tb")
    steps = [h.step for h in history]
    assert steps[-1] == FAIL_AT
    elements = {e.step: e.value for e in acc.Scalars("nanscan/nonfinite_elements")}
    assert sorted(elements) == steps and elements[FAIL_AT] > 0 and elements[steps[0]] == 0
    for entry in history:
        for i, t in enumerate(entry.report.tensors):
            if not entry.report.records[i, L.REC_HIST:].any():
                continue
            found = [e for e in acc.Histograms(histogram_tag(t.name)) if e.step == entry.step]
            assert len(found) == 1, (t.name, entry.step)
            limits, counts = expected_buckets(entry.report.records[i])
            assert list(found[0].histogram_value.bucket_limit) == limits
            assert list(found[0].histogram_value.bucket) == counts


def _expected_rows(history) -> list[tuple]:
    rows = []
    for entry in history:
        rows += [(entry.step, "", k, getattr(entry, k)) for k in ("loss", "lr", "grad_norm")
                 if getattr(entry, k) is not None]
        for s in entry.report:
            rows += [(entry.step, s.name, k, float(getattr(s, k))) for k in
                     ("numel", "nan", "posinf", "neginf", "zero", "subnormal", "absmax", "absmin", "sumsq")]
            rows += [(entry.step, s.name, f"exp_hist:{b - 128}", float(s.exp_hist[b]))
                     for b in range(256) if s.exp_hist[b]]
    return rows


def _comparable(rows) -> list[tuple]:
    """Rows with NaN values spelled out (NaN != NaN, and the failing step's loss is NaN)."""
    return [(*row[:3], "nan" if math.isnan(row[3]) else row[3]) for row in rows]


def test_export_csv_and_parquet_are_the_history_as_one_tidy_table(bundle_path, tmp_path):
    out_csv, out_parquet = tmp_path / "h.csv", tmp_path / "h.parquet"
    result = CliRunner().invoke(main, ["export", str(bundle_path), "--csv", str(out_csv), "--parquet",
                                       str(out_parquet)])
    assert result.exit_code == 0, result.output
    expected = _comparable(_expected_rows(load_bundle(bundle_path).history()))
    table = pq.read_table(out_parquet)
    assert table.column_names == ["step", "tensor", "stat", "value"]
    assert str(table.schema.field("step").type) == "int64" and str(table.schema.field("value").type) == "double"
    assert _comparable(zip(*(table.column(c).to_pylist() for c in table.column_names))) == expected
    with open(out_csv, newline="") as f:
        read = list(csv.reader(f))
    assert read[0] == ["step", "tensor", "stat", "value"]
    assert _comparable([(int(s), t, k, float(v)) for s, t, k, v in read[1:]]) == expected
    assert any(k == "nan" and v == 1 for _, t, k, v in expected if t == f"input:{LONG_INPUT}")


def test_export_never_replaces_a_file_without_overwrite(bundle_path, tmp_path):
    out = tmp_path / "h.csv"
    out.write_text("mine\n")
    result = CliRunner().invoke(main, ["export", str(bundle_path), "--csv", str(out)])
    assert result.exit_code == 1 and "pass --overwrite" in result.output and out.read_text() == "mine\n"
    result = CliRunner().invoke(main, ["export", str(bundle_path), "--csv", str(out), "--overwrite"])
    assert result.exit_code == 0 and out.read_text().startswith("step,tensor,stat,value")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "notes.txt").write_text("keep")
    for extra in ([], ["--overwrite"]):
        result = CliRunner().invoke(main, ["export", str(bundle_path), "--tensorboard", str(tmp_path / "tb"), *extra])
        assert result.exit_code == 1 and (tmp_path / "tb" / "notes.txt").read_text() == "keep"
    assert "not empty" in CliRunner().invoke(main, ["export", str(bundle_path), "--tensorboard",
                                                    str(tmp_path / "tb")]).output


def test_export_replaces_a_directory_of_events_only_with_overwrite(bundle_path, tmp_path):
    tb = tmp_path / "tb"
    assert CliRunner().invoke(main, ["export", str(bundle_path), "--tensorboard", str(tb)]).exit_code == 0
    first = sorted(p.name for p in tb.iterdir())
    assert CliRunner().invoke(main, ["export", str(bundle_path), "--tensorboard", str(tb)]).exit_code == 1
    assert CliRunner().invoke(main, ["export", str(bundle_path), "--tensorboard", str(tb),
                                     "--overwrite"]).exit_code == 0
    assert len(list(tb.iterdir())) == 1 and sorted(p.name for p in tb.iterdir()) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tb"]  # no temporary directory left behind


def test_export_refuses_no_output_and_an_output_inside_the_bundle(bundle_path):
    result = CliRunner().invoke(main, ["export", str(bundle_path)])
    assert result.exit_code == 2 and "--tensorboard DIR" in result.output
    result = CliRunner().invoke(main, ["export", str(bundle_path), "--csv", str(bundle_path / "h.csv")])
    assert result.exit_code == 1 and "inside the bundle" in result.output
    assert load_bundle(bundle_path).history()  # still loads


def test_report_piped_keeps_long_tensor_names_on_one_line(bundle_path):
    result = CliRunner().invoke(main, ["report", str(bundle_path)], env={"COLUMNS": None})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(f"input:{LONG_INPUT}" in line for line in lines), result.output
    assert not any(line.strip() and f"input:{LONG_INPUT}".startswith(line.split()[0]) and
                   f"input:{LONG_INPUT}" not in line for line in lines if line.split())
