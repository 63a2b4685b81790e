"""INCIDENT.md and the ledger it is rendered from: automatic findings and reviewer notes, kept apart."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from nanscan.bundle.format import DETECT_FINDING, MANIFEST, HistoryEntry, Incident
from nanscan.headroom import FORMATS, headroom_by_kind
from nanscan.incident import CATEGORY_EXPLANATIONS, REASON_EXPLANATIONS

MIXED_PRECISION_FINDING = "mixed_precision"
SKIPS_SHOWN = 12


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (float, str)) and not isinstance(value, bool):
        try:
            return f"{float(value):.6g}"
        except ValueError:
            return str(value)
    return str(value)


def _source_line(source: Mapping) -> str:
    if source.get("kind") == "git":
        commit = source.get("commit") or "no commit yet"
        line = f"git `{commit[:12]}` in `{source.get('root')}`"
        if source.get("dirty"):
            line += (f", dirty ({source.get('changed_files', 0)} changed, {source.get('untracked_files', 0)} "
                     f"untracked; diff sha256 `{(source.get('diff_sha256') or 'none')[:16]}`)")
        return line
    return f"not a git work tree ({source.get('reason', 'unknown')}); nanscan {source.get('nanscan_version')}"


def render_incident(manifest: Mapping, ledger: Sequence[Mapping]) -> str:
    """INCIDENT.md from the manifest and the ledger: the same inputs always give the same text."""
    state = manifest.get("state") or {}
    if not state.get("file"):
        state_line = f"not stored ({state.get('note') or 'no model given'})"
    elif state.get("pre_step"):
        state_line = "model and optimizer state from before this step (snapshot)"
    else:
        note = f" ({state['note']})" if state.get("note") else ""
        state_line = f"model and optimizer state at the failing step{note}"
    lines = [
        f"# Incident: non-finite values at step {manifest['first_invalid_step']}",
        "",
        f"- run: `{manifest['run_id']}`",
        f"- category: **{manifest['category']}**",
        f"- detected: {manifest.get('detected_at', 'n/a')}",
        f"- source: {_source_line(manifest.get('source') or {})}",
        f"- config sha256: `{manifest.get('config_sha256') or 'no config given'}`",
        f"- state: {state_line}",
        f"- replay entry: `{manifest['replay_entry']}`" if manifest.get("replay_entry") else "- replay entry: none",
        "",
        f"Every file of this bundle is listed with its sha256 in {MANIFEST}. "
        "`nanscan report <this directory>` summarises it.",
        "",
        "## Automatic findings",
        "",
    ]
    for record in ledger:
        if record.get("kind") == "finding":
            lines += [f"<!-- nanscan:finding {record['key']} -->", f"### {record['title']}", "",
                      record["body"].rstrip(), ""]
    lines += ["## Reviewer notes", ""]
    notes = [r for r in ledger if r.get("kind") == "note"]
    if not notes:
        lines += ['_No notes yet: add one with `nanscan note <this directory> "text"`._', ""]
    for record in notes:
        author = " ".join(str(record.get("author") or "anonymous").split())
        lines += [f"<!-- nanscan:note {record['key']} -->", f"**{author}**, {record['at']}:", "",
                  *_quoted(record["text"]), ""]
    return "\n".join(lines)


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
    body = [REASON_EXPLANATIONS.get(inc.reason) or CATEGORY_EXPLANATIONS.get(inc.category, ""), "",
            f"Non-finite tensors deciding the category: {', '.join(f'`{n}`' for n in inc.tensors[:10])}"
            + (f" and {len(inc.tensors) - 10} more" if len(inc.tensors) > 10 else "")
            + (f"; {others} other tensor(s) were non-finite too." if others else "."), "",
            "| tensor | kind | NaN | +inf | -inf | elements |", "|---|---|---:|---:|---:|---:|"]
    body += [f"| `{r['name']}` | {r['kind']} | {r['nan']} | {r['posinf']} | {r['neginf']} | {r['numel']} |"
             for r in shown]
    if len(nonfinite) > len(shown):
        body.append(f"| ... {len(nonfinite) - len(shown)} more in {MANIFEST} | | | | | |")
    last = step_entry(inc)
    finite_before = [e for e in inc.history if e.step < inc.step and e.report.ok]
    body += ["", f"At this step: loss {_fmt(last.loss if last else None)}, learning rate "
                 f"{_fmt(last.lr if last else None)}, gradient norm {_fmt(last.grad_norm if last else None)}."]
    if finite_before:
        prev = finite_before[-1]
        body.append(f"Last finite step in the history: {prev.step} (loss {_fmt(prev.loss)}, "
                    f"gradient norm {_fmt(prev.grad_norm)}).")
    record = {"step": inc.step, "category": inc.category, "tensors": list(inc.tensors),
              "nonfinite_count": len(nonfinite), "reason": inc.reason}
    streak = ", the first of a streak of skipped steps" if inc.reason in REASON_EXPLANATIONS else ""
    return {"kind": "finding", "key": DETECT_FINDING,
            "title": f"First non-finite step: {inc.step} ({inc.category}{streak})",
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
    if scaler:
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
