"""The Monitor's verdict on a step that is not finite, apart from its every-step path (nanscan.runtime.monitor):
the incident's evidence (report, history, batch, step-start RNG states, state), the bundle, the on_invalid policy,
GradScaler overflow skips and their streaks (nanscan.runtime.amp NOTE: [overflow skips]), and the spikes' warnings
and bundles (nanscan.runtime.spikes NOTE: [spike statistic]); with what a checked step keeps for them (StepStart,
PendingStep, SkipEvidence, retained), and the micro-batch path's last stage (NOTE: [check stages]).

StepVerdicts is a part of nanscan.runtime.monitor.Monitor (its base class): its methods read and set the Monitor's
state (model, optimizer, run_id, the history ring, the scaler watch, the spike watch, the bundle path), which
Monitor.__init__ sets up. nanscan.runtime.distributed's Agreement calls `incident` for each rank's part.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from nanscan.bundle import Incident, load_bundle, read_log_tail, unsaved_parts, write_bundle
from nanscan.bundle.format import RERUN_FINDING
from nanscan.bundle.provenance import RNG_SOURCES, capture_rng, environment
from nanscan.engine.headroom import overflowing_inputs
from nanscan.engine.inputs import optimizer_param_names, plain_ids
from nanscan.engine.pending import StepScan
from nanscan.engine.stats import PendingReport, ScanReport
from nanscan.incident import (INPUT_OVERFLOW, NONFINITE, OPTIMIZER_UPDATE, SKIP_STREAK, SPIKE, UPDATE, NonFiniteError,
                              SpikeWarning, categorize, reason_title, shown_names, update_message, warn_user)
from nanscan.runtime.amp import Streak, mixed_precision_record
from nanscan.runtime.distributed import all_gather_json
from nanscan.runtime.dropped_update import drop_gradients
from nanscan.runtime.incident_diagnosis import diagnose, record_diagnosis
from nanscan.runtime.incident_rerun import RerunResult, function_name, rerun_step
from nanscan.runtime.resume import CHECKPOINT_ERRORS, Resume, exit_for_restart, write_resume_checkpoint
from nanscan.runtime.rollback import (Rollback, RollbackWarning, bad_row_ids, chosen_skip, describe,
                                      quarantine_rows)
from nanscan.runtime.snapshot import CpuSnapshot
from nanscan.runtime.shards import placed_model_state, placed_optimizer_state
from nanscan.runtime.spikes import EPISODE_GAP, Spike, SpikeWatch, episode_start
from nanscan.runtime.stages import StepCheck
from nanscan.runtime.update import broken_by_update

log = logging.getLogger("nanscan")

_RNG_KEYS = {"torch": "torch_cpu", "numpy": "numpy", "python": "python"}  # a source's key in capture_rng's dict


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def scanned_report(host: Any, scan: Any, skipped: Any, step: int, scaling: Any) -> ScanReport:
    """A sync check's ScanReport: from the one-call host scan (a nanscan.engine.pending.HostScan), else from the
    launched StepScan (its flag on the device for a device scan)."""
    if host is not None:
        return ScanReport(host.tensors, host.records, skipped=skipped, backend=host.backend, step=step,
                          any_nonfinite=host.nonfinite, scaling=scaling)
    on_host = scan.on_host
    return ScanReport(scan.tensors, scan.records(), skipped=skipped, backend=scan.backend, step=step,
                      found_inf=None if on_host else scan.found_inf,
                      any_nonfinite=scan.nonfinite_on_host if on_host else None, scaling=scaling)


def _keep_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone() if tensor.device.type == "cpu" else tensor.detach()


def retained(value: Any, keep: Callable[[torch.Tensor], torch.Tensor] = _keep_tensor) -> Any:
    """A batch (or sample ids) as kept until the verdict of its step arrives one step later: CPU tensors and numpy
    arrays are copied (cheap, and the loop may refill its buffers in place), GPU tensors are kept by reference,
    not copied (a copy would cost GPU memory and bandwidth every step), so they must not be modified in place
    before the next check. Containers are rebuilt as the bundle stores them: mappings as dicts, tuples as tuples.
    `keep`: how a tensor is kept (nanscan.runtime.window copies GPU tensors to host buffers)."""
    if isinstance(value, torch.Tensor):
        return keep(value)
    if type(value) is dict:  # the usual batch, before the slower abstract-class checks
        return {k: retained(v, keep) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Mapping):
        return {k: retained(v, keep) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(retained(v, keep) for v in value)
    if isinstance(value, list):
        return [retained(v, keep) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kept = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(kept, f.name, retained(getattr(value, f.name), keep))
        return kept
    return value


class StepStart(NamedTuple):
    """What the forward pre-hook captured at a step's start (the RNG states, the snapshot holding the state); a
    tuple, made at every check (UpdateContext's reason)."""

    rng: dict | None
    snapshot: CpuSnapshot | None


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A checked step whose verdict has not been read yet (mode="async"), with what its bundle needs."""

    step: int
    report: PendingReport
    scan: StepScan
    slot: int  # its slot in the history ring
    batch: Any
    sample_ids: Any
    started: bool
    start: StepStart
    dated: Any = None  # the update before it, when dated by its verdict (nanscan.runtime.update.DatedUpdate)


@dataclasses.dataclass(frozen=True)
class SkipEvidence:
    """What a streak of overflow skips keeps of its first step, for the bundle if the streak becomes an incident."""

    report: ScanReport
    batch: Any
    sample_ids: Any
    started: bool
    rng: dict | None


class StepVerdicts:
    """The incident, overflow-skip and spike half of nanscan.runtime.monitor.Monitor (see the module docstring)."""

    # -- the incident ---------------------------------------------------------------------------------------
    def _invalid(self, report: ScanReport, step: int, batch: Any, sample_ids: Any, started: bool, *,
                 start: StepStart | None = None, read_at: str | None = None, slot: int | None = None) -> ScanReport:
        """Bundle the first non-finite step and apply on_invalid. read_at: None when decided at the step's own
        check; "next_check", "flush" or "close" when an async verdict was read then (start: the step's captures).
        Under a GradScaler an overflow skip goes to _overflow_skip instead (slot: the step's in the history)."""
        if self._dropped.covers(step):  # NOTE: [dropped update]: a step already dropped is no new incident
            self._drop_gradients()
            return report
        if self.is_overflow_skip(report):
            return self._overflow_skip(report, batch, sample_ids, started, start=start, read_at=read_at, slot=slot)
        category, tensors = categorize(report)
        deciding = self._deciding_micro
        bad = self._observed.first_bad(step) if category == "loss" else None
        if bad is not None:  # NOTE: [observed micro-batches]: the micro-batch whose loss went non-finite first
            batch, sample_ids, self._deciding_micro = bad.batch, bad.sample_ids, bad.micro
            self._deciding_observed = True
        try:
            return self._invalid_as(report, step, category, tensors, batch, sample_ids, started, start=start,
                                    read_at=read_at)
        finally:
            self._deciding_micro, self._deciding_observed = deciding, False

    def write_incident(self, incident: Incident) -> Path:
        """Write an incident's bundle: the run's first of its step in step-<N>, a later one in its own attempt
        directory (nanscan.bundle.format NOTE: [bundle attempts])."""
        attempt = self._bundle_attempts.get(incident.step, 0) + 1
        path = write_bundle(dataclasses.replace(incident, attempt=attempt), self.bundle_dir)
        self._bundle_attempts[incident.step] = attempt
        return path

    def attempt_of(self, step: int) -> int:
        """The attempt of the run's last bundle of `step` (NOTE: [bundle attempts]); 1 before any."""
        return self._bundle_attempts.get(step, 1)

    def _invalid_as(self, report: ScanReport, step: int, category: str, tensors: list[str], batch: Any,
                    sample_ids: Any, started: bool, *, start: StepStart | None, read_at: str | None) -> ScanReport:
        """_invalid's incident once its category is known: its bundle, then on_invalid."""
        reason = NONFINITE
        huge = overflowing_inputs(report.stats, (self._autocast or {}).get("dtype")) \
            if category in ("loss", "gradient") else []
        if huge:  # the step went bad computing on finite inputs it cannot hold: name them (NOTE: [overflow])
            category, tensors, reason = "input", huge, INPUT_OVERFLOW
        first = self.first_invalid_step is None
        if first:
            self.first_invalid_step = step
            try:
                incident = self.incident(report, step, category, tensors, batch, sample_ids, started, start=start,
                                         read_at=read_at)
                self.bundle_path = self.write_incident(dataclasses.replace(incident, reason=reason,
                                                                           rerun=self.rerun_record()))
            except Exception as exc:  # noqa: BLE001 - a failed write must not hide the NaN; it is reported below
                self.bundle_error = exc
                log.error("nanscan: could not write the evidence bundle for step %d: %s: %s", step,
                          type(exc).__name__, exc)
            self.rerun_incident(self.bundle_path, step, batch, started, start=start, read_at=read_at, report=report)
            self.diagnose_incident(self.bundle_path, step)
        else:
            self.invalid_steps += 1
        self._apply_policy(report, step, category, tensors, first, read_at=read_at,
                           why=reason_title(reason, step).lstrip(", ") or None, batch=batch, sample_ids=sample_ids)
        return report

    def rerun_record(self) -> dict | None:
        """The manifest's "rerun" (Incident.rerun) of an incident the Monitor reruns in the process, or None."""
        if self.step_fn is None:
            return None
        return {"step_fn": function_name(self.step_fn), "timeout_s": self.rerun_timeout,
                "diagnose": self.diagnose, "diagnose_timeout_s": self.diagnose_timeout}

    def diagnose_incident(self, path: Path | None, step: int) -> None:
        """Monitor(step_fn=..., diagnose=True): rerun the window in the process and change one factor at a time over
        it, adding what it found to the bundle at `path` (nanscan.runtime.incident_diagnosis NOTE: [in-process
        diagnosis]). Never raises: the incident goes on to on_invalid whatever the diagnosis does."""
        if self.step_fn is None or not self.diagnose:
            return
        armed, self._armed = self._armed, False  # the reruns' forwards are no step's start
        try:
            group = self._agreement
            result = diagnose(self.model, self.optimizer, self.step_fn, path, step=step,
                              timeout=self.diagnose_timeout, forward=self._given_ref(),
                              group=group.group if group is not None else None,
                              device=group.device if group is not None else None,
                              tensor_source=self.tensor_source)
        finally:
            self._armed = armed
        self.diagnosis = result
        if path is None:
            return
        try:
            record_diagnosis(result, load_bundle(path, whole_set=False))
        except Exception as exc:  # noqa: BLE001 - the bundle stands without the finding; the message still says it
            log.error("nanscan: could not add the in-process diagnosis to %s: %s: %s", path, type(exc).__name__, exc)

    def rerun_incident(self, path: Path | None, step: int, batch: Any, started: bool, *, start: StepStart | None,
                        read_at: str | None, sharded: str | None = None, report: ScanReport | None = None) -> None:
        """Monitor(step_fn=...): rerun the failing step in the process and add what it found to its bundle at
        `path` (nanscan.runtime.incident_rerun NOTE: [in-process rerun]); `sharded`: why this rank's weights cannot
        be rerun alone; `report`: the check's, compared bit for bit with the rerun. Never raises: the incident goes on
        to on_invalid whatever the rerun does."""
        if self.step_fn is None:
            return
        start = start if start is not None else StepStart(self._rng, self._snapshot)
        state, reason = None, sharded
        if batch is None:
            reason = "check() was given no batch, so there is nothing to rerun the step on"
        elif read_at is not None and reason is None:
            if started and start.snapshot is not None:
                state = start.snapshot.result()
            else:
                reason = (f"the verdict was read at {read_at.replace('_', ' ')}, after the step's update, and "
                          "snapshot='none' kept no copy of the state the step started from (snapshot='cpu' does)")
        if reason is not None:
            result = RerunResult(step, function_name(self.step_fn), "not run", reason=reason)
        else:
            armed, self._armed = self._armed, False  # the rerun's forward is no step's start
            try:
                result = rerun_step(self.model, self.optimizer, self.step_fn, batch, step=step,
                                    rng=start.rng if started else None, autocast=self._autocast,
                                    micro_batch=self._deciding_micro, state=state, timeout=self.rerun_timeout,
                                    in_group=self._agreement is not None, checked=report,
                                    gradients_comparable=self._deciding_micro is None and not self._deciding_observed
                                    and (report is None or report.scaling is None),
                                    grad_scale=report.scale if report is not None else None)
            finally:
                self._armed = armed
        self.rerun = result
        if path is None:
            return
        try:
            load_bundle(path, whole_set=False).add_finding(RERUN_FINDING, f"Rerun in process: {result.headline()}",
                                                           result.markdown(), result.to_dict())
        except Exception as exc:  # noqa: BLE001 - the bundle stands without the finding; the message still says it
            log.error("nanscan: could not add the in-process rerun's finding to %s: %s: %s", path,
                      type(exc).__name__, exc)

    def update_incident(self, report: ScanReport, context: Any, *, tensors: list[str] | None = None,
                        seen_at: int | None = None) -> None:
        """Bundle a non-finite optimizer update (nanscan.runtime.update NOTE: [post-update check]) as the incident
        of the step whose check it followed, and apply on_invalid (raising from inside optimizer.step() in
        mode="sync"). `report`: the scan after the update, or (seen_at: that check's step) the next check's
        scan, whose non-finite `tensors` only the update wrote (NOTE: [dated updates]); `context`: the
        check's UpdateContext."""
        step, tensors = context.step, broken_by_update(report) if tensors is None else tensors
        read_at = "next_check" if self.mode == "async" else None
        self.first_invalid_step = step
        try:
            incident = self.incident(report, step, UPDATE, tensors, context.batch, context.sample_ids,
                                     context.started, start=context.start, read_at=read_at)
            if not incident.state_pre_step:
                incident = dataclasses.replace(incident, state_note=(
                    "snapshot='none': the weights and optimizer state are those the update wrote (non-finite), "
                    "not the ones it read; snapshot='cpu' keeps the pre-step state, from which replay reruns the "
                    "update"))
            if seen_at is not None:
                incident = dataclasses.replace(incident, state_note=(
                    f"{incident.state_note}; " if incident.state_note else "") + (
                    f"dated at the check of step {seen_at}: the gradients and statistics are that step's, computed "
                    f"from the weights the update of step {step} wrote"))
            self.bundle_path = self.write_incident(dataclasses.replace(incident, reason=OPTIMIZER_UPDATE))
        except Exception as exc:  # noqa: BLE001 - a failed write must not hide the NaN; it is reported below
            self.bundle_error = exc
            log.error("nanscan: could not write the evidence bundle for step %d: %s: %s", step,
                      type(exc).__name__, exc)
        self._apply_policy(report, step, UPDATE, tensors, True, read_at=read_at, update=True, seen_at=seen_at)

    def _dated_incident(self, report: ScanReport, dated: Any, step: int) -> bool:
        """Whether the non-finite check of `step` is the incident of the update before it (NOTE: [dated updates]),
        which is then bundled and acted on."""
        if self.first_invalid_step is not None:  # mode="async": an earlier step's verdict was the incident
            return False
        broken = dated.broken(report)
        if broken:
            self.update_incident(ScanReport(report.tensors, report.records, skipped=report.skipped,
                                            backend=report.backend, step=dated.context.step, any_nonfinite=True,
                                            scaling=report.scaling), dated.context, tensors=broken, seen_at=step)
        return bool(broken)

    def _keep_start_snapshot(self) -> None:
        """Keep the step-start snapshot just taken past the next step's start (a verdict or a dated update read
        at the next check needs it), by capturing the next one into the other buffer."""
        if self._snapshot is not None:
            spare = self._spare_snapshot if self._spare_snapshot is not None else self._snapshot.spare()
            self._snapshot, self._spare_snapshot = spare, self._snapshot

    def _decide_micro(self, check: StepCheck) -> ScanReport:
        """A micro-batch check's last stage (NOTE: [check stages]): decide it at once. No history, spike statistic,
        export or armed update; a GradScaler's overflow is left to the step's own check, whose skip it is.

        NOTE: [micro-batch checks]
        Under gradient accumulation the step's own check, after the last micro-batch, sees gradients summed over
        every micro-batch and, under DDP's no_sync(), already averaged over the ranks: the micro-batch and the
        rank that went bad first are lost (every rank's gradients are non-finite, the last micro-batch's batch and
        loss are finite). check(micro_batch=True) after each earlier micro-batch's backward scans the same inputs
        (that micro-batch, its loss, the gradients so far, the weights and state) and decides at once, so a
        non-finite one is the incident of the step being accumulated, at that micro-batch (its index in the
        bundle's manifest and INCIDENT.md), with that micro-batch as the batch. Under a process group the ranks
        agree on each micro-batch check as on a step's (every rank makes the same checks in lockstep), and
        before the all-reduce each rank's gradients are its own, so the first bad rank is the one whose
        micro-batch went bad. It is no step: the step counter, the history ring and the spike statistic (whose
        gradient norms a partial sum would skew) see only the step's own check; a GradScaler overflow at a
        micro-batch is left to that check, whose skip it is; and in mode="async" the pending step's verdict is
        read first and the micro-batch's scan is waited for (a host sync per micro-batch: a diagnostic's cost)."""
        step, batch, sample_ids, started = check.step, check.batch, check.sample_ids, check.started
        report = scanned_report(check.host, check.scan, check.skipped, step, check.scaling)
        self._deciding_micro = check.micro
        try:
            if self._agreement is not None:
                return self._agreement.decide(self, report, step, batch, sample_ids, started)
            if report.ok or self.is_overflow_skip(report):
                return report
            if check.dated is not None and self._dated_incident(report, check.dated, step):
                return report
            return self._invalid(report, step, batch, sample_ids, started)
        finally:
            self._deciding_micro = None

    # -- GradScaler overflow skips (nanscan.runtime.amp NOTE: [overflow skips]) ----------------------------------------
    def finite_step(self, step: int) -> None:
        """A step decided finite: it ends an overflow-skip streak and counts toward a rollback's outcome."""
        if self._scaler is not None:
            self._scaler.end_streak()
        if self._rollbacks is not None:
            self._rollbacks.after_check(step)

    def is_overflow_skip(self, report: ScanReport) -> bool:
        """Whether a non-finite step is this Monitor's GradScaler's expected overflow skip."""
        return self._scaler is not None and self._scaler.is_skip(report)

    def agreed_overflow_skip(self, report: ScanReport, slot: int | None) -> bool:
        """Under a process group, a step every rank's scaler skipped (nanscan.runtime.distributed NOTE: [agreed
        skips]): record the skip (`slot`: the step's record in the history ring); False where the streak has
        become an incident, which the group then decides as one (every rank counts the same skips)."""
        report.overflow_skip = True
        if slot is not None:
            self._ring.mark_overflow_skip(slot)
        return self._scaler.record_skip(report, None) is None

    def _overflow_skip(self, report: ScanReport, batch: Any, sample_ids: Any, started: bool, *,
                       start: StepStart | None, read_at: str | None, slot: int | None) -> ScanReport:
        """Record an expected overflow skip; bundle its streak, from the streak's first step, once the streak has
        become an incident, and apply on_invalid to it then. Only a streak's first step is kept: its batch as
        retained keeps a pending step's (an async verdict's batch is already retained)."""
        report.overflow_skip = True
        if slot is not None:
            self._ring.mark_overflow_skip(slot)
        evidence = None
        if self._scaler.streak is None:
            rng = (start.rng if start is not None else self._rng) if started else None
            evidence = SkipEvidence(report, batch if read_at else retained(batch),
                                     sample_ids if read_at else retained(sample_ids), started, rng)
        streak = self._scaler.record_skip(report, evidence)
        if streak is None:
            return report
        first, step = streak.first, streak.first_step
        category, tensors = categorize(first.report)
        if self.first_invalid_step is None:
            self.first_invalid_step = step
            try:
                self.bundle_path = self.write_incident(self._streak_incident(streak, category, tensors, read_at))
            except Exception as exc:  # noqa: BLE001 - a failed write must not hide the streak; reported below
                self.bundle_error = exc
                log.error("nanscan: could not write the evidence bundle for step %d: %s: %s", step,
                          type(exc).__name__, exc)
            first_incident = True
        else:
            self.invalid_steps += 1
            first_incident = False
        self._apply_policy(report, step, category, tensors, first_incident, read_at=read_at, streak=streak.reason)
        return report

    def _streak_incident(self, streak: Streak, category: str, tensors: list[str], read_at: str | None) -> Incident:
        """The incident of a streak of overflow skips: its first step's report, batch and RNG, the state now (no
        update was applied since that step's start), the scale history."""
        first = streak.first
        incident = self.incident(first.report, streak.first_step, category, tensors, first.batch, first.sample_ids,
                                 first.started, start=StepStart(first.rng, None), read_at=read_at)
        note = (f"a streak of {len(streak.skips)} GradScaler overflow skips from step {streak.first_step}: no update "
                f"was applied since that step's start, so weights and optimizer state are the ones it started from; "
                "buffers updated by the forward pass (e.g. BatchNorm statistics) include the later batches")
        return dataclasses.replace(incident, reason=SKIP_STREAK, state_note=note, state_pre_step=False,
                                   mixed_precision=mixed_precision_record(self._scaler, self._autocast, streak))

    def incident(self, report: ScanReport, step: int, category: str, tensors: list[str], batch: Any,
                 sample_ids: Any, started: bool, *, start: StepStart | None = None,
                 read_at: str | None = None) -> Incident:
        """The evidence of a non-finite step as write_bundle takes it: the report, the history, the batch, the
        step-start RNG states and the state (the snapshot's when it was taken at this step's start). Also what
        nanscan.runtime.distributed's Agreement writes each rank's part from."""
        model = self.model
        if start is None:
            start = StepStart(self._rng, self._snapshot)
        rng = dict(start.rng) if started and start.rng is not None else {}
        rng_at = {source: "step_start" for source in RNG_SOURCES if _RNG_KEYS[source] in rng}
        late = tuple(source for source in RNG_SOURCES if source not in rng_at)
        rng.update(capture_rng(late))
        # Taken now: at the step's own check, or (async) where its verdict was read.
        rng_at.update({source: "next_check" if read_at == "next_check" else "check" for source in late})
        if started and start.snapshot is not None:
            model_state, optimizer_state = start.snapshot.result()
            pre_step, note = True, ""
        else:
            model_state, optimizer_state = self._plan.state(model, self.optimizer)  # NOTE: [tensor source]
            pre_step = False
            if self._snapshot is not None:
                note = "snapshot='cpu' but no training forward of the model was seen since the previous check"
            elif read_at == "next_check":
                note = (f"mode='async', snapshot='none': the verdict arrived at the next check, so weights and "
                        f"optimizer state include step {step}'s update unless it was skipped (report.found_inf "
                        "given to a fused optimizer, or no optimizer.step()), and buffers updated by the forward "
                        "pass (e.g. BatchNorm statistics) include the next batch; snapshot='cpu' keeps the exact "
                        "pre-step state")
            elif read_at is not None:
                note = (f"mode='async', snapshot='none': the verdict was read at {read_at}(); weights and optimizer "
                        f"state include step {step}'s update if optimizer.step() ran after its check; buffers "
                        "updated by the forward pass (e.g. BatchNorm statistics) already include this batch")
            else:
                note = ("snapshot='none': weights and optimizer state before this step's update; buffers updated "
                        "by the forward pass (e.g. BatchNorm statistics) already include this batch")
        return Incident(
            run_id=self.run_id, step=step, category=category, tensors=tensors, report=report, detected_at=_now(),
            history=self._history_entries(), batch=batch, sample_ids=sample_ids, config=self.config,
            source=self.source, environment=environment(report.backend), rng=rng, rng_captured_at=rng_at,
            model_state=model_state, optimizer_state=optimizer_state, state_pre_step=pre_step, state_note=note,
            logs=[read_log_tail(p) for p in self.log_files], replay_entry=self.replay_entry,
            mixed_precision=mixed_precision_record(self._scaler, self._autocast),
            spikes=[spike.to_dict() for spike in self.spikes], micro_batch=self._deciding_micro,
            micro_batch_observed=self._deciding_observed,
            frozen=self._frozen_keys(model), window=self._window.record(step) if self._window is not None else None,
            optimizer_params=optimizer_param_names(model, self.optimizer) if optimizer_state is not None else None,
            abandoned_steps=self._rollbacks.abandoned() if self._rollbacks is not None else (),
        )

    def _frozen_keys(self, model: torch.nn.Module) -> list[str]:
        """What the bundle holds of the model's frozen weights by reference (Monitor(frozen_weights=...))."""
        keys = getattr(self._plan, "frozen_keys", None)  # NOTE: [tensor source]: optional
        return keys(model) if keys is not None and self.frozen_weights == "digest" else []

    def _message(self, step: int, category: str, tensors: list[str], read_at: str | None = None,
                 streak: str | None = None, update: bool = False, why: str | None = None,
                 seen_at: int | None = None) -> str:
        why = f", {why}" if why else ""
        micro = f" at micro-batch {self._deciding_micro}" if self._deciding_micro is not None else ""
        text = f"nanscan: non-finite values at step {step}{micro} (category {category}{why}: {shown_names(tensors)})"
        if update:
            text = (f"nanscan: non-finite values written by {update_message(step)} (category {category}: "
                    f"{shown_names(tensors)}), right after optimizer.step(); everything checked before it was finite")
            if seen_at is not None:  # NOTE: [dated updates]
                text = (f"nanscan: non-finite values written by {update_message(step)} (category {category}: "
                        f"{shown_names(tensors)}), seen at the check of step {seen_at}: they were finite at step "
                        f"{step}'s check and nothing else wrote them since")
        if streak:
            text += f"; GradScaler skipped every step since: {streak}"
        if self.rerun is not None and step == self.first_invalid_step and not update and not streak:
            text += f"; rerun in process: {self.rerun.headline()}"
        if self.diagnosis is not None and step == self.first_invalid_step and not update and not streak:
            text += f"; diagnosis over the window in process: {self.diagnosis.headline()}"
        if read_at == "next_check" and seen_at is None:
            text += (f"; mode='async': detected at the next check, after step {step}'s optimizer.step() (pass "
                     "report.found_inf to a fused optimizer to skip that update on the GPU, or call Monitor.flush() "
                     "before optimizer.step() to decide each step before its update)")
        if self.bundle_path is not None:
            where = "evidence" if step == self.first_invalid_step else \
                f"first incident at step {self.first_invalid_step}, evidence"
            unsaved = unsaved_parts(self.bundle_path)  # NOTE: [write faults] in nanscan/bundle/write.py
            missing = f"; not saved: {'; '.join(unsaved)}" if unsaved else ""
            return f"{text}; {where} in {self.bundle_path} (see `nanscan report {self.bundle_path}`){missing}"
        if self.bundle_error is not None:
            return f"{text}; the evidence bundle could not be written: {self.bundle_error}"
        return text

    def _apply_policy(self, report: ScanReport, step: int, category: str, tensors: list[str], first: bool, *,
                      read_at: str | None = None, streak: str | None = None, update: bool = False,
                      why: str | None = None, seen_at: int | None = None, batch: Any = None,
                      sample_ids: Any = None) -> None:
        """on_invalid for a non-finite step (streak: why a streak of overflow skips from `step` is an incident;
        update: the post-update check found it, nanscan.runtime.update; why: what the deciding tensors are, when
        they are not the non-finite ones; batch, sample_ids: the failing step's, for a rollback's quarantine)."""
        policy = self.on_invalid
        if isinstance(policy, Rollback):
            message = self._message(step, category, tensors, read_at, streak, update, why, seen_at)
            self.roll_back(step, category, tensors, message, live_start=read_at is None and not update,
                           batch=batch, sample_ids=sample_ids)
            return
        if isinstance(policy, Resume):
            message = self._message(step, category, tensors, read_at, streak, update, why, seen_at)
            try:
                checkpoint, kept = self.resume_checkpoint(step)
            except CHECKPOINT_ERRORS as exc:
                raise NonFiniteError(f"{message}; on_invalid=Resume: no checkpoint to resume from was written: {exc}",
                                     bundle_path=self.bundle_path, step=step, category=category,
                                     tensors=tensors) from self.bundle_error
            exit_for_restart(message, policy, bundle_path=self.bundle_path, checkpoint=checkpoint, step=kept)
        if policy == "raise":
            raise NonFiniteError(self._message(step, category, tensors, read_at, streak, update, why, seen_at),
                                 bundle_path=self.bundle_path, step=step, category=category,
                                 tensors=tensors) from self.bundle_error
        if policy == "skip":
            self._drop_gradients()
            if read_at is None and not update:  # its later micro-batches' gradients too (NOTE: [dropped update])
                self._dropped.arm(self.optimizer, step)
        if policy in ("warn", "skip"):
            if first:
                warn_user(self._message(step, category, tensors, read_at, streak, update, why, seen_at))
            return
        policy(report, self.bundle_path)

    def resume_checkpoint(self, step: int, *, group: Any = None, device: Any = None) -> tuple[Path, int]:
        """on_invalid=Resume: the checkpoint a restart of the incident of `step` begins from (NOTE: [resume
        elsewhere]), written from this process's bundle, or under a process group by rank 0 from the whole set
        once every rank wrote its part, the ranks agreeing on the result; CHECKPOINT_ERRORS with why none was
        written."""
        first = episode_start([s.step for s in self.spikes], step)
        if group is None:
            return write_resume_checkpoint(self.on_invalid, self.bundle_path, self.run_id, first)
        dist.barrier(group=group)  # every rank's part is written
        result: dict = {}
        if dist.get_rank(group) == 0:
            try:
                path, kept = write_resume_checkpoint(self.on_invalid, self.bundle_path.parent
                                                     if self.bundle_path is not None else None, self.run_id, first)
                result = {"path": str(path), "step": kept}
            except CHECKPOINT_ERRORS as exc:
                result = {"error": f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)}
        agreed = all_gather_json(result, group, device)[0]
        if "error" in agreed:
            raise ValueError(agreed["error"])
        return Path(agreed["path"]), int(agreed["step"])

    def roll_back(self, step: int, category: str, tensors: list[str], message: str, *, live_start: bool,
                  batch: Any = None, sample_ids: Any = None, ledger: bool = True, rows: list | None = None) -> None:
        """on_invalid=Rollback(...) at the incident of `step` (nanscan.runtime.rollback NOTE: [rollback]): restore the
        chosen kept state, drop this step's gradients, record it, and let the run go on; or raise NonFiniteError
        (every attempt's bundle named) when the limits say the failure came back. `live_start`: the live weights are
        still the step's own start (a check before its update). `ledger`: write the run's rollbacks.json and the
        finding (one rank of a process group does). `rows`: the bad rows of every rank's batch (bad_row_ids), which
        a process group gathered; else this batch's."""
        rollbacks = self._rollbacks
        refusal = rollbacks.refusal(step)
        found = None
        first = episode_start([s.step for s in self.spikes], step)
        bad_rows = rows if rows is not None else bad_row_ids(batch, sample_ids)
        skip = chosen_skip(rollbacks.policy, category, bad_rows, first, step)
        if refusal is None and not (skip[0] == "step" and live_start):
            if skip[0] == "step":  # decided after the step's update: its own start is the newest state before it
                first = step
            try:
                found = self._window.state_at_or_before(first)
            except ValueError as exc:
                refusal = f"on_invalid=Rollback: {exc}"
            else:
                if found is None:
                    refusal = (f"on_invalid=Rollback: the window keeps no state from at or before step {first} (it "
                               f"keeps {self._window.kept_states() or 'none'}); a longer window (Window(steps=...)) "
                               "reaches further back")
        rollbacks.failed_again(step)  # an earlier rollback that had not settled yet
        if refusal is not None:
            if ledger:  # its bad rows too, so the next run keeps them out
                quarantine_rows(self.bundle_dir, bad_rows, step=step, bundle=self.bundle_path, stopped=True)
                rollbacks.stop(step, refusal.removeprefix("on_invalid=Rollback: "), self.bundle_path)
            # each attempt's bundle once (the last may be the stopping one's)
            bundles = list(dict.fromkeys([*rollbacks.bundles(), *([str(self.bundle_path)]
                                                                  if self.bundle_path is not None else [])]))
            raise NonFiniteError(f"{message}; {refusal}; the bundles of every attempt: {', '.join(bundles)}",
                                 bundle_path=self.bundle_path, step=step, category=category,
                                 tensors=tensors) from self.bundle_error
        model, optimizer = self.model, self.optimizer
        if found is None:  # skip="step" at a check before the update: the live state is the step's own start
            restored_step, restored_from, scale = step, "the live state at its check, before its update", None
            skipped = [{"step": step, "sample_ids": plain_ids(sample_ids)}]
        else:
            kept, (model_state, optimizer_state), _, scale = found
            restored_step = kept.step
            restored_from = f"the window's state kept at step {restored_step}"
            skipped = self._window.steps_between(restored_step, step) or [{"step": step,
                                                                            "sample_ids": plain_ids(sample_ids)}]
            if self.tensor_source is not None:  # a framework's buffers, in place; its step counters go on
                self.tensor_source.load_state(model, optimizer, model_state, optimizer_state, progress=False)
            else:  # in place; frozen weights are not in it; a sharded model's kept local shards back into its DTensors
                model.load_state_dict(placed_model_state(model, model_state), strict=False)
                if optimizer is not None and optimizer_state is not None:
                    optimizer.load_state_dict(placed_optimizer_state(optimizer, copy.deepcopy(optimizer_state)))
            # No generator is rewound: torch's, numpy's and Python's drive the data as much as the model (train.py's
            # get_batch draws with torch.randint), so the skipped batches would be drawn again (NOTE: [rollback]).
            if scale is not None and self._scaler is not None and self._scaler.scaler.is_enabled():
                self._scaler.scaler.update(new_scale=float(scale))
            self._window.restart(kept, step + 1)
        self._drop_gradients()
        if self._spike_watch is not None:  # its statistic held the abandoned steps
            self._spike_watch = SpikeWatch(self._spike_watch.rule)
        quarantined = quarantine_rows(self.bundle_dir, bad_rows, step=step,
                                      bundle=self.bundle_path) if ledger else bad_rows
        entry = rollbacks.record(step=step, category=category, bundle=self.bundle_path if ledger else None,
                                 restored_step=restored_step, restored_from=restored_from, skipped=skipped,
                                 scale=scale, quarantined=quarantined, skip=skip, write=ledger)
        rollbacks.attach(optimizer)
        if live_start:  # before the step's update: its later micro-batches' gradients too (NOTE: [dropped update])
            self._dropped.arm(optimizer, step)
        # the next incident is bundled (and rerun, and diagnosed) again
        self.first_invalid_step, self.rerun, self.diagnosis = None, None, None
        warn_user(f"{message}; rolled back: {describe(entry)}", RollbackWarning)

    def _drop_quarantined(self, step: int, batch: Any, sample_ids: Any) -> None:
        """At every check and observe (NOTE: [dropped update]): one of another step ends a dropped step; a batch
        holding a record a rollback quarantined in this run has its step's update dropped, said once a step. Under
        a process group the ranks drop it together: this rank's finding goes into the step's agreement
        (quarantine_held), which drops it on every rank (drop_update), as a replica must."""
        self._dropped.seen(step)
        held = self._rollbacks.quarantined_in(batch, sample_ids) if self._rollbacks is not None else []
        if not held:
            return
        if step not in self._dropped.quarantined_steps and self._held_step != step:
            shown = ", ".join(map(str, held[:5])) + (", ..." if len(held) > 5 else "")
            warn_user(f"nanscan: the batch of step {step} holds {len(held)} record(s) that a rollback of this run "
                      f"quarantined ({shown}): the step's update is dropped, so the record never reaches the weights "
                      "again (filter it out of the data with nanscan.skip_quarantined)", RollbackWarning)
        if self._agreement is not None:
            self._held_step = step
        else:
            self.drop_update(step)

    def quarantine_held(self, step: int) -> bool:
        """Whether a batch of `step` on this rank held a quarantined record (_drop_quarantined)."""
        return self._held_step == step

    def drop_update(self, step: int) -> None:
        """Drop `step`'s update, whatever the loop calls, because a batch of it held a quarantined record (on any
        rank of a group: the agreement decided it)."""
        self._dropped.arm(self.optimizer, step, quarantined=True)

    def update_dropped(self, step: int) -> bool:
        """Whether `step`'s update is already dropped (NOTE: [dropped update]): a failure in it is no new incident."""
        return self._dropped.covers(step)

    def _drop_gradients(self) -> None:
        """Set every gradient to None, so torch optimizers skip every parameter and optimizer.step() changes
        nothing (zeroed gradients would not do: Adam's momentum would still move the weights)."""
        for p in self.model.parameters():
            p.grad = None
        # it may also update parameters outside the model; a framework's optimizer (a TensorSource's) steps over
        # its own gradient buffers, taken only at its step (NOTE: [dropped update])
        if self.optimizer is not None and self.tensor_source is None:
            drop_gradients(self.optimizer)

    # -- spikes (nanscan.runtime.spikes NOTE: [spike statistic]) ------------------------------------------------------
    def _spike_at_check(self, report: ScanReport, step: int, batch: Any, sample_ids: Any,
                        started: bool, summary: Any = None) -> ScanReport:
        """Judge a finite sync step; at a spike, act on it and return the report carrying it. `summary`: the host
        scan's StepSummary, whose sums the statistic takes instead of reading the records again."""
        spike = self._spike_watch.observe_host(step, report, summary)
        if spike is None:
            return report
        if self.on_spike == "skip":
            self._drop_gradients()
            report = ScanReport(report.tensors, report.records, skipped=report.skipped, backend=report.backend,
                                step=step, found_inf=torch.ones_like(report.found_inf), any_nonfinite=False,
                                scaling=report.scaling)
        report.spike = self._spike_found(spike, report, step, batch, sample_ids, started)
        return report

    def _spike_on_device(self, step: int, scan: Any, tensors: tuple, scaling: Any) -> Any:
        """Judge an async step where its records are (no host sync); returns the found_inf its report gives: with
        spikes="skip", the non-finite flag and the spike flag combined on the device, else None (the scan's)."""
        if self._spike_watch is None:
            return None
        spiked = self._spike_watch.observe_device(step, scan, tensors, scaling)
        return torch.maximum(scan.found_inf, spiked) if self.on_spike == "skip" else None

    def _read_spike(self, pending: PendingStep, read_at: str) -> None:
        """Read a finite async step's spike verdict (judged on the device with its scan) and act on it."""
        read = self._spike_watch.read() if self._spike_watch is not None else None
        if read is None or read[0] != pending.step or not read[1]:
            return
        spike = self._spike_watch.spike_of(pending.step, read[1])
        self._decided_spike = self._spike_found(spike, pending.report.result(), pending.step, pending.batch,
                                                pending.sample_ids, pending.started, start=pending.start,
                                                read_at=read_at)

    def _spike_found(self, spike: Spike, report: ScanReport, step: int, batch: Any, sample_ids: Any, started: bool,
                     *, start: StepStart | None = None, read_at: str | None = None) -> Spike:
        """Keep a spike, bundle it (the run's first; every episode's first with spikes="bundle") and warn, raise
        or call spikes(spike, bundle_path). Spikes within EPISODE_GAP steps of the previous are one episode."""
        new_episode = not self.spikes or step - self.spikes[-1].step > EPISODE_GAP
        if new_episode or callable(self.on_spike):
            spike = self._spike_watch.attributed(spike, self._ring.entries())  # copies the history: at spikes only
        self.spikes.append(spike)
        bundle_path = None
        if new_episode and (self.on_spike == "bundle" or len(self.spikes) == 1):
            bundle_path = self._spike_bundle(spike, report, step, batch, sample_ids, started, start, read_at)
        if callable(self.on_spike):
            self.on_spike(spike, bundle_path)
            return spike
        warning = SpikeWarning(self._spike_message(spike, bundle_path, read_at), step=step, quantity=spike.quantity,
                               spike=spike, bundle_path=bundle_path)
        if self.on_spike == "raise":
            raise warning
        if new_episode:
            warn_user(warning)
        return spike

    def _spike_bundle(self, spike: Spike, report: ScanReport, step: int, batch: Any, sample_ids: Any,
                      started: bool, start: StepStart | None, read_at: str | None) -> Path | None:
        try:
            path = self.write_incident(self.incident(report, step, SPIKE, spike.tensors, batch, sample_ids, started,
                                                     start=start, read_at=read_at))
        except Exception as exc:  # noqa: BLE001 - a failed write must not stop training; the warning goes out
            log.error("nanscan: could not write the spike bundle for step %d: %s: %s", step, type(exc).__name__, exc)
            return None
        if self.spike_bundle_path is None:
            self.spike_bundle_path = path
        return path

    def _spike_message(self, spike: Spike, bundle_path: Path | None, read_at: str | None) -> str:
        text = f"nanscan: {spike.describe()}"
        if read_at == "next_check":
            text += "; mode='async': read at the next check (spikes='skip' skips it through report.found_inf)"
        if bundle_path is not None:
            text += f"; evidence in {bundle_path} (see `nanscan report {bundle_path}`)"
        return text + ". Values are still finite: this is an early warning, not an invalid step"


