"""What the subcommands share: JSON output, one way of turning expected errors into a one-line message and an
exit status, and the options of every command that rebuilds a bundle's step (--entry, --trust-bundle-paths)."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

import click

from nanscan.bundle import BundleError, plain_json


def entry_options(command):
    """--entry and --trust-bundle-paths, for replay, ablate and export-regression (NOTE: [trust rule] in
    nanscan/entry.py)."""
    command = click.option(
        "--trust-bundle-paths", is_flag=True,
        help="Also import the entry and model classes from the directories the bundle records (the run's working "
             "and script directories). Only for bundles you trust.")(command)
    return click.option(
        "--entry", default=None,
        help="Replay entry package.module:function, your choice (default: the bundle's, called only if marked "
             "with @nanscan.entry.replay_entry).")(command)


def json_out(data: Any) -> None:
    click.echo(json.dumps(plain_json(data), indent=2, allow_nan=False))


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn nanscan's own errors into one-line command-line messages (no traceback)."""
    # Imported here: both modules import torch, which no subcommand's --help may pay for (NOTE: [fast help] in
    # nanscan/cli/main.py); a command that enters this block is about to replay a step or read bundles.
    from nanscan.entry import EntryError  # noqa: PLC0415
    from nanscan.replay.step import ReplayError  # noqa: PLC0415

    try:
        yield
    except EntryError as exc:
        # a wrong or unimportable --entry (or the bundle's) is a usage error: exit 2, as `nanscan --help` says
        raise click.UsageError(str(exc)) from None
    except (BundleError, ReplayError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
