"""Checks made at the right moment: under the HF Trainer the check runs before the Trainer's gradient clipping (a
clip over one NaN gradient makes them all NaN), so the first bad tensor is the planted one; a check that sees no
gradient where the model trains warns once, naming the likely order mistake."""

from __future__ import annotations

import warnings

import pytest
import torch

import nanscan


def test_a_check_after_zero_grad_warns_once(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nanscan.Monitor(model, optimizer, bundle_dir=tmp_path)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.zero_grad(set_to_none=True)  # the wrong order: the gradients are gone before the check
    with pytest.warns(nanscan.GradientWarning, match="saw no gradient.*after loss.backward"):
        mon.check()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanscan.GradientWarning)
        mon.check()  # once
        frozen = torch.nn.Linear(3, 2).requires_grad_(False)
        nanscan.Monitor(frozen, bundle_dir=tmp_path).check()  # nothing trains: nothing to miss
        model(torch.randn(4, 3)).sum().backward()
        nanscan.Monitor(model, optimizer, bundle_dir=tmp_path).check()


def test_the_hf_check_comes_before_the_trainers_clipping(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nanscan.integrations.transformers import NanscanCallback  # noqa: PLC0415

    from integration_models import Generated, PlantingCollator, image_row, tiny_vit  # noqa: PLC0415

    model = tiny_vit()
    name = "classifier.weight"
    param = dict(model.named_parameters())[name]
    calls = {"n": 0}

    def poison(grad):  # one NaN element in one gradient, at the second optimizer step's last micro-batch
        calls["n"] += 1
        if calls["n"] == 4:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        return grad

    param.register_hook(poison)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        max_grad_norm=1.0)
    callback = NanscanCallback(bundle_dir=tmp_path / "b", run_id="clip")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Generated(image_row, 32),
                                   data_collator=PlantingCollator(), callbacks=[callback])
    with pytest.raises(nanscan.NonFiniteError) as info:
        trainer.train()
    assert (info.value.step, info.value.category) == (2, "gradient")
    assert info.value.tensors == [f"grad:{name}"]  # not every gradient, as after a clip over the NaN
    assert "clip_grad_norm_" not in trainer.accelerator.__dict__  # the wrapper is gone with the run
