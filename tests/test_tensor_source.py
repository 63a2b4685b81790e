"""Monitor(source=...) (nanscan.engine.plans NOTE: [tensor source]): a source that keeps a model's tensors outside its
parameters, here named views into one flat buffer, is scanned in place of the module's own, a NaN in the buffer is
named by the view that holds it, and the bundle stores the source's state."""

from __future__ import annotations

import pytest
import torch

from nanscan import Monitor, NonFiniteError, load_bundle
from nanscan.incident import tensor_name
from nanscan.engine.inputs import ScanInputs, prepare
from nanscan.engine.plans import as_step_inputs


class FlatSource:
    """Gradients kept in one flat buffer, as views per parameter (the way ZeRO keeps its partitions)."""

    def __init__(self, model: torch.nn.Module):
        self.names = [name for name, _ in model.named_parameters()]
        sizes = [p.numel() for p in model.parameters()]
        self.flat = torch.zeros(sum(sizes))
        self.views = list(torch.split(self.flat, sizes))
        self.rebuilds = 0
        self.no_gradients = False

    def inputs(self, model, optimizer, *, extra=()):
        self.rebuilds += 1
        items = list(as_step_inputs(extra).items())
        items += [prepare(tensor_name("gradient", f"{n}@flat"), v) for n, v in zip(self.names, self.views)]
        return ScanInputs(items)

    def scan_on_host(self, model, optimizer, *, extra, backend_for, carried=None):
        return None

    def stable_tensors(self):
        return []

    def state(self, model, optimizer):
        return {"flat": self.flat}, None


def test_a_nan_in_the_sources_buffer_is_named_by_its_view_and_its_state_is_bundled(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    source = FlatSource(model)
    mon = Monitor(model, source=source, bundle_dir=tmp_path, process_group=False)
    report = mon.check(loss=torch.tensor(1.0))
    assert report.ok and [n for n in report.names if n.startswith("grad:")] == [
        "grad:0.weight@flat", "grad:0.bias@flat", "grad:1.weight@flat", "grad:1.bias@flat"]
    assert not any(n.startswith("param:") for n in report.names)  # the module's own tensors are not the source's
    source.flat[12 + 2] = float("nan")  # 0.weight has 12 elements: this one is 0.bias's third
    with pytest.raises(NonFiniteError) as caught:
        mon.check(loss=torch.tensor(1.0))
    assert caught.value.category == "gradient" and caught.value.tensors == ["grad:0.bias@flat"]
    model_state, _ = load_bundle(caught.value.bundle_path).state()
    assert torch.isnan(model_state["flat"][14]) and model_state["flat"].numel() == 26
