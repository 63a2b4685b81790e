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
from nanscan.cli import main
from nanscan.replay import export_regression, record_replay, replay
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
    with pytest.raises(AssertionError, match=r"non-finite \(loss\): loss"):
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
