"""What every subcommand shares: the exit statuses, the console it prints with, one way of turning expected errors
into a one-line message and an exit status, JSON output, and the options of every command that rebuilds a bundle's
step (--entry, --trust-bundle-paths). Light (nothing at its top imports torch; NOTE: [fast help] in
nanscan/cli/main.py): the subcommands beside the tools import it, and it imports none of them."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from typing import Any, Iterator

import click

from nanscan.bundle import BundleError, plain_json

# Exit statuses shared by every subcommand (documented in `nanscan --help`).
FAILURE, USAGE = 1, 2


# How wide rich may print when the output is not a terminal (a pipe, a file, a test capturing it): rich's default
# there is 80 columns, which folds tensor names onto two lines (`input:weigh` / `ts`). Tables still take only the
# width of their content, so this only lifts the limit.
PIPED_WIDTH = 4096


def console(*, stderr: bool = False):
    """The rich Console a subcommand prints with: the terminal's width on a terminal, else (unless COLUMNS says
    otherwise) wide enough that no table row or tensor name is folded."""
    from rich.console import Console  # noqa: PLC0415 - NOTE: [fast help]

    out = Console(stderr=stderr)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, width=PIPED_WIDTH)
    return out


class CommandFailed(click.ClickException):
    """A one-line `Error: ...` on stderr and the given exit status."""

    def __init__(self, message: str, exit_code: int = FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


def os_error_message(exc: OSError) -> str:
    """What went wrong with which path, and what to do about it."""
    path = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None) or "a file"
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = "check its owner and permissions, or point nanscan at a copy or a directory you may use"
    elif exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        advice = "free some space there, or write somewhere else"
    else:
        advice = "check that the path is right and usable"
    return f"cannot use {path}: {reason}; {advice}"


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
