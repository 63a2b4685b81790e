"""What the subcommands share: JSON output and one way of turning expected errors into a one-line message and an
exit status."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

import click

from nanscan.bundle import BundleError, plain_json


def json_out(data: Any) -> None:
    click.echo(json.dumps(plain_json(data), indent=2, allow_nan=False))


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn nanscan's own errors into one-line command-line messages (no traceback)."""
    # Imported here: both modules import torch, which no subcommand's --help may pay for (NOTE: [fast help] in
    # nanscan/cli.py); a command that enters this block is about to replay a step or read bundles.
    from nanscan.entry import EntryError  # noqa: PLC0415
    from nanscan.replay.step import ReplayError  # noqa: PLC0415

    try:
        yield
    except EntryError as exc:
        # a wrong or unimportable --entry (or the bundle's) is a usage error: exit 2, as `nanscan --help` says
        raise click.UsageError(str(exc)) from None
    except (BundleError, ReplayError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
