"""`nanscan data` on every format: one fixture per finding, clean files that pass, and broken files (binary
garbage, truncated gzip, huge lines, non-UTF-8 bytes, truncated images) that become findings instead of crashes.
All fixtures are generated here."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from nanscan.cli.main import main
from nanscan.data import check_paths


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def by_category(report, category):
    return [f for f in report.findings if f.category == category]


def only(report, category):
    found = by_category(report, category)
    assert len(found) == 1, (category, report.counts, [f.to_dict() for f in report.findings])
    return found[0]


def run_cli(*args):
    return CliRunner().invoke(main, ["data", *map(str, args)])


GARBAGE = bytes(range(256)) * 40 + b"\x00\xff\xfe" * 100


# -- JSON Lines ---------------------------------------------------------------------------------------------------
def _doc(i, **change):
    record = {"id": i, "text": f"document number {i}", "score": 0.5 + i, "vec": [1.0, 2.0, 3.0]}
    record.update(change)
    return json.dumps(record).encode()


def test_jsonl_clean_file_passes(tmp_path):
    path = tmp_path / "clean.jsonl"
    path.write_bytes(b"\n".join(_doc(i) for i in range(50)) + b"\n")
    result = run_cli(path, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["ok"] and out["records"] == 50 and out["findings"] == []
    assert out["tokens"] == {"records": 50, "p50": 3, "p99": 3, "max": 3, "tokenizer": "whitespace",
                             "max_tokens": None}


def test_jsonl_each_finding_with_stable_ids(tmp_path):
    lines = [_doc(i) for i in range(40)]
    lines[2] = b'{"id": 2, "text": "a b", "score": NaN, "vec": [1.0, 2.0, 3.0]}'
    lines[4] = _doc(4, vec=[1.0, 1e999, float("-inf")]).replace(b"-Infinity", b"-1e999")
    lines[6] = _doc(6, text="")
    lines[8] = b""
    lines[10] = _doc(10, text=" ".join(["w"] * 50))
    lines[12] = b'{"id": 12, "text": "broken'
    lines[14] = _doc(14).replace(b"document", b"docu\xc3\x28ment")
    lines[16] = _doc(16, score="high")
    lines[18] = _doc(18, vec=[1.0, 2.0])
    lines[20] = json.dumps({"id": 20, "text": "no score here", "vec": [1.0, 2.0, 3.0]}).encode()
    lines[22] = b"null"
    lines[24] = _doc(24, vec=[])
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = check_paths([path], max_tokens=20)
    assert report.records == 40

    def at(line, category):
        found = [f for f in report.findings if f.record.line == line and f.category == category]
        assert len(found) == 1, (line, category, [f.to_dict() for f in report.findings])
        assert found[0].record.sha256 == sha(lines[line - 1])
        assert found[0].record.file == str(path)
        return found[0]

    assert at(3, "nonfinite").field == "score" and "NaN at score" in at(3, "nonfinite").detail
    assert "+inf at vec[1]" in at(5, "nonfinite").detail and "-inf at vec[2]" in at(5, "nonfinite").detail
    assert at(7, "empty").field == "text"
    assert at(9, "empty").detail == "blank line"
    assert "50 tokens" in at(11, "too_long").detail
    assert "invalid JSON" in at(13, "unreadable").detail
    assert "not UTF-8" in at(15, "unreadable").detail
    assert "string here, number" in at(17, "inconsistent").detail
    assert "shape [2] here, [3]" in at(19, "inconsistent").detail
    assert "missing field(s) 'score'" in at(21, "inconsistent").detail
    assert "empty record" in at(23, "empty").detail
    assert "zero-length sequence" in at(25, "empty").detail
    assert report.counts == {"nonfinite": 2, "overflow": 0, "empty": 4, "too_long": 1, "no_supervised_tokens": 0,
                             "corrupt_image": 0, "unreadable": 2, "inconsistent": 3}
    assert report.longest.value == 50 and report.longest.record.line == 11
    assert report.largest_magnitude.value == 39.5


def test_jsonl_gzip_matches_plain_and_truncated_gzip_is_reported(tmp_path):
    lines = [_doc(i) for i in range(2000)]
    lines[5] = b'{"id": 5, "text": "x", "score": Infinity, "vec": [1.0, 2.0, 3.0]}'
    data = b"\n".join(lines) + b"\n"
    plain, packed, cut = tmp_path / "a.jsonl", tmp_path / "a.jsonl.gz", tmp_path / "cut.jsonl.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))
    blob = gzip.compress(data)
    cut.write_bytes(blob[: len(blob) // 2])
    a, b = check_paths([plain]), check_paths([packed])
    assert a.counts == b.counts and a.records == b.records == 2000
    assert [f.record.sha256 for f in a.findings] == [f.record.sha256 for f in b.findings]
    c = check_paths([cut])
    truncated = only(c, "unreadable")
    assert "truncated" in truncated.detail and truncated.record.line is None
    assert truncated.record.sha256 == sha(cut.read_bytes())
    assert only(c, "nonfinite").record.line == 6  # the part before the cut was checked
    assert 0 < c.records < 2000
    assert run_cli(cut).exit_code == 3  # cut short: the records after the break were not checked


def test_jsonl_multi_member_gzip(tmp_path):
    path = tmp_path / "m.jsonl.gz"
    path.write_bytes(gzip.compress(_doc(0) + b"\n") + gzip.compress(_doc(1) + b"\n"))
    report = check_paths([path])
    assert report.records == 2 and report.ok


def test_jsonl_binary_garbage_is_unreadable_not_a_crash(tmp_path):
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(GARBAGE)
    report = check_paths([path])
    assert report.records >= 1 and report.counts["unreadable"] >= 1
    assert report.counts["unreadable"] + report.counts["empty"] == report.records
    not_gzip = tmp_path / "garbage.jsonl.gz"
    not_gzip.write_bytes(GARBAGE)
    assert "gzip" in only(check_paths([not_gzip]), "unreadable").detail


def test_jsonl_huge_single_line(tmp_path):
    big_text = "word " * 400_000
    line = json.dumps({"text": big_text, "x": 1.0}).encode()
    path = tmp_path / "huge.jsonl"
    path.write_bytes(_doc(0) + b"\n" + line + b"\n" + _doc(2) + b"\n")
    report = check_paths([path], max_tokens=1000)
    assert report.records == 3
    assert only(report, "too_long").record.line == 2
    assert report.longest.value == 400_000
    # Past --max-record-bytes the line is hashed in passing, never loaded.
    small = check_paths([path], max_record_bytes=1 << 20)
    skipped = only(small, "unreadable")
    assert skipped.record.line == 2 and skipped.record.sha256 == sha(line)
    assert "exceeds --max-record-bytes" in skipped.detail and small.records == 3


def test_jsonl_line_without_final_newline_and_crlf(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(_doc(0) + b"\r\n" + _doc(1, score=float("nan")) + b"\r\n" + _doc(2))
    report = check_paths([path])
    assert report.records == 3
    assert only(report, "nonfinite").record.line == 2


def test_jsonl_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"text": "hello world, hello"}\n{"text": "hello"}\n')
    report = check_paths([path], tokenizer=tok_path, max_tokens=3)
    assert report.tokenizer == "tokenizer.json:tokenizer.json"
    assert report.tokens["max"] == 4  # hello, world, ",", hello
    assert only(report, "too_long").record.line == 1
    result = run_cli(path, "--tokenizer", tok_path, "--max-tokens", 3, "--fail-on", "too_long")
    assert result.exit_code == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = run_cli(path, "--tokenizer", bad)
    assert result.exit_code == 2 and "bad.json" in result.output


def test_text_field_option_restricts_token_counting(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"title": "a b c d e f", "body": "x y", "ids": [1, 2, 3, 4, 5, 6, 7]}\n')
    assert check_paths([path]).tokens["max"] == 8
    assert check_paths([path], text_fields=["body"]).tokens["max"] == 2
    assert check_paths([path], text_fields=["ids"]).tokens["max"] == 7  # pre-tokenized ids count as tokens


# -- CSV ----------------------------------------------------------------------------------------------------------
def test_csv_findings_and_clean(tmp_path):
    clean = tmp_path / "clean.csv"
    clean.write_text("id,text,x\n1,hello there,0.5\n2,more text,1.5\n")
    assert check_paths([clean]).ok and check_paths([clean]).records == 2
    rows = ["id,text,x", "1,hello,0.5", "2,hi,nan", "3,,1.0", "4,a b,1e999", "5,ok", "6,ok,high", "7,ok,2.0",
            "8,ok,3.0", "9,ok,4.0", "10,ok,5.0", '11,"quoted, with comma",6.0']
    data = ("\n".join(rows) + "\n").encode().replace(b"10,ok", b"10,\xff\xfe")
    path = tmp_path / "bad.csv"
    path.write_bytes(data)
    report = check_paths([path])
    lines = data.split(b"\n")

    def at(line, category):
        found = [f for f in report.findings if f.record.line == line and f.category == category]
        assert len(found) == 1, (line, category, [f.to_dict() for f in report.findings])
        assert found[0].record.sha256 == sha(lines[line - 1])
        return found[0]

    assert "NaN at x" in at(3, "nonfinite").detail
    assert at(4, "empty").field == "text"
    assert "+inf at x" in at(5, "nonfinite").detail
    assert "2 cells where the header has 3" in at(6, "inconsistent").detail
    assert "string here" in at(7, "inconsistent").detail
    assert "not UTF-8" in at(11, "unreadable").detail
    assert report.records == 11


def test_csv_gzip_tsv_multiline_record_and_garbage(tmp_path):
    path = tmp_path / "t.tsv.gz"
    path.write_bytes(gzip.compress(b'a\tb\n1\t"two\nlines"\n2\tnan\n'))
    report = check_paths([path])
    assert report.records == 2
    assert only(report, "nonfinite").record.line == 4  # the multi-line record takes lines 2-3
    garbage = tmp_path / "g.csv"
    garbage.write_bytes(GARBAGE)
    assert check_paths([garbage]).records >= 1  # reported, not raised
    empty = tmp_path / "empty.csv"
    empty.write_bytes(b"")
    assert "no records" in only(check_paths([empty]), "empty").detail


def test_csv_too_long(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,text\n1,short\n2," + " ".join(["w"] * 40) + "\n")
    report = check_paths([path], max_tokens=10)
    assert only(report, "too_long").record.line == 3 and report.tokens["max"] == 40


# -- Parquet ------------------------------------------------------------------------------------------------------
def test_parquet_findings_clean_and_garbage(tmp_path):
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.table({"x": [1.0, 2.0], "t": ["a b", "c"]}), clean)
    assert check_paths([clean]).ok
    n = 20
    x = [float(i) for i in range(n)]
    x[1] = float("nan")
    v = [[1.0, 2.0] for _ in range(n)]
    v[2] = [1.0, float("inf")]
    v[3] = []
    t = ["a"] * n
    t[4] = None  # absent: most rows have "t"
    t[5] = "  "
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": x, "v": v, "t": t}), path)
    report = check_paths([path])
    assert {(f.category, f.record.index, f.field) for f in report.findings} == {
        ("nonfinite", 1, "x"), ("nonfinite", 2, "v"), ("empty", 3, "v"), ("inconsistent", 4, "t"),
        ("empty", 5, "t")}
    assert all(f.record.sha256 and len(f.record.sha256) == 64 for f in report.findings)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(GARBAGE)
    assert "not a readable Parquet file" in only(check_paths([garbage]), "unreadable").detail
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(path.read_bytes()[:-40])
    assert only(check_paths([truncated]), "unreadable")


# -- arrays -------------------------------------------------------------------------------------------------------
def test_npy_rows_with_nonfinite_values(tmp_path):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    a[3, 1] = np.nan
    a[7, 0] = -np.inf
    path = tmp_path / "a.npy"
    np.save(path, a)
    report = check_paths([path])
    rows = by_category(report, "nonfinite")
    assert [f.record.index for f in rows] == [3, 7]
    assert rows[0].record.sha256 == sha(a[3].tobytes()) and "NaN at array[3][1]" in rows[0].detail
    assert report.records == 10
    assert report.largest_magnitude.value == 39.0 and report.largest_magnitude.record.index == 9
    clean = tmp_path / "clean.npy"
    np.save(clean, np.ones((5, 5)))
    assert run_cli(clean).exit_code == 0


def test_npy_chunked_scan_fortran_order_and_dtypes(tmp_path, monkeypatch):
    monkeypatch.setattr("nanscan.data.arrays.SCAN_BYTES", 64)  # many chunks, rows split across none
    f = np.asfortranarray(np.ones((50, 7), dtype=np.float64))
    f[[4, 33], [6, 2]] = np.nan
    np.save(tmp_path / "f.npy", f)
    assert [x.record.index for x in by_category(check_paths([tmp_path / "f.npy"]), "nonfinite")] == [4, 33]
    h = np.ones(300, dtype=np.float16)
    h[[0, 299]] = [np.inf, np.nan]
    np.save(tmp_path / "h.npy", h)
    assert [x.record.index for x in by_category(check_paths([tmp_path / "h.npy"]), "nonfinite")] == [0, 299]
    c = np.ones((3, 2), dtype=np.complex64)
    c[1, 1] = complex(0, np.nan)
    np.save(tmp_path / "c.npy", c)
    assert only(check_paths([tmp_path / "c.npy"]), "nonfinite").record.index == 1
    np.save(tmp_path / "scalar.npy", np.float64(np.nan))
    scalar = only(check_paths([tmp_path / "scalar.npy"]), "nonfinite")
    assert scalar.record.index is None
    np.save(tmp_path / "ints.npy", np.arange(10))
    assert check_paths([tmp_path / "ints.npy"]).ok


def test_npy_empty_garbage_truncated_object(tmp_path):
    np.save(tmp_path / "empty.npy", np.zeros((0, 3), dtype=np.float32))
    assert "zero-sized" in only(check_paths([tmp_path / "empty.npy"]), "empty").detail
    (tmp_path / "garbage.npy").write_bytes(GARBAGE)
    assert "not a valid .npy" in only(check_paths([tmp_path / "garbage.npy"]), "unreadable").detail
    np.save(tmp_path / "full.npy", np.ones((100, 10), dtype=np.float32))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "full.npy").read_bytes()[:2000])
    assert "truncated" in only(check_paths([tmp_path / "cut.npy"]), "unreadable").detail
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert "pickle" in only(check_paths([tmp_path / "obj.npy"]), "unreadable").detail


def test_npz_members_compressed_and_inconsistent_samples(tmp_path):
    x = np.ones((6, 3), dtype=np.float32)
    x[2, 2] = np.nan
    np.savez_compressed(tmp_path / "a.npz", x=x, y=np.arange(6))
    f = only(check_paths([tmp_path / "a.npz"]), "nonfinite")
    assert (f.record.member, f.record.index) == ("x", 2) and f.record.sha256 == sha(x[2].tobytes())
    samples = [np.ones((4, 4), np.float32)] * 5 + [np.ones((4, 3), np.float32)] * 0
    samples = samples + [np.ones((4, 4), np.float32)] * 5 + [np.ones((2, 4), np.float32)]
    np.savez(tmp_path / "samples.npz", *samples)
    odd = only(check_paths([tmp_path / "samples.npz"]), "inconsistent")
    assert odd.record.member == "arr_10" and "shape [2, 4] here, [4, 4]" in odd.detail
    (tmp_path / "garbage.npz").write_bytes(GARBAGE)
    assert only(check_paths([tmp_path / "garbage.npz"]), "unreadable")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x.npy", b"\x93NUMPY garbage")
    (tmp_path / "badmember.npz").write_bytes(buf.getvalue())
    assert only(check_paths([tmp_path / "badmember.npz"]), "unreadable").record.member == "x"


def test_safetensors_bf16_rows_and_garbage(tmp_path):
    w = torch.ones(8, 4, dtype=torch.bfloat16)
    w[5, 3] = float("inf")
    save_torch({"w": w, "ids": torch.arange(3)}, str(tmp_path / "m.safetensors"))
    f = only(check_paths([tmp_path / "m.safetensors"]), "nonfinite")
    assert (f.record.member, f.record.index) == ("w", 5)
    assert f.record.sha256 == sha(w[5].contiguous().view(torch.uint8).numpy().tobytes())
    save_numpy({"a": np.ones((3, 3), np.float32)}, str(tmp_path / "clean.safetensors"))
    assert check_paths([tmp_path / "clean.safetensors"]).ok
    (tmp_path / "garbage.safetensors").write_bytes(GARBAGE)
    assert "safetensors" in only(check_paths([tmp_path / "garbage.safetensors"]), "unreadable").detail
    good = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(good[:-10])
    assert only(check_paths([tmp_path / "cut.safetensors"]), "unreadable")


def test_folder_of_arrays_shape_and_dtype_consistency(tmp_path):
    for i in range(12):
        np.save(tmp_path / f"s{i:02d}.npy", np.ones((3, 8), dtype=np.float32))
    np.save(tmp_path / "s12.npy", np.ones((3, 7), dtype=np.float32))
    for i in range(10):
        save_torch({"x": torch.ones(2, 2)}, str(tmp_path / f"t{i}.safetensors"))
    save_torch({"x": torch.ones(2, 2, dtype=torch.float64)}, str(tmp_path / "t_odd.safetensors"))
    save_torch({"empty": torch.ones(0, 4)}, str(tmp_path / "u.safetensors"))
    report = check_paths([tmp_path])
    odd = {f.record.file.rsplit("/", 1)[1]: f for f in by_category(report, "inconsistent")}
    assert set(odd) == {"s12.npy", "t_odd.safetensors"}
    assert "shape [3, 7] here, [3, 8]" in odd["s12.npy"].detail
    assert odd["s12.npy"].record.sha256 == sha((tmp_path / "s12.npy").read_bytes())
    assert "array[float64]" in odd["t_odd.safetensors"].detail
    assert only(report, "empty").record.member == "empty"


# -- images -------------------------------------------------------------------------------------------------------
def _image_bytes(fmt, size=(32, 24), mode="RGB", **save):
    buf = io.BytesIO()
    Image.new(mode, size, color=None if mode == "F" else 128).save(buf, fmt, **save)
    return buf.getvalue()


def test_image_folder_every_format_and_corruptions(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for fmt, suffix in [("PNG", "png"), ("JPEG", "jpg"), ("WEBP", "webp"), ("BMP", "bmp"), ("TIFF", "tif")]:
        (folder / f"ok.{suffix}").write_bytes(_image_bytes(fmt))
    assert check_paths([folder]).ok and check_paths([folder]).records == 5
    # A GIF decodes to a palette image: fine on its own, inconsistent among RGB images.
    (folder / "ok.gif").write_bytes(_image_bytes("GIF"))
    assert "image[P] of shape [24, 32]" in only(check_paths([folder]), "inconsistent").detail
    assert check_paths([folder / "ok.gif"]).ok
    png = _image_bytes("PNG", size=(64, 64))
    (folder / "truncated.png").write_bytes(png[: len(png) // 2])  # valid header, body cut
    jpg = _image_bytes("JPEG", size=(64, 64))
    (folder / "truncated.jpg").write_bytes(jpg[: len(jpg) // 2])
    (folder / "zero.png").write_bytes(b"")
    (folder / "text.png").write_bytes(b"this is not an image")
    (folder / "notes.txt").write_text("skipped: not a data file")
    (folder / ".hidden.png").write_bytes(b"ignored")
    report = check_paths([folder])
    corrupt = {f.record.file.rsplit("/", 1)[1]: f for f in by_category(report, "corrupt_image")}
    assert set(corrupt) == {"truncated.png", "truncated.jpg", "zero.png", "text.png"}
    assert corrupt["zero.png"].detail == "zero bytes"
    assert corrupt["truncated.png"].record.sha256 == sha(png[: len(png) // 2])
    assert report.records == 10 and report.skipped == [str(folder / "notes.txt")]
    result = run_cli(folder, "--json")
    assert result.exit_code == 1 and json.loads(result.output)["counts"]["corrupt_image"] == 4


def test_image_mode_inconsistency_and_float_pixels(tmp_path):
    for i in range(10):
        (tmp_path / f"rgb{i}.png").write_bytes(_image_bytes("PNG"))
    (tmp_path / "gray.png").write_bytes(_image_bytes("PNG", mode="L"))
    odd = only(check_paths([tmp_path]), "inconsistent")
    assert odd.record.file.endswith("gray.png") and "image[L]" in odd.detail
    pixels = np.ones((4, 5), dtype=np.float32)
    pixels[1, 2] = np.nan
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="F").save(buf, "TIFF")
    (tmp_path / "float.tif").write_bytes(buf.getvalue())
    f = only(check_paths([tmp_path / "float.tif"]), "nonfinite")
    assert "NaN at image[1][2]" in f.detail


def test_unknown_suffix_is_sniffed_or_reported(tmp_path):
    (tmp_path / "data.bin").write_bytes(_doc(0) + b"\n")
    assert check_paths([tmp_path / "data.bin"]).records == 1
    (tmp_path / "mystery.bin").write_bytes(GARBAGE)
    assert "format not recognised" in only(check_paths([tmp_path / "mystery.bin"]), "unreadable").detail


# -- CLI ----------------------------------------------------------------------------------------------------------
def test_cli_exit_codes_and_fail_on(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(_doc(0) + b"\n" + _doc(1, text=" ".join(["w"] * 30)) + b"\n")
    assert run_cli(path).exit_code == 0
    assert run_cli(path, "--max-tokens", 10).exit_code == 0  # too_long does not fail by default
    assert run_cli(path, "--max-tokens", 10, "--fail-on", "too_long").exit_code == 1
    assert run_cli(path, "--max-tokens", 10, "--fail-on", "all").exit_code == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"{oops\n")
    assert run_cli(bad).exit_code == 1
    assert run_cli(bad, "--fail-on", "none").exit_code == 0
    assert run_cli(bad, "--fail-on", "nonfinite,empty").exit_code == 0
    result = run_cli(bad, "--fail-on", "bogus")
    assert result.exit_code == 2 and "bogus" in result.output
    result = run_cli(tmp_path / "missing.jsonl")
    assert result.exit_code == 2 and "missing.jsonl" in result.output


def test_cli_human_output_names_records(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(_doc(0) + b"\n" + b'{"id": 1, "text": "t", "score": NaN, "vec": [1.0, 2.0, 3.0]}\n')
    result = CliRunner().invoke(main, ["data", str(path)], terminal_width=200)
    assert result.exit_code == 1
    assert "nonfinite" in result.output and f"{path}:2" in result.output and "FAIL" in result.output


def test_findings_listing_is_capped_but_counts_are_exact(tmp_path):
    a = np.full((500, 2), np.nan, dtype=np.float32)
    np.save(tmp_path / "nan.npy", a)
    report = check_paths([tmp_path / "nan.npy"], max_findings=7)
    assert report.counts["nonfinite"] == 500 and len(report.findings) == 7


def test_fields_are_compared_within_each_given_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for i in range(12):
        (tmp_path / "a" / f"{i}.jsonl").write_text('{"x": 1.0, "text": "t"}\n')
    (tmp_path / "a" / "odd.jsonl").write_text('{"x": "one", "text": "t"}\n')
    (tmp_path / "b" / "other.jsonl").write_text('{"label": 3}\n{"label": 4}\n')
    report = check_paths([tmp_path / "a", tmp_path / "b"])
    assert [f.record.file.rsplit("/", 1)[1] for f in by_category(report, "inconsistent")] == ["odd.jsonl"]


# -- adversarial inputs: each once crashed the check, hid a finding, or named the wrong place -----------------------
def test_jsonl_absurd_nesting_is_unreadable_not_a_crash(tmp_path):
    # Arrow's JSON reader recursed once per level and overflowed its stack: the whole process died. A subprocess
    # keeps such a crash from taking the test run with it.
    path = tmp_path / "deep.jsonl"
    deep = b'{"a": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    path.write_bytes(_doc(0) + b"\n" + deep + b"\n" + _doc(2, score=float("nan")) + b"\n")
    result = subprocess.run([sys.executable, "-m", "nanscan", "data", str(path), "--json"], capture_output=True,
                            timeout=120)
    assert result.returncode == 1, result.stderr.decode()[-2000:]
    out = json.loads(result.stdout)
    assert [(f["category"], f["line"]) for f in out["findings"]] == [("unreadable", 2), ("nonfinite", 3)]
    assert "RecursionError" in out["findings"][0]["detail"] and out["findings"][0]["sha256"] == sha(deep)


def test_jsonl_nesting_a_parser_can_read_gives_the_same_findings_on_both_paths(tmp_path):
    from nanscan.data.jsonl import MAX_ARROW_DEPTH, nesting_depth

    assert nesting_depth(b'{"a": [[1], {"b": []}]}') == 4
    assert nesting_depth(b'{"s": "[[[[{{{{", "t": "\\\\\\"[["}') == 1  # brackets and escaped quotes in strings
    assert nesting_depth(b'{"s": "]]]]]]", "a": [[[0]]]}') == 4  # closing brackets in strings do not hide depth
    depth = MAX_ARROW_DEPTH + 50
    nested_nan = b'{"a": ' + b"[" * depth + b"NaN" + b"]" * depth + b"}"
    many_pairs = json.dumps({"points": [[i, i + 0.5] for i in range(2 * MAX_ARROW_DEPTH)]}).encode()
    path = tmp_path / "nested.jsonl"
    path.write_bytes(b"\n".join([many_pairs, nested_nan, many_pairs]) + b"\n")
    report = check_paths([path])
    found = only(report, "nonfinite")
    assert found.record.line == 2 and "NaN at a" + "[0]" * depth in found.detail
    assert report.records == 3 and report.counts["unreadable"] == 0


def test_jsonl_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    first = b'{"text": "a b", "x": NaN}'
    data = b"\xef\xbb\xbf" + first + b"\n" + _doc(1) + b"\n"
    plain, packed = tmp_path / "bom.jsonl", tmp_path / "bom.jsonl.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))
    for path in (plain, packed):
        report = check_paths([path])
        found = only(report, "nonfinite")  # before: line 1 was `unreadable` and its NaN never seen
        assert (found.record.line, found.record.sha256) == (1, sha(first))
        assert report.records == 2 and report.counts["unreadable"] == 0
    (tmp_path / "only_bom.jsonl").write_bytes(b"\xef\xbb\xbf")
    assert "no records" in only(check_paths([tmp_path / "only_bom.jsonl"]), "empty").detail
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfx,label\n1.5,a\nnan,b\n")
    assert only(check_paths([tmp_path / "bom.csv"]), "nonfinite").field == "x"  # not "\ufeffx"


def test_jsonl_lines_that_are_not_objects_are_inconsistent(tmp_path):
    lines = [_doc(i) for i in range(20)]
    lines[3], lines[7], lines[11], lines[13] = b"[1.0, 2.0, 3.0]", b'"just text"', b"42", b"[1.0, NaN]"
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = check_paths([path])
    odd = {f.record.line: f.detail for f in by_category(report, "inconsistent")}
    assert odd == {4: "the record is list[number] of shape [3] here, object in 16 of 20 records",
                   8: "the record is string here, object in 16 of 20 records",
                   12: "the record is number here, object in 16 of 20 records",
                   14: "the record is list[number] of shape [2] here, object in 16 of 20 records"}
    assert only(report, "nonfinite").record.line == 14
    assert check_paths([tmp_path / "mixed.jsonl"]).findings == report.findings  # the same on a second run


def test_npy_big_endian_long_double_and_zero_d(tmp_path):
    # Rows holding non-finite values are read again for details: for these dtypes that raised.
    big = np.array([[1.0, 2.0], [np.nan, 4.0], [5.0, -np.inf]], dtype=">f8")
    np.save(tmp_path / "big.npy", big)
    report = check_paths([tmp_path / "big.npy"])
    assert [(f.record.index, f.record.sha256) for f in report.findings] == [
        (1, sha(big[1].tobytes())), (2, sha(big[2].tobytes()))]  # the stored (big-endian) bytes
    assert "NaN at array[1][0]" in report.findings[0].detail and report.largest_magnitude.value == 5.0
    np.save(tmp_path / "long.npy", np.array([1.0, np.inf], dtype=np.longdouble))
    assert only(check_paths([tmp_path / "long.npy"]), "nonfinite").record.index == 1
    np.save(tmp_path / "scalar.npy", np.array(np.nan, dtype=">f4"))
    found = only(check_paths([tmp_path / "scalar.npy"]), "nonfinite")
    assert found.detail == "1 non-finite value: NaN at array"  # a 0-d array has no [0]
    assert found.record.index is None and found.record.sha256 == sha(np.array(np.nan, dtype=">f4").tobytes())
    np.savez(tmp_path / "big.npz", a=big)
    assert [f.record.sha256 for f in check_paths([tmp_path / "big.npz"]).findings] == [
        sha(big[1].tobytes()), sha(big[2].tobytes())]


def test_structured_arrays_are_scanned_field_by_field(tmp_path):
    point = np.dtype([("pos", [("x", ">f4"), ("y", "<f8")]), ("feat", "<f2", (3,)), ("label", "<i4")])
    rows = np.zeros(5, dtype=point)
    rows["pos"]["x"] = [1, 2, 3, np.nan, 5]
    rows["feat"][1] = [0.5, np.inf, 1.0]
    rows["pos"]["y"][4] = 7.0
    np.save(tmp_path / "points.npy", rows)
    report = check_paths([tmp_path / "points.npy"])  # before: no finding, the NaN and inf went unseen
    assert [(f.record.index, f.field, f.detail) for f in report.findings] == [
        (1, "array.feat", "1 non-finite value: +inf at array.feat[1][1]"),
        (3, "array.pos.x", "1 non-finite value: NaN at array.pos.x[3]")]
    assert report.findings[1].record.sha256 == sha(rows[3:4].tobytes())
    assert (report.largest_magnitude.value, report.largest_magnitude.record.index) == (7.0, 4)
    assert report.largest_magnitude.field == "array.pos.y"
    np.savez_compressed(tmp_path / "points.npz", p=rows)
    assert [(f.record.member, f.record.index, f.field) for f in check_paths([tmp_path / "points.npz"]).findings] == [
        ("p", 1, "p.feat"), ("p", 3, "p.pos.x")]
    clean = np.zeros(4, dtype=point)
    np.save(tmp_path / "clean.npy", clean)
    assert check_paths([tmp_path / "clean.npy"]).ok
    np.save(tmp_path / "with_object.npy", np.zeros(2, dtype=[("x", "f4"), ("o", "O")]), allow_pickle=True)
    assert "pickle" in only(check_paths([tmp_path / "with_object.npy"]), "unreadable").detail


def test_safetensors_complex_and_e8m0_tensors_are_scanned(tmp_path):
    c = torch.tensor([[1 + 1j, 2 + 0j], [complex(0, float("nan")), 1j]], dtype=torch.complex64)
    scale = torch.tensor([1.0, 2.0, 4.0]).to(torch.float8_e8m0fnu)
    scale.view(torch.uint8)[2] = 0xFF  # e8m0's only NaN
    save_torch({"c": c, "scale": scale}, str(tmp_path / "t.safetensors"))
    report = check_paths([tmp_path / "t.safetensors"])
    assert [(f.record.member, f.record.index) for f in report.findings] == [("c", 1), ("scale", 2)]
    assert "NaN at c[1][0][1]" in report.findings[0].detail


def test_exit_status_and_json_tell_clean_findings_and_unreadable_inputs_apart(tmp_path):
    clean, bad, garbage = tmp_path / "clean.jsonl", tmp_path / "bad.jsonl", tmp_path / "garbage.parquet"
    clean.write_bytes(_doc(0) + b"\n" + _doc(1) + b"\n")
    bad.write_bytes(_doc(0) + b"\n" + b'{"x": NaN}\n')
    garbage.write_bytes(GARBAGE)
    cases = [((clean,), 0, "clean"), ((bad,), 1, "findings"), ((garbage,), 3, "unreadable"),
             ((bad, garbage), 3, "unreadable"), ((garbage, "--fail-on", "none"), 3, "unreadable"),
             ((bad, "--fail-on", "none"), 0, "clean")]
    for args, code, status in cases:
        result = run_cli(*args, "--json")
        out = json.loads(result.output)
        assert (result.exit_code, out["status"], out["ok"]) == (code, status, code == 0), args
        assert out["unreadable_inputs"] == ([str(garbage)] if status == "unreadable" else [])
        assert run_cli(*args, "--json").output == result.output  # the same run twice: the same report
    result = CliRunner().invoke(main, ["data", str(garbage)], terminal_width=200)
    assert result.exit_code == 3 and "INCOMPLETE" in result.output and str(garbage) in result.output
    # A line that is not JSON is a finding about a record, not an input that could not be read.
    (tmp_path / "oops.jsonl").write_bytes(b"{oops\n" + _doc(1) + b"\n")
    assert run_cli(tmp_path / "oops.jsonl").exit_code == 1
    report = check_paths([garbage], max_findings=0)  # counted even when nothing is listed
    assert (report.unreadable_input_count, report.status(), report.exit_code()) == (1, "unreadable", 3)


class _OpensAFileWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_object_arrays_are_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    payload = np.array([_OpensAFileWhenUnpickled(marker)], dtype=object)
    np.save(tmp_path / "evil.npy", payload, allow_pickle=True)
    np.savez(tmp_path / "evil.npz", ok=np.ones(2), evil=payload)
    for name in ("evil.npy", "evil.npz"):
        result = run_cli(tmp_path / name, "--json")
        found = [f for f in json.loads(result.output)["findings"] if f["category"] == "unreadable"]
        assert result.exit_code == 3 and len(found) == 1
        assert "needs pickle, which nanscan never uses" in found[0]["detail"]
        assert "numeric dtype" in found[0]["detail"]  # what to do about it
    assert not marker.exists()


def test_a_folder_without_data_files_is_a_usage_error_not_clean_data(tmp_path):
    (tmp_path / "notes.txt").write_text("not a data format")
    result = CliRunner().invoke(main, ["data", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 2 and "no data files found" in result.output
    (tmp_path / "train.jsonl").write_text('{"x": 1.0}\n')
    assert CliRunner().invoke(main, ["data", str(tmp_path)]).exit_code == 0


def test_largest_finite_magnitude_skips_values_that_are_all_non_finite(tmp_path):
    # Before: a field holding only NaN or inf was the "largest finite magnitude: 0", named at that record.
    (tmp_path / "nan.jsonl").write_text('{"x": NaN}\n{"x": [NaN, 1e999], "y": 3}\n')
    (tmp_path / "mixed.jsonl").write_text('{"x": NaN, "y": 0.0}\n')
    (tmp_path / "ints.csv").write_text("a,b\n1,nan\n7,1\n")
    np.save(tmp_path / "nan.npy", np.full((3, 2), np.nan, np.float32))
    np.save(tmp_path / "zeros.npy", np.array([[np.nan], [0.0]], np.float32))
    pq.write_table(pa.table({"a": [float("nan"), float("nan")], "b": [1, 2]}), tmp_path / "nan.parquet")
    pq.write_table(pa.table({"a": [float("nan"), 0.0]}), tmp_path / "zeros.parquet")
    for name in ("nan.jsonl", "ints.csv", "nan.npy", "nan.parquet"):
        report = check_paths([tmp_path / name])
        assert report.counts["nonfinite"] >= 1 and report.largest_magnitude is None, name
    for name, row in (("mixed.jsonl", ("y", 1, None)), ("zeros.npy", ("array", None, 1)),
                      ("zeros.parquet", ("a", None, 1))):
        largest = check_paths([tmp_path / name]).largest_magnitude
        assert (largest.value, largest.field, largest.record.line, largest.record.index) == (0.0, *row), name
    result = CliRunner().invoke(main, ["data", str(tmp_path / "nan.npy")])
    assert result.exit_code == 1 and "largest finite magnitude" not in result.output
