"""`nanscan note`: a reviewer's note added to a bundle's INCIDENT.md, apart from the automatic findings."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from nanscan.bundle import load_bundle
from nanscan.bundle.format import INCIDENT, BundleError


@click.command("note")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("text")
@click.option("--author", default=None, help="Who writes the note (default: the login name).")
def note_command(bundle: Path, text: str, author: str | None):
    """Add a reviewer note to BUNDLE's INCIDENT.md (under "Reviewer notes")."""
    if author is None:
        import getpass  # noqa: PLC0415

        with contextlib.suppress(Exception):
            author = getpass.getuser()
    try:
        opened = load_bundle(bundle)
        added = opened.add_note(text, author=author)
    except (BundleError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    where = opened.path / INCIDENT
    click.echo(f"note added to {where}" if added else f"the same note is already in {where}; nothing changed")
