"""The divergence before an incident (nanscan.bundle.divergence NOTE: [divergence onset]), on real runs: the
nanoGPT whose learning rate is too large for its warm-up shows its weight-decayed weights growing first and the
gradients after them, from the output layer down, in INCIDENT.md, `nanscan report --json`, the terminal report and
the HTML plot; a regression diverging under its warm-up shows its first layer's gradients first; a healthy run
never shows a tensor growing; a fault of one step claims no divergence."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner

import nanogpt_runs as N
from nanscan.bundle import load_bundle
from nanscan.bundle.divergence import (DIVERGENCE_FINDING, GROWTH_BINADES, MIN_STEPS, divergence,
                                       grown_tensors)
from nanscan.cli.main import main
from nanscan.incident import SpikeWarning
from nanscan.review.html_page import render_html
from nanscan.runtime.monitor import Monitor
from nanscan.runtime.window import Window
from replay_entries import train
from test_nanogpt_window import first_nonfinite_without_nanscan

# Measured on N.DIVERGING (bf16 autocast): every weight in AdamW's decay group grows by +1 binade a step once
# lr x weight_decay passes 2, and crosses GROWTH_BINADES at step 14; the gradients follow, the final LayerNorm's
# first, then the last block's, then the first block's. The onsets are the same on every CPU seen; where the run
# ends is not, since bf16 matmuls round by the instruction set (TRAJECTORIES).
FIRST_ONSET = 14


@dataclass(frozen=True)
class Trajectory:
    """How the run ends on one kind of CPU: the binades the decay group's weights and ln_f's bias gradient gained by
    the failing step, the failing step's gradients when it has a row of its own (None: its loss overflowed at
    micro-batch 0, a micro-batch check, which keeps no history row), the first gradient onset of each layer whose
    gradients grew, and the first tensors the report lists under transformer.h.0."""

    growth: int
    ln_f_growth: int
    failing_gradients: int | None
    gradient_onsets: dict
    h0_first: tuple


# by the failing step: AVX-512 BF16 (an EPYC Zen 4) goes non-finite at 29 in the gradients; AVX2 (an EPYC Zen 3) at
# 31, in micro-batch 0's loss
TRAJECTORIES = {
    29: Trajectory(22, 21, 14, {"transformer.ln_f": 15, "transformer.h.1": 16, "transformer.h.0": 17},
                   ("attn.c_proj", "mlp.c_fc")),
    31: Trajectory(24, 23, None, {"transformer.ln_f": 15}, ("attn.c_attn", "attn.c_proj", "mlp.c_fc")),
}


@pytest.fixture(scope="module")
def nanogpt_bundle(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpikeWarning)
        run = N.train(N.DIVERGING, tmp_path_factory.mktemp("nanogpt"), iters=60, window=Window(steps=32, every=8))
    # the step an independent isfinite check finds (it moves with the CPU's bf16 rounding; the onsets do not)
    assert run.nonfinite_step == first_nonfinite_without_nanscan(N.DIVERGING, 60) and run.bundle is not None
    assert run.nonfinite_step in TRAJECTORIES, run.nonfinite_step
    return load_bundle(run.bundle)


def trajectory(bundle) -> Trajectory:
    return TRAJECTORIES[bundle.step]


def decayed_weights() -> set[str]:
    """The parameters of nanoGPT's weight-decay group (its 2-D weights; lm_head is tied to wte)."""
    model = N.build_model(N.full_config(N.DIVERGING))
    return {f"param:{name}" for name, p in model.named_parameters() if p.dim() >= 2}


def test_incident_md_names_the_layers_that_grew_first(nanogpt_bundle):
    finding = next(f for f in nanogpt_bundle.findings() if f["key"] == DIVERGENCE_FINDING)
    assert [f["key"] for f in nanogpt_bundle.findings()][:2] == ["detect", DIVERGENCE_FINDING]
    record = finding["record"]
    step = nanogpt_bundle.step
    assert record["step"] == step and record["judged"] == [0, step - 1] and record["baseline"] == [0, 1, 2, 3]
    assert [(g["layer"], g["onset"]) for g in record["layers"]] == [
        ("transformer", FIRST_ONSET), ("transformer.h.0", FIRST_ONSET), ("transformer.h.1", FIRST_ONSET)]
    first = {t["tensor"] for t in record["grew"] if t["onset"] == FIRST_ONSET}
    assert first == decayed_weights()
    assert finding["title"] == f"Divergence before step {step}: 3 layers grew at once, from step {FIRST_ONSET}"
    text = nanogpt_bundle.incident_text()
    section = text[text.index(f"<!-- nanscan:finding {DIVERGENCE_FINDING} -->"):text.index("## Reviewer notes")]
    growth = trajectory(nanogpt_bundle).growth
    assert f"| transformer.h.0 | `param:transformer.h.0.mlp.c_fc.weight` | {FIRST_ONSET} | 1 | {growth + 1} | " \
           f"+{growth} |" in section
    assert "a cause they share" in section
    # the steps table: the loss, the gradient norm and the learning rate the window recorded, the onsets marked
    # the loss the step trained on: its two micro-batches' `loss / 2` summed (ln 65 at the start), not the last half
    assert re.search(r"\| 0 \| 4\.16987 \| 0\.730985 \| 2\.73 \|", section)
    assert re.search(rf"\| {FIRST_ONSET} \|[^\n]*\| transformer, transformer\.h\.0, transformer\.h\.1 \|", section)
    if trajectory(nanogpt_bundle).failing_gradients is not None:
        assert f"| {step} (non-finite) |" in section and "non-finite |" in section
    else:
        assert f"| {step - 1} |" in section and f"| {step} " not in section


def test_the_report_json_carries_every_step_and_tensor(nanogpt_bundle):
    result = CliRunner().invoke(main, ["report", str(nanogpt_bundle.path), "--json"])
    assert result.exit_code == 0, result.output
    div = json.loads(result.output)["divergence"]
    failing = trajectory(nanogpt_bundle).failing_gradients
    rows = nanogpt_bundle.step + (1 if failing is not None else 0)
    assert [s["step"] for s in div["steps"]] == list(range(rows))
    assert div["steps"][0]["lrs"] == [pytest.approx(30 / 11)] * 2  # both param groups, from the window
    if failing is not None:
        assert div["steps"][-1]["finite"] is False and div["steps"][-1]["nonfinite_gradients"] == failing
    else:
        assert div["steps"][-1]["finite"] is True
    assert all(s["loss_scale"] is None for s in div["steps"])  # no GradScaler in this run
    grew = {t["tensor"]: t for t in div["grew"]}
    # no weight outside the decay group grew (LayerNorm weights and the biases level off)
    assert {n for n in grew if n.startswith("param:")} == decayed_weights()
    gradients = [t for t in div["grew"] if t["kind"] == "gradient"]
    assert gradients and min(t["onset"] for t in gradients) > FIRST_ONSET
    by_layer = {}
    for t in gradients:
        layer = "transformer.ln_f" if ".ln_f." in t["tensor"] else t["layer"]
        by_layer[layer] = min(by_layer.get(layer, t["onset"]), t["onset"])
    assert by_layer == trajectory(nanogpt_bundle).gradient_onsets
    ledger = next(f for f in nanogpt_bundle.findings() if f["key"] == DIVERGENCE_FINDING)["record"]
    assert ledger["layers"] == div["layers"]  # INCIDENT.md and the report say the same


def test_the_terminal_report_shows_the_divergence(nanogpt_bundle):
    result = CliRunner().invoke(main, ["report", str(nanogpt_bundle.path)], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"Divergence before step {nanogpt_bundle.step}: 3 layers grew at once, from step {FIRST_ONSET}" in out
    # each layer once, its tensors named within it
    path = trajectory(nanogpt_bundle)
    listed = r"\s*\n\s+".join(rf"param:{re.escape(name)}\.weight\s+{FIRST_ONSET}\s+\+{path.growth}"
                               for name in path.h0_first)
    assert re.search(rf"transformer\.h\.0\s+{listed}", out)
    assert re.search(rf"\n\s+grad:ln_f\.bias\s+{path.gradient_onsets['transformer.ln_f']}\s+\+{path.ln_f_growth}",
                     out)
    assert re.search(rf"\n\s*{FIRST_ONSET}\s[^\n]*transformer, transformer\.h\.0, transformer\.h\.1", out)
    if path.failing_gradients is not None:
        assert re.search(rf"\n\s*{nanogpt_bundle.step} NaN/inf\s[^\n]*non-finite", out)


def test_the_html_report_plots_the_divergence(nanogpt_bundle, tmp_path):
    page = render_html(nanogpt_bundle, tmp_path / "report.html").read_text()
    start = page.index(f"<h2>Divergence before step {nanogpt_bundle.step}: 3 layers grew at once, from step {FIRST_ONSET}</h2>")
    section = page[start:page.index("<h2>", start + 4)]
    assert re.search(r'<img alt="loss, gradient norm, learning rate and loss scale before the incident[^"]*" '
                     r'src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}">', section)
    assert "<td>param:transformer.h.0.mlp.c_fc.weight</td>" in section.replace(' class="l"', "")
    assert section.count("<tr>") > 30  # the tensors and every step


def test_a_regression_diverging_under_its_warmup_grows_from_its_first_layer(tmp_path):
    from test_replay_window import diverging_run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpikeWarning)
        bundle = load_bundle(diverging_run(tmp_path).bundle_path)
    div = divergence(bundle.history(), bundle.window_records(), bundle.step)
    assert bundle.step == 44
    assert [(g["layer"], g["onset"]) for g in div["layers"]] == [("0", 41), ("1", 42)]
    assert div["grew"][0]["tensor"] == "grad:0.weight"
    assert all(t["onset"] > 41 for t in div["grew"][1:])


def healthy_nanogpt_history(bundle_dir, iters: int) -> list:
    """N.HEALTHY_CONFIGS["bf16"] trained as nanogpt_runs.train trains it, keeping its whole history."""
    c = N.full_config(N.HEALTHY_CONFIGS["bf16"])
    model = N.build_model(c)
    optimizer = N.configure_optimizer(model, c)
    mon = Monitor(model, optimizer, bundle_dir=bundle_dir, history=iters, window=None)
    for it in range(iters):
        for group in optimizer.param_groups:
            group["lr"] = N.get_lr(it, c)
        for micro in range(c["accum"]):
            batch = N.get_batch(c, it, micro)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = N.step_fn(model, batch) / c["accum"]
            loss.backward()
            mon.check(batch=batch, loss=loss, micro_batch=micro < c["accum"] - 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return sorted(mon.history, key=lambda e: e.step)


def test_a_healthy_run_shows_no_divergence_at_any_step(tmp_path):
    """Every 64-step history the Monitor could hold at an incident of the healthy run: no tensor grew, and the
    largest gain stays HEALTHY_MARGIN binades below the rule's (NOTE: [divergence onset])."""
    history = healthy_nanogpt_history(tmp_path, 100)
    largest = 0
    for end in range(MIN_STEPS, len(history) + 1):
        held = history[max(0, end - 64):end]
        assert divergence(held, [], held[-1].step)["grew"] == []
        largest = max([largest, *(t["binades"] for t in grown_tensors(held))])
    assert largest <= GROWTH_BINADES - 2


def test_a_fault_of_one_step_claims_no_divergence(tmp_path):
    path = train("poisoned_sample", tmp_path, config={"fault_step": 20}, steps=30)
    bundle = load_bundle(path)
    assert bundle.step == 20
    assert DIVERGENCE_FINDING not in [f["key"] for f in bundle.findings()]
    assert "Divergence" not in bundle.incident_text()
    result = CliRunner().invoke(main, ["report", str(path), "--json"])
    div = json.loads(result.output)["divergence"]
    assert div["grew"] == [] and div["judged"] == [0, 19] and len(div["steps"]) == 21
    terminal = CliRunner().invoke(main, ["report", str(path)], env={"COLUMNS": "200"}).output
    assert (f"divergence: no parameter or gradient grew by {GROWTH_BINADES} binades ({2 ** GROWTH_BINADES}x) over "
            "steps 0-19 before step 20" in terminal)
    page = render_html(bundle, tmp_path / "r.html").read_text()
    assert f"no parameter or gradient grew by {GROWTH_BINADES} binades" in page and "Divergence before step 20" in page


def test_too_short_a_history_is_not_judged(tmp_path):
    bundle = load_bundle(train("poisoned_sample", tmp_path))  # non-finite at step 3: three finite steps
    assert bundle.step == 3 and DIVERGENCE_FINDING not in [f["key"] for f in bundle.findings()]
    result = CliRunner().invoke(main, ["report", str(bundle.path), "--json"])
    assert json.loads(result.output)["divergence"] is None
    assert "divergence" not in CliRunner().invoke(main, ["report", str(bundle.path)]).output.lower()
