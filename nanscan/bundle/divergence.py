"""The divergence before an incident, from a bundle's history and its run's window: per step the loss, gradient
norm, learning rates and loss scale, and which tensors' magnitudes grew first, by layer. INCIDENT.md's "divergence"
finding (nanscan.bundle.incident_md) and `nanscan report`'s divergence section (nanscan.review) show it.

NOTE: [divergence onset]
A tensor's magnitude at a step is its top binade, floor(log2 max|x|) over its finite values, read from the
exponent histogram its scan already wrote (gradients unscaled: NOTE: [unscaled gradients] in nanscan.engine.stats).
Judged are the parameters and gradients of the finite steps up to the incident: a non-finite step's finite part
is no magnitude, and a GradScaler's overflow skip is non-finite. Optimizer state is not judged, it follows the
gradients (Adam's second moment in squared units, so by twice their binades), and neither are the batch's tensors,
which change with every batch. A tensor's baseline is the lower median of its first BASELINE_STEPS judged steps,
raised to the lower median of its kind's baselines: a tensor that starts far below the others of its kind (a bias
initialised to zero, a LayerNorm weight's gradient at initialisation) climbs toward them in healthy training (by 8
binades within 64 steps of tests/nanogpt_runs.py's healthy runs, without the floor). It grew when its top binade
stood GROWTH_BINADES or more above that baseline at each of the last HELD_STEPS judged steps or more; its onset is
the first step of that streak. A jump of one step is a spike (nanscan.runtime.spikes), not a divergence, and a
fault of one step leaves nothing grown. Layers (nanscan.incident.layer_of) rank by their earliest onset, then by
the most binades gained. Growth is seen within the history only: a tensor already far out at its first steps
(tests/spike_runs.py's growing attention logits, whose gradients stood at 2**51 there) has that as its baseline.

Measured over every 64-step history (the Monitor's default) of the healthy runs, each as if an incident followed
its last step: tests/nanogpt_runs.py's five healthy configurations (200 steps) and tests/spike_runs.py's four
healthy runs (320 steps). The largest gain held through the last two judged steps was 6 binades (the position
embedding's gradient of the nanoGPT at learning rate 1e-2; 7 at one step, hence HELD_STEPS), a parameter's 3.
GROWTH_BINADES = 8 (256x) leaves them 2 binades of margin and names the diverging runs' first layers well before
their first non-finite step: tests/nanogpt_runs.py's DIVERGING from step 14 (non-finite at 29; 10 and 28 in
float32), tests/spike_runs.py's endless warm-up from 259 (265) and outlier record from its own step 120 (126),
tests/replay_entries.py's warm-up regression from 41 (44). Fewer than MIN_STEPS judged steps are not judged.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import numpy as np

from nanscan.bundle.format import HistoryEntry, WindowStep, json_float
from nanscan.engine import _layout as L
from nanscan.engine.stats import lower_median
from nanscan.incident import is_kind, layer_of, tensor_kind

# The ledger key of the finding (nanscan.bundle.incident_md.divergence_finding).
DIVERGENCE_FINDING = "divergence"
GROWTH_BINADES = 8
HELD_STEPS = 2
BASELINE_STEPS = 4
MIN_STEPS = BASELINE_STEPS + 2
JUDGED_KINDS = ("parameter", "gradient")
_NONE = np.iinfo(np.int64).min  # no finite non-zero value (or no such tensor) at a step


def top_binades(report: Any) -> dict[str, int]:
    """{tensor name: floor(log2 max|x|)} of a scan report's finite non-zero values, read from its records'
    exponent histograms; gradients unscaled by the report's loss scale (NOTE: [unscaled gradients])."""
    hist = report.records[:, L.REC_HIST:L.REC_HIST_END]
    occupied = hist > 0
    top = L.HIST_BINS - 1 - np.argmax(occupied[:, ::-1], axis=1) + L.MIN_BIN_EXPONENT
    shift = report.scaling.grad_exponent if report.scaling is not None else 0
    out = {}
    for i, t in enumerate(report.tensors):
        if occupied[i].any():
            binade = int(top[i])
            if shift and is_kind(t.name, "gradient"):  # as unscaled_hist moves it: clamped at the ends
                binade = min(max(binade - shift, L.MIN_BIN_EXPONENT), L.MAX_BIN_EXPONENT)
            out[t.name] = binade
    return out


def grown_tensors(entries: Sequence[HistoryEntry], binades: int = GROWTH_BINADES) -> list[dict]:
    """Every judged tensor of `entries` (finite steps, oldest first) with its baseline, its top binade at the last
    step, the binades gained and its onset (None where it did not grow by `binades`), NOTE: [divergence onset]."""
    if len(entries) < MIN_STEPS:
        return []
    steps = [e.step for e in entries]
    tops = [top_binades(e.report) for e in entries]
    names = list(dict.fromkeys(n for t in tops for n in t if tensor_kind(n) in JUDGED_KINDS))
    grid = np.array([[t.get(n, _NONE) for n in names] for t in tops], dtype=np.int64).reshape(len(tops), len(names))
    own: dict[str, int] = {}
    for j, name in enumerate(names):
        column = grid[:, j][grid[:, j] != _NONE]
        if len(column) > BASELINE_STEPS:  # a baseline and at least one step after it
            own[name] = lower_median(column[:BASELINE_STEPS].tolist())
    floors = {kind: lower_median([b for n, b in own.items() if tensor_kind(n) == kind])
              for kind in {tensor_kind(n) for n in own}}
    out = []
    for j, name in enumerate(names):
        if name not in own or grid[-1, j] == _NONE:
            continue
        baseline = max(own[name], floors[tensor_kind(name)])
        last = int(grid[-1, j])
        i = len(steps)  # the first step of the streak above the threshold that ends at the last step
        while i > 0 and grid[i - 1, j] != _NONE and grid[i - 1, j] - baseline >= binades:
            i -= 1
        onset = steps[i] if len(steps) - i >= HELD_STEPS else None
        out.append({"layer": layer_of(name), "tensor": name, "kind": tensor_kind(name), "onset": onset,
                    "baseline": baseline, "binade": last, "binades": last - baseline})
    return out


def _lrs(entry: HistoryEntry, records: Sequence[WindowStep]) -> list:
    """Each param group's learning rate at the entry's step: the window's record of the step's own check (else
    its last micro-batch's), or the history's first group's."""
    at_step = [r for r in records if r.step == entry.step]
    record = next((r for r in at_step if r.micro_batch is None), at_step[-1] if at_step else None)
    if record is not None and record.lrs:
        return [json_float(lr) for lr in record.lrs]
    return [json_float(entry.lr)] if entry.lr is not None else []


def _loss_scale(entry: HistoryEntry, records: Sequence[WindowStep]) -> Any:
    if entry.report.scaling is not None:
        return json_float(entry.report.scaling.scale)
    scales = [r.loss_scale for r in records if r.step == entry.step and r.loss_scale is not None]
    return json_float(scales[-1]) if scales else None


def divergence(history: Sequence[HistoryEntry], records: Sequence[WindowStep], step: int, *,
               abandoned: Collection[int] = ()) -> dict | None:
    """The divergence up to the incident at `step`, JSON-ready (non-finite floats as strings), or None when the
    history holds fewer than MIN_STEPS finite steps up to it (NOTE: [divergence onset]).

    "steps": every history step up to `step` (the learning rates of each param group from the window's `records`
    where it holds the step), "grew": the tensors that grew by GROWTH_BINADES, earliest onset first, "layers":
    their layers in that order, "judged": the first and last finite step judged. `abandoned`: steps a rollback
    abandoned (their updates undone), shown marked and never judged: the run that goes on is not their lineage."""
    by_step = {e.step: e for e in sorted(history, key=lambda e: e.step) if e.step <= step}
    judged = [e for e in by_step.values() if e.report.ok and e.step not in abandoned]
    if len(judged) < MIN_STEPS:
        return None
    grew = [t for t in grown_tensors(judged) if t["onset"] is not None]
    grew.sort(key=lambda t: (t["onset"], -t["binades"], t["tensor"]))
    layers: dict[str, dict] = {}
    for t in grew:
        layer = layers.setdefault(t["layer"], {"layer": t["layer"], "onset": t["onset"], "binades": t["binades"],
                                               "tensors": 0})
        layer["binades"] = max(layer["binades"], t["binades"])
        layer["tensors"] += 1
    rows = []
    for e in by_step.values():
        bad_grads = sum(1 for n in e.report.nonfinite if is_kind(n, "gradient"))
        rows.append({"step": e.step, "loss": json_float(e.loss), "grad_norm": json_float(e.grad_norm),
                     "nonfinite_gradients": bad_grads, "finite": bool(e.report.ok),
                     "overflow_skip": bool(e.report.overflow_skip), "lrs": _lrs(e, records),
                     "loss_scale": _loss_scale(e, records), **({"abandoned": True} if e.step in abandoned else {})})
    return {"rule": {"binades": GROWTH_BINADES, "held_steps": HELD_STEPS, "baseline_steps": BASELINE_STEPS,
                     "kinds": list(JUDGED_KINDS)},
            "step": step, "judged": [judged[0].step, judged[-1].step],
            "baseline": [e.step for e in judged[:BASELINE_STEPS]], "steps": rows, "grew": grew,
            "layers": sorted(layers.values(), key=lambda g: (g["onset"], -g["binades"], g["layer"]))}


def shown_steps(summary: Mapping, limit: int) -> tuple[list[dict], int]:
    """(rows, stride): at most about `limit` of the summary's steps, every stride-th one plus those a reader looks for
    (the first, each layer's onset, the last four and the incident's); stride 1 shows them all."""
    rows = summary["steps"]
    if len(rows) <= limit:
        return list(rows), 1
    wanted = {summary["step"], rows[0]["step"], *(r["step"] for r in rows[-4:]), *onsets_by_step(summary)}
    stride = -(-len(rows) // max(limit - len(wanted), 1))
    return [r for i, r in enumerate(rows) if i % stride == 0 or r["step"] in wanted], stride


def lr_text(lrs: Sequence[Any], spec: str = ".3g") -> str:
    """Learning rates as a cell: one value when every param group has it, else each group's, "/"-separated."""
    if not lrs:
        return "-"
    cells = [lr if isinstance(lr, str) else "-" if lr is None else format(lr, spec) for lr in lrs]
    return cells[0] if len(set(cells)) == 1 else " / ".join(cells)


def onsets_by_step(summary: Mapping) -> dict[int, list[str]]:
    """{step: layers whose earliest onset is that step}, for marking the steps table and the plot."""
    out: dict[int, list[str]] = {}
    for layer in summary.get("layers") or ():
        out.setdefault(layer["onset"], []).append(layer["layer"])
    return out
