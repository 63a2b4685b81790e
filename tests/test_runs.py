"""`nanscan runs DIR`: empty files, invalid JSON, non-finite numbers and missing required keys in a folder of run
records."""

from __future__ import annotations

import json

from click.testing import CliRunner

from nanscan.cli.main import main
from nanscan.data.runs import check_runs


def make_runs(root):
    (root / "a").mkdir(parents=True)
    (root / "a" / "good.json").write_text(json.dumps({"step": 3, "metrics": {"loss": 0.5}}))
    (root / "a" / "empty.json").write_bytes(b"")
    (root / "blank.json").write_text("  \n")
    (root / "broken.json").write_text('{"step": 3,')
    (root / "latin1.json").write_bytes(b'{"name": "\xe9"}')
    (root / "no_loss.json").write_text(json.dumps({"step": 1, "metrics": {}}))
    (root / "list.json").write_text("[1, 2]")
    (root / ".tmp-partial.json").write_text("{")  # a temporary name: skipped
    (root / "notes.txt").write_text("not a run record")


def test_problems_are_listed_with_their_paths(tmp_path):
    make_runs(tmp_path)
    report = check_runs(tmp_path, ["step", "metrics.loss"])
    assert report.files == 7
    got = {p.path.removeprefix(str(tmp_path) + "/"): (p.category, p.detail) for p in report.problems}
    assert got["a/empty.json"] == ("empty", "the file is empty")
    assert got["blank.json"] == ("empty", "the file holds only whitespace")
    assert got["broken.json"][0] == "invalid_json" and "line 1" in got["broken.json"][1]
    assert got["latin1.json"][0] == "invalid_json" and "not UTF-8" in got["latin1.json"][1]
    assert got["no_loss.json"] == ("missing_key", "missing required key(s): metrics.loss")
    assert got["list.json"][0] == "missing_key" and "not an object" in got["list.json"][1]
    assert "a/good.json" not in got and len(got) == 6


def test_without_required_keys_only_broken_files_are_problems(tmp_path):
    make_runs(tmp_path)
    report = check_runs(tmp_path)
    assert sorted(p.category for p in report.problems) == ["empty", "empty", "invalid_json", "invalid_json"]


def test_cli_exit_codes_and_json(tmp_path):
    runner = CliRunner()
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "r.json").write_text('{"step": 1}')
    result = runner.invoke(main, ["runs", str(clean), "--require", "step"])
    assert result.exit_code == 0 and "OK" in result.output
    make_runs(tmp_path / "mixed")
    result = runner.invoke(main, ["runs", str(tmp_path / "mixed"), "--require", "step", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["counts"] == {"empty": 2, "invalid_json": 2, "nonfinite": 0, "missing_key": 1, "unreadable": 0}
    assert all(p["path"].startswith(str(tmp_path)) for p in data["problems"])
    result = runner.invoke(main, ["runs", str(tmp_path / "mixed")], terminal_width=200)
    assert result.exit_code == 1 and "broken.json" in result.output
    result = runner.invoke(main, ["runs", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "nope" in result.output


def test_non_finite_numbers_are_problems(tmp_path):
    # Python's json reads NaN and Infinity (not JSON) and 1e999 (as inf): the check passed such records before.
    (tmp_path / "nan.json").write_text('{"step": 3, "metrics": {"loss": NaN, "acc": 0.5}}')
    (tmp_path / "inf.json").write_text('{"step": 4, "metrics": {"loss": 1e999}, "history": [1.0, -Infinity]}')
    (tmp_path / "fine.json").write_text('{"step": 5, "metrics": {"loss": 1e-999}}')  # underflows to 0.0: finite
    report = check_runs(tmp_path, ["step", "metrics.loss"])
    got = {p.path.rsplit("/", 1)[1]: (p.category, p.detail) for p in report.problems}
    assert set(got) == {"nan.json", "inf.json"}
    assert got["nan.json"][0] == "nonfinite" and "metrics.loss = NaN" in got["nan.json"][1]
    assert "metrics.loss = +inf, history[1] = -inf" in got["inf.json"][1]
    result = CliRunner().invoke(main, ["runs", str(tmp_path), "--json"])
    assert result.exit_code == 1 and json.loads(result.output)["counts"]["nonfinite"] == 2


def test_a_byte_order_mark_is_fine_and_an_empty_folder_is_a_problem(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "bom.json").write_bytes(b'\xef\xbb\xbf{"step": 1}')
    assert check_runs(tmp_path / "runs", ["step"]).ok
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no records here")
    report = check_runs(tmp_path / "empty", ["step"])  # before: "OK: 0 run records"
    assert [(p.category, p.path) for p in report.problems] == [("empty", str(tmp_path / "empty"))]
    assert CliRunner().invoke(main, ["runs", str(tmp_path / "empty")]).exit_code == 1
