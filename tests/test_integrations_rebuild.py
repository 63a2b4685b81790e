"""The framework-free parts of the integrations: importing nanscan imports no framework, the recipe's reasons
for a step that cannot be rebuilt (a class replay cannot import, parameters outside the model, no recipe), and
the Trainer's loss normalisation under gradient accumulation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nanscan.entry import EntryError
from nanscan.integrations.rebuild import (RECIPE_KEY, optimizer_recipe, pretrained_model, replay_entry, step_loss,
                                          trainer_divisor, unimportable)

FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")


def test_importing_nanscan_and_its_integrations_package_imports_no_framework():
    code = ("import sys, nanscan, nanscan.integrations, nanscan.integrations.rebuild, nanscan.integrations.session; "
            f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_class_replay_cannot_import_is_named_with_the_reason():
    class Local(torch.nn.Module):
        pass

    assert "defined inside a function" in unimportable(Local)
    Main = type("Main", (torch.nn.Module,), {"__module__": "__main__"})
    assert "defined in the script being run (__main__)" in unimportable(Main)
    assert unimportable(torch.nn.Linear) is None
    assert pretrained_model(torch.nn.Linear(2, 2)) == {
        "unavailable": "Linear has no config with to_dict(), so it cannot be rebuilt from one"}


def test_the_optimizer_recipe_names_groups_by_parameter_and_refuses_outsiders():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.1},
                                   {"params": model[1].parameters(), "weight_decay": 0.0}], lr=0.01)
    recipe = optimizer_recipe(optimizer, model)
    assert recipe["class"] == "torch.optim.adamw:AdamW"
    assert [g["params"] for g in recipe["groups"]] == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    assert [g["settings"]["lr"] for g in recipe["groups"]] == [0.1, 0.01]
    extra = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert "1 parameter(s) outside the model" in optimizer_recipe(extra, model)["unavailable"]


def test_replay_entry_says_what_is_missing_and_what_to_pass():
    with pytest.raises(EntryError, match=f"no '{RECIPE_KEY}' recipe.*--entry"):
        replay_entry({"lr": 0.1})
    recipe = {"model": {"unavailable": "X is defined inside a function"}, "optimizer": {"class": "a:b", "groups": []},
              "step": {"unavailable": "MyTrainer overrides compute_loss"}}
    with pytest.raises(EntryError, match=r"model: X is defined inside a function; step: MyTrainer overrides "
                                         r"compute_loss\): pass --entry"):
        replay_entry({RECIPE_KEY: recipe})


def test_the_trainers_normalisation_under_accumulation():
    losses = [torch.tensor(2.0), torch.tensor(4.0)]
    assert trainer_divisor([{"x": 1}, {"x": 2}], None) == 2  # a per-micro-batch mean: divided by their count
    assert trainer_divisor([{"num_items_in_batch": 5}] * 2, None) == 1  # normalised over the step by the model
    assert trainer_divisor([{"num_items_in_batch": 5}] * 2, False) == 2  # Trainer.loss_is_scaled_for_ga decides
    assert step_loss(losses, divide_by=2).item() == 3.0 and step_loss(losses, divide_by=1).item() == 6.0
