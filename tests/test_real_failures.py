"""Twelve NaN failures users reported, reproduced small on the CPU (tests/real_failures.py), each caught by a real
Monitor and replayed: the step and category, the first bad module, the first bad op and the source line that called
it (where the NaN was computed, not read from the data), and a bisection that names a sample only when it is to
blame."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import real_failures as R
import torch
from click.testing import CliRunner
from torch import nn

from nanscan.bundle import load_bundle
from nanscan.cli.main import main
from nanscan.runtime.monitor import Monitor, NonFiniteError
from nanscan.preflight import run_preflight
from nanscan.replay import record_replay, replay
from nanscan.review.summary import summarize

SOURCE = Path(R.__file__).read_text().splitlines()
NOT_SPECIFIC = "not sample-specific"
FEWER = "fewer than 2 samples"


def line_of(fragment: str) -> int:
    """The line of tests/real_failures.py holding `fragment` (exactly one)."""
    found = [i + 1 for i, text in enumerate(SOURCE) if fragment in text]
    assert len(found) == 1, f"{fragment!r} is on lines {found} of real_failures.py"
    return found[0]


# name: step, category, first bad module (label, phase), op, the calling line, what bisection says
CASES = {
    "nan_feature": (2, "input", ("batch", "input"), None, None, [R.BAD_ROW]),
    "all_labels_ignored": (2, "loss", ("step_fn", "loss"), "aten.nll_loss_forward",
                           "return F.cross_entropy(logits.view(-1, VOCAB), batch[\"labels\"]", NOT_SPECIFIC),
    "zero_token_count": (2, "loss", ("step_fn", "loss"), "aten.div", "/ mask.sum()  # the count", NOT_SPECIFIC),
    "fully_masked_row": (2, "loss", ("attn", "forward"), "aten._softmax", "weights = torch.softmax(scores",
                         [R.BAD_ROW]),
    "minibatch_std_of_one": (2, "loss", ("mbstd", "forward"), "aten.std", "std = torch.std(x, dim=0", FEWER),
    "log_of_softmax": (2, "loss", ("(model)", "forward"), "aten.log", "return -torch.log(probs.gather",
                       [R.BAD_ROW]),
    "distance_at_zero": (2, "gradient", ("step_fn", "backward"), "SqrtBackward0",
                         "return torch.sqrt((d ** 2).sum(-1)).mean()", [R.BAD_ROW]),
    "masked_nan_targets": (2, "input", ("batch", "input"), None, None, [R.OTHER_BAD_ROW, R.BAD_ROW]),
    "t5_fp16_overflow": (2, "loss", ("ff.wo", "forward"), "aten.mm", "return self.wo(torch.relu(self.wi(h)))",
                         NOT_SPECIFIC),
    "empty_history": (2, "loss", ("pool", "forward"), "aten.div", "/ mask.sum(1, keepdim=True)", [R.BAD_ROW]),
    "large_lr": (20, "loss", ("step_fn", "loss"), "aten.mse_loss", "return F.mse_loss(model(batch[\"x\"]), batch",
                 NOT_SPECIFIC),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_reported_failure_is_caught_and_explained(name, tmp_path):
    step, category, (label, phase), op, fragment, bisected = CASES[name]
    path = R.train(name, tmp_path)
    bundle = load_bundle(path)
    assert (bundle.step, bundle.category) == (step, category)
    result = replay(path)
    assert result.reproduced and result.verdict == "persistent" and not result.phase_errors
    assert (result.localization.label, result.localization.phase) == (label, phase)
    if op is None:  # the batch was non-finite: the record is named, no op
        assert result.op is None
    else:
        site = result.op
        assert site.op == op and site.label == label
        assert Path(site.file).name == "real_failures.py" and site.line == line_of(fragment)
        assert site.code == SOURCE[site.line - 1].strip()
        assert site.received.nonfinite == 0 or (site.received.nan == 0 and site.produced.nan > 0)
        assert site.produced.nonfinite > 0
        assert f"op {op} at " in result.headline()
    found = result.bisect
    if isinstance(bisected, list):
        assert found.applicable and found.indices == bisected and found.rest_passes
        assert found.sample_ids == [f"{name}-{step}-{row}" for row in bisected]
    else:
        assert not found.applicable and not found.indices and bisected in found.describe()
        assert found.sample_specific is (False if bisected == NOT_SPECIFIC else None)


def test_the_batch_size_comes_from_the_recorded_sample_ids(tmp_path):
    # one real image beside 8 generated ones: the most common leading size (8) is not the number of samples (1)
    path = R.train("minibatch_std_of_one", tmp_path)
    from nanscan.replay import Replayer

    replayer = Replayer(path)
    assert replayer.sample_count == 1
    assert "fewer than 2 samples" in replay(path).bisect.reason


def test_an_op_found_by_replay_reaches_the_report_and_the_incident_note(tmp_path):
    path = R.train("log_of_softmax", tmp_path)
    result = replay(path)
    record_replay(result)
    bundle = load_bundle(path)
    text = bundle.incident_text()
    assert "**First bad op:** `aten.log` (called as `torch.log`), forward, in `(model)` (Classifier)" in text
    assert f"real_failures.py:{line_of('return -torch.log(probs.gather')}" in text
    op = summarize(bundle)["findings"]["replay"]["first_bad_op"]
    assert (op["op"], op["label"], op["call"]) == ("aten.log", "(model)", "torch.log")
    out = CliRunner().invoke(main, ["report", str(path)])
    assert out.exit_code == 0 and "first bad op: aten.log (called as torch.log)" in out.output
    html = tmp_path / "report.html"
    assert CliRunner().invoke(main, ["report", str(path), "--html", str(html)]).exit_code == 0
    assert "first bad op: aten.log" in html.read_text()


def test_an_error_in_bisection_keeps_reproduction_and_localization(tmp_path):
    path = R.train("fully_masked_row", tmp_path)
    out = CliRunner().invoke(main, ["replay", str(path), "--json", "--no-record", "--entry",
                                    f"{R.MODULE}:fully_masked_row_broken_select"])
    assert out.exit_code == 0, out.output
    found = json.loads(out.stdout)
    assert found["reproduced"] and found["verdict"] == "persistent"
    assert (found["localization"]["label"], found["localization"]["phase"]) == ("attn", "forward")
    assert found["op"]["op"] == "aten._softmax"
    assert found["bisect"] is None
    [failed] = found["phase_errors"]
    assert failed["phase"] == "bisection" and "select_samples raised ValueError" in failed["error"]
    text = CliRunner().invoke(main, ["replay", str(path), "--no-record", "--entry",
                                     f"{R.MODULE}:fully_masked_row_broken_select"])
    assert text.exit_code == 0 and re.search(r"warning: bisection failed, the results above stand", text.output)
    assert "first bad op: aten._softmax" in text.output


def test_a_batch_of_integer_tokens_is_not_declared_innocent(tmp_path):
    """Its labels are all -100: the incident note names them as the cause (NOTE: [no supervised tokens]); the
    report, which reads no batch, says an integer batch can still make the loss 0/0."""
    path = R.train("all_labels_ignored", tmp_path)
    meaning = summarize(load_bundle(path))["category_meaning"]
    assert ("The batch holds only integer tensors: none of them can be NaN, but targets that are all the loss's "
            "ignore index would still make a mean loss 0/0.") in meaning
    assert "none was given" not in meaning
    assert ("Likely cause: every target of the batch (`labels`, 48 value(s)) is -100, the ignore index: a mean "
            "cross-entropy over no tokens is 0/0.") in load_bundle(path).incident_text()


def test_an_update_that_writes_inf_is_dated_to_it_and_its_trap_named(tmp_path):
    # model.half() + Adam(eps=1e-8): eps is 0 in float16, the first update divides by 0
    path = R.train("half_adam", tmp_path)
    bundle = load_bundle(path)
    assert (bundle.step, bundle.category, bundle.manifest["reason"]) == (0, "update", "optimizer_update")
    assert bundle.manifest["state"]["pre_step"]  # the weights that update read, for replay
    assert "written by the optimizer update of step 0" in bundle.incident_text()
    result = replay(path)
    assert result.reproduced and result.runs[0].category == "update" and result.same_category
    assert (result.localization.phase, result.localization.module) == ("update", "Adam")
    assert result.update["broken"] and all(n.startswith(("param:", "optim:")) for n in result.update["broken"])
    [trap] = result.update["traps"]
    assert (trap["setting"], trap["dtype"], trap["severity"]) == ("eps", "float16", "breaks")
    assert "eps rounds to 0 in float16" in trap["text"] and "eps rounds to 0 in float16" in result.headline()
    assert not result.bisect.applicable and NOT_SPECIFIC in result.bisect.reason
    record_replay(result)
    out = CliRunner().invoke(main, ["report", str(path)])
    assert out.exit_code == 0 and "update trap (breaks): param group 0: eps=1e-08" in out.output


def test_without_the_post_update_check_the_same_fault_is_a_parameter_one_step_late(tmp_path):
    path = R.train("half_adam", tmp_path, post_update=False)
    bundle = load_bundle(path)
    assert (bundle.step, bundle.category) == (1, "parameter")


def test_the_post_update_check_in_async_mode_is_read_at_the_next_check(tmp_path):
    spec = R.half_adam({})
    optimizer = spec.make_optimizer()
    monitor = Monitor(spec.model, optimizer, bundle_dir=tmp_path, mode="async", snapshot="cpu", spikes=None)
    batch = R.half_batch({}, 0)
    spec.step_fn(spec.model, batch).backward()
    monitor.check(batch=batch, loss=spec.step_fn(spec.model, batch).detach())
    optimizer.step()  # writes inf: nothing is read yet in async mode
    optimizer.zero_grad()
    spec.step_fn(spec.model, batch).backward()
    with pytest.raises(NonFiniteError, match="optimizer update of step 0") as caught:
        monitor.check(batch=batch)
    assert (caught.value.step, caught.value.category) == (0, "update")
    assert load_bundle(caught.value.bundle_path).manifest["reason"] == "optimizer_update"


def test_preflight_flags_an_eps_that_is_zero_in_the_parameters_dtype():
    report = run_preflight(R.half_adam({}), steps=2)
    assert not report.go
    assert any("eps=1e-08 with 4 float16 parameter(s): eps rounds to 0 in float16" in r for r in report.reasons)
    healthy = run_preflight(R.nan_feature({}), steps=2)
    assert not any("optimizer:" in r for r in healthy.reasons + healthy.warnings)



@pytest.mark.parametrize("post_update, caught, seen", [("auto", (0, "update"), "seen at the check of step 1"),
                                                       (True, (0, "update"), "right after optimizer.step()"),
                                                       (False, (1, "parameter"), "at step 1")])
def test_post_update_auto_dates_float32_updates(post_update, caught, seen, tmp_path):
    # float32 weights, a step so large it overflows: "auto" dates float32 updates at the next check, which scans
    # them anyway (nanscan.runtime.update NOTE: [dated updates]); True scans right after the update
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e38)
    monitor = Monitor(model, optimizer, bundle_dir=tmp_path, spikes=None, post_update=post_update)
    with pytest.raises(NonFiniteError) as err:
        for step in range(3):
            optimizer.zero_grad()
            x = torch.full((2, 4), 100.0)
            loss = model(x).pow(2).mean()
            loss.backward()
            monitor.check(batch={"x": x}, loss=loss)
            optimizer.step()
    assert (err.value.step, err.value.category) == caught and seen in str(err.value)
    assert (monitor._updates is None) == (post_update is False)
