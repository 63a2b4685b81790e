"""A step whose update the Monitor dropped stays dropped to its end, whatever the loop calls: an optimizer step
pre-hook sets every gradient to None until a check of another step (NOTE: [dropped update]).

NOTE: [dropped update]
on_invalid="skip" and Rollback drop the failing step's gradients (None, never 0: a zero gradient still moves Adam's
weights through its moments), so an optimizer.step() the loop calls anyway updates nothing. Two cases escape that:
- an incident decided at a micro-batch check (check(micro_batch=True), NOTE: [micro-batch checks]) comes before the
  step's later micro-batches, whose backward passes make gradients again; a loop that does not look at that check's
  report (nanoGPT's micro-step loop does not) would apply the later micro-batches' gradients;
- a batch holding a record that a rollback quarantined in this run (NOTE: [rollback]): the loop draws it again (a
  sampler with replacement, a second epoch) and its update must not count.
So the Monitor arms this hook for the step: at every optimizer.step() until the first check or observe of another
step, every gradient the optimizer holds is set to None first, and torch's optimizers then change no weight and no
optimizer state. The hook is removed when it disarms, so a step that drops nothing costs nothing. A failure in a step
already dropped is no new incident (the record it holds, or the failure at an earlier micro-batch, is known).
Under a process group every rank must drop the same steps, else DDP's replicas part: a rank whose batch holds a
quarantined record says so in the step's agreement (a slot of its all-reduce, no extra collective), and every rank
drops that step's update; ranks that rolled back together at a micro-batch drop the rest of that step together. A
record known only by its content digest (no sample ids) is looked for by the digest of each row of every later
batch, read on the host: a cost paid only after a rollback quarantined such a record.
"""

from __future__ import annotations

from typing import Any

import torch


def drop_gradients(optimizer: torch.optim.Optimizer, held: list | None = None) -> None:
    """Set the gradient of every parameter `optimizer` holds to None, never to 0 (NOTE: [dropped update]); `held`:
    a list that keeps each gradient taken, for put_back after the step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if held is not None and p.grad is not None:
                held.append((p, p.grad))
            p.grad = None


def put_back(held: list) -> None:
    """The gradients drop_gradients took, back on their parameters (and `held` emptied)."""
    for p, grad in held:
        p.grad = grad
    held.clear()


class DroppedUpdate:
    """The Monitor's step whose update is dropped (NOTE: [dropped update]): `arm` at the decision, `seen` at every
    check or observe (a check of another step disarms it). `keep_buffers`: the gradients are a framework's own
    buffers, which it reuses from step to step (DeepSpeed ZeRO-Offload's fp32 gradient partition): each is taken
    only for the optimizer's step and put back after it, its values never read."""

    def __init__(self, keep_buffers: bool = False):
        self.step: int | None = None
        self.quarantined_steps: set[int] = set()  # steps whose batch held a quarantined record: no new incident
        self._handle: Any = None
        self.keep_buffers = keep_buffers
        self._held: list = []

    def arm(self, optimizer: torch.optim.Optimizer | None, step: int, *, quarantined: bool = False) -> None:
        if quarantined:
            self.quarantined_steps.add(step)
        if optimizer is None or not hasattr(optimizer, "register_step_pre_hook"):
            return
        self.step = step
        if self._handle is None:
            self._handle = [optimizer.register_step_pre_hook(self._pre_step)]
            if self.keep_buffers:
                self._handle.append(optimizer.register_step_post_hook(lambda *_: put_back(self._held)))

    def covers(self, step: int) -> bool:
        """`step`'s update is already dropped: a later micro-batch's incident in it, or a batch holding a quarantined
        record, is no new incident (a rollback refused as "the same failure, 0 steps later" stopped runs)."""
        return step == self.step or step in self.quarantined_steps

    def seen(self, step: int) -> None:
        """A check or observe of `step`: one of another step ends the dropped one."""
        if self.step is not None and step != self.step:
            self.disarm()

    def disarm(self) -> None:
        self.step = None
        if self._handle is not None:
            for handle in self._handle:
                handle.remove()
            self._handle = None

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        drop_gradients(optimizer, self._held if self.keep_buffers else None)
