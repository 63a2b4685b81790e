"""The `nanscan` command line: one program whose subcommands follow the workflow (detect, preserve, localize,
change one factor, check the data). Subcommands live beside the code they drive and are imported only when run,
so `nanscan --help` starts without loading torch.
"""

from __future__ import annotations

import importlib
import json

import click

# subcommand -> "module:attribute" of a click command
SUBCOMMANDS = {
    "info": "nanscan.cli:info",
    "bench": "nanscan.cli:bench",
    "demo": "nanscan.demo:demo_command",
    "report": "nanscan.report:report_command",
    "note": "nanscan.bundle:note_command",
    "replay": "nanscan.replay:replay_command",
    "ablate": "nanscan.ablate:ablate_command",
    "triage": "nanscan.triage:triage_command",
    "export-regression": "nanscan.replay:export_regression_command",
    "data": "nanscan.data.cli:data_command",
    "preflight": "nanscan.preflight:preflight_command",
    "runs": "nanscan.data.cli:runs_command",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx, name):
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nanscan")
def main():
    """nanscan: catch the first NaN/inf in training, keep the evidence, and find its cause."""


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info(as_json):
    """Show which backends are built and which one scans each device."""
    from nanscan.backends import backend_info

    data = backend_info()
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="nanscan backends")
    table.add_column("backend")
    table.add_column("available")
    table.add_column("detail")
    for name, entry in data["backends"].items():
        table.add_row(name, "yes" if entry["available"] else "no", entry.get("error", ""))
    console = Console()
    console.print(table)
    for device, name in data["active"].items():
        console.print(f"active on {device}: [bold]{name}[/bold]")
    console.print(f"build: {data['build']}")


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False)
@click.pass_context
def bench(ctx):
    """Run the scan benchmark (benchmarks/bench_scan.py); extra arguments are passed through."""
    from nanscan import bench_scan

    raise SystemExit(bench_scan.main(ctx.args))
