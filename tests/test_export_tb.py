"""TensorBoard and table export, read back with the real readers: the Monitor's live export (tensorboard's own
EventAccumulator: tags, steps, the non-finite counts per step and per tensor, the gradient norm NaN at the failing
step, exponent buckets with integer edges and counts equal to the records, an all-NaN tensor's empty histogram, a
3.4e38 in one bucket at 127; the event file's framing checked by tensorboard's own record reader, CRCs included),
`nanscan export` of a bundle's history (TensorBoard, CSV and Parquet through pyarrow) against load_bundle's
history, and its refusals."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

# `make test` installs both; a machine with only torch (the GPU check's) skips this file instead of failing to collect.
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.backend.event_processing.plugin_event_accumulator import (  # noqa: E402
    EventAccumulator as PluginEventAccumulator,
)
from tensorboard.util.tensor_util import make_ndarray  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

import nanscan  # noqa: E402
from nanscan.engine import _layout as L  # noqa: E402
from nanscan.integrations import live  # noqa: E402
from nanscan.bundle import load_bundle  # noqa: E402
from nanscan.cli.main import main  # noqa: E402
from nanscan.integrations.tensorboard import (  # noqa: E402
    HISTOGRAM_DESCRIPTION, EventFile, TensorBoardExport, TensorBoardSink, histogram_tag,
)
from nanscan.runtime.monitor import Monitor  # noqa: E402

import export_runs  # noqa: E402
from export_runs import FAIL_AT, small_model  # noqa: E402

LONG_INPUT = "features_of_the_sample_with_a_rather_long_name_for_the_table"


def events(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def histograms(acc: EventAccumulator, tag: str) -> dict[int, np.ndarray]:
    """A tag's histograms by step, as TensorBoard's histogram plugin reads them: (left, right, count) rows."""
    assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "histograms", tag
    return {e.step: make_ndarray(e.tensor_proto) for e in acc.Tensors(tag)}


def histogram_tags(acc: EventAccumulator) -> list[str]:
    return [t for t in acc.Tags()["tensors"] if "/exp_hist/" in t]


def train(monitor, model, optimizer, steps=8, fail_at=FAIL_AT):
    return export_runs.train(monitor, model, optimizer, steps, fail_at, input_name=LONG_INPUT)


def assert_exponent_buckets(buckets: np.ndarray, record: np.ndarray) -> None:
    """NOTE: [exponent buckets], written out slowly: bin b is the bucket [b - 128, b - 127), over the occupied bins;
    no bucket for a record with nothing binned."""
    hist = record[L.REC_HIST:L.REC_HIST_END]
    occupied = [b for b in range(L.HIST_BINS) if hist[b]]
    bins = range(occupied[0], occupied[-1] + 1) if occupied else range(0)
    assert buckets.shape == (len(bins), 3) and buckets.dtype == np.float64
    assert buckets[:, 0].tolist() == [b + L.MIN_BIN_EXPONENT for b in bins]
    assert buckets[:, 1].tolist() == [b + L.MIN_BIN_EXPONENT + 1 for b in bins]
    assert buckets[:, 2].tolist() == [int(hist[b]) for b in bins]


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


def test_the_gradient_norm_at_the_failing_step_is_nan_never_zero(live_run):
    """NOTE: [non-finite norms]: every gradient is NaN at the failing step, so the finite values' norm is 0.0."""
    _, root, history, _ = live_run
    acc = events(root / "tb")
    failing = {h.step: h for h in history}[FAIL_AT]
    assert all(s.nan == s.numel for s in failing.report if s.name.startswith("grad:"))
    assert failing.grad_norm == 0.0  # the history's norm over the finite values: what the export must not show
    for tag in ("nanscan/grad_norm", "0/grad_norm", "2/grad_norm"):
        values = {e.step: e.value for e in acc.Scalars(tag)}
        assert math.isnan(values[FAIL_AT]), tag
        assert all(math.isfinite(v) and v > 0 for s, v in values.items() if s < FAIL_AT), tag


def test_nonfinite_counts_per_tensor_at_the_failing_step(live_run):
    _, root, history, _ = live_run
    acc = events(root / "tb")
    failing = {h.step: h for h in history}[FAIL_AT].report
    logged = {t for t in acc.Tags()["scalars"] if any(f"/{stat}/" in t for stat in ("nan", "posinf", "neginf"))}
    expected = set()
    for s in (failing[name] for name in failing.nonfinite):
        for stat in ("nan", "posinf", "neginf"):
            tag = f"{live.group_of(s.name)}/{stat}/{s.name}"
            expected.add(tag)
            assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(FAIL_AT, getattr(s, stat))], tag
    assert logged == expected and f"input/nan/input:{LONG_INPUT}" in logged and "0/nan/grad:0.weight" in logged


def test_live_histograms_at_log_every_and_at_the_failing_step_equal_the_records(live_run):
    _, root, history, _ = live_run
    acc = events(root / "tb")
    by_step = {h.step: h.report for h in history}
    tag = histogram_tag("param:0.weight")
    assert tag == "0/exp_hist/param:0.weight"
    names = {n for report in by_step.values() for n in report.names}  # optimizer state from step 1 on
    assert sorted(histogram_tags(acc)) == sorted(histogram_tag(n) for n in names)
    assert acc.SummaryMetadata(tag).summary_description == HISTOGRAM_DESCRIPTION
    assert "the x axis is log2|x|" in HISTOGRAM_DESCRIPTION
    for name in names:
        logged = histograms(acc, histogram_tag(name))
        assert sorted(logged) == [s for s in (0, 2, 4, FAIL_AT) if name in by_step[s].names], name
        for step, buckets in logged.items():
            report = by_step[step]
            assert_exponent_buckets(buckets, report.records[report.names.index(name)])


def test_an_all_nan_tensor_has_an_empty_histogram_and_its_nan_count(live_run):
    _, root, history, _ = live_run
    acc = events(root / "tb")
    stats = {h.step: h for h in history}[FAIL_AT].report["grad:0.weight"]
    assert stats.nan == stats.numel > 0
    assert histograms(acc, histogram_tag("grad:0.weight"))[FAIL_AT].shape == (0, 3)
    assert {e.step: e.value for e in acc.Scalars("0/nan/grad:0.weight")} == {FAIL_AT: stats.numel}


def test_a_float32_maximum_is_one_bucket_at_127_on_the_exponent_axis(tmp_path):
    """The case the exponent axis is for: over |x|, 3.4e38 would stretch the axis and squeeze every other bucket."""
    x = torch.tensor([0.5, 0.75, 1.0, 3.0, 3.4e38, 0.0, float("nan")])
    report = nanscan.scan({"input:x": x})
    sink = TensorBoardSink(tmp_path)
    sink.write([live.step_row(0, report.tensors, report.records, histograms=[0])])
    sink.close()
    buckets = histograms(events(tmp_path), histogram_tag("input:x"))[0]
    assert buckets[0].tolist() == [-1, 0, 2] and buckets[-1].tolist() == [127, 128, 1]
    assert buckets[:, 2].sum() == 5 and buckets[1:3, 2].tolist() == [1, 1]  # 1.0 and 3.0; NaN and 0 not binned
    assert_exponent_buckets(buckets, report.records[0])
    assert {e.value for e in events(tmp_path).Scalars("input/nan/input:x")} == {1}


@pytest.mark.parametrize("bad, norm", [(None, 5.0), (math.inf, math.inf), (-math.inf, math.inf),
                                       (math.nan, math.nan)])
def test_a_gradient_norm_is_nan_with_a_nan_inf_with_only_infinities(bad, norm):
    """NOTE: [non-finite norms], per step and per module, as torch.linalg.vector_norm has it."""
    values = [3.0, 4.0] + ([] if bad is None else [bad])
    report = nanscan.scan({"grad:a.w": torch.tensor(values), "grad:b.w": torch.tensor([3.0, 4.0]),
                           "param:a.w": torch.tensor([math.nan])})
    by_torch = torch.linalg.vector_norm(torch.tensor(values, dtype=torch.float64)).item()
    assert by_torch == pytest.approx(norm, rel=1e-12, nan_ok=True)
    row = live.step_row(0, report.tensors, report.records, module_norms=True)
    expected = {"a": norm, "b": 5.0, "total": math.sqrt(norm ** 2 + 25.0)}
    got = {**row.module_norms, "total": row.scalars["grad_norm"]}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert (math.isnan(got[key]) and math.isnan(value)) or got[key] == pytest.approx(value, rel=1e-12), key


def test_a_writer_without_add_summary_gets_the_same_buckets_as_tensorboard_reads_them(tmp_path):
    """The add_histogram_raw path (tensorboardX's writers): TensorBoard's own conversion of the older
    HistogramProto, as its histogram plugin runs it, gives the same integer-edged buckets."""
    torch_writer = SummaryWriter(log_dir=str(tmp_path))

    class PlainWriter:  # only the two calls every SummaryWriter-like writer has
        add_scalar = staticmethod(torch_writer.add_scalar)
        add_histogram_raw = staticmethod(torch_writer.add_histogram_raw)

    report = nanscan.scan({"input:x": torch.tensor([0.5, 0.75, 3.0, 3.4e38])})
    sink = TensorBoardSink(PlainWriter())
    sink.write([live.step_row(0, report.tensors, report.records, histograms=[0])])
    torch_writer.close()
    acc = PluginEventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors(histogram_tag("input:x"))
    buckets = make_ndarray(event.tensor_proto).astype(np.float64)
    assert_exponent_buckets(buckets, report.records[0])


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
    assert sorted(histogram_tags(acc)) == sorted(histogram_tag(n) for n in matching[:3])
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
            found = [e for e in acc.Tensors(histogram_tag(t.name)) if e.step == entry.step]
            assert len(found) == 1, (t.name, entry.step)
            assert_exponent_buckets(make_ndarray(found[0].tensor_proto), entry.report.records[i])
    norms = {e.step: e.value for e in acc.Scalars("nanscan/grad_norm")}
    assert math.isnan(norms[FAIL_AT]) and norms[steps[0]] > 0
    assert {e.step for e in acc.Scalars("0/nan/grad:0.weight")} == {FAIL_AT}


def _expected_rows(history) -> list[tuple]:
    rows = []
    for entry in history:
        rows += [(entry.step, "", k, getattr(entry, k)) for k in ("loss", "lr") if getattr(entry, k) is not None]
        gradients = [s for s in entry.report if s.name.startswith("grad:")]
        if any(s.nan for s in gradients):  # NOTE: [non-finite norms]
            rows.append((entry.step, "", "grad_norm", math.nan))
        elif any(s.posinf or s.neginf for s in gradients):
            rows.append((entry.step, "", "grad_norm", math.inf))
        elif entry.grad_norm is not None:
            rows.append((entry.step, "", "grad_norm", entry.grad_norm))
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
    assert [v for step, t, k, v in expected if (step, t, k) == (FAIL_AT, "", "grad_norm")] == ["nan"]


def test_export_to_several_outputs_says_what_it_wrote_for_each(bundle_path, tmp_path):
    result = CliRunner().invoke(main, ["export", str(bundle_path), "--tensorboard", str(tmp_path / "tb"), "--csv",
                                       str(tmp_path / "h.csv"), "--parquet", str(tmp_path / "h.parquet")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split(":")[0] for line in lines] == ["tensorboard", "csv", "parquet"], result.output
    assert str(tmp_path / "tb") in lines[0] and str(tmp_path / "h.csv") in lines[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.csv", "h.parquet", "tb"]


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
