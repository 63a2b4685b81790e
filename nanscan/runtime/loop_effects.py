"""What the training loop does to a step's gradients between check() and the update, observed rather than declared:
the factor its optimizer.step() finds them multiplied by (gradient clipping, a GradScaler's unscale), taken by an
optimizer step pre-hook against a small sample of the gradients the check scanned (NOTE: [observed loop]).

NOTE: [observed loop]
A rerun of the run's window (nanscan.runtime.window_rerun NOTE: [window replay]) is faithful only if it does what the loop
did between the backward and the update, and the loop's code there is not the Monitor's to read. Two things are
observed at every step of a window, cheaply, and recorded with each of its checks (WindowStep.loss,
WindowStep.update_factor):
  - the loss the loop passed with each check() and observe(), as it backpropagated it (kept as the history keeps a
    loss: a float on the CPU, a device copy on a GPU, read at the incident): a replay compares it with what
    step_fn returns for the same micro-batch from the same state and so learns the loop's loss scaling (1/n for a
    mean over n micro-batches, 1 for a sum, or the loop's own factor) instead of assuming the mean;
  - the update factor: at a step's own check, the first SAMPLE elements of one gradient are copied (on the CPU
    read from host memory as Python floats, no torch op; on a GPU one small device copy); an optimizer step
    pre-hook then takes the least-squares ratio of those elements as the update sees them to the copy,
    dot(now, then) / dot(then, then) (on a GPU two device dot products, read at the incident). Clipping scales
    every gradient by one factor (clip_grad_norm_'s max_norm / (total_norm + 1e-6), at most 1), so any sample that
    is not all zero tells it exactly; a GradScaler's unscale divides by the scale. The gradient sampled is the
    largest parameter's outside embeddings (an embedding's gradient is zero in the rows of every token the batch
    lacks, so a sample of it is often all zero); its first elements are one contiguous read. A step whose update
    never ran (skipped) records none, and an all-zero sample records none.
From the factors and the recorded gradient norms a replay infers the clip threshold (factor x (norm + 1e-6) is
the same max_norm at every clipped step), and says so; a factor that no threshold explains is reported as what it
is. Cost, only while a window is kept (bench_overhead: `loop_observation`): a strided float64 sample of 1024
elements in torch ops cost 2.1% of the demo's step, 256 contiguous ones 1.4% (a torch op costs tens of
microseconds and a Python one some, cold after a backward, on 2 cores); a float32 CPU gradient's first 16 elements
read from host memory through a ctypes array picked once cost 0.4-0.5% there (47 us a step for one Monitor: 26 at
the check, 21 at the update).
"""

from __future__ import annotations

import ctypes
import math
import operator
from typing import Any

import torch

from nanscan.runtime.history import read_scalar

SAMPLE = 16


class UpdateFactorProbe:
    """The update factor of each step (NOTE: [observed loop]): `arm(model, step)` at a step's own check, the
    optimizer's step pre-hook measures it, `take(step)` returns it (a float, a device scalar, or None)."""

    def __init__(self):
        self._param: torch.nn.Parameter | None = None
        self._host: Any = None  # the ctypes array type of a host-read sample (_pick)
        # (step, the sample's copy: host floats, or a float32 device tensor)
        self._armed: tuple[int, list[float] | torch.Tensor] | None = None
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

    def _pick(self, model: torch.nn.Module) -> None:
        """The parameter whose gradient is sampled: the largest trainable one outside embeddings (any, where all are
        embeddings), chosen again only when it has no gradient (any gradient tells the factor, since clipping scales
        all alike; walking the model at every check would cost more than the sample); and how its gradient is read:
        a float32 CPU gradient straight from host memory (`_host`, a ctypes array type), any other through torch."""
        embedded = {id(p) for module in model.modules() if isinstance(module, torch.nn.Embedding)
                    for p in module.parameters()}
        trainable = [p for p in model.parameters() if p.requires_grad]
        dense = [p for p in trainable if id(p) not in embedded] or trainable
        self._param = max(dense, key=lambda p: p.numel(), default=None)
        grad = self._param.grad if self._param is not None else None
        # a plain tensor only: a DTensor's (FSDP2, TP) data_ptr is no address of its values
        host = type(grad) is torch.Tensor and grad.dtype is torch.float32 and grad.is_cpu and not grad.is_sparse \
            and grad.is_contiguous() and grad.numel() >= SAMPLE
        self._host = ctypes.c_float * SAMPLE if host else None

    def _read(self, grad: torch.Tensor) -> list[float] | torch.Tensor | None:
        """The sample of `grad`: host floats on the host path, else a float32 device copy (None: not readable)."""
        if self._host is not None and type(grad) is torch.Tensor and grad.dtype is torch.float32:  # as picked
            return self._host.from_address(grad.data_ptr())[:]
        if type(grad) is not torch.Tensor:  # a DTensor: this rank's own shard, with no collective
            to_local = getattr(grad, "to_local", None)
            if to_local is None:
                return None
            grad = to_local()
        if grad.is_sparse or not grad.dtype.is_floating_point:
            return None
        return grad.detach().reshape(-1)[:SAMPLE].to(torch.float32, copy=True)

    def arm(self, model: torch.nn.Module, step: int) -> None:
        """At a step's own check: copy the sample the update will be compared with."""
        grad = self._param.grad if self._param is not None else None
        if grad is None:
            self._pick(model)
            grad = self._param.grad if self._param is not None else None
        then = self._read(grad) if grad is not None else None
        self._armed = (step, then) if then is not None else None

    def _on_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        armed, self._armed = self._armed, None
        grad = self._param.grad if armed is not None else None
        if grad is None:
            return
        step, then = armed
        now = self._read(grad)
        if isinstance(then, list):
            if isinstance(now, list):
                self._factors[step] = (sum(map(operator.mul, now, then)), sum(map(operator.mul, then, then)))
        elif now is not None and now.shape == then.shape:  # device scalars: no host sync until the incident
            self._factors[step] = (torch.dot(now, then), torch.dot(then, then))

    def take(self, step: int) -> float | None:
        """The factor measured at `step`'s update, read (None: not measured, or a zero sample)."""
        value = self._factors.get(step)
        if value is None:
            return None
        num, den = (read_scalar(v) for v in value)
        if num is None or den is None or not (0 < den < math.inf) or not math.isfinite(num):
            return None  # an all-zero (or non-finite) sample tells nothing
        return num / den

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
