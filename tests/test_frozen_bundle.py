"""A bundle holds frozen weights by reference (nanscan.bundle.frozen NOTE: [frozen references]): their dtype, shape
and sha256, not their bytes, unless asked or non-finite; replay takes them from the entry's model after checking
them, and says which ones differ or cannot be checked."""

from __future__ import annotations

import json

import pytest
import replay_entries as E
import torch
from torch import nn

from nanscan.bundle import BundleError, load_bundle
from nanscan.bundle.format import MANIFEST, STATE
from nanscan.bundle.frozen import tensor_sha256
from nanscan.runtime.monitor import Monitor, NonFiniteError
from nanscan.replay import Replayer
from nanscan.replay.export import export_regression
from nanscan.replay.step import ReplayError
from nanscan.testing import load_regression_case


def test_a_bundle_holds_frozen_weights_by_digest(tmp_path):
    path = E.train("frozen_base", tmp_path)
    bundle = load_bundle(path)
    spec = E.frozen_base({})  # the run's model as its entry builds it: the same base
    references = bundle.frozen_references()
    assert references == {"base.weight": {"dtype": "float32", "shape": [4, 4],
                                          "sha256": tensor_sha256(spec.model.base.weight)}}
    model_state, _ = bundle.state()
    assert "base.weight" not in model_state and "top.lin1.weight" in model_state
    copied = load_bundle(E.train("frozen_base", tmp_path / "copy", frozen_weights="copy"))
    assert copied.frozen_references() == {}
    assert torch.equal(copied.state()[0]["base.weight"], spec.model.base.weight)
    assert (path / STATE).stat().st_size < (copied.path / STATE).stat().st_size
    assert "1 frozen weight(s) by sha256 only" in bundle.incident_text()
    assert "frozen weight" not in copied.incident_text()


def test_replay_takes_frozen_weights_from_the_entry_after_checking_them(tmp_path):
    replayer = Replayer(E.train("frozen_base", tmp_path))
    outcome = replayer.run()
    assert not outcome.finite  # the failure comes back on the entry's base
    assert any(note.startswith("frozen: 1 frozen tensor(s)") for note in replayer.notes)
    assert torch.equal(replayer.model_state["base.weight"], E.frozen_base({}).model.base.weight)
    assert not replayer.run().finite  # a second run loads them from the completed state


def test_an_exported_regression_case_holds_the_checked_frozen_weights(tmp_path):
    result = export_regression(E.train("frozen_base", tmp_path / "b"), tmp_path / "case", with_state=True)
    case = load_regression_case(result.case_dir)
    assert torch.equal(case.model_state["base.weight"], E.frozen_base({}).model.base.weight)


def test_replay_says_which_frozen_weights_differ(tmp_path):
    replayer = Replayer(E.train("frozen_base", tmp_path), entry=f"{E.MODULE}:frozen_base_elsewhere")
    with pytest.raises(ReplayError, match=r"frozen tensor\(s\) base.weight of the model built by .* differ from the "
                                          r"run's .*frozen_weights='copy'"):
        replayer.run()


def test_replay_says_when_it_cannot_check_frozen_weights(tmp_path):
    replayer = Replayer(E.train("frozen_base", tmp_path), entry=f"{E.MODULE}:sqrt_backward")  # no base at all
    with pytest.raises(ReplayError, match=r"cannot be checked against 1 of them \(base.weight\)"):
        replayer.run()


def test_a_non_finite_frozen_weight_is_stored_whole(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync", post_update=False)
    for i in range(4):
        if i == 3:
            model[1].weight.data[0, 0] = float("nan")
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(2, 4)
        loss = model(x).sum()
        loss.backward()
        try:
            mon.check(batch={"x": x}, loss=loss)
        except NonFiniteError as exc:
            bundle = load_bundle(exc.bundle_path)
            break
        optimizer.step()
    else:
        pytest.fail("the NaN in the frozen weight was not caught")
    assert set(bundle.frozen_references()) == {"0.weight", "0.bias", "1.bias"}
    stored = bundle.state()[0]["1.weight"]
    assert torch.isnan(stored[0, 0]) and torch.equal(stored.isnan().sum(), torch.tensor(1))
    assert "param:1.weight" in bundle.manifest["category_tensors"]


def test_a_reference_of_the_wrong_type_is_refused_on_loading(tmp_path):
    path = E.train("frozen_base", tmp_path)
    manifest = json.loads((path / MANIFEST).read_bytes())
    manifest["state"]["frozen"]["base.weight"]["sha256"] = "../state.safetensors"
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"state.frozen \(an object mapping each state key"):
        load_bundle(path)


def test_frozen_weights_option_is_checked(tmp_path):
    with pytest.raises(ValueError, match="frozen_weights='all'"):
        Monitor(nn.Linear(2, 2), bundle_dir=tmp_path, frozen_weights="all")
