"""Triage: bundles under a directory grouped by category and first bad module, interrupted writes skipped,
damaged bundles listed separately."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import replay_entries as E
from nanscan.bundle import load_bundle
from nanscan.cli.main import main
from nanscan.replay import record_replay, replay
from nanscan.review.triage import NOT_REPLAYED, find_bundle_dirs, triage


def _incidents(root):
    """Five incidents in two runs directories deep: three categories, one replayed twice over."""
    paths = {
        "attn": E.train("masked_attention", root / "team-a", run_id="attn-1"),
        "attn2": E.train("masked_attention", root / "team-a", run_id="attn-2", config={"seed": 1}),
        "sqrt": E.train("sqrt_backward", root / "team-b" / "nightly", run_id="sqrt-1"),
        "nan": E.train("poisoned_sample", root / "team-b", run_id="nan-1", config={"poison": "nan"}),
        "poison": E.train("poisoned_sample", root / "team-b", run_id="poison-1"),
    }
    for key in ("attn", "attn2", "sqrt"):
        record_replay(replay(paths[key], bisect=False))
    return paths


def test_triage_groups_by_category_then_module(tmp_path):
    paths = _incidents(tmp_path)
    (tmp_path / "team-a" / ".tmp-step-9-abcd").mkdir()  # an interrupted write: skipped, not an error
    (tmp_path / "team-a" / ".tmp-step-9-abcd" / "manifest.json").write_text("{")
    broken = tmp_path / "team-c" / "run" / "step-4"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{not json")

    result = triage(tmp_path)
    groups = result.groups()
    # by descending count; the 1e22 poison is finite, but its square is not: an input incident (input_overflow)
    assert list(groups) == ["input", "loss", "gradient"]
    assert {m: len(v) for m, v in groups["loss"].items()} == {"attn.softmax (Softmax, forward)": 2}
    assert [e.run_id for e in groups["loss"]["attn.softmax (Softmax, forward)"]] == ["attn-1", "attn-2"]
    assert list(groups["gradient"]) == ["mag (Magnitude, backward)"]
    assert sorted(e.path for e in groups["input"][NOT_REPLAYED]) == sorted([str(paths["nan"]), str(paths["poison"])])
    assert all(e.step == 3 for e in result.entries)
    assert [u["path"] for u in result.unreadable] == [str(broken)]
    assert "not valid JSON" in result.unreadable[0]["error"]


def test_find_bundle_dirs_skips_temporary_directories(tmp_path):
    good = E.train("sqrt_backward", tmp_path)
    (tmp_path / ".tmp-x").mkdir()
    (tmp_path / ".tmp-x" / "manifest.json").write_text("{}")
    assert find_bundle_dirs(tmp_path) == [good]
    assert find_bundle_dirs(good) == [good]  # a bundle directory itself


def test_triage_cli_json_and_table(tmp_path):
    E.train("sqrt_backward", tmp_path, run_id="sqrt-9")
    E.train("masked_attention", tmp_path, run_id="attn-9")
    runner = CliRunner()
    out = runner.invoke(main, ["triage", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["bundles"] == 2 and data["unreadable"] == []
    counts = {c["category"]: c["count"] for c in data["categories"]}
    assert counts == {"gradient": 1, "loss": 1}
    loss = next(c for c in data["categories"] if c["category"] == "loss")
    assert loss["modules"][0]["bundles"][0]["run_id"] == "attn-9"
    table = runner.invoke(main, ["triage", str(tmp_path)], env={"COLUMNS": "250"})
    assert table.exit_code == 0 and "category gradient" in table.output and "sqrt-9" in table.output
    missing = runner.invoke(main, ["triage", str(tmp_path / "nope")])
    assert missing.exit_code == 2


def test_one_damaged_bundle_does_not_stop_triage(tmp_path):
    E.train("sqrt_backward", tmp_path, run_id="good")
    edited = E.train("sqrt_backward", tmp_path, run_id="edited")
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["first_invalid_step"] = None
    (edited / "manifest.json").write_text(json.dumps(manifest))
    forged = E.train("sqrt_backward", tmp_path, run_id="forged")
    load_bundle(forged).add_finding("replay", "Replay", "forged", {"verdict": "persistent", "localization": ["mag"]})

    result = triage(tmp_path)
    assert [e.run_id for e in result.entries] == ["good"]
    errors = {Path(u["path"]).parent.name: u["error"] for u in result.unreadable}
    assert "wrong type for first_invalid_step" in errors["edited"]
    assert "the 'replay' finding in its ledger names no module" in errors["forged"]
    out = CliRunner().invoke(main, ["triage", str(tmp_path), "--json"])
    assert out.exit_code == 1 and json.loads(out.stdout)["bundles"] == 1  # 1: not every bundle could be counted


def test_triage_of_a_folder_without_bundles_says_so(tmp_path):
    out = CliRunner().invoke(main, ["triage", str(tmp_path)])
    assert out.exit_code == 0 and "no nanscan bundles under" in out.output


def test_triage_table_shows_module_labels_literally(tmp_path):
    path = E.train("sqrt_backward", tmp_path, run_id="sqrt-1")
    localization = {"label": "blocks[/0]", "module_type": "Magnitude", "phase": "backward"}
    load_bundle(path).add_finding("replay", "Replay", "localized", {"verdict": "persistent",
                                                                    "localization": localization})
    table = CliRunner().invoke(main, ["triage", str(tmp_path)], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    assert "blocks[/0] (Magnitude, backward)" in table.output
