"""The `nanscan replay` and `nanscan export-regression` subcommands. The replay itself is imported when a command
runs, so that their help does not import torch (NOTE: [fast help] in nanscan/cli/main.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from nanscan.cli.errors import cli_errors, entry_options, json_out
from nanscan.replay.options import DEFAULT_MAX_STATE_MB, DEFAULT_RUNS

if TYPE_CHECKING:
    from nanscan.replay.reproduce import ReplayResult


def print_replay(result: ReplayResult, console) -> None:
    from rich.markup import escape  # noqa: PLC0415 - errors, paths and module names are not markup
    from rich.table import Table  # noqa: PLC0415

    from nanscan.runtime.localize import fmt_value  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    # not reproduced is no all-clear: a rerun cannot see what lies outside the replay entry (NOTE: [not reproduced])
    style = "red" if result.reproduced and result.verdict == "persistent" else "yellow"
    console.print(f"[bold]{escape(result.bundle)}[/bold] (run {result.run_id}, step {result.step}, "
                  f"category {result.bundle_category})")
    console.print(f"[{style}]{escape(result.headline())}[/{style}]", highlight=False)
    console.print(result.explanation(), highlight=False, markup=False)
    table = Table(title="replays (deterministic algorithms on)")
    for column in ("run", "outcome", "loss", "non-finite tensors", "grad max exp"):
        table.add_column(column)
    for i, run in enumerate(result.runs, 1):
        table.add_row(str(i), "finite" if run.finite else escape(run.error or run.category), fmt_value(run.loss),
                      str(len(run.nonfinite)),
                      "n/a" if run.grad_max_exponent is None else f"2^{run.grad_max_exponent}")
    console.print(table)
    loc = result.localization
    if loc is not None:
        console.print(f"first bad module: [bold]{escape(loc.label)}[/bold] ({escape(loc.module_type)}), phase "
                      f"[bold]{loc.phase}[/bold]{escape(f' - {loc.detail}') if loc.detail else ''}", highlight=False)
        console.print(f"  received: {loc.received.describe()}", highlight=False, markup=False)
        console.print(f"  produced: {loc.produced.describe()}", highlight=False, markup=False)
    site = result.op
    if site is not None:
        console.print(f"first bad op: [bold]{escape(site.op)}[/bold] ({site.made} {escape(site.call)}), "
                      f"{site.phase}, in "
                      f"{escape(site.label)} ({escape(site.module_type)})", highlight=False)
        if site.location:
            console.print(f"  at {site.location}: {site.code or ''}", highlight=False, markup=False)
        console.print(f"  received: {site.received.describe()}", highlight=False, markup=False)
        console.print(f"  produced: {site.produced.describe()}", highlight=False, markup=False)
    if result.update is not None:
        console.print(f"the update ({result.update['optimizer']}.step()) broke {result.update['broken_count']} "
                      f"tensor(s): {', '.join(result.update['broken'][:5])}", highlight=False, markup=False)
        for trap in result.update["traps"]:
            console.print(f"  trap ({trap['severity']}): {trap['text']}", highlight=False, markup=False)
    if result.bisect is not None:
        b = result.bisect
        if b.applicable:
            shown = b.sample_ids if b.sample_ids is not None else b.indices
            title = "smallest failing subset" if b.minimal else "fewest failing samples found"
            console.print(f"{title}: {len(b.indices)} of {b.batch_size} samples: {shown} "
                          f"(rows {b.indices}, {b.trials} trials)", highlight=False, markup=False)
            if b.says_more:
                console.print(f"  {b.describe()}", highlight=False, markup=False)
        else:
            console.print(b.describe(), highlight=False, markup=False)
    for failed in result.phase_errors:
        console.print(f"warning: {failed['phase']} failed, the results above stand: {failed['error']}",
                      style="yellow", highlight=False, markup=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)


@click.command("replay")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@entry_options
@click.option("--runs", default=DEFAULT_RUNS, show_default=True, type=click.IntRange(1, 20),
              help="How many times to replay the step (persistent or intermittent needs at least 2).")
@click.option("--no-bisect", is_flag=True, help="Do not bisect the batch to the fewest failing samples.")
@click.option("--no-record", is_flag=True, help="Do not add the result to the bundle's ledger and INCIDENT.md.")
@click.option("--window", is_flag=True,
              help="Rerun the bundle's window of the run instead: every step from its oldest kept state as "
                   "recorded, compared with the recorded history.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def replay_command(bundle, entry, trust_bundle_paths, runs, no_bisect, no_record, window, as_json):
    """Replay BUNDLE's failing step: reproduced by the entry, every time? first bad module and op, fewest samples.

    With --window, rerun the steps that led to it from the window's oldest kept state instead.
    Exits 0 when the step ran, reproduced or not; an optional phase (localization, bisection) that fails is
    reported as a warning line (in --json: phase_errors) beside what the other phases found."""
    from nanscan.cli.errors import console as cli_console  # noqa: PLC0415
    from nanscan.replay.reproduce import record_replay, replay  # noqa: PLC0415 - NOTE: [fast help]

    console = cli_console(stderr=as_json)
    if window:
        _replay_window(bundle, entry, trust_bundle_paths, no_record, as_json, console)
        return
    with cli_errors():
        with console.status("replaying") as status:
            result = replay(bundle, entry, runs=runs, bisect=not no_bisect, trust_bundle_paths=trust_bundle_paths,
                            progress=lambda msg: status.update(msg))
        changed = None if no_record else record_replay(result)
    if as_json:
        json_out({**result.to_dict(), "recorded": changed})
        return
    print_replay(result, console)
    if changed is not None:
        console.print(f"recorded in {Path(result.bundle) / 'INCIDENT.md'}" if changed
                      else "the same result is already recorded in the bundle; nothing changed", markup=False)


def _replay_window(bundle, entry, trust_bundle_paths, no_record, as_json, console) -> None:
    """`replay --window` (nanscan.runtime.window_rerun NOTE: [window replay])."""
    from nanscan.runtime.localize import fmt_value  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py
    from nanscan.replay.window import record_window_replay, replay_window  # noqa: PLC0415

    with cli_errors():
        with console.status("rerunning the window"):
            result = replay_window(bundle, entry, trust_bundle_paths=trust_bundle_paths)
        changed = None if no_record else record_window_replay(result)
    if as_json:
        json_out({**result.to_dict(), "recorded": changed})
        return
    console.print(result.headline(), highlight=False, markup=False)
    console.print(result.departure_text(), highlight=False, markup=False)
    for s in result.steps:
        console.print(f"  step {s.step}: loss {fmt_value(s.loss)} (recorded {fmt_value(s.recorded_loss)}), grad "
                      f"norm {fmt_value(s.grad_norm)} (recorded {fmt_value(s.recorded_grad_norm)})"
                      f"{'  <- departs' if s.departs else ''}{'' if s.finite else '  <- non-finite'}",
                      highlight=False, markup=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    if changed is not None:
        console.print(f"recorded in {Path(result.bundle) / 'INCIDENT.md'}" if changed
                      else "the same result is already recorded in the bundle; nothing changed", markup=False)


@click.command("export-regression")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest", type=click.Path(path_type=Path))
@entry_options
@click.option("--samples", default=None, help="Comma-separated sample rows to export (default: the smallest "
                                              "failing subset from replay, or a fresh bisection).")
@click.option("--with-state/--no-state", default=None,
              help=f"Store the model and optimizer state (default: when at most {DEFAULT_MAX_STATE_MB} MB).")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export of this case that differs from this one.")
@click.option("--xfail", is_flag=True, help="Mark the test xfail(strict=True): it can be committed before the fix, "
                                            "and fails (XPASS) once the step is finite, to remove the mark.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def export_regression_command(bundle, dest, entry, trust_bundle_paths, samples, with_state, overwrite, xfail, as_json):
    """Write BUNDLE's minimal failing sample(s) to DEST as a regression case and a pytest file."""
    rows = None
    if samples:
        try:
            rows = [int(s) for s in samples.split(",") if s.strip()]
        except ValueError:
            raise click.BadParameter(f"{samples!r} is not a comma-separated list of row numbers",
                                     param_hint="--samples") from None
    from nanscan.replay.export import export_regression  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    with cli_errors():
        result = export_regression(bundle, dest, entry, samples=rows, with_state=with_state, overwrite=overwrite,
                                   xfail=xfail, trust_bundle_paths=trust_bundle_paths)
    if as_json:
        json_out(result.to_dict())
        return
    click.echo(f"regression case: {result.case_dir}")
    click.echo(f"pytest file:     {result.test_file}")
    shown = result.sample_ids if result.sample_ids is not None else result.indices
    now = "fails now" if result.reproduced else ("fails now with an error" if result.error else "passes now")
    click.echo(f"samples: {shown}; {now} ({'with' if result.with_state else 'without'} the saved state)"
               f"{'' if result.changed else '; the same export was already there, nothing changed'}")
    for note in result.notes:
        click.echo(f"note: {note}")
