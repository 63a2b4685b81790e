"""`nanscan bench` on the command line: the scan benchmark's arguments go to its own parser (argparse, in
nanscan.cli.bench_options), and the benchmark (nanscan.bench_scan, which imports torch) is imported only once they
parse, so that `nanscan bench --help` answers at once (NOTE: [fast help] in nanscan/cli/main.py).
"""

from __future__ import annotations

import click

from nanscan.cli.bench_options import parse_args


@click.command("bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               add_help_option=False)
@click.pass_context
def bench_command(ctx):
    """Run the scan benchmark (benchmarks/bench_scan.py); extra arguments are passed through."""
    args = parse_args(ctx.args)  # --help and a wrong argument end here, before torch is imported
    from nanscan import bench_scan  # noqa: PLC0415 - NOTE: [fast help] in nanscan/cli/main.py

    raise SystemExit(bench_scan.run(args))
