"""Monitor.observe (nanscan.runtime.observed NOTE: [observed micro-batches]): under gradient accumulation, a NaN loss
in an earlier micro-batch whose gradients stay finite (every target the ignore index: a mean cross-entropy over no
tokens is 0/0, its gradient 0) is missed by one check per step, and caught without a scan per micro-batch when
the loop hands each micro-batch to observe(): at its step and micro-batch, with that micro-batch in the bundle;
the step's recorded loss is the mean over its micro-batches; the window replays every micro-batch."""

from __future__ import annotations

import math

import pytest
import torch

import nanogpt_runs as N
from nanscan import Monitor, NonFiniteError, load_bundle
from nanscan.replay.window import replay_window
from nanscan.runtime.window import Window

ACCUM = 4
BAD = (3, 0)  # iteration 3, micro-batch 0: every target -1, nanoGPT's ignore index


def accumulate(tmp_path, *, observe: bool = True, bad=BAD, iters: int = 6, mode: str = "sync"):
    """nanoGPT's accumulation loop (float32), each micro-batch's loss divided by the count; observe() after every
    micro-batch but the last, check() after the last. Returns (error or None, the step losses the loop made)."""
    c = N.full_config({"accum": ACCUM, "dtype": "float32"})
    model, losses = N.build_model(c), []
    optimizer = N.configure_optimizer(model, c)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="observed", mode=mode, replay_entry=N.ENTRY,
                  config={"accum": ACCUM, "dtype": "float32"}, window=Window(steps=8, every=4))
    for it in range(iters):
        total = 0.0
        for micro in range(ACCUM):
            batch = N.get_batch(c, it, micro)
            if (it, micro) == bad:
                batch["y"][:] = -1
            loss = model(batch["x"], batch["y"])[1] / ACCUM
            loss.backward()
            total += float(loss.detach())
            try:
                if micro < ACCUM - 1:
                    if observe:
                        mon.observe(batch=batch, loss=loss)
                else:
                    mon.check(batch=batch, loss=loss)
            except NonFiniteError as exc:
                return exc, losses
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    try:
        mon.close()
    except NonFiniteError as exc:  # mode="async": the last step's verdict is read at close
        return exc, losses
    return None, losses


def test_one_check_per_step_misses_a_nan_loss_whose_gradients_stay_finite(tmp_path):
    error, losses = accumulate(tmp_path, observe=False)
    assert error is None and math.isnan(losses[BAD[0]])  # the loop's own loss was NaN at iteration 3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_observed_micro_batches_catch_it_at_its_step_and_micro_batch(tmp_path, mode):
    error, _ = accumulate(tmp_path, mode=mode)
    assert error is not None and error.step == BAD[0] and error.category == "loss"
    assert "micro-batch 0" in str(error)
    bundle = load_bundle(error.bundle_path)
    assert (bundle.step, bundle.micro_batch, bundle.category) == (BAD[0], BAD[1], "loss")
    assert bool((bundle.batch(nested=True)["y"] == -1).all())  # the bundle holds that micro-batch, not the last one
    assert bundle.manifest["micro_batch_observed"] is True
    assert "its loss, handed over by observe(), was the first non-finite one" in bundle.incident_text()


def test_the_recorded_loss_is_the_steps_mean_over_its_micro_batches(tmp_path):
    # a healthy run writes no bundle: its history is read through a NaN planted after the steps compared
    error, losses = accumulate(tmp_path, bad=(5, 2), iters=6)
    assert error is not None and error.step == 5
    recorded = {entry.step: entry.loss for entry in load_bundle(error.bundle_path).history()}
    for step in range(5):
        assert recorded[step] == pytest.approx(losses[step], rel=1e-6)


def test_the_window_replays_every_observed_micro_batch(tmp_path):
    error, _ = accumulate(tmp_path)
    records = load_bundle(error.bundle_path).window_records()
    assert [(r.step, r.micro_batch) for r in records if r.step == 1] == [(1, 0), (1, 1), (1, 2), (1, None)]
    result = replay_window(error.bundle_path)
    assert result.reproduced and result.first_departure is None, result.departure_text()
    assert all(s.grad_norm == pytest.approx(s.recorded_grad_norm, rel=1e-5) for s in result.steps[:-1])


def test_observe_takes_a_scalar_loss(tmp_path):
    model = torch.nn.Linear(2, 1)
    mon = Monitor(model, None, bundle_dir=tmp_path)
    with pytest.raises(ValueError, match=r"observe\(loss=...\) got a tensor of shape \(3,\)"):
        mon.observe(loss=torch.ones(3))
