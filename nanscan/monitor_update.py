"""The Monitor's post-update check: the weights and optimizer state scanned right after optimizer.step(), so that
a non-finite value written by the update is caught at the step whose update wrote it, with the evidence of what
that update read.

NOTE: [post-update check]
Monitor.check runs before the update; without this, weights an update made non-finite are first seen at the next
step's check, categorized "parameter" there, with that step's batch and a state already broken: the step that did
the damage and the optimizer settings that did it are out of reach. UpdateWatch hooks the optimizer
(Optimizer.register_step_post_hook) and, after each update that follows a finite check, scans the parameters the
optimizer holds and its state in one fused scan (one launch; inputs prepared once and only confirmed per step: the
same parameter and state objects at the same addresses). In mode="sync" the verdict is read at once, and a
non-finite update is an incident of category "update", reason UPDATE, dated to the step whose check preceded it,
with that step's batch, sample ids, RNG states and (snapshot="cpu") the pre-step state: what the update read, so
replay reruns it. In mode="async" the scan is only enqueued, its flag copied to pinned memory behind an event, and
read with the step's own verdict at the next check: no host sync of its own. Not with a process group (the ranks
would have to agree on it) and not for updates without a check before them. The next check scans the weights
and the state again: a loop may write them between optimizer.step() and the check (weights edited in place, a
state loaded), and that write must be seen at the check that follows it.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from nanscan.dispatch import launch
from nanscan.incident import is_kind, tensor_name
from nanscan.inputs import ScanInputs, prepare
from nanscan.pending import StepScan
from nanscan.stats import ScanReport


@dataclass(frozen=True)
class UpdateContext:
    """The finite check an update follows: what the incident of a non-finite update holds (its step, batch, sample
    ids, and the step-start captures: RNG states, the snapshot with the state the update read)."""

    step: int
    batch: Any
    sample_ids: Any
    started: bool
    start: Any  # nanscan.monitor_verdict.StepStart


LOW_PRECISION = (torch.float16, torch.bfloat16)  # post_update="auto" checks the updates of these parameters
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")


class UpdateInputs:
    """The `param:` and `optim:` inputs of an optimizer's parameters, prepared once and confirmed per update (the
    same state objects, the same tensors at the same addresses with the same dtypes), rebuilt when they change."""

    def __init__(self):
        self._inputs: ScanInputs | None = None
        self._state_values: list[Any] = []
        self._tensors: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._dtypes: list[torch.dtype] = []
        self._groups: list[tuple[list, int]] = []
        self.rebuilds = 0

    def inputs(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ScanInputs:
        if self._inputs is None or not self._unchanged(optimizer):
            self._rebuild(model, optimizer)
        return self._inputs

    def _unchanged(self, optimizer: torch.optim.Optimizer) -> bool:
        """The same parameter lists, state values and tensor addresses (C loops: this runs after every update)."""
        groups = optimizer.param_groups
        if len(groups) != len(self._groups) or any(g["params"] is not p or len(p) != n
                                                   for g, (p, n) in zip(groups, self._groups)):
            return False
        values = [v for d in optimizer.state.values() for v in d.values()]
        # a .data swap or model.half() moves a tensor, or changes its dtype where the allocator gave the address back
        return len(values) == len(self._state_values) and all(map(operator.is_, values, self._state_values)) \
            and list(map(_DATA_PTR, self._tensors)) == self._ptrs \
            and list(map(_DTYPE, self._tensors)) == self._dtypes

    def _rebuild(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.rebuilds += 1
        names = {id(p): name for name, p in model.named_parameters()}
        items, tensors = [], []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = names.get(id(p), f"optimizer.param_groups.{g}.params.{i}")
                pending = [(tensor_name("parameter", name), p)]
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
                        pending.append((tensor_name("optimizer_state", f"{name}.{key}"), value))
                for scanned, t in pending:
                    item = prepare(scanned, t)
                    if item is not None:
                        items.append(item)
                        tensors.append(t)
        self._inputs = ScanInputs(items)
        self._tensors = tensors
        self._ptrs = list(map(_DATA_PTR, tensors))
        self._dtypes = list(map(_DTYPE, tensors))
        self._state_values = [v for d in optimizer.state.values() for v in d.values()]
        self._groups = [(group["params"], len(group["params"])) for group in optimizer.param_groups]


class PendingUpdate:
    """An update's scan whose verdict is read later (mode="async"), with what its incident needs (`context`)."""

    def __init__(self, scan: StepScan, context: Any):
        self.scan = scan
        self.context = context
        self._flag = self._event = None
        if not scan.on_host:
            self._flag = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._flag.copy_(scan.found_inf, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def nonfinite(self) -> bool:
        """Waits for this scan's flag only (enqueued right after the update it checks)."""
        if self._event is None:
            return self.scan.nonfinite_on_host
        self._event.synchronize()
        return bool(self._flag.item() > 0)

    def report(self, step: int) -> ScanReport:
        return ScanReport(self.scan.tensors, self.scan.records(), backend=self.scan.backend, step=step)


class UpdateWatch:
    """The optimizer hook of NOTE: [post-update check]. The Monitor arms it at a finite check (`expect`), the hook
    scans after the next optimizer.step(), and `monitor._update_incident(report, context)` is called for a
    non-finite update (at once in mode="sync", from `read()` in mode="async")."""

    def __init__(self, monitor: Any, *, always: bool = True):
        self._monitor = weakref.ref(monitor)
        self.always = always  # False: post_update="auto", only while the optimizer holds low-precision parameters
        self._low_precision = False
        self._seen_rebuilds = -1
        self._inputs = UpdateInputs()
        self._optimizer: torch.optim.Optimizer | None = None
        self._handle = None
        self._expected: Any = None  # the context of the check whose update comes next
        self.pending: PendingUpdate | None = None
        self.updates_checked = 0


    def attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Hook `optimizer` (the Monitor's, which nanscan.check may change between calls)."""
        if optimizer is self._optimizer:
            return
        self.close()
        self._optimizer = optimizer
        if optimizer is not None:
            self._handle = optimizer.register_step_post_hook(self._after_step)

    def expect(self, context: Any) -> None:
        """The next update follows the finite check `context` describes (its step, batch, captures)."""
        self._expected = context

    def wanted(self, plan_rebuilds: int) -> bool:
        """Whether the next update is checked: always, or ("auto") while the optimizer holds a float16 or bfloat16
        parameter, looked up again only when the Monitor's scan plan was rebuilt (model.half() rebuilds it)."""
        if self.always:
            return True
        if plan_rebuilds != self._seen_rebuilds:
            self._seen_rebuilds = plan_rebuilds
            groups = self._optimizer.param_groups if self._optimizer is not None else ()
            self._low_precision = any(p.dtype in LOW_PRECISION for group in groups for p in group["params"])
        return self._low_precision

    def forget(self) -> None:
        self._expected = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._optimizer = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        monitor = self._monitor()
        context, self._expected = self._expected, None
        if monitor is None or context is None or monitor.first_invalid_step is not None:
            return
        inputs = self._inputs.inputs(monitor.model, optimizer)
        if not len(inputs):
            return
        scan = launch(inputs, backend=monitor._backend_for(inputs.devices))
        self.updates_checked += 1
        pending = PendingUpdate(scan, context)
        if monitor.mode == "async":
            self.pending = pending
            return
        if pending.nonfinite():
            monitor._update_incident(pending.report(context.step), context)

    def read(self) -> None:
        """mode="async": act on the last update's verdict, if one is pending."""
        pending, self.pending = self.pending, None
        monitor = self._monitor()
        if pending is None or monitor is None or monitor.first_invalid_step is not None:
            return
        if pending.nonfinite():
            monitor._update_incident(pending.report(pending.context.step), pending.context)


def broken_by_update(report: ScanReport) -> list[str]:
    """The tensors an update made non-finite, parameters first (what the incident's category is decided by)."""
    bad = report.nonfinite
    return [n for n in bad if is_kind(n, "parameter")] + [n for n in bad if not is_kind(n, "parameter")]
