"""The in-process diagnosis (Monitor(step_fn=...), nanscan.runtime.incident_diagnosis NOTE: [in-process diagnosis];
issue 59): at the incident, with no replay entry, the Monitor reruns the window in the training process and
changes one factor at a time over it. On karpathy's train.py loop as it is (lr 30) the rerun matches the record
at every step and a learning-rate reduction is confirmed, no precision; its rows are those `nanscan ablate` gives
through a replay entry; an RNN without clipping has clipping confirmed, each confirmed factor checked by running
the loop itself with it; an fp16 run is rerun under its GradScaler; nothing of the run changes (the state at the raise
is bit for bit the one a run without the diagnosis leaves); the time limit, diagnose=False and a run without a window
say what they did."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import karpathy_train as K
import rnn_train as R
from nanscan import Monitor, NonFiniteError, load_bundle
from nanscan import demo as D
from nanscan.bundle.format import DIAGNOSIS_FINDING, WINDOW_REPLAY_FINDING
from nanscan.replay.ablate_window import CONFIRMED, NOT_JUDGED, ablate_window
from nanscan.runtime.window import Window
from nanscan.replay.replayer import Replayer, open_bundle
from nanscan.runtime.window_ablation import TIME_CUT, TIME_SPENT, ablate_over_window
from nanscan.runtime.window_rerun import Lockstep

pytestmark = pytest.mark.filterwarnings("ignore::nanscan.incident.SpikeWarning")
WINDOW = Window(steps=32, every=8)
PRECISIONS = ("fp32", "bf16-autocast", "fp16-autocast")


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    return K.train(K.LR30, tmp_path_factory.mktemp("train-py"), window=WINDOW, step_fn=K.forward_loss)


def test_train_py_is_diagnosed_in_the_process_with_no_entry(diagnosed):
    diagnosis = diagnosed.monitor.diagnosis
    assert diagnosed.nonfinite_step == 27 and diagnosis is not None and diagnosis.verdict == "done"
    window = diagnosis.ablation.baseline.window
    assert window.reproduced and window.first_departure is None, window.departure_text()  # the record, every step
    assert [s.step for s in window.steps] == list(range(28))
    assert any(key.startswith("lr-") for key in diagnosis.fixes), diagnosis.headline()
    assert not set(diagnosis.fixes) & set(PRECISIONS), diagnosis.headline()
    assert diagnosis.headline().startswith("learning rate x") and "too large" in diagnosis.headline()
    message = str(diagnosed.error)
    assert f"diagnosis over the window in process: {diagnosis.headline()}" in message
    bundle = load_bundle(diagnosed.bundle)
    keys = {f["key"] for f in bundle.findings()}
    assert {DIAGNOSIS_FINDING, WINDOW_REPLAY_FINDING, *(f"ablate:window:{k}" for k in diagnosis.fixes)} <= keys
    assert "Diagnosis in process: learning rate x" in (diagnosed.bundle / "INCIDENT.md").read_text()
    assert bundle.manifest["rerun"]["diagnose"] is True


def test_its_rows_are_those_the_replay_entry_gives(diagnosed):
    """The same window judged through the replay entry (`nanscan ablate BUNDLE`): every factor the same verdict,
    but the bisection's, which only the entry's side runs."""
    in_process = {r.factor.key: r.verdict for r in diagnosed.monitor.diagnosis.ablation.rows}
    entry = {r.factor.key: r.verdict for r in ablate_window(diagnosed.bundle, K.ENTRY).rows}
    in_process.pop("drop-suspicious"), entry.pop("drop-suspicious")
    assert in_process == entry


def _state(monitor) -> dict:
    """Everything of the run a diagnosis could change, as bytes."""
    model, optimizer = monitor.model, monitor.optimizer
    raw = lambda t: t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).clone()  # noqa: E731 - NaN: by bits
    state = {f"w:{k}": raw(v) for k, v in model.state_dict().items()}
    state |= {f"g:{n}": raw(p.grad) if p.grad is not None else None for n, p in model.named_parameters()}
    for i, (_, values) in enumerate(sorted(optimizer.state_dict()["state"].items())):
        state |= {f"o:{i}:{k}": raw(v) if torch.is_tensor(v) else v for k, v in values.items()}
    state["rng"] = torch.get_rng_state()
    state["modes"] = [m.training for m in model.modules()]
    state["dtypes"] = [str(p.dtype) for p in model.parameters()]
    state["lrs"] = [g["lr"] for g in optimizer.param_groups]
    return state


def _equal(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_nothing_of_the_run_changes(diagnosed, tmp_path):
    """The state the loop holds when the incident raises, with the diagnosis run and without, bit for bit."""
    plain = K.train(K.LR30, tmp_path, window=WINDOW, step_fn=K.forward_loss, diagnose=False)
    assert plain.monitor.diagnosis is None and plain.nonfinite_step == diagnosed.nonfinite_step
    got, want = _state(diagnosed.monitor), _state(plain.monitor)
    assert got.keys() == want.keys()
    assert [k for k in want if not _equal(got[k], want[k])] == []
    keys = {f["key"] for f in load_bundle(plain.bundle).findings()}
    assert DIAGNOSIS_FINDING not in keys and "diagnosis over the window" not in str(plain.error)


@pytest.mark.slow  # a long run (17 s): make test-slow
def test_an_rnn_without_clipping_has_clipping_confirmed_and_each_fix_holds_in_the_real_loop(tmp_path):
    run = R.train({}, tmp_path, window=WINDOW, step_fn=R.forward_loss)
    diagnosis = run.monitor.diagnosis
    assert run.nonfinite_step == 26 and diagnosis.verdict == "done", diagnosis.headline()
    assert diagnosis.ablation.baseline.window.first_departure is None
    assert "clip-1.0" in diagnosis.fixes, diagnosis.headline()
    settings = {"clip-1.0": {"clip": 1.0}, "bf16-autocast": {"dtype": "bfloat16"},
                "fp16-autocast": {"dtype": "float16"}}
    for key in diagnosis.fixes:  # a confirmed factor is a fix of the loop itself, for 3x the failing step's steps
        change = settings.get(key) or {"lr": R.CONFIG["lr"] * float(key.removeprefix("lr-x"))}
        real = R.train({**change, "iters": 120}, None, monitor=False)
        ended = sorted(real.losses[-10:])[5]
        assert real.nonfinite_step is None and ended < 2 * real.losses[0], (key, ended)


def test_an_fp16_run_under_a_gradscaler_is_diagnosed_with_its_scaling_and_the_fix_holds(tmp_path):
    """train.py in float16 with its GradScaler (overflow skips along the way): the in-process rerun scales,
    unscales and skips as the loop did (NOTE: [replayed scaling]), matching the record at every step, and the
    learning rate it confirms keeps the real fp16 loop finite and training for 3x the failing step's steps."""
    config = {**K.LR30, "learning_rate": 5.0, "dtype": "float16"}
    run = K.train(config, tmp_path, window=WINDOW, step_fn=K.forward_loss)
    diagnosis = run.monitor.diagnosis
    assert diagnosis is not None and diagnosis.verdict == "done", diagnosis
    window = diagnosis.ablation.baseline.window
    assert window.reproduced and window.first_departure is None, window.departure_text()
    assert any(s.skipped for s in window.steps)
    # the failing step alone, rerun at the scale the run's check recorded for it
    recorded = load_bundle(run.bundle, whole_set=False).window_records()[-1].loss_scale
    assert run.monitor.rerun.grad_scale == recorded and recorded > 1 and run.monitor.rerun.reproduced
    lrs = [key for key in diagnosis.fixes if key.startswith("lr-")]
    assert lrs and not set(diagnosis.fixes) & set(PRECISIONS), diagnosis.headline()
    scale = float(lrs[0].removeprefix("lr-x"))
    real = K.train({**config, "learning_rate": 5.0 * scale, "max_iters": 3 * run.nonfinite_step}, None,
                   monitor=False)
    assert real.truth is None or all(math.isfinite(loss) for loss in real.losses), real.losses
    assert sorted(real.losses[-6:])[3] < 2 * real.losses[0], real.losses


def test_the_time_limit_leaves_factors_unjudged_and_says_so(tmp_path):
    run = K.train(K.LR30, tmp_path, window=WINDOW, step_fn=K.forward_loss, diagnose_timeout=1e-6)
    diagnosis = run.monitor.diagnosis
    assert diagnosis.verdict == "done" and diagnosis.ablation.baseline.verdict == "reproduced"  # always runs
    judged = [r for r in diagnosis.ablation.rows if r.verdict not in ("not applied",)]
    assert judged and all(r.verdict == NOT_JUDGED and r.detail == TIME_SPENT for r in judged)
    assert diagnosis.fixes == [] and "diagnose_timeout" in diagnosis.headline()


def test_a_run_without_a_window_says_why_and_bad_settings_are_refused(tmp_path):
    run = K.train(K.LR30, tmp_path, window=None, step_fn=K.forward_loss)
    assert run.monitor.diagnosis.verdict == "not run"
    assert "holds no window" in run.monitor.diagnosis.headline()
    assert "diagnosis over the window in process: not run: the bundle holds no window" in str(run.error)
    with pytest.raises(ValueError, match="diagnose_timeout"):
        K.train(K.LR30, tmp_path / "x", step_fn=K.forward_loss, diagnose_timeout=0)


def test_the_lr_ladder_stops_at_its_first_confirmed_rung(diagnosed):
    rows = [r for r in diagnosed.monitor.diagnosis.ablation.rows if r.factor.key.startswith("lr-")]
    assert rows[-1].verdict == CONFIRMED and all(r.verdict != CONFIRMED for r in rows[:-1])
    assert all(math.isfinite(r.beyond_run) for r in rows)


def test_the_demos_record_past_float32s_range_is_dropped_and_confirmed(tmp_path):
    """`nanscan demo`'s fault: a record whose loss weights are float32's maximum (finite, so no NaN row), at step 80
    row 5. The in-process diagnosis drops the row holding the overflow value and confirms it, and nothing else."""
    config = D.demo_config(tmp_path)
    records = D.make_records(config)
    bad_id = D.plant_fault(records, config)
    D.write_dataset(Path(config["data_path"]), records)
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
        optimizer = D.build_optimizer(model, config)
        mon = Monitor(model, optimizer, bundle_dir=tmp_path / "bundles", run_id="demo", step_fn=D.step_fn,
                      window=Window(steps=8, every=8))
        with pytest.raises(NonFiniteError) as caught:
            for step, (batch, ids) in enumerate(D.batches(D.TokenRecords(config["data_path"], config["seq_len"]),
                                                          config)):
                for group in optimizer.param_groups:
                    group["lr"] = D.lr_at(step, config)
                optimizer.zero_grad(set_to_none=True)
                loss = D.step_fn(model, batch)
                loss.backward()
                mon.check(batch=batch, loss=loss, sample_ids=ids, step=step)
                torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])
                optimizer.step()
    assert caught.value.step == D.FAULT_STEP
    diagnosis = mon.diagnosis
    assert diagnosis.fixes == ["drop-suspicious"], diagnosis.headline()
    (row,) = [r for r in diagnosis.ablation.rows if r.factor.key == "drop-suspicious"]
    assert f"dropped rows [{D.FAULT_ROW}] ({bad_id}) of its batch" in row.detail, row.detail


def _per_record_mean_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Each record's mean cross-entropy over its supervised tokens, then the mean over records: a record with no
    supervised token (every label -100) is 0/0."""
    logits = model(batch["x"])
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["y"], ignore_index=-100,
                                                  reduction="none")
    return (per_token.sum(dim=1) / (batch["y"] != -100).sum(dim=1)).mean()


def test_a_record_with_no_supervised_token_is_dropped_and_confirmed(tmp_path):
    """A record whose labels are all the ignore index (truncation cut its whole answer away) makes a per-record mean
    loss 0/0 at step 6. The in-process diagnosis drops it by the rule a rollback quarantines by
    (engine.targets.breaking_rows), and confirms it, and nothing else: no NaN value is in the batch to point at it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="masked", step_fn=_per_record_mean_loss,
                  window=Window(steps=8, every=4))
    data = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as caught:
        for step in range(12):
            tokens = torch.randint(0, 32, (4, 9), generator=data)
            batch = {"x": tokens[:, :-1], "y": tokens[:, 1:].clone()}
            if step == 6:
                batch["y"][2] = -100
            optimizer.zero_grad(set_to_none=True)
            loss = _per_record_mean_loss(model, batch)
            loss.backward()
            mon.check(batch=batch, loss=loss, step=step)
            optimizer.step()
    assert caught.value.step == 6
    diagnosis = mon.diagnosis
    assert diagnosis.fixes == ["drop-suspicious"], diagnosis.headline()
    (row,) = [r for r in diagnosis.ablation.rows if r.factor.key == "drop-suspicious"]
    assert "dropped rows [2] of its batch" in row.detail, row.detail


class _ClockAfter(Lockstep):
    """A clock whose time is up from its `calls`-th question on: the time limit without waiting for it."""

    def __init__(self, calls: int):
        self.calls, self.asked = calls, 0

    def time_up(self, deadline):
        if deadline is None:  # the unchanged window runs whole
            return False
        self.asked += 1
        return self.asked > self.calls


@pytest.mark.parametrize("calls, rerun, beyond", [(4, 3, 0), (32, 28, 3)])
def test_the_time_limit_cuts_a_factor_short_wherever_it_runs(diagnosed, calls, rerun, beyond):
    """The clock is asked before each factor and at each of its steps, in the window (28 steps here) and past it:
    the first factor (lr x0.5, finite over the window) is cut where the time ran out, unjudged, and every factor
    after it is left out."""
    replayer = Replayer(open_bundle(diagnosed.bundle), K.ENTRY)
    result = ablate_over_window(replayer, replayer.build(), [], suspicious="none", deadline=0.0,
                                lockstep=_ClockAfter(calls))
    first, *rest = [r for r in result.rows if r.verdict != "not applied"]
    assert (first.factor.key, first.verdict, first.detail) == ("lr-x0.5", NOT_JUDGED, TIME_CUT)
    assert (len(first.window.steps), first.beyond_run) == (rerun, beyond)
    assert rest and all(r.verdict == NOT_JUDGED and r.detail == TIME_SPENT for r in rest)
