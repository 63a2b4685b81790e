"""The quarantine across runs (NOTE: [quarantine file] in nanscan/bundle/quarantine.py, NOTE: [quarantine match] in
nanscan/data/quarantine.py): records named by a real replay's bisection, by a real `nanscan data` report or by hand
go into the bundle directory's quarantine.json; the next run's dataset (torch map-style, iterable, HF datasets)
skips them, by sample id or by digest wherever they moved, and logs how many; a release brings one back and is
recorded; the same add twice leaves the file byte-identical; a write that dies half way leaves the old file whole;
a broken file is refused, never written over."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import replay_entries as E
import torch
from click.testing import CliRunner

import nanscan._atomic as atomic
from nanscan.bundle.quarantine import (QUARANTINE, NamedRecord, QuarantineError, add_records, read_quarantine,
                                       record_id, release_records)
from nanscan.cli.main import main
from nanscan.data import check as check_data
from nanscan.data.quarantine import QuarantinedDataset, QuarantinedIterableDataset, skip_quarantined
from nanscan.engine.record_digest import digest_object

ROOT = Path(__file__).resolve().parent.parent
FAULT_STEP = 3  # replay_entries' default fault step
POISONED_ID = f"s{FAULT_STEP:03d}-{E.POISON_ROW:02d}"


def cli(*args: str, expect: int = 0):
    result = CliRunner().invoke(main, ["quarantine", *args])
    assert result.exit_code == expect, result.output
    return result


def run_nanscan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m nanscan ...` in a fresh interpreter, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "nanscan", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def poisoned_rows() -> list[dict]:
    """The records of the poisoned step's batch, one dict of tensors each, as a Dataset would give them."""
    batch = E.poison_batch(E._config({}), FAULT_STEP)
    return [{"x": batch["x"][i].clone(), "y": batch["y"][i].clone()} for i in range(E.BATCH_SIZE)]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> tuple[Path, Path]:
    """(bundle directory, bundle) of a real run whose batch holds one poisoned sample, replayed and bisected."""
    root = tmp_path_factory.mktemp("bundles")
    bundle = E.train("poisoned_sample", root)
    result = CliRunner().invoke(main, ["replay", str(bundle), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["bisect"]["sample_ids"] == [POISONED_ID]
    return root, bundle


# -- add, list, release ---------------------------------------------------------------------------------------

def test_add_by_ids_then_list_then_release_keeps_the_history(tmp_path):
    cli("add", "a1", "7", "--bundle-dir", str(tmp_path), "--reason", "labels  swapped", "--note", "seen in run 3",
        "--author", "alice")
    quarantine = read_quarantine(tmp_path)
    assert [(r.id, r.status, r.reason) for r in quarantine.records] == [("7", "quarantined", "labels swapped"),
                                                                        ("a1", "quarantined", "labels swapped")]
    first = quarantine.records[0].history[0]
    assert first["by"] == "alice" and first["note"] == "seen in run 3" and first["source"] == {"by_hand": True}
    listed = cli("list", "--bundle-dir", str(tmp_path)).output
    assert "2 quarantined, 0 released" in listed and "seen in run 3" in listed

    cli("release", "7", "--bundle-dir", str(tmp_path), "--note", "a false alarm", "--author", "bob")
    released = read_quarantine(tmp_path).find("7")
    assert released.status == "released"
    assert [e["event"] for e in released.history] == ["added", "released"]
    assert released.history[-1]["note"] == "a false alarm" and released.history[-1]["by"] == "bob"
    assert "7" not in cli("list", "--bundle-dir", str(tmp_path)).output.split()
    assert "a false alarm" in cli("list", "--all", "--bundle-dir", str(tmp_path)).output
    # added again after its release: a new add event, the release kept in the history
    cli("add", "7", "--bundle-dir", str(tmp_path), "--reason", "labels swapped after all")
    back = read_quarantine(tmp_path).find("7")
    assert back.status == "quarantined" and [e["event"] for e in back.history] == ["added", "released", "added"]


def test_a_bad_request_changes_nothing_and_says_why(tmp_path):
    cli("add", "a1", "--bundle-dir", str(tmp_path), "--reason", "why")
    before = (tmp_path / QUARANTINE).read_bytes()
    assert "--reason" in cli("add", "a2", "--bundle-dir", str(tmp_path), expect=2).output
    assert "one way" in cli("add", "a2", "--from-data", str(tmp_path / QUARANTINE), "--reason", "x",
                            "--bundle-dir", str(tmp_path), expect=2).output
    out = cli("release", "a1", "nope", "--bundle-dir", str(tmp_path), expect=1).output
    assert "has no record 'nope'" in out and "nothing was released" in out
    assert (tmp_path / QUARANTINE).read_bytes() == before
    assert "does not exist" in cli("add", "a1", "--reason", "x", "--bundle-dir", str(tmp_path / "nowhere"),
                                   expect=1).output


def test_the_same_add_twice_leaves_the_file_byte_identical(tmp_path, replayed):
    root, bundle = replayed
    cli("add", "a1", "--digest", "ab" * 32, "--bundle-dir", str(tmp_path), "--reason", "why", "--note", "n")
    once = (tmp_path / QUARANTINE).read_bytes()
    assert "nothing changed" in cli("add", "a1", "--digest", "ab" * 32, "--bundle-dir", str(tmp_path),
                                    "--reason", "why", "--note", "n").output
    assert (tmp_path / QUARANTINE).read_bytes() == once
    # a new note is a new add event: the file records it
    cli("add", "a1", "--bundle-dir", str(tmp_path), "--reason", "why", "--note", "another look")
    assert len(read_quarantine(tmp_path).find("a1").history) == 2

    cli("add", "--from", str(bundle), "--bundle-dir", str(tmp_path))
    after_bundle = (tmp_path / QUARANTINE).read_bytes()
    cli("add", "--from", str(bundle), "--bundle-dir", str(tmp_path))
    assert (tmp_path / QUARANTINE).read_bytes() == after_bundle


def test_two_names_of_one_record_release_it_once(tmp_path):
    digest = "cd" * 32
    add_records(tmp_path, [NamedRecord("r9", (digest,))], reason="why")
    _, result = release_records(tmp_path, ["r9", f"sha256:{digest[:12]}"], note="fine")
    assert len(result.released) == 1
    assert [e["event"] for e in read_quarantine(tmp_path).find("r9").history] == ["added", "released"]
    _, again = release_records(tmp_path, ["r9"])
    assert not again.released and len(again.already) == 1


def test_sample_ids_match_by_one_rule():
    assert record_id(7) == record_id("7") == record_id(torch.tensor(7)) == "7"
    assert record_id({"micro_batch": 0, "row": 3, "id": "r7"}) == "r7"  # a trainer adapter's sample id
    assert record_id({"micro_batch": 0, "row": 3}) is None  # a position in a batch, not a record
    assert record_id(None) is None


# -- from a replayed bundle and from a data report --------------------------------------------------------------

def test_add_from_a_bundle_takes_what_its_bisection_named_with_the_rows_digest(replayed):
    root, bundle = replayed
    out = cli("add", "--from", str(bundle)).output  # the bundle directory is the bundle's own
    assert f"quarantined 1 record(s) in {root / QUARANTINE}" in out
    [record] = read_quarantine(root).records
    assert record.sample_id == POISONED_ID and record.status == "quarantined"
    # the digest of its row is the data checks' digest of the record the row was collated from
    assert record.sha256 == [digest_object(poisoned_rows()[E.POISON_ROW])]
    source = record.history[0]["source"]
    assert source == {"bundle": "poisoned_sample/step-3", "run_id": "poisoned_sample", "step": FAULT_STEP,
                      "row": E.POISON_ROW}
    assert record.reason.startswith("named by the bisection of poisoned_sample/step-3 (step 3, category input)")


def test_the_next_run_skips_the_bisected_record_by_digest_wherever_it_moved(replayed, caplog):
    root, bundle = replayed
    cli("add", "--from", str(bundle))
    rows = poisoned_rows()[::-1]  # reordered: the poisoned record is no longer at row 11
    with caplog.at_level(logging.INFO, logger="nanscan"):
        data = skip_quarantined(rows, root)  # no id rule: matched by digest alone
    assert isinstance(data, QuarantinedDataset)
    assert data.skipped == 1 and data.skipped_indices == [E.BATCH_SIZE - 1 - E.POISON_ROW] and len(data) == 15
    assert all(bool(torch.isfinite(data[i]["x"] ** 2).all()) for i in range(len(data)))
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "quarantined record" in r.getMessage()]
    assert said == [(logging.WARNING, f"nanscan: skipped 1 quarantined record(s) of 16; 1 record(s) are quarantined "
                                      f"in {root / QUARANTINE}")]
    # by sample id too, when the records carry one (the digest then differs: the id is part of the record)
    with_ids = [{"id": f"s{FAULT_STEP:03d}-{i:02d}", **row} for i, row in enumerate(poisoned_rows())]
    by_id = skip_quarantined(with_ids, root, id_field="id")
    assert by_id.skipped_indices == [E.POISON_ROW]


def test_a_bundle_that_was_not_replayed_names_nothing(tmp_path):
    bundle = E.train("poisoned_sample", tmp_path)
    out = cli("add", "--from", str(bundle), expect=1).output
    assert "has not been replayed" in out and "nanscan replay" in out
    assert not (tmp_path / QUARANTINE).exists()


def _jsonl(path: Path) -> list[dict]:
    records = [{"id": f"r{i}", "x": [float(i), 1.0]} for i in range(6)]
    records[4]["x"][0] = float("nan")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # json writes NaN, as many exporters do
    return records


def test_add_from_a_data_report_and_skip_by_sample_id(tmp_path):
    records = _jsonl(tmp_path / "train.jsonl")
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    report = run_nanscan("data", "train.jsonl", "--json", "--id-field", "id", cwd=tmp_path)
    assert report.returncode == 1 and json.loads(report.stdout)["status"] == "findings", report.stderr
    (tmp_path / "report.json").write_text(report.stdout)
    cli("add", "--from-data", str(tmp_path / "report.json"), "--bundle-dir", str(bundles), "--note", "exporter bug")
    [record] = read_quarantine(bundles).records
    finding = json.loads(report.stdout)["findings"][0]
    assert record.sample_id == "r4" and record.sha256 == [finding["sha256"]]
    assert record.history[0]["source"]["record"] == "train.jsonl:5"
    assert record.history[0]["source"]["findings"] == ["nonfinite in field 'x': 1 non-finite value: NaN at x[0]"]
    assert record.history[0]["note"] == "exporter bug"
    kept = skip_quarantined(records, bundles, id_field="id")
    assert kept.skipped == 1 and [kept[i]["id"] for i in range(len(kept))] == ["r0", "r1", "r2", "r3", "r5"]


def test_a_data_report_without_ids_warns_that_text_records_cannot_be_matched(tmp_path):
    _jsonl(tmp_path / "train.jsonl")
    report = run_nanscan("data", "train.jsonl", "--json", cwd=tmp_path)
    assert json.loads(report.stdout)["status"] == "findings", report.stderr
    (tmp_path / "report.json").write_text(report.stdout)
    result = CliRunner().invoke(main, ["quarantine", "add", "--from-data", str(tmp_path / "report.json"),
                                       "--bundle-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "have no sample id" in result.output and "--id-field" in result.output


# -- the wrappers -------------------------------------------------------------------------------------------------

class Stream(torch.utils.data.IterableDataset):
    def __init__(self, records):
        self.records = records

    def __iter__(self):
        return iter(self.records)


def test_an_iterable_dataset_streams_without_them_and_logs_once(tmp_path, caplog):
    add_records(tmp_path, [NamedRecord("r2"), NamedRecord("r5")], reason="broken")
    stream = skip_quarantined(Stream([{"id": f"r{i}", "v": i} for i in range(8)]), tmp_path, id_field="id")
    assert isinstance(stream, QuarantinedIterableDataset)
    with caplog.at_level(logging.INFO, logger="nanscan"):
        loader = torch.utils.data.DataLoader(stream, batch_size=3)
        first = [int(v) for batch in loader for v in batch["v"]]
        second = [r["v"] for r in stream]
    assert first == second == [0, 1, 3, 4, 6, 7]
    assert stream.skipped == 2
    said = [r.getMessage() for r in caplog.records if "quarantined record" in r.getMessage()]
    assert said == [f"nanscan: skipped 2 quarantined record(s) of 8; 2 record(s) are quarantined in "
                    f"{tmp_path / QUARANTINE}"]


def test_a_released_record_comes_back(tmp_path):
    records = [{"id": f"r{i}", "v": i} for i in range(4)]
    add_records(tmp_path, [NamedRecord("r1", (digest_object(records[2]),))], reason="broken")
    kept = QuarantinedDataset(records, tmp_path, id_field="id")
    # id r1, and record 2 by its digest (one entry named both ways: either one skips)
    assert kept.skipped_indices == [1, 2]
    release_records(tmp_path, ["r1"], note="relabelled")
    again = QuarantinedDataset(records, tmp_path, id_field="id")
    assert again.skipped == 0 and len(again) == 4


def test_records_named_by_id_alone_need_an_id_rule_and_say_so(tmp_path, caplog):
    add_records(tmp_path, [NamedRecord("r1")], reason="broken")
    with caplog.at_level(logging.INFO, logger="nanscan"):
        kept = QuarantinedDataset([{"id": "r0"}, {"id": "r1"}], tmp_path)
    assert kept.skipped == 0
    assert any(r.levelno == logging.WARNING and "NOT skipped" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="has no field 'id'"):
        QuarantinedDataset([{"name": "r0"}], tmp_path, id_field="id")


def test_an_empty_quarantine_reads_no_record(tmp_path):
    class Untouchable(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise AssertionError("a record was loaded though nothing is quarantined")

    kept = skip_quarantined(Untouchable(), tmp_path)
    assert len(kept) == 3 and kept.skipped == 0
    # a path that is no directory (mistyped) is refused, naming it, instead of skipping nothing quietly
    with pytest.raises(QuarantineError, match=f"skip_quarantined: {tmp_path / 'bundels'} is no directory"):
        skip_quarantined(Untouchable(), tmp_path / "bundels")


def test_hf_datasets_are_filtered_and_stay_datasets(tmp_path, caplog):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": f"r{i}", "x": [float(i), 1.0]} for i in range(10)]
    rows[6]["x"][1] = float("inf")
    table = datasets.Dataset.from_list(rows)
    # named by a data check of the dataset itself: by digest, as nanscan.data.check names a Python record
    report = check_data(table)
    (tmp_path / "report.json").write_text(json.dumps(report.to_dict()))
    cli("add", "--from-data", str(tmp_path / "report.json"), "--bundle-dir", str(tmp_path))
    [record] = read_quarantine(tmp_path).records
    assert record.sample_id is None and len(record.sha256) == 1
    shuffled = table.shuffle(seed=1)
    with caplog.at_level(logging.INFO, logger="nanscan"):
        kept = skip_quarantined(shuffled, tmp_path)
    assert isinstance(kept, datasets.Dataset) and len(kept) == 9 and "r6" not in kept["id"]
    assert any("skipped 1 quarantined record(s) of 10" in r.getMessage() for r in caplog.records)
    # by the id column alone
    add_records(tmp_path, [NamedRecord("r2")], reason="mislabelled")
    kept = skip_quarantined(shuffled, tmp_path, id_field="id")
    assert sorted(kept["id"]) == sorted(f"r{i}" for i in range(10) if i not in (2, 6))


def test_import_nanscan_imports_no_hf_datasets():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", "import sys, nanscan\nnanscan.skip_quarantined\n"
                                                "print('datasets' in sys.modules)"],
                         capture_output=True, text=True, env=env, check=True, timeout=120).stdout
    assert out.split() == ["False"]


# -- the file survives faults and refuses to be misread --------------------------------------------------------

def test_a_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch):
    add_records(tmp_path, [NamedRecord("r1")], reason="broken")
    before = (tmp_path / QUARANTINE).read_bytes()

    def fsync_file(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(atomic, "fsync_file", fsync_file)
    with pytest.raises(OSError):
        release_records(tmp_path, ["r1"])
    assert (tmp_path / QUARANTINE).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [QUARANTINE]  # no temporary file left behind


def test_a_writer_killed_mid_write_leaves_the_old_file_whole(tmp_path):
    add_records(tmp_path, [NamedRecord("r1")], reason="broken")
    before = (tmp_path / QUARANTINE).read_bytes()
    # the new content is on disk under its temporary name when the process dies, before the rename
    code = ("import os, signal, sys\nimport nanscan._atomic as atomic\n"
            "from nanscan.bundle.quarantine import NamedRecord, add_records\n"
            "atomic.fsync_file = lambda path: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"add_records({str(tmp_path)!r}, [NamedRecord('r2')], reason='broken too')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    died = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert died.returncode == -9, died.stderr
    assert (tmp_path / QUARANTINE).read_bytes() == before
    assert [r.id for r in read_quarantine(tmp_path).records] == ["r1"]
    assert any(p.name.startswith(atomic.TEMP_PREFIX) for p in tmp_path.iterdir())  # what the dead writer left
    add_records(tmp_path, [NamedRecord("r2")], reason="broken too")
    assert [r.id for r in read_quarantine(tmp_path).records] == ["r1", "r2"]


@pytest.mark.parametrize("text, says", [
    ('{"format": "nanscan.quarantine/1", "records": [', "not valid JSON"),
    ('["r1"]', "not 'nanscan.quarantine/1'"),
    ('{"format": "nanscan.quarantine/1", "records": [{"sample_id": "r1", "sha256": [], "status": "released", '
     '"history": [{"event": "added", "at": "2025-01-01T00:00:00+00:00"}]}]}', "records[0].status is 'released'"),
])
def test_a_broken_file_is_refused_by_name_and_never_written_over(tmp_path, text, says):
    path = tmp_path / QUARANTINE
    path.write_text(text)
    for args in (["list"], ["add", "r2", "--reason", "x"], ["release", "r1"]):
        out = cli(*args, "--bundle-dir", str(tmp_path), expect=1).output
        assert str(path) in out and says in out and "fix it by hand" in out
    assert path.read_text() == text
    with pytest.raises(QuarantineError, match="fix it by hand"):
        skip_quarantined([{"id": "r1"}], tmp_path, id_field="id")


# -- the command line end to end -------------------------------------------------------------------------------

def test_the_command_line_end_to_end(tmp_path):
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    added = run_nanscan("quarantine", "add", "r1", "r2", "--reason", "bad crop", "--note", "checked by eye",
                        "--bundle-dir", "bundles", cwd=tmp_path)
    assert added.returncode == 0, added.stderr
    assert "quarantined 2 record(s)" in added.stdout
    released = run_nanscan("quarantine", "release", "r2", "--note", "recropped", "--bundle-dir", "bundles",
                           cwd=tmp_path)
    assert released.returncode == 0, released.stderr
    listed = run_nanscan("quarantine", "list", "--all", "--json", "--bundle-dir", "bundles", cwd=tmp_path)
    data = json.loads(listed.stdout)
    assert [(r["sample_id"], r["status"]) for r in data["records"]] == [("r1", "quarantined"), ("r2", "released")]
    assert data["records"][1]["history"][-1]["note"] == "recropped"
    # NANSCAN_BUNDLE_DIR is where the Monitor writes by default, and so where the quarantine is by default
    env_listed = subprocess.run([sys.executable, "-m", "nanscan", "quarantine", "list"], cwd=tmp_path,
                                env={**os.environ, "NANSCAN_BUNDLE_DIR": str(bundles),
                                     "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert "1 quarantined, 1 released" in env_listed.stdout, env_listed.stderr
