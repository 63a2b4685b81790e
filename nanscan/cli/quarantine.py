"""`nanscan quarantine list | add | release`: the records kept out of the next runs, in the bundle directory's
quarantine file (nanscan.bundle.quarantine NOTE: [quarantine file]); the runs skip them through
nanscan.skip_quarantined (nanscan.data.quarantine NOTE: [quarantine match]).

Light at its top (NOTE: [fast help] in nanscan/cli/main.py): the bundle and its batch, which need torch, are read
inside the command, and only for `add --from BUNDLE`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import click

from nanscan.bundle.format import REPLAY_FINDING, BundleError
from nanscan.bundle.quarantine import (NamedRecord, Quarantine, QuarantinedRecord, QuarantineError, add_records,
                                       read_quarantine, release_records, shown_path)
from nanscan.cli.errors import CommandFailed, json_out

ACTIONS = ("list", "add", "release")


def default_bundle_dir() -> Path:
    """The Monitor's own default: $NANSCAN_BUNDLE_DIR, else nanscan-bundles."""
    from nanscan.runtime.monitor import BUNDLE_DIR_ENV, DEFAULT_BUNDLE_DIR  # noqa: PLC0415 - NOTE: [fast help]

    return Path(os.environ.get(BUNDLE_DIR_ENV) or DEFAULT_BUNDLE_DIR)


def _bundle_root(bundle) -> Path:
    """The bundle directory a bundle was written into: <bundle_dir>/<run_id>/step-<N>[/rank-<r>]."""
    step_dir = getattr(bundle, "set_path", None) or bundle.path
    return Path(step_dir).parent.parent


def named_by_bundle(path: Path, bundle_dir: Path | None) -> tuple[list[NamedRecord], str, list[str], Path]:
    """The records the bundle's bisection named (its replay finding), with their sample ids and the digests of
    their rows; a default reason; notes for the user; the bundle directory (`bundle_dir`, else the bundle's own)."""
    from nanscan.bundle import load_bundle  # noqa: PLC0415 - NOTE: [fast help]

    bundle = load_bundle(path)
    bundle_dir = bundle_dir or _bundle_root(bundle)
    replay = next((f for f in bundle.findings() if f.get("key") == REPLAY_FINDING), None)
    if replay is None:
        raise CommandFailed(f"{path} has not been replayed, so no bisection named its samples: run `nanscan replay "
                            f"{path}` first (its bisection names the fewest samples that still fail)")
    found = (replay.get("record") or {}).get("bisect")
    if not isinstance(found, dict):
        raise CommandFailed(f"{path} was replayed without a bisection: run `nanscan replay {path}` again without "
                            "--no-bisect")
    verdict = found.get("verdict") if isinstance(found.get("verdict"), str) else ""
    rows = found.get("indices")
    if not found.get("applicable") or found.get("rest_passes") is False or not rows:
        raise CommandFailed(f"the bisection of {path} named no sample ({verdict or 'not applicable'}): nothing to "
                            "quarantine")
    if not isinstance(rows, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in rows):
        raise BundleError(f"{path}: the replay finding's bisection names rows {rows!r}, not row numbers; the ledger "
                          "was edited, run `nanscan replay` again on an untouched copy")
    ids = found.get("sample_ids")
    ids = ids if isinstance(ids, list) and len(ids) == len(rows) else [None] * len(rows)
    size = found.get("batch_size") if isinstance(found.get("batch_size"), int) else None
    from nanscan.engine.record_digest import row_digests  # noqa: PLC0415 - NOTE: [fast help]

    digests, why = row_digests(bundle.batch(nested=True), rows, size)
    notes = [] if digests is not None else [f"no digest taken from {path}: {why}; its records are quarantined by "
                                            "sample id only"]
    named, where = [], shown_path(getattr(bundle, "set_path", None) or bundle.path, bundle_dir)
    for k, row in enumerate(rows):
        source = {"bundle": where, "run_id": bundle.manifest.get("run_id"), "step": bundle.step, "row": row}
        digest = (digests[k],) if digests is not None else ()
        try:
            named.append(NamedRecord(ids[k], digest, source))
        except ValueError:
            raise CommandFailed(f"the bisection of {path} named row {row}, but the bundle has no sample id for it "
                                f"and {why}: nothing names the record; pass sample_ids= to Monitor.check so bundles "
                                "name their records") from None
    reason = f"named by the bisection of {where} (step {bundle.step}, category {bundle.category})" + \
        (f": {verdict}" if verdict else "")
    return named, reason, notes, bundle_dir


def named_by_data(path: Path, bundle_dir: Path, categories: tuple[str, ...]) -> tuple[list[NamedRecord], str,
                                                                                      list[str]]:
    """The records a `nanscan data --json` report (or a DataReport.to_dict() written as JSON) named in `categories`
    (default: the categories that failed its check), one per record however many findings it has."""
    try:
        report = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise CommandFailed(f"{path} is not a JSON data report ({exc}): write one with `nanscan data ... --json > "
                            f"{path.name}`") from None
    findings = report.get("findings") if isinstance(report, dict) else None
    if not isinstance(findings, list) or not all(isinstance(f, dict) for f in findings):
        raise CommandFailed(f"{path} has no list of findings: it is not a `nanscan data --json` report")
    wanted = set(categories or report.get("fail_on") or ())
    if not wanted:
        from nanscan.data.findings import DEFAULT_FAIL_ON  # noqa: PLC0415

        wanted = set(DEFAULT_FAIL_ON)
    grouped: dict[tuple, dict] = {}
    for f in findings:
        if f.get("category") not in wanted or (f.get("line") is None and f.get("index") is None):
            continue  # a category not asked for, or a whole input that could not be read (not a record)
        where = (f.get("file"), f.get("line"), f.get("index"), f.get("member"))
        entry = grouped.setdefault(where, {"record": f.get("record"), "sample_id": f.get("sample_id"),
                                           "sha256": f.get("sha256"), "findings": []})
        field = f" in field {f['field']!r}" if f.get("field") else ""
        entry["findings"].append(f"{f.get('category')}{field}: {f.get('detail')}")
    shown = shown_path(path, bundle_dir)
    named, nameless, by_bytes = [], [], 0
    for (_file, line, _index, _member), entry in grouped.items():
        source = {"data_report": shown, "record": entry["record"], "findings": entry["findings"]}
        digest = (entry["sha256"],) if isinstance(entry["sha256"], str) else ()
        try:
            named.append(NamedRecord(entry["sample_id"], digest, source))
        except ValueError:
            nameless.append(str(entry["record"]))
            continue
        by_bytes += entry["sample_id"] is None and line is not None
    if not named:
        raise CommandFailed(f"{path} names no record in {', '.join(sorted(wanted))}" +
                            (f" that has a sample id or a digest ({', '.join(nameless[:5])})" if nameless else "") +
                            ": nothing to quarantine")
    notes = [f"{len(nameless)} record(s) named without a sample id or a digest were left out: "
             f"{', '.join(nameless[:5])}"] if nameless else []
    if by_bytes:
        notes.append(f"{by_bytes} record(s) of text files have no sample id: their digest covers the line as stored, "
                     "which a dataset hands over parsed, so the next run cannot match them; run `nanscan data "
                     "--id-field FIELD` and add from that report")
    reason = f"named by nanscan data ({', '.join(sorted(wanted))}) in {shown}"
    return named, reason, notes


def _digest_text(record: QuarantinedRecord) -> str:
    if not record.sha256:
        return "no digest"
    more = f" +{len(record.sha256) - 1}" if len(record.sha256) > 1 else ""
    return f"sha256:{record.sha256[0][:16]}{more}"


def _name(record: QuarantinedRecord) -> str:
    return record.id if record.id is not None else f"sha256:{record.sha256[0][:16]}"


def _source_text(source: dict) -> str:
    if "bundle" in source:
        return f"{source['bundle']} row {source.get('row')}"
    if "data_report" in source:
        return f"{source['data_report']}: {source.get('record')}"
    return "by hand"


def _list_lines(quarantine: Quarantine, show_all: bool) -> list[str]:
    if not quarantine.exists:
        return [f"no quarantine file at {quarantine.path}: no record is quarantined"]
    shown = quarantine.records if show_all else quarantine.active()
    released = len(quarantine.records) - len(quarantine.active())
    lines = [f"{quarantine.path}: {len(quarantine.active())} quarantined, {released} released"
             + ("" if show_all or not released else " (--all lists them)")]
    for record in sorted(shown, key=lambda r: r.key):
        adds = [e for e in record.history if e["event"] == "added"]
        lines.append(f"  {record.status:<11} {_name(record)}  {_digest_text(record)}  since {adds[-1]['at']}"
                     f" by {adds[-1].get('by') or 'anonymous'}")
        lines.append(f"      reason: {record.reason}")
        lines += [f"      named by: {_source_text(e.get('source') or {})}" for e in adds]
        for event in record.history:
            if event.get("note"):
                lines.append(f"      note ({event['event']} {event['at']}): {event['note']}")
        if not record.quarantined:
            last = record.history[-1]
            lines.append(f"      released {last['at']} by {last.get('by') or 'anonymous'}")
    return lines


@click.command("quarantine")
@click.argument("action", type=click.Choice(ACTIONS))
@click.argument("names", nargs=-1, metavar="[ID]...")
@click.option("--bundle-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The directory the Monitor writes its bundles into, which holds quarantine.json (default: the "
                   "bundle's own with --from, else $NANSCAN_BUNDLE_DIR, else nanscan-bundles).")
@click.option("--from", "from_bundle", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              metavar="BUNDLE", help="add: the records the bundle's bisection named (run `nanscan replay` first), "
                                     "by sample id and the digest of their rows.")
@click.option("--from-data", "from_data", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              metavar="REPORT", help="add: the records a `nanscan data --json` report named, by sample id "
                                     "(--id-field) and digest.")
@click.option("--category", "categories", multiple=True,
              help="add --from-data: only findings of this category (repeatable; default: those that failed the "
                   "check).")
@click.option("--digest", "digests", multiple=True, metavar="SHA256",
              help="add: a record by its sha256 digest (repeatable), besides or instead of IDs.")
@click.option("--reason", default=None, help="Why the records are kept out (required with IDs or --digest).")
@click.option("--note", default=None, help="A reviewer's note, recorded with the add or the release.")
@click.option("--author", default=None, help="Who adds or releases (default: the login name).")
@click.option("--all", "show_all", is_flag=True, help="list: released records too.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def quarantine_command(action, names, bundle_dir, from_bundle, from_data, categories, digests, reason, note, author,
                       show_all, as_json):
    """Keep the records a bisection or a data check named out of the next runs: list, add, release.

    The quarantine is quarantine.json in the bundle directory: each record's sample id and digests, and its
    history (who added or released it, when, why, from which bundle or report, with reviewers' notes). The next
    run skips them with nanscan.skip_quarantined(dataset, BUNDLE_DIR).

    \b
    list                      the quarantined records (--all: released ones too)
    add ID... --reason TEXT   records by sample id (--digest SHA256: by digest)
    add --from BUNDLE         what the bundle's bisection named (after `nanscan replay BUNDLE`)
    add --from-data REPORT    what a `nanscan data --json` report named
    release ID...             let records back in (an ID, or sha256:DIGEST); the release is recorded

    The same add twice changes nothing. Exit status: 0 done, 1 the file cannot be read (it is never written over
    then), a bundle or report that names nothing, or an unknown ID; 2 a usage error.
    """
    if author is None:
        import getpass  # noqa: PLC0415

        with contextlib.suppress(Exception):
            author = getpass.getuser()
    try:
        if action == "list":
            _refuse(action, names=names, from_bundle=from_bundle, from_data=from_data, digests=digests,
                    reason=reason, note=note, categories=categories)
            quarantine = read_quarantine(bundle_dir or default_bundle_dir())
            if as_json:
                records = quarantine.records if show_all else quarantine.active()
                json_out({"path": str(quarantine.path), "exists": quarantine.exists,
                          "records": [r.to_dict() for r in sorted(records, key=lambda r: r.key)]})
            else:
                click.echo("\n".join(_list_lines(quarantine, show_all)))
        elif action == "add":
            _add(names, bundle_dir, from_bundle, from_data, categories, digests, reason, note, author, show_all,
                 as_json)
        else:
            _refuse(action, from_bundle=from_bundle, from_data=from_data, digests=digests, reason=reason,
                    categories=categories, show_all=show_all)
            if not names:
                raise click.UsageError("release: name the records to let back in (sample ids, or sha256:DIGEST)")
            quarantine, result = release_records(bundle_dir or default_bundle_dir(), names, note=note, by=author)
            if as_json:
                json_out({"path": str(quarantine.path), "released": [_name(r) for r in result.released],
                          "already_released": [_name(r) for r in result.already]})
            else:
                if result.released:
                    click.echo(f"released {len(result.released)} record(s) from {quarantine.path}: "
                               f"{', '.join(_name(r) for r in result.released)}; the next runs read them again")
                if result.already:
                    click.echo(f"already released, nothing changed: {', '.join(_name(r) for r in result.already)}")
    except (QuarantineError, BundleError, ValueError) as exc:
        raise CommandFailed(str(exc)) from None


def _refuse(action: str, **given) -> None:
    """A usage error for an option `action` does not take."""
    flags = {"names": "ID arguments", "from_bundle": "--from", "from_data": "--from-data", "digests": "--digest",
             "reason": "--reason", "note": "--note", "categories": "--category", "show_all": "--all"}
    extra = [flags[k] for k, v in given.items() if v]
    if extra:
        raise click.UsageError(f"{action} takes no {', '.join(extra)}")


def _add(names, bundle_dir, from_bundle, from_data, categories, digests, reason, note, author, show_all, as_json):
    _refuse("add", show_all=show_all)
    sources = [s for s, given in (("IDs or --digest", names or digests), ("--from", from_bundle),
                                  ("--from-data", from_data)) if given]
    if len(sources) != 1:
        raise click.UsageError("add: name the records one way: IDs (or --digest) with --reason, --from BUNDLE, or "
                               "--from-data REPORT" + (f" (given: {', '.join(sources)})" if sources else ""))
    if categories and not from_data:
        raise click.UsageError("--category goes with --from-data")
    notes: list[str] = []
    if from_bundle is not None:
        named, default_reason, notes, root = named_by_bundle(from_bundle, bundle_dir)
    elif from_data is not None:
        root = bundle_dir or default_bundle_dir()
        named, default_reason, notes = named_by_data(from_data, root, categories)
    else:
        if not reason:
            raise click.UsageError("add: say why with --reason when naming records by ID or --digest")
        root = bundle_dir or default_bundle_dir()
        named = [NamedRecord(name, (), {"by_hand": True}) for name in names]
        named += [NamedRecord(None, (digest,), {"by_hand": True}) for digest in digests]
        default_reason = ""
    quarantine, result = add_records(root, named, reason=reason or default_reason, note=note, by=author)
    for line in notes:
        click.echo(f"note: {line}", err=True)
    if as_json:
        json_out({"path": str(quarantine.path), "added": [_name(r) for r in result.added],
                  "added_again": [_name(r) for r in result.again], "unchanged": [_name(r) for r in result.unchanged]})
        return
    if result.added:
        click.echo(f"quarantined {len(result.added)} record(s) in {quarantine.path}: "
                   f"{', '.join(f'{_name(r)} ({_digest_text(r)})' for r in result.added)}")
    if result.again:
        click.echo(f"added again (a new source, or after a release): {', '.join(_name(r) for r in result.again)}")
    if result.unchanged:
        click.echo(f"already quarantined by the same add, nothing changed: "
                   f"{', '.join(_name(r) for r in result.unchanged)}")
