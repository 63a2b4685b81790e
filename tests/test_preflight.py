"""`nanscan preflight` against a tiny replay entry (tests/preflight_entry.py): the go path, every no-go reason,
the canary (input, parameter, and checks that are not live), the review sample and the headroom warnings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from nanscan.engine import _layout as L
from nanscan.cli.main import main
from nanscan.entry import EntryError, build_spec
from nanscan.preflight import headroom_report, run_canary, run_preflight

ENTRY = "preflight_entry:replay_entry"


def preflight(*args, config=None, tmp_path=None):
    argv = ["preflight", "--entry", ENTRY, "--json", *map(str, args)]
    if config is not None:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        argv += ["--config", str(path)]
    result = CliRunner().invoke(main, argv)
    return result, (json.loads(result.output) if result.output.startswith("{") else None)


def test_go_on_a_healthy_entry(tmp_path):
    result, out = preflight("--steps", 8, config={}, tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert out["verdict"] == "go" and out["reasons"] == []
    assert [(s["index"], s["roles"]) for s in out["sample"]] == [
        (0, ["normal"]), (1, ["normal"]), (2, ["longest"]), (4, ["largest magnitude"])]
    assert out["canaries"][0]["caught"] and out["canaries"][0]["injected_into"] == "input x[0]"
    assert len(out["steps"]) == 8 and all(s["ok"] for s in out["steps"])
    assert [s["batch"] for s in out["steps"][:4]] == [
        "batch 0 (normal)", "batch 1 (normal)", "batch 2 (longest)", "batch 4 (largest magnitude)"]
    assert set(out["headroom"]) == {"parameters", "gradients", "optimizer state"}
    assert out["warnings"] == []


def test_default_is_twenty_steps_and_human_output():
    result = CliRunner().invoke(main, ["preflight", "--entry", ENTRY], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "steps: 20 of 20 clean" in result.output and "GO" in result.output and "caught" in result.output


def test_data_findings_are_a_no_go(tmp_path):
    clean = tmp_path / "clean.jsonl"
    clean.write_text('{"text": "a b"}\n{"text": "c"}\n')
    result, out = preflight("--steps", 2, "--data", clean)
    assert result.exit_code == 0 and out["data"]["records"] == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b", "x": NaN}\n{"text": ""}\n')
    result, out = preflight("--steps", 2, "--data", clean, "--data", bad)
    assert result.exit_code == 1 and out["verdict"] == "no-go"
    assert out["reasons"] == ["data: 1 nonfinite, 1 empty (the listed records must be fixed or removed)"]
    assert out["steps"]  # the training rehearsal still ran, for the full picture
    result, out = preflight("--steps", 2, "--data", bad, "--fail-on", "none")
    assert result.exit_code == 0


def test_data_that_cannot_be_read_is_a_no_go_whatever_fail_on_says(tmp_path):
    clean = tmp_path / "clean.jsonl"
    clean.write_text('{"text": "a b"}\n{"text": "c"}\n')
    garbage = tmp_path / "features.npy"
    garbage.write_bytes(b"\x93NUMPY" + bytes(range(256)))
    result, out = preflight("--steps", 2, "--data", clean, "--data", garbage, "--fail-on", "nonfinite")
    assert result.exit_code == 1 and out["verdict"] == "no-go"  # before: go, with the .npy never checked
    assert out["reasons"] == [f"data: 1 input(s) could not be read through, so their records were not all "
                              f"checked: {garbage}"]
    assert out["data"]["status"] == "unreadable" and out["data"]["unreadable_inputs"] == [str(garbage)]


@pytest.mark.parametrize("config, reason", [
    ({"explode": True}, "step 1 on batch 1 (normal): the loss is inf"),
    ({"nan_batch": 3}, "batch 3 already holds non-finite input values in x"),
    ({"crash_at": 4}, "step_fn raised RuntimeError: simulated crash in step_fn"),
    ({"no_batches": True}, "returned no batches"),
])
def test_no_go_reasons(tmp_path, config, reason):
    result, out = preflight("--steps", 6, config=config, tmp_path=tmp_path)
    assert result.exit_code == 1, result.output
    assert len(out["reasons"]) == 1 and reason in out["reasons"][0], out["reasons"]


def test_explosion_names_the_step_and_batch():
    report = run_preflight(ENTRY, config={"explode": True, "optimizer": "sgd"}, steps=10)
    failed = [s for s in report.steps if not s.ok]
    assert len(failed) == 1 and failed[0] is report.steps[-1]
    assert report.reasons[0].startswith(f"step {failed[0].step} on batch ")
    assert json.dumps(report.to_dict(), allow_nan=False)  # non-finite losses are written as text


def test_masked_inputs_fall_back_to_a_parameter_canary():
    report = run_preflight(ENTRY, config={"mask_inputs": True}, steps=3)
    assert [(c.injected_into, c.caught) for c in report.canaries] == [
        ("input x[0]", False), ("parameter net.0.weight", True)]
    assert report.go


def test_integer_inputs_use_a_parameter_canary():
    report = run_preflight(ENTRY, config={"int_inputs": True}, steps=3)
    assert [(c.injected_into, c.caught) for c in report.canaries] == [("parameter net.0.weight", True)]
    assert report.go and report.sample[0].magnitude == 0.0


def test_checks_that_are_not_live_are_a_no_go():
    from nanscan.preflight import scan_model

    def blind(model, optimizer, step=None):
        report = scan_model(model, optimizer, step)
        report.records = report.records.copy()  # scans return read-only records
        report.records[:, L.REC_NAN:L.REC_NEGINF + 1] = 0  # a scan that never sees a NaN
        return report

    report = run_preflight(ENTRY, steps=3, scan=blind)
    assert not report.go and "the canary was not caught" in report.reasons[0]
    assert report.steps == []


def test_the_canary_leaves_the_real_model_untouched():
    spec = build_spec(ENTRY, {"optimizer": "sgd"})
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    optimizer = spec.make_optimizer()
    results = run_canary(spec, spec.model, optimizer, spec.batches[0])
    assert results[-1].caught
    after = spec.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in spec.model.parameters())


def test_entry_errors(tmp_path):
    result = CliRunner().invoke(main, ["preflight", "--entry", "no_such_module_xyz:entry"])
    assert result.exit_code == 2 and "no_such_module_xyz" in result.output
    result = CliRunner().invoke(main, ["preflight", "--entry", "preflight_entry:not_a_spec"])
    assert result.exit_code == 2 and "expected nanscan.entry.ReplaySpec" in result.output
    result, out = preflight("--steps", 2)
    assert result.exit_code == 0
    result = CliRunner().invoke(main, ["preflight", "--entry", "preflight_entry:raising_entry", "--json"])
    assert result.exit_code == 1
    assert "raised ValueError: the checkpoint path is wrong" in json.loads(result.output)["reasons"][0]
    bad_config = tmp_path / "c.json"
    bad_config.write_text("[1]")
    result = CliRunner().invoke(main, ["preflight", "--entry", ENTRY, "--config", str(bad_config)])
    assert result.exit_code == 2 and "JSON object" in result.output
    with pytest.raises(EntryError):
        run_preflight("preflight_entry:missing_function")
    with pytest.raises(ValueError, match="steps"):
        run_preflight(ENTRY, steps=0)


def test_headroom_warnings_only_for_formats_the_model_uses():
    def hist(binade, count):
        h = np.zeros(L.HIST_BINS, dtype=np.int64)
        h[binade - L.MIN_BIN_EXPONENT] = count
        return h

    near = {"gradients": hist(14, 10) + hist(-30, 100), "parameters": hist(16, 1) + hist(0, 99)}
    table, warnings = headroom_report(near, ["float16"])
    assert set(table) == {"gradients", "parameters"}
    assert "gradients: the largest value is within 1 binade(s) of float16 overflow" in warnings
    assert "90.91% of gradient values would flush to zero in float16 (consider loss scaling)" in warnings
    assert "1.00% of parameters values lie above the float16 range" in warnings
    assert headroom_report(near, [])[1] == []
