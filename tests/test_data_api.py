"""`nanscan.data.check` over Python datasets: torch map-style and iterable datasets, lists of dicts, tuples of
tensors; loading errors are findings; identifiers are dataset indices with a digest of the record's content."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import nanscan.data
from nanscan.engine.record_digest import digest_object


class Pairs(Dataset):
    """(features, label) samples; sample 3 has a NaN feature, sample 5 a short feature vector."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        x = torch.ones(4, dtype=torch.bfloat16) * i
        if i == 3:
            x[2] = float("nan")
        if i == 5:
            x = torch.ones(3, dtype=torch.bfloat16)
        return x, i % 2


def test_map_style_torch_dataset():
    report = nanscan.data.check(Pairs(), name="pairs")
    assert report.records == 20
    nonfinite = [f for f in report.findings if f.category == "nonfinite"]
    assert [(f.record.file, f.record.index, f.field) for f in nonfinite] == [("pairs", 3, "[0]")]
    assert "NaN at [0][2]" in nonfinite[0].detail
    assert nonfinite[0].record.sha256 == digest_object(Pairs()[3])
    inconsistent = [f for f in report.findings if f.category == "inconsistent"]
    assert [(f.record.index, f.field) for f in inconsistent] == [(5, "[0]")]
    assert "array[bfloat16] of shape" not in inconsistent[0].detail and "shape [3] here, [4]" in inconsistent[0].detail
    assert report.largest_magnitude.value == 19.0 and report.largest_magnitude.record.index == 19


def test_list_of_dicts_every_category():
    records = [{"text": "a b c", "x": 1.0, "v": [1.0, 2.0]} for _ in range(20)]
    records[1] = {"text": "", "x": 1.0, "v": [1.0, 2.0]}
    records[2] = {"text": "a", "x": float("inf"), "v": [1.0, float("nan")]}
    records[3] = {"text": " ".join(["w"] * 100), "x": 1.0, "v": [1.0, 2.0]}
    records[4] = {"text": "a", "x": "one", "v": [1.0, 2.0]}
    records[5] = {}
    records[6] = {"text": "a", "x": None, "v": []}
    report = nanscan.data.check(records, max_tokens=10)
    got = sorted((f.category, f.record.index, f.field) for f in report.findings)
    # A null is an absent field: reported because 19 of 20 records have "x".
    assert got == [("empty", 1, "text"), ("empty", 5, None), ("empty", 6, "v"), ("inconsistent", 4, "x"),
                   ("inconsistent", 6, "x"), ("nonfinite", 2, "v"), ("nonfinite", 2, "x"), ("too_long", 3, None)]
    missing = [f for f in report.findings if f.record.index == 6 and f.category == "inconsistent"][0]
    assert "missing field(s) 'x'" in missing.detail
    assert nanscan.data.check([{"a": None}, None]).counts["empty"] == 2
    assert report.tokens["max"] == 100 and report.tokens["p50"] == 3


def test_numpy_numbers_and_nested_structures():
    records = [{"a": {"b": [np.float32(1.0), {"c": np.array([1.0, np.nan])}]}, "n": np.float16(np.inf)}]
    report = nanscan.data.check(records)
    details = sorted(f.detail for f in report.findings)
    assert details == ["1 non-finite value: +inf at n", "1 non-finite value: NaN at a.b[1].c[1]"]


def test_none_inside_a_number_list_is_not_nan():
    report = nanscan.data.check([{"v": [1.0, None, 2.0]}])
    assert report.counts["nonfinite"] == 0


class Flaky(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 1:
            raise OSError("disk hiccup")
        return {"x": torch.zeros(2)}


def test_a_record_that_fails_to_load_is_a_finding_and_the_check_goes_on():
    report = nanscan.data.check(Flaky())
    bad = [f for f in report.findings if f.category == "unreadable"]
    assert [(f.record.index, f.record.sha256) for f in bad] == [(1, None)]
    assert "OSError: disk hiccup" in bad[0].detail
    assert report.records == 4


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.tensor([1.0, 2.0])
        yield torch.tensor([float("-inf"), 2.0])
        raise RuntimeError("stream broke")


def test_iterable_dataset_and_iterator_failure():
    report = nanscan.data.check(Stream())
    assert [(f.category, f.record.index) for f in report.findings] == [("nonfinite", 1), ("unreadable", 2)]
    assert "stream broke" in report.findings[1].detail
    generator = ({"t": "x y"} for _ in range(5))
    assert nanscan.data.check(generator).records == 5
    assert nanscan.data.check(range(10), limit=3).records == 3


def test_strings_as_records_and_paths_are_delegated(tmp_path):
    report = nanscan.data.check(["one two", "", "three"], max_tokens=1)
    assert sorted((f.category, f.record.index) for f in report.findings) == [("empty", 1), ("too_long", 0)]
    path = tmp_path / "d.jsonl"
    path.write_text('{"x": NaN}\n')
    assert nanscan.data.check(str(path)).counts["nonfinite"] == 1
    assert nanscan.data.check([path]).counts["nonfinite"] == 1


def test_report_to_dict_is_strict_json_and_failing():
    import json

    report = nanscan.data.check([{"x": float("nan")}, {"x": 1e308 * 10}])
    text = json.dumps(report.to_dict(), allow_nan=False)
    data = json.loads(text)
    assert data["counts"]["nonfinite"] == 2 and data["ok"] is False
    assert report.failing() == {"nonfinite": 2} and report.failing(["empty"]) == {}


def test_digest_object_is_canonical():
    assert digest_object({"a": 1, "b": [1.0, "x"]}) == digest_object({"b": [1.0, "x"], "a": 1})
    assert digest_object({"a": 1}) != digest_object({"a": 1.0})
    assert digest_object(torch.zeros(2)) != digest_object(torch.zeros(2, dtype=torch.float64))
    assert digest_object(np.zeros((2, 1))) != digest_object(np.zeros((1, 2)))
    assert digest_object(["ab"]) != digest_object(["a", "b"])


def test_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match="max_tokens"):
        nanscan.data.check([], max_tokens=-1)
    with pytest.raises(ValueError, match="tokenizer file"):
        nanscan.data.check([], tokenizer="/nonexistent/tokenizer.json")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        nanscan.data.check_paths(["missing.jsonl"])


def test_field_tallies_stay_bounded(monkeypatch):
    from nanscan.data import findings

    monkeypatch.setattr(findings, "MAX_FIELDS", 5)
    monkeypatch.setattr(findings, "MAX_KEYSETS", 5)
    monkeypatch.setattr(findings, "MAX_VARIANTS_PER_FIELD", 5)
    checker = nanscan.data.Checker()
    from nanscan.data.findings import RecordRef

    for i in range(50):
        ref = RecordRef("d", index=i)
        checker.tracker.add(f"field{i}", "number", None, ref)
        checker.tracker.add("v", "list[number]", (i,), ref)
        checker.tracker.add_keys([f"k{i}"], 1, lambda k, ref=ref: [ref])
    assert len(checker.tracker._fields) == 5 and len(checker.tracker._keysets) == 5
    assert len(checker.tracker._fields["v"]) == 5 + 1  # five shapes, then the rest without a shape


def test_records_of_another_kind_than_the_rest_are_inconsistent():
    records = [{"x": float(i), "text": "t"} for i in range(10)] + [(1.0, 2.0), "a bare string"]
    report = nanscan.data.check(records)
    odd = {(f.record.index, f.field): f.detail for f in report.findings if f.category == "inconsistent"}
    assert odd[(10, "(record)")] == "the record is tuple here, object in 10 of 12 records"
    assert odd[(11, "(record)")] == "the record is string here, object in 10 of 12 records"
    assert nanscan.data.check([(torch.ones(2), 1)] * 5).ok  # all tuples: one kind
