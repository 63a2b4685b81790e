"""`nanscan demo` on the command line: the subcommand and what it prints. The demo itself (nanscan.demo: a torch
model, its data and the ordered stages) is imported when the command runs, so that `nanscan demo --help` does not
import torch (NOTE: [fast help] in nanscan/cli/main.py).
"""

from __future__ import annotations

import json
import shlex

import click


def diverging_command(out_dir: str, as_json: bool) -> None:
    """`nanscan demo --diverging`: run_diverging, then the spike bundle's report."""
    from rich.console import Console  # noqa: PLC0415

    from nanscan.bundle import load_bundle  # noqa: PLC0415
    from nanscan.demo import run_diverging  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py
    from nanscan.review.summary import summarize  # noqa: PLC0415
    from nanscan.review.terminal import render_terminal  # noqa: PLC0415

    console = Console(stderr=as_json)
    result = run_diverging(out_dir, echo=lambda line: console.print(line, markup=False, highlight=False,
                                                                    soft_wrap=True))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    elif result.spike_bundle is not None:
        console.print()
        render_terminal(summarize(load_bundle(result.spike_bundle)), console)
        lead = (f", {result.first_invalid_step - result.first_warning_step} steps before the first non-finite step "
                f"{result.first_invalid_step}" if result.first_invalid_step is not None else "")
        console.print(f"\nwarned at step {result.first_warning_step}{lead}", highlight=False)
        console.print(f"next:   {shlex.join(['nanscan', 'report', result.spike_bundle, '--html', 'spike.html'])}",
                      markup=False, highlight=False, soft_wrap=True)
    if not result.ok:
        click.echo("nanscan demo --diverging: the divergence was not warned about 5 or more steps before its first "
                   "non-finite step", err=True)
        raise SystemExit(1)


@click.command("demo")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="nanscan-demo", show_default=True,
              help="Directory for the dataset, its config, the training log and the bundle.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the result as JSON instead of the report (the stage lines go to stderr).")
@click.option("--diverging", is_flag=True,
              help="Run the diverging demo instead: an endless learning-rate warm-up, warned about by a spike long "
                   "before the NaN.")
def demo_command(out_dir, as_json, diverging):
    """Train a tiny language model on data with one corrupted record: catch the first non-finite step, keep the
    evidence as a bundle, then replay it, change one factor at a time and check the data to find the cause.

    Takes about ten seconds on two CPU cores. A rerun into the same --out directory writes the same bytes; a
    directory holding files the demo did not write (such as a data/train.jsonl of your own) is refused, not
    overwritten.

    Exits 0 when every stage went as designed (the fault caught at its step and traced to the corrupted record),
    1 when one did not, 2 on a usage error such as an --out directory that cannot be used.
    """
    if diverging:
        diverging_command(out_dir, as_json)
        return
    from rich.text import Text  # noqa: PLC0415

    from nanscan import demo  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py
    from nanscan.cli.errors import console as cli_console  # noqa: PLC0415
    from nanscan.review.terminal import render_terminal  # noqa: PLC0415

    console = cli_console(stderr=as_json)
    # soft_wrap: each stage line and each path stays one line, so it can be copied and grepped at any width
    try:
        result = demo.run_demo(out_dir, echo=lambda line: console.print(line, markup=False, highlight=False,
                                                                        soft_wrap=True))
    except demo.DemoOutputError as exc:
        raise click.BadParameter(str(exc), param_hint="'--out'") from None
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str, allow_nan=False))
    else:
        if result.summary is not None:
            console.print()
            render_terminal(result.summary, console)
        if result.caught:
            console.print(f"\nplanted fault (the answer key): record {result.planted_record} has every loss weight "
                          f"= {demo.MISSING_SENTINEL:.7g}, the float32 maximum used as a missing-value sentinel")
            console.print(Text.assemble("bundle: ", (result.bundle_path, "bold")), soft_wrap=True)
            next_step = shlex.join(["nanscan", "report", result.bundle_path, "--html", "report.html"])
            console.print(f"next:   {next_step}", markup=False, highlight=False, soft_wrap=True)
    if not result.ok:
        failed = next((s for s in result.stages if not s.ok), None)
        what = "the planted failure was not caught as designed" if not result.caught else \
            "the workflow did not go as designed"
        click.echo(f"nanscan demo: {what}{f' ({failed.name}: {failed.headline})' if failed else ''}", err=True)
        raise SystemExit(1)
