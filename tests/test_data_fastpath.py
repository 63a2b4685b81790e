"""The columnar fast paths (JSON Lines through Arrow, Parquet record batches) must report exactly what the
per-record definition reports: the same findings, record identifiers, counts and token statistics."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanscan.data import check_paths
from nanscan.data import columnar, jsonl


def _summary(report):
    return {
        "counts": report.counts, "records": report.records, "tokens": report.tokens,
        "longest": report.longest.value if report.longest else None,
        "findings": sorted((f.category, str(f.record), f.record.sha256, f.field, f.detail) for f in report.findings),
    }


def _both_paths(monkeypatch, path, **kwargs):
    """(fast report, definition-only report) for the same file."""
    fast = check_paths([path], **kwargs)
    with monkeypatch.context() as m:
        m.setattr(jsonl.JsonLinesFile, "_parse", lambda self, data: None)
        m.setattr(columnar.TableCheck, "run", lambda self: self._inspect(np.arange(self.n)))
        slow = check_paths([path], **kwargs)
    return fast, slow


def _corpus_lines(rng: random.Random, n: int, period: int = 37) -> list[bytes]:
    """Uniform records with every kind of problem planted once per `period` lines (13 kinds)."""
    words = ["alpha", "beta", "gamma", "\u00e9t\u00e9", "x\u00a0y", "z\u3000w"]
    lines = []
    for i in range(n):
        record = {"id": i, "text": " ".join(rng.choices(words, k=rng.randint(1, 12))), "score": rng.random(),
                  "tags": rng.choices(["a", "b"], k=rng.randint(1, 3)), "vec": [rng.random() for _ in range(4)],
                  "meta": {"src": "web", "q": rng.random()}, "day": "2021-03-04"}
        line = json.dumps(record).encode()
        variant = i % period
        if variant == 3:
            line = line.replace(b'"score": ', b'"score": NaN, "s2": ')
        elif variant == 5:
            record["text"] = "   "
            line = json.dumps(record).encode()
        elif variant == 7:
            line = b""
        elif variant == 11:
            line = line[:-5]
        elif variant == 13:
            line = line.replace(b'"text": "', b'"text": "\xff')
        elif variant == 17:
            record["vec"] = record["vec"][:3]
            line = json.dumps(record).encode()
        elif variant == 19:
            record["score"] = "high"
            line = json.dumps(record).encode()
        elif variant == 23:
            del record["meta"]
            line = json.dumps(record).encode()
        elif variant == 25:
            record["meta"]["q"] = 3.4028235e38  # finite, but its square overflows float32
            line = json.dumps(record).encode()
        elif variant == 29:
            line = line.replace(b'"vec": [', b'"vec": [1e999, ')
        elif variant == 31:
            line = b"null"
        elif variant == 33:
            record["tags"] = []
            line = json.dumps(record).encode()
        elif variant == 35:
            record["meta"] = {}
            line = json.dumps(record).encode()
        lines.append(line)
    return lines


@pytest.mark.parametrize("seed", [0, 1])
def test_jsonl_fast_path_matches_definition(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(jsonl, "READ_BYTES", 4096)  # many blocks and carried-over lines
    monkeypatch.setattr(jsonl, "SPLIT_MIN", 512)
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b"\n".join(_corpus_lines(random.Random(seed), 600)) + b"\n")
    fast, slow = _both_paths(monkeypatch, path, max_tokens=8)
    assert _summary(fast) == _summary(slow)
    assert fast.records == 600
    for category in ("nonfinite", "overflow", "empty", "unreadable", "inconsistent", "too_long"):
        assert fast.counts[category] > 0, category
    assert fast.largest_magnitude is not None and slow.largest_magnitude is not None
    assert fast.largest_magnitude.value == slow.largest_magnitude.value


def test_jsonl_fast_path_checks_few_lines_individually(tmp_path, monkeypatch):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b"\n".join(_corpus_lines(random.Random(2), 6000, period=1500)) + b"\n")
    seen = []
    original = jsonl.check_json_line

    def spy(checker, raw, ref):
        seen.append(ref.line)
        return original(checker, raw, ref)

    monkeypatch.setattr(jsonl, "check_json_line", spy)
    report = check_paths([path])
    assert report.records == 6000
    assert report.counts["unreadable"] == 8 and report.counts["nonfinite"] == 8 and report.counts["overflow"] == 4
    # 52 planted lines; each costs at most a small piece of its neighbours, not the whole block.
    assert len(seen) < 6000 * 0.2


_TEXT = st.text(alphabet=st.sampled_from(list("ab \t\u00a0\u2009\u3000\u00e9\x00\u2028")), max_size=8)
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10 ** 20), 10 ** 20), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-100, 0]),  # the ignore index and a masked position (no_supervised_tokens)
    _TEXT, st.sampled_from(["2020-01-01", "2021-05-06 10:00:00"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["x", "y"]), inner, max_size=2), max_leaves=5)
_RECORDS = st.dictionaries(st.sampled_from(["a", "b", "text", "n", "input_ids", "labels", "loss_mask"]), _VALUES,
                           max_size=4)
# Records sharing one shape, so that Arrow accepts whole runs and the columnar checks do the work.
_UNIFORM = st.fixed_dictionaries(
    {"text": _TEXT, "n": st.floats(allow_nan=True, allow_infinity=True),
     "v": st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=0, max_size=3)},
    optional={"m": _VALUES, "o": st.dictionaries(st.sampled_from(["p", "q"]), st.integers(0, 3), max_size=2)})
_ODD_LINES = st.sampled_from([b"", b"   ", b"null", b"[1, 2]", b"5", b'{"a": 1} {"a": 2}', b"\xff\xfe", b"{not json",
                              b'{"a": 1e999}', b'{"a": Inf}', b'{"a": "\\ud800"}', b'{"a": 1, "a": 2}', b"{}",
                              b'{"a": {}}', b'{"a": []}', b'{"a": [null]}', b'{"a": -NaN}'])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(_RECORDS.map(lambda r: json.dumps(r).encode()), _ODD_LINES,
                                _UNIFORM.map(lambda r: json.dumps(r).encode())), min_size=1, max_size=25))
def test_jsonl_fast_path_matches_definition_on_arbitrary_lines(tmp_path_factory, monkeypatch, lines):
    monkeypatch.setattr(jsonl, "SPLIT_MIN", 16)
    path = tmp_path_factory.mktemp("h") / "x.jsonl"
    path.write_bytes(b"\n".join(lines))
    fast, slow = _both_paths(monkeypatch, path, max_tokens=2)
    assert _summary(fast) == _summary(slow)


def test_parquet_fast_path_matches_definition(tmp_path, monkeypatch):
    monkeypatch.setattr("nanscan.data.parquet.PARQUET_BATCH_ROWS", 64)
    rng = np.random.default_rng(0)
    n = 300
    vec = [list(rng.standard_normal(4)) for _ in range(n)]
    vec[10][2] = float("nan")
    vec[20] = vec[20][:3]
    vec[30] = []
    score = rng.standard_normal(n)
    score[40] = np.inf
    score[45] = -1e30
    text = [" ".join(["w"] * int(k)) for k in rng.integers(1, 9, n)]
    text[50] = ""
    text[60] = None
    half = pa.array(rng.standard_normal(n).astype(np.float16))
    table = pa.table({"vec": vec, "score": score, "text": text, "half": half,
                      "meta": [{"q": float(x), "lang": "en"} for x in rng.random(n)],
                      "day": pa.array(np.full(n, np.datetime64("2021-01-01", "D")))})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=100)
    fast, slow = _both_paths(monkeypatch, path, max_tokens=6)
    assert _summary(fast) == _summary(slow)
    assert fast.counts["nonfinite"] == 2 and fast.counts["empty"] == 2 and fast.counts["overflow"] == 1
    assert fast.counts["inconsistent"] == 2 and fast.counts["too_long"] > 0  # vec[20] short, text[60] absent
    assert fast.largest_magnitude.value == slow.largest_magnitude.value


def _training_records(n: int) -> list[dict]:
    """Pre-tokenized records (input_ids, labels, loss_mask, text) with fully ignored labels, all-zero masks, long
    id lists, scalar and boolean masks planted among them."""
    rng = random.Random(3)
    records = []
    for i in range(n):
        size = rng.randint(1, 6) + (40 if i % 29 == 4 else 0)
        labels = [-100] * size if i % 7 == 2 else [-100] * (size - 1) + [rng.randint(0, 50)]
        mask = [0] * size if i % 11 == 5 else [rng.randint(0, 1) for _ in range(size - 1)] + [1]
        records.append({"text": "a few words here", "input_ids": [rng.randint(0, 50) for _ in range(size)],
                        "labels": labels, "loss_mask": mask, "label": -100 if i % 13 == 6 else i})
    return records


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_training_fields_fast_path_matches_definition(tmp_path, monkeypatch, fmt):
    """Token ids counted in place of the text, no_supervised_tokens from list and scalar labels and masks: the
    columnar path flags exactly the records the per-record definition reports."""
    from nanscan.data import TrainingFields  # noqa: PLC0415

    records = _training_records(200)
    path = tmp_path / f"t.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        monkeypatch.setattr("nanscan.data.parquet.PARQUET_BATCH_ROWS", 64)
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=50)
    inspected = []
    original = columnar.TableCheck._inspect

    def spy(self, rows):
        inspected.extend(rows.tolist())
        original(self, rows)

    for fields in (TrainingFields(), TrainingFields(labels_field="label")):
        fast, slow = _both_paths(monkeypatch, path, max_tokens=30, fields=fields)
        assert _summary(fast) == _summary(slow)
        assert fast.tokens["max"] == max(len(r["input_ids"]) for r in records)  # ids, never the four words
        with monkeypatch.context() as m:
            m.setattr(columnar.TableCheck, "_inspect", spy)
            inspected.clear()
            check_paths([path], max_tokens=30, fields=fields)
        labels = [r["label"] == -100 if fields.labels_field == "label" else set(r["labels"]) == {-100}
                  for r in records]
        planted = [i for i, r in enumerate(records)
                   if labels[i] or not any(r["loss_mask"]) or len(r["input_ids"]) > 30]
        assert len(inspected) == len(planted) > 0  # the fast path checks only the planted records one by one
    expected = sum(r["labels"] == [-100] * len(r["labels"]) for r in records) + sum(
        not any(r["loss_mask"]) for r in records)
    assert check_paths([path], max_tokens=30).counts["no_supervised_tokens"] == expected > 0
    assert fast.counts["no_supervised_tokens"] == sum(r["label"] == -100 for r in records) + sum(
        not any(r["loss_mask"]) for r in records)
    assert fast.counts["too_long"] == sum(len(r["input_ids"]) > 30 for r in records) > 0
