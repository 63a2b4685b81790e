"""The Monitor over torch.compile'd models (a module without __len__, as most are): `Monitor(torch.compile(model))`
and `model.compile()` both work with fullgraph=True (no hook of nanscan's inside a compiled region, so no graph
break), under the eager and inductor backends, and a planted NaN is caught at its step with the plain model's
names."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import nanscan


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.out = nn.Linear(12, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def _train(model, call, optimizer, monitor, *, begin: bool) -> nanscan.NonFiniteError:
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(8, 6, generator=g)
        if step == 2:
            x[3, 1] = float("nan")
        if begin:
            monitor.begin_step()
        optimizer.zero_grad()
        call(x).pow(2).mean().backward()
        try:
            monitor.check(batch={"x": x}, loss=None, step=step)
        except nanscan.NonFiniteError as exc:
            return exc
        optimizer.step()
    raise AssertionError("no NonFiniteError")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.skipif(
    os.environ.get("NANSCAN_BACKEND") == "numba", reason="compiling does not depend on the scan backend: the "
    "native pass runs inductor (a minute of C++ compiling) once"))])
@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_is_monitored_without_graph_breaks(tmp_path, backend, how):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    if how == "model.compile()":
        model.compile(backend=backend, fullgraph=True)
        target = call = model
    else:
        target = call = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = nanscan.Monitor(target, optimizer, bundle_dir=tmp_path, run_id="c", snapshot="cpu")
    # in place, the model's own forward is the compiled region: the loop marks the step's start itself
    error = _train(model, call, optimizer, monitor, begin=how == "model.compile()")
    assert (error.step, error.category) == (2, "input")
    bundle = nanscan.load_bundle(error.bundle_path)
    assert bundle.manifest["state"]["pre_step"] is True
    assert bundle.manifest["rng"]["captured_at"] == "step_start"
    assert sorted(bundle.state()[0]) == ["inp.bias", "inp.weight", "out.bias", "out.weight"]
    assert all(not name.startswith("_orig_mod") for name in bundle.state()[0])
