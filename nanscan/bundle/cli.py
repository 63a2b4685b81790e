"""The bundle's subcommands: `nanscan note`, a reviewer's note added to a bundle's INCIDENT.md, apart from the
automatic findings (`--rebuild` renders the automatic part again from the ledger after a hand edit), and `nanscan
checkpoint`, a bundle's state as a checkpoint a trainer resumes from (nanscan.bundle.checkpoint)."""

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


@click.command("checkpoint")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--step", type=int, default=None, help="The window's kept state at this step (default: the failing "
                                                     "step's state).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def checkpoint_command(bundle: Path, out: Path, step: int | None, overwrite: bool, as_json: bool):
    """Write BUNDLE's state as a torch.distributed.checkpoint directory OUT that any number of ranks load.

    A bundle set's shards are joined first; the model and optimizer state are keyed as get_state_dict names them
    ("model", "optimizer"), with the RNG state and nanscan_resume.json (the step it begins, learning rates, sample
    ids) beside them."""
    import json  # noqa: PLC0415

    from nanscan.bundle.checkpoint import write_checkpoint  # noqa: PLC0415 - torch: NOTE: [fast help]

    try:
        written = write_checkpoint(load_bundle(bundle), out, step=step, overwrite=overwrite)
    except (BundleError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(written.to_dict(), indent=2))
        return
    state = "the pre-step state" if written.pre_step else "the state"
    click.echo(f"wrote {written.path}: {state} of step {written.step} ({', '.join(written.keys)}), from "
               f"{written.bundle}; load it with torch.distributed.checkpoint.load on any number of ranks")
    for note in written.notes:
        click.echo(f"note: {note}")
