"""Replay of bundles written by a real Monitor on planted faults: reproduction, persistent vs not reproduced,
localization of the first bad module and phase, bisection to the poisoned sample, and an idempotent ledger."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import pytest
import replay_entries as E
import torch
from click.testing import CliRunner
from rich.console import Console
from torch import nn

from nanscan.bundle import load_bundle
from nanscan.cli.main import main
from nanscan.replay import (Replayer, ReplayError, StepOptions, StepOutcome, bisect_samples, ddmin, localize,
                            record_replay, replay, run_step, select_samples)
from nanscan.replay.cli import print_replay
from nanscan.replay.reproduce import replay_markdown, verdict_of
from nanscan.replay.step import deterministic_algorithms, run_localized


def test_masked_attention_row_is_localized_to_softmax_forward(tmp_path):
    result = replay(E.train("masked_attention", tmp_path))
    assert result.bundle_category == "loss"
    assert result.reproduced and result.verdict == "persistent"
    loc = result.localization
    assert (loc.phase, loc.module, loc.module_type) == ("forward", "attn.softmax", "Softmax")
    # the -inf of the mask came in, the NaN was made here
    assert loc.received.neginf > 0 and loc.received.nan == 0
    assert loc.produced.nan > 0
    assert result.bisect.indices == [E.MASKED_ROW]
    assert result.bisect.sample_ids == [f"s003-{E.MASKED_ROW:02d}"]


def test_sqrt_at_zero_is_localized_to_backward_only(tmp_path):
    result = replay(E.train("sqrt_backward", tmp_path))
    first = result.runs[0]
    assert result.bundle_category == "gradient" and first.category == "gradient"
    assert math.isfinite(first.loss)
    loc = result.localization
    assert (loc.phase, loc.module, loc.module_type) == ("backward", "mag", "Magnitude")
    assert loc.received.nonfinite == 0 and loc.received.absmax > 0  # its output gradient was finite
    assert loc.produced.nan > 0
    assert result.bisect.indices == [E.ZERO_ROW]


def test_fp16_overflow_is_localized_to_the_matmul(tmp_path):
    result = replay(E.train("fp16_overflow", tmp_path))
    loc = result.localization
    assert (loc.phase, loc.module, loc.module_type) == ("forward", "proj", "Linear")
    assert loc.received.dtypes == ("float16",) and loc.received.nonfinite == 0
    assert 1000 < loc.received.absmax <= 65504  # finite, large inputs ...
    assert loc.produced.inf > 0  # ... whose products overflow float16
    assert result.runs[0].param_dtypes == ["float16"]


def test_transient_fault_does_not_come_back(tmp_path):
    E.arm_transient(fail_at=5)
    path = E.train("transient", tmp_path)
    assert load_bundle(path).step == 5
    result = replay(path)
    assert not result.reproduced
    assert result.verdict == "transient"
    assert all(run.finite for run in result.runs) and len(result.runs) == 3
    assert result.localization is None and result.bisect is None
    assert result.headline().startswith("not reproduced by the replay entry: step 5 rerun through")


def test_bisect_finds_the_one_poisoned_sample(tmp_path):
    path = E.train("poisoned_sample", tmp_path)
    result = replay(path)
    assert result.bisect.applicable
    assert result.bisect.indices == [E.POISON_ROW]
    assert result.bisect.sample_ids == [f"s003-{E.POISON_ROW}"]
    assert result.bisect.batch_size == 16
    assert result.bisect.trials <= 12  # halving, not one trial per sample
    # finite inputs, finite module outputs: the overflow is the squared error in step_fn
    assert (result.localization.phase, result.localization.module) == ("loss", "step_fn")


def test_nan_in_the_batch_is_localized_to_the_input(tmp_path):
    path = E.train("poisoned_sample", tmp_path, config={"poison": "nan"})
    result = replay(path)
    assert result.bundle_category == "input" and result.runs[0].category == "input"
    assert result.localization.phase == "input" and result.localization.module == "batch"
    assert result.runs[0].nonfinite[0] == "input:x"
    assert result.bisect.indices == [E.POISON_ROW]


def test_replay_from_state_at_the_failing_step(tmp_path):
    result = replay(E.train("masked_attention", tmp_path, snapshot="none"), bisect=False)
    assert result.state == "at the failing step"
    assert any("no pre-step snapshot" in n for n in result.notes)
    assert result.reproduced and result.localization.module == "attn.softmax"
    assert result.bisect is None


def test_replay_is_recorded_once(tmp_path):
    path = E.train("sqrt_backward", tmp_path)
    result = replay(path)
    assert record_replay(result) is True
    again = replay(path)
    assert record_replay(again) is False  # the same replay of the same bundle: one record
    bundle = load_bundle(path)  # still valid: every hash rewritten
    replays = [f for f in bundle.findings() if f["key"] == "replay"]
    assert len(replays) == 1
    assert replays[0]["record"]["localization"]["module"] == "mag"
    text = bundle.incident_text()
    assert text.count("### Replay:") == 1
    assert "**First bad module:** `mag` (Magnitude), backward" in text


def test_cli_replay_json_and_idempotent_record(tmp_path):
    path = E.train("poisoned_sample", tmp_path)
    runner = CliRunner()
    first = runner.invoke(main, ["replay", str(path), "--json"])
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    assert data["reproduced"] is True and data["verdict"] == "persistent" and data["recorded"] is True
    assert data["runs"][0]["loss"] == "inf"  # strict JSON: non-finite floats as strings
    assert data["bisect"]["sample_ids"] == [f"s003-{E.POISON_ROW}"]
    second = runner.invoke(main, ["replay", str(path), "--json"])
    assert json.loads(second.stdout)["recorded"] is False
    text = runner.invoke(main, ["replay", str(path), "--no-bisect", "--no-record"])
    assert text.exit_code == 0 and "reproduced, persistent" in text.output


def test_missing_entry_is_a_clear_error_and_entry_overrides(tmp_path):
    path = E.train("masked_attention", tmp_path, entry=False)
    runner = CliRunner()
    failed = runner.invoke(main, ["replay", str(path)])
    assert failed.exit_code == 1
    assert "records no replay entry" in failed.output and "--entry" in failed.output
    ok = runner.invoke(main, ["replay", str(path), "--entry", f"{E.MODULE}:masked_attention", "--json",
                              "--no-bisect"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["localization"]["module"] == "attn.softmax"


def test_an_entry_for_another_model_is_refused(tmp_path):
    path = E.train("masked_attention", tmp_path)
    with pytest.raises(ReplayError, match="does not match the state"):
        replay(path, f"{E.MODULE}:sqrt_backward")


def test_hooks_are_removed_after_a_localized_step():
    model = E.SqrtModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = E.sqrt_batch({"seed": 0, "fault_step": 0, "batch_size": 4}, 0)
    outcome = run_step(model, optimizer, E.sqrt_step, batch, localize=True)
    assert outcome.localization.module == "mag"
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks and not module._backward_pre_hooks
    assert all(not p._backward_hooks for p in model.parameters())


def test_inplace_modules_fall_back_to_parameter_gradients():
    # nn.ReLU(inplace=True) refuses full backward hooks; without them the forward pass is still localized
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e38)
    batch = {"x": torch.ones(2, 4), "y": torch.zeros(2, 1)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def attempt(backward_module_hooks):
        return run_step(model, optimizer, E.sqrt_step, batch, localize=True,
                        backward_module_hooks=backward_module_hooks)

    assert "BackwardHookFunction" in attempt(True).error
    outcome = run_localized(attempt)
    assert outcome.error is None and not outcome.finite
    loc = outcome.localization
    assert (loc.module, loc.phase) == ("0", "forward")
    assert loc.received.absmax == 1.0 and loc.parameters.absmax == pytest.approx(3e38, rel=1e-6)
    assert loc.produced.posinf == 8
    assert any("backward hooks could not be used" in n for n in outcome.notes)


def test_select_samples_slices_every_tensor_with_the_batch_dimension():
    batch = {"x": torch.arange(12.0).view(6, 2), "ids": torch.arange(6), "scale": torch.tensor(2.0),
             "pair": (torch.zeros(6, 3), torch.ones(4))}
    picked = select_samples(batch, [1, 4])
    assert picked["x"].tolist() == [[2.0, 3.0], [8.0, 9.0]]
    assert picked["ids"].tolist() == [1, 4]
    assert picked["scale"].item() == 2.0
    assert picked["pair"][0].shape == (2, 3) and picked["pair"][1].shape == (4,)  # not a sample dimension
    assert isinstance(picked["pair"], tuple)


@pytest.mark.parametrize("culprits", [{7}, {3, 9}, {0, 15}, {5, 6, 12}])
def test_ddmin_finds_exactly_the_samples_that_fail_together(culprits):
    found, trials = ddmin(list(range(16)), lambda subset: culprits <= set(subset))
    assert sorted(found) == sorted(culprits)
    assert trials < 64


def test_verdict_tells_persistent_transient_and_intermittent():
    def outcome(finite, names=("loss",)):
        return StepOutcome(finite, None if finite else "loss", 1.0, [] if finite else list(names), None, None,
                           None, ["float32"])

    assert verdict_of([outcome(False)] * 3) == "persistent"
    assert verdict_of([outcome(True)] * 3) == "transient"
    assert verdict_of([outcome(False), outcome(True), outcome(False)]) == "intermittent"
    assert verdict_of([outcome(False), outcome(False, ("grad:w",)), outcome(False)]) == "intermittent"


def test_deterministic_settings_are_restored():
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_localize_and_bisect_as_library_calls(tmp_path):
    path = E.train("masked_attention", tmp_path)
    assert localize(path).module == "attn.softmax"
    replayer = Replayer(path)
    assert replayer.sample_count == 16
    assert bisect_samples(replayer, StepOptions()).indices == [E.MASKED_ROW]
    # the whole batch but the masked row is finite, under the same state and RNG states
    rest = [i for i in range(16) if i != E.MASKED_ROW]
    assert replayer.run(samples=rest).finite


@pytest.mark.slow
def test_demo_bundle_replays_with_no_extra_arguments(tmp_path):
    from nanscan.demo import FAULT_ROW, run_demo

    demo = run_demo(tmp_path / "demo")
    assert demo.caught
    result = CliRunner().invoke(main, ["replay", demo.bundle_path, "--json", "--no-record"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["reproduced"] and data["verdict"] == "persistent"
    assert data["localization"]["module"] == "loss_fn" and data["localization"]["phase"] == "forward"
    assert data["bisect"]["indices"] == [FAULT_ROW]
    assert data["bisect"]["sample_ids"] == [demo.planted_record]


# -- what a replay may conclude, and what it may not -------------------------------------------------------------

@pytest.fixture(scope="module")
def poisoned_bundle(tmp_path_factory):
    return E.train("poisoned_sample", tmp_path_factory.mktemp("poisoned"))


def test_backward_nan_made_in_the_models_own_code_is_not_put_on_step_fn(tmp_path):
    # torch.sqrt written inline in the model's forward: no submodule's backward makes the NaN, the model's does
    result = replay(E.train("inline_sqrt", tmp_path), bisect=False)
    loc = result.localization
    assert (loc.phase, loc.module, loc.module_type) == ("backward", "", "InlineSqrtModel")
    assert loc.received.nonfinite == 0 and loc.produced.nan > 0
    assert "gradient it passed back to lin1" in loc.detail
    assert "first bad: (model) (InlineSqrtModel, backward)" in result.headline()


def test_a_subset_that_cannot_run_is_not_counted_as_failing(tmp_path):
    # the step splits the batch into 4 micro-batches: a subset of 2 or 3 samples raises instead of running
    path = E.train("micro_batched", tmp_path)
    result = replay(path)
    found = result.bisect
    assert E.POISON_ROW in found.indices
    assert not found.minimal and "is invalid for input of size" in found.errors[0]
    assert "not shown to be the fewest" in found.describe()
    outcome = Replayer(path).run(samples=found.indices)
    assert outcome.error is None and not outcome.finite  # the subset shown really fails, it does not just raise


def test_a_fault_of_the_whole_batch_is_not_pinned_on_some_samples(tmp_path):
    path = E.train("batch_statistics", tmp_path)
    result = replay(path)
    assert (result.localization.module, result.localization.phase) == ("0", "forward")
    found = result.bisect
    assert found.indices == list(range(E.BATCH_SIZE)) and found.minimal
    assert "needs all 16 samples together" in found.describe()
    record_replay(result)
    assert "No smaller subset fails: the failure needs all 16 samples together" in load_bundle(path).incident_text()


def test_a_step_that_raises_is_an_error_not_a_reproduction(poisoned_bundle):
    entry = f"{E.MODULE}:loss_not_a_tensor"
    with pytest.raises(ReplayError, match="raised an error instead of running: step_fn returned float"):
        replay(poisoned_bundle, entry)
    out = CliRunner().invoke(main, ["replay", str(poisoned_bundle), "--entry", entry])
    assert out.exit_code == 1 and "fix the replay entry" in out.output
    assert not [f for f in load_bundle(poisoned_bundle).findings() if f["key"] == "replay"]


# An entry that is wrong (usage: exit 2) against one whose code raises while it runs (a failure: exit 1).
@pytest.mark.parametrize("entry, message, status", [
    ("no_model", "model is NoneType, not a torch.nn.Module", 2),
    ("optimizer_factory_returns_a_name", "optimizer factory returned str", 2),
    ("optimizer_factory_raises", "optimizer factory of replay entry 'replay_entries:optimizer_factory_raises' "
                                 "raised KeyError: 'missing'", 1),
    ("NOT_A_FUNCTION", "names an object of type int, not a function", 2),
    ("missing_function", "has no attribute 'missing_function'", 2),
])
def test_an_entry_that_breaks_the_contract_is_named_without_a_traceback(poisoned_bundle, entry, message, status):
    out = CliRunner().invoke(main, ["replay", str(poisoned_bundle), "--entry", f"{E.MODULE}:{entry}", "--no-record"])
    assert out.exit_code == status and message in out.output, out.output or repr(out.exception)


def test_an_optimizer_that_raises_is_an_outcome_not_a_crash():
    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("fused kernel missing")

    model = E.SqrtModel()
    batch = E.sqrt_batch({"seed": 0, "fault_step": -1, "batch_size": 4}, 0)
    outcome = run_step(model, Broken(model.parameters(), lr=0.1), E.sqrt_step, batch)
    assert outcome.error == "optimizer.step() raised RuntimeError: fused kernel missing" and not outcome.finite


def test_a_failure_on_some_replays_is_counted_as_it_came(tmp_path):
    E.arm_transient(fail_at=5)
    path = E.train("transient", tmp_path)
    E.arm_transient(fail_at=1)  # the second replay's forward call, and only it
    result = replay(path)
    assert [run.finite for run in result.runs] == [True, False, True]
    assert result.verdict == "intermittent" and result.reproduced
    assert result.headline().startswith("reproduced 1 time(s) out of 3, intermittent: loss")
    assert result.same_category and result.bisect.reason.startswith("the failure is intermittent")


def test_not_reproduced_never_blames_the_hardware(tmp_path):
    """NOTE: [not reproduced]: exact conditions or not, the hardware is one candidate among those a rerun cannot
    see, never the conclusion; inexact conditions are named first."""
    E.arm_transient(fail_at=5)
    exact = replay(E.train("transient", tmp_path / "cpu"))
    assert exact.inexact == [] and "points at hardware" not in exact.explanation()
    assert "Nothing here points at the hardware" in exact.explanation()
    E.arm_transient(fail_at=5)
    result = replay(E.train("transient", tmp_path / "none", snapshot="none"))
    assert result.verdict == "transient" and result.inexact == ["the state at the check, not a pre-step snapshot"]
    assert "from inexact conditions" in result.headline()
    markdown = replay_markdown(result)
    assert markdown.index("the conditions the replay could not rebuild exactly") < markdown.index("the hardware:")
    assert "points at hardware" not in markdown


def test_without_recorded_rng_every_replay_draws_the_same(tmp_path, monkeypatch):
    import nanscan.runtime.monitor
    import nanscan.runtime.verdict

    # at the step's start (the Monitor's forward pre-hook) and at the incident (nanscan.runtime.verdict)
    for module in (nanscan.runtime.monitor, nanscan.runtime.verdict):
        monkeypatch.setattr(module, "capture_rng", lambda *args, **kwargs: {})
    path = E.train("poisoned_sample", tmp_path)
    monkeypatch.undo()
    replayer = Replayer(path, f"{E.MODULE}:rng_draws")
    assert replayer.rng is None and replayer.inexact == ["no RNG state"]
    E.DRAWS.clear()
    replayer.run()
    torch.rand(7)  # the process's generators move on between replays, as they do in a long session
    replayer.run()
    assert len(E.DRAWS) == 2 and E.DRAWS[0] == E.DRAWS[1]


def test_replay_output_prints_error_text_as_written(poisoned_bundle):
    result = replay(poisoned_bundle, bisect=False)
    result.runs[1] = dataclasses.replace(result.runs[1], finite=False, category="loss",
                                         error="step_fn raised KeyError: '[/data] shard 3 [bold]'")
    console = Console(file=io.StringIO(), width=300)
    print_replay(result, console)
    assert "KeyError: '[/data] shard 3 [bold]'" in console.file.getvalue()
