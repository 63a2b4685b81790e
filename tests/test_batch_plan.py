"""The Monitor's batch inputs (nanscan.engine.plans.BatchPlan, NOTE: [batch plan]): reused while the batch keeps its
structure, prepared again as soon as it does not, and always equal to preparing every tensor from scratch.

Each test feeds a plan the batches a training loop would (same structure every step, then a change) and compares
each step's inputs with a fresh preparation: same names, same skipped names, same tensors, and the same records.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nanscan.engine._native import tensor_access
from nanscan.engine.inputs import ScanInputs, iter_batch_tensors, prepare
from nanscan.engine.plans import BatchPlan
from nanscan.scan import scan_inputs


def fresh(batch, loss):
    """The ordinary preparation, tensor by tensor."""
    items, skipped = [], []
    if batch is not None:
        for path, tensor in iter_batch_tensors(batch):
            item = prepare(f"input:{path}", tensor)
            (skipped.append(f"input:{path}") if item is None else items.append(item))
    loss_input = prepare("loss", loss) if loss is not None else None
    if loss_input is not None:
        items.append(loss_input)
    return items, tuple(skipped), loss_input


def assert_same(plan: BatchPlan, batch, loss) -> None:
    step = plan.prepare(batch, loss)
    items, skipped = step.items(), step.skipped
    want_items, want_skipped, want_loss = fresh(batch, loss)
    assert step.identities == tuple(i.identity for i in want_items)
    assert step.ptrs == [i.data_ptr() for i in items], "the table's pointers are the bound tensors'"
    assert [i.name for i in items] == [i.name for i in want_items]
    assert [i.identity for i in items] == [i.identity for i in want_items]
    assert skipped == want_skipped
    assert [a.tensor.data_ptr() for a in items] == [b.tensor.data_ptr() for b in want_items], "other tensors"
    assert step.has_loss == (want_loss is not None)
    if items:
        got, want = scan_inputs(ScanInputs(items)), scan_inputs(ScanInputs(want_items))
        assert np.array_equal(got.records, want.records)


def native_plan_expected() -> bool:
    return BatchPlan()._check is not None and tensor_access() is not None


def step_batch(step: int, n: int = 4) -> dict:
    gen = torch.Generator().manual_seed(step)
    weights = torch.randn(n, 3, generator=gen)
    if step == 2:
        weights[1, 2] = float("nan")  # the values change every step; a NaN among them is scanned like any value
    return {"tokens": torch.randint(0, 9, (n, 5), generator=gen), "weights": weights, "index": torch.arange(n)}


def test_a_steady_dict_batch_is_prepared_once():
    plan = BatchPlan()
    for step in range(5):
        assert_same(plan, step_batch(step), torch.tensor(1.5 + step))
    assert plan.rebuilds == (1 if native_plan_expected() else 5)


@pytest.mark.parametrize("change", ["dtype", "shape", "key order", "new key", "int to float", "no loss",
                                    "loss dtype", "transposed", "list", "nested", "numpy", "parameter"])
def test_a_changed_batch_is_prepared_again_and_matches(change):
    plan = BatchPlan()
    loss = torch.tensor(0.25)
    for step in range(2):
        assert_same(plan, step_batch(step), loss)
    batch = step_batch(7)
    if change == "dtype":
        batch["weights"] = batch["weights"].double()
    elif change == "shape":
        batch["weights"] = torch.randn(6, 3)
    elif change == "key order":
        batch = {"weights": batch["weights"], "tokens": batch["tokens"], "index": batch["index"]}
    elif change == "new key":
        batch["mask"] = torch.ones(4, 5)
    elif change == "int to float":
        batch["index"] = batch["index"].float()
    elif change == "no loss":
        loss = None
    elif change == "loss dtype":
        loss = torch.tensor(0.25, dtype=torch.bfloat16)
    elif change == "transposed":
        batch["weights"] = torch.randn(3, 4).t()
    elif change == "list":
        batch = list(batch.values())
    elif change == "nested":
        batch = {"inputs": batch, "extra": torch.ones(2)}
    elif change == "numpy":
        batch["weights"] = batch["weights"].numpy()
    elif change == "parameter":
        batch["weights"] = torch.nn.Parameter(batch["weights"])
    rebuilds = plan.rebuilds
    for _ in range(2):
        assert_same(plan, batch, loss)
    assert plan.rebuilds > rebuilds, "the change was noticed"


@pytest.mark.parametrize("batch", [None, torch.ones(3), [torch.ones(2), torch.arange(3)],
                                   (torch.zeros(2, 2), torch.full((1,), float("inf")))],
                         ids=["none", "tensor", "list", "tuple"])
def test_other_plain_batches_are_planned_too(batch):
    plan = BatchPlan()
    for _ in range(3):
        assert_same(plan, batch, torch.tensor(2.0, dtype=torch.float64))
    assert plan.rebuilds == (1 if native_plan_expected() else 3)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


def test_batches_the_plan_does_not_describe_take_the_ordinary_path_every_step():
    plan = BatchPlan()
    batches = [Batch(torch.ones(2), torch.arange(2)), {"a": {"b": torch.ones(2)}}, {"a": np.ones(3)},
               {"a": torch.ones(4)[::2]}, {"a": torch.ones(2), "label": "cat"}]
    for batch in batches:
        before = plan.rebuilds
        for _ in range(2):
            assert_same(plan, batch, None)
        assert plan.rebuilds == before + 2
    for loss in (torch.tensor(3), torch.ones(2, 2).t()):  # an integer loss (not scanned), a permuted one
        before = plan.rebuilds
        for _ in range(2):
            assert_same(plan, {"a": torch.ones(2)}, loss)
        assert plan.rebuilds == before + 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_loss_value_is_read_from_host_memory_as_item_reads_it(dtype):
    """StepInputs.loss_value, which the Monitor's history keeps every step instead of calling loss.item()."""
    plan = BatchPlan()
    for value in (2.5, -0.0, -3.0e-5, 65504.0, float("nan"), float("-inf"), 1.0):
        loss = torch.tensor(value, dtype=dtype)
        read, expected = plan.prepare({"x": torch.ones(2)}, loss).loss_value(), loss.item()
        same = read == expected and np.signbit(read) == np.signbit(expected)
        assert same or (np.isnan(read) and np.isnan(expected))
    assert plan.prepare({"x": torch.ones(2)}, None).loss_value() is None
    assert plan.prepare(None, torch.ones(2, dtype=dtype)).loss_value() is None, "not one element"
