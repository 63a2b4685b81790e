"""The Monitor's every-step inputs (nanscan.engine.plans.ModelScanPlan, NOTE: [model scan plan]): reused while nothing
changed, rebuilt as soon as anything did, and always equal to preparing every tensor from scratch.

Each test changes the model or optimizer the way training code does (a layer replaced, weights cast, state
reloaded, a gradient assigned by hand) and compares the plan's scan, step by step, with a scan of freshly prepared
inputs: same names in the same order, and records equal with `==`.
"""

from __future__ import annotations

import copy
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import nanscan
import nanscan.runtime.monitor as monitor_module
from conftest import native_extension_expected
from nanscan.engine import backends
from nanscan.engine.backends import BackendUnavailable
from nanscan.engine.inputs import ScanInputs, UnsupportedTensorError, prepare
from nanscan.engine.dispatch import select_for_part
from nanscan.engine.plans import ModelScanPlan
from nanscan.scan import model_inputs, scan_inputs


@pytest.fixture(params=["one call", "native, Python reads", "python"])
def new_plan(request):
    """Plans whose per-step check runs in C++ together with the native scan (ModelScanPlan.launch with the cpu
    backend, nanscan._C.PlanCheck.check_and_scan, reading tensors through nanscan._torch_access where it is built),
    in C++ alone reading tensors through Python calls (PlanCheck.check), or in Python: all must agree."""
    def make() -> ModelScanPlan:
        plan = ModelScanPlan()
        if request.param == "python":
            plan._native_check = None
        elif plan._native_check is None:
            pytest.skip("nanscan._C is not built")
        elif request.param == "native, Python reads":
            plan._tensor_access = None
        plan.test_one_call = request.param == "one call"  # read by planned_scan below
        return plan
    return make


def planned_scan(plan: ModelScanPlan, model: nn.Module, optimizer=None) -> nanscan.ScanReport:
    """The plan's scan of this step, the way the new_plan fixture chose."""
    if getattr(plan, "test_one_call", False):
        scan = plan.launch(model, optimizer, backend_for=lambda devices: backends.load("cpu"))
        return nanscan.ScanReport(scan.tensors, scan.records(), backend=scan.backend)
    return scan_inputs(plan.inputs(model, optimizer))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def backward(model: nn.Module, optimizer=None, *, set_to_none: bool = True) -> None:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=set_to_none)
    else:
        model.zero_grad(set_to_none=set_to_none)
    x = torch.randn(5, 6, dtype=next(model.parameters()).dtype)
    model(x).float().square().mean().backward()


def assert_plan_matches_fresh(plan: ModelScanPlan, model: nn.Module, optimizer=None) -> nanscan.ScanReport:
    planned = planned_scan(plan, model, optimizer)
    fresh = scan_inputs(model_inputs(model, optimizer), backend=planned.backend)  # sums of squares differ by backend
    assert planned.names == fresh.names
    assert np.array_equal(planned.records, fresh.records), "the plan scanned other memory than the tensors"
    return planned


def test_a_training_loop_prepares_once_and_scans_the_new_gradients_each_step(new_plan):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = new_plan()
    for step in range(4):
        backward(model, optimizer)  # new gradient tensors every step
        report = assert_plan_matches_fresh(plan, model, optimizer)
        optimizer.step()
    assert plan.rebuilds == 2, "one rebuild for the first step, one when Adam's state appeared, none after"
    params = [n for n, _ in model.named_parameters()]
    assert report.names[: 2 * len(params)] == [f"param:{n}" for n in params] + [f"grad:{n}" for n in params]
    assert all(n.startswith("optim:") for n in report.names[2 * len(params):])


def test_in_place_gradient_zeroing_reuses_the_plan(new_plan):
    model = make_model()
    plan = new_plan()
    for _ in range(3):
        backward(model, set_to_none=False)
        assert_plan_matches_fresh(plan, model)
    assert plan.rebuilds == 1


def test_a_nan_planted_in_a_gradient_between_steps_is_seen(new_plan):
    model = make_model()
    plan = new_plan()
    backward(model)
    assert planned_scan(plan, model).ok
    backward(model)
    model[3].weight.grad[0, 0] = float("nan")
    report = assert_plan_matches_fresh(plan, model)
    assert report.nonfinite == ["grad:3.weight"] and plan.rebuilds == 1


@pytest.mark.parametrize("change", ["replace layer", "new parameter", "delete layer", "tie weights", "half",
                                    "data swap", "freeze", "reload optimizer", "new state tensor"])
def test_every_change_to_the_tensor_set_rebuilds(change, new_plan):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = new_plan()
    backward(model, optimizer)
    optimizer.step()
    backward(model, optimizer)
    assert_plan_matches_fresh(plan, model, optimizer)
    assert_plan_matches_fresh(plan, model, optimizer)
    assert plan.rebuilds == 1
    if change == "replace layer":
        model[3] = nn.Linear(8, 3)
    elif change == "new parameter":
        model[1].register_parameter("extra", nn.Parameter(torch.full((2,), float("inf"))))
    elif change == "delete layer":
        del model[1]
    elif change == "tie weights":
        model[3].weight = nn.Parameter(torch.ones(3, 8))
        model.add_module("head", nn.Linear(8, 3))
        model.head.weight = model[3].weight
    elif change == "half":
        model.double()  # same Parameter objects, new memory and dtype
    elif change == "data swap":
        model[0].weight.data = torch.full_like(model[0].weight, float("nan"))
    elif change == "freeze":
        model[0].weight.requires_grad_(False)
        model[0].weight.grad = None
    elif change == "reload optimizer":
        state = copy.deepcopy(optimizer.state_dict())  # as from a checkpoint file: new tensors
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer.load_state_dict(state)
    elif change == "new state tensor":
        p = model[0].weight
        optimizer.state[p]["momentum_buffer"] = torch.full_like(p, float("-inf"))
    if change in ("delete layer", "tie weights", "half", "new parameter", "replace layer"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if change == "half":
            backward(model, optimizer)
    report = assert_plan_matches_fresh(plan, model, optimizer)
    assert plan.rebuilds == 2
    if change in ("new parameter", "data swap", "new state tensor"):
        assert not report.ok
    assert_plan_matches_fresh(plan, model, optimizer)
    assert plan.rebuilds == 2, "the changed model is planned once, then reused"


def test_optimizer_parameters_outside_the_model_are_scanned_and_a_new_group_rebuilds(new_plan):
    """A loss weight the optimizer trains beside the model, and a group added later whose parameter has neither
    state nor gradient yet: only the optimizer's parameter lists show it."""
    model = make_model()
    temperature = nn.Parameter(torch.tensor(0.5))
    optimizer = torch.optim.Adam([*model.parameters(), temperature], lr=1e-2)
    plan = new_plan()

    def backward_with_temperature():
        optimizer.zero_grad(set_to_none=True)
        (model(torch.randn(5, 6)).square().mean() * temperature).backward()

    backward_with_temperature()
    optimizer.step()
    for _ in range(2):
        backward_with_temperature()
        report = assert_plan_matches_fresh(plan, model, optimizer)
    outside = "optimizer.param_groups.0.params.6"
    for name in (f"param:{outside}", f"grad:{outside}", f"optim:{outside}.exp_avg"):
        assert name in report, name
    assert plan.rebuilds == 1
    optimizer.add_param_group({"params": [nn.Parameter(torch.full((3,), float("nan")))]})
    report = assert_plan_matches_fresh(plan, model, optimizer)
    assert report.nonfinite == ["param:optimizer.param_groups.1.params.0"] and plan.rebuilds == 2


def test_lbfgs_history_lists_are_scanned_as_they_change(new_plan):
    """LBFGS keeps its curvature pairs in lists of tensors that it appends to in place."""
    model = make_model()
    optimizer = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=2)
    x = torch.randn(5, 6)

    def closure():
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    plan = new_plan()
    for _ in range(3):
        closure()
        assert_plan_matches_fresh(plan, model, optimizer)
        optimizer.step(closure)
    closure()
    old_dirs = optimizer.state[model[0].weight]["old_dirs"]
    assert len(old_dirs) >= 2
    old_dirs[-1][0] = float("nan")
    report = assert_plan_matches_fresh(plan, model, optimizer)
    assert report.nonfinite == [f"optim:0.weight.old_dirs.{len(old_dirs) - 1}"]


def test_a_parameter_cut_down_to_a_view_that_keeps_its_pointer_is_scanned_at_its_new_size(new_plan):
    model = make_model()
    plan = new_plan()
    for _ in range(2):
        assert_plan_matches_fresh(plan, model)
    weight = model[0].weight
    with torch.no_grad():
        weight[4:] = float("nan")  # the rows about to be cut off
    weight.data = weight.data[:4]  # the same data pointer, half the elements
    report = assert_plan_matches_fresh(plan, model)
    assert report.ok and report["param:0.weight"].numel == weight.numel()


def test_a_parameter_reinterpreted_in_place_is_scanned_in_its_new_format(new_plan):
    # float16 -> bfloat16 at the same address and size: what model.half() then model.bfloat16() can give when the
    # allocator hands the freed block back. Read as float16, 0x7F80 (bfloat16 +inf) is a finite 2.0e4.
    model = make_model().half()
    plan = new_plan()
    for _ in range(2):
        assert_plan_matches_fresh(plan, model)
    weight = model[0].weight
    weight.data = weight.data.view(torch.bfloat16)
    weight.data.view(torch.int16)[0, 0] = 0x7F80
    report = assert_plan_matches_fresh(plan, model)
    assert report["param:0.weight"].dtype == "bfloat16" and report.nonfinite == ["param:0.weight"]


def test_optimizer_state_cut_down_in_place_is_scanned_at_its_new_size(new_plan):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    plan = new_plan()
    backward(model)
    optimizer.step()
    for _ in range(2):
        assert_plan_matches_fresh(plan, model, optimizer)
    exp_avg = optimizer.state[model[0].weight]["exp_avg"]
    exp_avg.data = exp_avg.data[:2]  # same address, fewer bytes
    report = assert_plan_matches_fresh(plan, model, optimizer)
    assert report["optim:0.weight.exp_avg"].numel == exp_avg.numel()


def test_gradients_assigned_with_other_layouts_are_scanned_correctly(new_plan):
    model = make_model()
    plan = new_plan()
    backward(model)
    assert_plan_matches_fresh(plan, model)
    weight = model[0].weight
    weight.grad = torch.randn(weight.shape[1], weight.shape[0]).t()  # dense, transposed
    weight.grad[0, 0] = float("inf")
    assert assert_plan_matches_fresh(plan, model).nonfinite == ["grad:0.weight"]
    rebuilds = plan.rebuilds
    weight.grad = torch.ones(1, 1).expand_as(weight)  # one element seen through stride 0: must not be read flat
    report = assert_plan_matches_fresh(plan, model)
    assert plan.rebuilds > rebuilds and report["grad:0.weight"].numel == weight.numel() and report.ok


def test_gradients_and_weights_without_strided_storage_are_checked_safely(new_plan):
    """The plan check's warm-up (NOTE: [warm reads] in csrc/torch/tensor_access.cpp) follows every tensor's chain
    before the reads decide: a sparse gradient (no storage) and optimizer state on the meta device (storage without
    data) must each take the ordinary path, as fresh inputs do."""
    model = make_model()
    plan = new_plan()
    backward(model)
    assert_plan_matches_fresh(plan, model)
    weight = model[0].weight
    weight.grad = weight.grad.to_sparse()
    assert planned_scan(plan, model).names == scan_inputs(model_inputs(model)).names
    backward(model)
    assert_plan_matches_fresh(plan, model)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.step()
    backward(model)
    assert_plan_matches_fresh(plan, model, optimizer)
    optimizer.state[weight]["exp_avg"] = torch.empty_like(weight, device="meta")
    with pytest.raises(UnsupportedTensorError, match="'optim:0.weight.exp_avg' is a meta tensor"):
        planned_scan(plan, model, optimizer)
    optimizer.state[weight]["exp_avg"] = torch.zeros_like(weight)
    assert_plan_matches_fresh(plan, model, optimizer)


def test_channels_last_gradients_keep_the_plan(new_plan):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3)).to(memory_format=torch.channels_last)
    plan = new_plan()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
        assert not model[0].weight.grad.is_contiguous()
        assert_plan_matches_fresh(plan, model)
    assert plan.rebuilds == 1


def test_a_module_that_finds_its_parameters_its_own_way_is_walked_every_step(new_plan):
    class Renamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 2)

        def named_parameters(self, *args, **kwargs):
            for name, p in super().named_parameters(*args, **kwargs):
                yield name.replace("inner.", ""), p

    model = Renamed()
    plan = new_plan()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model.inner(torch.randn(4, 3)).sum().backward()
        report = assert_plan_matches_fresh(plan, model)
    assert report.names[:2] == ["param:weight", "param:bias"] and plan.rebuilds == 2


def test_the_plan_does_not_keep_gradients_alive(new_plan):
    model = make_model()
    plan = new_plan()
    backward(model)
    planned_scan(plan, model)
    grad = weakref.ref(model[0].weight.grad)
    model.zero_grad(set_to_none=True)
    assert grad() is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [2.5, -0.0, -3.0e-5, 65504.0, float("nan"), float("-inf")])
def test_host_scalar_reads_the_loss_as_item_does(dtype, value):
    from nanscan.engine.inputs import prepare

    t = torch.tensor(value, dtype=dtype)
    read = prepare("loss", t).host_scalar()
    expected = t.item()
    assert (read == expected and np.signbit(read) == np.signbit(expected)) or (np.isnan(read) and np.isnan(expected))
    with pytest.raises(ValueError, match="one-element CPU inputs"):
        prepare("two", torch.ones(2, dtype=dtype)).host_scalar()


def test_the_inputs_of_one_device_are_taken_with_their_table():
    """ScanInputs.take, as launch() cuts a check that spans devices (CUDA weights beside AdamW's CPU step
    counters): the sliced table is the one the taken inputs build themselves, and a compacted view keeps the copy
    its pointer names."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backward(model, optimizer)
    optimizer.step()
    plan = ModelScanPlan()
    for step in range(2):  # the rebuild's joined inputs, then the plan's every-step inputs
        backward(model, optimizer)
        extra = [prepare("input:x", torch.arange(20.0)[::2]), prepare("loss", torch.tensor(1.5))]
        inputs = plan.inputs(model, optimizer, extra=extra)
        rows = np.array([5, 0, 2, len(inputs) - 1, 1], dtype=np.int64)
        taken = inputs.take(rows)
        fresh = ScanInputs([inputs[i] for i in rows.tolist()])
        assert [item.name for item in taken] == [inputs[i].name for i in rows.tolist()]
        for got, want in zip(taken.table(), fresh.table()):
            assert np.array_equal(got, want)
        assert taken.identities == fresh.identities and taken.devices == ("cpu",)
        assert np.array_equal(scan_inputs(taken).records, scan_inputs(fresh).records)
        again = fresh.take(np.array([1, 0], dtype=np.int64))  # inputs given as items: the items themselves travel
        assert again[0] is fresh[1] and np.array_equal(again.table()[0], fresh.table()[0][[1, 0]])
    assert plan.rebuilds == 1


def test_a_named_backend_leaves_the_devices_it_cannot_scan_to_the_automatic_choice(monkeypatch):
    """A check spanning devices with NANSCAN_BACKEND=cuda: the CPU part goes to the host's automatic choice; a
    check on one device the named backend cannot scan still fails loudly."""
    monkeypatch.setenv("NANSCAN_BACKEND", "cuda")
    chosen = select_for_part(torch.device("cpu"), None, mixed=True)
    assert chosen.name in ("cpu", "numba", "reference") and chosen.supports(torch.device("cpu"))
    with pytest.raises(BackendUnavailable):
        select_for_part(torch.device("cpu"), None, mixed=False)


def test_the_monitor_chooses_each_devices_backend_once(monkeypatch, tmp_path):
    """A check that spans devices gets one Backend per device, chosen at the first check and reused after."""
    calls = []

    def counting(device, backend, *, mixed):
        calls.append((str(device), mixed))
        return select_for_part(torch.device("cpu"), None, mixed=mixed)  # any host backend stands in

    monkeypatch.setattr(monitor_module, "select_for_part", counting)
    mon = nanscan.Monitor(make_model(), bundle_dir=tmp_path)
    spanning = ("cuda:0", "cpu")
    first, second = mon.backend_for(spanning), mon.backend_for(spanning)
    assert set(first) == {"cuda:0", "cpu"} and first == second
    assert calls == [("cuda:0", True), ("cpu", True)]
    one = ("cpu",)
    assert mon.backend_for(one) is mon.backend_for(one) and calls[2:] == [("cpu", False)]


def test_one_call_scans_the_batch_and_loss_with_the_model_and_gives_the_verdict():
    """ModelScanPlan.launch on the native cpu backend (the check inside the scan's parallel region): the extra
    inputs come first, a strided batch view is scanned from its compacted copy, and the verdict counts them."""
    if ModelScanPlan()._native_check is None:
        pytest.skip("nanscan._C is not built")
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = ModelScanPlan()
    cpu = backends.load("cpu")
    for step in range(4):
        backward(model, optimizer)
        x = torch.arange(40.0)[::3]
        if step == 3:
            x[2] = float("inf")
        extra = [prepare("input:x", x), prepare("loss", torch.tensor(1.5))]
        scan = plan.launch(model, optimizer, extra=extra, backend_for=lambda devices: cpu)
        fresh = scan_inputs(ScanInputs.join([ScanInputs(extra), model_inputs(model, optimizer)]), backend="cpu")
        assert [t.name for t in scan.tensors] == fresh.names
        assert np.array_equal(scan.records(), fresh.records)
        assert scan.backend == "cpu" and scan.nonfinite_on_host == (step == 3)
        optimizer.step()
    assert plan.rebuilds == 2, "the first step, then Adam's state; the one-call path served the others"


def test_one_call_falls_back_to_launch_for_another_backend():
    """A backend without the one-call path (here the reference backend) gets the plan's inputs through launch."""
    model = make_model()
    plan = ModelScanPlan()
    for _ in range(2):
        backward(model)
        scan = plan.launch(model, backend_for=lambda devices: backends.load("reference"))
        assert scan.backend == "reference"
        assert np.array_equal(scan.records(), scan_inputs(model_inputs(model), backend="reference").records)


def test_tensor_reads_through_torch_are_used_only_for_the_torch_they_were_built_for(monkeypatch):
    """nanscan._torch_access reads torch's objects by their C++ layout: built for another torch, it is not used."""
    import nanscan.engine._native as native_module

    access = pytest.importorskip("nanscan._torch_access")
    if native_extension_expected():
        assert access.torch_version == torch.__version__, "make install builds it for the torch it installs"
    monkeypatch.setattr(native_module, "_tensor_access", False)
    assert native_module.tensor_access() is access.tensor_access
    monkeypatch.setattr(native_module, "_tensor_access", False)
    assert "through torch's C++ headers" in native_module.tensor_access_status()
    monkeypatch.setattr(access, "torch_version", "0.0.1")
    monkeypatch.setattr(native_module, "_tensor_access", False)  # looked up once per process: look again
    assert native_module.tensor_access() is None
    assert ModelScanPlan()._tensor_access is None
    assert "built for torch 0.0.1" in nanscan.backend_info()["tensor_reads"], "nanscan info says why"


def test_a_plan_check_refuses_a_foreign_capsule():
    from nanscan import _C

    model = make_model()
    plan = ModelScanPlan()
    backward(model)
    plan.inputs(model)
    foreign = __import__("datetime").datetime_CAPI  # a capsule of another name
    with pytest.raises(ValueError):
        _C.PlanCheck(plan._child_dicts, plan._children, plan._param_dicts, plan._raw_params, plan._state_values,
                     plan._params, plan._grad_absent, plan._state_tensors, plan._stable_ptrs, plan._stable_dtypes,
                     plan._stable_nbytes, torch.Tensor.data_ptr, torch.Tensor.is_contiguous, foreign)
