"""The run's window (nanscan.runtime.window NOTE: [run window]): kept states every `every` steps in a ring, exactly
the state each step started from, every check's batch, learning rates, scale, precision and RNG state since the
oldest, bounded memory, and a bundle that holds it and reads it back (report, validation, window=None)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

from nanscan import Monitor, NonFiniteError, load_bundle
from nanscan.bundle import BundleError
from nanscan.review.summary import summarize
from nanscan.review.text import size_text
from nanscan.runtime.window import Window, WindowWarning, window_setting


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.25), nn.Tanh(), nn.Linear(8, 1))


def make_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(2000 + step)
    return {"x": torch.randn(6, 4, generator=g), "y": torch.randn(6, 1, generator=g), "ids": torch.arange(6) + 6 * step}


def state_copy(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
             for k, v in optimizer.state_dict()["state"].items()})


def run(tmp_path, steps: int, *, window=Window(steps=8, every=4), fault_step: int | None = None, lr_of=None,
        autocast: bool = False, micro_batches: int = 1, mode: str = "sync", **monitor_kwargs):
    """A training loop with a per-step learning rate (set by hand, as nanoGPT does), Adam, dropout; returns the
    Monitor, the states each step started from, the RNG states at each step's start and the bundle path (if any)."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path / "bundles", run_id="win", window=window, mode=mode,
                  **monitor_kwargs)
    starts, rngs, path = {}, {}, None
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_of(step) if lr_of is not None else 1e-3 * (step + 1)
        starts[step] = state_copy(model, optimizer)
        rngs[step] = torch.get_rng_state()
        for micro in range(micro_batches):
            batch = make_batch(step * micro_batches + micro)
            if fault_step == step and micro == micro_batches - 1:
                batch["x"][1, 2] = float("nan")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(batch["x"])
            loss = nn.functional.mse_loss(out.float(), batch["y"]) / micro_batches
            loss.backward()
            try:
                report = mon.check(batch=batch, loss=loss, sample_ids=batch["ids"],
                                   micro_batch=micro < micro_batches - 1)
            except NonFiniteError as exc:
                return mon, starts, rngs, exc.bundle_path
        if report.ok:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mon.close()
    return mon, starts, rngs, path


def test_the_window_keeps_a_state_every_k_steps_in_a_ring_and_the_steps_since_the_oldest(tmp_path):
    mon, _, _, _ = run(tmp_path, 20)
    keeper = mon._window
    assert Window(steps=8, every=4).states == 3
    assert keeper.kept_states() == [8, 12, 16]  # 0, 4 dropped as the ring moved on
    assert keeper.kept_steps() == list(range(8, 20))
    # the oldest kept state reaches at least `steps` back from any step: from step 19, 11 steps
    assert 19 - keeper.kept_states()[0] >= 8


@pytest.mark.parametrize("steps,every,want", [(32, 16, 3), (8, 4, 3), (9, 4, 4), (1, 1, 2), (5, 16, 2)])
def test_the_ring_holds_enough_states_to_reach_steps_back(steps, every, want):
    window = Window(steps=steps, every=every)
    assert window.states == want
    # worst case: the failing step is a kept state's own step; the oldest is then (R - 1) * every back
    assert (window.states - 1) * every >= steps


def test_a_nan_at_step_19_bundles_the_window_with_the_exact_states_and_every_step_since(tmp_path):
    mon, starts, rngs, path = run(tmp_path, 30, fault_step=19)
    assert path is not None and mon.first_invalid_step == 19
    bundle = load_bundle(path)
    info = bundle.window
    assert [s["step"] for s in info["states"]] == [8, 12, 16] and info["span"] == [8, 19]
    assert info["steps"] == 8 and info["every"] == 4 and info["records"] == 12
    assert all(s["pre_step"] for s in info["states"])
    for kept in (8, 12, 16):
        model_state, optimizer_state = bundle.window_state(kept)
        want_model, want_optim = starts[kept]
        assert model_state.keys() == want_model.keys()
        assert all(torch.equal(model_state[k], want_model[k]) for k in want_model)
        assert optimizer_state["state"].keys() == want_optim.keys()
        for k, entry in want_optim.items():
            assert all(torch.equal(optimizer_state["state"][k][n], t) for n, t in entry.items()
                       if isinstance(t, torch.Tensor))
    records = bundle.window_records()
    assert [r.step for r in records] == list(range(8, 20)) and all(r.micro_batch is None for r in records)
    for r in records:
        want = make_batch(r.step)
        if r.step == 19:
            want["x"][1, 2] = float("nan")
        assert torch.equal(r.batch["x"].nan_to_num(7.0), want["x"].nan_to_num(7.0))
        assert torch.equal(r.batch["ids"], want["ids"]) and r.sample_ids == want["ids"].tolist()
        assert r.lrs == [pytest.approx(1e-3 * (r.step + 1))]
        assert r.loss_scale is None and r.autocast is None
        assert torch.equal(r.rng["torch_cpu"], rngs[r.step])  # dropout masks can be drawn again
    with pytest.raises(BundleError, match="keeps no state at step 9"):
        bundle.window_state(9)


def test_the_report_shows_the_bundles_size_and_the_windows_span(tmp_path):
    _, _, _, path = run(tmp_path, 30, fault_step=19)
    bundle = load_bundle(path)
    summary = summarize(bundle)
    size = summary["size"]
    assert size["bytes"] == sum(e["bytes"] for e in bundle.manifest["files"].values())
    assert size["window"]["span"] == [8, 19] and size["window"]["states"] == [8, 12, 16]
    window_bytes = sum(e["bytes"] for n, e in bundle.manifest["files"].items() if n.startswith("window/"))
    assert 0 < size["window"]["bytes"] == window_bytes < size["bytes"]
    text = size_text(size)
    assert "window: steps 8-19 (12 checks, states at step 8, 12, 16)" in text and text.startswith("bundle: ")
    json.dumps(summary)  # the report's --json output holds it


def test_without_a_window_the_bundle_says_so(tmp_path):
    _, _, _, path = run(tmp_path, 10, window=None, fault_step=5)
    bundle = load_bundle(path)
    assert bundle.window is None and "window" not in bundle.manifest
    assert not any(n.startswith("window/") for n in bundle.manifest["files"])
    with pytest.raises(BundleError, match="holds no window of the run"):
        bundle.window_records()
    assert "no window of the run" in size_text(summarize(bundle)["size"])


def test_a_changed_window_file_is_refused(tmp_path):
    _, _, _, path = run(tmp_path, 12, fault_step=9)
    target = path / "window" / "steps.json"
    target.write_text(target.read_text().replace('"step": 9', '"step": 10'))
    with pytest.raises(BundleError, match="sha256"):
        load_bundle(path)


def test_bf16_autocast_and_the_scale_are_recorded_per_step(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    mon, _, _, path = run(tmp_path, 8, autocast=True, fault_step=6, scaler=scaler)
    records = load_bundle(path).window_records()
    assert [r.step for r in records] == list(range(0, 7))
    assert all(r.autocast == {"device_type": "cpu", "dtype": "bfloat16"} for r in records)
    # the loop never called scaler.scale(): the scaler holds no scale yet, so none was in effect
    assert all(r.loss_scale is None for r in records)


def test_micro_batch_checks_are_each_recorded_with_their_index(tmp_path):
    mon, _, _, path = run(tmp_path, 10, micro_batches=3, fault_step=7)
    records = load_bundle(path).window_records()
    steps = [(r.step, r.micro_batch) for r in records]
    assert steps[:3] == [(0, 0), (0, 1), (0, None)]
    assert steps[-3:] == [(7, 0), (7, 1), (7, None)]
    assert [s for s, m in steps if m is None] == list(range(0, 8))
    assert load_bundle(path).window["states"][0]["step"] == 0


def test_async_mode_bundles_the_window_up_to_the_failing_step(tmp_path):
    mon, _, _, path = run(tmp_path, 30, fault_step=13, mode="async")
    assert mon.first_invalid_step == 13
    bundle = load_bundle(path)
    assert bundle.window["span"] == [4, 13] and [s["step"] for s in bundle.window["states"]] == [4, 8, 12]


def fail_at(mon: Monitor, model: nn.Module, optimizer, fault_step: int):
    """A plain loop up to the check of `fault_step`, whose batch holds an infinity; the bundle's path."""
    for step in range(fault_step + 1):
        batch = make_batch(step)
        if step == fault_step:
            batch["x"][0, 0] = float("inf")
        nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
        try:
            mon.check(batch=batch)
        except NonFiniteError as exc:
            return exc.bundle_path
        optimizer.step()
        optimizer.zero_grad()
    raise AssertionError("the planted infinity was not caught")


def test_without_a_step_start_the_state_is_kept_at_the_check_and_says_so(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="nohook", window=Window(steps=2, every=2))
    mon._hook.remove()  # no forward pre-hook: no step start is seen
    path = fail_at(mon, model, optimizer, 4)
    states = load_bundle(path).window["states"]
    assert [s["step"] for s in states] == [2, 4] and not any(s["pre_step"] for s in states)  # R = 2
    assert all(r.rng is None for r in load_bundle(path).window_records())


def test_a_window_whose_states_do_not_fit_keeps_its_steps_only_and_says_so(tmp_path):
    with pytest.warns(WindowWarning, match="keeps no state"):
        mon, _, _, path = run(tmp_path, 20, window=Window(steps=8, every=4, max_bytes=100), fault_step=15)
    bundle = load_bundle(path)
    assert bundle.window["states"] == [] and bundle.window["span"] == [8, 15]  # the last `steps` checks
    assert mon._window.nbytes() < 10_000


def test_the_window_may_keep_fewer_states_than_asked_when_the_budget_is_tight(tmp_path):
    model_bytes = sum(t.numel() * t.element_size() for t in make_model().state_dict().values())
    budget = 2 * 3 * model_bytes + 64  # two states of the model and Adam's two moments (and step counters)
    with pytest.warns(WindowWarning, match="it keeps 2 states"):
        mon, _, _, _ = run(tmp_path, 20, window=Window(steps=8, every=4, max_bytes=budget))
    assert mon._window.kept_states() == [12, 16]


def test_frozen_parameters_are_not_copied_into_the_windows_states(tmp_path):
    model = make_model()
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="frozen", window=Window(steps=2, every=1))
    bundle = load_bundle(fail_at(mon, model, optimizer, 2))
    model_state, _ = bundle.window_state(2)
    assert "0.weight" not in model_state and "0.bias" in model_state
    assert "0.weight" in bundle.frozen_references()


def test_window_settings():
    assert window_setting(None) is None
    assert window_setting(64) == Window(steps=64, every=32) and window_setting(3) == Window(steps=3, every=3)
    for bad in (0, -1, True):
        with pytest.raises((ValueError, TypeError)):
            Window(steps=bad)
    with pytest.raises(TypeError, match="window='yes'"):
        window_setting("yes")
    with pytest.raises(ValueError, match="max_bytes"):
        Window(max_bytes=-5)


def test_the_default_monitor_keeps_a_window_and_a_tensor_source_none(tmp_path):
    model = make_model()
    mon = Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), bundle_dir=tmp_path)
    assert mon._window is not None and mon._window.window == Window(steps=32, every=32)
    mon.close()
    with pytest.raises(ValueError, match="window= with a TensorSource"):
        Monitor(model, bundle_dir=tmp_path, source=object(), window=Window())  # type: ignore[arg-type]


def test_the_windows_memory_stays_bounded_over_a_long_run(tmp_path):
    mon, _, _, _ = run(tmp_path, 80, window=Window(steps=8, every=4), lr_of=lambda s: 1e-4)
    keeper = mon._window
    assert len(keeper.kept_states()) == 3 and len(keeper.kept_steps()) <= 8 + 4
    state_bytes = 3 * keeper._states[0].snapshot.nbytes()
    batch = make_batch(0)
    step_bytes = sum(t.numel() * t.element_size() for t in [*batch.values(), batch["ids"]])  # and the sample ids
    assert keeper.nbytes() <= state_bytes + (8 + 4) * step_bytes
    assert not math.isnan(keeper.nbytes())


def test_a_bundle_without_window_keys_from_before_windows_still_loads(tmp_path):
    _, _, _, path = run(tmp_path, 10, window=None, fault_step=5)
    assert load_bundle(path).window is None  # what an older bundle looks like: no "window" key at all
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summarize(load_bundle(path))


def _refilling_run(tmp_path, refill) -> tuple[list, int]:
    """A loop that fills the same batch tensor every step (`refill(buffer, step)`), a NaN at step 9."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="refill", window=Window(steps=8, every=4))
    buffer = torch.empty(6, 4)
    for step in range(12):
        x = refill(buffer, step)
        fresh = make_batch(step)
        if step == 9:
            x[1, 2] = float("nan")
        nn.functional.mse_loss(model(x), fresh["y"]).backward()
        try:
            mon.check(batch={"x": x, "y": fresh["y"]})
        except NonFiniteError as exc:
            return load_bundle(exc.bundle_path).window_records(), mon._window._batches.copy_cpu
        optimizer.step()
        optimizer.zero_grad()
    raise AssertionError("the planted NaN was not caught")


@pytest.mark.parametrize("how", ["torch copy_", "numpy view"])
def test_a_loop_that_refills_its_batch_tensor_in_place_is_seen(tmp_path, how):
    """NOTE: [window batches]: held by reference until the loop is seen to refill the tensor (its version moved, or
    a new tensor object over the same array); from then on copied, and the steps held before say they lost it."""
    import numpy as np

    array = np.empty((6, 4), dtype=np.float32)

    def refill(buffer, step):
        if how == "torch copy_":
            return buffer.copy_(make_batch(step)["x"])
        array[...] = make_batch(step)["x"].numpy()
        return torch.from_numpy(array)  # a new tensor object each step, over the same memory

    records, copying = _refilling_run(tmp_path, refill)
    assert copying
    by_step = {r.step: r for r in records}
    assert sorted(by_step) == list(range(10))  # states at 0, 4 and 8
    # step 1 revealed the refill: it and every step after it hold their own batch
    for step in range(1, 10):
        want = make_batch(step)["x"]
        if step == 9:
            want[1, 2] = float("nan")
        assert by_step[step].note is None and torch.equal(by_step[step].batch["x"].nan_to_num(7.0),
                                                          want.nan_to_num(7.0)), step
    # step 0, held by reference before it: its tensor was overwritten, so its batch is left out, with the reason
    assert by_step[0].batch is None and "wrote into this step's batch" in by_step[0].note


def test_a_loop_that_trains_on_the_same_unchanged_batch_holds_it_without_copies(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, window=Window(steps=8, every=4))
    fixed = make_batch(0)
    for _ in range(10):
        nn.functional.mse_loss(model(fixed["x"]), fixed["y"]).backward()
        mon.check(batch=fixed)
        optimizer.step()
        optimizer.zero_grad()
    assert not mon._window._batches.copy_cpu
    assert all(s.batch["x"] is fixed["x"] for s in mon._window._steps)


# -- the states on disk (NOTE: [spilled states]) ------------------------------------------------------------------

def _states_of(path, steps) -> dict:
    bundle = load_bundle(path)
    return {step: bundle.window_state(step) for step in steps}


def test_a_window_kept_on_disk_bundles_the_same_states_and_holds_one_in_memory(tmp_path):
    import gc

    spill_dir = tmp_path / "spill"
    mon, starts, _, path = run(tmp_path / "disk", 30, fault_step=19,
                               window=Window(steps=8, every=4, directory=spill_dir))
    _, _, _, memory_path = run(tmp_path / "memory", 30, fault_step=19)
    folder = mon._window.spill.root
    assert folder.parent == spill_dir and folder.name.startswith("nanscan-window-")
    # the ring of R = 3 states on disk, the last kept one's buffers in memory
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"state-{s}.{ext}" for s in (8, 12, 16) for ext in ("json", "safetensors"))
    assert mon._window.nbytes() < 2 * mon._window.spill.nbytes() + 10_000
    disk, memory = _states_of(path, (8, 12, 16)), _states_of(memory_path, (8, 12, 16))
    for step in (8, 12, 16):
        want_model, _ = starts[step]
        assert all(torch.equal(disk[step][0][k], want_model[k]) for k in want_model)
        assert disk[step][1]["state"].keys() == memory[step][1]["state"].keys()
        assert all(torch.equal(a, b) for k in disk[step][1]["state"]
                   for a, b in zip(disk[step][1]["state"][k].values(), memory[step][1]["state"][k].values())
                   if isinstance(a, torch.Tensor))
    assert load_bundle(path).window["states"] == load_bundle(memory_path).window["states"]
    del mon
    gc.collect()
    assert not folder.exists()  # the spill folder goes with the Monitor; the bundle keeps its own files
    assert load_bundle(path).window_state(8)[0].keys() == starts[8][0].keys()


def test_a_state_the_disk_could_not_take_is_left_out_and_said(tmp_path, monkeypatch):
    import nanscan.runtime.spill as spill

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill, "save_state_files", full_disk)
    with pytest.warns(WindowWarning, match="could not write a kept state .*No space left on device"):
        _, _, _, path = run(tmp_path, 30, fault_step=19, window=Window(steps=8, every=4, directory=tmp_path / "s"))
    bundle = load_bundle(path)
    assert bundle.window["states"] == [] and bundle.window["span"] == [8, 19]


def test_a_directory_that_cannot_be_used_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="Window\\(directory=.*file'\\): cannot keep the window's states there"):
        Monitor(make_model(), None, bundle_dir=tmp_path, window=Window(directory=blocker))


def test_an_fp16_gradscaler_runs_overflow_skips_are_in_the_window_with_their_scale(tmp_path):
    """float16 autocast under a GradScaler whose first scale is far too large: its first steps overflow and are
    skipped (expected, no incident), the scale halving each time; then a NaN record. The window holds every step,
    the skipped ones with the scale they carried, and the history says which were skips."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="fp16", scaler=scaler, spikes=None,
                  window=Window(steps=16, every=4))
    with pytest.raises(NonFiniteError) as caught:
        for step in range(40):
            batch = make_batch(step)
            if step == 14:
                batch["x"][1, 2] = float("nan")
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(batch["x"])
            loss = nn.functional.mse_loss(out.float(), batch["y"])
            scaler.scale(loss).backward()
            mon.check(batch=batch, loss=loss)
            scaler.step(optimizer)
            scaler.update()
    assert caught.value.step == 14
    bundle = load_bundle(caught.value.bundle_path)
    records = {r.step: r for r in bundle.window_records()}
    skips = [entry.step for entry in bundle.history() if entry.report.overflow_skip]
    assert skips and set(skips) <= set(records)  # the expected skips are in the window
    scales = [records[s].loss_scale for s in sorted(records)]
    assert all(scale is not None for scale in scales) and scales[0] > scales[-1]
    for step in skips:  # each skip halved the scale the next step carries
        if step + 1 in records:
            assert records[step + 1].loss_scale == records[step].loss_scale / 2
    assert all(r.autocast == {"device_type": "cpu", "dtype": "float16"} for r in records.values())
