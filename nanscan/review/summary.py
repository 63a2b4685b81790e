"""What `nanscan report` says about a bundle, gathered once: `summarize(bundle)` is the single source of every
number and fact shown, as a JSON-ready dict; the terminal (nanscan.review.terminal), the HTML page
(nanscan.review.html_page) and --json only format it.

Non-finite floats (a NaN loss) appear in the summary as the strings "nan", "inf" and "-inf", since strict JSON has
no tokens for them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from nanscan.engine import _layout as L
from nanscan.engine.headroom import FORMATS, Format, headroom, headroom_by_kind
from nanscan.incident import (KINDS, LOSS, NONFINITE, PREFIX, REASON_EXPLANATIONS, SPIKE, explain_category,
                              module_layer, tensor_kind)

SUMMARY_SCHEMA = "nanscan.review.report/1"

# float32 is listed too: a tensor whose top binade is at float32's own ceiling is one step from inf.
HEADROOM_FORMATS = (Format("float32", 127, -126, -149), *FORMATS)
HEADROOM_PER_KIND = 2  # largest tensors of each kind in the headroom table
JUMPS_SHOWN = 5
JUMP_BINADES = 8  # a largest value that grew 256-fold in one step is worth a look
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


def json_float(value: Any) -> float | str | None:
    """nanscan.bundle's json_float, imported on first use: nanscan.bundle imports torch, which `nanscan report
    --help` must not wait for (NOTE: [fast help] in nanscan/cli/main.py)."""
    from nanscan.bundle import json_float as bundle_json_float  # noqa: PLC0415 - NOTE: [fast help]

    return bundle_json_float(value)


def is_finite(x: Any) -> bool:
    """A recorded number that is there and finite (None and the strings "nan", "inf", "-inf" are not)."""
    return x is not None and not isinstance(x, str) and math.isfinite(float(x))


def kind_rank(kind: str) -> int:
    """A tensor kind's place in the order of the failure categories (unknown kinds last)."""
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


# ---------------------------------------------------------------------------------------------------------------
# summarize
# ---------------------------------------------------------------------------------------------------------------

def load_history(bundle) -> list:
    """The bundle's history entries, oldest first."""
    return sorted(bundle.history(), key=lambda e: e.step)


def run_rollbacks(bundle) -> list[dict]:
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
    last_finite = next((e for e in reversed(before) if e.report.ok and (e.loss is None or is_finite(e.loss))), None)
    checked = [s.name for s in failing.report] if failing is not None else None

    offenders = [dict(t) for t in manifest.get("nonfinite_tensors", [])]
    for t in offenders:
        t["kind"], t["module"], t["layer"] = split_name(t["name"])
    groups = _group_by_module(offenders)
    jumps = _exponent_jumps(last_finite, failing)
    rollbacks = run_rollbacks(bundle)

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
        "rollbacks": rollbacks,
        # the history steps those rollbacks undid, each run with the rollback that undid it (a reader must not take
        # them for the steps that followed it, which go on with new numbers)
        "abandoned": abandoned_spans(rollbacks),
        # the run's spikes up to this step (nanscan.runtime.spikes); a spike bundle's own is "spike"
        "spikes": [{"step": s["step"], "quantity": s["quantity"], "ratio": s["scores"][0]["ratio"]}
                   for s in manifest.get("spikes", [])],
        "spike": _spike_summary(manifest, step) if category == SPIKE else None,
        "size": _size_summary(manifest),
        # the steps before the incident and the tensors that grew first, by layer (nanscan.bundle.divergence)
        "divergence": _divergence_summary(bundle, history, step, rollbacks),
    }


def abandoned_spans(rollbacks: list[dict]) -> list[dict]:
    """The steps each rollback abandoned (nanscan.runtime.rollback NOTE: [rollback]: their updates undone, their
    batches not fed again), as runs of consecutive steps: {"first", "last", "at_step", "restored_step"}, in the
    order of the rollbacks. A record without its skipped steps (an error row) abandons none."""
    spans = []
    for r in rollbacks:
        steps = sorted({s for s in r.get("skipped_steps") or () if isinstance(s, int)})
        for i, s in enumerate(steps):
            if i == 0 or s != steps[i - 1] + 1:
                spans.append({"first": s, "last": s, "at_step": r.get("at_step"),
                              "restored_step": r.get("restored_step")})
            else:
                spans[-1]["last"] = s
    return spans


def abandoned_steps(spans: list[dict] | None) -> dict[int, int]:
    """Each step of `spans` (abandoned_spans, the summary's "abandoned") and the rollback step that abandoned it."""
    steps: dict[int, int] = {}
    for span in spans or ():
        for s in range(span["first"], span["last"] + 1):
            steps.setdefault(s, span["at_step"])  # a step a later rollback went back over was undone by the first
    return steps


def _divergence_summary(bundle, history: list, step, rollbacks: list[dict]) -> dict | None:
    """nanscan.bundle.divergence's summary of the history up to `step`, the learning rates of each param group
    from the run's window where the bundle holds one (NOTE: [divergence onset]); the steps that rollbacks before
    this incident abandoned are not judged (their updates were undone: the run that failed here is not their
    lineage), as INCIDENT.md's finding leaves them out. A rollback at this step or later abandoned steps that were
    this failure's own lineage, and they are judged."""
    from nanscan.bundle.divergence import divergence  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    if step is None:
        return None
    earlier = [r for r in rollbacks if isinstance(r.get("at_step"), int) and r["at_step"] < step]
    return divergence(history, bundle.window_records() if bundle.window is not None else [], step,
                      abandoned=set(abandoned_steps(abandoned_spans(earlier))))


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


def _mixed_precision(record: dict | None, history: list, failing) -> dict | None:
    """The mixed-precision section: the bundle's record (autocast, scaler, skips, streak), the scale and overflow
    skip of every history step under a scaler, and per-kind headroom of the failing step's scanned values, its
    gradients unscaled (nanscan.engine.stats NOTE: [unscaled gradients])."""
    if record is None:
        return None
    steps = [{"step": e.step, "scale": json_float(e.report.scale), "overflow_skip": e.report.overflow_skip,
              "stats_unscaled": e.report.scaling.unscaled}
             for e in history if e.report.scaling is not None]
    kinds = headroom_by_kind(failing.report) if failing is not None else {}
    return {**record, "steps": steps,
            "headroom": {kind: [h.to_dict() for h in rooms] for kind, rooms in kinds.items()}}


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
    return {"step": entry.step, "loss": json_float(entry.loss), "lr": json_float(entry.lr),
            "grad_norm": json_float(entry.grad_norm), "nonfinite_tensors": len(entry.report.nonfinite),
            # grad_norm sums the finite values only: with any of these, it is not the step's gradient norm
            "nonfinite_gradients": sum(1 for n in entry.report.nonfinite if tensor_kind(n) == "gradient")}


def _inputs(report) -> list[dict]:
    rows = []
    for stats in report:
        if tensor_kind(stats.name) != "input":
            continue
        rows.append({"name": stats.name, "dtype": stats.dtype, "numel": stats.numel, "nan": stats.nan,
                     "posinf": stats.posinf, "neginf": stats.neginf, "zero": stats.zero,
                     "absmax": json_float(stats.absmax), "absmin": json_float(stats.absmin),
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
        for kind in sorted(by_kind, key=kind_rank):
            chosen += [(last_finite.step, s) for s in by_kind[kind][:HEADROOM_PER_KIND]]
    if failing is not None:
        chosen += [(failing.step, s) for s in failing.report if tensor_kind(s.name) == "input"]
    rows = []
    for step, stats in chosen:
        formats = {h.format: {"overflow": h.overflow, "subnormal": h.subnormal, "underflow": h.underflow,
                              "binades_to_overflow": h.binades_to_overflow}
                   for h in headroom(stats.exp_hist, HEADROOM_FORMATS)}
        rows.append({"step": step, "name": stats.name, "dtype": stats.dtype, "numel": stats.numel,
                     "absmax": json_float(stats.absmax),
                     "nonfinite": stats.nonfinite, "formats": formats})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Where a report (or an export) may be written
# ---------------------------------------------------------------------------------------------------------------

def bundle_holding(bundle, path) -> Path | None:
    """The bundle directory (or, for a distributed set, the part's) that `path` would land in, or None."""
    target = Path(path).resolve()
    parts = getattr(bundle, "parts", None) or {}
    for directory in [bundle.path, *(part.path for part in parts.values())]:
        if target.is_relative_to(Path(directory).resolve()):
            return Path(directory)
    return None
