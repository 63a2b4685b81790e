"""NanscanCallback under the real transformers.Trainer (a tiny GPT-2 and a tiny ViT built from config, CPU, no
download): clean runs write no bundle, planted faults are caught at the right optimizer step with the right
category and micro-batch, and zero-config replay reproduces and localizes them."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nanscan  # noqa: E402
from nanscan.bundle import load_bundle  # noqa: E402
from nanscan.entry import EntryError  # noqa: E402
from nanscan.integrations.transformers import NanscanCallback  # noqa: E402
from nanscan.replay.reproduce import replay  # noqa: E402

from integration_models import ImageData, PlantingCollator, TokenData, plant_bad_weight, tiny_gpt2, tiny_vit  # noqa: E402

accepts_scaler = "scaler" in inspect.signature(nanscan.Monitor).parameters
ROOT = Path(__file__).resolve().parent.parent


class PlantWeight(transformers.TrainerCallback):
    """Writes an inf into a weight when the given optimizer step begins."""

    def __init__(self, step: int, name: str):
        self.step, self.name = step, name

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            plant_bad_weight(model, self.name)


class BlowUpMlp(transformers.TrainerCallback):
    """From the given optimizer step on, block 0's MLP output is multiplied by 1e40 (inf in float32): a forward
    fault inside the model, which the in-process rerun must find again and name."""

    def __init__(self, step: int):
        self.step, self.handle = step, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step and self.handle is None:
            self.handle = model.transformer.h[0].mlp.register_forward_hook(lambda _m, _a, out: out * 1e40)


class OwnLossTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss * 2.0


def make_trainer(tmp_path, model, data, collator, *, callback, extra=(), accumulation=2, steps=3,
                 trainer_class=transformers.Trainer):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
        max_steps=steps, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, learning_rate=1e-3)
    return trainer_class(model=model, args=args, train_dataset=data, data_collator=collator,
                         callbacks=[callback, *extra])


def caught(trainer) -> nanscan.NonFiniteError:
    with pytest.raises(nanscan.NonFiniteError) as info:
        trainer.train()
    assert info.value.bundle_path is not None
    return info.value


@pytest.mark.parametrize("build,data", [(tiny_gpt2, TokenData), (tiny_vit, ImageData)], ids=["gpt2", "vit"])
def test_a_clean_run_writes_no_bundle_and_logs_nanscans_numbers(tmp_path, build, data):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="clean")
    trainer = make_trainer(tmp_path, build(), data(), PlantingCollator(), callback=callback)
    trainer.train()
    assert not (tmp_path / "bundles").exists()
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert len(steps) == 3
    assert all(log["nanscan/nonfinite_tensors"] == 0 and log["nanscan/nonfinite_steps"] == 0 for log in steps)
    assert callback.monitor.step == 4  # one check per optimizer step (numbered 1..3 as the Trainer logs them)
    assert callback.monitor.history[-1].step == 3 == trainer.state.global_step


def test_a_nan_in_one_micro_batch_is_caught_at_its_step_and_replayed(tmp_path):
    # call 5 of the collator: optimizer step 2, micro-batch 1 (two micro-batches per step)
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="vit-input")
    trainer = make_trainer(tmp_path, tiny_vit(), ImageData(), PlantingCollator("nan", at=(5,)), callback=callback,
                           steps=4)
    error = caught(trainer)
    assert (error.step, error.category) == (3, "input")
    assert error.tensors == ["input:micro_batches.1.pixel_values"]
    bundle = load_bundle(error.bundle_path)
    finding = next(f for f in bundle.findings() if f["key"] == "micro_batches")
    assert finding["record"]["first_bad"] == 1 and finding["record"]["micro_batches"] == 2
    assert "micro-batch 1 of 2" in (Path(error.bundle_path) / "INCIDENT.md").read_text()
    assert [len(b["pixel_values"]) for b in bundle.batch(nested=True)["micro_batches"]] == [2, 2]
    # the run's window: every optimizer step's micro-batches since the run's first step, and its state then
    records = bundle.window_records()
    assert [r.step for r in records] == [1, 2, 3] and [s["step"] for s in bundle.window["states"]] == [1]
    assert all(len(r.batch["micro_batches"]) == 2 for r in records) and records[0].lrs[0] is not None

    result = replay(error.bundle_path, runs=2)
    assert result.entry == "nanscan.integrations.rebuild:replay_entry"
    assert result.reproduced and result.verdict == "persistent" and result.failing_run.category == "input"
    assert result.localization.phase == "input"
    assert result.localization.detail == "non-finite in input:micro_batches.1.pixel_values"
    # the planted row, numbered across the step's micro-batches, and named by micro-batch and row
    assert result.bisect.indices == [3] and result.bisect.sample_ids == [{"micro_batch": 1, "row": 1}]


def test_a_bad_weight_gives_parameter_and_replay_names_its_module(tmp_path):
    name = "transformer.h.0.mlp.c_fc.weight"
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="gpt2-weight")
    trainer = make_trainer(tmp_path, tiny_gpt2(), TokenData(), PlantingCollator(), callback=callback,
                           extra=[PlantWeight(1, name)])
    error = caught(trainer)
    assert (error.step, error.category) == (2, "parameter")
    assert f"param:{name}" in error.tensors
    result = replay(error.bundle_path, runs=2, bisect=False)
    assert result.reproduced and result.verdict == "persistent" and result.failing_run.category == "parameter"
    assert result.localization.label == "transformer.h.0.mlp.c_fc"


def test_a_fully_masked_step_gives_loss_and_the_cli_replays_it_without_an_entry(tmp_path):
    # both micro-batches of step 1 have every label -100: the Trainer's token count is 0 and the loss 0/0
    # the subject is the command line's replay: the in-process diagnosis is left out
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="gpt2-masked", diagnose=False)
    trainer = make_trainer(tmp_path, tiny_gpt2(), TokenData(), PlantingCollator("masked", at=(2, 3)),
                           callback=callback)
    error = caught(trainer)
    assert (error.step, error.category) == (2, "loss")
    finding = next(f for f in load_bundle(error.bundle_path).findings() if f["key"] == "micro_batches")
    assert [row["bad"] for row in finding["record"]["rows"]] == [True, True]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-m", "nanscan", "replay", str(error.bundle_path), "--runs", "2",
                           "--no-bisect", "--json"], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    result = json.loads(done.stdout)
    assert result["reproduced"] and result["verdict"] == "persistent"
    assert result["runs"][0]["category"] == "loss"
    assert result["localization"]["module_type"] == "GPT2LMHeadModel"  # the model's own loss makes the NaN


def test_stop_skips_the_bad_update_and_ends_training_cleanly(tmp_path):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="stop", on_invalid="stop")
    model = tiny_vit()
    trainer = make_trainer(tmp_path, model, ImageData(), PlantingCollator("nan", at=(2,)), callback=callback,
                           steps=5)
    with pytest.warns(nanscan.NonFiniteWarning):
        trainer.train()
    assert trainer.state.global_step == 2  # step 1 was the bad one: skipped, then training stopped
    assert callback.monitor.bundle_path is not None and callback.monitor.first_invalid_step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    last = [log for log in trainer.state.log_history if "nanscan/skipped_steps" in log][-1]
    assert last["nanscan/skipped_steps"] == 1 and last["nanscan/nonfinite_steps"] == 1


def test_rollback_goes_back_to_the_window_and_training_goes_on(tmp_path):
    """on_invalid=Rollback(skip="window") (nanscan.runtime.rollback NOTE: [rollback]): the NaN micro-batch's step is
    rolled back to the window's state and training runs all its steps, finite, with the rollback in the run's record
    (the default would skip the bad step alone)."""
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="rollback",
                               on_invalid=nanscan.Rollback(skip="window"))
    model = tiny_vit()
    trainer = make_trainer(tmp_path, model, ImageData(), PlantingCollator("nan", at=(2,)), callback=callback,
                           steps=5)
    with pytest.warns(nanscan.RollbackWarning, match="rolled back: back to step 1's start"):
        trainer.train()
    assert trainer.state.global_step == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (entry,) = json.loads((tmp_path / "bundles" / "rollback" / "rollbacks.json").read_text())["rollbacks"]
    # the Trainer counts steps from 1: the window kept step 1's start, the NaN came at step 2
    assert (entry["at_step"], entry["restored_step"], entry["skipped_steps"]) == (2, 1, [1, 2])
    assert entry["outcome"] == {"status": "pending", "finite_steps": 3}
    last = [log for log in trainer.state.log_history if "nanscan/skipped_steps" in log][-1]
    assert last["nanscan/skipped_steps"] == 1


@pytest.mark.parametrize("trainer_class", [transformers.Trainer, OwnLossTrainer], ids=["model-loss", "own-loss"])
def test_with_no_step_fn_the_incident_is_rerun_in_the_process_and_names_the_module(tmp_path, trainer_class):
    """The callback's default step_fn (issue 61 item 3): the Trainer's own loss over the recorded micro-batches (a
    compute_loss override, as TRL's SFTTrainer's, through trainer.compute_loss), so that the Monitor reruns the
    failing step in the process and names the module with no code of the user's."""
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="gpt2-mlp", diagnose=False)
    trainer = make_trainer(tmp_path, tiny_gpt2(), TokenData(), PlantingCollator(), callback=callback,
                           extra=[BlowUpMlp(1)], trainer_class=trainer_class)
    error = caught(trainer)
    assert error.step == 2 and error.category in ("loss", "gradient"), (error.step, error.category)
    rerun = callback.monitor.rerun
    assert rerun is not None and rerun.reproduced, rerun.headline() if rerun else None
    assert rerun.step_fn.endswith("step" if trainer_class is transformers.Trainer else "trainer_loss"), rerun.step_fn
    assert "transformer.h.0.mlp" in rerun.headline() and "rerun in process: reproduced" in str(error)
    finding = next(f for f in load_bundle(error.bundle_path).findings() if f["key"] == "rerun")
    assert finding["record"]["verdict"] == "reproduced"


def test_a_custom_compute_loss_makes_replay_ask_for_an_entry(tmp_path):
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="custom")
    trainer = make_trainer(tmp_path, tiny_vit(), ImageData(), PlantingCollator("nan", at=(0,)), callback=callback,
                           trainer_class=OwnLossTrainer)
    error = caught(trainer)
    with pytest.raises(EntryError, match=r"OwnLossTrainer overrides compute_loss.*--entry"):
        replay(error.bundle_path, runs=1)


@pytest.mark.cuda
@pytest.mark.skipif(not accepts_scaler, reason="Monitor(scaler=) not in this build")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Trainer has a GradScaler for fp16 only on a GPU")
def test_fp16_overflow_skips_are_expected_not_incidents(tmp_path):
    class Overflow(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                callback.monitor.scaler.update(new_scale=2.0 ** 60)

    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="fp16")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                          max_steps=3, fp16=True, report_to=[], logging_steps=1,
                                          save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(),
                                   data_collator=PlantingCollator(), callbacks=[callback, Overflow()])
    trainer.train()
    assert not (tmp_path / "bundles").exists()
    assert trainer.state.log_history[-2]["nanscan/skipped_steps"] >= 1


def test_in_async_mode_the_verdict_one_step_later_still_names_the_step_and_its_micro_batch(tmp_path):
    # mode="async" (the GPU default) runs on the CPU too: step 2's verdict is read at step 3's check
    callback = NanscanCallback(bundle_dir=tmp_path / "bundles", run_id="async", mode="async")
    trainer = make_trainer(tmp_path, tiny_vit(), ImageData(), PlantingCollator("nan", at=(5,)), callback=callback,
                           steps=5)
    error = caught(trainer)
    assert (error.step, error.category) == (3, "input")
    assert trainer.state.global_step == 3  # raised at the next step's check
    finding = next(f for f in load_bundle(error.bundle_path).findings() if f["key"] == "micro_batches")
    assert finding["record"]["first_bad"] == 1
