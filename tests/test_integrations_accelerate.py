"""nanscan.integrations.accelerate.monitor in a hand-written accelerate loop (CPU, gradient_accumulation_steps=2):
one check per optimizer step with all its micro-batches, the right step and micro-batch, zero-config replay of a
transformers model called as model(**batch), and the reason replay gives when the loop's loss is its own."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import nanscan  # noqa: E402
from nanscan.entry import EntryError  # noqa: E402
from nanscan.integrations.accelerate import monitor  # noqa: E402
from nanscan.replay.reproduce import replay  # noqa: E402

from integration_models import ImageData, PlantingCollator, tiny_vit  # noqa: E402


def run(tmp_path, collator, *, steps=4, loss_of=lambda out, batch: out.loss, **options):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_vit()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(ImageData(4 * steps), batch_size=2, collate_fn=collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with monitor(accelerator, model, optimizer, bundle_dir=tmp_path / "bundles", run_id="loop", **options) as mon:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_of(model(**batch), batch)
                accelerator.backward(loss)
                mon.check(batch=batch, loss=loss)
                optimizer.step()
                optimizer.zero_grad()
    return mon


def test_a_clean_loop_checks_once_per_optimizer_step(tmp_path):
    mon = run(tmp_path, PlantingCollator())
    assert not (tmp_path / "bundles").exists()
    assert mon.monitor.step == 4 and mon.numbers()["nanscan/nonfinite_steps"] == 0


def test_a_nan_in_one_micro_batch_is_caught_and_replayed_without_an_entry(tmp_path):
    with pytest.raises(nanscan.NonFiniteError) as info:
        run(tmp_path, PlantingCollator("nan", at=(3,)))
    error = info.value
    assert (error.step, error.category, error.tensors) == (1, "input", ["input:micro_batches.1.pixel_values"])
    result = replay(error.bundle_path, runs=2, bisect=False)
    assert result.reproduced and result.verdict == "persistent" and result.failing_run.category == "input"


def test_a_loss_of_the_loops_own_makes_replay_ask_for_an_entry(tmp_path):
    def own(out, batch):
        return torch.nn.functional.cross_entropy(out.logits, batch["labels"])

    with pytest.raises(nanscan.NonFiniteError) as info:
        run(tmp_path, PlantingCollator("nan", at=(0,)), loss_of=own)
    with pytest.raises(EntryError, match=r"the loss given to check\(\) is not the `loss` the model returned.*--entry"):
        replay(info.value.bundle_path, runs=1)


def test_stop_skips_the_update_and_asks_the_loop_to_end(tmp_path):
    with pytest.warns(nanscan.NonFiniteWarning):
        mon = run(tmp_path, PlantingCollator("nan", at=(2,)), on_invalid="stop")
    assert mon.stop_requested and mon.monitor.first_invalid_step == 1
    assert mon.numbers()["nanscan/skipped_steps"] == 1
