"""`nanscan report`: the summary's facts (JSON), the terminal tables, the self-contained HTML with its plots, and a
clear exit 2 for a bundle that cannot be read."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch import nn

from nanscan import demo as D
from nanscan.bundle import load_bundle
from nanscan.cli import main
from nanscan.monitor import Monitor, NonFiniteError
from nanscan.report import render_html, split_name, summarize


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity tokens, which strict JSON readers reject."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory):
    result = D.run_demo(tmp_path_factory.mktemp("demo"))
    assert result.caught
    return load_bundle(result.bundle_path)


class Magnitude(nn.Module):
    """|x| written as sqrt(x * x): finite forward, but the backward at x = 0 is 0 * inf = NaN."""

    def forward(self, x):
        return torch.sqrt(x * x)


@pytest.fixture(scope="module")
def gradient_bundle(tmp_path_factory):
    """A `gradient` incident from a small model: the loss is finite, the first layer's gradients are not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), Magnitude(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, optimizer, bundle_dir=tmp_path_factory.mktemp("bundles"), run_id="grad-case") as monitor:
        for step in range(3):
            x = torch.randn(16, 4) if step < 2 else torch.zeros(16, 4)  # all-zero rows reach sqrt at 0
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            try:
                monitor.check(batch={"x": x}, loss=loss, sample_ids=list(range(16)))
            except NonFiniteError as exc:
                return load_bundle(exc.bundle_path)
            optimizer.step()
    pytest.fail("the planted backward-only fault did not fire")


@pytest.mark.parametrize("name, expected", [
    ("grad:blocks.0.attn.qkv.weight", ("gradient", "blocks.0.attn.qkv", "blocks.0")),
    ("param:head.weight", ("parameter", "head", "head")),
    ("optim:blocks.1.mlp.0.weight.exp_avg_sq", ("optimizer_state", "blocks.1.mlp.0", "blocks.1")),
    ("grad:0.bias", ("gradient", "0", "0")),
    ("input:weights", ("input", "batch", "batch")),
    ("loss", ("loss", "loss", "loss")),
])
def test_split_name(name, expected):
    assert split_name(name) == expected


def test_report_json_fields(demo_bundle):
    result = CliRunner().invoke(main, ["report", str(demo_bundle.path), "--json"])
    assert result.exit_code == 0, result.output
    s = strict_json(result.stdout)
    assert (s["first_invalid_step"], s["category"], s["run_id"]) == (D.FAULT_STEP, "loss", D.RUN_ID)
    assert [t["name"] for t in s["nonfinite_tensors"]] == ["loss"]
    assert s["groups"] == [{"module": "loss", "layer": "loss", "kinds": {"loss": 1}, "tensors": ["loss"],
                            "nan": 0, "posinf": 1, "neginf": 0, "numel": 1}]
    last, failing = s["last_finite"], s["failing"]
    assert last["step"] == D.FAULT_STEP - 1 and 0 < last["loss"] < 2 and 0 < last["grad_norm"] < 10
    assert failing["loss"] == "inf" and failing["grad_norm"] > 1e30  # finite gradients ~1e35 after inf loss
    weights = s["inputs_at_failure"][0]
    assert weights["name"] == "input:weights" and weights["top_binade"] == 127
    assert weights["absmax"] == D.MISSING_SENTINEL and weights["nan"] == weights["posinf"] == 0
    assert s["exponent_jumps"] and all(j["jump"] >= 8 for j in s["exponent_jumps"])
    assert s["batch"]["sample_ids"][D.FAULT_ROW].startswith("doc-")
    rows = {(r["name"], r["step"]): r for r in s["headroom"]}
    at_failure = rows[("input:weights", D.FAULT_STEP)]["formats"]
    assert at_failure["float32"]["binades_to_overflow"] == 0
    assert at_failure["float16"]["overflow"] == pytest.approx(27 / 449, abs=0.05)  # one record's weights of 449
    assert {r["step"] for r in s["headroom"]} == {D.FAULT_STEP - 1, D.FAULT_STEP}
    assert s["replay_entry"] == D.REPLAY_ENTRY and "manifest.json" not in s["files"]


def test_report_terminal(demo_bundle):
    result = CliRunner().invoke(main, ["report", str(demo_bundle.path)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"first invalid step {D.FAULT_STEP}, category loss" in out
    for text in ("last finite", "input:weights", "3.403e+38", "dtype headroom", "jumps at step"):
        assert text in out


def test_report_html_is_self_contained_with_plots(demo_bundle, tmp_path):
    out = tmp_path / "sub" / "report.html"
    result = CliRunner().invoke(main, ["report", str(demo_bundle.path), "--html", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3  # loss/grad-norm curves, non-finite map, exponent heatmap
    for data in images:
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        assert image.format == "PNG" and image.width >= 600 and image.height >= 300
    assert not re.search(r'(src|href)="(https?:|//)', page)  # nothing fetched from elsewhere
    assert f"first invalid step {D.FAULT_STEP}" in page and "Automatic findings" in page


def test_gradient_incident_groups_by_module(gradient_bundle, tmp_path):
    s = summarize(gradient_bundle)
    assert s["category"] == "gradient" and s["failing"]["loss"] != "nan"
    modules = {g["module"]: g for g in s["groups"]}
    assert set(modules) == {"0"}  # only the layer before the sqrt: its gradient is inf * 0 = NaN or inf
    assert modules["0"]["kinds"] == {"gradient": 1} and modules["0"]["tensors"] == ["grad:0.weight"]
    assert modules["0"]["nan"] + modules["0"]["posinf"] + modules["0"]["neginf"] > 0
    html_path = render_html(gradient_bundle, tmp_path / "grad.html")
    assert html_path.read_text().count("data:image/png;base64,") == 3


def test_unreadable_bundle_exits_2(tmp_path, demo_bundle):
    runner = CliRunner()
    missing = runner.invoke(main, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    assert "cannot read the bundle" in missing.stderr and "does not exist" in missing.stderr

    tampered = tmp_path / "tampered"
    shutil.copytree(demo_bundle.path, tampered)
    data = bytearray((tampered / "history.json").read_bytes())
    data[-3] = ord("7") if data[-3] != ord("7") else ord("8")  # same size, one byte changed
    (tampered / "history.json").write_bytes(bytes(data))
    result = runner.invoke(main, ["report", str(tampered)])
    assert result.exit_code == 2 and "sha256" in result.stderr
    assert "Traceback" not in result.output

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"schema": "other/1"}')
    result = runner.invoke(main, ["report", str(foreign), "--json"])
    assert result.exit_code == 2 and "schema" in result.stderr and result.stdout == ""
