"""`nanscan report BUNDLE`: what an incident bundle says, as a terminal summary, one self-contained HTML page with
plots, or JSON. A spike bundle (category "spike", the early warning) shows what spiked and the gradient tensors
that moved first; any bundle marks the run's spikes on its loss and gradient-norm plots.

`summarize(bundle)` is the single source of every number shown; the terminal, HTML and JSON views only format it.
Non-finite floats (a NaN loss) appear in the JSON as the strings "nan", "inf" and "-inf", since strict JSON has no
tokens for them.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import click
import numpy as np

from nanscan.engine import _layout as L
from nanscan.engine.headroom import FORMATS, Format, headroom, headroom_by_kind
from nanscan.incident import (ELEVATED, GROWTH, KINDS, LOSS, NONFINITE, PREFIX, REASON_EXPLANATIONS, SPIKE,
                              explain_category, module_layer, tensor_kind)

SUMMARY_SCHEMA = "nanscan.review.report/1"

# float32 is listed too: a tensor whose top binade is at float32's own ceiling is one step from inf.
HEADROOM_FORMATS = (Format("float32", 127, -126, -149), *FORMATS)
HEADROOM_PER_KIND = 2  # largest tensors of each kind in the headroom table
# The tensor's own dtype beside the columns of the dtypes it is not in (a float32 gradient's e4m3 column is a
# what-if, not a finding).
_SHORT_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64", "complex64": "c64",
                 "complex128": "c128"}
HEATMAP_TENSORS = 6
HEATMAP_MAX_ROWS = 48  # binade rows drawn as one contiguous range
JUMPS_SHOWN = 5
JUMP_BINADES = 8  # a largest value that grew 256-fold in one step is worth a look
MAP_MAX_ROWS = 40  # beyond this many modules the non-finite map is drawn per layer
TABLE_MAX_ROWS = 20
# Kinds (nanscan.incident.tensor_kind) in the order of the failure categories, and their short labels.
KIND_ORDER = KINDS
KIND_LABEL = {kind: PREFIX[kind][:-1] if kind in PREFIX else kind for kind in KINDS}


# ---------------------------------------------------------------------------------------------------------------
# Names: "grad:blocks.0.attn.qkv.weight" -> kind "gradient", module "blocks.0.attn.qkv", layer "blocks.0"
# ---------------------------------------------------------------------------------------------------------------

def split_name(name: str) -> tuple[str, str, str]:
    """(kind, module, layer) of a scanned tensor's name; batch tensors share the module "batch"."""
    kind = tensor_kind(name)
    if kind in ("input", "loss"):
        return kind, "batch" if kind == "input" else "loss", "batch" if kind == "input" else "loss"
    parts = name.partition(":")[2].split(".") if ":" in name else name.split(".")
    # optimizer state names end in the state key after the parameter name (optim:<param>.exp_avg)
    drop = 2 if kind == "optimizer_state" and len(parts) > 2 else 1
    module_parts = parts[:-drop] if len(parts) > drop else parts[:1]
    module = ".".join(module_parts)
    return kind, module, module_layer(module)


def sample_id_list(sample_ids: Any) -> list:
    """The batch's sample ids as a list for display: the Monitor stores whatever JSON value it was given (a list,
    or one id, or a dict of columns), so a single value is one id."""
    if sample_ids is None:
        return []
    return list(sample_ids) if isinstance(sample_ids, list) else [sample_ids]


def _json_float(value: Any) -> float | str | None:
    """nanscan.bundle's json_float, imported on first use: nanscan.bundle imports torch, which `nanscan report
    --help` must not wait for (NOTE: [fast help] in nanscan/cli/main.py)."""
    from nanscan.bundle import json_float  # noqa: PLC0415 - NOTE: [fast help]

    return json_float(value)


def _is_finite(x: Any) -> bool:
    return x is not None and not isinstance(x, str) and math.isfinite(float(x))


# ---------------------------------------------------------------------------------------------------------------
# summarize
# ---------------------------------------------------------------------------------------------------------------

def load_history(bundle) -> list:
    """The bundle's history entries, oldest first."""
    return sorted(bundle.history(), key=lambda e: e.step)


def _run_rollbacks(bundle) -> list[dict]:
    """The rollbacks of the bundle's run (its directory's rollbacks.json); a broken record is one row saying so."""
    from nanscan.bundle.format import BundleError  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py
    from nanscan.bundle.rollbacks import read_rollbacks  # noqa: PLC0415

    run_dir = Path(getattr(bundle, "set_path", None) or bundle.path).parent
    try:
        return read_rollbacks(run_dir)
    except BundleError as exc:
        return [{"error": str(exc)}]


def summarize(bundle, history: list | None = None) -> dict:
    """Every fact the report shows, as a JSON-ready dict (see the module docstring for non-finite values).
    `history`: load_history(bundle), when the caller already has it."""
    from nanscan.bundle.findings import recorded_findings  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    manifest = bundle.manifest
    step = manifest.get("first_invalid_step")
    category = manifest.get("category")
    history = load_history(bundle) if history is None else history
    failing = next((e for e in history if e.step == step), None)
    before = [e for e in history if step is None or e.step < step]
    # the scan alone decides: nanscan.check(model) records no loss, and its steps are still finite or not
    last_finite = next((e for e in reversed(before) if e.report.ok and (e.loss is None or _is_finite(e.loss))), None)
    checked = [s.name for s in failing.report] if failing is not None else None

    offenders = [dict(t) for t in manifest.get("nonfinite_tensors", [])]
    for t in offenders:
        t["kind"], t["module"], t["layer"] = split_name(t["name"])
    groups = _group_by_module(offenders)
    jumps = _exponent_jumps(last_finite, failing)

    return {
        "schema": SUMMARY_SCHEMA,
        "bundle": str(bundle.path),
        "run_id": manifest.get("run_id"),
        "first_invalid_step": step,
        "category": category,
        "category_meaning": REASON_EXPLANATIONS.get(manifest.get("reason")) or explain_category(
            category, loss_checked=checked is None or LOSS in checked,
            inputs_checked=checked is None or any(tensor_kind(n) == "input" for n in checked),
            batch_given=bool(manifest.get("batch", {}).get("file"))),
        "nonfinite_tensors": [{k: t[k] for k in ("name", "kind", "module", "layer", "nan", "posinf", "neginf",
                                                   "numel")} for t in offenders],
        "groups": groups,
        "last_finite": _step_values(last_finite),
        "failing": _step_values(failing),
        "inputs_at_failure": _inputs(failing.report) if failing else [],
        "exponent_jumps": jumps[:JUMPS_SHOWN],
        "exponent_jumps_total": len(jumps),
        "headroom": _headroom_rows(last_finite, failing),
        "history": {"steps": len(history), "first": history[0].step if history else None,
                    "last": history[-1].step if history else None},
        "batch": {k: manifest.get("batch", {}).get(k) for k in ("sample_ids", "shapes", "dtypes")},
        "source": manifest.get("source"),
        "replay_entry": manifest.get("replay_entry"),
        "files": sorted(manifest.get("files", {})),
        # a distributed incident's ranks (nanscan.bundle.BundleSet); None for a single process
        "distributed": bundle.set_summary() if hasattr(bundle, "set_summary") else None,
        "reason": manifest.get("reason", NONFINITE),
        "mixed_precision": _mixed_precision(manifest.get("mixed_precision"), history, failing),
        # what replay, ablate and reviewers added to the ledger so far
        "findings": recorded_findings(bundle),
        # the run's rollbacks (on_invalid=Rollback: nanscan.runtime.rollback), this incident's among them
        "rollbacks": _run_rollbacks(bundle),
        # the run's spikes up to this step (nanscan.runtime.spikes); a spike bundle's own is "spike"
        "spikes": [{"step": s["step"], "quantity": s["quantity"], "ratio": s["scores"][0]["ratio"]}
                   for s in manifest.get("spikes", [])],
        "spike": _spike_summary(manifest, step) if category == SPIKE else None,
        "size": _size_summary(manifest),
        # the steps before the incident and the tensors that grew first, by layer (nanscan.bundle.divergence)
        "divergence": _divergence_summary(bundle, history, step),
    }


def _divergence_summary(bundle, history: list, step) -> dict | None:
    """nanscan.bundle.divergence's summary of the history up to `step`, the learning rates of each param group
    from the run's window where the bundle holds one (NOTE: [divergence onset])."""
    from nanscan.bundle.divergence import divergence  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    if step is None:
        return None
    return divergence(history, bundle.window_records() if bundle.window is not None else [], step)


def _divergence_none_text(div: dict) -> str:
    """The divergence section where no tensor grew: what was judged, and that nothing crossed the threshold."""
    first, last = div["judged"]
    binades = div["rule"]["binades"]
    return (f"divergence: no parameter or gradient grew by {binades} binades ({2 ** binades}x) over steps "
            f"{first}-{last} before step {div['step']}, each against its own start (its median at steps "
            f"{div['baseline'][0]}-{div['baseline'][-1]})")


def _size_summary(manifest: dict) -> dict:
    """The bundle's bytes and its window's (nanscan.runtime.window NOTE: [run window]): span, kept states, bytes."""
    files = manifest.get("files", {})
    total = sum(int(e.get("bytes", 0)) for e in files.values())
    info = manifest.get("window")
    if not isinstance(info, dict):
        return {"bytes": total, "window": None}
    prefix = f"{info.get('dir') or 'window'}/"
    window = {"span": info.get("span"), "states": [e.get("step") for e in info.get("states") or ()],
              "records": info.get("records", 0), "steps": info.get("steps"), "every": info.get("every"),
              "bytes": sum(int(e.get("bytes", 0)) for name, e in files.items() if name.startswith(prefix)),
              "error": info.get("error")}
    return {"bytes": total, "window": window}


def size_text(size: dict | None) -> str:
    """One line: the bundle's size and its window's span."""
    if not size:
        return ""
    text = f"bundle: {_mib(size['bytes'])}"
    window = size.get("window")
    if window is None:
        return text + "; no window of the run (Monitor(window=None), or a bundle from before windows)"
    if window.get("error"):
        return text + f"; the window could not be written ({window['error']})"
    span = window.get("span")
    states = window.get("states") or []
    where = f"steps {span[0]}-{span[1]}" if span else "no step"
    kept = f"states at step {', '.join(map(str, states))}" if states else "no kept state"
    return text + f"; window: {where} ({window['records']} checks, {kept}), {_mib(window['bytes'])}"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.2f} MiB" if size >= 1 << 16 else f"{size:,} bytes"


def _mixed_precision(record: dict | None, history: list, failing) -> dict | None:
    """The mixed-precision section: the bundle's record (autocast, scaler, skips, streak), the scale and overflow
    skip of every history step under a scaler, and per-kind headroom of the failing step's scanned values, its
    gradients unscaled (nanscan.engine.stats NOTE: [unscaled gradients])."""
    if record is None:
        return None
    steps = [{"step": e.step, "scale": _json_float(e.report.scale), "overflow_skip": e.report.overflow_skip,
              "stats_unscaled": e.report.scaling.unscaled}
             for e in history if e.report.scaling is not None]
    kinds = headroom_by_kind(failing.report) if failing is not None else {}
    return {**record, "steps": steps,
            "headroom": {kind: [h.to_dict() for h in rooms] for kind, rooms in kinds.items()}}


def _mixed_precision_text(summary: dict) -> list[str]:
    """The mixed-precision section as lines of Markdown (the same as INCIDENT.md's)."""
    from nanscan.bundle.incident_md import mixed_precision_lines  # noqa: PLC0415 - NOTE: [fast help]

    mp = summary["mixed_precision"]
    rooms = {kind: [_HeadroomRow(**h) for h in rows] for kind, rows in mp["headroom"].items()}
    lines = mixed_precision_lines(mp, rooms)
    scaled = [s["step"] for s in mp["steps"] if not s["stats_unscaled"]]
    if scaled:
        lines.append(f"- gradient statistics of steps {scaled[:5]} are of the scaled gradients (scale not a power "
                     "of two)")
    return lines


class _HeadroomRow:
    """A headroom row read back from the summary's JSON, with the fields mixed_precision_lines uses."""

    def __init__(self, **fields):
        self.__dict__.update(fields)




def _spike_summary(manifest: dict, step: int) -> dict | None:
    """A spike bundle's own spike: its scores and the first-moving tensors, flattened by layer."""
    spike = next((s for s in reversed(manifest.get("spikes", [])) if s.get("step") == step), None)
    if spike is None:
        return None
    moving = [{"layer": g["layer"], **t} for g in spike.get("first_moving", []) for t in g["tensors"]]
    return {"step": step, "window": spike.get("window"), "rule": spike.get("rule"), "scores": spike["scores"],
            "first_moving": moving}


def _group_by_module(offenders: list[dict]) -> list[dict]:
    groups: dict[str, dict] = {}
    for t in offenders:
        g = groups.setdefault(t["module"], {"module": t["module"], "layer": t["layer"], "kinds": {},
                                            "tensors": [], "nan": 0, "posinf": 0, "neginf": 0, "numel": 0})
        g["kinds"][t["kind"]] = g["kinds"].get(t["kind"], 0) + 1
        g["tensors"].append(t["name"])
        for key in ("nan", "posinf", "neginf", "numel"):
            g[key] += int(t[key])
    return list(groups.values())


def _step_values(entry) -> dict | None:
    if entry is None:
        return None
    return {"step": entry.step, "loss": _json_float(entry.loss), "lr": _json_float(entry.lr),
            "grad_norm": _json_float(entry.grad_norm), "nonfinite_tensors": len(entry.report.nonfinite),
            # grad_norm sums the finite values only: with any of these, it is not the step's gradient norm
            "nonfinite_gradients": sum(1 for n in entry.report.nonfinite if tensor_kind(n) == "gradient")}


def _grad_norm_cell(values: dict) -> str:
    return "non-finite" if values.get("nonfinite_gradients") else _fmt(values["grad_norm"])


def _inputs(report) -> list[dict]:
    rows = []
    for stats in report:
        if tensor_kind(stats.name) != "input":
            continue
        rows.append({"name": stats.name, "dtype": stats.dtype, "numel": stats.numel, "nan": stats.nan,
                     "posinf": stats.posinf, "neginf": stats.neginf, "zero": stats.zero,
                     "absmax": _json_float(stats.absmax), "absmin": _json_float(stats.absmin),
                     "top_binade": _top_binade(stats.exp_hist)})
    return rows


def _exponent_jumps(last_finite, failing) -> list[dict]:
    """Tensors whose top occupied binade rose by JUMP_BINADES or more from the last finite step to the failing
    one, largest rise first: finite values that exploded along with the failure."""
    if last_finite is None or failing is None:
        return []
    jumps = []
    for stats in failing.report:
        if stats.name not in last_finite.report:
            continue
        before, after = _top_binade(last_finite.report[stats.name].exp_hist), _top_binade(stats.exp_hist)
        if before is not None and after is not None and after - before >= JUMP_BINADES:
            jumps.append({"name": stats.name, "top_binade_before": before, "top_binade_after": after,
                          "jump": after - before})
    return sorted(jumps, key=lambda j: (-j["jump"], j["name"]))


def _top_binade(exp_hist) -> int | None:
    occupied = np.flatnonzero(np.asarray(exp_hist))
    return int(occupied[-1]) + L.MIN_BIN_EXPONENT if len(occupied) else None


def _headroom_rows(last_finite, failing) -> list[dict]:
    """The largest tensors of the last finite step (HEADROOM_PER_KIND of each kind: weights, gradients and
    optimizer state differ in range), then the batch tensors of the failing step (the data the failure came with)."""
    chosen = []
    if last_finite is not None:
        by_kind: dict[str, list] = {}
        for stats in sorted(last_finite.report, key=lambda s: (-s.numel, s.name)):
            by_kind.setdefault(tensor_kind(stats.name), []).append(stats)
        for kind in sorted(by_kind, key=_kind_rank):
            chosen += [(last_finite.step, s) for s in by_kind[kind][:HEADROOM_PER_KIND]]
    if failing is not None:
        chosen += [(failing.step, s) for s in failing.report if tensor_kind(s.name) == "input"]
    rows = []
    for step, stats in chosen:
        formats = {h.format: {"overflow": h.overflow, "subnormal": h.subnormal, "underflow": h.underflow,
                              "binades_to_overflow": h.binades_to_overflow}
                   for h in headroom(stats.exp_hist, HEADROOM_FORMATS)}
        rows.append({"step": step, "name": stats.name, "dtype": stats.dtype, "numel": stats.numel,
                     "absmax": _json_float(stats.absmax),
                     "nonfinite": stats.nonfinite, "formats": formats})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Terminal
# ---------------------------------------------------------------------------------------------------------------

def _fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def _pct(fraction: float, *, compact: bool = False) -> str:
    if fraction == 0:
        return "0"
    if compact:
        return "<1%" if fraction < 0.01 else f"{100 * fraction:.0f}%"
    return "<0.1%" if fraction < 0.001 else f"{100 * fraction:.1f}%"


def _headroom_cell(fmt: dict, *, compact: bool = False) -> str:
    over, below = _pct(fmt["overflow"], compact=compact), _pct(fmt["subnormal"] + fmt["underflow"], compact=compact)
    return f"{over}/{below}" if compact else f"{over} / {below}"


def _literal(*cells: str) -> list[str]:
    """Text for rich, escaped: tensor names, sample ids and run ids are data, and a batch key such as "tokens[bos]"
    must not be read as markup (it would vanish, or end the report with a MarkupError)."""
    from rich.markup import escape

    return [escape(cell) for cell in cells]


def render_terminal(summary: dict, console=None) -> None:
    """Print the summary as rich tables, narrow enough for an 80-column terminal."""
    from nanscan.bundle.findings import findings_lines  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    from rich import box
    from rich.table import Table
    from rich.text import Text

    from nanscan.cli.errors import console as cli_console  # noqa: PLC0415

    def table(title: str, *columns: str, left: int = 1) -> Table:
        t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1))
        for i, col in enumerate(columns):
            # names fold onto a second line rather than lose their ends to an ellipsis
            t.add_column(col, justify="left" if i < left else "right", overflow="fold")
        return t

    console = console or cli_console()
    step, category = summary["first_invalid_step"], summary["category"]
    category_text, run_text = _literal(str(category), str(summary["run_id"]))
    headline = f"spike at step {step}" if category == SPIKE else f"first invalid step {step}"
    console.print(f"[bold red]{headline}[/bold red], category [bold]{category_text}[/bold] (run {run_text})")
    if summary["category_meaning"]:
        console.print(summary["category_meaning"], highlight=False)
    if summary.get("distributed"):
        console.print(_ranks_table(table, summary["distributed"], step))

    if not summary["history"]["steps"]:
        console.print("[yellow]this bundle holds no history steps:[/yellow] no loss, gradient norm, batch statistics "
                      "or headroom to show")
    if summary.get("size"):
        console.print(_literal(size_text(summary["size"]))[0], highlight=False)
    steps = table("around the failure", "", "step", "loss", "lr", "grad norm", "non-finite tensors")
    at_step = "spike" if category == SPIKE else "first invalid"
    for label, values in (("last finite", summary["last_finite"]), (at_step, summary["failing"])):
        if values is not None:
            steps.add_row(*_literal(label, str(values["step"]), _fmt(values["loss"]), _fmt(values["lr"], ".3e"),
                                    _grad_norm_cell(values), str(values["nonfinite_tensors"])))
    console.print(steps)
    console.print(Text("\n".join(findings_lines(summary["findings"]))))

    groups = table(f"non-finite tensors by module ({len(summary['nonfinite_tensors'])})",
                   "module", "tensors", "NaN", "+inf", "-inf", "elements", left=2)
    for g in summary["groups"][:TABLE_MAX_ROWS]:
        kinds = ", ".join(f"{n} {KIND_LABEL.get(k, k)}"
                          for k, n in sorted(g["kinds"].items(), key=lambda kv: _kind_rank(kv[0])))
        groups.add_row(*_literal(g["module"], kinds, str(g["nan"]), str(g["posinf"]), str(g["neginf"]),
                                 str(g["numel"])))
    if len(summary["groups"]) > TABLE_MAX_ROWS:
        groups.caption = f"{len(summary['groups']) - TABLE_MAX_ROWS} more modules in --json"
    if summary["groups"] or category != SPIKE:  # a spike bundle holds no non-finite tensor
        console.print(groups)

    if summary["inputs_at_failure"]:
        inputs = table(f"batch at step {step}", "tensor", "dtype", "elements", "NaN", "inf", "zero", "absmax",
                       "top binade", left=2)
        for r in summary["inputs_at_failure"]:
            inputs.add_row(*_literal(r["name"], r["dtype"], str(r["numel"]), str(r["nan"]),
                                     str(r["posinf"] + r["neginf"]), str(r["zero"]), _fmt(r["absmax"], ".4g"),
                                     _fmt(r["top_binade"], "d")))
        sample_ids = sample_id_list(summary["batch"].get("sample_ids"))
        if sample_ids:
            shown = ", ".join(map(str, sample_ids[:5])) + (", ..." if len(sample_ids) > 5 else "")
            inputs.caption = _literal(f"{len(sample_ids)} samples: {shown}")[0]
        console.print(inputs)

    if summary.get("spike"):
        console.print(_spike_tables(table, summary["spike"]))
    if summary.get("spikes"):
        console.print(_literal("spikes of this run up to here: " + _spike_list(summary["spikes"]))[0],
                      highlight=False)

    if summary.get("divergence"):
        console.print(_divergence_tables(table, summary["divergence"]))

    if summary["exponent_jumps"]:
        jumps = table(f"jumps at step {step}: top binade (log2)", "tensor",
                      "before", "after", "jump")
        for j in summary["exponent_jumps"]:
            jumps.add_row(*_literal(j["name"], str(j["top_binade_before"]), str(j["top_binade_after"]),
                                    f"+{j['jump']}"))
        if summary["exponent_jumps_total"] > len(summary["exponent_jumps"]):
            jumps.caption = f"{summary['exponent_jumps_total']} tensors in all"
        console.print(jumps)

    if summary.get("mixed_precision"):
        console.print("[bold]mixed precision[/bold]")
        for line in _mixed_precision_text(summary):
            console.print(_literal(line)[0], highlight=False)

    if summary["headroom"]:
        room = table("if stored in another dtype: overflow/below-normal share; f32: binades left", "tensor", "dtype",
                     "step", "absmax", "f32", "f16", "bf16", "e4m3", "e5m2")
        for r in summary["headroom"]:
            cells = [_fmt(r["formats"]["float32"]["binades_to_overflow"], "d")]
            cells += [_headroom_cell(r["formats"][fmt.name], compact=True) for fmt in FORMATS]
            room.add_row(*_literal(r["name"], _SHORT_DTYPES.get(r["dtype"], r["dtype"]), str(r["step"]),
                                   _fmt(r["absmax"], ".3g"), *cells))
        console.print(room)


TERMINAL_DIVERGENCE_STEPS = 12


def _divergence_cells(div: dict, limit: int) -> tuple[list[str], list[list[str]], int]:
    """(headers, rows, stride) of the divergence's steps table: loss, gradient norm, learning rate, the loss scale
    where a GradScaler ran, the layers that began to grow there."""
    from nanscan.bundle.divergence import lr_text, onsets_by_step, shown_steps  # noqa: PLC0415 - NOTE: [fast help]

    rows, stride = shown_steps(div, limit)
    scaled = any(r["loss_scale"] is not None for r in div["steps"])
    onsets = onsets_by_step(div)
    headers = ["step", "loss", "grad norm", "lr", *(["scale"] if scaled else []), "began to grow"]
    cells = []
    for r in rows:
        note = "" if r["finite"] else (" skip" if r["overflow_skip"] else " NaN/inf")
        cells.append([f"{r['step']}{note}", _fmt(r["loss"]), _grad_norm_cell(r), lr_text(r["lrs"]),
                      *([_fmt(r["loss_scale"], ".3g")] if scaled else []), ", ".join(onsets.get(r["step"], []))])
    return headers, cells, stride


def _within_layer(name: str, layer: str) -> str:
    """A tensor's name without its layer's path, beside the layer's own column: "param:transformer.h.0.mlp.c_fc.weight"
    in "transformer.h.0" is "param:mlp.c_fc.weight" (80 columns hold it)."""
    kind, sep, body = name.partition(":")
    return f"{kind}:{body[len(layer) + 1:]}" if sep and body.startswith(layer + ".") else name


def _divergence_tables(table, div: dict):
    from rich.console import Group
    from rich.text import Text

    from nanscan.bundle.incident_md import divergence_rows, divergence_title  # noqa: PLC0415 - NOTE: [fast help]

    if not div["grew"]:
        return Text(_divergence_none_text(div))
    grew = table(_literal(divergence_title(div))[0], "layer", "tensor in it", "from step", "binades", left=2)
    shown, more = divergence_rows(div)
    for i, t in enumerate(shown):
        first_of_layer = i == 0 or shown[i - 1]["layer"] != t["layer"]
        grew.add_row(*_literal(t["layer"] if first_of_layer else "", _within_layer(t["tensor"], t["layer"]),
                               str(t["onset"]), f"+{t['binades']}"))
    grew.caption = (f"largest |x| {div['rule']['binades']}+ binades over its start (steps {div['baseline'][0]}-"
                    f"{div['baseline'][-1]}) through step {div['judged'][1]}"
                    + (f"; {more} more tensors in --json" if more else ""))
    headers, cells, stride = _divergence_cells(div, TERMINAL_DIVERGENCE_STEPS)
    steps = table(f"steps before {div['step']}" + (f" (one in {stride}, the onsets and the last)" if stride > 1
                                                    else ""), *headers)
    steps.columns[-1].justify = "left"
    for row in cells:
        steps.add_row(*_literal(*row))
    return Group(grew, steps)


RANKS_HEADERS = ("rank", "host / device", "category", "deciding tensors", "non-finite tensors")


def _ranks_rows(ranks: dict) -> list[list[str]]:
    """One row per rank: its host and device (the machine a replica mismatch or a recurring fault points at), its
    category and tensors."""
    from nanscan.bundle.rank_set import device_label  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    first = set(ranks["first_bad_ranks"])
    rows = []
    for r in ranks["ranks"]:
        tensors = r.get("category_tensors") or []
        shown = ", ".join(tensors[:2]) + (f" +{len(tensors) - 2}" if len(tensors) > 2 else "")
        where = f"{r.get('host') or '?'} / {device_label(r.get('device'))}"
        rows.append([str(r["rank"]) + (" (first)" if r["rank"] in first else ""), where, str(r.get("category")),
                     shown or ("no part: " + r["error"] if r.get("error") else ""), str(r.get("nonfinite_count", "-"))])
    return rows


def _ranks_title(ranks: dict, step) -> str:
    return (f"ranks at step {step} (world size {ranks['world_size']}, agreement {ranks['agreement']}; "
            f"showing rank {ranks['shown_rank']}'s part)")


def _ranks_table(table, ranks: dict, step):
    t = table(_literal(_ranks_title(ranks, step))[0], *RANKS_HEADERS, left=4)
    for row in _ranks_rows(ranks):
        t.add_row(*_literal(*row))
    return t


def _kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


# ---------------------------------------------------------------------------------------------------------------
# HTML with embedded plots
# ---------------------------------------------------------------------------------------------------------------

def _figure(width: float, height: float):
    # A bare Figure with its own Agg canvas: no pyplot global state, no GUI backend, safe in any process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _heatmap_tensors(summary: dict, history) -> list[str]:
    """The tensors worth a heatmap: for a `loss` failure the (finite) batch tensors first, since the data fed to
    the forward pass is the first suspect; then the non-finite tensors, the category's own kind first; then the
    tensors whose largest value jumped most at the failing step."""
    first_kind = summary["category"]
    names = [t["name"] for t in sorted(summary["nonfinite_tensors"],
                                       key=lambda t: (t["kind"] != first_kind, _kind_rank(t["kind"])))]
    if summary["category"] == "loss":
        names = [r["name"] for r in summary["inputs_at_failure"]] + names
    names += [j["name"] for j in summary["exponent_jumps"]]
    present = {name for entry in history for name in entry.report.names}
    return [n for n in dict.fromkeys(names) if n in present][:HEATMAP_TENSORS]


def _binade_rows(occupied: np.ndarray) -> np.ndarray:
    """Histogram bins to draw as rows: the occupied range plus a margin when it is compact; otherwise only the
    occupied bins, so a few values far from the rest (a 2**127 among ones) still get a visible row."""
    if not len(occupied):
        return np.arange(L.HIST_BINS // 2 - 4, L.HIST_BINS // 2 + 4)
    lo, hi = max(occupied[0] - 2, 0), min(occupied[-1] + 2, L.HIST_BINS - 1)
    if hi - lo + 1 <= HEATMAP_MAX_ROWS:
        return np.arange(lo, hi + 1)
    return occupied


def plot_exponent_heatmap(summary: dict, history):
    """Exponent histogram of each chosen tensor over the history steps (colour: fraction of the tensor's elements
    in each binade); a red X marks steps where the tensor held NaN/inf, dashed lines mark skipped binades."""
    from matplotlib.colors import LogNorm

    names = _heatmap_tensors(summary, history)
    if not names or not history:
        return None
    steps = [e.step for e in history]
    fig = _figure(10, 2.1 * len(names) + 0.6)
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names):
        fractions = np.full((L.HIST_BINS, len(steps)), np.nan)
        bad_steps = []
        for j, entry in enumerate(history):
            if name in entry.report:
                stats = entry.report[name]
                column = stats.exp_hist / max(stats.numel, 1)
                fractions[:, j] = np.where(column > 0, column, np.nan)
                if stats.nonfinite:
                    bad_steps.append(j)
        rows = _binade_rows(np.flatnonzero(np.isfinite(fractions).any(axis=1)))
        image = ax.imshow(fractions[rows], origin="lower", aspect="auto", cmap="viridis",
                          norm=LogNorm(vmin=1e-4, vmax=1.0), interpolation="nearest",
                          extent=(-0.5, len(steps) - 0.5, -0.5, len(rows) - 0.5))
        for i in np.flatnonzero(np.diff(rows) > 1):  # binades skipped between two drawn rows
            ax.axhline(i + 0.5, color="0.3", lw=1, ls=(0, (4, 3)))
        every = max(1, len(rows) // 8)
        ax.set_yticks(range(0, len(rows), every), [str(b + L.MIN_BIN_EXPONENT) for b in rows[::every]],
                      fontsize=7)
        if bad_steps:
            ax.scatter(bad_steps, [len(rows) - 1] * len(bad_steps), marker="X", s=60, color="red", zorder=3,
                       label="NaN/inf present")
            ax.legend(loc="upper left", fontsize=8, framealpha=0.8)
        ax.set_title(name, fontsize=9, loc="left", parse_math=False)  # a '$' in a batch key is not TeX
        ax.set_ylabel("log2 |x|", fontsize=8)
        fig.colorbar(image, ax=ax, pad=0.01, label="fraction")
    every = max(1, len(steps) // 12)
    ticks = sorted(set(range(0, len(steps), every)[:-1]) | {len(steps) - 1})  # always label the last step
    axes[-1].set_xticks(ticks, [str(steps[i]) for i in ticks])
    axes[-1].set_xlabel("step")
    fig.suptitle("exponent histogram per step (finite values)", fontsize=10)
    return fig


def _spike_list(spikes: list[dict]) -> str:
    return ", ".join(f"step {s['step']} ({s['quantity']} {s['ratio']:.3g}x)" for s in spikes[-10:])


def _spike_rows(spike: dict) -> tuple[list[list[str]], list[list[str]]]:
    """(score rows, first-moving rows) of a spike summary, as text cells. A growth's score (NOTE: [growth rule])
    holds the value where the growth began as its median and the binades gained as its z; an elevated one's (NOTE:
    [elevated rule]) the first step's value and the binades above it."""
    by_rule = (GROWTH, ELEVATED)
    scores = [[s["quantity"] + (f" ({s['kind']})" if s.get("kind") in by_rule else ""), _fmt(s["value"]),
               _fmt(s["median"]), f"{s['ratio']:.3g}x",
               f"+{s['z']:.1f} binades" if s.get("kind") in by_rule else f"{s['z']:.1f}"]
              for s in spike["scores"]]
    moving = [[t["layer"], t["name"], str(t["onset"]), f"{t['ratio']:.3g}x", f"{t['z']:.1f}"]
              for t in spike["first_moving"]]
    return scores, moving


def _spike_title(spike: dict) -> str:
    kinds = {s.get("kind") for s in spike["scores"]}
    if GROWTH in kinds:
        return "growth: still rising over its last finite steps, by binades, to a new high (start: where it began)"
    if ELEVATED in kinds:
        return (f"elevated: {spike['window']} finite steps in a row far above the first step's value (start: the "
                "first step's)")
    return f"spike against the last {spike['window']} finite steps (log space, median and MAD)"


def _spike_tables(table, spike: dict):
    from rich.console import Group

    scores, moving = _spike_rows(spike)
    first = table(_spike_title(spike), "quantity", "value", "median or start", "ratio", "robust z or gain")
    for row in scores:
        first.add_row(*_literal(*row))
    second = table("gradient norms that moved first, by layer", "layer", "tensor", "from step", "ratio",
                   "robust z", left=2)
    for row in moving:
        second.add_row(*_literal(*row))
    return Group(first, second) if moving else first


def _mark_nonfinite(ax, step: int, text: str | None = None) -> None:
    """A non-finite value at `step`: a red X at the top of the axis (a log axis has no place for it), labelled with
    what it was when `text` is given."""
    ax.scatter([step], [1.0], transform=ax.get_xaxis_transform(), marker="X", s=70, color="red", zorder=3,
               clip_on=False)
    if text is not None:
        ax.annotate(text, xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(-8, -4),
                    textcoords="offset points", ha="right", va="top", color="red", fontsize=9)


def plot_curves(summary: dict, history):
    """Loss and gradient norm over the history, with the first invalid step marked; a non-finite value is drawn
    as a red X at the top of the axis, labelled with what it was; the run's rollbacks as purple dotted lines."""
    if not history:
        return None
    step = summary["first_invalid_step"]
    fig = _figure(10, 4.6)
    ax_loss, ax_norm = fig.subplots(2, 1, sharex=True)
    for ax, key, label in ((ax_loss, "loss", "loss"), (ax_norm, "grad_norm", "grad norm (finite values)")):
        points = [(e.step, getattr(e, key)) for e in history if getattr(e, key) is not None]
        good = [(s, v) for s, v in points if math.isfinite(v)]
        if good:
            ax.plot(*zip(*good), marker=".", color="tab:blue", lw=1.2)
        if key == "grad_norm" and good and min(v for _s, v in good) > 0:
            ax.set_yscale("log")
        if step is not None:
            ax.axvline(step, color="red", ls="--", lw=1)
        spiked = {s["step"] for s in summary.get("spikes", [])}
        marked = [(s, v) for s, v in good if s in spiked]
        if marked:
            ax.scatter(*zip(*marked), marker="^", s=60, color="darkorange", zorder=3, label="spike")
            ax.legend(loc="upper left", fontsize=8, framealpha=0.8)
        for s, v in points:
            if not math.isfinite(v):
                _mark_nonfinite(ax, s, _json_float(v))
        shown = [r for r in summary.get("rollbacks", []) if "at_step" in r and points
                 and points[0][0] <= r["at_step"] <= points[-1][0]]
        for r in shown:  # the Monitor went back to an earlier state here (on_invalid=Rollback)
            ax.axvline(r["at_step"], color="purple", ls=":", lw=1.5)
            if key == "loss":
                ax.annotate(f"rollback to step {r['restored_step']}", xy=(r["at_step"], 0.92),
                            xycoords=("data", "axes fraction"), xytext=(-4, 0), textcoords="offset points",
                            ha="right", color="purple", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if step is not None:
        label = "spike" if summary["category"] == SPIKE else "first invalid step"
        ax_norm.annotate(f"{label} {step}", xy=(step, 0.5), xycoords=("data", "axes fraction"),
                         xytext=(-6, 0), textcoords="offset points", ha="right", va="center", color="red",
                         fontsize=9)
    ax_norm.set_xlabel("step")
    return fig


def plot_divergence(div: dict):
    """The steps before the incident on log axes: loss, gradient norm, each param group's learning rate and the
    loss scale; a dotted line where layers began to grow (NOTE: [divergence onset]), labelled with them, a dashed
    red one at the incident; a non-finite value is a red X at the top of its axis."""
    from nanscan.bundle.divergence import onsets_by_step  # noqa: PLC0415 - NOTE: [fast help]

    rows = div["steps"]
    fig = _figure(10, 6.4)
    ax_loss, ax_norm, ax_lr = fig.subplots(3, 1, sharex=True)
    series = [(ax_loss, "loss", [(r["step"], r["loss"]) for r in rows], "tab:blue"),
              (ax_norm, "grad norm", [(r["step"], "nan" if r["nonfinite_gradients"] else r["grad_norm"])
                                      for r in rows], "tab:purple")]
    groups = max((len(r["lrs"]) for r in rows), default=0)
    differ = any(len(set(map(str, r["lrs"]))) > 1 for r in rows)
    for g in range(groups if differ else min(groups, 1)):
        series.append((ax_lr, f"lr, group {g}" if differ else "learning rate",
                       [(r["step"], r["lrs"][g]) for r in rows if len(r["lrs"]) > g], None))
    for ax, label, points, color in series:
        values = [(s, None if v is None else float(v)) for s, v in points]
        good = [(s, v) for s, v in values if v is not None and math.isfinite(v)]
        if good:
            ax.plot(*zip(*good), marker=".", lw=1.2, color=color, label=label)
            if min(v for _s, v in good) > 0:
                ax.set_yscale("log")
        for s, v in values:
            if v is not None and not math.isfinite(v):
                _mark_nonfinite(ax, s)
        ax.set_ylabel(label if ax is not ax_lr else "learning rate")
    scales = [(r["step"], float(r["loss_scale"])) for r in rows if _is_finite(r["loss_scale"])]
    if scales:
        ax_scale = ax_lr.twinx()
        ax_scale.step(*zip(*scales), where="post", color="tab:green", lw=1.2, label="loss scale")
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_ylabel("loss scale", color="tab:green")
    if differ:
        ax_lr.legend(loc="upper left", fontsize=8, framealpha=0.8)
    onsets = onsets_by_step(div)
    for ax in (ax_loss, ax_norm, ax_lr):
        ax.grid(alpha=0.3)
        ax.axvline(div["step"], color="red", ls="--", lw=1)
        for onset in onsets:
            ax.axvline(onset, color="darkorange", ls=":", lw=1.5)
    for onset, layers in onsets.items():
        text = ", ".join(layers[:2]) + (f" +{len(layers) - 2}" if len(layers) > 2 else "")
        ax_loss.annotate(f"{text} from {onset}", xy=(onset, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(3, 3), textcoords="offset points", ha="left", va="bottom", color="darkorange",
                         fontsize=8, annotation_clip=False)
    ax_norm.annotate(f"incident {div['step']}", xy=(div["step"], 0.5), xycoords=("data", "axes fraction"),
                     xytext=(-6, 0), textcoords="offset points", ha="right", va="center", color="red", fontsize=9)
    ax_lr.set_xlabel("step")
    return fig


def _divergence_html(div: dict) -> list[str]:
    """The divergence section: the rule, the plot, the tensors that grew first by layer, every step."""
    from nanscan.bundle.incident_md import (divergence_rows, divergence_rule_text,  # noqa: PLC0415 - [fast help]
                                            divergence_title)

    esc = html.escape
    if not div["grew"]:
        return [f"<h2>Divergence before step {div['step']}</h2>", f"<p>{esc(_divergence_none_text(div))}.</p>"]
    shown, more = divergence_rows(div)
    last = div["judged"][1]
    parts = [f"<h2>{esc(divergence_title(div))}</h2>", f"<p>{esc(divergence_rule_text(div))}.</p>",
             *_img(plot_divergence(div), "loss, gradient norm, learning rate and loss scale before the incident, "
                                         "with the onsets of the layers that grew first"),
             _table(["layer", "tensor", "grew from step", "baseline binade", f"binade at step {last}", "gained"],
                    [[t["layer"], t["tensor"], t["onset"], t["baseline"], t["binade"], f"+{t['binades']}"]
                     for t in shown], left=2)]
    if more:
        parts.append(f"<p class='muted'>{more} more tensors grew: see <code>nanscan report --json</code>.</p>")
    headers, cells, _stride = _divergence_cells(div, len(div["steps"]))
    parts.append(_table(headers, cells, left=0))
    return parts


def _map_cells(summary: dict, history) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """Rows (modules, or layers when there are many), kind columns, non-finite fraction and count per cell."""
    step = summary["first_invalid_step"]
    failing = next((e for e in history if e.step == step), None)
    reference = failing or (history[-1] if history else None)
    tensors: list[tuple[str, str, str, int, int]] = []  # kind, module, layer, numel, nonfinite
    if failing is not None:
        for s in failing.report:
            tensors.append((*split_name(s.name), s.numel, s.nonfinite))
    else:
        bad = {t["name"]: t for t in summary["nonfinite_tensors"]}
        for s in (reference.report if reference else []):
            t = bad.get(s.name)
            tensors.append((*split_name(s.name), s.numel, t["nan"] + t["posinf"] + t["neginf"] if t else 0))
    use_layers = len({m for _k, m, *_ in tensors}) > MAP_MAX_ROWS
    rows = list(dict.fromkeys((layer if use_layers else module) for _k, module, layer, *_ in tensors))
    kinds = sorted({k for k, *_ in tensors}, key=_kind_rank)
    numel = np.zeros((len(rows), len(kinds)))
    bad = np.zeros((len(rows), len(kinds)))
    for kind, module, layer, n, nonfinite in tensors:
        i, j = rows.index(layer if use_layers else module), kinds.index(kind)
        numel[i, j] += n
        bad[i, j] += nonfinite
    fraction = np.where(numel > 0, bad / np.maximum(numel, 1), np.nan)
    return rows, kinds, fraction, bad


def plot_nonfinite_map(summary: dict, history):
    """Which modules held NaN/inf at the failing step, per kind of tensor (fraction of elements)."""
    rows, kinds, fraction, bad = _map_cells(summary, history)
    if not rows:
        return None
    fig = _figure(2.2 + 1.3 * len(kinds), 0.8 + 0.32 * len(rows))
    ax = fig.subplots()
    cmap = _nonfinite_cmap()
    image = ax.imshow(fraction, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    for i in range(len(rows)):
        for j in range(len(kinds)):
            if np.isfinite(fraction[i, j]) and bad[i, j]:
                ax.text(j, i, _pct(fraction[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if fraction[i, j] > 0.5 else "black")
    ax.set_xticks(range(len(kinds)), [KIND_LABEL.get(k, k) for k in kinds])
    ax.set_yticks(range(len(rows)), rows, fontsize=8, parse_math=False)
    ax.xaxis.tick_top()
    ax.set_title(f"non-finite elements at step {summary['first_invalid_step']} (grey: no such tensor)",
                 fontsize=10)
    fig.colorbar(image, ax=ax, pad=0.02, label="non-finite fraction")
    return fig


def _nonfinite_cmap():
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("nonfinite", ["#f4f4f4", "#fdae61", "#d7191c", "#67000d"])
    return cmap.with_extremes(bad="#bdbdbd")


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; }
.bad { color: #b00; font-weight: bold; } .muted { color: #666; } img { max-width: 100%; }
code { background: #f4f4f4; padding: 1px 4px; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; }
.note { border-left: 3px solid #ddd; padding-left: 1em; } .note table td { text-align: left; }
.note h1 { font-size: 1.2em; } .note h2 { font-size: 1.1em; } .note h3 { font-size: 1em; }
"""

# nanscan's own markers in INCIDENT.md (<!-- nanscan:finding ... -->, <!-- nanscan:note ... -->): for the note's
# updates, not for a reader.
_MARKER = re.compile(r"^[ \t]*<!-- nanscan:[^\n]*-->[ \t]*\n?", re.MULTILINE)


def markdown_html(text: str) -> str:
    """Markdown (INCIDENT.md, a finding) as HTML, with markdown-it-py: tables, headings and lists rendered, nanscan's
    markers dropped, and any raw HTML in the text shown as text, never as markup (a bundle's text is data)."""
    from markdown_it import MarkdownIt  # noqa: PLC0415 - with the HTML report only

    return MarkdownIt("commonmark", {"html": False}).enable("table").render(_MARKER.sub("", text))


def _table(headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    def cell(tag, i, value):
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{html.escape(str(value))}</{tag}>"
    head = "".join(cell("th", i, h) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(bundle, path, *, summary: dict | None = None, history: list | None = None,
                incident: str | None = None) -> Path:
    """Write one self-contained HTML report (inline CSS, plots as embedded PNG) to `path`, atomically.
    `summary`, `history` and `incident`: summarize(bundle), load_history(bundle) and bundle.incident_text(), when
    the caller already has them."""
    from nanscan._atomic import atomic_write_text

    history = load_history(bundle) if history is None else history
    summary = summarize(bundle, history) if summary is None else summary
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    esc = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>nanscan report: "
             f"{esc(str(summary['run_id']))} step {summary['first_invalid_step']}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>nanscan incident: run <code>{esc(str(summary['run_id']))}</code></h1>",
             f"<p><span class='bad'>first invalid step {summary['first_invalid_step']}</span>, category "
             f"<b>{esc(str(summary['category']))}</b>: {esc(summary['category_meaning'])}</p>",
             f"<p class='muted'>bundle {esc(summary['bundle'])}; history of {summary['history']['steps']} steps "
             f"({summary['history']['first']}..{summary['history']['last']}); "
             f"{esc(size_text(summary.get('size')))}</p>"]

    if summary.get("distributed"):
        parts.append(f"<h2>{esc(_ranks_title(summary['distributed'], summary['first_invalid_step']))}</h2>")
        parts.append(_table(list(RANKS_HEADERS), _ranks_rows(summary["distributed"]), left=4))
    rows = [[label, v["step"], _fmt(v["loss"]), _fmt(v["lr"], ".3e"), _grad_norm_cell(v), v["nonfinite_tensors"]]
            for label, v in (("last finite", summary["last_finite"]), ("first invalid", summary["failing"]))
            if v is not None]
    from nanscan.bundle.findings import findings_lines  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    parts.append("<h2>Findings</h2><ul>" + "".join(f"<li>{esc(line)}</li>"
                                                   for line in findings_lines(summary["findings"])) + "</ul>")
    parts.append("<h2>Loss, learning rate and gradient norm</h2>")
    parts.append(_table(["", "step", "loss", "lr", "grad norm", "non-finite tensors"], rows))
    parts += _img(plot_curves(summary, history), "loss and gradient norm")

    parts.append("<h2>Non-finite tensors by module</h2>")
    parts.append(_table(["module", "layer", "tensors", "NaN", "+inf", "-inf", "of numel"],
                        [[g["module"], g["layer"], ", ".join(g["tensors"]), g["nan"], g["posinf"], g["neginf"],
                          g["numel"]] for g in summary["groups"]], left=3))
    parts += _img(plot_nonfinite_map(summary, history), "per-module non-finite map")

    if summary.get("spike"):
        scores, moving = _spike_rows(summary["spike"])
        parts.append(f"<h2>{esc(_spike_title(summary['spike']).capitalize())}</h2>")
        parts.append(_table(["quantity", "value", "median or start", "ratio", "robust z or gain"], scores))
        if moving:
            parts.append("<p>Gradient norms that moved first, by layer:</p>")
            parts.append(_table(["layer", "tensor", "from step", "ratio", "robust z"], moving, left=2))
    if summary.get("spikes"):
        parts.append(f"<p>Spikes of this run up to here: {esc(_spike_list(summary['spikes']))}</p>")

    if summary.get("divergence"):
        parts += _divergence_html(summary["divergence"])

    if summary["inputs_at_failure"]:
        parts.append(f"<h2>Batch at step {summary['first_invalid_step']}</h2>")
        parts.append(_table(["tensor", "dtype", "numel", "NaN", "inf", "zero", "absmax", "top binade"],
                            [[r["name"], r["dtype"], r["numel"], r["nan"], r["posinf"] + r["neginf"], r["zero"],
                              _fmt(r["absmax"]), _fmt(r["top_binade"], "d")] for r in summary["inputs_at_failure"]],
                            left=2))
        ids = sample_id_list(summary["batch"].get("sample_ids"))
        if ids:
            parts.append(f"<p class='muted'>sample ids: {esc(', '.join(map(str, ids)))}</p>")

    parts.append("<h2>Exponent histograms over the history</h2>")
    parts += _img(plot_exponent_heatmap(summary, history), "exponent heatmap")
    if summary["exponent_jumps"]:
        parts.append(f"<p>Largest values that jumped at step {summary['first_invalid_step']} "
                     f"({summary['exponent_jumps_total']} tensors rose by {JUMP_BINADES} binades or more):</p>")
        parts.append(_table(["tensor", "top binade before", "after", "jump"],
                            [[j["name"], j["top_binade_before"], j["top_binade_after"], f"+{j['jump']}"]
                             for j in summary["exponent_jumps"]]))

    if summary["headroom"]:
        parts.append("<h2>Dtype headroom</h2><p class='muted'>overflow / below the normal range, as fractions of "
                     "finite non-zero values (binade granularity); float32: binades left before overflow</p>")
        parts.append(_table(["tensor", "dtype", "step", "numel", "absmax", *[f.name for f in HEADROOM_FORMATS]],
                            [[r["name"], r["dtype"], r["step"], r["numel"], _fmt(r["absmax"], ".3g"),
                              _fmt(r["formats"]["float32"]["binades_to_overflow"], "d"),
                              *[_headroom_cell(r["formats"][f.name]) for f in FORMATS]]
                             for r in summary["headroom"]]))
    if summary.get("mixed_precision"):
        parts.append(f"<h2>Mixed precision</h2><pre>{esc(chr(10).join(_mixed_precision_text(summary)))}</pre>")
    provenance = {"source": summary["source"], "replay_entry": summary["replay_entry"]}
    parts.append(f"<h2>Provenance</h2><pre>{esc(json.dumps(provenance, indent=2, default=str))}</pre>")
    incident = bundle.incident_text() if incident is None else incident
    parts.append(f"<h2>Incident note</h2><div class='note'>{markdown_html(incident)}</div>")
    parts.append("</body></html>\n")
    return atomic_write_text(path, "".join(parts))


def bundle_holding(bundle, path) -> Path | None:
    """The bundle directory (or, for a distributed set, the part's) that `path` would land in, or None."""
    target = Path(path).resolve()
    parts = getattr(bundle, "parts", None) or {}
    for directory in [bundle.path, *(part.path for part in parts.values())]:
        if target.is_relative_to(Path(directory).resolve()):
            return Path(directory)
    return None


def _img(fig, alt: str) -> list[str]:
    alt = html.escape(alt, quote=True)
    if fig is None:
        return [f"<p class='muted'>({alt}: no history in this bundle)</p>"]
    return [f"<p><img alt=\"{alt}\" src=\"data:image/png;base64,{_png(fig)}\"></p>"]


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

@click.command("report")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(path_type=Path))
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a self-contained HTML report with plots to this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the machine-readable summary instead of tables.")
def report_command(bundle_path, html_out, as_json):
    """Summarize an incident bundle: first invalid step, category, offending tensors, last finite values, headroom.

    Exits 2 when the bundle cannot be read.
    """
    from nanscan.bundle import BundleError, load_bundle  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    try:
        bundle = load_bundle(bundle_path)
        history = load_history(bundle)
        summary = summarize(bundle, history)
        incident = bundle.incident_text() if html_out is not None else None
    except (BundleError, OSError) as exc:
        click.echo(f"nanscan report: cannot read the bundle {bundle_path}: {exc}\n"
                   "Pass the step-<N> directory that `nanscan demo` or a Monitor printed "
                   "(it holds manifest.json).", err=True)
        raise SystemExit(2) from None
    if html_out is not None:
        inside = bundle_holding(bundle, html_out)
        if inside is not None:
            raise click.ClickException(f"--html {html_out} is inside the bundle {inside}: a file the manifest does "
                                       "not list makes the bundle fail to load; write the report elsewhere")
        try:
            render_html(bundle, html_out, summary=summary, history=history, incident=incident)
        except OSError as exc:
            raise click.ClickException(f"cannot write the HTML report {html_out}: {exc}") from None
    if as_json:
        click.echo(json.dumps(summary, indent=2, allow_nan=False))
        return
    from nanscan.cli.errors import console as cli_console  # noqa: PLC0415

    console = cli_console()
    render_terminal(summary, console)
    if html_out is not None:
        console.print(f"html: {html_out}", highlight=False)
