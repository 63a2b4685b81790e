"""`nanscan report` in the terminal: the summary (nanscan.review.summary) as rich tables and lines, narrow enough for
an 80-column terminal, worded by nanscan.review.text. rich is imported when a report is printed, not before.
"""

from __future__ import annotations

from nanscan.engine.headroom import FORMATS
from nanscan.review.summary import KIND_LABEL, kind_rank, sample_id_list
from nanscan.review.text import (AROUND_HEADERS, RANKS_HEADERS, abandoned_lines, around_rows, divergence_cells,
                                 divergence_none_text, findings_text, fmt, headline, headroom_cell,
                                 mixed_precision_text, ranks_rows, ranks_title, replica_lines, size_text, spike_list,
                                 spike_rows, spike_title)

TABLE_MAX_ROWS = 20
TERMINAL_DIVERGENCE_STEPS = 12
# The tensor's own dtype beside the columns of the dtypes it is not in (a float32 gradient's e4m3 column is a
# what-if, not a finding).
_SHORT_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64", "complex64": "c64",
                 "complex128": "c128"}


def _literal(*cells: str) -> list[str]:
    """Text for rich, escaped: tensor names, sample ids and run ids are data, and a batch key such as "tokens[bos]"
    must not be read as markup (it would vanish, or end the report with a MarkupError)."""
    from rich.markup import escape

    return [escape(cell) for cell in cells]


def _table(title: str, *columns: str, left: int = 1, rows: list[list[str]] = ()):
    """A report table: the first `left` columns left-aligned, `rows` added as literal text."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1))
    for i, col in enumerate(columns):
        # names fold onto a second line rather than lose their ends to an ellipsis
        t.add_column(col, justify="left" if i < left else "right", overflow="fold")
    for row in rows:
        t.add_row(*_literal(*row))
    return t


def _lines(console, lines: list[str]) -> None:
    for line in lines:
        console.print(_literal(line)[0], highlight=False)


def render_terminal(summary: dict, console=None) -> None:
    """Print the summary as rich tables, narrow enough for an 80-column terminal."""
    from rich.text import Text

    from nanscan.cli.errors import console as cli_console  # noqa: PLC0415

    console = console or cli_console()
    step, category = summary["first_invalid_step"], summary["category"]
    category_text, run_text = _literal(str(category), str(summary["run_id"]))
    console.print(f"[bold red]{headline(summary)}[/bold red], category [bold]{category_text}[/bold] (run {run_text})")
    if summary["category_meaning"]:
        console.print(summary["category_meaning"], highlight=False)
    _lines(console, replica_lines(summary))
    if summary.get("distributed"):
        console.print(_table(_literal(ranks_title(summary["distributed"], step))[0], *RANKS_HEADERS, left=4,
                             rows=ranks_rows(summary["distributed"])))

    if not summary["history"]["steps"]:
        console.print("[yellow]this bundle holds no history steps:[/yellow] no loss, gradient norm, batch statistics "
                      "or headroom to show")
    if summary.get("size"):
        _lines(console, [size_text(summary["size"])])
    console.print(_table("around the failure", *AROUND_HEADERS, rows=around_rows(summary)))
    _lines(console, abandoned_lines(summary))
    console.print(Text("\n".join(findings_text(summary))))

    if summary["groups"]:  # none when no tensor was non-finite (a spike, replicas that differ): no empty table
        console.print(_groups_table(summary))

    if summary["inputs_at_failure"]:
        console.print(_inputs_table(summary))

    if summary.get("spike"):
        console.print(_spike_tables(summary["spike"]))
    if summary.get("spikes"):
        _lines(console, ["spikes of this run up to here: " + spike_list(summary["spikes"])])

    if summary.get("divergence"):
        console.print(_divergence_tables(summary["divergence"], summary.get("abandoned")))

    if summary["exponent_jumps"]:
        jumps = _table(f"jumps at step {step}: top binade (log2)", "tensor", "before", "after", "jump",
                       rows=[[j["name"], str(j["top_binade_before"]), str(j["top_binade_after"]), f"+{j['jump']}"]
                             for j in summary["exponent_jumps"]])
        if summary["exponent_jumps_total"] > len(summary["exponent_jumps"]):
            jumps.caption = f"{summary['exponent_jumps_total']} tensors in all"
        console.print(jumps)

    if summary.get("mixed_precision"):
        console.print("[bold]mixed precision[/bold]")
        _lines(console, mixed_precision_text(summary))

    if summary["headroom"]:
        console.print(_headroom_table(summary))


def _groups_table(summary: dict):
    rows = []
    for g in summary["groups"][:TABLE_MAX_ROWS]:
        kinds = ", ".join(f"{n} {KIND_LABEL.get(k, k)}"
                          for k, n in sorted(g["kinds"].items(), key=lambda kv: kind_rank(kv[0])))
        rows.append([g["module"], kinds, str(g["nan"]), str(g["posinf"]), str(g["neginf"]), str(g["numel"])])
    groups = _table(f"non-finite tensors by module ({len(summary['nonfinite_tensors'])})",
                    "module", "tensors", "NaN", "+inf", "-inf", "elements", left=2, rows=rows)
    if len(summary["groups"]) > TABLE_MAX_ROWS:
        groups.caption = f"{len(summary['groups']) - TABLE_MAX_ROWS} more modules in --json"
    return groups


def _inputs_table(summary: dict):
    inputs = _table(f"batch at step {summary['first_invalid_step']}", "tensor", "dtype", "elements", "NaN", "inf",
                    "zero", "absmax", "top binade", left=2,
                    rows=[[r["name"], r["dtype"], str(r["numel"]), str(r["nan"]), str(r["posinf"] + r["neginf"]),
                           str(r["zero"]), fmt(r["absmax"], ".4g"), fmt(r["top_binade"], "d")]
                          for r in summary["inputs_at_failure"]])
    sample_ids = sample_id_list(summary["batch"].get("sample_ids"))
    if sample_ids:
        shown = ", ".join(map(str, sample_ids[:5])) + (", ..." if len(sample_ids) > 5 else "")
        inputs.caption = _literal(f"{len(sample_ids)} samples: {shown}")[0]
    return inputs


def _headroom_table(summary: dict):
    rows = []
    for r in summary["headroom"]:
        cells = [fmt(r["formats"]["float32"]["binades_to_overflow"], "d")]
        cells += [headroom_cell(r["formats"][f.name], compact=True) for f in FORMATS]
        rows.append([r["name"], _SHORT_DTYPES.get(r["dtype"], r["dtype"]), str(r["step"]), fmt(r["absmax"], ".3g"),
                     *cells])
    return _table("if stored in another dtype: overflow/below-normal share; f32: binades left", "tensor", "dtype",
                  "step", "absmax", "f32", "f16", "bf16", "e4m3", "e5m2", rows=rows)


def _within_layer(name: str, layer: str) -> str:
    """A tensor's name without its layer's path, beside the layer's own column: "param:transformer.h.0.mlp.c_fc.weight"
    in "transformer.h.0" is "param:mlp.c_fc.weight" (80 columns hold it)."""
    kind, sep, body = name.partition(":")
    return f"{kind}:{body[len(layer) + 1:]}" if sep and body.startswith(layer + ".") else name


def _divergence_tables(div: dict, abandoned: list[dict] | None):
    from rich.console import Group
    from rich.text import Text

    from nanscan.bundle.incident_md import divergence_rows, divergence_title  # noqa: PLC0415 - NOTE: [fast help]

    if not div["grew"]:
        return Text(divergence_none_text(div))
    shown, more = divergence_rows(div)
    grew = _table(_literal(divergence_title(div))[0], "layer", "tensor in it", "from step", "binades", left=2,
                  rows=[[t["layer"] if i == 0 or shown[i - 1]["layer"] != t["layer"] else "",
                         _within_layer(t["tensor"], t["layer"]), str(t["onset"]), f"+{t['binades']}"]
                        for i, t in enumerate(shown)])
    grew.caption = (f"largest |x| {div['rule']['binades']}+ binades over its start (steps {div['baseline'][0]}-"
                    f"{div['baseline'][-1]}) through step {div['judged'][1]}"
                    + (f"; {more} more tensors in --json" if more else ""))
    headers, cells, stride = divergence_cells(div, TERMINAL_DIVERGENCE_STEPS, abandoned)
    steps = _table(f"steps before {div['step']}" + (f" (one in {stride}, the onsets and the last)" if stride > 1
                                                     else ""), *headers, rows=cells)
    steps.columns[-1].justify = "left"
    return Group(grew, steps)


def _spike_tables(spike: dict):
    from rich.console import Group

    scores, moving = spike_rows(spike)
    first = _table(spike_title(spike), "quantity", "value", "median or start", "ratio", "robust z or gain",
                   rows=scores)
    if not moving:
        return first
    return Group(first, _table("gradient norms that moved first, by layer", "layer", "tensor", "from step", "ratio",
                               "robust z", left=2, rows=moving))
