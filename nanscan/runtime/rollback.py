"""on_invalid=Rollback(...): after the evidence is safe, the run goes back to a state the window kept, skips what broke
it, may change one factor for a while, and records every decision (NOTE: [rollback]).

NOTE: [rollback]
At an incident, once its bundle is written (and the in-process rerun has run), a Monitor whose on_invalid is a
Rollback goes back as far as the fault needs (chosen_skip; skip="auto", the default): to the failing step's own
start when a bad input at that step broke it with no warning before it (skip="step": the live weights at a check
before its update, else the newest kept state before it), else (skip="window") to the newest state its window kept
(nanscan.runtime.window NOTE: [run window]) from at or before the first warning of the episode that ended in the
incident (its first SpikeWarning no more than EPISODE_GAP steps before the next; with no warning, the failing step
itself). One bad record then costs its step, not every good step since the window's state. It restores the model's
weights and buffers and the optimizer's state (loaded in place) and the GradScaler's scale of that step. No
generator is rewound: torch's, numpy's and Python's global generators drive the data as much as the model
(nanoGPT's get_batch draws its batches with torch.randint, a DataLoader's sampler shuffles with torch's), and
rewinding them would draw the skipped batches again; dropout draws new masks, as at any later step. A loop with its
own DataLoader goes on with its iterator's next batch either way.
The loop does not change: the failing step's gradients are dropped (set to None, never multiplied by 0, which would
still carry a NaN into Adam's moments), check() returns a report that is not ok (the loop skips optimizer.step() as
for "skip", and one that calls it anyway updates nothing, to the end of the step: NOTE: [dropped update]), and the
loop goes on with its next batch. So the batches from the restored state through the failing step are skipped:
their updates are undone and they are not fed again (PaLM's "restart about 100 steps before the spike and skip the
batches"); a record the rollback quarantined that the loop draws again later has that step's update dropped (NOTE:
[dropped update]); skip_next drops the updates of that many more steps, through an optimizer step pre-hook (their
checks stay as they are).
One factor may change for the next steps, named and recorded, never several: lr_scale multiplies every param group's
learning rate inside optimizer.step() only (pre- and post-hooks), so a loop that sets the learning rate itself, or a
scheduler, keeps its own schedule and the factor applies on top of it.
Limits: at most max_rollbacks per run; a failure within settle_steps of a rollback (default: the window's steps) is
the same failure coming back, and raises NonFiniteError naming every attempt's bundle, as does a failure with no
kept state to go back to. Under a process group every rank rolls back at the same step (the ranks' agreement decides
it) to its own kept state, which DDP keeps identical; a sharded model's (FSDP2, HSDP, TP) kept local shards are
loaded back into its DTensors and the optimizer's in place (nanscan.runtime.shards.placed_model_state), and the
kept optimizer state is copied first, so the training that follows never writes into the window's copy. Under a
group no spike dates an episode's start (spikes are judged per process), so skip="window" goes back to the newest
kept state before the failing step. The window then starts again from the restored state, as the
first state of the steps that follow (the abandoned steps are no one's lineage). What the user saved is never
touched: the state comes from the window's host copies, not from a checkpoint.
The record: each rollback is an entry of <bundle_dir>/<run_id>/rollbacks.json (what was restored, which steps and
sample ids were skipped, the factor, what happened next: after settle_steps finite steps "recovered" when the loss
and gradient norm are back within the band of the steps before (NOTE: [recovered] in nanscan.runtime.recovery), else
"not recovered" with the numbers and a warning; or "failed again" at a step), written atomically with no wall-clock
time (the same run gives the same file), and the finding "rollback" of the incident's bundle, updated with the outcome;
the failing batch's rows that break a step by themselves (bad_row_ids: a NaN, an infinity or an overflow value, as a
float32 maximum written for "missing" breaks a step as a NaN does, or every target the ignore index:
engine.targets.breaking_rows, the diagnosis's rule), named by their sample ids, else by their content digests
("sha256:<hex>", the quarantine's match: NOTE: [quarantine match]), go into the run directory's quarantine
(nanscan.bundle.quarantine NOTE: [quarantine file]). Under a process group each rank's bad rows are gathered at the
rollback: every rank chooses the same skip from them and knows every quarantined record, and rank 0 writes them into the
quarantine.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from nanscan.bundle import load_bundle
from nanscan.bundle.format import ROLLBACK_FINDING
from nanscan.bundle.rollbacks import ROLLBACKS_FILE, write_rollbacks
from nanscan.bundle.quarantine import DIGEST_PREFIX, NamedRecord, add_records
from nanscan.engine.inputs import batch_size, plain_ids
from nanscan.engine.targets import breaking_rows
from nanscan.engine.record_digest import row_digests
from nanscan.incident import warn_user
from nanscan.runtime.dropped_update import drop_gradients, put_back
from nanscan.runtime.recovery import judge

log = logging.getLogger("nanscan")

SKIPS = ("auto", "window", "step")
SHOWN_IDS = 8  # INCIDENT.md names the first few skipped ids; rollbacks.json holds them all


@dataclasses.dataclass(frozen=True)
class Rollback:
    """on_invalid=Rollback(...): go back to a kept state and keep training (NOTE: [rollback]).

    skip: "auto" (the default: the one that fits the fault, chosen_skip), "window" (restore the newest kept state
        from before the episode's first warning: the batches since, the failing one included, are skipped) or
        "step" (the failing step's batch alone: its own start is restored).
    skip_next: drop the updates of this many more steps after the rollback.
    lr_scale: the one factor changed, the learning rate times this inside optimizer.step() for `factor_steps` steps
        after the rollback (None: no factor).
    max_rollbacks: rollbacks allowed in a run; the next incident raises.
    settle_steps: a failure within this many steps after a rollback raises (the same failure came back); also the
        finite steps after which a rollback counts as recovered. None: the window's steps."""

    skip: str = "auto"
    skip_next: int = 0
    lr_scale: float | None = None
    factor_steps: int = 32
    max_rollbacks: int = 3
    settle_steps: int | None = None

    def __post_init__(self):
        if self.skip not in SKIPS:
            raise ValueError(f"Rollback(skip={self.skip!r}): use 'auto' (the default), 'window' (back to the kept "
                             "state before the first warning) or 'step' (the failing step's batch alone)")
        for name in ("skip_next", "factor_steps", "max_rollbacks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Rollback({name}={value!r}): give a number, 0 or more")
        if self.settle_steps is not None and (not isinstance(self.settle_steps, int) or self.settle_steps < 1):
            raise ValueError(f"Rollback(settle_steps={self.settle_steps!r}): give a number of steps, or None")
        if self.lr_scale is not None and not (isinstance(self.lr_scale, (int, float)) and 0 < self.lr_scale):
            raise ValueError(f"Rollback(lr_scale={self.lr_scale!r}): give a positive factor, or None")

    @property
    def factor(self) -> str | None:
        return f"learning rate x{self.lr_scale:g} for {self.factor_steps} steps" if self.lr_scale is not None else None


def chosen_skip(policy: Rollback, category: str, bad_rows: list, first_warning: int, step: int) -> tuple[str, str]:
    """The skip a rollback at `step` takes and why (NOTE: [rollback]): skip="auto" fits the fault, the cheapest
    sufficient one. A warning episode before the incident (its first warning at `first_warning`) says the run's
    state was going wrong before the step: back before it. A bad input at the step with no warning before it (the
    category `input`, or rows of the batch holding a NaN or an infinity) says the batch alone broke it: that step.
    Anything else may predate the step (a learning rate too large fails with no warning): back to the window's
    state."""
    if policy.skip != "auto":
        return policy.skip, "set by hand"
    if first_warning < step:
        return "window", f"a warning episode began at step {first_warning}, before the incident"
    if category == "input" or bad_rows:
        return "step", "a bad input at this step, with no warning before it"
    return "window", f"no bad input named and no warning before it: the {category} cause may predate the step"


class RollbackWarning(UserWarning):
    """The Monitor rolled the run back at an incident and goes on (NOTE: [rollback]); the message says what it did."""


class Rollbacks:
    """The Monitor's rollbacks (NOTE: [rollback]): at an incident `refusal` (the limits), then `record` or `stop`;
    `after_check` at each finite check (the outcome), and the optimizer hooks of skip_next and the factor. The
    Monitor restores the chosen state (StepVerdicts.roll_back)."""

    def __init__(self, policy: Rollback, run_dir: Path, settle_default: int, *,
                 history: Callable[[], list] = list, first_loss: Callable[[], float | None] = lambda: None,
                 keep_buffers: bool = False):
        """`keep_buffers`: a dropped update puts the framework's gradient buffers back after the step (as
        nanscan.runtime.dropped_update.DroppedUpdate's)."""
        self.policy = policy
        self.keep_buffers = keep_buffers
        self._held: list = []
        self.run_dir = run_dir
        # the Monitor's history (entries with step, loss, grad_norm) and the run's first loss, read at a rollback
        # and once it settled, never per step (NOTE: [recovered])
        self._history, self._first_loss = history, first_loss
        self._reference: list = []  # the steps before the last rollback's restored state
        self.settle = policy.settle_steps or settle_default
        self.records: list[dict] = []
        self._skip_left = 0
        self._factor_left = 0
        self._saved_lrs: list | None = None
        self._handles: list[Any] = []
        self.writes = True  # this process writes rollbacks.json and the findings (one rank of a group does)
        self.quarantined: set = set()  # the records this run's rollbacks quarantined (NOTE: [dropped update])
        self.stopped: dict | None = None  # where a refused rollback stopped the run

    # -- at an incident ---------------------------------------------------------------------------------------------
    def refusal(self, step: int) -> str | None:
        """Why the incident of `step` is not rolled back (the limits), or None."""
        if len(self.records) >= self.policy.max_rollbacks:
            return (f"on_invalid=Rollback: {len(self.records)} rollback(s) already, "
                    f"max_rollbacks={self.policy.max_rollbacks}")
        last = self.records[-1] if self.records else None
        if last is not None and step - last["at_step"] <= self.settle:
            return (f"on_invalid=Rollback: failed again at step {step}, {step - last['at_step']} step(s) after the "
                    f"rollback at step {last['at_step']} (within settle_steps={self.settle}): the same failure")
        return None

    def quarantined_in(self, batch: Any, sample_ids: Any) -> list:
        """The records of a batch that a rollback of this run quarantined (NOTE: [dropped update]): by sample id,
        and, once a record known only by its digest was quarantined, by the digest of each row (read on the host:
        a cost paid only after such a rollback)."""
        if not self.quarantined:
            return []
        ids = plain_ids(sample_ids)
        ids = list(ids) if isinstance(ids, (list, tuple)) else []
        held = [i for i in ids if isinstance(i, (str, int)) and i in self.quarantined]
        if batch is not None and any(is_digest(q) for q in self.quarantined):
            size = len(ids) or batch_size(batch)
            digests, _ = row_digests(batch, list(range(size or 0)), size)
            held += [DIGEST_PREFIX + d for d in digests or () if DIGEST_PREFIX + d in self.quarantined]
        return held

    def abandoned(self) -> tuple[int, ...]:
        """The steps this run's rollbacks abandoned (their updates undone): the history still holds them."""
        return tuple(sorted({s for r in self.records for s in r["skipped_steps"]}))

    def bundles(self) -> list[str]:
        return [str(self.run_dir / r["bundle"]) for r in self.records if r.get("bundle")]

    def _shown(self, bundle: Path | None) -> str | None:
        """A bundle as the record names it: relative to the run directory, as its step directory (the record moves
        with the run's folder), else its whole path."""
        if bundle is None:
            return None
        return Path(bundle).name if Path(bundle).parent == self.run_dir else str(bundle)

    def stop(self, step: int, why: str, bundle: Path | None) -> None:
        """A rollback refused at `step`: the run stops there. rollbacks.json and the stopping incident's bundle say
        so (its finding "rollback"), so the record never ends on a "recovered" that the run did not keep."""
        self.stopped = {"at_step": step, "bundle": self._shown(bundle), "why": why}
        if not self.writes:
            return
        self._write_file()  # the error raised next says what happened
        if bundle is not None:
            text = (f"The run stopped at step {step}: {why}. The attempts before it: "
                    + (", ".join(f"step {r['at_step']} ({r['outcome']['status']})" for r in self.records) or "none")
                    + ". Every rollback of the run is in rollbacks.json in the run's directory.")
            try:
                load_bundle(bundle).add_finding(ROLLBACK_FINDING, f"Rollback: the run stopped at step {step}", text,
                                                self.stopped)
            except Exception as exc:  # noqa: BLE001
                log.error("nanscan: could not add the stop to %s: %s: %s", bundle, type(exc).__name__, exc)

    def record(self, *, step: int, category: str, bundle: Path | None, restored_step: int, restored_from: str,
               skipped: list[dict], scale: float | None, quarantined: list[str], skip: tuple[str, str],
               write: bool = True) -> dict:
        entry = {"at_step": step, "category": category, "bundle": self._shown(bundle), "skip": skip[0],
                 "skip_why": skip[1], "restored_step": restored_step, "restored_from": restored_from,
                 "skipped_steps": sorted({s["step"] for s in skipped}),
                 "skipped_sample_ids": [s["sample_ids"] for s in skipped if s.get("sample_ids") is not None],
                 "skip_next": self.policy.skip_next, "factor": self.policy.factor, "loss_scale": scale,
                 "quarantined": quarantined, "outcome": {"status": "pending", "finite_steps": 0}}
        self.records.append(entry)
        # the finite steps of the restored state's lineage before it (NOTE: [recovered]), none an earlier rollback
        # abandoned
        abandoned = set(self.abandoned())
        self._reference = [e for e in self._history()
                           if e.step < restored_step and e.report.ok and e.step not in abandoned]
        self.quarantined.update(quarantined)
        self._skip_left = self.policy.skip_next
        self._factor_left = self.policy.factor_steps if self.policy.lr_scale is not None else 0
        self.writes = write
        self._write(entry)
        return entry

    # -- after it ---------------------------------------------------------------------------------------------------
    def after_check(self, step: int) -> None:
        """A finite check: count it toward the last rollback's outcome."""
        last = self.records[-1] if self.records else None
        if last is None or last["outcome"]["status"] != "pending" or step <= last["at_step"]:
            return
        last["outcome"]["finite_steps"] += 1
        if last["outcome"]["finite_steps"] >= self.settle:
            after = [e for e in self._history() if e.step > last["at_step"]][-self.settle:]
            last["outcome"].update(judge(self._reference, after, self._first_loss()))
            self._write(last)
            if last["outcome"]["status"] != "recovered":
                warn_user(f"nanscan: the rollback at step {last['at_step']} has not recovered the run: "
                          f"{last['outcome']['why']}" + (f" ({last['factor']})" if last["factor"] else "")
                          + "; the run goes on, and rollbacks.json says so", RollbackWarning)

    def failed_again(self, step: int) -> None:
        last = self.records[-1] if self.records else None
        if last is not None and last["outcome"]["status"] == "pending":
            last["outcome"].update(status="failed again", failed_at=step)
            self._write(last)

    def close(self) -> None:
        """The run ends (Monitor.close): the last rollback's count of finite steps so far goes into its record."""
        self.detach()
        last = self.records[-1] if self.records else None
        if last is not None and last["outcome"]["status"] == "pending":
            self._write(last)

    # -- the optimizer hooks: skip_next and the factor -----------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None or self._handles:
            return
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._skip_left > 0:  # dropped, never multiplied by 0 (NOTE: [rollback])
            drop_gradients(optimizer, self._held if self.keep_buffers else None)
        if self._factor_left > 0:
            self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self.policy.lr_scale

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        put_back(self._held)  # a framework's gradient buffers (DroppedUpdate's keep_buffers)
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs):
                group["lr"] = lr
            self._saved_lrs = None
            self._factor_left -= 1
        if self._skip_left > 0:
            self._skip_left -= 1
        if self._skip_left <= 0 and self._factor_left <= 0:
            self.detach()

    # -- the record -------------------------------------------------------------------------------------------------
    def _write_file(self) -> None:
        """rollbacks.json now; a failure is logged, never raised (the run goes on, or the error raised says why)."""
        try:
            write_rollbacks(self.run_dir, self.records, self.stopped)
        except Exception as exc:  # noqa: BLE001
            log.error("nanscan: could not write %s: %s: %s", self.run_dir / ROLLBACKS_FILE, type(exc).__name__, exc)

    def _write(self, entry: dict) -> None:
        """The run's rollbacks.json and the finding of the incident's bundle (NOTE: [rollback]); a failure to write
        is logged, never raised (the run goes on, and the error says what was not saved)."""
        if not self.writes:
            return
        self._write_file()
        if entry.get("bundle"):
            try:
                load_bundle(self.run_dir / entry["bundle"]).add_finding(
                    ROLLBACK_FINDING, f"Rollback: {describe(entry)}", markdown(entry), entry)
            except Exception as exc:  # noqa: BLE001
                log.error("nanscan: could not add the rollback to %s: %s: %s", entry["bundle"], type(exc).__name__,
                          exc)


def describe(entry: dict) -> str:
    """One line: what was restored, skipped and changed, and what happened next."""
    skipped = entry["skipped_steps"]
    span = f"steps {skipped[0]}-{skipped[-1]}" if len(skipped) > 1 else f"step {skipped[0]}" if skipped else "none"
    text = f"back to step {entry['restored_step']}'s start ({entry['restored_from']}); skipped {span}"
    if entry.get("skip"):  # older records have no skip
        text += f" (skip={entry['skip']}: {entry['skip_why']})"
    if entry["skip_next"]:
        text += f" and the next {entry['skip_next']} update(s)"
    if entry["factor"]:
        text += f"; {entry['factor']}"
    outcome = entry["outcome"]
    if outcome["status"] in ("recovered", "not recovered"):
        text += f"; {outcome['status']} after {outcome['finite_steps']} finite steps"
        if outcome.get("why"):  # older records carry no measure (NOTE: [recovered])
            text += f": {outcome['why']}"
    elif outcome["status"] == "failed again":
        text += f"; failed again at step {outcome['failed_at']}"
    else:
        text += f"; finite for {outcome['finite_steps']} step(s) since"
    return text


def markdown(entry: dict) -> str:
    lines = [f"The Monitor rolled the run back at step {entry['at_step']} (on_invalid=Rollback): "
             f"{describe(entry)}.", "",
             f"- restored: the model's weights and buffers and the optimizer's state of step "
             f"{entry['restored_step']}'s start, from {entry['restored_from']}; no generator rewound (the data goes "
             "on from where it was)"
             + (f"; the GradScaler's scale set to {entry['loss_scale']:g}" if entry["loss_scale"] is not None else ""),
             f"- skipped (updates undone, batches not fed again): steps {entry['skipped_steps']}"]
    if entry["skipped_sample_ids"]:
        ids = [i for step_ids in entry["skipped_sample_ids"]
               for i in (step_ids if isinstance(step_ids, (list, tuple)) else [step_ids])]
        shown = ", ".join(map(str, ids[:SHOWN_IDS])) + (", ..." if len(ids) > SHOWN_IDS else "")
        lines.append(f"- their sample ids: {len(ids)} ({shown}; every one in rollbacks.json, `skipped_sample_ids`)")
    if entry["quarantined"]:
        lines.append("- quarantined (rows of the failing batch that break a step by themselves: a NaN, an infinity or "
                     "an overflow value, or every target the ignore index): "
                     f"{entry['quarantined']}; a later step "
                     "whose batch holds one has its update dropped; `nanscan quarantine list` shows them, "
                     "`nanscan.skip_quarantined` keeps them out of the next run")
    lines.append(f"- factor changed: {entry['factor'] or 'none'}")
    outcome = entry["outcome"]
    lines.append(f"- what happened next: {outcome['status']}" + (f" ({outcome['why']})" if outcome.get("why") else ""))
    lines += ["", "Every rollback of the run is in rollbacks.json in the run's directory."]
    return "\n".join(lines)


def bad_row_ids(batch: Any, sample_ids: Any) -> list:
    """The names of the batch rows that break a step by themselves: rows holding a NaN, an infinity or an overflow
    value or whose targets are all the ignore index (engine.targets.breaking_rows). A row is
    named by its sample id where `sample_ids` names one per row, else by its content digest, "sha256:<hex>"
    (engine.record_digest.row_digests: the quarantine's match, NOTE: [quarantine match]); [] when neither names it
    (said in the log)."""
    ids = plain_ids(sample_ids)
    ids = list(ids) if isinstance(ids, (list, tuple)) and ids else None
    size = len(ids) if ids is not None else batch_size(batch)
    if batch is None or not size:
        return []
    rows = breaking_rows(batch, size)
    if not rows:
        return []
    if ids is not None:
        return [ids[i] for i in rows]
    digests, why = row_digests(batch, rows, size)
    if digests is None:
        log.warning("nanscan: the failing batch's rows %s cannot be quarantined: no sample ids, and %s; pass "
                    "sample_ids= to check()", rows, why)
        return []
    return [DIGEST_PREFIX + d for d in digests]


def is_digest(name: Any) -> bool:
    """A row named by its content digest (bad_row_ids), not by a sample id."""
    return isinstance(name, str) and name.startswith(DIGEST_PREFIX)


def quarantine_rows(bundle_dir: Path, rows: list, *, step: int, bundle: Path | None, stopped: bool = False) -> list:
    """Put the failing batch's bad rows (bad_row_ids) into the quarantine of `bundle_dir`; the ids added. `stopped`: the
    incident stopped the run instead of rolling it back."""
    if not rows:
        return []
    source = {"bundle": str(bundle) if bundle is not None else None, "step": step, "rollback": True}
    named = [NamedRecord(sample_id=None, sha256=(row,), source=source) if is_digest(row)
             else NamedRecord(sample_id=row, source=source) for row in rows]
    try:
        done = "where the run stopped" if stopped else "rolled back by the Monitor"
        add_records(bundle_dir, named, reason=f"a row that breaks a step by itself at step {step}, {done}",
                    by="nanscan rollback", at=f"step {step}")
    except Exception as exc:  # noqa: BLE001 - the rollback stands without it; said in the log
        log.error("nanscan: could not quarantine %s: %s: %s", rows, type(exc).__name__, exc)
        return []
    return list(rows)
