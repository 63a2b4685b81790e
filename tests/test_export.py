"""export-regression: the minimal failing sample as safetensors + JSON and a pytest file that fails until the cause
is fixed; nanscan.testing.assert_step_finite on its own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import replay_entries as E
from nanscan.cli.main import main
from nanscan.replay import ReplayError, export_regression, record_replay, replay
from nanscan.testing import RegressionCaseError, assert_step_finite, load_regression_case

TESTS_DIR = Path(__file__).parent


def _load_test_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_writes_the_minimal_failing_sample(tmp_path):
    bundle = E.train("poisoned_sample", tmp_path / "bundles")
    result = export_regression(bundle, tmp_path / "regress")
    case_dir, test_file = Path(result.case_dir), Path(result.test_file)
    assert result.indices == [E.POISON_ROW] and result.sample_ids == [f"s003-{E.POISON_ROW}"]
    assert result.reproduced and result.with_state
    assert sorted(p.name for p in case_dir.iterdir()) == ["batch.safetensors", "case.json", "rng.safetensors",
                                                          "state.safetensors"]
    batch = load_file(case_dir / "batch.safetensors")
    assert batch["x"].shape == (1, 8) and batch["x"][0, 2].item() == pytest.approx(1e22, rel=1e-6)
    meta = json.loads((case_dir / "case.json").read_text())
    assert meta["expected"] == {"finite": True}
    assert meta["observed"]["finite"] is False and meta["observed"]["loss"] == "inf"
    assert meta["samples"]["sample_ids"] == [f"s003-{E.POISON_ROW}"]
    assert meta["source"]["step"] == 3 and meta["replay_entry"] == f"{E.MODULE}:poisoned_sample"
    assert test_file.name.startswith("test_") and "assert_step_finite" in test_file.read_text()
    case = load_regression_case(case_dir)
    assert set(case.model_state) == {"0.weight", "0.bias"} and case.optimizer_state is not None


def test_generated_test_fails_until_the_cause_is_fixed(tmp_path):
    bundle = E.train("poisoned_sample", tmp_path / "bundles")
    result = export_regression(bundle, tmp_path / "regress")
    module = _load_test_module(Path(result.test_file))
    test = next(getattr(module, n) for n in dir(module) if n.startswith("test_"))
    with pytest.raises(AssertionError, match=r"(?s)non-finite \(input\): loss.*likely cause: the batch's input:x"):
        test()
    # the fix (clamping the features) recorded in the case's config: the same test now passes
    case_json = Path(result.case_dir) / "case.json"
    meta = json.loads(case_json.read_text())
    meta["config"]["clamp"] = True
    case_json.write_text(json.dumps(meta))
    test()


def test_export_is_idempotent_and_uses_the_recorded_bisection(tmp_path):
    bundle = E.train("masked_attention", tmp_path / "bundles")
    record_replay(replay(bundle))
    first = export_regression(bundle, tmp_path / "regress")
    before = _files(tmp_path / "regress")
    second = export_regression(bundle, tmp_path / "regress")
    assert _files(tmp_path / "regress") == before
    assert first.indices == second.indices == [E.MASKED_ROW]
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "regress").iterdir())
    meta = json.loads((Path(first.case_dir) / "case.json").read_text())
    assert meta["observed"]["localization"]["module"] == "attn.softmax"
    assert meta["batch"]["structure"]["mask"] == {"__tensor__": "mask"}
    assert load_regression_case(first.case_dir).batch["mask"].dtype == torch.bool


def test_cli_export_without_state(tmp_path):
    bundle = E.train("sqrt_backward", tmp_path / "bundles")
    out = CliRunner().invoke(main, ["export-regression", str(bundle), str(tmp_path / "regress"), "--no-state",
                                    "--samples", f"{E.ZERO_ROW},0", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["indices"] == [E.ZERO_ROW, 0] and data["with_state"] is False
    case = load_regression_case(data["case_dir"])
    assert case.model_state is None and case.batch["x"].shape == (2, 4)
    bad = CliRunner().invoke(main, ["export-regression", str(bundle), str(tmp_path / "r2"), "--samples", "a,b"])
    assert bad.exit_code == 2 and "comma-separated" in bad.output


@pytest.mark.slow
def test_generated_file_runs_under_pytest(tmp_path):
    bundle = E.train("masked_attention", tmp_path / "bundles")
    result = export_regression(bundle, tmp_path / "regress")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", result.test_file],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr  # fails: the fully masked row is still there
    assert "attn.softmax (Softmax), forward" in run.stdout


def test_assert_step_finite_passes_on_healthy_data_and_names_the_module():
    config = {"seed": 0, "fault_step": 0, "batch_size": 4}
    model = E.SqrtModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    healthy = E.sqrt_batch(config, 1)
    outcome = assert_step_finite(model, E.sqrt_step, healthy, optimizer=optimizer)
    assert outcome.finite and outcome.grad_max_exponent is not None
    with pytest.raises(AssertionError, match=r"(?s)non-finite \(gradient\).*first bad: mag \(Magnitude\), backward"):
        assert_step_finite(model, E.sqrt_step, E.sqrt_batch(config, 0))
    with pytest.raises(ValueError, match="without an optimizer"):
        assert_step_finite(model, E.sqrt_step, healthy, optimizer_state={})


def test_load_regression_case_errors(tmp_path):
    with pytest.raises(RegressionCaseError, match="no case.json"):
        load_regression_case(tmp_path)
    (tmp_path / "case.json").write_text('{"schema": "other"}')
    with pytest.raises(RegressionCaseError, match="schema"):
        load_regression_case(tmp_path)


@pytest.fixture(scope="module")
def poisoned_bundle(tmp_path_factory):
    return E.train("poisoned_sample", tmp_path_factory.mktemp("bundles"))


CASE_NAME = "nanscan_poisoned_sample_step3"


def test_a_users_file_of_the_same_name_is_never_replaced(poisoned_bundle, tmp_path):
    user_test = tmp_path / f"test_{CASE_NAME}.py"
    user_test.write_text("def test_mine():\n    assert True\n")
    with pytest.raises(ReplayError, match=f"test_{CASE_NAME}.py already exists .* nothing was written"):
        export_regression(poisoned_bundle, tmp_path)
    assert user_test.read_text() == "def test_mine():\n    assert True\n"
    assert not (tmp_path / CASE_NAME).exists()
    user_test.unlink()
    user_dir = tmp_path / CASE_NAME
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("mine")
    out = CliRunner().invoke(main, ["export-regression", str(poisoned_bundle), str(tmp_path), "--overwrite"])
    assert out.exit_code == 1 and "holds notes.txt" in out.output
    assert (user_dir / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [CASE_NAME]


def test_an_earlier_export_that_differs_is_replaced_only_when_asked(poisoned_bundle, tmp_path):
    first = export_regression(poisoned_bundle, tmp_path)
    assert first.changed and first.indices == [E.POISON_ROW]
    case_json = Path(first.case_dir) / "case.json"
    meta = json.loads(case_json.read_text())
    meta["config"]["clamp"] = True  # a reviewer trying the fix in the exported case
    case_json.write_text(json.dumps(meta))
    edited = _files(tmp_path)
    with pytest.raises(ReplayError, match="an earlier export differs .* pass --overwrite"):
        export_regression(poisoned_bundle, tmp_path)
    assert _files(tmp_path) == edited
    again = export_regression(poisoned_bundle, tmp_path, overwrite=True)
    assert again.changed and json.loads(case_json.read_text())["config"] == {}
    assert not export_regression(poisoned_bundle, tmp_path).changed  # the same export again: nothing to replace
    out = CliRunner().invoke(main, ["export-regression", str(poisoned_bundle), str(tmp_path)])
    assert out.exit_code == 0 and "nothing changed" in out.output


@pytest.mark.parametrize("rows", ["16", "-1", "3,3"])
def test_sample_rows_outside_the_batch_are_refused(poisoned_bundle, tmp_path, rows):
    out = CliRunner().invoke(main, ["export-regression", str(poisoned_bundle), str(tmp_path), "--samples", rows])
    assert out.exit_code == 1 and "give distinct row numbers from 0 to 15" in out.output, out.output


def test_sample_ids_with_quotes_and_backslashes_give_a_valid_test_file(tmp_path, monkeypatch):
    odd = 'C:\\new\\N{x} """ \x07'
    monkeypatch.setattr(E, "sample_ids", lambda step, size: [f"{odd}{row}" for row in range(size)])
    result = export_regression(E.train("poisoned_sample", tmp_path / "bundles"), tmp_path / "regress")
    module = _load_test_module(Path(result.test_file))  # a SyntaxError here before
    assert repr([f"{odd}{E.POISON_ROW}"]) in module.__doc__
    test = next(getattr(module, n) for n in dir(module) if n.startswith("test_"))
    with pytest.raises(AssertionError, match=r"non-finite \(input\)"):
        test()
