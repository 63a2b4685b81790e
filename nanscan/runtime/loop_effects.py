"""What the training loop does to a step's gradients between check() and the update, observed rather than declared:
the factor its optimizer.step() finds them multiplied by (gradient clipping, a GradScaler's unscale), taken by an
optimizer step pre-hook against a small sample of the gradients the check scanned (NOTE: [observed loop]).

NOTE: [observed loop]
A rerun of the run's window (nanscan.replay.window NOTE: [window replay]) is faithful only if it does what the loop
did between the backward and the update, and the loop's code there is not the Monitor's to read. Two things are
observed at every step of a window, cheaply, and recorded with each of its checks (WindowStep.loss,
WindowStep.update_factor):
  - the loss the loop passed with each check() and observe(), as it backpropagated it (kept as the history keeps a
    loss: a float on the CPU, a device copy on a GPU, read at the incident): a replay compares it with what
    step_fn returns for the same micro-batch from the same state and so learns the loop's loss scaling (1/n for a
    mean over n micro-batches, 1 for a sum, or the loop's own factor) instead of assuming the mean;
  - the update factor: at a step's own check, a strided sample of at most SAMPLE elements of the largest gradient
    is copied (one small device op); an optimizer step pre-hook then takes the least-squares ratio of that sample
    as the update sees it to the copy, sum(now * then) / sum(then * then). Clipping scales every gradient by one
    factor (clip_grad_norm_'s max_norm / (total_norm + 1e-6), at most 1), so one sample tells it; a GradScaler's
    unscale divides by the scale. A step whose update never ran (skipped) records none.
From the factors and the recorded gradient norms a replay infers the clip threshold (factor x (norm + 1e-6) is
the same max_norm at every clipped step), and says so; a factor that no threshold explains is reported as what it
is. Cost: a strided copy of 1024 elements at each check and two dot products of that length at each update, only
while a window is kept (bench_overhead: `loop_observation`).
"""

from __future__ import annotations

from typing import Any

import torch

from nanscan.runtime.history import read_scalar

SAMPLE = 1024


class UpdateFactorProbe:
    """The update factor of each step (NOTE: [observed loop]): `arm(model, step)` at a step's own check, the
    optimizer's step pre-hook measures it, `take(step)` returns it (a float, a device scalar, or None)."""

    def __init__(self):
        self._param: torch.nn.Parameter | None = None
        self._armed: tuple[int, torch.Tensor, int] | None = None  # (step, the sample's copy, its stride)
        self._factors: dict[int, Any] = {}
        self._hooked: Any = None
        self._handle: Any = None

    def attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Register the step pre-hook once per optimizer (a pre-hook is the earliest the update can be seen)."""
        if optimizer is None or self._hooked is optimizer or not hasattr(optimizer, "register_step_pre_hook"):
            return
        if self._handle is not None:
            self._handle.remove()
        self._hooked = optimizer
        self._handle = optimizer.register_step_pre_hook(self._on_update)

    def _sampled(self, model: torch.nn.Module) -> torch.nn.Parameter | None:
        """The parameter whose gradient is sampled: the largest trainable one, chosen again only when it has no
        gradient (any gradient tells the factor, since clipping scales all alike; walking the parameters at every
        check would cost more than the sample)."""
        if self._param is None or self._param.grad is None:
            trainable = [p for p in model.parameters() if p.requires_grad]
            self._param = max(trainable, key=lambda p: p.numel(), default=None)
        return self._param

    def arm(self, model: torch.nn.Module, step: int) -> None:
        """At a step's own check: copy the sample the update will be compared with."""
        self._armed = None
        param = self._sampled(model)
        grad = param.grad if param is not None else None
        if grad is None or grad.is_sparse or not grad.dtype.is_floating_point:
            return
        stride = max(1, grad.numel() // SAMPLE)
        self._armed = (step, grad.detach().reshape(-1)[::stride][:SAMPLE].clone(), stride)

    def _on_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        armed, self._armed = self._armed, None
        if armed is None or self._param is None or self._param.grad is None:
            return
        step, then, stride = armed
        now = self._param.grad.detach().reshape(-1)[::stride][:SAMPLE]
        if now.shape != then.shape:
            return
        then64 = then.to(torch.float64)
        num, den = (now.to(torch.float64) * then64).sum(), (then64 * then64).sum()
        # a zero sample tells nothing: NaN, read as None; on a GPU a device scalar (no host sync until the incident)
        factor = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)),
                             torch.full_like(den, float("nan")))
        self._factors[step] = float(factor) if factor.is_cpu else factor

    def take(self, step: int) -> float | None:
        """The factor measured at `step`'s update, read (None: not measured, or a zero sample)."""
        value = self._factors.get(step)
        if value is None:
            return None
        value = read_scalar(value)
        return None if value is None or value != value else float(value)

    def forget(self, step: int) -> None:
        """The window let go of `step`."""
        self._factors.pop(step, None)

    def forget_after(self, step: int) -> None:
        """A rollback abandoned the steps after `step` (an armed sample of one of them included)."""
        self._factors = {s: f for s, f in self._factors.items() if s <= step}
        self._armed = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle = self._hooked = None
