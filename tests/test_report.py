"""`nanscan report`: the summary's facts (JSON), the terminal tables, the self-contained HTML with its plots, a
clear exit 2 for a bundle that cannot be read, unusual bundles (no history, non-finite statistics, sample ids of
any JSON shape, names that look like markup or TeX), and a run that rolled back (the steps it abandoned marked in
the tables and on the plots)."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file, save
from torch import nn

from nanscan.engine import _layout as L
from nanscan import Rollback, RollbackWarning
from nanscan import demo as D
from nanscan.bundle import load_bundle
from nanscan.bundle.history import history_payload
from nanscan.cli.main import main
from nanscan.runtime.monitor import Monitor, NonFiniteError
from nanscan.review.html_page import render_html
from nanscan.review.plots import plot_curves, plot_exponent_heatmap
from nanscan.review.summary import load_history, split_name, summarize
from nanscan.review.text import divergence_cells

from test_rollback import broken_run, rollbacks


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
    assert (s["first_invalid_step"], s["category"], s["run_id"]) == (D.FAULT_STEP, "input", D.RUN_ID)
    assert s["reason"] == "input_overflow" and "beyond the range" in s["category_meaning"]
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
    assert f"first invalid step {D.FAULT_STEP}, category input" in out
    for text in ("last finite", "input:weights", "3.403e+38", "if stored in another dtype", "jumps at step",
                 "grad norm", "replay: "):
        assert text in out
    # each headroom row says the tensor's own dtype (the demo trains in float32)
    assert re.search(r"input:weights\s+f32\s+80\s", out), out


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


# -- bundles that are unusual, damaged or hostile --------------------------------------------------------------

def _bundle(root, batch_at, *, sample_ids=None, steps: int = 3):
    """A small input-category bundle: `batch_at(step)` is the batch; the last step's holds a NaN."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    with Monitor(model, bundle_dir=root, run_id="small", on_invalid="raise") as monitor:
        for step in range(steps):
            batch = batch_at(step)
            x = next(iter(batch.values()))
            if step == steps - 1:
                x[0, 0] = float("nan")
            loss = model(x).sum()
            loss.backward()
            try:
                monitor.check(batch=batch, loss=loss, sample_ids=sample_ids)
            except NonFiniteError as exc:
                return load_bundle(exc.bundle_path)
    pytest.fail("the planted NaN did not fire")


def _replace_member(root, name: str, data: bytes) -> None:
    """Change a bundle file and record its new sha256, as a hostile sender (or a buggy writer) would."""
    (root / name).write_bytes(data)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("sample_ids, shown", [
    ({"shard": "s-7", "rows": [3, 4]}, "1 samples: {'shard': 's-7', 'rows': [3, 4]}"),
    ("doc-17", "1 samples: doc-17"),
])
def test_sample_ids_of_any_json_shape_are_shown(tmp_path, sample_ids, shown):
    bundle = _bundle(tmp_path, lambda step: {"x": torch.ones(2, 3)}, sample_ids=sample_ids)
    result = CliRunner().invoke(main, ["report", str(bundle.path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert shown in result.stdout
    page = render_html(bundle, tmp_path / "r.html", summary=summarize(bundle), history=[]).read_text()  # no plots
    assert f"sample ids: {html.escape(shown.partition(': ')[2])}" in page


def test_html_plots_names_that_look_like_tex(tmp_path):
    key = r"cost$\frac{a$"  # a batch key is any string; matplotlib would parse it as (broken) mathtext
    bundle = _bundle(tmp_path, lambda step: {key: torch.ones(2, 3)})
    html_path = render_html(bundle, tmp_path / "r.html")
    page = html_path.read_text()
    assert page.count("data:image/png;base64,") == 3 and "input:cost$\\frac{a$" in page


def test_html_inside_the_bundle_is_refused(tmp_path):
    bundle = _bundle(tmp_path, lambda step: {"x": torch.ones(2, 3)})
    result = CliRunner().invoke(main, ["report", str(bundle.path), "--html", str(bundle.path / "report.html")])
    assert result.exit_code == 1 and "inside the bundle" in result.output
    assert not (bundle.path / "report.html").exists()
    assert load_bundle(bundle.path).path == bundle.path


def test_report_with_no_history_steps(tmp_path):
    bundle = _bundle(tmp_path, lambda step: {"x": torch.ones(2, 3)})
    tensors, index = history_payload([])
    _replace_member(bundle.path, "history.safetensors", save(tensors))
    _replace_member(bundle.path, "history.json", json.dumps(index).encode())
    runner = CliRunner()
    terminal = runner.invoke(main, ["report", str(bundle.path)], env={"COLUMNS": "200"})
    assert terminal.exit_code == 0, terminal.output
    assert "no history steps" in terminal.stdout and "category input" in terminal.stdout
    s = strict_json(runner.invoke(main, ["report", str(bundle.path), "--json"]).stdout)
    assert s["history"] == {"steps": 0, "first": None, "last": None} and s["failing"] is None
    assert s["nonfinite_tensors"][0]["name"] == "input:x" and s["headroom"] == []
    page = render_html(load_bundle(bundle.path), tmp_path / "r.html").read_text()
    assert page.count("no history in this bundle") == 3


def test_report_with_non_finite_history_values(demo_bundle, tmp_path):
    """Sums of squares, largest values and scalars that are NaN or inf (a damaged or hostile history) are shown as
    such, and the JSON stays strict."""
    copy = tmp_path / "bundle"
    shutil.copytree(demo_bundle.path, copy)
    tensors = load_file(copy / "history.safetensors")
    records = tensors["scalars"].numpy()  # the slots before the histogram (NOTE: [sparse history records])
    records[:, L.REC_SUMSQ] = np.array([np.nan], dtype=np.float64).view(np.int64)[0]
    records[::2, L.REC_SUMSQ] = np.array([np.inf], dtype=np.float64).view(np.int64)[0]
    records[:, L.REC_ABSMAX_BITS] = 0x7F800000  # +inf as float32 bits
    _replace_member(copy, "history.safetensors", save(tensors))
    index = json.loads((copy / "history.json").read_text())
    for entry in index["entries"]:
        entry["grad_norm"], entry["lr"] = "inf", "nan"
    _replace_member(copy, "history.json", json.dumps(index).encode())

    runner = CliRunner()
    result = runner.invoke(main, ["report", str(copy), "--json"])
    assert result.exit_code == 0, result.output
    s = strict_json(result.stdout)
    assert s["failing"]["grad_norm"] == "inf" and s["failing"]["lr"] == "nan"
    assert s["inputs_at_failure"][0]["absmax"] == "inf"
    assert all(r["absmax"] == "inf" for r in s["headroom"])
    html_out = tmp_path / "r.html"
    terminal = runner.invoke(main, ["report", str(copy), "--html", str(html_out)], env={"COLUMNS": "200"})
    assert terminal.exit_code == 0, terminal.output
    assert "inf" in terminal.stdout and html_out.read_text().count("data:image/png;base64,") == 3


@pytest.mark.parametrize("name, damage, message", [
    ("history.json", lambda data: b"{", "history.json is not valid JSON"),
    ("history.json", lambda data: data.replace(b'"layout": 0', b'"layout": 99', 1), "layout 99"),
    ("manifest.json", lambda data: data.replace(b'"first_invalid_step": 80', b'"first_invalid_step": "80"'),
     "wrong type for first_invalid_step"),
])
def test_damaged_bundle_with_matching_sha256_exits_2(demo_bundle, tmp_path, name, damage, message):
    copy = tmp_path / "bundle"
    shutil.copytree(demo_bundle.path, copy)
    data = damage((copy / name).read_bytes())
    if name == "manifest.json":
        (copy / name).write_bytes(data)
    else:
        _replace_member(copy, name, data)
    for args in ([], ["--json"], ["--html", str(tmp_path / "r.html")]):
        result = CliRunner().invoke(main, ["report", str(copy), *args])
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert "Traceback" not in result.output and not isinstance(result.exception, (TypeError, KeyError))


def test_terminal_shows_names_and_ids_with_brackets_literally(tmp_path):
    bundle = _bundle(tmp_path, lambda step: {"tokens[bos]": torch.ones(2, 3)}, sample_ids=["[/b]", "[red]c"])
    result = CliRunner().invoke(main, ["report", str(bundle.path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output  # "[/b]" as markup closes no tag: rich raised MarkupError
    assert "input:tokens[bos]" in result.stdout and "2 samples: [/b], [red]c" in result.stdout


def test_the_html_reports_incident_note_is_rendered_markdown(demo_bundle, tmp_path):
    """INCIDENT.md's findings (the replay's and the ablation's included) as HTML: headings, tables, no nanscan
    markers and no Markdown left raw; a note typed with HTML in it stays text."""
    from html.parser import HTMLParser  # noqa: PLC0415

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack, self.headings, self.tables, self.pre_text, self.scripts = [], [], 0, [], 0

        def handle_starttag(self, tag, attrs):
            self.stack.append(tag)
            self.tables += tag == "table"
            self.scripts += tag == "script"

        def handle_endtag(self, tag):
            while self.stack and self.stack.pop() != tag:
                pass

        def handle_data(self, data):
            if self.stack and self.stack[-1] == "h3":
                self.headings.append(data)
            if "pre" in self.stack:
                self.pre_text.append(data)

    incident = demo_bundle.incident_text() + "\n<script>alert(1)</script> and **bold** text\n"
    page = render_html(demo_bundle, tmp_path / "r.html", incident=incident).read_text()
    tags = Tags()
    tags.feed(page)
    titles = [f["title"] for f in demo_bundle.findings()]
    assert any(t.startswith("Replay") for t in titles) and any(t.startswith("Ablation") for t in titles)
    assert all(any(title in h for h in tags.headings) for title in titles), (titles, tags.headings)
    assert tags.tables >= 4 and tags.scripts == 0
    assert "nanscan:finding" not in page and "&lt;!-- nanscan" not in page
    assert "### " not in page and "|---" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<strong>bold</strong>" in page
    assert not any("Automatic findings" in t for t in tags.pre_text)


# -- a run that rolled back: the steps a rollback abandoned, marked wherever the history is shown step by step -----

STOPPED = 14  # the rolled-back run's second failure, where it stops


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """(the rollback's own bundle, the bundle where the run stopped, the rollback's record): the model's output is
    infinite at step 5, and the run goes back to its window's oldest state, abandoning the steps from there to 5;
    steps 6-13 go on from it, and step 14 fails again, where the run stops (max_rollbacks=1)."""
    root = tmp_path_factory.mktemp("rolled-back")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RollbackWarning)
        with pytest.raises(NonFiniteError) as caught:
            broken_run(root, Rollback(skip="window", max_rollbacks=1, settle_steps=1), faults=frozenset({5, 14}))
    (entry,) = rollbacks(root / "broken")
    assert entry["at_step"] == 5 and entry["skipped_steps"] == list(range(entry["restored_step"], 6))
    assert caught.value.step == STOPPED
    return load_bundle(root / "broken" / entry["bundle"]), load_bundle(caught.value.bundle_path), entry


def abandoned_line(entry: dict) -> str:
    return (f"steps {entry['restored_step']}-5: abandoned by the rollback at step 5 (back to step "
            f"{entry['restored_step']}'s start)")


def test_the_steps_a_rollback_abandoned_are_marked_in_the_terminal_and_html(rolled_back, tmp_path):
    own, stopped, entry = rolled_back
    restored = entry["restored_step"]
    runner = CliRunner()
    summary = strict_json(runner.invoke(main, ["report", str(stopped.path), "--json"]).stdout)
    assert summary["abandoned"] == [{"first": restored, "last": 5, "at_step": 5, "restored_step": restored}]

    # the rollback's own bundle: its last finite step and its failing one were both abandoned
    terminal = runner.invoke(main, ["report", str(own.path)], env={"COLUMNS": "200"})
    assert terminal.exit_code == 0, terminal.output
    assert re.search(r"last finite\s+4 abandoned\s", terminal.stdout), terminal.stdout
    assert re.search(r"first invalid\s+5 abandoned\s", terminal.stdout), terminal.stdout
    assert abandoned_line(entry) in terminal.stdout
    page = render_html(own, tmp_path / "own.html").read_text()
    assert "<td>4 abandoned</td>" in page and "<td>5 abandoned</td>" in page
    assert html.escape(abandoned_line(entry)) in page

    # where the run stopped: the steps around it followed the rollback, and the abandoned ones are named
    terminal = runner.invoke(main, ["report", str(stopped.path)], env={"COLUMNS": "200"})
    assert terminal.exit_code == 0, terminal.output
    assert re.search(rf"last finite\s+{STOPPED - 1}\s", terminal.stdout)
    assert re.search(rf"first invalid\s+{STOPPED}\s", terminal.stdout)
    assert abandoned_line(entry) in terminal.stdout
    page = render_html(stopped, tmp_path / "stopped.html").read_text()
    assert f"<td>{STOPPED - 1}</td>" in page and html.escape(abandoned_line(entry)) in page


def test_the_curves_shade_the_abandoned_steps_and_draw_them_hollow(rolled_back):
    _own, stopped, entry = rolled_back
    history = load_history(stopped)
    fig = plot_curves(summarize(stopped, history), history)
    ax_loss = fig.axes[0]
    assert "abandoned by the rollback at step 5" in [t.get_text() for t in ax_loss.get_legend().get_texts()]
    (hollow,) = [line for line in ax_loss.lines if line.get_markerfacecolor() == "none"]
    assert list(hollow.get_xdata()) == list(range(entry["restored_step"], 5))  # step 5's loss was inf: a red X
    (run,) = [line for line in ax_loss.lines if line.get_marker() == "."]
    assert list(run.get_xdata()) == list(range(6, STOPPED))  # the line is the run's: the steps after the rollback


def test_two_rollbacks_are_shaded_in_two_colours_their_legend_above_a_heatmap(tmp_path):
    """Faults at steps 5 and 8, each rolled back: the two abandoned spans, side by side on every plot, each in its
    rollback's colour; on the exponent heatmaps the legend sits above the axes, off the cells."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RollbackWarning)
        with pytest.raises(NonFiniteError) as caught:
            broken_run(tmp_path, Rollback(skip="window", max_rollbacks=2, settle_steps=1))
    stopped = load_bundle(caught.value.bundle_path)
    history = load_history(stopped)
    summary = summarize(stopped, history)
    assert [span["at_step"] for span in summary["abandoned"]] == [5, 8]
    fig = plot_curves(summary, history)
    spans = [p for p in fig.axes[0].patches if p.get_label() and "abandoned" in p.get_label()]
    assert len({tuple(p.get_facecolor()[:3]) for p in spans}) == 2, [p.get_label() for p in spans]
    heatmap = plot_exponent_heatmap(summary, history)
    legend = heatmap.axes[0].get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().y0 >= heatmap.axes[0].get_window_extent().y1 - 1


def test_the_divergence_steps_mark_the_abandoned_steps(rolled_back):
    """The rows of the divergence's steps table, the terminal's and the HTML's, where a layer grew first."""
    _own, stopped, entry = rolled_back
    summary = summarize(stopped)
    _headers, cells, _stride = divergence_cells(summary["divergence"], len(summary["divergence"]["steps"]),
                                                summary["abandoned"])
    marked = [f"{step} abandoned" for step in range(entry["restored_step"], 5)] + ["5 abandoned NaN/inf", "6", "7"]
    assert [row[0] for row in cells][:len(marked)] == marked
    # judged on the run that failed: the steps after the rollback, not the abandoned ones before it
    assert summary["divergence"]["judged"] == [6, STOPPED - 1]
