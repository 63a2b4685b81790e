"""Monitor(step_fn=...): the failing step rerun in the training process at its incident (nanscan.runtime.incident_rerun
NOTE: [in-process rerun]). A nanoGPT-style script (module-level globals, accumulation through observe(), bf16
autocast on the CPU, prefetching, no replay entry) names its planted fault in the bundle with no command run; the
rerun leaves the run exactly as it was (weights, optimizer, buffers, RNG streams bit for bit); it starts from the
step's own state under mode="async" through the snapshot, and says why when it cannot; and it never hides the
incident when it fails."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from nanscan import Monitor, NonFiniteError
from nanscan.bundle import load_bundle
from nanscan.bundle.findings import first_bad_module, recorded_findings
from nanscan.bundle.format import RERUN_FINDING
from nanscan.cli.main import main
from nanscan.replay import Replayer, ReplayError

SCRIPT = Path(__file__).parent / "scripts" / "nanogpt_train.py"


def run_script(tmp_path: Path, fault: str, **env) -> dict:
    out = tmp_path / fault / "out.json"
    out.parent.mkdir(parents=True)
    environ = {**os.environ, "NANOGPT_FAULT": fault, "NANOGPT_OUT": str(out), **{k: str(v) for k, v in env.items()}}
    subprocess.run([sys.executable, str(SCRIPT)], check=True, env=environ, timeout=300)
    return json.loads(out.read_text())


def rerun_finding(bundle_dir) -> dict:
    bundle = load_bundle(bundle_dir)
    found = [f for f in bundle.findings() if f["key"] == RERUN_FINDING]
    assert len(found) == 1, [f["key"] for f in bundle.findings()]
    return found[0]


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("script")
    return {fault: run_script(base, fault) for fault in ("overflow", "ignored", "grad_hook")}


def test_an_activation_overflow_is_named_with_its_module_op_line_and_where_it_began(script_runs):
    run = script_runs["overflow"]
    assert run["step"] == 6  # micro-batch 0's loss went NaN, handed over by observe()
    finding = rerun_finding(run["bundle"])
    record = finding["record"]
    assert record["verdict"] == "reproduced" and record["step_fn"] == "__main__:forward"
    began = record["localization"]["overflow_began"]
    assert began["module"] == "transformer.h.1.mlp" and began["module_type"] == "MLP"
    assert record["localization"]["module"] == "transformer.ln_f"
    op = record["op"]
    assert op["op"] == "aten.native_layer_norm" and op["file"].endswith("nanogpt_runs.py")
    assert "self.transformer.ln_f(x)" in op["code"]
    # The rerun ran in the run's precision, re-entered by the Monitor (step_fn enters no autocast).
    assert "bfloat16" in json.dumps(record["localization"]["overflow_began"]["produced"]["dtypes"])
    # Where users look: the error's message, INCIDENT.md, the manifest, the report.
    assert "rerun in process: reproduced" in run["message"] and "transformer.h.1.mlp" in run["message"]
    bundle = load_bundle(run["bundle"])
    text = bundle.incident_text()
    assert "**Where the overflow began:** `transformer.h.1.mlp`" in text and "aten.native_layer_norm" in text
    assert "needs an entry that rebuilds the model" in text
    assert bundle.manifest["rerun"]["step_fn"] == "__main__:forward" and bundle.replay_entry is None
    assert first_bad_module(bundle)[:2] == ("transformer.ln_f (LayerNorm, forward)", RERUN_FINDING)
    assert recorded_findings(bundle)["first_bad_module"]["from"] == RERUN_FINDING
    shown = CliRunner().invoke(main, ["report", run["bundle"]])
    assert shown.exit_code == 0 and "Rerun in process: reproduced (loss)" in shown.output
    assert "first bad module: transformer.ln_f (LayerNorm, forward) (from rerun)" in shown.output
    # The command line's replay has no model code: it needs an entry, and says the rerun already ran.
    with pytest.raises(ReplayError, match="records no replay entry.*the Monitor reran the step in its process "
                                          "through __main__:forward: reproduced"):
        Replayer(run["bundle"])


def test_an_all_ignored_micro_batch_is_named_as_the_cause(script_runs):
    run = script_runs["ignored"]
    record = rerun_finding(run["bundle"])["record"]
    assert record["verdict"] == "reproduced" and record["category"] == "loss"
    assert record["op"]["op"] == "aten.nll_loss_forward"
    cause = record["cause"]
    assert (cause["scope"], cause["path"], cause["ignore_index"]) == ("micro-batch 0", "y", -1)
    assert "every target of micro-batch 0 is -1, the ignore index" in run["message"]


def test_a_one_shot_gradient_hook_is_not_reproduced_and_not_blamed_on_hardware(script_runs):
    run = script_runs["grad_hook"]
    assert run["step"] == 6 and "grad:transformer.h.0.mlp.c_fc.weight" in run["message"]  # the hook's step, tensor
    finding = rerun_finding(run["bundle"])
    assert finding["record"]["verdict"] == "not reproduced"
    assert "not reproduced by the rerun: the cause is outside the forward and backward" in run["message"]
    assert "code in the loop outside step_fn" in finding["body"]
    assert "Nothing here points at the hardware" in finding["body"]
    assert "hardware fault" not in run["message"]
    bundle = load_bundle(run["bundle"])
    assert first_bad_module(bundle)[0] == "(not reproduced by the in-process rerun)"


@pytest.mark.slow  # make test's 15 minutes (a subprocess run or a long training); make test-slow runs it
def test_the_rerun_changes_nothing_of_the_run(tmp_path):
    """With on_invalid="skip" the run goes on after the incident: with and without step_fn, dropout drawing from the
    RNG, the weights and optimizer state after 10 more steps are the same bit for bit."""
    fault = "ignored"  # the rerun reproduces it: both passes run
    common = {"NANOGPT_POLICY": "skip", "NANOGPT_DROPOUT": "0.1", "NANOGPT_ITERS": "16", "NANOGPT_AT": "5"}
    with_rerun = run_script(tmp_path / "with", fault, **common)
    without = run_script(tmp_path / "without", fault, NANOGPT_STEP_FN="0", **common)
    assert with_rerun["iters"] == without["iters"] == 16
    assert with_rerun["rerun"] is not None and without["rerun"] is None
    assert with_rerun["digest"] == without["digest"]
    assert with_rerun["rng"] == without["rng"]


# -- the Monitor's side, in this process ------------------------------------------------------------------------------
class Net(nn.Module):
    """A Linear, a BatchNorm (buffers a training forward moves) and a second Linear (whose weight a test blows up)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def loss_of(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def fit(tmp_path, *, bad_at=3, steps=6, **monitor_options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model, opt, bundle_dir=tmp_path, run_id="net", **monitor_options)
    seen = {}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        batch = {"x": torch.randn(32, 8, generator=g), "y": torch.randn(32, 1, generator=g)}
        if step == bad_at:  # finite, but fc2's output overflows float32: the weights the step starts from
            with torch.no_grad():
                model.fc2.weight.mul_(1e38)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        loss.backward()
        if step == bad_at:
            seen = {"grads": [p.grad.clone() for p in model.parameters()],
                    "buffers": [b.clone() for b in model.buffers()], "rng": torch.get_rng_state()}
        report = mon.check(batch=batch, loss=loss)
        if step == bad_at and mon.mode == "sync":
            seen["after"] = {"grads": [p.grad for p in model.parameters()],
                             "buffers": [b.clone() for b in model.buffers()], "rng": torch.get_rng_state()}
        if getattr(report, "ok", True):
            opt.step()
    mon.close()
    return mon, seen


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs included (the gradients of the failing step hold them)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.is_floating_point() \
        else torch.equal(a, b)


def test_gradients_buffers_and_rng_are_put_back(tmp_path):
    mon, seen = fit(tmp_path, step_fn=loss_of, on_invalid="warn")
    assert mon.rerun is not None and mon.rerun.verdict == "reproduced"
    after = seen["after"]
    assert all(same_bits(a, b) for a, b in zip(seen["grads"], after["grads"], strict=True))
    assert all(same_bits(a, b) for a, b in zip(seen["buffers"], after["buffers"], strict=True))
    assert torch.equal(seen["rng"], after["rng"])
    # bit for bit (NOTE: [bit-exact rerun]): the batch, weights, Adam's state, loss and gradients the check saw
    assert mon.rerun.bitwise["first_difference"] is None and mon.rerun.bitwise["left_out"] == []
    assert mon.rerun.bitwise["compared"] == 2 + 6 + 1 + 6  # input:x, input:y; 6 parameters; the loss; 6 gradients
    assert mon.rerun.localization.phase in ("forward", "loss")  # from the step's finite weights


def test_async_verdicts_rerun_from_the_snapshot_or_say_why_not(tmp_path):
    """Read at the next check, the verdict comes after step 3's update wrote non-finite weights: the rerun loads the
    snapshot of step 3's start and finds the forward's overflow, not a state already broken."""
    mon, _ = fit(tmp_path / "snap", step_fn=loss_of, on_invalid="warn", mode="async", snapshot="cpu")
    assert mon.rerun.verdict == "reproduced", mon.rerun.headline()
    assert mon.rerun.localization.phase in ("forward", "loss")  # from the step's finite weights
    assert mon.rerun.state == "snapshot"
    assert "snapshot='cpu''s copy of the state the step started from" in rerun_finding(mon.bundle_path)["body"]
    mon, _ = fit(tmp_path / "none", step_fn=loss_of, on_invalid="warn", mode="async")
    assert mon.rerun.verdict == "not run" and "snapshot='cpu'" in mon.rerun.reason
    finding = rerun_finding(mon.bundle_path)
    assert finding["title"].startswith("Rerun in process: not run: the verdict was read at next check")
    # replay without an entry does not claim a rerun that did not run (issue 61)
    with pytest.raises(ReplayError, match="in-process rerun through .*loss_of did not run \\(the verdict was read"):
        Replayer(mon.bundle_path)


def test_a_failing_step_fn_never_hides_the_incident(tmp_path):
    def broken(model, batch):
        raise RuntimeError("a bug in step_fn")

    with pytest.raises(NonFiniteError, match="rerun in process: failed: .*a bug in step_fn") as caught:
        fit(tmp_path, step_fn=broken)
    assert caught.value.step == 3 and caught.value.bundle_path is not None
    assert rerun_finding(caught.value.bundle_path)["record"]["verdict"] == "error"


def test_no_batch_and_the_time_limit(tmp_path):
    torch.manual_seed(0)
    model = Net()
    mon = Monitor(model, None, bundle_dir=tmp_path / "nobatch", step_fn=loss_of, on_invalid="warn")
    x = torch.randn(4, 8)
    model(x).sum().backward()
    mon.check(loss=torch.tensor(float("nan")))
    assert mon.rerun.verdict == "not run" and "no batch" in mon.rerun.reason
    mon, _ = fit(tmp_path / "limit", step_fn=loss_of, on_invalid="warn", rerun_timeout=1e-9)
    assert mon.rerun.verdict == "reproduced" and mon.rerun.op is None
    assert any("op pass was left out" in n for n in mon.rerun.notes)


def test_step_fn_settings_are_checked():
    with pytest.raises(TypeError, match="step_fn must be a function"):
        Monitor(Net(), step_fn="forward")
    with pytest.raises(ValueError, match="rerun_timeout"):
        Monitor(Net(), step_fn=loss_of, rerun_timeout=0)


def test_the_same_incident_twice_gives_the_same_bundle(tmp_path):
    """Idempotent: a second identical run keeps the first bundle, and its rerun finding changes no file."""
    fit(tmp_path, step_fn=loss_of, on_invalid="warn")
    step_dir = tmp_path / "net" / "step-3"
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_dir.iterdir() if p.is_file()}
    fit(tmp_path, step_fn=loss_of, on_invalid="warn")
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in step_dir.iterdir() if p.is_file()}
    assert before == after
