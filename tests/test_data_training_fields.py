"""`nanscan data` on training fields: pre-tokenized records count their token ids (JSON Lines, Parquet, CSV, Python
records), --max-tokens flags a long one, and a record whose labels are all the ignore index or whose loss mask is
all 0 is a `no_supervised_tokens` finding with its stable id and sha256, on the command line and in --json."""

from __future__ import annotations

import csv
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from nanscan.cli.main import main
from nanscan.data import TrainingFields, check, check_paths
from nanscan.engine.record_digest import digest_object

RECORDS = [
    {"id": "a", "text": "one two", "input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "loss_mask": [0, 0, 1, 1]},
    {"id": "b", "text": "one two", "input_ids": [5, 6, 7], "labels": [-100, -100, -100], "loss_mask": [0, 1, 1]},
    {"id": "c", "text": "one two", "input_ids": list(range(300)), "labels": [1] * 300, "loss_mask": [1] * 300},
    {"id": "d", "text": "one two", "input_ids": [5, 6], "labels": [5, 6], "loss_mask": [0, 0]},
]


def write(tmp_path, fmt: str):
    path = tmp_path / f"train.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(RECORDS), path)
    else:  # the lists as JSON in their cells, as pandas' to_csv of lists would not write them but exporters do
        with open(path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(list(RECORDS[0]))
            for r in RECORDS:
                out.writerow([json.dumps(v, separators=(",", ":")) if isinstance(v, list) else v for v in r.values()])
    return path


def expected_sha256(path, fmt: str, row: int) -> str:
    if fmt == "parquet":
        return digest_object(pq.read_table(path).slice(row, 1).to_pylist()[0])
    lines = path.read_bytes().splitlines()
    return hashlib.sha256(lines[row + (fmt == "csv")]).hexdigest()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_a_fully_ignored_record_and_an_all_zero_mask_are_found_with_stable_ids(tmp_path, fmt):
    path = write(tmp_path, fmt)
    report = check_paths([path])
    found = sorted((f.record.line or f.record.index, f.field, f.record.sha256, f.detail) for f in report.findings
                   if f.category == "no_supervised_tokens")
    where = (lambda row: row + 2) if fmt == "csv" else (lambda row: row + 1) if fmt == "jsonl" else (lambda row: row)
    assert [(at, field) for at, field, _, _ in found] == [(where(1), "labels"), (where(3), "loss_mask")]
    assert found[0][2] == expected_sha256(path, fmt, 1) and found[1][2] == expected_sha256(path, fmt, 3)
    assert found[0][3].startswith("all 3 labels are the ignore index -100: no token is supervised")
    assert found[1][3].startswith("the loss mask is 0 at all 2 positions")
    assert report.counts["no_supervised_tokens"] == 2 and report.status() == "findings"  # it fails the check


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_pre_tokenized_records_count_their_ids_and_max_tokens_flags_a_long_one(tmp_path, fmt):
    path = write(tmp_path, fmt)
    result = CliRunner().invoke(main, ["data", str(path), "--max-tokens", "100", "--json"])
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    # the ids' lengths 4, 3, 300, 2: never 1 per list, nor the text's two words, nor the labels' cells
    assert (data["tokens"]["records"], data["tokens"]["p50"], data["tokens"]["max"]) == (4, 3, 300)
    (long,) = [f for f in data["findings"] if f["category"] == "too_long"]
    assert long["detail"] == "300 tokens > --max-tokens 100" and long["sha256"] == expected_sha256(path, fmt, 2)
    assert data["fields"] == {"token_fields": ["input_ids"], "labels_field": "labels", "ignore_index": -100,
                              "loss_mask_field": "loss_mask"}
    assert data["counts"]["no_supervised_tokens"] == 2 and "no_supervised_tokens" in data["failing"]


def test_without_a_token_field_the_text_is_counted(tmp_path):
    path = write(tmp_path, "jsonl")
    report = check_paths([path], fields=TrainingFields(token_fields=()))
    assert report.tokens["max"] == 3  # the text fields, "a" and "one two"


def test_the_field_names_and_the_ignore_index_are_options(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [{"ids": [1, 2, 3], "target": [-1, -1, -1], "weights": [1, 1, 1], "loss_mask": [0, 0, 0]},
            {"ids": [1, 2], "target": [-1, 4], "weights": [0.0, 0.0], "loss_mask": [0, 0]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["data", str(path), "--json", "--token-field", "ids", "--labels-field",
                                       "target", "--ignore-index", "-1", "--loss-mask-field", "weights"])
    data = json.loads(result.stdout)
    assert sorted((f["line"], f["field"]) for f in data["findings"]) == [(1, "target"), (2, "weights")]
    assert data["tokens"]["max"] == 3 and result.exit_code == 1
    result = CliRunner().invoke(main, ["data", str(path), "--json", "--labels-field", "", "--loss-mask-field", ""])
    assert json.loads(result.stdout)["counts"]["no_supervised_tokens"] == 0 and result.exit_code == 0
    human = CliRunner().invoke(main, ["data", str(path), "--labels-field", "target", "--ignore-index", "-1"])
    assert f"no_supervised_tokens {path}:1 field target: all 3 labels are the ignore index -1" in human.stdout


def test_python_records_with_tensors_and_a_scalar_label():
    records = [{"input_ids": torch.arange(6), "labels": torch.full((6,), -100)},
               {"input_ids": torch.arange(2), "labels": torch.tensor([-100, 3])}]
    report = check(records, max_tokens=5)
    assert sorted((f.category, f.record.index) for f in report.findings) == [("no_supervised_tokens", 0),
                                                                             ("too_long", 0)]
    assert report.tokens["max"] == 6
    classified = check([{"text": "fine", "labels": 2}, {"text": "ignored", "labels": -100}])
    assert [(f.record.index, f.detail.split(":")[0]) for f in classified.findings] == [
        (1, "the label is the ignore index -100")]
    with pytest.raises(TypeError, match="ignore_index=0.5"):
        TrainingFields(ignore_index=0.5)
    with pytest.raises(TypeError, match=r"token_fields='ids': give a tuple of field names, e.g. \('ids',\)"):
        TrainingFields(token_fields="ids")
