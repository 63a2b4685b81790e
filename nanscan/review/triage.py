"""`nanscan triage DIR`: every bundle under DIR grouped by failure category and then by first bad module (from the
replay or ablation findings when those ran, else the Monitor's in-process rerun), with what a rollback at it did,
and counts, so incidents are reviewed by kind and not as one blended
number. A distributed incident (a bundle set: one part per rank) counts once, as its first bad rank's part, and so
do copies of one incident (same run, step and detection time). Spike bundles (category "spike": early warnings,
every value finite) are listed apart, not counted as incidents. Unreadable bundles are listed separately with the
reason; a hand-edited INCIDENT.md is not unreadable (its edited automatic sections are named). Incidents are also
counted by the host and device of their first bad rank (a replica mismatch's odd rank: nanscan.runtime.distributed
NOTE: [replica agreement]), so a machine that keeps appearing across runs stands out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import click

from nanscan._atomic import is_temp_name
from nanscan.cli.errors import cli_errors, json_out
from nanscan.bundle import BundleError, load_bundle
from nanscan.bundle.findings import NOT_REPLAYED, first_bad_module
from nanscan.bundle.format import INDEX, MANIFEST, PENDING_PREFIX, ROLLBACK_FINDING
from nanscan.incident import REPLAY_VERDICT_WORDS, SPIKE


@dataclass
class TriageEntry:
    path: str
    run_id: str
    step: int
    category: str
    module: str  # first bad module as "name (Type, phase)", or NOT_REPLAYED
    source: str  # which finding named the module: "replay", "ablate:baseline" or ""
    verdict: str | None  # the replay record's key (nanscan.incident.REPLAY_VERDICT_WORDS), when replay ran
    detected_at: str | None
    first_bad_ranks: list[int] | None = None  # a distributed incident's first bad rank(s); None for one process
    world_size: int | None = None
    copies: list[str] = field(default_factory=list)  # other directories holding the same incident, not counted
    note_edited: list[str] = field(default_factory=list)  # INCIDENT.md's automatic sections edited by hand
    rollback: str | None = None  # what the Monitor's rollback at this incident did (nanscan.runtime.rollback)
    host: str | None = None  # where the first bad rank ran (a single process: its host), None where not recorded
    device: str | None = None  # its device (nanscan.bundle.rank_set.device_label), None where not recorded

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TriageResult:
    root: str
    entries: list[TriageEntry]  # the incidents
    unreadable: list[dict] = field(default_factory=list)  # {"path", "error"}
    spikes: list[TriageEntry] = field(default_factory=list)  # spike bundles: early warnings, not incidents

    def groups(self) -> dict[str, dict[str, list[TriageEntry]]]:
        """category -> module -> entries; categories and modules by descending count, entries by run and step."""
        by_category: dict[str, dict[str, list[TriageEntry]]] = {}
        for e in sorted(self.entries, key=lambda e: (e.run_id, e.step, e.path)):
            by_category.setdefault(e.category, {}).setdefault(e.module, []).append(e)
        ordered = sorted(by_category.items(), key=lambda kv: (-sum(map(len, kv[1].values())), kv[0]))
        return {cat: dict(sorted(mods.items(), key=lambda kv: (-len(kv[1]), kv[0]))) for cat, mods in ordered}

    def by_host(self) -> list[dict]:
        """Incidents by the host of their first bad rank, most first: {"host", "count", "devices": {device: count},
        "ranks": {rank: count}, "categories": {category: count}}; a host seen only once is still listed."""
        hosts: dict[str, dict] = {}
        for e in self.entries:
            row = hosts.setdefault(e.host or "unknown", {"host": e.host or "unknown", "count": 0, "devices": {},
                                                          "ranks": {}, "categories": {}})
            row["count"] += 1
            for key, value in (("devices", e.device or "unknown"), ("categories", e.category),
                               ("ranks", None if e.first_bad_ranks is None else str(e.first_bad_ranks[0]))):
                if value is not None:
                    row[key][value] = row[key].get(value, 0) + 1
        return sorted(hosts.values(), key=lambda r: (-r["count"], r["host"]))

    def to_dict(self) -> dict:
        groups = self.groups()
        return {
            "root": self.root, "bundles": len(self.entries), "unreadable": list(self.unreadable),
            "categories": [
                {"category": cat, "count": sum(map(len, mods.values())),
                 "modules": [{"module": mod, "count": len(items), "bundles": [e.to_dict() for e in items]}
                             for mod, items in mods.items()]}
                for cat, mods in groups.items()],
            "spikes": [e.to_dict() for e in sorted(self.spikes, key=lambda e: (e.run_id, e.step, e.path))],
            "hosts": self.by_host(),
        }


def find_bundle_dirs(root: str | os.PathLike) -> list[Path]:
    """Every directory under `root` (root included) that holds a bundle manifest (or an interrupted update of
    one) or a bundle set's index, skipping the `.tmp-*` directories of interrupted writes. A bundle's own
    subdirectories are not searched, so a set's per-rank parts are not listed beside the set."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not is_temp_name(d))
        if MANIFEST in filenames or INDEX in filenames or any(f.startswith(PENDING_PREFIX) for f in filenames):
            found.append(Path(dirpath))
            dirnames[:] = []
    return sorted(found)


def triage(root: str | os.PathLike) -> TriageResult:
    """Read every bundle under `root`; the ones that fail to load are listed with their error, not skipped."""
    from nanscan.bundle import BundleSet  # noqa: PLC0415 - it needs torch (NOTE: [fast help] in nanscan/cli/main.py)
    from nanscan.bundle.rank_set import device_label  # noqa: PLC0415 - beside BundleSet

    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; pass the directory that holds the bundles "
                         "(the Monitor's bundle_dir)")
    entries, unreadable, seen, spikes = [], [], {}, []
    for path in find_bundle_dirs(root):
        # Everything read from one bundle stays inside the try: one damaged bundle is listed, the others still count.
        try:
            bundle = load_bundle(path)
            module, source, verdict = first_bad_module(bundle)
            if bundle.category == SPIKE:  # no module went bad: name the layers whose gradients moved first
                moving = (bundle.spike or {}).get("first_moving") or []
                module, source = ", ".join(str(g.get("layer")) for g in moving[:3]) or "(none moved first)", "spike"
            ranks = (bundle.first_bad_ranks, bundle.world_size) if isinstance(bundle, BundleSet) else (None, None)
            rolled = next((f["title"].removeprefix("Rollback: ") for f in bundle.findings()
                           if f.get("key") == ROLLBACK_FINDING), None)
            host, device = (bundle.manifest.get("environment") or {}).get("host"), None
            if isinstance(bundle, BundleSet) and bundle.first_bad_ranks:
                info = bundle.device_of(bundle.first_bad_ranks[0])
                if info:
                    host, device = info.get("host", host), device_label(info)
            entry = TriageEntry(str(path), str(bundle.manifest["run_id"]), bundle.step, bundle.category,
                                module, source, verdict, bundle.manifest.get("detected_at"), *ranks,
                                note_edited=list(bundle.note_review().edited), rollback=rolled, host=host,
                                device=device)
            identity = _incident_identity(bundle)
        except (BundleError, OSError, ValueError, KeyError, TypeError) as exc:
            unreadable.append({"path": str(path), "error": f"{type(exc).__name__}: {exc}"})
            continue
        if identity in seen:  # a copy (cp -r, a download) of an incident already counted
            seen[identity].copies.append(entry.path)
            continue
        seen[identity] = entry
        (spikes if entry.category == SPIKE else entries).append(entry)
    return TriageResult(str(root), entries, unreadable, spikes)


def _incident_identity(bundle) -> tuple:
    """What makes two bundle directories one incident: the run, the step and the detection time; without a
    detection time, the evidence itself (every file's sha256 but the ledger's and the note's, which reviews
    change)."""
    manifest = bundle.manifest
    detected = manifest.get("detected_at")
    if detected is not None:
        return manifest["run_id"], bundle.step, detected
    skip = (manifest["ledger"], manifest["incident"])
    return manifest["run_id"], bundle.step, tuple(sorted((name, entry["sha256"])
                                                         for name, entry in manifest["files"].items()
                                                         if name not in skip))


def print_triage(result: TriageResult, console) -> None:
    from rich.markup import escape  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    groups = result.groups()
    if not result.entries and not result.unreadable and not result.spikes:
        console.print(f"no nanscan bundles under {result.root} (bundles are the step-<N> directories that a Monitor "
                      "writes under <bundle_dir>/<run_id>/)", highlight=False, markup=False)
        return
    summary = Table(title=f"{len(result.entries)} bundle(s) under {result.root}, by category")
    summary.add_column("category")
    summary.add_column("bundles", justify="right")
    summary.add_column("first bad modules")
    for cat, mods in groups.items():
        # run ids, module labels and paths are data: "[...]" in them is not rich markup
        summary.add_row(escape(cat), str(sum(map(len, mods.values()))),
                        escape(", ".join(f"{m} x{len(items)}" for m, items in mods.items())))
    console.print(summary)
    for cat, mods in groups.items():
        table = Table(title=f"category {escape(cat)}")
        rolled = any(e.rollback for items in mods.values() for e in items)
        columns = ("first bad module", "run", "step", "first bad ranks", "verdict", *(("rolled back",) if rolled
                                                                                        else ()), "bundle")
        for column in columns:
            table.add_column(column, overflow="fold")
        for mod, items in mods.items():
            for e in items:
                ranks = "" if e.world_size is None else \
                    f"{', '.join(map(str, e.first_bad_ranks))} of {e.world_size}"
                verdict = REPLAY_VERDICT_WORDS.get(e.verdict, e.verdict or "")  # "transient": not reproduced
                row = (mod, e.run_id, str(e.step), ranks, verdict, *((e.rollback or "",) if rolled else ()), e.path)
                table.add_row(*map(escape, row))
        console.print(table)
    hosts = result.by_host()
    if any(h["host"] != "unknown" for h in hosts):
        # NOTE: [replica agreement] (nanscan.runtime.distributed): the same machine under many incidents is a lead
        table = Table(title="incidents by the host and device of their first bad rank")
        for column in ("host", "incidents", "devices", "first bad ranks", "categories"):
            table.add_column(column, overflow="fold")
        for h in hosts:
            counts = [", ".join(f"{k} x{v}" for k, v in h[key].items()) for key in ("devices", "ranks", "categories")]
            table.add_row(*map(escape, (h["host"], str(h["count"]), *counts)))
        console.print(table)
    copies = [e for e in result.entries if e.copies]
    if copies:
        console.print(f"{sum(len(e.copies) for e in copies)} copy(ies) of incidents counted once:")
        for e in copies:
            console.print(f"  {e.path}: also {', '.join(e.copies)}", highlight=False, markup=False)
    edited = [e for e in result.entries if e.note_edited]
    if edited:
        console.print(f"[yellow]{len(edited)} bundle(s) whose INCIDENT.md automatic findings were edited by hand[/yellow] "
                      "(`nanscan note --rebuild DIR` renders them again from the ledger, keeping the edit):")
        for e in edited:
            console.print(f"  {e.path}: {'; '.join(e.note_edited)}", highlight=False, markup=False)
    if result.spikes:
        table = Table(title=f"{len(result.spikes)} spike bundle(s): early warnings, every value finite (not "
                            "incidents)")
        for column in ("run", "step", "first moving", "bundle"):
            table.add_column(column, overflow="fold")
        for e in sorted(result.spikes, key=lambda e: (e.run_id, e.step, e.path)):
            table.add_row(*map(escape, (e.run_id, str(e.step), e.module, e.path)))
        console.print(table)
    if result.unreadable:
        console.print(f"[red]{len(result.unreadable)} unreadable bundle(s)[/red]:")
        for item in result.unreadable:
            console.print(f"  {item['path']}: {item['error']}", highlight=False, markup=False)


@click.command("triage")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def triage_command(directory, as_json):
    """Group every bundle under DIRECTORY by failure category and first bad module, with counts.

    Exits 1 when some bundle could not be read (it is listed, the others are counted)."""
    from nanscan.cli.errors import console as cli_console  # noqa: PLC0415


    with cli_errors():
        result = triage(directory)
    if as_json:
        json_out(result.to_dict())
    else:
        print_triage(result, cli_console())
    if result.unreadable:
        raise SystemExit(1)  # some evidence could not be counted
