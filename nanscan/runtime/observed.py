"""Micro-batches handed to the Monitor without a scan (Monitor.observe): their losses folded into the step's check,
and, at a non-finite loss, the micro-batch it came from (NOTE: [observed micro-batches]).

NOTE: [observed micro-batches]
Under gradient accumulation the step's own check sees the gradients summed over every micro-batch: a NaN loss in
an earlier micro-batch whose backward left the gradients finite (a loss masked to 0/0 whose gradient is 0, a
forward that returns NaN for a row the loss then drops) is never seen, and check(micro_batch=True) finds it at the
cost of a full scan per micro-batch. observe(loss=..., batch=...) after each earlier micro-batch's backward takes no
scan: it keeps the micro-batch's loss (a 0-dim tensor, detached: no host sync) and its batch by reference, and the
window records the micro-batch (nanscan.runtime.window NOTE: [run window]), so that the window's rerun replays
every micro-batch (nanscan.runtime.rerun NOTE: [replayed accumulation]). At the step's check the observed losses
and the check's own are summed into one loss (one small device op), the step's scanned and recorded loss: a
non-finite loss anywhere makes the step's loss non-finite, and with each micro-batch's loss passed as the loop
backpropagates it (divided by the accumulation count), the step's loss is their mean, the loss the step trained
on. At a loss incident the observed losses are read (the incident may wait for the device) and the first
non-finite one names the micro-batch: its index goes into the bundle, and its batch and sample ids are the bundle's
batch. A gradient that goes non-finite at an earlier micro-batch while its loss stays finite is seen at the step's
check, without the micro-batch: check(micro_batch=True) is still the way to name it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Observed:
    """One observed micro-batch: its index within its step, its loss (detached, or None), batch and sample ids."""

    micro: int
    loss: torch.Tensor | None
    batch: Any
    sample_ids: Any


class ObservedMicroBatches:
    """The observed micro-batches of the step being accumulated and of the step whose verdict is pending
    (mode="async" reads a step's verdict at the next check), by step."""

    def __init__(self):
        self._current: list[Observed] = []
        self._by_step: dict[int, list[Observed]] = {}
        self._checked: list[torch.Tensor] = []  # the losses of this step's check(micro_batch=True) calls so far
        self._checked_step: int | None = None

    def add_checked(self, step: int, loss: Any) -> None:
        """A micro-batch check's loss (decided at its own check): it joins the step's recorded loss, the loss the
        loop summed over its micro-batches, not the last micro-batch's part of it alone. Those of an earlier step
        whose own check never came are dropped (a loop checking every micro-batch as micro_batch=True)."""
        if step != self._checked_step:
            self._checked, self._checked_step = [], step
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._checked.append(loss.detach())

    def add(self, micro: int, loss: Any, batch: Any, sample_ids: Any) -> None:
        if loss is not None and not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss), dtype=torch.float64)
        if loss is not None and loss.numel() != 1:
            raise ValueError(f"observe(loss=...) got a tensor of shape {tuple(loss.shape)}: pass the micro-batch's "
                             "scalar loss, as the loop backpropagates it")
        self._current.append(Observed(micro, loss.detach() if loss is not None else None, batch, sample_ids))

    def fold(self, step: int, loss: Any) -> Any:
        """The step's loss: the observed losses and the check's own summed (one small op on their device), or the
        check's own when nothing was observed; the observed micro-batches are kept under `step` until decided."""
        if not self._current and not self._by_step and not self._checked:  # every step, no micro-batch: nothing
            return loss
        observed, self._current = self._current, []
        checked = self._checked if self._checked_step == step else []
        self._checked, self._checked_step = [], None
        # a step older than the one before it was decided already (sync: at its check; async: at the next)
        self._by_step = {s: kept for s, kept in self._by_step.items() if s >= step - 1}
        if observed:
            self._by_step[step] = observed
        elif not checked:
            return loss
        parts = checked + [o.loss for o in observed if o.loss is not None] + ([loss] if loss is not None else [])
        if not parts:
            return None
        device = parts[-1].device
        return torch.stack([p.reshape(()).to(device=device, dtype=torch.float32) for p in parts]).sum()

    def first_bad(self, step: int) -> Observed | None:
        """At a loss incident of `step`: the first observed micro-batch whose loss is not finite (reads them)."""
        for observed in self._by_step.get(step, ()):
            if observed.loss is not None and not math.isfinite(float(observed.loss)):
                return observed
        return None

    def pending(self) -> int:
        """Micro-batches observed since the last check."""
        return len(self._current)
