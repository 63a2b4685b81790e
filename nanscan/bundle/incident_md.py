"""INCIDENT.md and the ledger it is rendered from: automatic findings and reviewer notes, kept apart."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

from nanscan.bundle.divergence import DIVERGENCE_FINDING, divergence, lr_text, onsets_by_step, shown_steps
from nanscan.bundle.format import DETECT_FINDING, MANIFEST, HistoryEntry, Incident
from nanscan.engine.headroom import FORMATS, headroom_by_kind
from nanscan.engine.targets import ignored_targets
from nanscan.incident import (CATEGORY_EXPLANATIONS, INPUT_OVERFLOW, LOSS, REASON_EXPLANATIONS, REPLICA_MISMATCH,
                              SPIKE, explain_category, is_kind, reason_title)

MIXED_PRECISION_FINDING = "mixed_precision"
SKIPS_SHOWN = 12
# The divergence finding's tables: layers, tensors of each, steps (nanscan.bundle.divergence.shown_steps).
DIVERGENCE_LAYERS = 8
DIVERGENCE_TENSORS_PER_LAYER = 3
DIVERGENCE_STEPS = 24


def _fmt(value: Any, missing: str = "n/a") -> str:
    if value is None:
        return missing
    if isinstance(value, (float, str)) and not isinstance(value, bool):
        try:
            return f"{float(value):.6g}"
        except ValueError:
            return str(value)
    return str(value)


def grad_norm_text(norm: float | None, nonfinite_gradients: int) -> str:
    """The gradient norm in words. The recorded norm sums only the finite values (nanscan.engine.stats), so for a step
    whose gradients hold NaN or inf it is not the gradient norm, and is never shown as one."""
    if nonfinite_gradients:
        finite_part = f"; {_fmt(norm)} over their finite values" if norm is not None else ""
        return f"gradient norm non-finite ({nonfinite_gradients} gradient tensor(s) hold NaN or inf{finite_part})"
    return f"gradient norm {_fmt(norm)}"


def _source_line(source: Mapping) -> str:
    if source.get("kind") == "git":
        commit = source.get("commit") or "no commit yet"
        line = f"git `{commit[:12]}` in `{source.get('root')}`"
        if source.get("dirty"):
            line += (f", dirty ({source.get('changed_files', 0)} changed, {source.get('untracked_files', 0)} "
                     f"untracked; diff sha256 `{(source.get('diff_sha256') or 'none')[:16]}`)")
        return line
    return f"not a git work tree ({source.get('reason', 'unknown')}); nanscan {source.get('nanscan_version')}"


# NOTE: [editable incident note]
# INCIDENT.md is a document people edit. Its automatic part (everything above REVIEWER_HEADING: the header and one
# section per finding) is a rendering of the manifest and the ledger, both pinned by sha256, so it is checked by
# rendering it again: a difference names the section that changed, and `nanscan note --rebuild` renders it anew.
# Everything below REVIEWER_HEADING belongs to the reviewers: the ledger's notes (rendered once, then left alone)
# and any text typed there by hand, which is kept on every later update and shown as a reviewer note. Nothing a
# reviewer wrote is dropped: a hand edit of the automatic part is moved, quoted, into the reviewer section when
# the automatic part is rendered again.
REVIEWER_HEADING = "## Reviewer notes"


NO_NOTES = '_No notes yet: add one with `nanscan note <this directory> "text"`._'


_FINDING_MARKER = "<!-- nanscan:finding "


HEADER_SECTION = "header"


@dataclasses.dataclass(frozen=True)
class NoteReview:
    """What INCIDENT.md holds beyond its rendering from the ledger (NOTE: [editable incident note]).

    hand_written: text typed by hand under "Reviewer notes" (not through `nanscan note`), or "".
    edited: the automatic sections that differ from their rendering, each named for a reader.
    reviewer: the reviewer section as it is (None when its heading is gone); moved: (name, text) of each edited
    automatic section, to be kept in the reviewer section when the note is rendered again.
    """

    hand_written: str = ""
    edited: tuple[str, ...] = ()
    reviewer: str | None = dataclasses.field(default=None, repr=False)
    moved: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)


def _micro_batch_line(manifest: Mapping) -> str:
    micro, step = manifest["micro_batch"], manifest["first_invalid_step"]
    if manifest.get("micro_batch_observed"):  # NOTE: [observed micro-batches]
        return (f"- found at: micro-batch {micro} of step {step} (gradient accumulation: its loss, handed over by "
                "observe(), was the first non-finite one; the batch is that micro-batch, the gradients the whole "
                "step's, checked after its last micro-batch)")
    return (f"- found at: micro-batch {micro} of step {step} (gradient accumulation: the gradients are the sum over "
            f"micro-batches 0 to {micro}, the batch is that micro-batch)")


def _entry_line(manifest: Mapping) -> str:
    """How the step can be run again: the replay entry, and the Monitor's in-process rerun (its finding below)."""
    rerun = manifest.get("rerun") or {}
    entry = f"`{manifest['replay_entry']}`" if manifest.get("replay_entry") else "none"
    if not rerun.get("step_fn"):
        return f"- replay entry: {entry}"
    line = f"- replay entry: {entry}; the Monitor reran the step in its process through `{rerun['step_fn']}` (below)"
    if not manifest.get("replay_entry"):
        line += "; `nanscan replay` runs outside the process and needs an entry that rebuilds the model"
    return line


def render_automatic(manifest: Mapping, ledger: Sequence[Mapping]) -> str:
    """The automatic part of INCIDENT.md (header and findings), ending just before REVIEWER_HEADING."""
    state = manifest.get("state") or {}
    if not state.get("file"):
        state_line = f"not stored ({state.get('error') or state.get('note') or 'no model given'})"
    elif state.get("pre_step"):
        state_line = "model and optimizer state from before this step (snapshot)"
    else:
        note = f" ({state['note']})" if state.get("note") else ""
        state_line = f"model and optimizer state at the failing step{note}"
    if state.get("file") and isinstance(state.get("frozen"), dict) and state["frozen"]:  # NOTE: [frozen references]
        state_line += (f"; {len(state['frozen'])} frozen weight(s) by sha256 only, which replay takes from its "
                       "entry's model")
    step = manifest["first_invalid_step"]
    heading = {SPIKE: f"# Spike at step {step}: an early warning, every value finite",
               REPLICA_MISMATCH: f"# Incident: replicas differ at step {step}"}.get(
        manifest["category"], f"# Incident: non-finite values at step {step}")
    lines = [
        heading,
        "",
        f"- run: `{manifest['run_id']}`",
        f"- category: **{manifest['category']}**",
        *([_micro_batch_line(manifest)] if manifest.get("micro_batch") is not None else []),
        f"- detected: {manifest.get('detected_at', 'n/a')}",
        f"- source: {_source_line(manifest.get('source') or {})}",
        f"- config sha256: `{manifest.get('config_sha256') or 'no config given'}`",
        f"- state: {state_line}",
        _entry_line(manifest),
        *_unsaved_lines(manifest),
        "",
        f"Every file of this bundle is listed with its sha256 in {MANIFEST}. "
        "`nanscan report <this directory>` summarises it.",
        "",
        "## Automatic findings",
        "",
    ]
    for record in ledger:
        if record.get("kind") == "finding":
            lines += [f"{_FINDING_MARKER}{record['key']} -->", f"### {record['title']}", "",
                      record["body"].rstrip(), ""]
    return "\n".join(lines) + "\n"


def unsaved_lines(write_errors: Any) -> list[str]:
    """A manifest's write_errors as "part, part: error" lines, the parts that failed alike on one line."""
    grouped: dict[str, list[str]] = {}
    for e in write_errors if isinstance(write_errors, list) else []:
        if isinstance(e, Mapping):
            grouped.setdefault(str(e.get("error")), []).append(str(e.get("part")))
    return [f"{', '.join(parts)}: {error}" for error, parts in grouped.items()]


def _unsaved_lines(manifest: Mapping) -> list[str]:
    """What a write error kept out of the bundle (NOTE: [write faults] in nanscan/bundle/write.py)."""
    lines = unsaved_lines(manifest.get("write_errors"))
    if not lines:
        return []
    return ["- **not saved** (a write failed; the rest of the bundle is complete and verified):",
            *(f"  - {line}" for line in lines)]


def _note_block(record: Mapping) -> str:
    author = " ".join(str(record.get("author") or "anonymous").split())
    return "\n".join([f"<!-- nanscan:note {record['key']} -->", f"**{author}**, {record['at']}:", "",
                      *_quoted(record["text"]), ""]) + "\n"


def render_incident(manifest: Mapping, ledger: Sequence[Mapping], kept: NoteReview | None = None) -> str:
    """INCIDENT.md from the manifest and the ledger: the same inputs always give the same text.

    `kept`, review_incident of the file as it is now, keeps what reviewers wrote (NOTE: [editable incident note]):
    the reviewer section stays as it is, with the ledger's notes it lacks appended, and each hand edit of an
    automatic section is moved there, quoted."""
    notes = [r for r in ledger if r.get("kind") == "note"]
    body = (kept.reviewer or "") if kept is not None else NO_NOTES + "\n"
    moved = [_moved_edit(name, text) for name, text in (kept.moved if kept is not None else ())]
    new_notes = [_note_block(r) for r in notes if f"<!-- nanscan:note {r['key']} -->" not in body]
    if moved or new_notes:
        body = body.replace(NO_NOTES + "\n", "").replace(NO_NOTES, "")
        body = body.rstrip("\n") + "\n\n" if body.strip() else ""
        body += "".join(moved) + "".join(new_notes)
    body = body.lstrip("\n") if body.strip() else NO_NOTES + "\n"
    if body.endswith("\n\n"):  # a note block's closing blank line: the file ends with one newline
        body = body[:-1]
    return render_automatic(manifest, ledger) + REVIEWER_HEADING + "\n\n" + body


def split_incident(text: str) -> tuple[str, str | None]:
    """(automatic part, reviewer section below REVIEWER_HEADING or None when the heading is gone)."""
    lines = text.splitlines(keepends=True)
    seen_automatic = False
    for i, line in enumerate(lines):
        if line.rstrip() == "## Automatic findings":
            seen_automatic = True
        elif seen_automatic and line.rstrip() == REVIEWER_HEADING:
            return "".join(lines[:i]), "".join(lines[i + 1:]).lstrip("\n")
    return text, None


def _sections(automatic: str) -> dict[str, str]:
    """The automatic part by section: HEADER_SECTION, then each finding by its ledger key."""
    sections, key, current = {}, HEADER_SECTION, []
    for line in automatic.splitlines(keepends=True):
        if line.startswith(_FINDING_MARKER) and line.rstrip().endswith("-->"):
            sections[key] = "".join(current)
            key, current = line.rstrip()[len(_FINDING_MARKER):-3].strip(), []
        current.append(line)
    sections[key] = "".join(current)
    return sections


def _section_name(key: str, ledger: Sequence[Mapping]) -> str:
    if key == HEADER_SECTION:
        return "the header (run, category, source, config, state, replay entry)"
    title = next((r["title"] for r in ledger if r.get("kind") == "finding" and r.get("key") == key), None)
    return f"the finding '{title}'" if title is not None else f"a section '{key}' that the ledger does not hold"


def _changed_sections(actual: str, expected: str, ledger: Sequence[Mapping]) -> list[tuple[str, str]]:
    """(section name, its text as it is now) for each automatic section that differs from its rendering."""
    have, want = _sections(actual), _sections(expected)
    changed = []
    for key in [*want, *(k for k in have if k not in want)]:
        if have.get(key, "").strip() != want.get(key, "").strip():
            changed.append((_section_name(key, ledger), have.get(key, "")))
    return changed


def _moved_edit(name: str, text: str) -> str:
    kept = "\n".join(line for line in text.splitlines() if not line.startswith(_FINDING_MARKER))
    head = f"_Hand edit of {name}, moved here when the automatic findings were rendered again from the ledger:_"
    return "\n".join([head, "", *(_quoted(kept) if kept.strip() else ["> (the section was deleted)"]), ""]) + "\n"


def review_incident(text: str, manifest: Mapping, ledger: Sequence[Mapping], *, pinned: bool) -> NoteReview:
    """Compare INCIDENT.md with its rendering (NOTE: [editable incident note]). `pinned`: the file still has the
    sha256 the manifest records, so its automatic part is what nanscan wrote (not compared again: a bundle written
    by an older renderer must not read as edited)."""
    automatic, reviewer = split_incident(text)
    moved: list[tuple[str, str]] = []
    if not pinned:
        moved = _changed_sections(automatic, render_automatic(manifest, ledger), ledger)
    edited = [name for name, _ in moved]
    if reviewer is None and not pinned:
        edited.append(f"the '{REVIEWER_HEADING}' heading (it is gone)")
    hand = reviewer or ""
    for record in ledger:
        if record.get("kind") == "note":
            block = _note_block(record)
            hand = hand.replace(block, "").replace(block[:-1], "")  # the last block ends with one newline
    hand = hand.replace(NO_NOTES, "").strip()
    return NoteReview(hand, tuple(edited), reviewer, tuple(moved))


# A '#' that could open a heading: at the start of a line, or after block-quote and list markers only.
_HEADING = re.compile(r"^((?:[ \t]*(?:>|[-+*]|\d{1,9}[.)])(?=[ \t]|$))*[ \t]*)(#)")


_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)\s*$")


def _quoted(text: str) -> list[str]:
    """A reviewer's text as a Markdown block quote in which no line can start a heading or hide an HTML comment,
    so a note can never pose as an "Automatic findings" section or as one of its markers."""
    out = []
    for line in text.rstrip().splitlines():
        line = _HEADING.sub(r"\1\\\2", line.replace("<!--", "&lt;!--"))
        if _SETEXT_UNDERLINE.match(line):  # would turn the line above into a heading
            line = "\\" + line.lstrip()
        out.append(f"> {line}".rstrip())
    return out


def detect_finding(inc: Incident, nonfinite: list[dict]) -> dict:
    deciding = set(inc.tensors)
    culprits = [row for row in nonfinite if row["name"] in deciding]
    others = len(nonfinite) - len(culprits)
    shown = (culprits + [row for row in nonfinite if row["name"] not in deciding])[:20]
    names = [s.name for s in inc.report.stats]
    # NOTE: [no supervised tokens]: targets all the ignore index make the loss 0/0, and its gradients after it
    ignored = ignored_targets(inc.batch) if inc.batch is not None and inc.category in (LOSS, "gradient") else []
    scope = "the batch" if inc.micro_batch is None else f"micro-batch {inc.micro_batch}"
    explanation = REASON_EXPLANATIONS.get(inc.reason) or explain_category(
        inc.category, loss_checked=LOSS in names, inputs_checked=any(is_kind(n, "input") for n in names),
        batch_given=inc.batch is not None, batch_cause=ignored[0].describe(scope) if ignored else None)
    if inc.reason == INPUT_OVERFLOW:
        largest = {s.name: s.absmax for s in inc.report.stats}
        shown_inputs = [f"`{n}` (largest |x| {largest.get(n, float('nan')):.4g})" for n in inc.tensors[:10]]
        deciding_line = f"Inputs with finite values beyond the step's range, deciding the category: {', '.join(shown_inputs)}"
    elif inc.category == REPLICA_MISMATCH:
        deciding_line = f"Tensors that differed across the replicas: {', '.join(f'`{n}`' for n in inc.tensors[:10])}"
    else:
        deciding_line = f"Non-finite tensors deciding the category: {', '.join(f'`{n}`' for n in inc.tensors[:10])}"
    replicas = (inc.distributed or {}).get("replicas") if inc.category == REPLICA_MISMATCH else None
    if replicas:  # nanscan.runtime.distributed NOTE: [replica agreement]: who, and where it began
        explanation += (f"\n\nReplicas: {replicas['ranks_text']}; {replicas['cause']} "
                        f"({replicas['differing_count']} tensor(s) differed).")
    body = [explanation, "",
            deciding_line
            + (f" and {len(inc.tensors) - 10} more" if len(inc.tensors) > 10 else "")
            + (f"; {others} other tensor(s) were non-finite too." if others else ".")]
    if shown:  # a replica mismatch may have no non-finite tensor: no empty table
        body += ["", "| tensor | kind | NaN | +inf | -inf | elements |", "|---|---|---:|---:|---:|---:|"]
        body += [f"| `{r['name']}` | {r['kind']} | {r['nan']} | {r['posinf']} | {r['neginf']} | {r['numel']} |"
                 for r in shown]
    if len(nonfinite) > len(shown):
        body.append(f"| ... {len(nonfinite) - len(shown)} more in {MANIFEST} | | | | | |")
    last = step_entry(inc)
    finite_before = [e for e in inc.history if e.step < inc.step and e.report.ok]
    bad_grads = sum(1 for row in nonfinite if row["kind"] == "gradient")
    body += ["", f"At this step: loss {_fmt(last.loss if last else None, 'not recorded')}, learning rate "
                 f"{_fmt(last.lr if last else None)}, "
                 f"{grad_norm_text(last.grad_norm if last else None, bad_grads)}."]
    if finite_before:
        prev = finite_before[-1]
        body.append(f"Last finite step in the history: {prev.step} (loss {_fmt(prev.loss, 'not recorded')}, "
                    f"{grad_norm_text(prev.grad_norm, 0)}).")
    record = {"step": inc.step, "category": inc.category, "tensors": list(inc.tensors),
              "nonfinite_count": len(nonfinite), "reason": inc.reason, "micro_batch": inc.micro_batch}
    if ignored:
        record["ignored_targets"] = [found.to_dict() for found in ignored]
    title = (f"Replicas differ at step {inc.step} ({inc.category})" if inc.category == REPLICA_MISMATCH else
             f"First non-finite step: {inc.step} ({inc.category}{reason_title(inc.reason, inc.step)})")
    return {"kind": "finding", "key": DETECT_FINDING, "title": title,
            "body": "\n".join(body), "record": record, "at": inc.detected_at}


def step_entry(inc: Incident) -> HistoryEntry | None:
    """The history entry of the incident's step (a streak's first step is not the newest entry)."""
    return next((e for e in reversed(inc.history) if e.step == inc.step), None)


def mixed_precision_lines(mp: Mapping, kinds: Mapping[str, list]) -> list[str]:
    """The mixed-precision section: autocast, the scaler and its skips, headroom of the scanned tensors by kind
    (`kinds`: headroom_by_kind of a report whose gradients are unscaled; NOTE: [unscaled gradients])."""
    autocast = mp.get("autocast")
    scaler = mp.get("scaler")
    lines = [f"- autocast: {autocast['dtype']} on {autocast['device_type']}" if autocast else
             "- autocast: not active in the last forward pass"]
    if scaler and scaler.get("enabled") is False:
        lines.append("- GradScaler: given, but disabled (every non-finite value is an incident)")
    elif scaler:
        lines.append(f"- GradScaler: scale {_fmt(mp.get('scale'))} now, growth x{_fmt(scaler['growth_factor'])} "
                     f"every {scaler['growth_interval']} steps, backoff x{_fmt(scaler['backoff_factor'])}; a streak "
                     f"is an incident at {scaler['max_skips']} skips or below scale {_fmt(scaler['min_scale'])}")
        lines.append(f"- overflow skips in the run: {mp.get('skips_total', 0)}")
    else:
        lines.append("- GradScaler: none (every non-finite value is an incident)")
    streak = mp.get("streak")
    skips = streak["scale_history"] if streak else mp.get("recent_skips") or []
    if streak:
        lines += ["", f"Streak of {streak['length']} skipped steps from step {streak['first_step']}: "
                      f"{streak['reason']}."]
    if skips:
        lines += ["", "| skipped step | scale before | scale after |", "|---:|---:|---:|"]
        lines += [f"| {s['step']} | {_fmt(s['scale_before'])} | {_fmt(s['scale_after'])} |"
                  for s in skips[-SKIPS_SHOWN:]]
    if kinds:
        lines += ["", "Headroom of the scanned values (gradients unscaled), overflow / below normal:", "",
                  "| kind | values | " + " | ".join(f.name for f in FORMATS) + " |",
                  "|---|---:|" + "---:|" * len(FORMATS)]
        for kind, rooms in kinds.items():
            cells = " | ".join(f"{_share(h.overflow)} / {_share(h.subnormal + h.underflow)}" for h in rooms)
            lines.append(f"| {kind} | {rooms[0].values} | {cells} |")
    return lines


def _share(fraction: float) -> str:
    return "0" if fraction == 0 else ("<0.1%" if fraction < 0.001 else f"{100 * fraction:.1f}%")


def mixed_precision_finding(inc: Incident) -> dict:
    """The "Mixed precision" finding, from the incident's mixed_precision record and its step's report."""
    mp = dict(inc.mixed_precision or {})
    kinds = headroom_by_kind(inc.report)
    return {"kind": "finding", "key": MIXED_PRECISION_FINDING, "title": "Mixed precision",
            "body": "\n".join(mixed_precision_lines(mp, kinds)),
            "record": {"streak_first_step": (mp.get("streak") or {}).get("first_step"),
                       "skips_total": mp.get("skips_total", 0)},
            "at": inc.detected_at}


def spike_finding(inc: Incident) -> dict:
    """The detection finding of a spike bundle: what spiked, against what, and the tensors that moved first."""
    spike = inc.spikes[-1]
    rule = spike["rule"]
    growth = spike.get("kind", SPIKE) != SPIKE  # the growth rule (nanscan.runtime.spikes NOTE: [growth rule])
    if growth:
        body = [CATEGORY_EXPLANATIONS[SPIKE], "",
                f"Found by the growth rule, which needs no window (it speaks during the spike statistic's "
                f"{rule['warmup']}-step warm-up too): over its last {spike['window']} finite steps the quantity rose "
                f"at all but one, gained at least {rule['growth_binades']:g} binades and reached its highest value "
                "of the run:", "",
                "| quantity | value | from | ratio | binades gained |", "|---|---:|---:|---:|---:|"]
        body += [f"| {s['quantity']} | {_fmt(s['value'])} | {_fmt(s['median'])} | {s['ratio']:.3g}x | "
                 f"{s['z']:.2f} |" for s in spike["scores"]]
    else:
        body = [CATEGORY_EXPLANATIONS[SPIKE], "",
                f"Judged against the last {spike['window']} finite steps, in log space (median and MAD; warm-up "
                f"{rule['warmup']} steps, robust z > {rule['threshold']:g} and at least {rule['min_ratio']:g}x the "
                "median):", "", "| quantity | value | median | ratio | robust z |", "|---|---:|---:|---:|---:|"]
        body += [f"| {s['quantity']} | {_fmt(s['value'])} | {_fmt(s['median'])} | {s['ratio']:.3g}x | "
                 f"{s['z']:.1f} |" for s in spike["scores"]]
    if spike["first_moving"]:
        body += ["", "Gradient norms that left their own range first, by layer:", "",
                 "| layer | tensor | from step | ratio | robust z |", "|---|---|---:|---:|---:|"]
        body += [f"| {g['layer']} | `{t['name']}` | {t['onset']} | {t['ratio']:.3g}x | {t['z']:.1f} |"
                 for g in spike["first_moving"] for t in g["tensors"]]
    earlier = [s["step"] for s in inc.spikes[:-1]]
    if earlier:
        body += ["", f"Earlier spikes of this run: steps {', '.join(map(str, earlier[-10:]))}."]
    record = {"step": inc.step, "category": SPIKE, "rule": spike.get("kind", SPIKE), "quantity": spike["quantity"],
              "tensors": list(inc.tensors)}
    top = spike["scores"][0]
    title = (f"Growth at step {inc.step}: {top['quantity']} gained {top['z']:.1f} binades in {spike['window']} steps"
             if growth else f"Spike at step {inc.step}: {top['quantity']} {top['ratio']:.3g}x its median")
    return {"kind": "finding", "key": DETECT_FINDING, "title": title,
            "body": "\n".join(body), "record": record, "at": inc.detected_at}


def divergence_finding(inc: Incident) -> dict | None:
    """The "divergence" finding: the tensors whose magnitudes grew first, by layer, and the loss, gradient norm,
    learning rate and loss scale of the steps before the incident (NOTE: [divergence onset] in
    nanscan.bundle.divergence). None where the history is too short to judge or no tensor grew: a fault of one
    step is no divergence, and the finding does not invent one."""
    summary = divergence(inc.history, inc.window.records if inc.window is not None else (), inc.step,
                         abandoned=inc.abandoned_steps)
    if summary is None or not summary["grew"]:
        return None
    record = {key: summary[key] for key in ("step", "judged", "baseline", "rule", "layers")}
    record["grew"] = summary["grew"][:DIVERGENCE_LAYERS * DIVERGENCE_TENSORS_PER_LAYER]
    return {"kind": "finding", "key": DIVERGENCE_FINDING, "title": divergence_title(summary),
            "body": "\n".join(divergence_lines(summary)), "record": record, "at": inc.detected_at}


def divergence_title(summary: Mapping) -> str:
    first = summary["layers"][0]
    together = [g["layer"] for g in summary["layers"] if g["onset"] == first["onset"]]
    who = f"layer {first['layer']} grew first" if len(together) == 1 else f"{len(together)} layers grew at once"
    return f"Divergence before step {summary['step']}: {who}, from step {first['onset']}"


def divergence_rule_text(summary: Mapping) -> str:
    """What was judged, against what, in one sentence (NOTE: [divergence onset])."""
    rule, (first, last), base = summary["rule"], summary["judged"], summary["baseline"]
    return (f"Parameters and gradients whose largest |x| rose {rule['binades']} binades ({2 ** rule['binades']}x) or "
            f"more above their baseline (the median of their top binades at steps {base[0]}-{base[-1]}, or their "
            f"kind's median where that is higher) and stayed there for {rule['held_steps']} steps or more through "
            f"step {last} (finite steps {first}-{last} judged)")


def divergence_rows(summary: Mapping) -> tuple[list[dict], int]:
    """The grown tensors shown: DIVERGENCE_LAYERS layers in onset order, the first DIVERGENCE_TENSORS_PER_LAYER
    of each; and how many are left out."""
    shown = [t for g in summary["layers"][:DIVERGENCE_LAYERS]
             for t in [t for t in summary["grew"] if t["layer"] == g["layer"]][:DIVERGENCE_TENSORS_PER_LAYER]]
    return shown, len(summary["grew"]) - len(shown)


def divergence_lines(summary: Mapping) -> list[str]:
    """The divergence finding's Markdown: the rule, the grown tensors by layer, the steps."""
    last = summary["judged"][1]
    lines = [divergence_rule_text(summary) + "; the earliest first:", "",
             f"| layer | tensor | grew from step | baseline binade | binade at step {last} | gained |",
             "|---|---|---:|---:|---:|---:|"]
    shown, more = divergence_rows(summary)
    lines += [f"| {t['layer']} | `{t['tensor']}` | {t['onset']} | {t['baseline']} | {t['binade']} | "
              f"+{t['binades']} |" for t in shown]
    if more:
        lines.append(f"| ... {more} more in `nanscan report --json` | | | | | |")
    first = summary["layers"][0]
    together = [g["layer"] for g in summary["layers"] if g["onset"] == first["onset"]]
    if len(together) > 1:
        lines += ["", f"{len(together)} layers began at step {first['onset']} together "
                      f"({', '.join(together[:6])}{', ...' if len(together) > 6 else ''}): a cause they share (the "
                      "learning rate, the optimizer, the data) is likelier than any one layer."]
    rows, stride = shown_steps(summary, DIVERGENCE_STEPS)
    scaled = any(r["loss_scale"] is not None for r in summary["steps"])
    onsets = onsets_by_step(summary)
    lines += ["", "| step | loss | gradient norm | learning rate |" + (" loss scale |" if scaled else "")
              + " began to grow |", "|---:|---:|---:|---:|" + ("---:|" if scaled else "") + "---|"]
    for r in rows:
        grad_norm = "non-finite" if r["nonfinite_gradients"] else _fmt(r["grad_norm"])
        began = ", ".join(onsets.get(r["step"], []))
        note = " (overflow skip)" if r["overflow_skip"] else (" (non-finite)" if not r["finite"] else "")
        lines.append(f"| {r['step']}{note} | {_fmt(r['loss'])} | {grad_norm} | {lr_text(r['lrs'])} |"
                     + (f" {_fmt(r['loss_scale'])} |" if scaled else "") + f" {began} |")
    if stride > 1:
        lines += ["", f"One step in {stride} shown, with the first, the onsets and the last; `nanscan report --json` "
                      "lists every step."]
    return lines


def valid_ledger_record(record: Any) -> bool:
    """Whether a ledger line has the fields render_incident and the readers use, with their types."""
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        return False
    if record.get("kind") == "finding":
        return (isinstance(record.get("title"), str) and isinstance(record.get("body"), str)
                and isinstance(record.get("record", {}), dict))
    if record.get("kind") == "note":
        return (isinstance(record.get("text"), str) and isinstance(record.get("at"), str)
                and (record.get("author") is None or isinstance(record.get("author"), str)))
    return False


def ledger_bytes(records: Sequence[Mapping]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n" for r in records)
