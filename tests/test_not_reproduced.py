"""Honest non-reproduction (NOTE: [not reproduced] in nanscan/replay/reproduce.py): a NaN that the training loop
writes into a gradient outside the replay entry (a hook on a weight, an in-place edit after backward) is "not
reproduced by the replay entry", the verdict names what a rerun cannot see with what would tell each apart, and
the hardware is never its conclusion, in the result, the command's output and INCIDENT.md."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import replay_entries as E
from nanscan.bundle import load_bundle
from nanscan.cli.main import main
from nanscan.incident import NOT_REPRODUCED
from nanscan.replay import record_replay, replay
from nanscan.replay.reproduce import UNSEEN_BY_RERUN, replay_markdown
from nanscan.runtime.monitor import Monitor, NonFiniteError
from test_replay_window import diverging_run

ENTRY = f"{E.MODULE}:warmup_regression"
FAULT_AT = 5
# each candidate a rerun cannot see, and the phrase of what tells it apart
CANDIDATES = [("code in the training script outside the replay entry: a hook, an in-place edit",
               "rerun the step in the training process with the loop's own forward"),
              ("a difference in the data pipeline", "the very tensors the forward receives"),
              ("nondeterministic kernels", "a deterministic rerun"),
              ("the hardware", "on another device")]


def hooked_run(tmp_path) -> str:
    """The loop registers a gradient hook of its own on the first weight (the replay entry knows nothing of it),
    which writes a NaN at step FAULT_AT."""
    config = {"lr": 0.01}
    spec = E.build_spec(ENTRY, config)
    model, optimizer = spec.model, spec.make_optimizer()
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, run_id="hooked", config=config, replay_entry=ENTRY,
                      snapshot="cpu", spikes=None)
    current = {"step": 0}

    def poison(grad):
        if current["step"] != FAULT_AT:
            return grad
        grad = grad.clone()
        grad[0, 0] = float("nan")
        return grad

    model[0].weight.register_hook(poison)
    full = E._config(config)
    for step in range(FAULT_AT + 2):
        current["step"] = step
        batch = E.regression_batch(full, step)
        optimizer.zero_grad(set_to_none=True)
        loss = spec.step_fn(model, batch)
        loss.backward()
        try:
            monitor.check(batch=batch, loss=loss, step=step)
        except NonFiniteError as exc:
            return exc.bundle_path
        optimizer.step()
    raise AssertionError("the hook's NaN was not caught")


def _assert_honest(text: str) -> None:
    for candidate, tells in CANDIDATES:
        assert candidate in text and tells in text, candidate
    assert "Nothing here points at the hardware" in text
    assert "points at hardware" not in text and "hardware fault or" not in text


@pytest.mark.filterwarnings("ignore::nanscan.incident.SpikeWarning")
@pytest.mark.parametrize("outside", ["hook", "in-place edit"])
def test_a_nan_the_loop_writes_outside_the_entry_is_not_reproduced_and_names_what_a_rerun_cannot_see(outside,
                                                                                                     tmp_path):
    if outside == "hook":
        path = hooked_run(tmp_path)
    else:  # nanoGPT-style loop: model[0].weight.grad[0, 0] = nan after backward
        path = diverging_run(tmp_path, peak=0.01, steps=30, grad_fault_at=20).bundle_path
    assert load_bundle(path).category == "gradient"
    result = replay(path)
    assert not result.reproduced and result.verdict == NOT_REPRODUCED == "transient"  # the stored key is kept
    assert result.headline().startswith("not reproduced by the replay entry: step ")
    assert f"rerun through {ENTRY} is finite 3 time(s) out of 3" in result.headline()
    assert "hardware" not in result.headline()
    # the hooked run keeps a pre-step snapshot; diverging_run's Monitor does not, which the verdict names first
    assert result.inexact == ([] if outside == "hook" else ["the state at the check, not a pre-step snapshot"])
    _assert_honest(result.explanation())
    record = result.to_dict()
    assert [u["candidate"] for u in record["unseen"]][-len(UNSEEN_BY_RERUN):] == [c for c, _ in UNSEEN_BY_RERUN]


def test_the_verdict_reaches_the_incident_note_and_the_command(tmp_path):
    path = hooked_run(tmp_path)
    result = replay(path)
    assert record_replay(result)
    note = load_bundle(path).incident_text()
    assert "### Replay: not reproduced by the replay entry" in note
    _assert_honest(note)
    assert replay_markdown(result).splitlines()[0] in note
    out = CliRunner().invoke(main, ["replay", str(path), "--no-record"], env={"COLUMNS": "400"})
    assert out.exit_code == 0, out.output
    assert "not reproduced by the replay entry" in out.output
    _assert_honest(out.output)
    data = json.loads(CliRunner().invoke(main, ["replay", str(path), "--no-record", "--json"]).stdout)
    assert data["verdict"] == "transient" and len(data["unseen"]) == len(UNSEEN_BY_RERUN)


def test_a_replay_from_inexact_conditions_names_them_first(tmp_path):
    E.arm_transient(fail_at=5)
    result = replay(E.train("transient", tmp_path, snapshot="none"))
    assert result.inexact == ["the state at the check, not a pre-step snapshot"]
    first, *rest = result.unseen()
    assert "the conditions the replay could not rebuild exactly (the state at the check" in first[0]
    assert "snapshot='cpu'" in first[1] and rest == list(UNSEEN_BY_RERUN)
    _assert_honest(result.explanation())


def test_a_reproduced_failure_names_nothing_unseen(tmp_path):
    result = replay(E.train("sqrt_backward", tmp_path), bisect=False)
    assert result.reproduced and result.unseen() == [] and result.to_dict()["unseen"] == []
    assert "A rerun cannot see" not in result.explanation()
    assert torch.isfinite(torch.tensor(result.runs[0].loss))
