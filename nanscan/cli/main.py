"""The `nanscan` command line: one program whose subcommands follow the workflow (detect, preserve, localize,
change one factor, check the data). Subcommands live beside the code they drive and are imported only when run;
what they all share is nanscan.cli.errors, and no module of the package imports this one (`python -m nanscan` aside).
"""

from __future__ import annotations

import ast
import errno
import importlib
import json
import sys
from pathlib import Path

import click

from nanscan.cli.errors import FAILURE, USAGE, CommandFailed, console, os_error_message

# subcommand -> "module:attribute" of a click command
SUBCOMMANDS = {
    "info": "nanscan.cli.main:info",
    "bench": "nanscan.cli.bench:bench_command",
    "demo": "nanscan.cli.demo:demo_command",
    "report": "nanscan.review.report:report_command",
    "note": "nanscan.bundle.cli:note_command",
    "checkpoint": "nanscan.bundle.cli:checkpoint_command",
    "replay": "nanscan.replay.cli:replay_command",
    "ablate": "nanscan.replay.ablate:ablate_command",
    "triage": "nanscan.review.triage:triage_command",
    "export-regression": "nanscan.replay.cli:export_regression_command",
    "data": "nanscan.data.cli:data_command",
    "preflight": "nanscan.cli.preflight:preflight_command",
    "runs": "nanscan.data.cli:runs_command",
    "export": "nanscan.review.export:export_command",
    "quarantine": "nanscan.cli.quarantine:quarantine_command",
}

# NOTE: [fast help]
# `nanscan --help` and `nanscan SUBCOMMAND --help` must answer at once, and torch with the backends takes seconds
# to import. So no help imports torch, for any subcommand:
# - the packages (nanscan, nanscan.bundle, nanscan.replay, nanscan.data) load their public names on first use
#   (nanscan._lazy: module __getattr__, PEP 562), and the others (nanscan.engine, nanscan.runtime, nanscan.review,
#   nanscan.cli) import nothing in their __init__, so importing one of their modules does not import its siblings;
# - the group's help reads each subcommand's one-line summary from its module's source (command_summary) instead
#   of importing the module;
# - the module of a subcommand (SUBCOMMANDS) imports only light modules at its top: click, and the names and
#   formats nanscan's tools share (nanscan.cli.errors, nanscan.bundle.format, nanscan.replay.options,
#   nanscan.data.findings). What needs torch it imports inside the function that uses it (report, export, ablate,
#   triage, the replay commands; so do nanscan.bundle.load_bundle and nanscan.cli.errors for its error types);
# - a tool that needs torch by its nature (a model, torch dtypes, tensors at module level) keeps its work in its
#   own module and its subcommand in a light one, which imports the tool inside the command: cli.py in the
#   tool's package (nanscan.replay.cli), a module of nanscan/cli/ named like a single-module tool (nanscan.cli.demo
#   for nanscan.demo, nanscan.cli.preflight, nanscan.cli.bench for nanscan.bench_scan);
# - what such a tool and its subcommand both need (an option's default, bench's argparse parser) lives in a light
#   module below both, options.py in a package and nanscan/cli/X_options.py for a single module
#   (nanscan.replay.options, nanscan.cli.preflight_options, nanscan.cli.bench_options): the tool never imports its
#   subcommand's module.
# tests/test_cli_help.py runs the group's help and every subcommand's, each in a fresh interpreter, and checks that
# none imports torch.


def command_summary(target: str, limit: int = 45) -> str | None:
    """The short help of the click command at "module:function", read from the module's source without importing
    it (NOTE: [fast help]); None when the source or the function's docstring cannot be found."""
    module, attr = target.split(":")
    # Found by path: importlib's find_spec would import the parent packages, which a summary need not pay for.
    base = Path(__file__).resolve().parents[2].joinpath(*module.split("."))  # the directory above nanscan/
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            break
    else:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            doc = ast.get_docstring(node)
            # shortened as click shortens a command's own help
            return click.Command(attr, help=doc).get_short_help_str(limit) if doc else None
    return None


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def format_commands(self, ctx, formatter):
        """The subcommands and their one-line summaries, without importing them (NOTE: [fast help])."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))  # click's own spacing
        rows = []
        for name in names:
            summary = command_summary(SUBCOMMANDS[name], limit)
            if summary is None:  # not found in the source: ask the command itself
                command = self.get_command(ctx, name)
                summary = command.get_short_help_str(limit) if command else ""
            rows.append((name, summary))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx, name):
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx):
        """Run the subcommand; a file that cannot be read or written, or a backend that cannot run, ends it with
        a one-line message and an exit status instead of a traceback from deep inside (any subcommand can meet
        them: a bundle someone else wrote, a full disk, NANSCAN_BACKEND left set)."""
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise  # click's own handling: the reader of stdout went away (`| head`)
            raise CommandFailed(os_error_message(exc)) from None
        except Exception as exc:
            # Looked up, not imported: if the error is a BackendUnavailable, nanscan.engine.backends is loaded already.
            backends = sys.modules.get("nanscan.engine.backends")
            if backends is None or not isinstance(exc, backends.BackendUnavailable):
                raise
            requested = backends.requested_name(None)
            unknown = requested is not None and requested not in backends.BACKEND_NAMES
            raise CommandFailed(str(exc), USAGE if unknown else FAILURE) from None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nanscan")
def main():
    """nanscan: catch the first NaN/inf in training, keep the evidence, and find its cause.

    New here? `nanscan demo` runs the whole workflow on a tiny model in seconds; `nanscan info` says which
    backend scans your tensors.

    Exit status: 0 done; 1 a check failed or the command could not finish (data findings, a NO-GO from
    preflight, problems in run records, a demo that did not go as designed, a file that could not be read or
    written, a backend that cannot run here); 2 a usage error (a missing or wrong argument, a path that does not
    exist, an unknown NANSCAN_BACKEND). Besides: `nanscan data` exits 3 when an input could not be read through,
    and `nanscan report` exits 2 when the bundle cannot be read.
    """


def build_line(build: dict) -> str:
    """The build line of `nanscan info`: build_info()'s "cuda" (compiled, the key --json keeps) shown as
    cuda_compiled with what it means here, so that a CPU-only torch does not read as CUDA."""
    import torch  # noqa: PLC0415 - info has imported it with the backends already

    from nanscan.engine.backends import cuda_build_note  # noqa: PLC0415

    if "cuda" not in build:  # the extension did not load: its error
        return f"build: {build}"
    compiled = bool(build["cuda"])
    note = cuda_build_note(compiled, torch.version.cuda, torch.cuda.is_available())
    rest = "".join(f", {key}: {value}" for key, value in build.items() if key != "cuda")
    return f"build: cuda_compiled: {compiled} ({note}){rest}"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info(as_json):
    """Show which backends are built and which one scans each device.

    Exits 0 when NANSCAN_BACKEND is unset, auto or a backend that runs here, 1 when it names one that cannot run
    here, 2 when it names no backend at all.
    """
    from nanscan.engine.backends import BACKEND_NAMES, ENV_VAR, backend_info

    data = backend_info()
    requested = data.get("requested")
    if requested is None:
        status = 0
    elif requested not in BACKEND_NAMES:
        status = USAGE
    else:
        status = 0 if data["backends"][requested]["available"] else FAILURE
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="nanscan backends")
        table.add_column("backend")
        table.add_column("available")
        table.add_column("detail", overflow="fold")  # an import error is the one clue to a missing backend
        for name, entry in data["backends"].items():
            table.add_row(name, "yes" if entry["available"] else "no", escape(entry.get("error", "")))
        out = console()
        out.print(table)
        chosen_by = f"set by {ENV_VAR}={requested}" if requested is not None else "auto: the best available"
        for device, name in data["active"].items():
            if name in BACKEND_NAMES:
                out.print(f"active on {device}: [bold]{escape(name)}[/bold] ({escape(chosen_by)})")
            else:  # the reason, which says what to do, on one line however narrow the terminal
                out.print(f"active on {device}: none: {name.removeprefix('error: ')}", markup=False,
                              highlight=False, soft_wrap=True)
        out.print(build_line(data["build"]), markup=False, highlight=False, soft_wrap=True)
        out.print(f"plan checks read tensors {data['tensor_reads']}", markup=False)
    if status:
        raise SystemExit(status)
