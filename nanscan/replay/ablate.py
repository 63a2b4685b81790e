"""`nanscan ablate BUNDLE`: change one factor at a time (learning rate, precision, gradient clipping, the suspicious
samples, deterministic algorithms), each alone from the bundle's state and batch, and record what each change does.

Rows that do not fix the failure are kept: a factor that helps does not erase the evidence about the others. A
factor that seems to fix the step is confirmed on held-out batches and reported separately, so that a lucky
change on one batch is not mistaken for the cause.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import click

from nanscan.cli.errors import cli_errors, entry_options, json_out
from nanscan.bundle import load_bundle
from nanscan.bundle.format import ABLATE_FINDING_PREFIX
from nanscan.replay.options import BASELINE, FACTOR_KEYS, FACTORS, Factor, StepOptions

# The replay is imported by the functions that run it: it needs torch, which `nanscan ablate --help` must not import
# (NOTE: [fast help] in nanscan/cli/main.py).
if TYPE_CHECKING:
    from nanscan.bundle import Bundle
    from nanscan.replay.replayer import Replayer
    from nanscan.replay.step import StepOutcome

DEFAULT_HOLDOUT = 3
FINDING_PREFIX = ABLATE_FINDING_PREFIX




@dataclass
class Confirmation:
    """The factor applied to held-out batches (each from the bundle's state), next to the unchanged step on them."""

    source: str  # where the held-out batches came from, "" when there were none
    batches: int
    finite_with_factor: int
    finite_baseline: int
    failures: list[str] = field(default_factory=list)  # how the factor failed on a held-out batch
    reason: str = ""

    @property
    def confirmed(self) -> bool | None:
        """True when every held-out batch stays finite with the factor; None when there was nothing to test."""
        return None if not self.batches else self.finite_with_factor == self.batches

    def describe(self) -> str:
        if not self.batches:
            return f"not confirmed: {self.reason}"
        verdict = "confirmed" if self.confirmed else "NOT confirmed"
        text = (f"{verdict} on held-out batches: finite on {self.finite_with_factor}/{self.batches} with the "
                f"factor, {self.finite_baseline}/{self.batches} without it")
        if self.confirmed and self.finite_baseline == self.batches:
            text += (" (the held-out batches were finite anyway: the failure is specific to the failing batch, so "
                     "this shows only that the change does no harm there)")
        return text

    def to_dict(self) -> dict:
        return {"source": self.source, "batches": self.batches, "finite_with_factor": self.finite_with_factor,
                "finite_baseline": self.finite_baseline, "confirmed": self.confirmed,
                "failures": list(self.failures), "reason": self.reason}


@dataclass
class AblationRow:
    factor: Factor
    applied: bool
    outcome: StepOutcome | None
    fixes: bool = False  # the baseline fails and this change alone makes the step finite
    confirmation: Confirmation | None = None
    dropped: list[int] = field(default_factory=list)
    dropped_ids: list | None = None
    note: str = ""
    uncredited: str = ""  # why a finite outcome is not counted as a fix (the unchanged step is not deterministic)

    @property
    def first_bad(self) -> str | None:
        loc = self.outcome.localization if self.outcome else None
        return f"{loc.label} ({loc.module_type}, {loc.phase})" if loc else None

    def status(self) -> str:
        if not self.applied:
            return "not applied"
        if self.outcome.error:
            return "error"
        return "finite" if self.outcome.finite else "non-finite"

    def to_dict(self) -> dict:
        out = self.outcome
        return {"factor": self.factor.key, "label": self.factor.label, "applied": self.applied,
                "status": self.status(), "finite": out.finite if out else None,
                "category": out.category if out else None,
                "loss": out.to_dict()["loss"] if out else None,
                "grad_max_exponent": out.grad_max_exponent if out else None,
                "first_bad_module": self.first_bad, "fixes": self.fixes,
                "confirmation": self.confirmation.to_dict() if self.confirmation else None,
                "dropped": list(self.dropped), "dropped_ids": self.dropped_ids, "note": self.note,
                "uncredited": self.uncredited,
                "outcome": out.to_dict() if out else None, "options": self.factor.options.to_dict()}


@dataclass
class AblationResult:
    bundle: str
    run_id: str
    step: int
    category: str
    entry: str
    state: str
    baseline: AblationRow
    rows: list[AblationRow]
    notes: list[str] = field(default_factory=list)

    @property
    def fixes(self) -> list[AblationRow]:
        return [r for r in self.rows if r.fixes]

    def row(self, key: str) -> AblationRow:
        for r in [self.baseline, *self.rows]:
            if r.factor.key == key:
                return r
        raise KeyError(f"no ablation row {key!r}; rows: {', '.join(r.factor.key for r in self.rows)}")

    def to_dict(self) -> dict:
        return {"bundle": self.bundle, "run_id": self.run_id, "step": self.step, "category": self.category,
                "entry": self.entry, "state": self.state, "baseline": self.baseline.to_dict(),
                "rows": [r.to_dict() for r in self.rows],
                "fixes": [{"factor": r.factor.key, "confirmed": r.confirmation.confirmed if r.confirmation else None}
                          for r in self.fixes],
                "notes": list(self.notes)}


def select_factors(keys: Sequence[str] | None) -> list[Factor]:
    if not keys:
        return list(FACTORS)
    by_key = {f.key: f for f in FACTORS}
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise ValueError(f"unknown factor(s) {', '.join(unknown)}; choose from {', '.join(FACTOR_KEYS)}")
    return [by_key[k] for k in dict.fromkeys(keys)]


def _holdout_batches(replayer: Replayer, count: int) -> tuple[list[Any], str]:
    if count <= 0:
        return [], "held-out confirmation turned off"
    spec = replayer.build()
    if spec.batches is None:
        return [], ("the bundle keeps no earlier batches and the replay entry gives no ReplaySpec.batches; "
                    "return some healthy batches there to confirm fixes")
    return list(itertools.islice(spec.batches, count)), "ReplaySpec.batches"


def ablate(bundle: Bundle | str | os.PathLike, entry: str | None = None, *, factors: Sequence[str] | None = None,
           holdout: int = DEFAULT_HOLDOUT, progress: Callable[[str, int], None] | None = None,
           trust_bundle_paths: bool = False) -> AblationResult:
    """Replay the bundle's step once as recorded and once per factor (each alone), with localization hooks.

    factors: keys of FACTORS (default: all). holdout: how many held-out batches confirm a factor that fixes the
    step. progress(description, total): called before each replay with the number of replays planned so far.
    trust_bundle_paths: as for nanscan.replay.Replayer. Nothing is written; see record_ablation.
    """
    from nanscan.replay.replayer import Replayer  # noqa: PLC0415
    from nanscan.replay.step import ReplayError  # noqa: PLC0415

    chosen = select_factors(factors)
    replayer = Replayer(bundle, entry, trust_bundle_paths=trust_bundle_paths)
    b = replayer.bundle
    total = 1 + len(chosen)
    say = progress or (lambda _description, _total: None)

    say("baseline (as recorded)", total)
    baseline_outcome = replayer.run(StepOptions(), localize=True)
    notes = list(replayer.notes)  # after a run: it says whether the run's autocast is re-applied
    if baseline_outcome.error is not None:
        # Against a step that cannot run, a factor that makes it run would look like a fix of the failure.
        raise ReplayError(f"the unchanged step of {b.path} raised an error instead of running: "
                          f"{baseline_outcome.error}; fix the replay entry {replayer.entry!r} (or pass --entry) "
                          "before changing factors")
    baseline = AblationRow(BASELINE, True, baseline_outcome)
    if baseline_outcome.finite:
        notes.append("the unchanged step is finite when replayed, so no factor can be said to fix it; "
                     "`nanscan replay` says what a rerun through the replay entry cannot see")

    held_out: list[Any] | None = None
    held_source = ""
    baseline_held: list[StepOutcome] = []
    baseline_repeats: bool | None = None  # does the unchanged step fail the same way again? asked once
    rows = []
    for factor in chosen:
        say(factor.label, total)
        row = _run_factor(replayer, factor, baseline_outcome)
        if row.fixes and baseline_repeats is None:
            total += 1
            say("baseline again, to credit a fix", total)
            again = replayer.run(StepOptions())
            baseline_repeats = again.signature == baseline_outcome.signature
            if not baseline_repeats:
                baseline.note = (f"the unchanged step did not fail the same way when replayed again "
                                 f"({again.describe()}): the failure is not deterministic here, so no factor is "
                                 "credited with fixing it; run `nanscan replay` to see how often it comes back")
                notes.append(baseline.note)
        if row.fixes and not baseline_repeats:
            row.fixes = False
            row.uncredited = "finite, but the unchanged step is not deterministic here: not credited as a fix"
        if row.fixes:
            if held_out is None:  # once, for every factor that needs it
                held_out, held_source = _holdout_batches(replayer, holdout)
                total += len(held_out)
                for i, batch in enumerate(held_out):
                    say(f"held-out batch {i + 1}, unchanged", total)
                    baseline_held.append(replayer.run(StepOptions(), batch=batch))
            total += len(held_out)
            row.confirmation = _confirm(replayer, factor, held_out, held_source, baseline_held, say, total)
        rows.append(row)
    return AblationResult(str(b.path), b.manifest["run_id"], b.step, b.category, replayer.entry,
                          replayer.state_description, baseline, rows, notes)


def _run_factor(replayer: Replayer, factor: Factor, baseline: StepOutcome) -> AblationRow:
    from nanscan.replay.reproduce import suspicious_samples  # noqa: PLC0415
    from nanscan.replay.step import sample_ids_of  # noqa: PLC0415

    if factor.drops_samples:
        if baseline.finite:
            return AblationRow(factor, False, None, note="the unchanged step is finite: no suspicious samples")
        found, origin = suspicious_samples(replayer)
        if found is None or not found.applicable:
            return AblationRow(factor, False, None, note=f"no suspicious samples: {found.reason if found else ''}")
        keep = [i for i in range(replayer.sample_count) if i not in set(found.indices)]
        if not keep:
            return AblationRow(factor, False, None, note="every sample is suspicious; nothing would be left")
        outcome = replayer.run(factor.options, samples=keep, localize=True)
        ids = found.sample_ids or sample_ids_of(replayer.bundle.sample_ids, found.indices, replayer.sample_count)
        return AblationRow(factor, True, outcome, fixes=not baseline.finite and outcome.finite,
                           dropped=list(found.indices), dropped_ids=ids,
                           note=f"dropped {len(found.indices)} of {replayer.sample_count} samples ({origin})")
    outcome = replayer.run(factor.options, localize=True)
    applied = not any("was not in effect" in n for n in outcome.notes)
    return AblationRow(factor, applied, outcome, fixes=applied and not baseline.finite and outcome.finite,
                       note="; ".join(outcome.notes))


def _confirm(replayer: Replayer, factor: Factor, batches: list[Any], source: str,
             baseline_held: list[StepOutcome], say, total: int) -> Confirmation:
    if not batches:
        return Confirmation("", 0, 0, 0, reason=source)
    finite, failures = 0, []
    for i, batch in enumerate(batches):
        say(f"{factor.label}: held-out batch {i + 1}", total)
        # dropping samples is specific to the failing batch: on held-out batches the step runs as recorded
        outcome = replayer.run(factor.options, batch=batch)
        if outcome.finite:
            finite += 1
        else:
            failures.append(f"batch {i}: {outcome.describe()}")
    return Confirmation(source, len(batches), finite, sum(o.finite for o in baseline_held), failures)


# ---------------------------------------------------------------------------------------------------------------
# Recording and output
# ---------------------------------------------------------------------------------------------------------------

def _row_title(row: AblationRow) -> str:
    name = row.factor.label
    if not row.applied:
        return f"Ablation: {name}: not applied"
    out = row.outcome
    if out.error:
        return f"Ablation: {name}: the step raised an error"
    if out.finite:
        if row.fixes and row.confirmation is not None and row.confirmation.confirmed is not None:
            verdict = "confirmed" if row.confirmation.confirmed else "not confirmed"
            return f"Ablation: {name}: finite ({verdict} on held-out batches)"
        return f"Ablation: {name}: finite"
    where = f", first bad {row.first_bad}" if row.first_bad else ""
    return f"Ablation: {name}: still non-finite ({out.category}{where})"


def _row_markdown(row: AblationRow, result: AblationResult) -> str:
    from nanscan.runtime.localize import fmt_value  # noqa: PLC0415

    lines = [f"Applied alone to the bundle's {result.state} state and batch, replayed with `{result.entry}`."
             if row.factor is not BASELINE else
             f"The step replayed unchanged from the bundle's {result.state} state and batch with `{result.entry}`; "
             "every ablation row is compared with it."]
    if not row.applied:
        lines += ["", f"Not applied: {row.note}."]
        return "\n".join(lines)
    out = row.outcome
    lines += ["", f"- outcome: {out.describe()}", f"- loss: {fmt_value(out.loss)}",
              f"- largest gradient exponent: "
              f"{'n/a' if out.grad_max_exponent is None else '2^' + str(out.grad_max_exponent)}"]
    if row.dropped:
        shown = row.dropped_ids if row.dropped_ids is not None else row.dropped
        lines.append(f"- dropped samples: {', '.join(f'`{s}`' for s in shown)}")
    if row.fixes:
        lines.append("- this change alone makes the failing step finite")
    if row.uncredited:
        lines.append(f"- {row.uncredited}")
    if row.confirmation is not None:
        lines.append(f"- {row.confirmation.describe()}")
        lines += [f"  - {f}" for f in row.confirmation.failures]
    if row.note and not row.dropped:
        lines.append(f"- note: {row.note}")
    return "\n".join(lines)


def record_ablation(result: AblationResult, bundle: Bundle | None = None) -> int:
    """Add one finding per row ("ablate:<factor>") to the bundle; the same rows again change nothing.
    Returns how many findings changed."""
    target = bundle or load_bundle(result.bundle)
    changed = 0
    for row in [result.baseline, *result.rows]:
        changed += target.add_finding(f"{FINDING_PREFIX}{row.factor.key}", _row_title(row),
                                      _row_markdown(row, result), row.to_dict())
    return changed


def print_ablation(result: AblationResult, console) -> None:
    from rich.markup import escape  # noqa: PLC0415 - notes, paths and module names are not markup
    from rich.table import Table  # noqa: PLC0415

    from nanscan.runtime.localize import fmt_value  # noqa: PLC0415

    console.print(f"[bold]{escape(result.bundle)}[/bold] (run {result.run_id}, step {result.step}, category "
                  f"{result.category}; {result.state} state)")
    table = Table(title="one factor at a time (rows that do not fix it are evidence too)")
    for column in ("factor", "result", "loss", "grad max exp", "first bad module", "note"):
        table.add_column(column, overflow="fold")
    for row in [result.baseline, *result.rows]:
        out = row.outcome
        status = row.status()
        color = {"finite": "green", "non-finite": "red"}.get(status, "yellow")
        table.add_row(row.factor.label, f"[{color}]{status}[/{color}]", fmt_value(out.loss) if out else "",
                      "" if not out or out.grad_max_exponent is None else f"2^{out.grad_max_exponent}",
                      escape(row.first_bad or ""), escape("; ".join(filter(None, [row.note, row.uncredited]))))
    console.print(table)
    fixes = result.fixes
    if not fixes:
        console.print("no single factor makes the step finite" if not result.baseline.outcome.finite else
                      "the unchanged step is finite: nothing to fix here")
    else:
        console.print("[bold]factors that make the failing step finite[/bold] (each alone):")
        for row in fixes:
            console.print(f"  {row.factor.label}: {row.confirmation.describe() if row.confirmation else ''}",
                          highlight=False, markup=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)


@click.command("ablate")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@entry_options
@click.option("--factor", "factors", multiple=True, type=click.Choice(FACTOR_KEYS),
              help="Only these factors (repeatable; default: all).")
@click.option("--holdout", default=DEFAULT_HOLDOUT, show_default=True, type=click.IntRange(0, 100),
              help="Held-out batches that confirm a factor which fixes the step (0: no confirmation).")
@click.option("--no-record", is_flag=True, help="Do not add the rows to the bundle's ledger and INCIDENT.md.")
@click.option("--window/--step", "window", default=None,
              help="Change each factor over the bundle's window of the run, from its oldest kept state, judged past "
                   "the failing step (the default when the bundle holds a window), or on the failing step alone "
                   "(the default otherwise, and with --factor).")
@click.option("--beyond", default=16, show_default=True, type=click.IntRange(0, 1000),
              help="Over the window: the fewest steps run past the failing step to confirm a fix (at least twice "
                   "the steps it took to fail are run).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def ablate_command(bundle, entry, trust_bundle_paths, factors, holdout, no_record, window, beyond, as_json):
    """Change one factor at a time and record the outcome of each: over BUNDLE's window of the run when it holds
    one (a cause that built up over many steps is judged where it built up), else from its state and batch."""
    from nanscan.cli.errors import console as cli_console  # noqa: PLC0415
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn  # noqa: PLC0415

    console = cli_console(stderr=as_json)
    if window is None:
        window = not factors and _holds_window(bundle)
    if window:
        _ablate_window(bundle, entry, trust_bundle_paths, beyond, no_record, as_json, console)
        return
    with cli_errors():
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("ablation", total=None)
            started = [False]

            def progress(description: str, total: int) -> None:
                if started[0]:
                    bar.advance(task)
                started[0] = True
                bar.update(task, description=description, total=total)

            result = ablate(bundle, entry, factors=factors or None, holdout=holdout, progress=progress,
                            trust_bundle_paths=trust_bundle_paths)
        changed = None if no_record else record_ablation(result)
    _show(result, changed, as_json, console, print_ablation)


def _holds_window(bundle: Path) -> bool:
    """Whether the bundle's manifest names a window of the run (read as JSON: a broken bundle is refused later, by
    the command that loads it, with its reason)."""
    try:
        manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and isinstance(manifest.get("window"), dict) and \
        bool(manifest["window"].get("states"))


def _ablate_window(bundle, entry, trust_bundle_paths, beyond, no_record, as_json, console) -> None:
    """`ablate --window` (nanscan.runtime.window_ablation NOTE: [window ablation])."""
    from nanscan.replay.ablate_window import (ablate_window, print_window_ablation,  # noqa: PLC0415
                                              record_window_ablation)

    with cli_errors():
        with console.status("changing one factor at a time over the window") as status:
            result = ablate_window(bundle, entry, beyond=beyond, trust_bundle_paths=trust_bundle_paths,
                                   progress=lambda label: status.update(f"over the window: {label}"))
        changed = None if no_record else record_window_ablation(result)
    _show(result, changed, as_json, console, print_window_ablation)


def _show(result, changed: int | None, as_json: bool, console, printer) -> None:
    """An ablation's rows (printer(result, console)) or its JSON, and what recording them changed."""
    if as_json:
        json_out({**result.to_dict(), "recorded_changes": changed})
        return
    printer(result, console)
    if changed is not None:
        console.print(f"recorded {changed} new or changed row(s) in {Path(result.bundle) / 'INCIDENT.md'}"
                      if changed else "the same rows are already recorded in the bundle; nothing changed", markup=False)
