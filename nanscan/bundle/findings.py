"""What a bundle's ledger says so far, for reports and triage: the replay's verdict and first bad module, the
ablation outcomes, other findings, and the reviewer notes (recorded ones and those typed into INCIDENT.md)."""

from __future__ import annotations

from typing import Any

from nanscan.bundle.format import ABLATE_FINDING_PREFIX, DETECT_FINDING, REPLAY_FINDING, RERUN_FINDING, BundleError

NOT_REPLAYED = "(not replayed)"


def first_bad_module(bundle) -> tuple[str, str, str | None]:
    """(module, finding key, replay verdict) from the bundle's findings; the replay's localization wins over the
    ablation baseline's, and both over the Monitor's in-process rerun's (replay runs deterministic algorithms)."""
    records = {f.get("key"): f.get("record") or {} for f in bundle.findings()}
    baseline = f"{ABLATE_FINDING_PREFIX}baseline"
    replayed, ablated = records.get(REPLAY_FINDING, {}), records.get(baseline, {})
    rerun = records.get(RERUN_FINDING, {})
    verdict = replayed.get("verdict")
    if verdict is not None and not isinstance(verdict, str):
        raise BundleError(f"{bundle.path}: the replay finding's verdict is {verdict!r}, not a word; the ledger was "
                          "edited, run `nanscan replay` again on an untouched copy")
    outcome = ablated.get("outcome") or {}
    # an outcome that is not an object is as malformed as a bad localization: it is refused below
    ablated_loc = outcome.get("localization") if isinstance(outcome, dict) else outcome
    for key, loc in ((REPLAY_FINDING, replayed.get("localization")), (baseline, ablated_loc),
                     (RERUN_FINDING, rerun.get("localization"))):
        if not loc:
            continue
        if not isinstance(loc, dict) or not all(isinstance(loc.get(k), str) for k in ("label", "module_type", "phase")):
            raise BundleError(f"{bundle.path}: the {key!r} finding in its ledger names no module (label, module_type "
                              "and phase); the ledger was edited, run `nanscan replay` again on an untouched copy")
        return f"{loc['label']} ({loc['module_type']}, {loc['phase']})", key, verdict
    if verdict == "transient":
        return "(not reproduced by the replay entry)", REPLAY_FINDING, verdict
    if rerun.get("verdict") == "not reproduced":
        return "(not reproduced by the in-process rerun)", RERUN_FINDING, verdict
    return NOT_REPLAYED, "", verdict


def first_bad_op(record: dict) -> dict | None:
    """The replay record's first bad op (nanscan.runtime.ops.OpSite.to_dict), reduced to what a report shows."""
    op = record.get("op")
    if not isinstance(op, dict) or not isinstance(op.get("op"), str):
        return None
    return {k: _text(op.get(k)) for k in ("op", "call", "phase", "label", "module_type", "location", "code")}


def _bisection_verdict(record: dict) -> str | None:
    found = record.get("bisect")
    return _text(found.get("verdict")) if isinstance(found, dict) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def recorded_findings(bundle) -> dict:
    """Every finding and note recorded so far, JSON-ready: what `nanscan report` shows beside the detection."""
    findings = [f for f in bundle.findings() if f.get("key") != DETECT_FINDING]
    replay = next((f for f in findings if f.get("key") == REPLAY_FINDING), None)
    module, source, verdict = first_bad_module(bundle)
    out: dict[str, Any] = {"replay": None, "ablation": [], "other": [], "first_bad_module": None}
    if module != NOT_REPLAYED:
        out["first_bad_module"] = {"module": module, "from": source}
    if replay is not None:
        record = replay.get("record") or {}
        out["replay"] = {"title": replay["title"], "verdict": verdict, "reproduced": record.get("reproduced"),
                         "first_bad_module": module if source == REPLAY_FINDING else None,
                         "first_bad_op": first_bad_op(record), "bisection": _bisection_verdict(record),
                         "update": record.get("update") if isinstance(record.get("update"), dict) else None}
    for f in findings:
        key, record = f.get("key"), f.get("record") or {}
        if key.startswith(ABLATE_FINDING_PREFIX):
            out["ablation"].append({"factor": key[len(ABLATE_FINDING_PREFIX):], "title": f["title"],
                                    "status": _text(record.get("status")), "fixes": record.get("fixes") is True,
                                    "first_bad_module": _text(record.get("first_bad_module"))})
        elif key != REPLAY_FINDING:
            out["other"].append({"key": key, "title": f["title"]})
    review = bundle.note_review()
    out["reviewer_notes"] = [{"author": n.get("author"), "at": n.get("at"), "text": n.get("text")}
                             for n in bundle.notes()]
    out["hand_written_notes"] = review.hand_written or None
    out["note_edited_sections"] = list(review.edited)
    return out


def findings_lines(found: dict) -> list[str]:
    """recorded_findings as plain lines for a terminal (none when nothing beyond the detection was recorded)."""
    lines = []
    replay = found.get("replay")
    if replay is not None:
        lines.append(f"replay: {replay['title'].removeprefix('Replay: ')}")
        op = replay.get("first_bad_op")
        if op:
            made = "created by" if op["phase"] == "backward" else "called as"
            lines.append(f"first bad op: {op['op']} ({made} {op['call']}), {op['phase']}, in {op['label']} "
                         f"({op['module_type']})" + (f" at {op['location']}: {op['code'] or ''}" if op["location"]
                                                     else ""))
        update = replay.get("update") or {}
        for trap in update.get("traps") or []:
            if isinstance(trap, dict) and isinstance(trap.get("text"), str):
                lines.append(f"update trap ({trap.get('severity')}): {trap['text']}")
        if replay.get("bisection"):
            lines.append(f"bisection: {replay['bisection']}")
    elif found.get("first_bad_module"):
        lines.append(f"first bad module: {found['first_bad_module']['module']} "
                     f"(from {found['first_bad_module']['from']})")
    else:
        lines.append("replay: not run yet (`nanscan replay <bundle>` names the first bad module)")
    for row in found.get("ablation", []):
        lines.append(f"ablation: {row['title'].removeprefix('Ablation: ')}" + (" - fixes it" if row["fixes"] else ""))
    lines += [f"finding: {row['title']}" for row in found.get("other", [])]
    for note in found.get("reviewer_notes", []):
        text = " ".join(str(note.get("text") or "").split())
        lines.append(f"note ({note.get('author') or 'anonymous'}, {note.get('at')}): {text}")
    if found.get("hand_written_notes"):
        lines.append(f"note (typed into INCIDENT.md): {' '.join(found['hand_written_notes'].split())}")
    for section in found.get("note_edited_sections", []):
        lines.append(f"INCIDENT.md: {section} was edited by hand (the ledger keeps the recorded text; "
                     "`nanscan note --rebuild <bundle>` renders it again)")
    return lines
