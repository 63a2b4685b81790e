"""The trust rule (NOTE: [trust rule] in nanscan/entry.py): a bundle someone sent you never makes nanscan call code
you did not choose. Crafted manifests naming `subprocess` through the entry and through a zero-config recipe, and a
LightningModule that lives only in a directory the bundle records, are refused with no side effect; a marked entry,
an entry given with --entry, the zero-config rebuilds and exported regression tests still work."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import nanscan
import replay_entries as E
from nanscan.cli.main import main
from nanscan.entry import (EntryWarning, UntrustedError, build_spec, is_marked_entry, load_entry, replay_entry)
from nanscan.integrations.rebuild import RECIPE_KEY, REPLAY_ENTRY
from nanscan.bundle.provenance import config_sha256
from nanscan.replay import Replayer
from nanscan.replay.export import export_regression
from nanscan.replay.reproduce import replay
from nanscan.testing import load_regression_case


@pytest.fixture(scope="module")
def sent(tmp_path_factory) -> Path:
    """A real bundle (a marked entry's), to be edited into what a stranger could send."""
    return E.train("poisoned_sample", tmp_path_factory.mktemp("sent"))


def _edited(bundle: Path, tmp_path: Path, edit) -> Path:
    """A copy of `bundle` whose manifest `edit` changed, with config_sha256 recomputed (the digests prove only
    integrity, so anyone can do this)."""
    import shutil  # noqa: PLC0415

    copy = tmp_path / "copy" / bundle.name
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    manifest["config_sha256"] = config_sha256(manifest["config"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _planted(tmp_path: Path) -> tuple[Path, list[str]]:
    marker = tmp_path / "PLANTED"
    return marker, ["sh", "-c", f"touch {marker}"]


def _cli(*args: str) -> tuple[int, str]:
    out = CliRunner().invoke(main, [str(a) for a in args])
    return out.exit_code, out.output


def test_marks_are_in_the_function_itself():
    from nanscan.demo import replay_entry as demo_entry  # noqa: PLC0415

    assert is_marked_entry(E.poisoned_sample) and is_marked_entry(demo_entry)
    assert not is_marked_entry(subprocess.run) and not is_marked_entry(print)
    with pytest.raises(TypeError, match="marks a function"):
        replay_entry(subprocess.Popen)

    class Lies:  # any attribute lookup answers True
        def __getattr__(self, name):
            return True

    assert not is_marked_entry(Lies())


@pytest.mark.parametrize("command", ["replay", "ablate", "export-regression"])
def test_a_bundle_naming_subprocess_run_as_its_entry_is_refused(sent, tmp_path, command):
    marker, argv = _planted(tmp_path)
    crafted = _edited(sent, tmp_path, lambda m: m.update(
        replay_entry="subprocess:run", config={"args": argv}))
    extra = [tmp_path / "out"] if command == "export-regression" else []
    code, output = _cli(command, crafted, *extra)
    assert code == 2, output
    assert "replay_entry 'subprocess:run' is not marked" in output and "--entry subprocess:run" in output
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def _recipe(model: dict, optimizer_class: str = "torch.optim.sgd:SGD") -> dict:
    return {RECIPE_KEY: {"model": model,
                         "optimizer": {"class": optimizer_class, "groups": [{"params": [], "settings": {"lr": 0.1}}]},
                         "step": {"kind": "training_step", "divide_by": 1}}}


@pytest.mark.parametrize("model, optimizer_class, field, named", [
    ({"kind": "lightning", "class": "subprocess:run", "hparams": {}}, "torch.optim.sgd:SGD",
     "model.class", "names a function"),
    ({"kind": "lightning", "class": "subprocess:Popen", "hparams": {}}, "torch.optim.sgd:SGD",
     "model.class", "names Popen, which is not a LightningModule"),
    ({"kind": "pretrained", "class": "subprocess:Popen", "config_class": "subprocess:Popen", "config": {}},
     "torch.optim.sgd:SGD", "model.class", "which is not a transformers PreTrainedModel"),
    ({"kind": "lightning", "class": "integration_models:TinyRegressor", "hparams": {}}, "subprocess:Popen",
     "optimizer.class", "which is not a torch.optim.Optimizer"),
])
def test_a_zero_config_recipe_naming_a_command_is_refused(sent, tmp_path, model, optimizer_class, field, named):
    pytest.importorskip("lightning.pytorch")
    marker, argv = _planted(tmp_path)
    model = {**model, "hparams": {"args": argv}} if "hparams" in model else {**model, "config": {"args": argv}}
    crafted = _edited(sent, tmp_path, lambda m: m.update(replay_entry=REPLAY_ENTRY,
                                                          config=_recipe(model, optimizer_class)))
    code, output = _cli("replay", crafted, "--no-record")
    assert code == 2, output
    assert f"config.{RECIPE_KEY}.{field}" in " ".join(output.split()) and named in " ".join(output.split())
    assert "--entry" in output
    assert not marker.exists()


def test_a_recipe_dtype_must_be_a_torch_dtype(sent, tmp_path):
    pytest.importorskip("lightning.pytorch")
    model = {"kind": "lightning", "class": "integration_models:TinyRegressor", "hparams": {}, "dtype": "load"}
    crafted = _edited(sent, tmp_path, lambda m: m.update(replay_entry=REPLAY_ENTRY, config=_recipe(model)))
    with pytest.raises(UntrustedError, match="dtype is 'load', not a torch dtype"):
        Replayer(crafted).build()


def test_an_unmarked_entry_from_the_bundle_needs_entry(sent, tmp_path):
    """The user's own unmarked entry: refused on the bundle's word, run when the user names it."""
    crafted = _edited(sent, tmp_path, lambda m: m.update(replay_entry="replay_entries:unmarked_poisoned_sample"))
    with pytest.raises(UntrustedError, match="--entry replay_entries:unmarked_poisoned_sample"):
        replay(crafted, runs=1, bisect=False)
    result = replay(crafted, "replay_entries:unmarked_poisoned_sample", runs=1, bisect=False)
    assert result.reproduced and result.failing_run.category == "input"


def test_the_window_replay_and_ablation_keep_the_trust_rule(sent, tmp_path):
    """replay --window and ablate --window build the step through the same entry: an unmarked entry named only by
    the bundle is refused, and a planted command in the manifest runs nothing."""
    from nanscan.replay.ablate_window import ablate_window  # noqa: PLC0415
    from nanscan.replay.window import replay_window  # noqa: PLC0415

    crafted = _edited(sent, tmp_path, lambda m: m.update(replay_entry="replay_entries:unmarked_poisoned_sample"))
    for rerun in (replay_window, ablate_window):
        with pytest.raises(UntrustedError, match="--entry replay_entries:unmarked_poisoned_sample"):
            rerun(crafted)
    assert replay_window(crafted, "replay_entries:unmarked_poisoned_sample").reproduced
    marker, command = _planted(tmp_path)
    planted = _edited(sent, tmp_path / "planted", lambda m: m.update(replay_entry="subprocess:run",
                                                                     config={"args": command}))
    code, out = _cli("replay", planted, "--window")
    assert code == 2 and not marker.exists(), out


def test_the_monitor_warns_at_once_about_an_unmarked_entry():
    model = torch.nn.Linear(2, 2)
    with pytest.warns(EntryWarning, match="not marked with @nanscan.entry.replay_entry"):
        nanscan.Monitor(model, replay_entry="replay_entries:unmarked_poisoned_sample")
    with warnings.catch_warnings():
        warnings.simplefilter("error", EntryWarning)
        nanscan.Monitor(model, replay_entry="replay_entries:poisoned_sample")


def test_a_user_choice_needs_no_mark():
    assert load_entry("replay_entries:unmarked_poisoned_sample") is E.unmarked_poisoned_sample
    spec = build_spec("replay_entries:unmarked_poisoned_sample", {})
    assert isinstance(spec.model, torch.nn.Module)


# -- directories a bundle records -------------------------------------------------------------------------------

LIT_PACKAGE = '''
"""A user's LightningModule in a package of its own (litpkg), imported only from its directory."""
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

with open(Path(__file__).with_name("IMPORTED"), "a") as f:
    f.write("imported\\n")


class MaskedRegressor(pl.LightningModule):
    def __init__(self, dim: int = 4, hidden: int = 8, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y, mask = batch
        return ((((self.body(x).squeeze(-1) - y) ** 2) * mask).sum() / mask.sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
'''


@pytest.fixture(scope="module")
def lit_bundle(tmp_path_factory):
    """A Lightning run whose module lives in <project>/litpkg, trained from <project> (its working directory)."""
    pl = pytest.importorskip("lightning.pytorch")
    from nanscan.integrations.lightning import NanscanCallback  # noqa: PLC0415

    from integration_models import regression_rows  # noqa: PLC0415

    project = tmp_path_factory.mktemp("project")
    (project / "litpkg").mkdir()
    (project / "litpkg" / "__init__.py").write_text(textwrap.dedent(LIT_PACKAGE))
    mp = pytest.MonkeyPatch()
    mp.chdir(project)
    mp.syspath_prepend(str(project))
    try:
        from litpkg import MaskedRegressor  # noqa: PLC0415

        trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[NanscanCallback(bundle_dir=project / "bundles", run_id="lit")])
        loader = torch.utils.data.DataLoader(regression_rows(nan_rows=(22,)), batch_size=4, shuffle=False)
        with pytest.raises(nanscan.NonFiniteError) as info:
            trainer.fit(MaskedRegressor(), loader)
    finally:
        mp.undo()
        for name in [n for n in sys.modules if n == "litpkg" or n.startswith("litpkg.")]:
            del sys.modules[name]
    return project, Path(info.value.bundle_path)


def _imports(project: Path) -> int:
    return len((project / "litpkg" / "IMPORTED").read_text().splitlines())


def test_a_class_only_in_a_recorded_directory_is_not_imported_without_the_flag(lit_bundle, tmp_path, monkeypatch):
    project, bundle = lit_bundle
    monkeypatch.chdir(tmp_path)
    before = _imports(project)
    code, output = _cli("replay", bundle, "--no-record", "--no-bisect")
    flat = " ".join(output.split())
    assert code == 2, output
    assert f"the run's working directory (recorded in the bundle), {project}, holds it" in flat
    assert "--trust-bundle-paths" in flat
    assert _imports(project) == before and "litpkg" not in sys.modules


def test_the_flag_imports_from_the_recorded_directory(lit_bundle, tmp_path, monkeypatch):
    project, bundle = lit_bundle
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        code, output = _cli("replay", bundle, "--no-record", "--no-bisect", "--trust-bundle-paths", "--json")
        assert code == 0, output
        result = json.loads(output[output.index("{"):])
        assert result["reproduced"] and result["runs"][0]["category"] == "input"
    finally:
        sys.modules.pop("litpkg", None)


def test_a_users_lightning_module_in_the_current_directory_replays_with_no_entry(lit_bundle, monkeypatch):
    project, bundle = lit_bundle
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        for command in (["replay", bundle, "--no-record", "--no-bisect"], ["ablate", bundle, "--no-record",
                                                                           "--factor", "lr-x0.1", "--holdout", "0"]):
            code, output = _cli(*command)
            assert code == 0, output
    finally:
        sys.modules.pop("litpkg", None)


# -- exported regression tests ------------------------------------------------------------------------------------

def _run_pytest(test_file: str, cwd: Path) -> subprocess.CompletedProcess:
    tests_dir = Path(E.__file__).resolve().parent
    env = {**__import__("os").environ, "PYTHONPATH": str(tests_dir)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # make test's 15 minutes (a subprocess run or a long training); make test-slow runs it
def test_an_exported_test_calls_the_bundles_entry_only_when_marked(sent, tmp_path):
    result = export_regression(sent, tmp_path / "regressions", samples=[E.POISON_ROW])
    source = Path(result.test_file).read_text()
    assert "ENTRY" not in source and "case.build_spec()" in source
    run = _run_pytest(result.test_file, tmp_path)
    assert run.returncode == 1 and "went non-finite" in run.stdout, run.stdout + run.stderr
    # A case file edited to name subprocess: the test refuses it and runs nothing.
    marker, argv = _planted(tmp_path)
    case_json = Path(result.case_dir) / "case.json"
    case = json.loads(case_json.read_text())
    case.update(replay_entry="subprocess:run", config={"args": argv})
    case_json.write_text(json.dumps(case))
    with pytest.raises(UntrustedError, match="not marked"):
        load_regression_case(result.case_dir).build_spec()
    run = _run_pytest(result.test_file, tmp_path)
    assert run.returncode == 1 and "UntrustedError" in run.stdout and not marker.exists(), run.stdout


@pytest.mark.slow  # make test's 15 minutes (a subprocess run or a long training); make test-slow runs it
def test_an_exported_test_keeps_the_entry_its_exporter_chose_in_its_code(sent, tmp_path):
    crafted = _edited(sent, tmp_path, lambda m: m.update(replay_entry="replay_entries:unmarked_poisoned_sample"))
    result = export_regression(crafted, tmp_path / "regressions", "replay_entries:unmarked_poisoned_sample",
                               samples=[E.POISON_ROW])
    source = Path(result.test_file).read_text()
    assert "ENTRY = 'replay_entries:unmarked_poisoned_sample'" in source and "case.build_spec(ENTRY)" in source
    run = _run_pytest(result.test_file, tmp_path)
    assert run.returncode == 1 and "went non-finite (input)" in run.stdout, run.stdout + run.stderr
