"""`nanscan preflight` on the command line: the subcommand, its --config file and the GO / NO-GO view. The
rehearsal itself (nanscan.preflight) needs torch, so it is imported when the command runs and `nanscan preflight
--help` does not import it (NOTE: [fast help] in nanscan/cli/main.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from nanscan.data.cli import data_options
from nanscan.cli.preflight_options import DEFAULT_SAMPLE_BATCHES, DEFAULT_STEPS

if TYPE_CHECKING:
    from nanscan.preflight import PreflightReport


def _render(report: PreflightReport, console) -> None:
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    if report.data is not None:
        d = report.data
        counts = ", ".join(f"{n} {c}" for c, n in d.counts.items() if n) or "no findings"
        console.print(f"data: {d.records} records in {d.files} files: {counts}")
        for f in d.findings[:20]:
            console.print(f"  {f.category} {escape(str(f.record))}: {escape(f.detail)}", soft_wrap=True)
        if len(d.findings) > 20:
            console.print(f"  ... {len(d.findings) - 20} more (run `nanscan data` for the full list)")
    if report.sample:
        table = Table(title="review sample")
        for column in ("batch", "roles", "length/sample", "max |x|"):
            table.add_column(column)
        for s in report.sample:
            table.add_row(str(s.index), ", ".join(s.roles), str(s.length), f"{s.magnitude:.4g}")
        console.print(table)
    for c in report.canaries:
        mark = "[green]caught[/green]" if c.caught else "[red]not caught[/red]"
        console.print(f"canary ({escape(c.injected_into)}): {mark}: {escape(c.detail)}", soft_wrap=True)
    if report.steps:
        ok = [s for s in report.steps if s.ok]
        losses = [s.loss for s in ok]
        line = f"steps: {len(ok)} of {len(report.steps)} clean"
        if losses:
            line += f", loss {losses[0]:.4g} -> {losses[-1]:.4g}"
        console.print(line)
    if report.headroom:
        table = Table(title="dtype headroom over the steps (binades to overflow / share overflowing / flushed)")
        table.add_column("tensors")
        formats = [row["format"] for row in next(iter(report.headroom.values()))]
        for fmt in formats:
            table.add_column(fmt)
        for group, rows in report.headroom.items():
            cells = []
            for row in rows:
                if not row["values"]:
                    cells.append("-")
                    continue
                cells.append(f"{row['binades_to_overflow']} / {row['overflow']:.1%} / {row['underflow']:.1%}")
            table.add_row(group, *cells)
        console.print(table)
    body = "\n".join([*(f"[red]x[/red] {escape(r)}" for r in report.reasons),
                      *(f"[yellow]![/yellow] {escape(w)}" for w in report.warnings)]) or "all checks passed"
    console.print(Panel(body, title="[bold green]GO[/bold green]" if report.go else "[bold red]NO-GO[/bold red]",
                        expand=False))


def _load_config(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path!r} as JSON ({exc})", param_hint="--config") from None
    if not isinstance(config, dict):
        raise click.BadParameter(f"{path!r} must hold a JSON object", param_hint="--config")
    return config


@click.command("preflight")
@click.option("--entry", required=True, help="Replay entry 'package.module:function' returning a ReplaySpec.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="A JSON file whose object is passed to the entry.")
@click.option("--steps", type=click.IntRange(min=1), default=DEFAULT_STEPS, show_default=True,
              help="Training steps to run on the review sample.")
@click.option("--data", "data_paths", multiple=True, type=click.Path(exists=True),
              help="Data files or folders to check first (repeatable).")
@click.option("--sample-batches", type=click.IntRange(min=1), default=DEFAULT_SAMPLE_BATCHES, show_default=True,
              help="How many of the entry's batches to consider for the review sample.")
@click.option("--seed", type=int, default=0, show_default=True, help="torch.manual_seed before building the entry.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@data_options
def preflight_command(entry, config_path, steps, data_paths, sample_batches, seed, as_json, max_tokens, tokenizer,
                      text_fields, token_fields, labels_field, ignore_index, loss_mask_field, fail_on, max_findings,
                      max_record_bytes):
    """Before a long run: data checks, then a few training steps with every-step checks, a canary that must be
    caught, and the dtype headroom report; prints GO or NO-GO with reasons (exit 0 go, 1 no-go, 2 usage)."""
    from nanscan.data.cli import RichProgress, parse_fail_on, training_fields
    from nanscan.data.tokens import TokenizerError
    from nanscan.entry import EntryError  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py
    from nanscan.preflight import run_preflight  # noqa: PLC0415

    fail_on = parse_fail_on(fail_on)
    config = _load_config(config_path)
    options = {"max_tokens": max_tokens, "tokenizer": tokenizer, "text_fields": text_fields or None,
               "max_findings": max_findings, "max_record_bytes": max_record_bytes,
               "fields": training_fields(token_fields, labels_field, ignore_index, loss_mask_field)}
    try:
        with RichProgress(not as_json) as progress:
            report = run_preflight(entry, config=config, steps=steps, data_paths=data_paths, fail_on=fail_on,
                                   data_options=options, sample_batches=sample_batches, seed=seed,
                                   progress=progress)
    except EntryError as exc:
        raise click.BadParameter(str(exc), param_hint="--entry") from None
    except TokenizerError as exc:
        raise click.BadParameter(str(exc), param_hint="--tokenizer") from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        from nanscan.cli.errors import console as cli_console

        _render(report, cli_console())
    raise SystemExit(0 if report.go else 1)
