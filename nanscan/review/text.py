"""What the terminal and the HTML views of `nanscan report` both say, worded once from the summary
(nanscan.review.summary): numbers and cells, the headline, table rows and titles, and the lines about replicas,
rollbacks, findings, spikes, sizes and mixed precision. Each view only lays them out.
"""

from __future__ import annotations

from typing import Any

from nanscan.incident import ELEVATED, GROWTH, REPLICA_MISMATCH, SPIKE
from nanscan.review.summary import abandoned_steps

RANKS_HEADERS = ("rank", "host / device", "category", "deciding tensors", "non-finite tensors")
AROUND_HEADERS = ("", "step", "loss", "lr", "grad norm", "non-finite tensors")
REPLICA_TENSORS_SHOWN = 10  # as many as INCIDENT.md names


# ---------------------------------------------------------------------------------------------------------------
# Numbers and cells
# ---------------------------------------------------------------------------------------------------------------

def fmt(x: Any, spec: str = ".4g") -> str:
    """A recorded number as text: "-" when absent, the summary's "nan"/"inf" strings as they are."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def pct(fraction: float, *, compact: bool = False) -> str:
    if fraction == 0:
        return "0"
    if compact:
        return "<1%" if fraction < 0.01 else f"{100 * fraction:.0f}%"
    return "<0.1%" if fraction < 0.001 else f"{100 * fraction:.1f}%"


def headroom_cell(fmt_row: dict, *, compact: bool = False) -> str:
    """One format's column of a headroom row: the share that would overflow / fall below the normal range."""
    over = pct(fmt_row["overflow"], compact=compact)
    below = pct(fmt_row["subnormal"] + fmt_row["underflow"], compact=compact)
    return f"{over}/{below}" if compact else f"{over} / {below}"


def grad_norm_cell(values: dict) -> str:
    # grad_norm sums the finite values only: with a non-finite gradient it is not the step's norm
    return "non-finite" if values.get("nonfinite_gradients") else fmt(values["grad_norm"])


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.2f} MiB" if size >= 1 << 16 else f"{size:,} bytes"


# ---------------------------------------------------------------------------------------------------------------
# The headline and the steps around the incident
# ---------------------------------------------------------------------------------------------------------------

def step_label(summary: dict) -> str:
    """What the bundle's step is: a spike, replicas that differ (every value finite) or the first invalid step."""
    if summary["category"] == SPIKE:
        return "spike"
    return "replicas differ" if summary["category"] == REPLICA_MISMATCH else "first invalid"


def headline(summary: dict) -> str:
    step = summary["first_invalid_step"]
    label = step_label(summary)
    return f"{label} at step {step}" if label != "first invalid" else f"first invalid step {step}"


def step_cell(step: int, abandoned: dict[int, int]) -> str:
    """A history step's number, marked when a rollback abandoned it (abandoned_steps)."""
    return f"{step} abandoned" if step in abandoned else str(step)


def around_rows(summary: dict) -> list[list[str]]:
    """The last finite step and the bundle's own, as rows under AROUND_HEADERS."""
    abandoned = abandoned_steps(summary.get("abandoned"))
    return [[label, step_cell(values["step"], abandoned), fmt(values["loss"]), fmt(values["lr"], ".3e"),
             grad_norm_cell(values), str(values["nonfinite_tensors"])]
            for label, values in (("last finite", summary["last_finite"]), (step_label(summary), summary["failing"]))
            if values is not None]


def abandoned_label(at_step: int) -> str:
    return f"abandoned by the rollback at step {at_step}"


def abandoned_lines(summary: dict) -> list[str]:
    """One line per run of history steps a rollback abandoned (nanscan.runtime.rollback NOTE: [rollback]): their
    updates were undone, and the steps after the rollback go on from the restored state with new numbers."""
    history = summary["history"]
    if not history["steps"]:
        return []
    lines = []
    for span in summary.get("abandoned") or ():
        first, last = max(span["first"], history["first"]), min(span["last"], history["last"])
        if first > last:
            continue
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        lines.append(f"{steps}: {abandoned_label(span['at_step'])} (back to step {span['restored_step']}'s start); "
                     f"the steps after {span['at_step']} go on from that state")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Ranks and replicas
# ---------------------------------------------------------------------------------------------------------------

def ranks_title(ranks: dict, step) -> str:
    return (f"ranks at step {step} (world size {ranks['world_size']}, agreement {ranks['agreement']}; "
            f"showing rank {ranks['shown_rank']}'s part)")


def ranks_rows(ranks: dict) -> list[list[str]]:
    """One row per rank under RANKS_HEADERS: its host and device (the machine a replica mismatch or a recurring
    fault points at), its category and tensors; the odd rank(s) of a replica mismatch marked, else the first bad."""
    from nanscan.bundle.rank_set import device_label  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    first = set(ranks["first_bad_ranks"])
    odd = set((ranks.get("replicas") or {}).get("odd_ranks") or ())
    rows = []
    for r in ranks["ranks"]:
        tensors = r.get("category_tensors") or []
        shown = ", ".join(tensors[:2]) + (f" +{len(tensors) - 2}" if len(tensors) > 2 else "")
        where = f"{r.get('host') or '?'} / {device_label(r.get('device'))}"
        mark = " (odd)" if r["rank"] in odd else " (first)" if r["rank"] in first else ""
        rows.append([f"{r['rank']}{mark}", where, str(r.get("category")),
                     shown or ("no part: " + r["error"] if r.get("error") else ""), str(r.get("nonfinite_count", "-"))])
    return rows


def replica_lines(summary: dict) -> list[str]:
    """A replica mismatch's verdict (nanscan.runtime.replicas NOTE: [replica agreement]) as INCIDENT.md words it:
    the odd rank(s) and the cause, then the tensors that differed. None for another category, or an index that
    predates the comparison."""
    replicas = (summary.get("distributed") or {}).get("replicas")
    if summary["category"] != REPLICA_MISMATCH or not replicas:
        return []
    tensors = list(replicas.get("tensors") or [])
    more = len(tensors) - REPLICA_TENSORS_SHOWN
    return [f"Replicas: {replicas['ranks_text']}; {replicas['cause']} ({replicas['differing_count']} tensor(s) "
            "differed).",
            f"Tensors that differed across the replicas: {', '.join(tensors[:REPLICA_TENSORS_SHOWN])}"
            + (f" and {more} more." if more > 0 else ".")]


# ---------------------------------------------------------------------------------------------------------------
# Findings
# ---------------------------------------------------------------------------------------------------------------

def findings_text(summary: dict) -> list[str]:
    """The ledger's findings as lines (nanscan.bundle.findings.findings_lines). For a replica mismatch that nothing
    was replayed for, the replay line says why replay does not apply instead of "not run yet": every value was
    finite, so there is no first bad module to find, and the lead is the odd rank's machine."""
    from nanscan.bundle.findings import findings_lines  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    found = summary["findings"]
    lines = findings_lines(found)
    if summary["category"] == REPLICA_MISMATCH and found.get("replay") is None and not found.get("first_bad_module"):
        # findings_lines' first line is then its "replay: not run yet" (it knows no category)
        lines[0] = ("replay: does not apply (every value was finite, so there is no first bad module to find; the "
                    "ranks table names the odd rank's host and device, and `nanscan triage` shows a machine that "
                    "keeps appearing)")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Sections' lines
# ---------------------------------------------------------------------------------------------------------------

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


def divergence_none_text(div: dict) -> str:
    """The divergence section where no tensor grew: what was judged, and that nothing crossed the threshold."""
    first, last = div["judged"]
    binades = div["rule"]["binades"]
    return (f"divergence: no parameter or gradient grew by {binades} binades ({2 ** binades}x) over steps "
            f"{first}-{last} before step {div['step']}, each against its own start (its median at steps "
            f"{div['baseline'][0]}-{div['baseline'][-1]})")


def divergence_cells(div: dict, limit: int, abandoned: list[dict] | None) -> tuple[list[str], list[list[str]], int]:
    """(headers, rows, stride) of the divergence's steps table: loss, gradient norm, learning rate, the loss scale
    where a GradScaler ran, the layers that began to grow there; a step a rollback abandoned (`abandoned`: the
    summary's spans of them) is marked so."""
    from nanscan.bundle.divergence import lr_text, onsets_by_step, shown_steps  # noqa: PLC0415 - NOTE: [fast help]

    abandoned_at = abandoned_steps(abandoned)
    rows, stride = shown_steps(div, limit)
    scaled = any(r["loss_scale"] is not None for r in div["steps"])
    onsets = onsets_by_step(div)
    headers = ["step", "loss", "grad norm", "lr", *(["scale"] if scaled else []), "began to grow"]
    cells = []
    for r in rows:
        note = "" if r["finite"] else (" skip" if r["overflow_skip"] else " NaN/inf")
        cells.append([f"{step_cell(r['step'], abandoned_at)}{note}", fmt(r["loss"]), grad_norm_cell(r),
                      lr_text(r["lrs"]), *([fmt(r["loss_scale"], ".3g")] if scaled else []),
                      ", ".join(onsets.get(r["step"], []))])
    return headers, cells, stride


def spike_list(spikes: list[dict]) -> str:
    return ", ".join(f"step {s['step']} ({s['quantity']} {s['ratio']:.3g}x)" for s in spikes[-10:])


def spike_rows(spike: dict) -> tuple[list[list[str]], list[list[str]]]:
    """(score rows, first-moving rows) of a spike summary, as text cells. A growth's score (NOTE: [growth rule])
    holds the value where the growth began as its median and the binades gained as its z; an elevated one's (NOTE:
    [elevated rule]) the first step's value and the binades above it."""
    by_rule = (GROWTH, ELEVATED)
    scores = [[s["quantity"] + (f" ({s['kind']})" if s.get("kind") in by_rule else ""), fmt(s["value"]),
               fmt(s["median"]), f"{s['ratio']:.3g}x",
               f"+{s['z']:.1f} binades" if s.get("kind") in by_rule else f"{s['z']:.1f}"]
              for s in spike["scores"]]
    moving = [[t["layer"], t["name"], str(t["onset"]), f"{t['ratio']:.3g}x", f"{t['z']:.1f}"]
              for t in spike["first_moving"]]
    return scores, moving


def spike_title(spike: dict) -> str:
    kinds = {s.get("kind") for s in spike["scores"]}
    if GROWTH in kinds:
        return "growth: still rising over its last finite steps, by binades, to a new high (start: where it began)"
    if ELEVATED in kinds:
        return (f"elevated: {spike['window']} finite steps in a row far above the first step's value (start: the "
                "first step's)")
    return f"spike against the last {spike['window']} finite steps (log space, median and MAD)"


def mixed_precision_text(summary: dict) -> list[str]:
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
