"""Monitor behaviour: a planted fault per category is caught at the right step with the right tensors, the
on_invalid policies, the bounded history, pre-step snapshots and RNG capture, and the default Monitor behind
nanscan.check."""

from __future__ import annotations

import copy
import gc
import math
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nanscan
from nanscan import Monitor, NonFiniteError, NonFiniteWarning, load_bundle
from nanscan.incident import CATEGORIES, categorize
import nanscan.runtime.default as defaults
from nanscan.runtime.default import default_monitor

FAULT_STEP = 3


@pytest.fixture(autouse=True)
def _bundles_in_tmp(tmp_path, monkeypatch):
    # Monitors created without bundle_dir (and nanscan.check) must never write into the repository.
    monkeypatch.setenv("NANSCAN_BUNDLE_DIR", str(tmp_path / "env-bundles"))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def make_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(16, 4, generator=g), "y": torch.randn(16, 1, generator=g),
            "scale": torch.tensor(math.e), "ids": torch.arange(16) + 16 * step}


def plant(fault: str | None, model: nn.Module, optimizer, batch: dict) -> None:
    """Faults that exist before the forward pass of the step."""
    if fault == "input":
        batch["x"][3, 1] = float("nan")
    elif fault == "loss":
        batch["scale"] = torch.tensor(-1.0)  # finite input; log(-1) in the forward pass is NaN
    elif fault == "parameter":
        with torch.no_grad():
            model[0].weight[2, 1] = float("inf")
    elif fault == "optimizer_state":
        optimizer.state[model[2].weight]["exp_avg_sq"][0, 0] = float("nan")


def forward_backward(model: nn.Module, optimizer, step: int, fault: str | None = None):
    """One step of the regression loop up to the check: its batch (with `fault` planted), forward and backward.
    Returns (batch, loss)."""
    batch = make_batch(step)
    plant(fault, model, optimizer, batch)
    out = model(batch["x"])
    y = batch["y"]
    if fault == "gradient":
        # One row's target equals its prediction exactly: sqrt(0) is finite forward, its gradient is not.
        y = y.clone()
        y[0] = out[0].detach()
    loss = torch.sqrt((out - y) ** 2).mean() * torch.log(batch["scale"])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return batch, loss


def train(mon: Monitor, model, optimizer, steps: int, fault: str | None = None, fault_step: int = FAULT_STEP):
    """A small regression loop; returns the reports. A `fault` is planted at `fault_step`."""
    reports = []
    for step in range(steps):
        batch, loss = forward_backward(model, optimizer, step, fault if step == fault_step else None)
        report = mon.check(batch={k: batch[k] for k in ("x", "y", "scale")}, loss=loss,
                           sample_ids=batch["ids"])
        reports.append(report)
        if not report.ok:
            continue
        optimizer.step()
    return reports


EXPECTED_TENSORS = {
    "input": ["input:x"],
    "loss": ["loss"],
    "parameter": ["param:0.weight"],
    "optimizer_state": ["optim:2.weight.exp_avg_sq"],
    "gradient": ["grad:0.weight", "grad:0.bias", "grad:2.weight", "grad:2.bias"],
}


@pytest.mark.parametrize("fault", CATEGORIES)
def test_planted_fault_is_caught_with_category_and_tensors(fault, tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="run", config={"fault": fault})
    with pytest.raises(NonFiniteError) as caught:
        train(mon, model, optimizer, steps=6, fault=fault)
    err = caught.value
    assert (err.step, err.category, err.tensors) == (FAULT_STEP, fault, EXPECTED_TENSORS[fault])
    assert mon.first_invalid_step == FAULT_STEP
    assert err.bundle_path == mon.bundle_path == tmp_path / "run" / f"step-{FAULT_STEP}"
    assert str(err.bundle_path) in str(err)

    bundle = load_bundle(err.bundle_path)
    assert bundle.manifest["category"] == fault
    assert bundle.manifest["category_tensors"] == EXPECTED_TENSORS[fault]
    listed = {row["name"]: row for row in bundle.manifest["nonfinite_tensors"]}
    assert set(EXPECTED_TENSORS[fault]) <= set(listed)
    assert all(row["nan"] + row["posinf"] + row["neginf"] > 0 for row in listed.values())
    assert bundle.manifest["config"] == {"fault": fault}
    assert bundle.history()[-1].step == FAULT_STEP
    assert [e.report.ok for e in bundle.history()] == [True] * FAULT_STEP + [False]
    assert f"({fault})" in bundle.incident_text()


def test_categorize_order_puts_inputs_before_everything():
    report = nanscan.scan({"grad:w": torch.tensor([float("nan")]), "loss": torch.tensor(float("inf")),
                           "input:x": torch.tensor([float("nan")]), "param:w": torch.tensor([1.0])})
    assert categorize(report) == ("input", ["input:x"])
    assert categorize(nanscan.scan({"param:w": torch.ones(2)})) == (None, [])
    assert categorize(nanscan.scan({"w": torch.tensor([float("inf")])})) == ("other", ["w"])


def test_batch_paths_nested_and_integer_tensors_skipped(tmp_path):
    model = nn.Linear(2, 1)
    mon = Monitor(model, bundle_dir=tmp_path)
    batch = {"inputs": (torch.ones(3, 2), [torch.zeros(2)]), "tokens": torch.arange(3), "meta": "text"}
    report = mon.check(batch=batch, loss=0.5)
    assert report.names[:3] == ["input:inputs.0", "input:inputs.1.0", "loss"]
    assert "input:tokens" in report.skipped
    assert mon.history[-1].loss == 0.5
    bare = mon.check(batch=torch.ones(2, 2))
    assert bare.names[0] == "input:batch"
    # An empty top-level key names its tensor like a bare batch, as a nested empty key keeps its parent's path.
    unnamed = mon.check(batch={"": torch.ones(2), "x": {"": torch.ones(2)}})
    assert unnamed.names[:2] == ["input:batch", "input:x."]


def test_history_is_bounded_and_records_loss_lr_grad_norm(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, history=3)
    train(mon, model, optimizer, steps=8)
    assert [e.step for e in mon.history] == [5, 6, 7]
    assert mon.step == 8
    last = mon.history[-1]
    assert last.lr == 3e-3
    expected_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
    assert last.grad_norm == pytest.approx(expected_norm, rel=1e-9)
    assert math.isfinite(last.loss)
    assert last.report.records.shape == (len(last.report), 265)  # the last slot: the fingerprint (NOTE: [stats record])
    assert mon.first_invalid_step is None and mon.bundle_path is None


def test_warn_bundles_once_and_counts_later_steps(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="w", on_invalid="warn")
    with pytest.warns(NonFiniteWarning, match="step 3") as record:
        reports = train(mon, model, optimizer, steps=6, fault="parameter")
    assert len(record) == 1
    assert [r.ok for r in reports] == [True, True, True, False, False, False]  # the inf weight stays
    assert mon.first_invalid_step == 3 and mon.invalid_steps == 2
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["step-3"]


def test_skip_leaves_weights_and_optimizer_state_untouched(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, on_invalid="skip")
    train(mon, model, optimizer, steps=3)
    batch = make_batch(3)
    batch["x"][0, 0] = float("nan")
    model(batch["x"]).sum().backward()
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    with pytest.warns(NonFiniteWarning):
        report = mon.check(batch={"x": batch["x"]})
    assert not report.ok
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()  # a loop that forgets to `continue` still changes nothing: Adam skips grad-less params
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[0][key])
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], before[1]["state"][0]["exp_avg"])
    assert mon.bundle_path is not None and load_bundle(mon.bundle_path).category == "input"


def test_skip_also_leaves_parameters_the_optimizer_trains_outside_the_model_untouched(tmp_path):
    model = make_model()
    log_scale = nn.Parameter(torch.zeros(()))  # a loss weight kept beside the model, as uncertainty weighting does
    optimizer = torch.optim.SGD([*model.parameters(), log_scale], lr=0.1, momentum=0.9)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, on_invalid="skip")

    def backward(x):
        optimizer.zero_grad(set_to_none=True)
        (model(x).square().mean() * log_scale.exp()).backward()

    backward(make_batch(0)["x"])
    assert mon.check().ok
    optimizer.step()
    x = make_batch(1)["x"]
    x[2, 2] = float("nan")
    backward(x)
    assert torch.isnan(log_scale.grad)
    before = [t.detach().clone() for t in [*model.parameters(), log_scale]]
    momentum = optimizer.state[log_scale]["momentum_buffer"].clone()
    with pytest.warns(NonFiniteWarning, match="category input"):
        report = mon.check(batch={"x": x})
    assert not report.ok and log_scale.grad is None
    optimizer.step()
    assert all(torch.equal(t, b) for t, b in zip([*model.parameters(), log_scale], before))
    assert torch.equal(optimizer.state[log_scale]["momentum_buffer"], momentum)


def test_callable_policy_gets_report_and_first_bundle_every_time(tmp_path):
    calls = []
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, on_invalid=lambda report, path: calls.append((report, path)))
    train(mon, model, optimizer, steps=5, fault="parameter")
    assert [r.step for r, _ in calls] == [3, 4]
    assert all(path == mon.bundle_path for _, path in calls)
    assert calls[0][0].nonfinite[0] == "param:0.weight"


def test_raise_again_on_later_steps_names_first_bundle(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    mon = Monitor(model, optimizer, bundle_dir=tmp_path)
    with pytest.raises(NonFiniteError):
        train(mon, model, optimizer, steps=4, fault="parameter")
    model(make_batch(4)["x"]).sum().backward()
    with pytest.raises(NonFiniteError, match="first incident at step 3") as caught:
        mon.check()
    assert caught.value.step == 4 and caught.value.bundle_path == mon.bundle_path
    assert mon.invalid_steps == 1


@pytest.mark.parametrize("wrap", ["torch.compile", pytest.param("DataParallel", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a GPU, DataParallel moves the model there; this checks its CPU form"))])
def test_a_wrapped_model_is_scanned_and_stored_under_the_plain_models_names(wrap, tmp_path):
    """The bundle must load into the model that replay builds, which is not wrapped: a compiled model's own
    names all start with `_orig_mod.`, DataParallel's with `module.`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    wrapped = torch.compile(model, backend="eager") if wrap == "torch.compile" else nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(wrapped, optimizer, bundle_dir=tmp_path, on_invalid="warn", snapshot="cpu")
    x = torch.randn(8, 4)
    for step in range(3):
        step_start_rng = torch.get_rng_state()
        loss = wrapped(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == 2:
            model[2].weight.grad[0, 3] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteWarning)
            report = mon.check(batch={"x": x}, loss=loss)
        if report.ok:
            optimizer.step()
    assert report.nonfinite == ["grad:2.weight"] and mon.first_invalid_step == 2
    bundle = load_bundle(mon.bundle_path)
    model_state, _ = bundle.state()
    assert bundle.manifest["state"]["pre_step"] is True  # the snapshot was taken at the wrapped forward's start
    nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)).load_state_dict(model_state)
    assert set(bundle.manifest["rng"]["captured_at_by_source"].values()) == {"step_start"}
    assert torch.equal(bundle.rng_state()["torch_cpu"], step_start_rng)


@pytest.mark.parametrize("given", [np.int64(7), torch.tensor(7)], ids=["numpy", "tensor"])
def test_a_step_given_as_a_numpy_or_tensor_integer_still_gets_its_bundle(given, tmp_path):
    mon = Monitor(nn.Linear(2, 1), bundle_dir=tmp_path, run_id="r", on_invalid="warn")
    with pytest.warns(NonFiniteWarning):
        report = mon.check(loss=float("nan"), step=given)
    assert report.step == 7 and type(report.step) is int and mon.step == 8
    assert mon.bundle_error is None and mon.bundle_path == tmp_path / "r" / "step-7"
    assert load_bundle(mon.bundle_path).manifest["first_invalid_step"] == 7
    with pytest.raises(TypeError, match=r"step=2\.5: pass the step number as an int"):
        mon.check(step=2.5)


def test_a_check_that_cannot_read_its_batch_is_not_a_step(tmp_path):
    """It counts no step, and the step start it consumed is not passed off as the next step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    mon = Monitor(model, bundle_dir=tmp_path, on_invalid="warn")
    x = torch.randn(8, 4)
    model(x).sum().backward()
    with pytest.raises(nanscan.UnsupportedTensorError, match="'input:x8' has dtype float8_e8m0fnu"):
        mon.check(batch={"x8": torch.ones(2).to(torch.float8_e8m0fnu)})
    assert mon.step == 0 and not mon.history
    step_start_rng = torch.get_rng_state()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    model[0].weight.grad[1, 1] = float("nan")
    with pytest.warns(NonFiniteWarning):
        assert mon.check(batch={"x": x}).step == 0
    assert torch.equal(load_bundle(mon.bundle_path).rng_state()["torch_cpu"], step_start_rng)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("snapshot", ["cpu", "none"])
def test_snapshot_cpu_holds_exact_pre_step_state(snapshot, tmp_path):
    model = _bn_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, on_invalid="warn", snapshot=snapshot)
    for step in range(4):
        batch = make_batch(step)
        if step == 3:
            expected_model = copy.deepcopy(model.state_dict())
            expected_optim = copy.deepcopy(optimizer.state_dict())
            batch["x"][5, 2] = float("nan")  # the forward pass writes NaN into BatchNorm's running_mean
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteWarning)
            if mon.check(batch=batch, loss=loss).ok:
                optimizer.step()
    bundle = load_bundle(mon.bundle_path)
    model_state, optim_state = bundle.state()
    assert bundle.manifest["state"]["pre_step"] is (snapshot == "cpu")
    if snapshot == "cpu":  # exact mode takes every RNG at the step start
        assert set(bundle.manifest["rng"]["captured_at_by_source"].values()) == {"step_start"}
    assert torch.isnan(model.state_dict()["1.running_mean"]).any()
    if snapshot == "none":
        assert torch.isnan(model_state["1.running_mean"]).any()
        assert "snapshot='none'" in bundle.manifest["state"]["note"]
        return
    assert model_state.keys() == expected_model.keys()
    for key, value in expected_model.items():
        assert torch.equal(model_state[key], value), key
    assert optim_state["param_groups"] == expected_optim["param_groups"]
    for index, state in expected_optim["state"].items():
        for key, value in state.items():
            assert torch.equal(optim_state["state"][index][key], value), (index, key)
    fresh = _bn_model()
    fresh.load_state_dict(model_state)
    torch.optim.Adam(fresh.parameters()).load_state_dict(optim_state)


def test_snapshot_buffers_are_reused_between_steps(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, snapshot="cpu")
    train(mon, model, optimizer, steps=3)
    buffers = list(mon._snapshot._buffers)  # matched to the state's tensors by their order in it
    train(mon, model, optimizer, steps=2)
    assert buffers and len(mon._snapshot._buffers) == len(buffers)
    assert all(now.data_ptr() == b.data_ptr() for now, b in zip(mon._snapshot._buffers, buffers))


def test_rng_captured_at_step_start_replays_dropout(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    mon = Monitor(model, bundle_dir=tmp_path, on_invalid="warn")
    x = torch.randn(8, 4)
    for _ in range(2):
        out = model(x)
        out.sum().backward()
        if mon.step == 1:
            model[0].weight.grad[0, 0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NonFiniteWarning)
            mon.check(batch={"x": x})
    bundle = load_bundle(mon.bundle_path)
    assert bundle.manifest["rng"]["captured_at"] == "step_start"
    assert bundle.manifest["rng"]["captured_at_by_source"] == {"torch": "step_start", "numpy": "check",
                                                               "python": "check"}
    torch.manual_seed(12345)  # move the generator away, then restore it from the bundle
    bundle.restore_rng()
    assert torch.equal(model(bundle.batch()["x"]), out)


def test_rng_without_forward_is_marked_as_captured_at_check(tmp_path):
    model = nn.Linear(2, 1)
    mon = Monitor(model, bundle_dir=tmp_path, on_invalid="warn")
    with pytest.warns(NonFiniteWarning):
        mon.check(loss=float("nan"))
    assert load_bundle(mon.bundle_path).manifest["rng"]["captured_at"] == "check"


def test_bundle_write_failure_still_reports_the_nan(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the bundle directory should be")
    model = nn.Linear(2, 1)
    mon = Monitor(model, bundle_dir=blocker)
    with pytest.raises(NonFiniteError, match="could not be written") as caught:
        mon.check(loss=float("inf"))
    assert caught.value.bundle_path is None and mon.bundle_error is not None
    assert caught.value.category == "loss"


def test_nanscan_check_default_monitor_bundles_into_env_dir(tmp_path):
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    assert nanscan.check(model).ok
    model.weight.grad[1, 1] = float("inf")
    with pytest.warns(NonFiniteWarning, match="grad:weight"):
        report = nanscan.check(model)
    assert report.step == 1 and not report.ok
    assert report.names == ["param:weight", "param:bias", "grad:weight", "grad:bias"]
    assert nanscan.first_invalid(model) == 1
    bundles = list(nanscan.bundle.iter_bundles(tmp_path / "env-bundles"))
    assert len(bundles) == 1 and load_bundle(bundles[0]).category == "gradient"
    assert nanscan.check(model, step=10).step == 10 and default_monitor(model).step == 11


def test_default_monitor_does_not_keep_the_model_alive():
    model = nn.Linear(3, 2)
    nanscan.check(model)
    assert default_monitor(model, create=False) is not None
    before = len(defaults._default_monitors)
    del model
    gc.collect()
    assert len(defaults._default_monitors) == before - 1


def test_monitor_without_bundle_dir_uses_env(tmp_path):
    mon = Monitor(nn.Linear(2, 1), on_invalid="warn")
    assert mon.bundle_dir == tmp_path / "env-bundles"


@pytest.mark.parametrize("kwargs, match", [
    ({"on_invalid": "ignore"}, "on_invalid"),
    ({"snapshot": "gpu"}, "snapshot"),
    ({"run_id": "../escape"}, "run_id"),
    ({"history": 0}, "history"),
    ({"replay_entry": "no_colon"}, "replay_entry"),
    ({"config": {"lr": float("nan")}}, r"config\['lr'\]"),
    ({"config": {"fn": print}}, r"config\['fn'\]"),
])
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Monitor(nn.Linear(2, 1), **kwargs)


def test_model_with_monitor_still_pickles_and_copies(tmp_path):
    model = make_model()
    mon = Monitor(model, bundle_dir=tmp_path, snapshot="cpu")
    clone = pickle.loads(pickle.dumps(model))  # what torch.save(model) does with a whole module
    twin = copy.deepcopy(model)
    for other in (clone, twin):
        other(torch.ones(2, 4))
    assert mon._snapshot.model_state is None  # copies carry an inert hook: no capture for the original
    model(torch.ones(2, 4))
    assert mon._snapshot.model_state is not None
    mon.close()
    assert not model._forward_pre_hooks


def test_numpy_batches_read_only_and_unreadable(tmp_path):
    """A memory-mapped (read-only) array is read without torch's 'not writable' warning, since nothing writes it,
    and its NaN is caught; an array torch cannot read is refused with its path named."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="run", on_invalid="warn")
    features = np.ones((4, 3), dtype=np.float32)
    features[1, 2] = np.nan
    features.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torch warning would be an error here; the NaN's is expected below
        warnings.simplefilter("ignore", NonFiniteWarning)
        warnings.simplefilter("ignore", nanscan.GradientWarning)  # no backward here: only the batch is the point
        report = mon.check(batch={"features": features})
    assert report.nonfinite == ["input:features"] and report["input:features"].nan == 1
    with pytest.raises(nanscan.UnsupportedTensorError, match="'features'.*float128|'features'.*longdouble"):
        mon.check(batch={"features": np.ones(3, dtype=np.longdouble)})


class Float8Linear(nn.Module):
    """A linear layer whose frozen weight is stored in float8_e4m3fn (cast up for the matmul, as weight-only float8
    recipes do), with a float8 buffer beside it (the Monitor scans parameters, not buffers: it must pass it by)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("amax_history", torch.ones(4).to(torch.float8_e5m2))

    def forward(self, x):
        return x @ self.weight.float().t()


@pytest.mark.parametrize("snapshot", ["none", "cpu"])
def test_a_model_holding_float8_tensors_is_monitored_and_a_nan_in_one_is_caught(snapshot, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Float8Linear(torch.randn(1, 8)))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="run", snapshot=snapshot)
    for step in range(FAULT_STEP):
        batch, loss = forward_backward(model, optimizer, step)
        report = mon.check(batch={k: batch[k] for k in ("x", "y", "scale")}, loss=loss)
        assert report.ok
        assert report["param:2.weight"].dtype == "float8_e4m3fn" and report["param:2.weight"].numel == 8
        optimizer.step()
    with torch.no_grad():  # S.1111.111, the only NaN of e4m3fn (it has no infinity)
        model[2].weight.view(torch.uint8)[0, 5] = 0x7F
    batch, loss = forward_backward(model, optimizer, FAULT_STEP)
    with pytest.raises(NonFiniteError) as caught:
        mon.check(batch={k: batch[k] for k in ("x", "y", "scale")}, loss=loss)
    assert (caught.value.step, caught.value.category) == (FAULT_STEP, "parameter")
    assert "param:2.weight" in caught.value.tensors
    bundle = load_bundle(caught.value.bundle_path)
    listed = {row["name"]: row for row in bundle.manifest["nonfinite_tensors"]}
    assert listed["param:2.weight"]["nan"] == 1


def test_tensors_are_named_as_the_state_dict_names_them_under_activation_checkpointing(tmp_path):
    """torch's checkpoint_wrapper (torchtitan wraps each block in it) adds `_checkpoint_wrapped_module.` to the
    parameters' names and removes it from the state dict: the scan, the bundle's state and replay agree on the
    state dict's names (NOTE: [state dict names])."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    model = nn.Sequential(checkpoint_wrapper(block), nn.Linear(8, 1))
    assert "0._checkpoint_wrapped_module.0.weight" in dict(model.named_parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="ac", post_update=True)
    with pytest.raises(NonFiniteError) as err:
        for step in range(4):
            x = torch.randn(8, 4)
            optimizer.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            if step == 3:
                model[0]._checkpoint_wrapped_module[0].weight.grad[1, 2] = float("nan")
            mon.check(batch={"x": x})
            optimizer.step()
    assert err.value.tensors == ["grad:0.0.weight"]
    bundle = load_bundle(err.value.bundle_path)
    names = bundle.history()[-1].report.names
    assert not any("_wrapped_module" in n for n in names), names
    state, optimizer_state = bundle.state()
    assert {f"param:{k}" for k in state} == {n for n in names if n.startswith("param:")}
