"""The trainers' second pass, against the real transformers, Lightning and accelerate: the step start (snapshot,
RNG, precision) comes from the trainer even when training_step calls a submodule; HF bf16 records its autocast; a
huge but finite input (3.4e38) is named as the cause by the Monitor, the micro-batch finding and replay; sample ids
flow through both callbacks and bisection names micro-batch, row and id; a subset replay recounts
num_items_in_batch; the HF bundle's step is the one the Trainer logs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")

import nanscan  # noqa: E402
from nanscan.replay.ablate import ablate  # noqa: E402
from nanscan.bundle import load_bundle  # noqa: E402
from nanscan.integrations.lightning import NanscanCallback as LightningCallback  # noqa: E402
from nanscan.integrations.rebuild import NUM_ITEMS, select_rows  # noqa: E402
from nanscan.integrations.transformers import NanscanCallback as HFCallback  # noqa: E402
from nanscan.replay.reproduce import replay  # noqa: E402

from integration_models import (DictRegressor, Generated, PlantingCollator, TinyRegressor, image_row,  # noqa: E402
                                regression_dicts, regression_rows, tiny_gpt2, tiny_vit, TokenData)

HUGE = 3.4e38  # float32's largest value, a common missing-value sentinel


def fit(module, data, callback, *, precision="32-true", steps=4, batch_size=4, collate=None):
    trainer = pl.Trainer(max_steps=steps, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback], precision=precision)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=collate))
    return trainer


def hf_trainer(tmp_path, model, data, collator, callback, **args):
    options = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                   max_steps=3, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
                   dataloader_num_workers=0, learning_rate=1e-3)
    options.update(args)
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**options), train_dataset=data,
                                data_collator=collator, callbacks=[callback])


# -- the step start -------------------------------------------------------------------------------------------------

def test_a_training_step_calling_self_net_gets_its_snapshot_and_precision(tmp_path):
    """TinyRegressor.training_step calls self.net(...), never the module itself: the step start comes from
    on_train_batch_start, the autocast from the bf16-mixed precision plugin."""
    callback = LightningCallback(bundle_dir=tmp_path / "b", run_id="net", snapshot="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanscan.SnapshotWarning)
        with pytest.raises(nanscan.NonFiniteError) as info:
            fit(TinyRegressor(), regression_rows(nan_rows=(22,)), callback, precision="bf16-mixed")
    bundle = load_bundle(info.value.bundle_path)
    assert bundle.manifest["state"]["pre_step"] is True
    assert bundle.manifest["rng"]["captured_at"] == "step_start"
    assert bundle.manifest["mixed_precision"]["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    assert "Mixed precision" in (Path(info.value.bundle_path) / "INCIDENT.md").read_text()
    result = ablate(info.value.bundle_path, factors=["bf16-autocast", "fp32"], holdout=0)
    notes = [n for row in result.rows for n in row.outcome.notes]
    assert not any("sets its own autocast" in n for n in notes), notes


def test_a_check_without_a_step_start_warns_at_the_first_step(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    mon = nanscan.Monitor(model, bundle_dir=tmp_path, snapshot="cpu")
    model[0](torch.randn(2, 3)).sum().backward()  # a submodule only: the model's own forward never runs
    with pytest.warns(nanscan.SnapshotWarning, match="no step start was seen before the check of step 0"):
        mon.check()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanscan.SnapshotWarning)
        mon.check()  # once per Monitor
        mon.begin_step()
        mon.check()


def test_hf_bf16_gets_a_mixed_precision_section(tmp_path):
    callback = HFCallback(bundle_dir=tmp_path / "b", run_id="bf16")
    trainer = hf_trainer(tmp_path, tiny_vit(), Generated(image_row, 32), PlantingCollator("nan", at=(3,)), callback,
                         bf16=True)
    with pytest.raises(nanscan.NonFiniteError) as info:
        trainer.train()
    bundle = load_bundle(info.value.bundle_path)
    assert bundle.manifest["mixed_precision"]["autocast"]["dtype"] == "bfloat16"
    assert "## " in (Path(info.value.bundle_path) / "INCIDENT.md").read_text()
    assert "Mixed precision" in (Path(info.value.bundle_path) / "INCIDENT.md").read_text()


# -- a huge but finite input ----------------------------------------------------------------------------------------

class HugeCollator(PlantingCollator):
    """Stacks image items; at call `at` puts 3.4e38 (finite) into one pixel of row 1."""

    def __call__(self, items):
        batch = {k: torch.stack([item[k] for item in items]) for k in items[0]}
        if self.calls in self.at:
            batch["pixel_values"][1, 0, 0, 0] = HUGE
        self.calls += 1
        return batch


def test_a_huge_finite_input_is_named_as_the_cause_everywhere(tmp_path):
    callback = HFCallback(bundle_dir=tmp_path / "b", run_id="huge")
    trainer = hf_trainer(tmp_path, tiny_vit(), Generated(image_row, 32), HugeCollator(at=(3,)), callback)
    with pytest.raises(nanscan.NonFiniteError) as info:
        trainer.train()
    error = info.value
    assert (error.step, error.category) == (2, "input")
    assert error.tensors == ["input:micro_batches.1.pixel_values"]
    assert "finite inputs beyond the step's range" in str(error)
    bundle = load_bundle(error.bundle_path)
    assert bundle.manifest["reason"] == "input_overflow"
    finding = next(f for f in bundle.findings() if f["key"] == "micro_batches")
    assert finding["record"]["first_bad"] == 1
    assert "micro-batch 1 of 2 held finite inputs beyond the step's range" in finding["title"]
    text = (Path(error.bundle_path) / "INCIDENT.md").read_text()
    assert "largest |x| 3.4e+38" in text and "`nanscan data` flags the same values" in text
    result = replay(error.bundle_path, runs=1, bisect=False)
    assert result.reproduced and result.failing_run.category == "input"
    assert any("likely cause" in n and "3.4e+38" in n for n in result.failing_run.notes)


# -- sample ids and subsets -----------------------------------------------------------------------------------------

def test_sample_ids_flow_through_the_lightning_callback(tmp_path):
    callback = LightningCallback(bundle_dir=tmp_path / "b", run_id="ids", sample_id_field="id")
    with pytest.raises(nanscan.NonFiniteError) as info:
        fit(DictRegressor(), regression_dicts(nan_rows=(22,)), callback)
    bundle = load_bundle(info.value.bundle_path)
    assert bundle.sample_ids[:2] == [{"micro_batch": 0, "row": 0, "id": 16}, {"micro_batch": 0, "row": 1, "id": 17}]
    result = replay(info.value.bundle_path, runs=2)
    assert result.bisect.sample_ids == [{"micro_batch": 1, "row": 2, "id": 22}]


class WithIds(torch.utils.data.Dataset):
    def __init__(self, size: int = 32):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {**image_row(torch.Generator().manual_seed(i)), "id": torch.tensor(1000 + i)}


def test_sample_ids_flow_through_the_hf_callback_without_reaching_the_model(tmp_path):
    callback = HFCallback(bundle_dir=tmp_path / "b", run_id="ids", sample_id_field="id")
    trainer = hf_trainer(tmp_path, tiny_vit(), WithIds(), PlantingCollator("nan", at=(3,)), callback,
                         remove_unused_columns=False)
    with pytest.raises(nanscan.NonFiniteError) as info:
        trainer.train()
    bundle = load_bundle(info.value.bundle_path)
    assert all("id" not in mb for mb in bundle.batch(nested=True)["micro_batches"])
    ids = bundle.sample_ids  # the Trainer shuffles: the ids say which dataset items the step held
    assert [(s["micro_batch"], s["row"]) for s in ids] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(1000 <= s["id"] < 1032 for s in ids)
    result = replay(info.value.bundle_path, runs=2)
    assert result.bisect.sample_ids == [ids[3]]  # PlantingCollator's row 1 of the step's second micro-batch


def test_a_subset_recounts_num_items_in_batch():
    labels = [torch.tensor([[1, 2, -100, 4], [5, -100, -100, -100]]), torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])]
    shifted_total = sum(int(lab[..., 1:].ne(-100).sum()) for lab in labels)  # 2 + 0 + 3 + 3
    micro = [{"input_ids": lab.clamp(min=0), "labels": lab, NUM_ITEMS: torch.tensor(shifted_total)} for lab in labels]
    subset = select_rows({"micro_batches": micro}, [0, 3])  # row 0 of micro-batch 0, row 1 of micro-batch 1
    kept = subset["micro_batches"]
    assert [mb["labels"].tolist() for mb in kept] == [[[1, 2, -100, 4]], [[5, 6, 7, 8]]]
    assert [int(mb[NUM_ITEMS]) for mb in kept] == [2 + 3, 2 + 3]
    only_second = select_rows({"micro_batches": micro, "batch_indices": [4, 5]}, [2])
    assert len(only_second["micro_batches"]) == 1 and only_second["batch_indices"] == [5]
    assert int(only_second["micro_batches"][0][NUM_ITEMS]) == 3


# -- step numbers ---------------------------------------------------------------------------------------------------

def test_the_hf_bundle_step_is_the_one_the_trainer_logs(tmp_path):
    callback = HFCallback(bundle_dir=tmp_path / "b", run_id="steps", on_invalid="stop")
    trainer = hf_trainer(tmp_path, tiny_gpt2(), TokenData(), PlantingCollator("masked", at=(2, 3)), callback,
                         max_steps=4)
    trainer.train()
    bad = [log for log in trainer.state.log_history if log.get("nanscan/nonfinite_tensors")]
    assert bad, trainer.state.log_history
    assert bad[0]["step"] == callback.monitor.first_invalid_step == 2
    assert Path(callback.monitor.bundle_path).name == "step-2"
