"""INCIDENT.md and the ledger it is rendered from: automatic findings and reviewer notes, kept apart."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from nanscan.bundle.format import DETECT_FINDING, MANIFEST, Incident
from nanscan.incident import CATEGORY_EXPLANATIONS, SPIKE


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
        (f"# Spike at step {manifest['first_invalid_step']}: an early warning, every value finite"
         if manifest["category"] == SPIKE else f"# Incident: non-finite values at step {manifest['first_invalid_step']}"),
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
    body = [CATEGORY_EXPLANATIONS.get(inc.category, ""), "",
            f"Non-finite tensors deciding the category: {', '.join(f'`{n}`' for n in inc.tensors[:10])}"
            + (f" and {len(inc.tensors) - 10} more" if len(inc.tensors) > 10 else "")
            + (f"; {others} other tensor(s) were non-finite too." if others else "."), "",
            "| tensor | kind | NaN | +inf | -inf | elements |", "|---|---|---:|---:|---:|---:|"]
    body += [f"| `{r['name']}` | {r['kind']} | {r['nan']} | {r['posinf']} | {r['neginf']} | {r['numel']} |"
             for r in shown]
    if len(nonfinite) > len(shown):
        body.append(f"| ... {len(nonfinite) - len(shown)} more in {MANIFEST} | | | | | |")
    last = inc.history[-1] if inc.history and inc.history[-1].step == inc.step else None
    finite_before = [e for e in inc.history if e.step < inc.step and e.report.ok]
    body += ["", f"At this step: loss {_fmt(last.loss if last else None)}, learning rate "
                 f"{_fmt(last.lr if last else None)}, gradient norm {_fmt(last.grad_norm if last else None)}."]
    if finite_before:
        prev = finite_before[-1]
        body.append(f"Last finite step in the history: {prev.step} (loss {_fmt(prev.loss)}, "
                    f"gradient norm {_fmt(prev.grad_norm)}).")
    record = {"step": inc.step, "category": inc.category, "tensors": list(inc.tensors),
              "nonfinite_count": len(nonfinite)}
    return {"kind": "finding", "key": DETECT_FINDING,
            "title": f"First non-finite step: {inc.step} ({inc.category})",
            "body": "\n".join(body), "record": record, "at": inc.detected_at}


def spike_finding(inc: Incident) -> dict:
    """The detection finding of a spike bundle: what spiked, against what, and the tensors that moved first."""
    spike = inc.spikes[-1]
    rule = spike["rule"]
    body = [CATEGORY_EXPLANATIONS[SPIKE], "",
            f"Judged against the last {spike['window']} finite steps, in log space (median and MAD; warm-up "
            f"{rule['warmup']} steps, robust z > {rule['threshold']:g} and at least {rule['min_ratio']:g}x the "
            "median):", "", "| quantity | value | median | ratio | robust z |", "|---|---:|---:|---:|---:|"]
    body += [f"| {s['quantity']} | {_fmt(s['value'])} | {_fmt(s['median'])} | {s['ratio']:.3g}x | {s['z']:.1f} |"
             for s in spike["scores"]]
    if spike["first_moving"]:
        body += ["", "Gradient norms that left their own range first, by layer:", "",
                 "| layer | tensor | from step | ratio | robust z |", "|---|---|---:|---:|---:|"]
        body += [f"| {g['layer']} | `{t['name']}` | {t['onset']} | {t['ratio']:.3g}x | {t['z']:.1f} |"
                 for g in spike["first_moving"] for t in g["tensors"]]
    earlier = [s["step"] for s in inc.spikes[:-1]]
    if earlier:
        body += ["", f"Earlier spikes of this run: steps {', '.join(map(str, earlier[-10:]))}."]
    record = {"step": inc.step, "category": SPIKE, "quantity": spike["quantity"], "tensors": list(inc.tensors)}
    top = spike["scores"][0]
    return {"kind": "finding", "key": DETECT_FINDING,
            "title": f"Spike at step {inc.step}: {top['quantity']} {top['ratio']:.3g}x its median",
            "body": "\n".join(body), "record": record, "at": inc.detected_at}


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
