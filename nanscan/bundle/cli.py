"""`nanscan note`: a reviewer's note added to a bundle's INCIDENT.md, apart from the automatic findings, and
`--rebuild` to render the automatic part again from the ledger after a hand edit."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from nanscan.bundle import load_bundle
from nanscan.bundle.format import INCIDENT, BundleError


@click.command("note")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("text", required=False)
@click.option("--author", default=None, help="Who writes the note (default: the login name).")
@click.option("--rebuild", is_flag=True, help="Render INCIDENT.md's automatic findings again from the ledger; hand "
                                              "edits there are kept, quoted, under \"Reviewer notes\".")
def note_command(bundle: Path, text: str | None, author: str | None, rebuild: bool):
    """Add a reviewer note to BUNDLE's INCIDENT.md (under "Reviewer notes"), or with --rebuild render its
    automatic part again. Text typed by hand under "Reviewer notes" is kept either way."""
    if text is None and not rebuild:
        raise click.UsageError("give the note's TEXT, or --rebuild to render the automatic findings again")
    if author is None:
        import getpass  # noqa: PLC0415

        with contextlib.suppress(Exception):
            author = getpass.getuser()
    try:
        opened = load_bundle(bundle)
        edited = opened.note_review().edited
        rebuilt = opened.rebuild_note() if rebuild else False
        added = opened.add_note(text, author=author) if text is not None else None
    except (BundleError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    where = opened.path / INCIDENT
    if rebuild:
        kept = f"; the hand edit of {', '.join(edited)} is kept under \"Reviewer notes\"" if edited else ""
        click.echo(f"rebuilt the automatic findings of {where}{kept}" if rebuilt
                   else f"{where} already matches its ledger; nothing changed")
    if added is not None:
        click.echo(f"note added to {where}" if added else f"the same note is already in {where}; nothing changed")
