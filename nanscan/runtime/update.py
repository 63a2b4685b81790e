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
and the state again, unless nothing wrote them since (NOTE: [carried records]): a loop may write them between
optimizer.step() and the check (weights edited in place, a state loaded), and that write must be seen at the check
that follows it.

NOTE: [carried records]
Scanned after the update and again at the next check, every weight and state tensor would be read twice per step
for one answer: between the two, a training loop almost never writes them (zero_grad, forward and backward touch
gradients and activations). So a post-update scan on the host (mode="sync") hands its records to the next check,
which copies them in instead of reading those tensors again (nanscan.engine.plans.ModelScanPlan.scan_on_host), for each
tensor that is provably the one scanned, unchanged:
  - the same object, found by identity among the check plan's confirmed tensors (ModelScanPlan.stable_tensors);
  - the same data pointer and dtype (a `.data` swap or model.half() keeps the object and its version counter);
  - the same autograd version counter, which every in-place write through the tensor moves (an edit under
    torch.no_grad(), copy_, load_state_dict); these three are compared in C++ (nanscan._C.PlanCheck, through
    nanscan._torch_access) inside the check's own pass over the tensors, since in a training step each Python
    read of a tensor attribute costs a cache miss, and so does a second pass over them; without those reads
    nothing is carried;
  - and no optimizer.step() since the scan (fused optimizers write without moving the counter), nor another check.
One write escapes these: an in-place write through `.data` (`p.data.clamp_()`), which shares the storage but not
the version counter. So a check that finds any non-finite value is scanned whole, its verdict and first bad tensor
from fresh records; a `.data` write that makes a weight non-finite is caught at that step wherever the weight is
used (its loss and gradients), and otherwise by that step's own post-update scan, one update later than the write.
Its cost: a tensor's records at a check are the post-update ones, so a finite `.data` edit in between (WGAN's weight
clipping) shows in the history one step late. Not in mode="async", where the records stay on the device until the
next check has launched its scan.

NOTE: [dated updates]
A scan after every update costs about half a check on a small model (bench_overhead: +2.1-3.4% of a step), for an
answer the next check gives anyway: it scans every weight and state tensor. What that check cannot tell by
itself is who wrote a non-finite weight. post_update="date" (the default for float32 parameters) makes the hook
stamp the tensors the update may have written (nanscan.engine.plans.tensor_stamps of the check plan's parameters with a
gradient and its state, ModelScanPlan.update_targets: never a frozen weight; or the optimizer's own tensors when
the update created state the plan has not seen: Adam's first step),
a few microseconds, and the next check, where it finds a non-finite parameter or state tensor whose stamp did not
move since the hook, dates it to the update: the previous check saw it finite, and no in-place write, `.data`
swap or dtype change happened after the update. The incident is the same as a scan's (UpdateContext: that
step's batch, sample ids and step-start captures; the snapshot is kept in a second buffer past the next step's
start, as in mode="async"), seen one check later: its gradients and statistics are the next step's, computed from
the weights the update wrote (the bundle's state note says so), and the batch is held by reference (a loop that
refills the batch tensors in place gives the bundle the refilled ones). In mode="async" the tensors are stamped
at the next check's launch and compared when its verdict is read. What dating cannot see is what nothing can
without a scan: an in-place write through `.data` between the update and the check (a finite-to-NaN
`p.data.clamp_()` there is dated to the update), and a second optimizer.step() without a check before it
(dating stops there: the hook drops the stamps).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from nanscan.engine.dispatch import launch
from nanscan.incident import is_kind, tensor_name
from nanscan.engine.inputs import ScanInputs, named_parameters, prepare
from nanscan.engine.pending import StepScan
from nanscan.engine.plans import tensor_stamps
from nanscan.engine.stats import ScanReport


class UpdateContext(NamedTuple):
    """The finite check an update follows: what the incident of a non-finite update holds (its step, batch, sample
    ids, and the step-start captures: RNG states, the snapshot with the state the update read). A tuple: one is
    made at every check, where a frozen dataclass's field-by-field construction costs several microseconds."""

    step: int
    batch: Any
    sample_ids: Any
    started: bool
    start: Any  # nanscan.runtime.verdict.StepStart


LOW_PRECISION = (torch.float16, torch.bfloat16)  # post_update="auto" checks the updates of these parameters


@dataclass(frozen=True)
class Carried:
    """A post-update scan's records and what its tensors were when scanned (NOTE: [carried records])."""

    rebuilds: int  # UpdateInputs.rebuilds when scanned: which tensors the rows are
    records: np.ndarray
    stamps: np.ndarray  # nanscan.engine.plans.tensor_stamps


class UpdateInputs:
    """The `param:` and `optim:` inputs of an optimizer's parameters, prepared once and confirmed per update (the
    same state objects, the same tensors at the same addresses with the same dtypes), rebuilt when they change."""

    def __init__(self):
        self._inputs: ScanInputs | None = None
        self._state_values: list[Any] = []
        self._tensors: list[torch.Tensor] = []
        self._placed = np.empty((0, 2), dtype=np.int64)  # the rebuild's data pointers and dtypes (tensor_stamps)
        self._groups: list[tuple[list, int]] = []
        self.stamps = np.empty((0, 3), dtype=np.int64)  # the tensors' stamps when inputs() last confirmed them
        self.rebuilds = 0

    def inputs(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ScanInputs:
        if self._inputs is not None and self._same_objects(optimizer):
            stamps = tensor_stamps(self._tensors)
            # a .data swap or model.half() moves a tensor, or changes its dtype where the allocator gave the
            # address back
            if np.array_equal(stamps[:, 1:], self._placed):
                self.stamps = stamps
                return self._inputs
        self._rebuild(model, optimizer)
        return self._inputs

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The scanned tensors, in the inputs' order."""
        return self._tensors

    def carried(self, records: np.ndarray) -> Carried:
        """The records of a scan of inputs() as the next check may take them (NOTE: [carried records])."""
        return Carried(self.rebuilds, records, self.stamps)

    def _same_objects(self, optimizer: torch.optim.Optimizer) -> bool:
        """The same parameter lists and state values (C loops: this runs after every update)."""
        groups = optimizer.param_groups
        if len(groups) != len(self._groups) or any(g["params"] is not p or len(p) != n
                                                   for g, (p, n) in zip(groups, self._groups)):
            return False
        values = [v for d in optimizer.state.values() for v in d.values()]
        return len(values) == len(self._state_values) and all(map(operator.is_, values, self._state_values))

    def _rebuild(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.rebuilds += 1
        names = {id(p): name for name, p in named_parameters(model)}  # NOTE: [state dict names]
        params, states = [], []  # the parameters first, then the state, as the check's plan orders them
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = names.get(id(p), f"optimizer.param_groups.{g}.params.{i}")
                params.append((tensor_name("parameter", name), p))
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
                        states.append((tensor_name("optimizer_state", f"{name}.{key}"), value))
        items, tensors = [], []
        for scanned, t in params + states:
            item = prepare(scanned, t)
            if item is not None:
                items.append(item)
                tensors.append(t)
        self._inputs = ScanInputs(items)
        self._tensors = tensors
        self.stamps = tensor_stamps(tensors)
        self._placed = self.stamps[:, 1:].copy()
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
    scans after the next optimizer.step(), and `monitor.update_incident(report, context)` is called for a
    non-finite update (at once in mode="sync", from `read()` in mode="async"); a finite one's records are offered
    to the next check (`carried_rows`, NOTE: [carried records])."""

    def __init__(self, monitor: Any, *, policy: bool | str = True):
        self._monitor = weakref.ref(monitor)
        self.policy = "scan" if policy is True else policy  # "scan", "date" or "auto" (NOTE: [dated updates])
        self._low_precision = False
        self._seen_rebuilds = -1
        self._inputs = UpdateInputs()
        self._optimizer: torch.optim.Optimizer | None = None
        self._handle = None
        self._expected: Any = None  # the context of the check whose update comes next
        self._how = "scan"  # what the expected update gets: "scan" or "date"
        self._plan: Any = None  # the check's plan (ModelScanPlan), whose stable tensors a dated update stamps
        self._dated: DatedUpdate | None = None
        self.updates_dated = 0
        self.pending: PendingUpdate | None = None
        self.updates_checked = 0
        self._carried: Carried | None = None
        self._rows_key: tuple | None = None  # (plan, its rebuilds, the inputs' rebuilds) of _rows
        self._rows: tuple[np.ndarray, np.ndarray | None] = (np.empty(0, np.int64), None)
        self.records_offered = 0  # tensors whose records were offered to a check (it takes them if its plan holds)

    def attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Hook `optimizer` (the Monitor's, which nanscan.check may change between calls)."""
        if optimizer is self._optimizer:
            return
        self.close()
        self._optimizer = optimizer
        if optimizer is not None:
            self._handle = optimizer.register_step_post_hook(self._after_step)

    def expect(self, context: Any, plan: Any) -> str:
        """The next update follows the finite check `context` describes (its step, batch, captures); `plan` is
        that check's scan plan. Returns what that update gets (how())."""
        self._expected, self._plan = context, plan
        self._how = self.how(plan.rebuilds)
        return self._how

    def how(self, plan_rebuilds: int) -> str:
        """What the next update gets: a scan ("scan"), or stamps that the next check dates by ("date"). "auto"
        scans while the optimizer holds a float16 or bfloat16 parameter, looked up again only when the Monitor's
        scan plan was rebuilt (model.half() rebuilds it), and dates the others."""
        if self.policy != "auto":
            return self.policy
        if plan_rebuilds != self._seen_rebuilds:
            self._seen_rebuilds = plan_rebuilds
            groups = self._optimizer.param_groups if self._optimizer is not None else ()
            self._low_precision = any(p.dtype in LOW_PRECISION for group in groups for p in group["params"])
        return "scan" if self._low_precision else "date"

    def take_dated(self) -> "DatedUpdate | None":
        """For the check that follows a dated update: what dates a non-finite weight or state to it (NOTE: [dated
        updates]). Taken once."""
        dated, self._dated = self._dated, None
        return dated

    def forget(self) -> None:
        self._expected = None

    def carried_rows(self, plan: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """For the check that follows a finite post-update scan: (indices into `plan.stable_tensors()`, their
        stamps and records) of the tensors that scan read, which the check takes where the stamps did not move
        (NOTE: [carried records]), or None. Taken once: a second check scans everything."""
        carried, self._carried = self._carried, None
        if carried is None or carried.rebuilds != self._inputs.rebuilds:
            return None
        key = (id(plan), plan.rebuilds, carried.rebuilds)
        if key != self._rows_key:
            self._rows_key = key
            index = {id(t): i for i, t in enumerate(self._inputs.tensors)}
            found = [(j, index[id(t)]) for j, t in enumerate(plan.stable_tensors()) if id(t) in index]
            stable = np.array([j for j, _ in found], dtype=np.int64)
            rows = np.array([i for _, i in found], dtype=np.int64)
            # the usual order (an optimizer over model.parameters()) needs no gather: the arrays are taken whole
            whole = len(rows) == len(index) and np.array_equal(rows, np.arange(len(rows)))
            self._rows = (stable, None if whole else rows)
        stable, rows = self._rows
        if not len(stable):
            return None
        self.records_offered += len(stable)
        if rows is None:
            return stable, carried.stamps, carried.records
        return stable, carried.stamps[rows], carried.records[rows]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._optimizer = None
        self._carried = None
        self._dated = None
        self._plan = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        monitor = self._monitor()
        context, self._expected = self._expected, None
        plan, self._plan = self._plan, None
        self._carried = None  # this update wrote what an earlier scan read
        self._dated = None  # ... and what an earlier update's stamps describe
        if monitor is None or context is None or monitor.first_invalid_step is not None:
            return
        if self._how == "date":
            self._date(monitor, optimizer, context, plan)
            return
        inputs = self._inputs.inputs(monitor.model, optimizer)
        if not len(inputs):
            return
        scan = launch(inputs, backend=monitor.backend_for(inputs.devices))
        self.updates_checked += 1
        pending = PendingUpdate(scan, context)
        if monitor.mode == "async":
            self.pending = pending
            return
        if pending.nonfinite():
            monitor.update_incident(pending.report(context.step), context)
        elif scan.on_host:
            self._carried = self._inputs.carried(scan.records())

    def _date(self, monitor: Any, optimizer: torch.optim.Optimizer, context: Any, plan: Any) -> None:
        """Stamp what the update wrote (NOTE: [dated updates]): the check plan's parameters that have a gradient and
        its state tensors, unless the update created state the plan has not seen (Adam's first update), then the
        optimizer's own tensors."""
        # a TensorSource may keep none
        tensors, names = plan.update_targets() if hasattr(plan, "update_targets") else ([], [])
        if not tensors or len(optimizer.state) != plan.state_owners:
            inputs = self._inputs.inputs(monitor.model, optimizer)
            tensors, names = self._inputs.tensors, [i.name for i in inputs.identities]
        if tensors:
            self._dated = DatedUpdate(context, tensors, names, tensor_stamps(tensors))
            self.updates_dated += 1

    def read(self) -> None:
        """mode="async": act on the last update's verdict, if one is pending."""
        pending, self.pending = self.pending, None
        monitor = self._monitor()
        if pending is None or monitor is None or monitor.first_invalid_step is not None:
            return
        if pending.nonfinite():
            monitor.update_incident(pending.report(pending.context.step), pending.context)


class DatedUpdate:
    """An update that was stamped, not scanned (NOTE: [dated updates]): the finite check it followed (`context`),
    the parameters and state tensors it may have written, their names and their stamps right after it."""

    def __init__(self, context: Any, tensors: list[torch.Tensor], names: list[str], stamps: np.ndarray):
        self.context = context
        self._tensors = tensors
        self._names = names
        self._stamps = stamps
        self._seen: np.ndarray | None = None

    def seen(self) -> "DatedUpdate":
        """Stamp the tensors now, at the check that follows the update: mode="async" reads that check's verdict
        one step later, after the next update has moved the stamps again."""
        self._seen = tensor_stamps(self._tensors)
        return self

    def broken(self, report: ScanReport) -> list[str]:
        """The tensors of `report` (the next check's) that are non-finite and that nothing but this update wrote
        since the finite check before it, parameters first; [] when there are none: the step is not the update's."""
        now = self._seen if self._seen is not None else tensor_stamps(self._tensors)
        unchanged = {name for name, same in zip(self._names, (now == self._stamps).all(axis=1)) if same}
        return [name for name in broken_by_update(report) if name in unchanged]


def broken_by_update(report: ScanReport) -> list[str]:
    """The tensors an update made non-finite, parameters first (what the incident's category is decided by)."""
    bad = report.nonfinite
    return [n for n in bad if is_kind(n, "parameter")] + [n for n in bad if not is_kind(n, "parameter")]
