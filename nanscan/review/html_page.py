"""`nanscan report --html`: one self-contained HTML page (inline CSS, the plots of nanscan.review.plots as embedded
PNG, INCIDENT.md rendered) from the summary (nanscan.review.summary), worded by nanscan.review.text. Every piece of
a bundle's text is escaped: it is data, never markup.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from nanscan._atomic import atomic_write_text
from nanscan.engine.headroom import FORMATS
from nanscan.review.plots import plot_curves, plot_divergence, plot_exponent_heatmap, plot_nonfinite_map, png_base64
from nanscan.review.summary import HEADROOM_FORMATS, JUMP_BINADES, load_history, sample_id_list, summarize
from nanscan.review.text import (AROUND_HEADERS, RANKS_HEADERS, abandoned_lines, around_rows, divergence_cells,
                                 divergence_none_text, findings_text, fmt, headline, headroom_cell,
                                 mixed_precision_text, ranks_rows, ranks_title, replica_lines, size_text, spike_list,
                                 spike_rows, spike_title)

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

_esc = html.escape


def markdown_html(text: str) -> str:
    """Markdown (INCIDENT.md, a finding) as HTML, with markdown-it-py: tables, headings and lists rendered, nanscan's
    markers dropped, and any raw HTML in the text shown as text, never as markup (a bundle's text is data)."""
    from markdown_it import MarkdownIt  # noqa: PLC0415 - with the HTML report only

    return MarkdownIt("commonmark", {"html": False}).enable("table").render(_MARKER.sub("", text))


def _table(headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    def cell(tag, i, value):
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{_esc(str(value))}</{tag}>"
    head = "".join(cell("th", i, h) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _paragraphs(lines: list[str], cls: str = "") -> list[str]:
    attr = f" class='{cls}'" if cls else ""
    return [f"<p{attr}>{_esc(line)}</p>" for line in lines]


def _img(fig, alt: str) -> list[str]:
    alt = _esc(alt, quote=True)
    if fig is None:
        return [f"<p class='muted'>({alt}: no history in this bundle)</p>"]
    return [f"<p><img alt=\"{alt}\" src=\"data:image/png;base64,{png_base64(fig)}\"></p>"]


def render_html(bundle, path, *, summary: dict | None = None, history: list | None = None,
                incident: str | None = None) -> Path:
    """Write one self-contained HTML report (inline CSS, plots as embedded PNG) to `path`, atomically.
    `summary`, `history` and `incident`: summarize(bundle), load_history(bundle) and bundle.incident_text(), when
    the caller already has them."""
    history = load_history(bundle) if history is None else history
    summary = summarize(bundle, history) if summary is None else summary
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>nanscan report: "
             f"{_esc(str(summary['run_id']))} step {summary['first_invalid_step']}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>nanscan incident: run <code>{_esc(str(summary['run_id']))}</code></h1>",
             f"<p><span class='bad'>{_esc(headline(summary))}</span>, category "
             f"<b>{_esc(str(summary['category']))}</b>: {_esc(summary['category_meaning'])}</p>",
             *_paragraphs(replica_lines(summary)),
             f"<p class='muted'>bundle {_esc(summary['bundle'])}; history of {summary['history']['steps']} steps "
             f"({summary['history']['first']}..{summary['history']['last']}); "
             f"{_esc(size_text(summary.get('size')))}</p>"]

    if summary.get("distributed"):
        parts.append(f"<h2>{_esc(ranks_title(summary['distributed'], summary['first_invalid_step']))}</h2>")
        parts.append(_table(list(RANKS_HEADERS), ranks_rows(summary["distributed"]), left=4))
    parts.append("<h2>Findings</h2><ul>" + "".join(f"<li>{_esc(line)}</li>" for line in findings_text(summary))
                 + "</ul>")
    parts.append("<h2>Loss, learning rate and gradient norm</h2>")
    parts.append(_table(list(AROUND_HEADERS), around_rows(summary)))
    parts += _paragraphs(abandoned_lines(summary))
    parts += _img(plot_curves(summary, history), "loss and gradient norm")

    if summary["groups"]:  # none when no tensor was non-finite (a spike, replicas that differ): no empty table
        parts.append("<h2>Non-finite tensors by module</h2>")
        parts.append(_table(["module", "layer", "tensors", "NaN", "+inf", "-inf", "of numel"],
                            [[g["module"], g["layer"], ", ".join(g["tensors"]), g["nan"], g["posinf"], g["neginf"],
                              g["numel"]] for g in summary["groups"]], left=3))
        parts += _img(plot_nonfinite_map(summary, history), "per-module non-finite map")

    parts += _spike_html(summary)
    if summary.get("divergence"):
        parts += _divergence_html(summary["divergence"], summary.get("abandoned"))
    parts += _batch_html(summary)

    parts.append("<h2>Exponent histograms over the history</h2>")
    parts += _img(plot_exponent_heatmap(summary, history), "exponent heatmap")
    if summary["exponent_jumps"]:
        parts.append(f"<p>Largest values that jumped at step {summary['first_invalid_step']} "
                     f"({summary['exponent_jumps_total']} tensors rose by {JUMP_BINADES} binades or more):</p>")
        parts.append(_table(["tensor", "top binade before", "after", "jump"],
                            [[j["name"], j["top_binade_before"], j["top_binade_after"], f"+{j['jump']}"]
                             for j in summary["exponent_jumps"]]))

    parts += _headroom_html(summary)
    provenance = {"source": summary["source"], "replay_entry": summary["replay_entry"]}
    parts.append(f"<h2>Provenance</h2><pre>{_esc(json.dumps(provenance, indent=2, default=str))}</pre>")
    incident = bundle.incident_text() if incident is None else incident
    parts.append(f"<h2>Incident note</h2><div class='note'>{markdown_html(incident)}</div>")
    parts.append("</body></html>\n")
    return atomic_write_text(path, "".join(parts))


def _spike_html(summary: dict) -> list[str]:
    """A spike bundle's own spike (its scores, the gradient norms that moved first), and the run's spikes."""
    parts = []
    if summary.get("spike"):
        scores, moving = spike_rows(summary["spike"])
        parts.append(f"<h2>{_esc(spike_title(summary['spike']).capitalize())}</h2>")
        parts.append(_table(["quantity", "value", "median or start", "ratio", "robust z or gain"], scores))
        if moving:
            parts.append("<p>Gradient norms that moved first, by layer:</p>")
            parts.append(_table(["layer", "tensor", "from step", "ratio", "robust z"], moving, left=2))
    if summary.get("spikes"):
        parts.append(f"<p>Spikes of this run up to here: {_esc(spike_list(summary['spikes']))}</p>")
    return parts


def _divergence_html(div: dict, abandoned: list[dict] | None) -> list[str]:
    """The divergence section: the rule, the plot, the tensors that grew first by layer, every step."""
    from nanscan.bundle.incident_md import (divergence_rows, divergence_rule_text,  # noqa: PLC0415 - [fast help]
                                            divergence_title)

    if not div["grew"]:
        return [f"<h2>Divergence before step {div['step']}</h2>", f"<p>{_esc(divergence_none_text(div))}.</p>"]
    shown, more = divergence_rows(div)
    last = div["judged"][1]
    parts = [f"<h2>{_esc(divergence_title(div))}</h2>", f"<p>{_esc(divergence_rule_text(div))}.</p>",
             *_img(plot_divergence(div, abandoned or []),
                   "loss, gradient norm, learning rate and loss scale before the incident, with the onsets of the "
                   "layers that grew first"),
             _table(["layer", "tensor", "grew from step", "baseline binade", f"binade at step {last}", "gained"],
                    [[t["layer"], t["tensor"], t["onset"], t["baseline"], t["binade"], f"+{t['binades']}"]
                     for t in shown], left=2)]
    if more:
        parts.append(f"<p class='muted'>{more} more tensors grew: see <code>nanscan report --json</code>.</p>")
    headers, cells, _stride = divergence_cells(div, len(div["steps"]), abandoned)
    parts.append(_table(headers, cells, left=0))
    return parts


def _batch_html(summary: dict) -> list[str]:
    if not summary["inputs_at_failure"]:
        return []
    parts = [f"<h2>Batch at step {summary['first_invalid_step']}</h2>",
             _table(["tensor", "dtype", "numel", "NaN", "inf", "zero", "absmax", "top binade"],
                    [[r["name"], r["dtype"], r["numel"], r["nan"], r["posinf"] + r["neginf"], r["zero"],
                      fmt(r["absmax"]), fmt(r["top_binade"], "d")] for r in summary["inputs_at_failure"]], left=2)]
    ids = sample_id_list(summary["batch"].get("sample_ids"))
    if ids:
        parts.append(f"<p class='muted'>sample ids: {_esc(', '.join(map(str, ids)))}</p>")
    return parts


def _headroom_html(summary: dict) -> list[str]:
    parts = []
    if summary["headroom"]:
        parts.append("<h2>Dtype headroom</h2><p class='muted'>overflow / below the normal range, as fractions of "
                     "finite non-zero values (binade granularity); float32: binades left before overflow</p>")
        parts.append(_table(["tensor", "dtype", "step", "numel", "absmax", *[f.name for f in HEADROOM_FORMATS]],
                            [[r["name"], r["dtype"], r["step"], r["numel"], fmt(r["absmax"], ".3g"),
                              fmt(r["formats"]["float32"]["binades_to_overflow"], "d"),
                              *[headroom_cell(r["formats"][f.name]) for f in FORMATS]]
                             for r in summary["headroom"]]))
    if summary.get("mixed_precision"):
        parts.append(f"<h2>Mixed precision</h2><pre>{_esc(chr(10).join(mixed_precision_text(summary)))}</pre>")
    return parts
