"""Checks per micro-batch under gradient accumulation (nanscan.runtime.verdict NOTE: [micro-batch checks]): steps
count optimizer steps, a NaN is the incident of its step at its micro-batch with that micro-batch as the batch,
healthy accumulation raises no alarm, and under DDP's no_sync() the rank whose micro-batch went bad is named."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spawn_ranks import spawn

from nanscan import Monitor, NonFiniteError, load_bundle
from nanscan.incident import OTHER_RANK, SpikeWarning

ACCUMULATE = 4
BAD = (3, 2)  # (optimizer step, micro-batch) whose input holds a NaN


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def micro_batch(step: int, micro: int, bad: tuple | None = None) -> dict:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(8, 6, generator=g)
    if (step, micro) == bad:
        x[5, 2] = float("nan")
    return {"x": x, "y": x.sum(dim=1, keepdim=True)}


def accumulate(model, optimizer, monitor, steps: int, *, micro_checks: bool, bad: tuple | None = BAD,
               sync_context=None) -> list:
    """The accumulation loop: a backward per micro-batch, check(micro_batch=True) after each but the last when
    `micro_checks`, the step's own check after the last, one optimizer.step() per step. Returns the reports."""
    reports = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(ACCUMULATE):
            last = micro == ACCUMULATE - 1
            batch = micro_batch(step, micro, bad)
            with (sync_context() if sync_context is not None and not last else _no_context()):
                loss = (model(batch["x"]) - batch["y"]).pow(2).mean() / ACCUMULATE
                loss.backward()
            if micro_checks and not last:
                reports.append(monitor.check(batch=batch, loss=loss, micro_batch=True))
        reports.append(monitor.check(batch=batch, loss=loss))
        optimizer.step()
    return reports


class _no_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_nan_is_the_incident_of_its_step_at_its_micro_batch(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync")
    with pytest.raises(NonFiniteError, match=r"at step 3 at micro-batch 2 \(category input") as err:
        accumulate(model, optimizer, monitor, 6, micro_checks=True)
    assert (err.value.step, err.value.category, err.value.tensors) == (3, "input", ["input:x", "input:y"])
    bundle = load_bundle(err.value.bundle_path)
    assert (bundle.step, bundle.micro_batch, bundle.category) == (3, 2, "input")
    assert torch.isnan(bundle.batch()["x"][5, 2])  # that micro-batch, not the step's last
    assert "micro-batch 2 of step 3" in bundle.incident_text()
    assert [e.step for e in monitor.history] == [0, 1, 2]  # one entry per optimizer step


def test_without_micro_batch_checks_the_step_sees_only_summed_gradients(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync")
    with pytest.raises(NonFiniteError) as err:
        accumulate(model, optimizer, monitor, 6, micro_checks=False)
    assert (err.value.step, err.value.category) == (3, "gradient")  # the NaN micro-batch is gone
    assert load_bundle(err.value.bundle_path).micro_batch is None


def test_micro_batch_checks_count_optimizer_steps_and_raise_no_alarm(tmp_path):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpikeWarning)  # a partial gradient sum in the statistic would read as spikes
        reports = accumulate(model, optimizer, monitor, 60, micro_checks=True, bad=None)
    assert all(r.ok for r in reports) and monitor.first_invalid_step is None and not monitor.spikes
    assert [r.step for r in reports[: 2 * ACCUMULATE]] == [0] * ACCUMULATE + [1] * ACCUMULATE
    assert monitor.step == 60 and len(monitor.history) == min(60, 64)
    assert not list(tmp_path.glob("*"))


def test_the_recorded_loss_is_the_steps_loss_as_the_loop_summed_it(tmp_path):
    """Each micro-batch's loss divided by the accumulation count, checked after each: the step's recorded loss
    (history, report, the spike statistic) is their sum, the loss the step trained on, not the last micro-batch's
    quarter of it (NOTE: [observed micro-batches])."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync")
    accumulate(model, optimizer, monitor, 2, micro_checks=True, bad=None)
    twin = make_model()  # the same loop unchecked, for the losses it backpropagated
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=1e-2)
    for step in range(2):
        twin_optimizer.zero_grad(set_to_none=True)
        losses = []
        for micro in range(ACCUMULATE):
            batch = micro_batch(step, micro)
            loss = (twin(batch["x"]) - batch["y"]).pow(2).mean() / ACCUMULATE
            loss.backward()
            losses.append(float(loss))
        twin_optimizer.step()
        assert monitor.history[step].loss == pytest.approx(sum(losses), rel=1e-6)
        assert monitor.history[step].loss != pytest.approx(losses[-1], rel=1e-3)


def test_an_update_dated_at_the_next_micro_batch_check(tmp_path):
    # the first check after a bad update is the next step's first micro-batch check: it dates it
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, mode="sync")
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(ACCUMULATE):
            batch = micro_batch(step, micro)
            ((model(batch["x"]) - batch["y"]).pow(2).mean() / ACCUMULATE).backward()
            if step == 1 and micro == 0:
                with pytest.raises(NonFiniteError) as err:
                    monitor.check(batch=batch, micro_batch=True)
                assert (err.value.step, err.value.category) == (0, "update")
                assert "seen at the check of step 1" in str(err.value)
                return
            if micro < ACCUMULATE - 1:
                monitor.check(batch=batch, micro_batch=True)
        monitor.check(batch=batch)
        optimizer.param_groups[0]["lr"] = float("inf")
        optimizer.step()
    raise AssertionError("the dated update was not raised")


# -- DDP with no_sync(), 2 processes --------------------------------------------------------------------------

def _ddp_no_sync_worker(rank: int, world: int, store: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    results = {}
    for micro_checks in (True, False):
        model = DDP(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        monitor = Monitor(model, optimizer, bundle_dir=Path(out) / f"bundles-{micro_checks}", run_id="no-sync")
        bad = (2, 0) if rank == 1 else None  # rank 1's first micro-batch, accumulated locally under no_sync()
        try:
            accumulate(model, optimizer, monitor, 4, micro_checks=micro_checks, bad=bad, sync_context=model.no_sync)
            results[str(micro_checks)] = None
        except NonFiniteError as err:
            results[str(micro_checks)] = {"step": err.step, "category": err.category,
                                          "first_bad_ranks": getattr(err, "first_bad_ranks", None),
                                          "bad_ranks": getattr(err, "bad_ranks", None),
                                          "local_category": getattr(err, "local_category", None),
                                          "bundle": str(err.bundle_path)}
        monitor.close()
        dist.barrier()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow  # two processes
@pytest.mark.timeout(300)
def test_under_no_sync_the_rank_whose_micro_batch_went_bad_is_named(tmp_path):
    spawn(_ddp_no_sync_worker, 2, 2, tmp_path, timeout_s=240, label="DDP no_sync micro-batch checks")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, results in enumerate(ranks):
        found = results["True"]
        assert found is not None and (found["step"], found["first_bad_ranks"]) == (2, [1])
        assert found["bad_ranks"] == [1]  # before the all-reduce, rank 0's gradients are its own and finite
        assert found["local_category"] == ("input" if rank == 1 else OTHER_RANK)
        # without micro-batch checks the step's own check sees every rank's averaged NaN
        lost = results["False"]
        assert lost is not None and lost["step"] == 2 and lost["bad_ranks"] == [0, 1]
    part = load_bundle(Path(ranks[1]["True"]["bundle"]) / "rank-1")
    assert (part.step, part.micro_batch) == (2, 0)


# -- the HF Trainer under DDP, gradient accumulation, 2 processes ------------------------------------------------

HF_STEPS, HF_FAULT = 3, 1  # rank 1's first micro-batch of update 1 (the Trainer's step 2) gets a NaN gradient


def _hf_worker(rank: int, world: int, store: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29537")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nanscan.integrations.transformers import NanscanCallback

    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for micro in (True, False):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
            backwards = [0]

            def plant(grad, backwards=backwards):
                backwards[0] += 1
                if rank == 1 and backwards[0] == 2 * HF_FAULT + 1:  # micro-batch 0 of update HF_FAULT
                    grad = grad.clone()
                    grad.view(-1)[3] = float("nan")
                return grad

            model.transformer.h[0].mlp.c_fc.weight.register_hook(plant)
            g = torch.Generator().manual_seed(rank)
            data = [{"input_ids": torch.randint(0, 64, (16,), generator=g),
                     "labels": torch.randint(0, 64, (16,), generator=g)}
                    for _ in range(8 * HF_STEPS)]  # 2 ranks x 2 micro-batches of 2 per update: no short epoch
            callback = NanscanCallback(micro_batches=micro, bundle_dir=Path(out) / f"bundles-{micro}", run_id="hf")
            args = TrainingArguments(output_dir=str(Path(out) / f"o{rank}"), use_cpu=True, max_steps=HF_STEPS,
                                     per_device_train_batch_size=2, gradient_accumulation_steps=2, report_to=[],
                                     save_strategy="no", disable_tqdm=True, ddp_backend="gloo")
            trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
            try:
                trainer.train()
                results[str(micro)] = None
            except NonFiniteError as err:
                results[str(micro)] = {"step": err.step, "first_bad_ranks": getattr(err, "first_bad_ranks", None),
                                       "bad_ranks": getattr(err, "bad_ranks", None), "bundle": str(err.bundle_path)}
            dist.barrier()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow  # two processes
@pytest.mark.timeout(300)
def test_the_hf_trainer_checks_each_micro_batch_under_no_sync(tmp_path):
    pytest.importorskip("transformers")
    spawn(_hf_worker, 2, 2, tmp_path, timeout_s=240, label="HF Trainer micro-batch checks")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for results in ranks:
        found, lost = results["True"], results["False"]
        assert found is not None and (found["step"], found["first_bad_ranks"], found["bad_ranks"]) == (2, [1], [1])
        assert lost is not None and lost["step"] == 2 and lost["bad_ranks"] == [0, 1]  # averaged: both bad
    part = load_bundle(Path(ranks[1]["True"]["bundle"]) / "rank-1")
    assert (part.step, part.micro_batch) == (2, 0)


def test_snapshot_and_window_copy_the_state_once_per_optimizer_step_not_per_micro_batch(tmp_path, monkeypatch):
    """The weights and optimizer state do not change between a step's micro-batches, so the pre-step copy is taken
    at the first micro-batch's start only; a micro-batch that goes bad later still bundles that pre-step state."""
    from nanscan.runtime.snapshot import CpuSnapshot

    copies = []
    capture = CpuSnapshot.capture
    monkeypatch.setattr(CpuSnapshot, "capture", lambda self, *a, **k: (copies.append(1), capture(self, *a, **k))[1])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, snapshot="cpu", spikes=None)
    before = None
    with pytest.raises(NonFiniteError) as caught:
        for step in range(3):
            before = {k: v.clone() for k, v in model.state_dict().items()}
            for micro in range(8):  # nanoGPT's accumulation, checked per micro-batch
                x = torch.randn(2, 4)
                if (step, micro) == (2, 5):
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                mon.check(batch={"x": x}, micro_batch=micro < 7)
            optimizer.step()
            optimizer.zero_grad()
    bundle = load_bundle(caught.value.bundle_path)
    assert (bundle.step, bundle.micro_batch) == (2, 5)
    # one snapshot copy per step started (3; 22 before, one per micro-batch's forward), plus the window's at step 0
    assert len(copies) == 3 + 1
    state, _ = bundle.state()
    assert all(torch.equal(state[k], before[k]) for k in before)
