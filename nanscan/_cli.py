"""What the subcommands share: JSON output and one way of turning expected errors into a one-line message and an
exit status."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

import click

from nanscan.bundle import BundleError, plain_json
from nanscan.entry import EntryError
from nanscan.replay.step import ReplayError


def json_out(data: Any) -> None:
    click.echo(json.dumps(plain_json(data), indent=2, allow_nan=False))


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn nanscan's own errors into one-line command-line messages (no traceback)."""
    try:
        yield
    except (BundleError, EntryError, ReplayError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
