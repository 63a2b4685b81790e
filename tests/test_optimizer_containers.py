"""An optimizer that comes in a container (issue 61 item 6: no silent gaps): torchtitan's real OptimizersContainer, a
torch.optim.Optimizer whose own state stays empty while its inner optimizers hold the state and the learning rates.
Given to a Monitor, the one inner optimizer of a single model part is checked (its state scanned, its learning rate
recorded, its hooks firing inside the container's step); a container of several is refused, naming the fix."""

from __future__ import annotations

import pytest
import torch

optimizer_module = pytest.importorskip("torchtitan.components.optimizer",
                                       reason="torchtitan is not installed (make install puts it in the venv)")

from nanscan import Monitor  # noqa: E402

OptimizersContainer, ParamGroupConfig = optimizer_module.OptimizersContainer, optimizer_module.ParamGroupConfig


def _container(parts: list[torch.nn.Module], names: tuple[str, ...] = ("AdamW",)) -> OptimizersContainer:
    groups = [ParamGroupConfig(pattern=r"\.bias$", optimizer_name=names[-1], optimizer_kwargs={"lr": 2e-3})] \
        if len(names) > 1 else []
    groups.append(ParamGroupConfig(pattern=".*", optimizer_name=names[0], optimizer_kwargs={"lr": 1e-3}))
    config = OptimizersContainer.Config(param_groups=groups, implementation="for-loop")
    return OptimizersContainer(config, model_parts=parts)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_the_inner_optimizer_of_one_model_part_is_checked(tmp_path):
    model = _model()
    container = _container([model])
    assert not container.state and len(container.optimizers) == 1  # the container itself holds nothing
    mon = Monitor(model, container, bundle_dir=tmp_path, window=None)
    assert mon.optimizer is container.optimizers[0]
    names = []
    for step in range(3):
        container.zero_grad()
        loss = model(torch.randn(5, 4)).pow(2).mean()
        loss.backward()
        report = mon.check(loss=loss)
        names.append(sum(name.startswith("optim:") for name in report.names))
        container.step()
    mon.close()
    parameters = len(list(model.parameters()))
    assert names == [0, 3 * parameters, 3 * parameters]  # AdamW's exp_avg, exp_avg_sq and step from its first update
    assert [entry.lr for entry in mon.history] == [1e-3] * 3


def test_a_container_of_several_optimizers_is_refused_with_the_fix(tmp_path):
    parts = [_model(), _model()]  # two model parts (pipeline stages)
    container = _container(parts)
    with pytest.raises(TypeError, match=r"OptimizersContainer of 2 optimizers .*optimizers\[i\]"):
        Monitor(parts[0], container, bundle_dir=tmp_path)
