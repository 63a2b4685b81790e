"""The `overflow` finding: a finite value with |x| >= 2**64, whose square overflows float32, reported once per
(record, field) in every format that holds numbers, next to `nonfinite` and never instead of it (an infinity or a
NaN is `nonfinite` only). All fixtures are generated here."""

from __future__ import annotations

import csv
import hashlib
import json
import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file as save_torch

import nanscan.data
from nanscan import demo as D
from nanscan.cli.main import main
from nanscan.data import arrays, check_paths, columnar, numeric, records
from nanscan.data import checker as checker_module
from nanscan.engine.headroom import OVERFLOW_MIN

BELOW = float(np.nextafter(2.0 ** 64, 0))  # the largest float64 below 2**64: not an overflow value
F32_MAX = float(np.finfo(np.float32).max)
F64_MAX = float(np.finfo(np.float64).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
INF, NAN = math.inf, math.nan

# Every fixture below holds these rows of four numbers (as a line, a CSV record, an array row, a Python record).
ROWS = [
    [1.0, 2.0 ** 64, 0.0, 0.0],  # 0: exactly 2**64
    [1.0, BELOW, 0.0, 0.0],  # 1: just below: clean
    [F32_MAX, 1.0, 0.0, 0.0],  # 2: the float32 maximum
    [1.0, 0.0, 0.0, -1e20],  # 3: negative
    [INF, 1.0, 0.0, 0.0],  # 4: nonfinite only
    [NAN, 1.0, 0.0, 0.0],  # 5: nonfinite only
    [NAN, 1e30, 0.0, 0.0],  # 6: both
    [0.5, -BELOW, 0.0, 0.0],  # 7: clean
    [1.0, 0.0, 0.0, -INF],  # 8: nonfinite only
]
# row -> (the value as the detail prints it, its column)
OVERFLOW_ROWS = {0: ("1.845e+19", 1), 2: ("3.403e+38", 0), 3: ("-1e+20", 3), 6: ("1e+30", 1)}
NONFINITE_ROWS = [4, 5, 6, 8]
SENTINEL = "is the float32 maximum, a common missing-value sentinel"
ONE = "1 value with |x| >= 2**64 (its square overflows float32): "


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def by_category(report, category):
    return [f for f in report.findings if f.category == category]


def assert_rows(report, row_of, path_of=None):
    """The findings of a ROWS fixture: `row_of(finding)` is the ROWS index a finding names; `path_of(row, column)`
    is how the detail names that value (None: not checked)."""
    overflow = by_category(report, "overflow")
    assert sorted(row_of(f) for f in overflow) == sorted(OVERFLOW_ROWS), [f.to_dict() for f in report.findings]
    for f in overflow:
        row = row_of(f)
        text, column = OVERFLOW_ROWS[row]
        assert f.detail.startswith(f"{ONE}{text} at "), f.detail
        if path_of is not None:
            assert f.detail.startswith(f"{ONE}{text} at {path_of(row, column)}"), f.detail
        assert (SENTINEL in f.detail) == (row == 2), f.detail
    assert sorted(row_of(f) for f in by_category(report, "nonfinite")) == NONFINITE_ROWS
    assert report.counts["overflow"] == len(OVERFLOW_ROWS) and report.counts["nonfinite"] == len(NONFINITE_ROWS)
    assert report.records == len(ROWS)
    assert report.largest_magnitude.value == F32_MAX and row_of(report.largest_magnitude) == 2
    assert report.failing() == {"nonfinite": 4, "overflow": 4}


# -- every format ----------------------------------------------------------------------------------------------
def test_jsonl_nested_lists_and_scalars(tmp_path):
    lines = [json.dumps({"id": i, "w": [[a, b], [c]], "s": d}).encode() for i, (a, b, c, d) in enumerate(ROWS)]
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = check_paths([path])
    assert_rows(report, lambda f: f.record.line - 1,
                lambda row, column: "s" if column == 3 else f"w[{column // 2}][{column % 2}]")
    fields = {f.record.line - 1: f.field for f in by_category(report, "overflow")}
    assert fields == {0: "w", 2: "w", 3: "s", 6: "w"}
    first = by_category(report, "overflow")[0]
    assert first.detail == f"{ONE}1.845e+19 at w[0][1]"
    assert first.record.sha256 == sha(lines[0])


def test_jsonl_rows_arrow_accepts_reach_the_record_check(tmp_path, monkeypatch):
    """Finite values only, so the columnar fast path reads every block: it must hand the overflow rows on."""
    seen = []
    original = records.inspect_record

    def spy(checker, record, ref):
        seen.append(ref.line)
        return original(checker, record, ref)

    monkeypatch.setattr("nanscan.data.jsonl.inspect_record", spy)
    lines = [json.dumps({"id": i, "v": [0.5, float(i)], "s": 1.0}) for i in range(500)]
    lines[100] = json.dumps({"id": 100, "v": [0.5, 1e30], "s": 1.0})
    lines[300] = json.dumps({"id": 300, "v": [0.5, 1.0], "s": -F32_MAX})
    lines[400] = json.dumps({"id": 400, "v": [0.5, BELOW], "s": 1.0})
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = check_paths([path])
    assert [(f.record.line, f.field) for f in report.findings] == [(101, "v"), (301, "s")]
    assert report.findings[1].detail == f"{ONE}-3.403e+38 at s; -3.4028235e+38 is minus the float32 maximum, a " \
                                        "common missing-value sentinel"
    assert seen == [101, 301]  # only the two rows took the per-record path


def test_csv(tmp_path):
    path = tmp_path / "x.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["a", "b", "c", "d"])
        writer.writerows([[repr(v) for v in row] for row in ROWS])  # repr: the exact float64 (BELOW included)
    report = check_paths([path])
    assert_rows(report, lambda f: f.record.line - 2, lambda row, column: "abcd"[column])
    assert [f.field for f in by_category(report, "overflow")] == ["b", "a", "d", "b"]


def test_parquet(tmp_path):
    table = pa.table({"w": [row[:3] for row in ROWS], "s": [row[3] for row in ROWS]})
    path = tmp_path / "x.parquet"
    pq.write_table(table, path)
    report = check_paths([path])
    assert_rows(report, lambda f: f.record.index, lambda row, column: "s" if column == 3 else f"w[{column}]")


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("small_chunks", [False, True])
def test_npy(tmp_path, monkeypatch, order, small_chunks):
    if small_chunks:  # many chunks (a Fortran-order row is met in several) and many pieces to locate values in
        monkeypatch.setattr(arrays, "SCAN_BYTES", 64)
        monkeypatch.setattr(arrays, "LOCATE_ELEMS", 4)
    a = np.array(ROWS, dtype=np.float64, order=order)
    path = tmp_path / "a.npy"
    np.save(path, a)
    report = check_paths([path])
    assert_rows(report, lambda f: f.record.index, lambda row, column: f"array[{row}][{column}]")
    both = [f for f in report.findings if f.record.index == 6]
    assert [f.category for f in both] == ["nonfinite", "overflow"]
    assert both[1].record.sha256 == sha(a[6].tobytes())


def test_npy_float32_complex_and_many_values_in_one_row(tmp_path):
    below32 = np.nextafter(np.float32(2.0 ** 64), np.float32(0))
    a = np.ones((4, 8), dtype=np.float32)
    a[0, 1] = below32
    a[1, 2] = -below32
    a[2] = [1e20, -F32_MAX, 2e20, 3e20, 4e20, 5e20, 6e20, 1.0]
    a[3, 7] = np.float32(2.0 ** 64)
    np.save(tmp_path / "a.npy", a)
    report = check_paths([tmp_path / "a.npy"])
    assert [(f.category, f.record.index) for f in report.findings] == [("overflow", 2), ("overflow", 3)]
    assert report.findings[0].detail == (
        "7 values with |x| >= 2**64 (their squares overflow float32): 1e+20 at array[2][0], -3.403e+38 at "
        "array[2][1], 2e+20 at array[2][2], 3e+20 at array[2][3], 4e+20 at array[2][4] and 2 more; the largest, "
        "-3.4028235e+38, is minus the float32 maximum, a common missing-value sentinel")
    c = np.ones((3, 2), dtype=np.complex128)
    c[1, 1] = complex(0, 1e30)
    c[2, 0] = complex(INF, 0)
    np.save(tmp_path / "c.npy", c)
    report = check_paths([tmp_path / "c.npy"])
    assert [(f.category, f.record.index) for f in report.findings] == [("overflow", 1), ("nonfinite", 2)]
    assert report.findings[0].detail == f"{ONE}1e+30 at array[1][1][1]"


@pytest.mark.parametrize("compressed", [False, True])
def test_npz(tmp_path, compressed):
    a = np.array(ROWS, dtype=np.float64)
    save = np.savez_compressed if compressed else np.savez
    save(tmp_path / "a.npz", w=a)
    report = check_paths([tmp_path / "a.npz"])
    assert_rows(report, lambda f: f.record.index, lambda row, column: f"w[{row}][{column}]")
    assert {f.record.member for f in report.findings} == {"w"}


def test_npz_fortran_member_read_once(tmp_path):
    """A compressed Fortran-order member cannot be re-read row by row: the rows are still named, in general terms."""
    np.savez_compressed(tmp_path / "f.npz", w=np.asfortranarray(np.array(ROWS, dtype=np.float64)))
    report = check_paths([tmp_path / "f.npz"])
    overflow = by_category(report, "overflow")
    assert [f.record.index for f in overflow] == sorted(OVERFLOW_ROWS)
    assert overflow[0].detail.startswith(
        "value(s) with |x| >= 2**64 (the square of each overflows float32) in this row")
    assert [f.record.index for f in by_category(report, "nonfinite")] == NONFINITE_ROWS


def test_safetensors(tmp_path):
    save_torch({"w": torch.tensor(ROWS, dtype=torch.float64)}, str(tmp_path / "w.safetensors"))
    report = check_paths([tmp_path / "w.safetensors"])
    assert_rows(report, lambda f: f.record.index, lambda row, column: f"w[{row}][{column}]")
    assert {f.record.member for f in report.findings} == {"w"}


def test_safetensors_bfloat16_and_float32_maxima(tmp_path):
    half = torch.ones(3, 2, dtype=torch.bfloat16)
    half[1, 0] = BF16_MAX
    half[2, 1] = 2.0 ** 64
    single = torch.ones(2, 2, dtype=torch.float32)
    single[0, 1] = F32_MAX
    save_torch({"half": half, "single": single, "ids": torch.arange(3)}, str(tmp_path / "m.safetensors"))
    report = check_paths([tmp_path / "m.safetensors"])
    assert report.counts["overflow"] == 3 and report.failing() == {"overflow": 3}
    halves = [f for f in report.findings if f.record.member == "half"]
    assert [(f.record.index, f.category) for f in halves] == [(1, "overflow"), (2, "overflow")]
    assert halves[0].detail == (f"{ONE}3.39e+38 at half[1][0]; 3.3895314e+38 is the bfloat16 maximum, a common "
                                "missing-value sentinel")
    assert halves[0].record.sha256 == sha(half[1].contiguous().view(torch.uint8).numpy().tobytes())
    assert halves[1].detail == f"{ONE}1.845e+19 at half[2][1]"
    single_finding = [f for f in report.findings if f.record.member == "single"]
    assert [f.record.index for f in single_finding] == [0] and SENTINEL in single_finding[0].detail


@pytest.mark.parametrize("build", [
    lambda row: dict(zip("abcd", row)),  # Python floats: pooled into one scan
    lambda row: {"w": torch.tensor(row[:3], dtype=torch.float64), "d": np.array(row[3])},
    lambda row: (np.array(row), "text"),
], ids=["floats", "tensors", "tuples"])
def test_python_dataset_objects(build):
    data = [build(row) for row in ROWS]
    report = nanscan.data.check(data, name="ds")
    assert_rows(report, lambda f: f.record.index)
    assert all(f.record.file == "ds" for f in report.findings)


def test_python_floats_of_one_field_make_one_finding():
    report = nanscan.data.check([{"a": {"x": 1e20, "y": [2.0, -2e20]}, "b": 3e20, "c": 1.0}, {"a": {"x": 1.0}}])
    assert [(f.record.index, f.field) for f in report.findings] == [(0, "a"), (0, "b")]
    first, second = report.findings
    assert first.detail.startswith("2 values with |x| >= 2**64 (their squares overflow float32): ")
    assert "1e+20 at a.x" in first.detail and "-2e+20 at a.y[1]" in first.detail
    assert second.detail == f"{ONE}3e+20 at b"


def test_listing_is_capped_per_category_but_counts_are_exact(tmp_path):
    a = np.zeros((50, 3))
    a[:, 1] = 1e30
    a[::10, 2] = np.nan
    np.save(tmp_path / "a.npy", a)
    report = check_paths([tmp_path / "a.npy"], max_findings=2)
    assert report.counts["overflow"] == 50 and report.counts["nonfinite"] == 5
    assert [(f.category, f.record.index) for f in report.findings] == [
        ("nonfinite", 0), ("overflow", 0), ("overflow", 1), ("nonfinite", 10)]


# -- which values ----------------------------------------------------------------------------------------------
def test_format_maxima_are_named_exactly(tmp_path):
    f32_text = "3.4028235e+38"  # how a float32 column's maximum is written to text
    lines = [f'{{"x": {f32_text}}}', f'{{"x": {F64_MAX!r}}}', f'{{"x": {BF16_MAX!r}}}', '{"x": 3.4e+38}',
             '{"x": -3.4028234663852886e+38}']
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    details = [f.detail for f in check_paths([path]).findings]
    assert len(details) == 5
    assert details[0].endswith("3.4028235e+38 is the float32 maximum, a common missing-value sentinel")
    assert details[1].endswith("1.7976931e+308 is the float64 maximum, a common missing-value sentinel")
    assert details[2].endswith("3.3895314e+38 is the bfloat16 maximum, a common missing-value sentinel")
    assert details[3] == f"{ONE}3.4e+38 at x"  # near a maximum is not a maximum
    assert details[4].endswith("is minus the float32 maximum, a common missing-value sentinel")


def test_integers_past_int64_are_checked_as_the_floats_they_become(tmp_path):
    big = 2 ** 64
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"n": big}, {"n": big - 1}, {"n": -big}, {"n": 2 ** 63}, {"n": 3, "l": [1, big]}, {"n": 10 ** 400},
        {"n": 7}]) + "\n")
    report = check_paths([path])
    # 2**64 - 1 is 2**64 as a float; 2**63 is not an overflow value; 10**400 is past the float64 maximum: inf
    assert [(f.category, f.record.line) for f in report.findings] == [
        ("overflow", 1), ("overflow", 2), ("overflow", 3), ("overflow", 5), ("nonfinite", 6)]
    assert report.findings[2].detail == f"{ONE}-1.845e+19 at n"
    csv_path = tmp_path / "x.csv"
    csv_path.write_text(f"n,m\n{big},1\n{2 ** 63},2\n")
    assert [(f.category, f.record.line) for f in check_paths([csv_path]).findings] == [("overflow", 2)]


def test_the_threshold_is_two_to_the_64():
    assert OVERFLOW_MIN == 2.0 ** 64 == float(1 << 64)
    values = torch.tensor([2.0 ** 64, BELOW, -2.0 ** 64, -BELOW, INF, -INF, NAN, 0.0, F64_MAX, 5e-324],
                          dtype=torch.float64)
    assert numeric.overflow_mask(values).tolist() == [True, False, True, False, False, False, False, False, True,
                                                      False]
    report = nanscan.data.check([{"v": values}])
    assert report.findings[0].category == "nonfinite"
    assert report.findings[1].detail.startswith("3 values with |x| >= 2**64")


# -- cost: elementwise searches only where the histogram says there is something to find -----------------------
def test_values_are_located_only_in_flagged_data(tmp_path, monkeypatch):
    calls = []

    def counting(original):
        def mask(values):
            calls.append(values.numel())
            return original(values)
        return mask

    for module in (arrays, checker_module, columnar, numeric):
        monkeypatch.setattr(module, "overflow_mask", counting(numeric.overflow_mask))
    clean = np.linspace(-1e19, 1e19, 200_000)
    np.save(tmp_path / "clean.npy", clean)
    pq.write_table(pa.table({"x": clean}), tmp_path / "clean.parquet")
    (tmp_path / "clean.jsonl").write_text("".join(json.dumps({"x": float(v), "l": [float(v)]}) + "\n"
                                                  for v in clean[:2000]))
    assert nanscan.data.check([{"x": float(v)} for v in clean[:5000]]).ok
    assert check_paths([tmp_path / "clean.npy", tmp_path / "clean.parquet", tmp_path / "clean.jsonl"]).ok
    assert calls == []
    huge = clean.copy()
    huge[150_000] = 1e25
    np.save(tmp_path / "huge.npy", huge)
    report = check_paths([tmp_path / "huge.npy"])
    assert [f.record.index for f in report.findings] == [150_000]
    assert calls[0] == arrays.LOCATE_ELEMS  # one piece searched, then the one-element row described
    assert sum(calls) <= arrays.LOCATE_ELEMS + 1


# -- command line and JSON ---------------------------------------------------------------------------------------
def test_cli_exit_codes_fail_on_and_json(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"w": [1.0, 2.0]}\n{"w": [3.4028234663852886e+38, 1.0]}\n')

    def invoke(*args):
        return CliRunner().invoke(main, ["data", str(path), *map(str, args)], terminal_width=200)

    result = invoke()
    assert result.exit_code == 1
    assert "overflow" in result.output and f"{path}:2" in result.output and "FAIL: 1 overflow" in result.output
    assert invoke("--fail-on", "nonfinite").exit_code == 0
    assert invoke("--fail-on", "overflow").exit_code == 1
    assert invoke("--fail-on", "none").exit_code == 0
    data = json.loads(invoke("--json").stdout)
    assert data["status"] == "findings" and data["failing"] == {"overflow": 1}
    assert "overflow" in data["fail_on"] and data["counts"]["overflow"] == 1
    assert list(data["counts"])[:2] == ["nonfinite", "overflow"]
    (finding,) = data["findings"]
    assert (finding["category"], finding["line"], finding["field"]) == ("overflow", 2, "w")
    assert SENTINEL in finding["detail"]
    assert json.loads(invoke("--json", "--fail-on", "nonfinite").stdout)["status"] == "clean"
    bogus = invoke("--fail-on", "bogus")
    assert bogus.exit_code == 2 and "nonfinite, overflow, empty" in bogus.output


def test_demo_dataset_is_flagged(tmp_path):
    """The demo's planted record (weights = the float32 maximum) is an overflow finding, named by the demo."""
    config = D.demo_config(tmp_path)
    data = D.make_records(config)
    planted = D.plant_fault(data, config)
    D.write_dataset(tmp_path / "data" / "train.jsonl", data)
    report = check_paths([config["data_path"]])
    (finding,) = report.findings
    line = [r["id"] for r in data].index(planted) + 1
    assert (finding.category, finding.record.line, finding.field) == ("overflow", line, "weights")
    assert SENTINEL in finding.detail and report.failing() == {"overflow": 1}
    ctx = SimpleNamespace(config=config, data_check=None)
    stage = D.stage_check_data(ctx)
    assert stage.ok and f"1 overflow; overflow in {planted} (line {line})" in stage.headline
    assert ctx.data_check["overflow"] == [{"id": planted, "line": line, "field": "weights"}]


def test_unsigned_integers_past_int64_are_floats_in_lists_too(tmp_path, monkeypatch):
    """numpy keeps a list of Python ints past int64 as uint64, Parquet keeps such a column as uint64: the values
    are still the floats they become (2**64 - 1 is 2**64), as a lone integer is, on both paths."""
    big = 2 ** 64 - 1
    report = nanscan.data.check([{"l": [big]}, {"l": [2 ** 63, big]}, {"l": big}, {"l": [2 ** 63]}, {"l": [1]}])
    assert [(f.category, f.record.index) for f in report.findings if f.category == "overflow"] == [
        ("overflow", 0), ("overflow", 1), ("overflow", 2)]
    assert report.findings[0].detail == f"{ONE}1.845e+19 at l[0]"
    path = tmp_path / "u.jsonl"
    path.write_text('{"l": [18446744073709551615]}\n{"l": [1.5]}\n')
    assert [(f.category, f.record.line) for f in check_paths([path]).findings] == [("overflow", 1)]

    table = pa.table({"u": pa.array([1, big, 2 ** 63], pa.uint64()),
                      "lu": pa.array([[big], [1], None], pa.list_(pa.uint64())), "x": [0.5, 0.25, 0.125]})
    pq.write_table(table, tmp_path / "u.parquet")
    fast = check_paths([tmp_path / "u.parquet"])
    with monkeypatch.context() as m:
        m.setattr(columnar.TableCheck, "run", lambda self: self._inspect(np.arange(self.n)))
        slow = check_paths([tmp_path / "u.parquet"])
    for report in (fast, slow):
        assert [(f.category, f.record.index, f.field) for f in report.findings] == [
            ("overflow", 0, "lu"), ("overflow", 1, "u")]
        assert report.largest_magnitude.value == 2.0 ** 64


def test_the_listing_cap_keeps_the_first_records(tmp_path):
    """With --max-findings, the findings listed are those of the first records, whether a record's values are
    Python numbers or arrays."""
    data = [{"a": 1.0}, {"a": 1e30}, {"a": np.array([1e30])}, {"a": NAN}, {"a": np.array([NAN])}]
    report = nanscan.data.check(data, max_findings=1)
    assert [(f.category, f.record.index) for f in report.findings if f.category != "inconsistent"] == [
        ("overflow", 1), ("nonfinite", 3)]
    assert report.counts["overflow"] == 2 and report.counts["nonfinite"] == 2
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1.0}\n{"a": 1e30}\n{"a": [1e30]}\n')
    report = check_paths([path], max_findings=1)
    assert [(f.category, f.record.line) for f in report.findings if f.category == "overflow"] == [("overflow", 2)]
