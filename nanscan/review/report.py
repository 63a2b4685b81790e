"""`nanscan report BUNDLE`: what an incident bundle says, as a terminal summary, one self-contained HTML page with
plots, or JSON. A spike bundle (category "spike", the early warning) shows what spiked and the gradient tensors
that moved first; a replica mismatch, the odd rank and the tensors that differed; any bundle marks the run's spikes
and rollbacks on its plots, and the steps a rollback abandoned wherever it shows the history step by step.

The command only reads and routes: nanscan.review.summary gathers every fact once (summarize), and
nanscan.review.terminal, nanscan.review.html_page and --json format it.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from nanscan.review.html_page import render_html
from nanscan.review.summary import bundle_holding, load_history, summarize
from nanscan.review.terminal import render_terminal


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
