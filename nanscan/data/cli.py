"""`nanscan data` and `nanscan runs`: the dataset and run-record checks on the command line.

Exit codes: 0 clean, 1 findings in a --fail-on category (runs: any problem), 2 usage errors (a missing path, a bad
option value), as click reports them, 3 (data) an input that could not be read through, so the check is incomplete.
"""

from __future__ import annotations

import json
from typing import Iterable

import click

from nanscan.data.findings import (
    CATEGORIES, DEFAULT_FAIL_ON, DEFAULT_IGNORE_INDEX, DEFAULT_LABELS_FIELD, DEFAULT_LOSS_MASK_FIELD,
    DEFAULT_TOKEN_FIELDS, TrainingFields,
)


def parse_fail_on(values: Iterable[str]) -> tuple[str, ...]:
    """--fail-on values: categories, comma-separated or repeated; "all" or "none". Default: all but too_long."""
    chosen: list[str] = []
    given = False
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            given = True
            if part == "all":
                chosen.extend(CATEGORIES)
            elif part == "none":
                continue
            elif part in CATEGORIES:
                chosen.append(part)
            else:
                raise click.BadParameter(f"unknown category {part!r}; choose from {', '.join(CATEGORIES)}, all, none",
                                         param_hint="--fail-on")
    return tuple(dict.fromkeys(chosen)) if given else DEFAULT_FAIL_ON


class RichProgress:
    """Bytes-based progress bar for long checks; silent unless stderr is a terminal."""

    def __init__(self, enabled: bool):
        from rich.console import Console
        from rich.progress import (
            BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
        )

        console = Console(stderr=True)
        self.enabled = enabled and console.is_terminal
        self.progress = Progress(TextColumn("{task.description}", style="dim"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
                                 disable=not self.enabled)
        self.task = self.progress.add_task("checking", total=0)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def add_total(self, nbytes: int) -> None:
        total = self.progress.tasks[0].total or 0
        self.progress.update(self.task, total=total + nbytes)

    def advance(self, nbytes: int) -> None:
        self.progress.advance(self.task, nbytes)

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=text[-40:])


def _render(report, fail_on: tuple[str, ...], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    failing = report.failing(fail_on)
    summary = Table(title=f"nanscan data: {report.records} records in {report.files} files "
                          f"({report.bytes / 1e6:.1f} MB)")
    summary.add_column("category")
    summary.add_column("findings", justify="right")
    summary.add_column("fails the check")
    for category in CATEGORIES:
        count = report.counts.get(category, 0)
        style = "bold red" if category in failing else ("yellow" if count else "")
        summary.add_row(category, str(count), "yes" if category in fail_on else "no", style=style)
    console.print(summary)
    if report.findings:
        # One line per finding, never wrapped, so that a record id can be copied or grepped whole.
        console.print("[bold]findings[/bold]")
        for f in report.findings:
            field = f" field {escape(f.field)}" if f.field else ""
            digest = f" sha256:{f.record.sha256[:16]}" if f.record.sha256 else ""
            sample = f" (id {escape(str(f.sample_id))})" if f.sample_id is not None else ""
            console.print(f"  [bold]{f.category}[/bold] {escape(str(f.record))}{sample}{field}: {escape(f.detail)}"
                          f"[dim]{digest}[/dim]", soft_wrap=True)
        omitted = {c: report.counts.get(c, 0) - sum(f.category == c for f in report.findings) for c in CATEGORIES}
        omitted = {c: n for c, n in omitted.items() if n > 0}
        if omitted:
            console.print(f"[dim]listing capped at {report.listed_per_category} per category; not listed: "
                          + ", ".join(f"{n} {c}" for c, n in omitted.items()) + " (raise --max-findings)[/dim]")
    t = report.tokens
    if t["records"]:
        console.print(f"token lengths ({report.tokenizer}): p50 {t['p50']}, p99 {t['p99']}, max {t['max']} "
                      f"over {t['records']} records" + (f"; --max-tokens {report.max_tokens}"
                                                        if report.max_tokens is not None else ""))
    if report.longest is not None:
        console.print(f"longest record: {escape(str(report.longest.record))} ({report.longest.value} tokens)",
                      soft_wrap=True)
    if report.largest_magnitude is not None:
        b = report.largest_magnitude
        console.print(f"largest finite magnitude: {b.value:.6g} in {escape(str(b.record))}"
                      + (f" field {escape(b.field)}" if b.field else ""), soft_wrap=True)
    if report.skipped_count:
        shown = ", ".join(report.skipped[:5]) + (" ..." if report.skipped_count > 5 else "")
        console.print(f"[dim]skipped {report.skipped_count} file(s) of unknown format: {escape(shown)}[/dim]",
                      soft_wrap=True)
    if not report.complete:
        shown = ", ".join(report.unreadable_inputs[:5]) + (" ..." if report.unreadable_input_count > 5 else "")
        console.print(f"[bold red]INCOMPLETE[/bold red]: {report.unreadable_input_count} input(s) could not be read "
                      f"through, so their records were not all checked: {escape(shown)}", soft_wrap=True)
    if failing:
        console.print("[bold red]FAIL[/bold red]: " + ", ".join(f"{n} {c}" for c, n in failing.items()))
    elif report.complete:
        console.print("[bold green]OK[/bold green]: no findings in the --fail-on categories "
                      f"({', '.join(fail_on) or 'none'})")


def data_options(func):
    """The options `nanscan data` shares with `nanscan preflight`."""
    options = [
        click.option("--max-tokens", type=click.IntRange(min=0), default=None,
                     help="Report records with more tokens than this (too_long)."),
        click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="A HuggingFace tokenizer.json to count tokens with (default: whitespace tokens)."),
        click.option("--text-field", "text_fields", multiple=True,
                     help="A field whose text is counted (repeatable; default: every top-level string field)."),
        click.option("--token-field", "token_fields", multiple=True, metavar="FIELD",
                     help="A field of token ids (a list of ints; in CSV a JSON list): a record with one counts its "
                          "length as its tokens, in place of its text (repeatable; default: "
                          f"{', '.join(DEFAULT_TOKEN_FIELDS)})."),
        click.option("--labels-field", default=DEFAULT_LABELS_FIELD, show_default=True, metavar="FIELD",
                     help="The field of labels: all equal to --ignore-index is no_supervised_tokens ('' for none)."),
        click.option("--ignore-index", type=int, default=DEFAULT_IGNORE_INDEX, show_default=True,
                     help="The label the loss ignores (torch's cross_entropy and Hugging Face models: -100)."),
        click.option("--loss-mask-field", default=DEFAULT_LOSS_MASK_FIELD, show_default=True, metavar="FIELD",
                     help="The field of a 0/1 loss mask: all 0 is no_supervised_tokens ('' for none)."),
        click.option("--fail-on", "fail_on", multiple=True,
                     help="Categories that fail the check (repeatable or comma-separated; 'all', 'none'). "
                          f"Default: {', '.join(DEFAULT_FAIL_ON)}."),
        click.option("--max-findings", type=click.IntRange(min=0), default=1000, show_default=True,
                     help="Findings listed per category (counts are always exact)."),
        click.option("--max-record-bytes", type=click.IntRange(min=1), default=64 << 20, show_default=True,
                     help="Longer records (lines) are reported unreadable instead of loaded."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def training_fields(token_fields, labels_field, ignore_index, loss_mask_field) -> TrainingFields:
    """The TrainingFields of the --token-field, --labels-field, --ignore-index and --loss-mask-field options."""
    return TrainingFields(tuple(token_fields) or DEFAULT_TOKEN_FIELDS, labels_field or None, ignore_index,
                          loss_mask_field or None)


def run_data_check(paths, *, max_tokens, tokenizer, text_fields, max_findings, max_record_bytes, show_progress,
                   fields):
    """check_paths with CLI error handling: a bad tokenizer is a usage error (exit 2)."""
    from nanscan.data.api import check_paths
    from nanscan.data.tokens import TokenizerError

    try:
        with RichProgress(show_progress) as progress:
            return check_paths(paths, max_tokens=max_tokens, tokenizer=tokenizer,
                               text_fields=text_fields or None, max_findings=max_findings,
                               max_record_bytes=max_record_bytes, progress=progress, fields=fields)
    except TokenizerError as exc:
        raise click.BadParameter(str(exc), param_hint="--tokenizer") from None


@click.command("data")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--id-field", default=None, metavar="FIELD",
              help="Also name each listed record by this field's value (JSON Lines, CSV, Parquet): the sample id "
                   "training passes to Monitor.check(sample_ids=...), which bundles and replay show.")
@data_options
def data_command(paths, as_json, id_field, max_tokens, tokenizer, text_fields, token_fields, labels_field,
                 ignore_index, loss_mask_field, fail_on, max_findings, max_record_bytes):
    """Check data files and folders for records that will break training.

    Findings: nonfinite (NaN, inf), overflow (finite but |x| >= 2**64, so its square overflows float32, e.g. a
    float32-maximum "missing value" sentinel), empty, too_long (--max-tokens; a record's tokens are its token ids
    when it has a --token-field, else its text), no_supervised_tokens (every label is --ignore-index, or the loss
    mask is all 0: a mean loss over the record is 0/0), corrupt_image, unreadable, inconsistent (a field's type or
    shape differs from the other records').

    Formats: JSON Lines (.jsonl/.ndjson/.json, optionally .gz), CSV/TSV (optionally .gz), Parquet, .npy, .npz,
    safetensors, and folders of images (png, jpeg, webp, bmp, tiff, gif). Every finding names its record by
    file, line or index and the sha256 of the record's bytes.

    Exit status: 0 clean, 1 findings in a --fail-on category, 2 usage errors (e.g. a path that does not exist),
    3 an input could not be read through (not valid in its format, or cut short), so its records were not all
    checked, whatever --fail-on says. The --json report's "status" says the same: clean, findings or unreadable.
    """
    fail_on = parse_fail_on(fail_on)
    report = run_data_check(paths, max_tokens=max_tokens, tokenizer=tokenizer, text_fields=text_fields,
                            max_findings=max_findings, max_record_bytes=max_record_bytes, show_progress=not as_json,
                            fields=training_fields(token_fields, labels_field, ignore_index, loss_mask_field))
    if report.files == 0:  # "no findings" in nothing checked would read as clean data
        raise click.UsageError(f"no data files found in {', '.join(map(str, paths))}: nothing was checked; point "
                               "nanscan data at files or folders in one of the formats listed in --help")
    id_notes = []
    if id_field is not None:
        from nanscan.data.ids import with_sample_ids

        report, id_notes = with_sample_ids(report, id_field)
    for note in id_notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        click.echo(json.dumps(report.to_dict(fail_on), indent=2))
    else:
        from nanscan.cli.errors import console as cli_console

        _render(report, fail_on, cli_console())
    raise SystemExit(report.exit_code(fail_on))


@click.command("runs")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--require", "required", multiple=True,
              help="A key every record must have (repeatable; dotted paths like metrics.loss reach into objects).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def runs_command(directory, required, as_json):
    """Check a folder of run records (*.json, recursively): empty files, invalid JSON, non-finite numbers
    (NaN, Infinity, 1e999), missing required keys, and a folder without any record.

    Exit status: 0 no problems, 1 problems (each listed with its path), 2 usage errors.
    """
    from nanscan.data.runs import check_runs

    report = check_runs(directory, required)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        from nanscan.cli.errors import console as cli_console
        from rich.table import Table

        console = cli_console()
        if report.problems:
            table = Table(title=f"nanscan runs: {len(report.problems)} problem(s) in {report.files} run records")
            for column in ("problem", "path", "detail"):
                table.add_column(column, overflow="fold")
            for p in report.problems:
                table.add_row(p.category, p.path, p.detail)
            console.print(table)
            console.print("[bold red]FAIL[/bold red]: " + ", ".join(
                f"{n} {c}" for c, n in report.counts().items() if n))
        else:
            console.print(f"[bold green]OK[/bold green]: {report.files} run records, no problems"
                          + (f" (required keys: {', '.join(report.required)})" if report.required else ""))
    raise SystemExit(0 if report.ok else 1)
