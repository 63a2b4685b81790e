"""The workflow from a new user's seat: a hand-edited INCIDENT.md, manifest digests, entries imported from the
working directory and checked at Monitor(), the one-liner's honest bundles, reports that show every recorded
finding, the smaller CLI options (--id-field, --xfail), triage of copied incidents, and the README's examples run
as written."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import replay_entries as E
import torch
from click.testing import CliRunner
from torch import nn

import nanscan
from nanscan.replay.ablate import ablate, record_ablation
from nanscan.bundle import BundleError, load_bundle
from nanscan.cli.main import main
from nanscan.runtime.default import default_monitor
from nanscan.entry import EntryError, EntryWarning, entry_search_dirs, locate_entry
from nanscan.replay import replay
from nanscan.replay.export import export_regression
from nanscan.runtime.localize import ValueSummary
from nanscan.replay.reproduce import record_replay
from nanscan.review.triage import triage

TESTS_DIR = Path(__file__).resolve().parent
README = TESTS_DIR.parent / "README.md"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """A bundle that replay and one ablation row have run on (recorded in its ledger)."""
    path = E.train("masked_attention", tmp_path_factory.mktemp("bundles"))
    record_replay(replay(path, bisect=False))
    record_ablation(ablate(path, factors=["lr-x0.1"], holdout=0))
    return path


@pytest.fixture
def bundle(tmp_path, replayed):
    """A fresh copy of the replayed bundle, to edit."""
    return Path(shutil.copytree(replayed, tmp_path / "copy" / "r" / replayed.name))


def _report_json(path: Path) -> dict:
    out = CliRunner().invoke(main, ["report", str(path), "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


# -- INCIDENT.md is a document people edit ------------------------------------------------------------------------

def test_a_hand_added_reviewer_line_loads_and_is_shown_as_a_note(bundle, tmp_path):
    note = bundle / "INCIDENT.md"
    note.write_text(note.read_text() + "\nChecked with the data team: record 913 is the empty one.\n")
    opened = load_bundle(bundle)
    assert opened.note_review().hand_written == "Checked with the data team: record 913 is the empty one."
    assert opened.note_review().edited == ()
    found = _report_json(bundle)["findings"]
    assert found["hand_written_notes"] == "Checked with the data team: record 913 is the empty one."
    terminal = CliRunner().invoke(main, ["report", str(bundle)], env={"COLUMNS": "200"})
    assert "note (typed into INCIDENT.md): Checked with the data team" in terminal.output
    assert triage(tmp_path / "copy").unreadable == []
    # a later note through nanscan keeps the hand-typed line, and both show
    assert opened.add_note("second look: confirmed", author="rev")
    text = note.read_text()
    assert "record 913 is the empty one." in text and "> second look: confirmed" in text
    again = load_bundle(bundle).note_review()
    assert again.hand_written == "Checked with the data team: record 913 is the empty one." and again.edited == ()


def test_a_hand_edit_of_an_automatic_finding_is_named_and_rebuilt_without_loss(bundle):
    note = bundle / "INCIDENT.md"
    replay_title = next(f["title"] for f in load_bundle(bundle).findings() if f["key"] == "replay")
    text = note.read_text()
    assert "\n### " + replay_title + "\n" in text
    note.write_text(text.replace("\n### " + replay_title + "\n", "\n### " + replay_title + " (I disagree)\n"))
    opened = load_bundle(bundle)  # not locked out
    assert opened.note_review().edited == (f"the finding '{replay_title}'",)
    assert _report_json(bundle)["findings"]["note_edited_sections"] == [f"the finding '{replay_title}'"]
    out = CliRunner().invoke(main, ["note", str(bundle), "--rebuild"])
    assert out.exit_code == 0 and "rebuilt the automatic findings" in out.output, out.output
    rebuilt = load_bundle(bundle)
    assert rebuilt.note_review().edited == ()
    assert "(I disagree)" in rebuilt.note_review().hand_written  # moved under "Reviewer notes", quoted
    automatic, _, reviewer = note.read_text().partition("\n## Reviewer notes\n")
    assert f"### {replay_title}\n" in automatic and "(I disagree)" not in automatic and "(I disagree)" in reviewer
    again = CliRunner().invoke(main, ["note", str(bundle), "--rebuild"])
    assert "already matches its ledger; nothing changed" in again.output


def test_tampered_tensors_and_ledger_are_still_refused(bundle):
    data = bytearray((bundle / "batch.safetensors").read_bytes())
    data[-1] ^= 1
    (bundle / "batch.safetensors").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="batch.safetensors does not match its sha256"):
        load_bundle(bundle)


def test_a_config_edit_in_the_manifest_is_refused(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["config"] = {**(manifest["config"] or {}), "lr": 123.0}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="config does not match config_sha256"):
        load_bundle(bundle)


def test_a_batch_digest_edit_in_the_manifest_is_refused(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["batch"]["sha256"] = "0" * 64
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="batch.sha256 does not match the sha256 listed for batch.safetensors"):
        load_bundle(bundle)


def test_a_bundle_without_the_recorded_directories_still_loads(bundle):
    """Bundles written before the working directory was recorded: they load, and only the current directory is
    searched for their entry."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["environment"]["working_directory"]
    for key in ("working_directory", "main_path"):
        del manifest["environment"][key]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    opened = load_bundle(bundle)
    for trusted in (False, True):
        search = entry_search_dirs(opened.manifest["environment"], trust_bundle_paths=trusted)
        assert [label for label, _ in search.dirs] == ["the current directory"] and search.withheld == ()


# -- entries --------------------------------------------------------------------------------------------------------

def test_replay_finds_an_entry_module_in_the_working_directory(replayed, tmp_path, monkeypatch):
    work = tmp_path / "project"
    (work / "textclf").mkdir(parents=True)
    (work / "textclf" / "__init__.py").write_text("")
    shutil.copy(TESTS_DIR / "replay_entries.py", work / "textclf" / "train.py")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(work)
    out = CliRunner().invoke(main, ["replay", str(replayed), "--entry", "textclf.train:masked_attention",
                                    "--no-bisect", "--no-record", "--json"])
    assert out.exit_code == 0, out.output
    notes = json.loads(out.stdout)["notes"]
    assert any(f"imported it from the current directory {work}" in n for n in notes), notes
    sys.modules.pop("textclf.train", None)
    sys.modules.pop("textclf", None)


def test_an_entry_found_nowhere_names_where_it_looked_and_exits_2(replayed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EntryError, match=f"also looked in {re.escape(str(tmp_path))}"):
        locate_entry("nosuchpkg.train:entry", entry_search_dirs())
    out = CliRunner().invoke(main, ["replay", str(replayed), "--entry", "nosuchpkg.train:entry"])
    assert out.exit_code == 2 and "cannot import 'nosuchpkg.train'" in out.output


def test_a_misspelt_replay_entry_warns_when_the_monitor_is_made():
    model = nn.Linear(2, 2)
    with pytest.warns(EntryWarning, match="'replay_entries:masked_atention'.*no attribute 'masked_atention'"):
        nanscan.Monitor(model, replay_entry="replay_entries:masked_atention")
    with pytest.warns(EntryWarning, match="cannot import 'replay_entriez'"):
        nanscan.Monitor(model, replay_entry="replay_entriez:masked_attention")
    with warnings.catch_warnings():
        warnings.simplefilter("error", EntryWarning)
        nanscan.Monitor(model, replay_entry="replay_entries:masked_attention")


def test_preflight_says_when_the_entry_got_an_empty_config(tmp_path, monkeypatch):
    (tmp_path / "needs_seed.py").write_text(
        "def entry(config):\n    return config['seed']\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(main, ["preflight", "--entry", "needs_seed:entry", "--json"])
    assert out.exit_code == 1, out.output
    reasons = json.loads(out.stdout)["reasons"]
    assert any("KeyError: 'seed'" in r and "called with an empty config {}" in r for r in reasons), reasons
    sys.modules.pop("needs_seed", None)


# -- the one-liner's bundles ----------------------------------------------------------------------------------------

def test_the_one_liner_bundle_words_what_it_did_not_see(tmp_path, monkeypatch):
    monkeypatch.setenv("NANSCAN_BUNDLE_DIR", str(tmp_path / "b"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(5, 3)
        if step == 2:
            x[0, 0] = float("nan")  # a forward-pass NaN: the one-liner sees it first in the gradients
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nanscan.check(model, optimizer)
        optimizer.step()
    path = default_monitor(model).bundle_path
    text = load_bundle(path).incident_text()
    assert "The loss was finite but a gradient was not" not in text
    assert "no loss was checked" in text and "No batch was checked" in text
    assert "loss not recorded" in text and "gradient norm non-finite (" in text
    summary = _report_json(path)
    assert summary["last_finite"]["step"] == 1
    assert "cannot tell the forward pass from the backward pass" in summary["category_meaning"]
    assert summary["failing"]["nonfinite_gradients"] > 0
    terminal = CliRunner().invoke(main, ["report", str(path)], env={"COLUMNS": "200"})
    assert re.search(r"first invalid\s+2\s+-\s+\S+\s+non-finite", terminal.output), terminal.output


# -- reports ----------------------------------------------------------------------------------------------------------

def test_report_shows_replay_ablation_and_notes(bundle):
    load_bundle(bundle).add_note("looked at it", author="rev")
    found = _report_json(bundle)["findings"]
    assert found["replay"]["verdict"] == "persistent" and found["replay"]["reproduced"] is True
    assert found["replay"]["first_bad_module"] == found["first_bad_module"]["module"]
    assert found["first_bad_module"]["module"].startswith("attn.softmax (Softmax")
    assert [(row["factor"], row["status"]) for row in found["ablation"]][:2] == [("baseline", "non-finite"),
                                                                                  ("lr-x0.1", "non-finite")]
    assert found["reviewer_notes"][0]["text"] == "looked at it" and found["reviewer_notes"][0]["author"] == "rev"
    terminal = CliRunner().invoke(main, ["report", str(bundle)], env={"COLUMNS": "200"})
    assert "replay: reproduced" in terminal.output and "attn.softmax" in terminal.output
    assert "ablation: learning rate x0.1" in terminal.output and "note (rev, " in terminal.output


# -- the smaller items ----------------------------------------------------------------------------------------------

def test_an_all_zero_tensor_reads_all_zeros():
    zeros = ValueSummary(tensors=1, absmin=None, absmax=0.0, dtypes=("float32",))
    assert zeros.describe() == "finite; finite values all zeros (float32)"


def test_data_names_records_by_their_id_field(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"id": "s-913", "text": "a b"}\n{"id": "s-914", "text": ""}\n')
    out = CliRunner().invoke(main, ["data", str(data), "--json", "--id-field", "id"])
    assert out.exit_code == 1, out.output
    (finding,) = json.loads(out.stdout)["findings"]
    assert (finding["line"], finding["sample_id"]) == (2, "s-914")
    plain = CliRunner().invoke(main, ["data", str(data), "--id-field", "id"], env={"COLUMNS": "200"})
    assert "train.jsonl:2 (id s-914) field text" in plain.output


def test_export_regression_xfail_marks_the_test(replayed, tmp_path):
    result = export_regression(replayed, tmp_path / "regress", xfail=True)
    source = Path(result.test_file).read_text()
    assert "@pytest.mark.xfail(strict=True" in source
    spec = importlib.util.spec_from_file_location("exported_case", result.test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    test = next(getattr(module, n) for n in dir(module) if n.startswith("test_"))
    (mark,) = [m for m in test.pytestmark if m.name == "xfail"]
    assert mark.kwargs["strict"] is True
    with pytest.raises(AssertionError):  # fails today: the xfail mark is what lets it be committed
        test()
    plain = export_regression(replayed, tmp_path / "plain")
    assert "xfail" not in Path(plain.test_file).read_text()


def test_triage_counts_copies_of_one_incident_once(replayed, tmp_path):
    for where in ("a", "b"):
        shutil.copytree(replayed, tmp_path / where / "run" / replayed.name)
    result = triage(tmp_path)
    assert len(result.entries) == 1 and result.unreadable == []
    assert result.entries[0].copies == [str(tmp_path / "b" / "run" / replayed.name)]


# -- the README's examples, run as written --------------------------------------------------------------------------

def _readme_entry_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (entry,) = [b for b in blocks if b.startswith("# mypkg/train.py")]
    return entry


def test_the_readme_entry_example_is_complete_and_short(tmp_path, monkeypatch):
    code = _readme_entry_example()
    assert len(code.strip().splitlines()) <= 12  # the file-name comment, the mark and ten lines
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(code)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    from nanscan.entry import build_spec

    spec = build_spec("mypkg.train:build_step", {}, from_bundle=True)  # marked: a bundle naming it replays
    assert isinstance(spec.model, nn.Module) and spec.extras
    loss = spec.step_fn(spec.model, next(iter(spec.batches)))
    assert loss.dim() == 0 and torch.isfinite(loss)
    sys.modules.pop("mypkg.train", None)
    sys.modules.pop("mypkg", None)


def test_the_readme_preflight_example_runs_as_written(tmp_path):
    (line,) = [ln for ln in README.read_text().splitlines() if ln.startswith("nanscan preflight ")]
    argv = line.split("#")[0].split()[1:]
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(_readme_entry_example())
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"id": i, "text": "a b c"}) + "\n" for i in range(8)))
    # the console script's way: the current directory is not on sys.path, nanscan adds it for the entry
    run = subprocess.run([sys.executable, "-c",
                          "import sys; sys.path.pop(0); from nanscan.cli.main import main; main()",
                          *argv, "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**__import__("os").environ,
                              "PYTHONPATH": str(Path(nanscan.__file__).resolve().parent.parent)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["verdict"] == "go"
    assert any("imported it from the current directory" in w for w in report["warnings"])
