"""Monitor.check() as its stages (NOTE: [check stages]): what one check carries from stage to stage (StepCheck) and
a way through them (CheckPath), so that a new every-step feature joins as a stage, not as a branch in check().

NOTE: [check stages]
A check prepares (its step number, the step start it closes, the update before it, the batch plan's inputs, the
GradScaler's state, the mode), then takes one of three paths, each a tuple of stages over one StepCheck and a last
stage that decides the step and acts on the verdict:
  sync   scan (plans confirmed and scanned in one native call on the CPU, else launched), count, window (the
         run's window, nanscan.runtime.window NOTE: [run window]), record (the history ring and the live export),
         spike (a finite step against its recent range)
         -> decide alone or with the other ranks, and act: raise, skip or warn (nanscan.runtime.verdict)
  async  read the inputs, count, decide the pending step (the previous check's verdict, acted on now), window,
         launch, record, spike on the device
         -> keep the step pending, return its PendingReport
  micro  scan, count, window
         -> decide at once (nanscan.runtime.verdict NOTE: [micro-batch checks])
Stages run in their path's order, once each; each reads and fills the StepCheck and returns nothing, the last returns
what check() returns. A new every-step feature (a window of kept states, a replica comparison, a rollback) is a
stage placed in the paths it belongs to, or a step of the last one's verdict; the body of check() stays as it is.
A stage whose feature is off returns at once (as the live export's does), so a path costs what its features cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


@dataclass(slots=True, eq=False)
class StepCheck:
    """One check(): its arguments as the stages use them, and what each stage leaves for the next."""

    model: Any  # the plain model (unwrapped), resolved once
    step: int
    batch: Any
    loss: Any  # a tensor, or None
    sample_ids: Any
    lr: Any  # the caller's, else the optimizer's first group's (set by the count stage)
    started: bool  # a step start (forward pre-hook, begin_step) was seen since the previous check
    micro: int | None  # a micro-batch check's index within its step, or None (NOTE: [micro-batch checks])
    step_inputs: Any  # the batch plan's inputs: input: and loss (nanscan.engine.plans.StepInputs)
    scaling: Any  # the GradScaler's state before the scan (nanscan.runtime.amp NOTE: [overflow skips])
    carried: Any = None  # records a finite post-update scan carries in (NOTE: [carried records])
    dated: Any = None  # the dated update before this check (NOTE: [dated updates])
    passed_loss: Any = None  # the loss as the loop passed it, before observed losses join (NOTE: [observed loop])
    host: Any = None  # the one-call host scan (nanscan.engine.pending.HostScan), when the plan ran one
    inputs: Any = None  # else the check's ScanInputs
    scan: Any = None  # and their launched StepScan
    report: Any = None  # sync: the ScanReport the verdict is taken on
    slot: int | None = None  # the step's slot in the history ring
    found_inf: Any = None  # async: the flag its report gives a fused optimizer (spikes="skip": with the spike's)
    decided: tuple = (None, True, False)  # async: the pending step's (step, finite, overflow skip), read this check

    @property
    def skipped(self) -> Any:
        """The batch's leaves that are not scanned (integers, non-tensors), for the report."""
        return self.step_inputs.skipped


Stage = Callable[[Any, StepCheck], Any]


class CheckPath(NamedTuple):
    """A way through check(): `stages` in order, then `finish`, which returns the report (NOTE: [check stages])."""

    stages: tuple[Stage, ...]
    finish: Stage

    def run(self, monitor: Any, check: StepCheck) -> Any:
        for stage in self.stages:
            stage(monitor, check)
        return self.finish(monitor, check)
