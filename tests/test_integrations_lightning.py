"""NanscanCallback under the real lightning.Trainer (a small LightningModule, CPU, accumulate_grad_batches=2): a
clean run writes no bundle, planted faults are caught at the right optimizer step with the right category and
micro-batch, "stop" ends training cleanly, and zero-config replay rebuilds the module from its hyperparameters."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

import nanscan  # noqa: E402
from nanscan.bundle import load_bundle  # noqa: E402
from nanscan.entry import EntryError  # noqa: E402
from nanscan.integrations.lightning import NanscanCallback  # noqa: E402
from nanscan.replay.reproduce import replay  # noqa: E402

from integration_models import NoHparams, TinyRegressor, plant_bad_weight, regression_rows  # noqa: E402

accepts_scaler = "scaler" in inspect.signature(nanscan.Monitor).parameters


class PlantWeight(pl.Callback):
    def __init__(self, step: int, name: str):
        self.step, self.name = step, name

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            plant_bad_weight(pl_module, self.name)


def fit(module, data, callback, *, extra=(), steps=4, plugins=None):
    trainer = pl.Trainer(max_steps=steps, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=[callback, *extra], plugins=plugins)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    trainer.fit(module, loader)
    return trainer


def caught(module, data, callback, **kwargs) -> nanscan.NonFiniteError:
    with pytest.raises(nanscan.NonFiniteError) as info:
        fit(module, data, callback, **kwargs)
    assert info.value.bundle_path is not None
    return info.value


def test_a_clean_run_writes_no_bundle_and_logs_nanscans_numbers(tmp_path):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="clean")
    trainer = fit(TinyRegressor(), regression_rows(), callback)
    assert not (tmp_path / "bundles").exists()
    assert callback.monitor.step == 4  # one check per optimizer step (8 micro-batches)
    assert trainer.callback_metrics["nanscan/nonfinite_tensors"] == 0
    assert trainer.callback_metrics["nanscan/skipped_steps"] == 0


def test_a_nan_in_one_micro_batch_is_caught_at_its_step_and_replayed(tmp_path):
    # rows 20..23 are batch 5: optimizer step 2, micro-batch 1
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="input")
    error = caught(TinyRegressor(), regression_rows(nan_rows=(22,)), callback)
    assert (error.step, error.category) == (2, "input")
    assert error.tensors == ["input:micro_batches.1.0"]
    bundle = load_bundle(error.bundle_path)
    assert bundle.batch(nested=True)["batch_indices"] == [4, 5]
    # the run's window: every optimizer step's micro-batches since the run's first step, and its state then
    records = bundle.window_records()
    assert [r.step for r in records] == [0, 1, 2] and [s["step"] for s in bundle.window["states"]] == [0]
    assert [r.batch["batch_indices"] for r in records] == [[0, 1], [2, 3], [4, 5]]
    finding = next(f for f in bundle.findings() if f["key"] == "micro_batches")
    assert finding["record"]["first_bad"] == 1
    result = replay(error.bundle_path, runs=2)
    assert result.reproduced and result.verdict == "persistent" and result.failing_run.category == "input"
    assert result.bisect.indices == [6] and result.bisect.sample_ids == [{"micro_batch": 1, "row": 2}]


def test_a_bad_weight_gives_parameter(tmp_path):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="weight")
    error = caught(TinyRegressor(), regression_rows(), callback, extra=[PlantWeight(1, "net.2.weight")])
    assert (error.step, error.category) == (1, "parameter")
    result = replay(error.bundle_path, runs=2, bisect=False)
    assert result.reproduced and result.failing_run.category == "parameter"
    assert result.localization.label == "net.2"


class NanHidden(pl.Callback):
    """From the given optimizer step on, the hidden layer gives NaN (a broken kernel): a forward fault inside the
    module."""

    def __init__(self, step: int):
        self.step, self.handle = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.handle is None:
            self.handle = pl_module.net[0].register_forward_hook(lambda _m, _a, out: out * float("nan"))


def test_with_no_step_fn_the_incident_is_rerun_in_the_process_and_names_the_module(tmp_path):
    """The callback's default step_fn (issue 61 item 3): the module's own training_step over the recorded
    micro-batches, as the zero-config replay runs it, so that the Monitor reruns the failing step in the process and
    names the module with no code of the user's."""
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="blow-up", diagnose=False)
    error = caught(TinyRegressor(), regression_rows(), callback, extra=[NanHidden(1)])
    rerun = callback.monitor.rerun
    assert error.step == 1 and rerun is not None and rerun.reproduced, (error.step, str(error))
    assert rerun.step_fn.endswith("training_step") and "net.0" in rerun.headline(), rerun.headline()
    assert "rerun in process: reproduced" in str(error)


def test_a_fully_masked_step_gives_loss_and_replays_from_the_hyperparameters(tmp_path):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="masked")
    error = caught(TinyRegressor(hidden=6), regression_rows(masked_rows=range(4, 8)), callback)
    assert (error.step, error.category) == (0, "loss")
    finding = next(f for f in load_bundle(error.bundle_path).findings() if f["key"] == "micro_batches")
    assert [row["bad"] for row in finding["record"]["rows"]] == [False, True]
    result = replay(error.bundle_path, runs=2, bisect=False)
    assert result.reproduced and result.verdict == "persistent" and result.failing_run.category == "loss"


def test_stop_skips_the_bad_update_and_ends_training_cleanly(tmp_path):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="stop", on_invalid="stop")
    module = TinyRegressor()
    with pytest.warns(nanscan.NonFiniteWarning):
        trainer = fit(module, regression_rows(nan_rows=(9,)), callback, steps=6)
    assert callback.monitor.first_invalid_step == 1 and callback.monitor.bundle_path is not None
    assert trainer.global_step < 6 and trainer.should_stop
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert trainer.callback_metrics["nanscan/skipped_steps"] == 1


def test_rollback_skips_the_bad_step_and_training_goes_on(tmp_path):
    """on_invalid=Rollback(skip="step") (nanscan.runtime.rollback NOTE: [rollback]): the NaN row's step is dropped,
    each epoch (4 steps apart, more than settle_steps=2), and training runs all its steps, finite, with the rollbacks
    in the run's record."""
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="rollback",
                               on_invalid=nanscan.Rollback(skip="step", settle_steps=2))
    module = TinyRegressor()
    with pytest.warns(nanscan.RollbackWarning, match="rolled back: back to step 1's start"):
        trainer = fit(module, regression_rows(nan_rows=(9,)), callback, steps=6)
    assert trainer.global_step == 6 and not trainer.should_stop
    assert all(torch.isfinite(p).all() for p in module.parameters())
    entries = json.loads((tmp_path / "bundles" / "rollback" / "rollbacks.json").read_text())["rollbacks"]
    assert [(e["at_step"], e["skipped_steps"]) for e in entries] == [(1, [1]), (5, [5])]
    assert trainer.callback_metrics["nanscan/skipped_steps"] == 2


def test_a_module_without_saved_hyperparameters_makes_replay_ask_for_an_entry(tmp_path):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="no-hparams")
    error = caught(NoHparams(width=5), regression_rows(nan_rows=(0,)), callback)
    with pytest.raises(EntryError, match=r"NoHparams\(\.\.\.\) cannot be called with no saved hyperparameters.*"
                                         r"save_hyperparameters.*--entry"):
        replay(error.bundle_path, runs=1)


def test_the_same_callback_serves_pytorch_lightning(tmp_path):
    legacy = pytest.importorskip("pytorch_lightning")
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="legacy")

    class Module(legacy.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            return ((self.net(x).squeeze(-1) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = legacy.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    data = regression_rows(nan_rows=(9,))
    with pytest.raises(nanscan.NonFiniteError) as info:
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    assert (info.value.step, info.value.category) == (2, "input")


@pytest.mark.skipif(not accepts_scaler, reason="Monitor(scaler=) not in this build")
def test_16_mixed_overflow_skips_are_expected_not_incidents(tmp_path):
    from lightning.pytorch.plugins import MixedPrecision

    class Overflow(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:
                trainer.precision_plugin.scaler.update(new_scale=2.0 ** 60)

    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="fp16")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fit(TinyRegressor(), regression_rows(), callback, extra=[Overflow()], plugins=[plugin])
    assert not (tmp_path / "bundles").exists()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_fabric_module_is_unwrapped_and_its_step_start_seen(tmp_path, compiled):
    """litgpt's way: Fabric's setup() wraps the (compiled) model in a _FabricModule. The Monitor scans and stores
    the plain model under its own names, not `_forward_module.` or `_orig_mod.` ones, and its forward pre-hook sits
    where the forward runs eagerly, so the RNG state is the step start's, not the check's (inside the compiled
    region the hook does nothing, which took them at the check without a word)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, fabric_optimizer = fabric.setup(torch.compile(model, backend="eager") if compiled else model, optimizer)
    monitor = nanscan.Monitor(wrapped, fabric_optimizer, bundle_dir=tmp_path, run_id="fabric")
    with pytest.raises(nanscan.NonFiniteError) as err:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 3:
                x[2, 1] = float("nan")
            fabric_optimizer.zero_grad()
            loss = wrapped(x).pow(2).mean()
            fabric.backward(loss)
            if monitor.check(batch={"x": x}, loss=loss).ok:
                fabric_optimizer.step()
    bundle = load_bundle(err.value.bundle_path)
    assert err.value.step == 3 and bundle.category == "input"
    names = [t["name"] for t in bundle.manifest["nonfinite_tensors"]] + list(bundle.manifest["category_tensors"])
    assert names and not any("_forward_module" in n or "_orig_mod" in n for n in names), names
    assert set(bundle.state()[0]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert bundle.manifest["rng"]["captured_at"] == "step_start"
