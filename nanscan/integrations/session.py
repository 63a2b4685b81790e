"""One optimizer step as a trainer runs it, for the framework adapters: its micro-batches and their losses
collected, the Monitor's check over them, the on_invalid policy (with "stop"), which micro-batch went bad
recorded in the bundle, and nanscan's own numbers for the trainer's logs.

The adapters only turn a framework's hooks into these calls:

    session = StepSession(model, optimizer, recipe=..., scaler=..., options=monitor_options)
    session.add_micro_batch(inputs)        # each forward of the step (all of them under gradient accumulation)
    session.set_loss(loss)                 # that micro-batch's loss
    session.check(step=..., divide_by=n)   # after backward and unscaling, before the optimizer step
    session.after_update(skipped=...)      # after it, where the framework says whether it skipped the update
    logs.update(session.numbers())
    session.close()
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping

import torch

from nanscan.bundle import load_bundle
from nanscan.engine.headroom import overflowing_inputs, range_limit_text
from nanscan.incident import NonFiniteError, tensor_name
from nanscan.engine.inputs import batch_size, iter_batch_tensors
from nanscan.integrations.rebuild import MICRO_BATCHES, REPLAY_ENTRY, step_function, step_loss, with_recipe
from nanscan.runtime.monitor import Monitor
from nanscan.runtime.rollback import Rollback
from nanscan.scan import scan
from nanscan.engine.stats import ScanReport

__all__ = ["LOG_KEYS", "ON_INVALID", "StepSession", "autocast_region", "check_on_invalid", "micro_batch_finding"]

log = logging.getLogger("nanscan")

# "stop": skip the bad update (as "skip") and end training cleanly through the framework's own stop flag.
ON_INVALID = ("raise", "warn", "skip", "stop")
LOG_KEYS = ("nanscan/nonfinite_tensors", "nanscan/nonfinite_steps", "nanscan/skipped_steps")
MICRO_BATCH_FINDING = "micro_batches"


def autocast_region(precision: str | None, device_type: str) -> Any:
    """The autocast region a trainer's mixed-precision setting ("bf16", "fp16"; Lightning's "bf16-mixed",
    "16-mixed") puts the forward in, as Monitor.begin_step takes it: None for full precision, "current" (read it
    at the step's start) for a setting this does not know."""
    dtype = {"bf16": "bfloat16", "bf16-mixed": "bfloat16", "fp16": "float16", "16-mixed": "float16"}.get(
        str(precision) if precision is not None else "")
    if dtype is not None:
        return {"device_type": device_type, "dtype": dtype}
    full = (None, "no", "32", "32-true", "64", "64-true", "bf16-true", "16-true")
    return None if precision in full else "current"


def with_step_fn(options: dict, step: Mapping, *, engine: Any = None,
                 fallback: Callable[[], Callable | None] = lambda: None) -> dict:
    """The Monitor's options with a step_fn where the user gave none, so that an incident is rerun and diagnosed in
    the process with no code of the user's (nanscan.runtime.incident_rerun NOTE: [in-process rerun]): the step's
    loss over its recorded micro-batches as the trainer forms it (nanscan.integrations.rebuild.step_function, as
    the zero-config replay entry runs it), else `fallback()`'s (a trainer's own loss function). None under
    DeepSpeed (its engine drives the step) or when more than one process trains: the rerun would run the module
    outside the wrapper whose collectives it needs (DDP's all-reduce); pass step_fn= there."""
    if "step_fn" in options or engine is not None or distributed_run():
        return options
    step_fn = step_function(dict(step)) if "unavailable" not in step else fallback()
    return {**options, "step_fn": step_fn} if step_fn is not None else options


def distributed_run() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def check_on_invalid(policy: Any) -> None:
    if not (callable(policy) or policy in ON_INVALID or isinstance(policy, Rollback)):
        raise ValueError(f"on_invalid={policy!r}: use one of {', '.join(ON_INVALID)}, a nanscan.Rollback(...), or a "
                         "callable f(report, bundle_path)")


def micro_batch_finding(micro_batches: list, losses: list, compute_dtype: str | None = None) -> tuple[str, str, dict]:
    """(title, markdown, record) of the finding that says which micro-batches of the step held a non-finite input,
    a finite input beyond the range the step computes in (`compute_dtype`, the autocast dtype; NOTE: [overflow] in
    nanscan/engine/headroom.py), or a non-finite loss (read once, at the incident)."""
    rows = []
    for index, (inputs, loss) in enumerate(zip(micro_batches, losses)):
        named = [(tensor_name("input", f"{MICRO_BATCHES}.{index}.{path}"), t) for path, t in iter_batch_tensors(inputs)
                 if t.is_floating_point()]
        stats = scan(named).stats if named else []
        bad = [s.name for s in stats if not s.ok]
        huge = overflowing_inputs(stats, compute_dtype)
        loss_value = None if loss is None else float(loss.detach().float().reshape(-1)[0])
        loss_bad = loss_value is not None and not math.isfinite(loss_value)
        rows.append({"index": index, "nonfinite_inputs": bad, "out_of_range_inputs": huge,
                     "loss": loss_value if not loss_bad else str(loss_value), "bad": bool(bad or huge) or loss_bad})
    first = next((row["index"] for row in rows if row["bad"]), None)
    total = len(rows)
    if first is None:
        title = (f"Micro-batches: none of the {total} micro-batch(es) of the step had a non-finite input or loss "
                 "(the fault is in the state or the backward pass)")
    else:
        bad = [row["index"] for row in rows if row["bad"]]
        what = (f"held finite inputs beyond the step's range ({range_limit_text(compute_dtype)})"
                if rows[first]["out_of_range_inputs"] and not rows[first]["nonfinite_inputs"] else "went bad")
        title = f"Micro-batches: micro-batch {first} of {total} {what} first (bad: {bad})"
    lines = ["| micro-batch | loss | non-finite inputs | inputs beyond the step's range |", "| --- | --- | --- | --- |"]
    lines += [f"| {row['index']} | {row['loss']} | {', '.join(f'`{n}`' for n in row['nonfinite_inputs']) or '-'} | "
              f"{', '.join(f'`{n}`' for n in row['out_of_range_inputs']) or '-'} |" for row in rows]
    lines += ["", f"The bundle's batch is {{'{MICRO_BATCHES}': [...]}}: the step's micro-batches in the order they "
                  "were run; `input:micro_batches.<i>.<key>` names micro-batch i's tensors."]
    return title, "\n".join(lines), {"micro_batches": total, "first_bad": first, "rows": rows}


def call_before(owner: Any, name: str, hook: Callable[[], Any]) -> Callable[[], None]:
    """Make `owner.name(...)` call `hook()` first, then the method as it was, its arguments and result untouched;
    returns what undoes it. For the moments a trainer gives no hook at: just before its gradient clipping, or
    before a DeepSpeed engine's step(), which accelerate calls inside accelerator.backward() (and which frees the
    gradient partitions)."""
    method = getattr(owner, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        hook()
        return method(*args, **kwargs)

    setattr(owner, name, hooked)
    return lambda: owner.__dict__.pop(name, None)


class StepSession:
    """A Monitor over one trainer's model and optimizer, fed a whole optimizer step at a time.

    options: the Monitor's keyword arguments, with on_invalid also "stop" (skip the update, then `stop_requested`
    is True and the adapter stops the trainer), and sample_id_field: the key of a micro-batch (a dict) that holds
    its samples' ids (a dataset index, a record id). replay_entry defaults to the integrations' own (zero-config
    replay from `recipe`, nanscan.integrations.rebuild); config, when given, is kept with the recipe added.
    scaler: the framework's GradScaler, passed to the Monitor only when there is one.
    engine: the trainer's DeepSpeed engine when it runs under DeepSpeed (its plugin): the Monitor is then a
    nanscan.integrations.deepspeed.DeepSpeedMonitor, which reads the engine's ZeRO partitions; on_invalid="stop"
    warns and stops the trainer there, leaving the update to DeepSpeed (which does not read `.grad`, so it cannot
    be skipped by nanscan), and "skip" is refused.

    Every checked step's sample ids are one per row of its micro-batches, in order: {"micro_batch": i, "row": r},
    with "id" the sample's id when sample_id_field finds one, so a replay's bisection names the micro-batch, the
    row and the sample.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, recipe: dict,
                 scaler: Any = None, options: dict, engine: Any = None):
        options = dict(options)
        self.sample_id_field = options.pop("sample_id_field", None)
        policy = options.pop("on_invalid", "raise")
        check_on_invalid(policy)
        options["config"] = with_recipe(options.get("config"), recipe)
        options["replay_entry"] = options.get("replay_entry") or REPLAY_ENTRY
        if scaler is not None:
            options["scaler"] = scaler
        self.policy = policy
        self._drops_update = engine is None  # whether on_invalid "skip"/"stop" makes the update change nothing
        if engine is not None:
            # imported only here: deepspeed is an optional extra, and importing it costs seconds
            from nanscan.integrations.deepspeed import DeepSpeedMonitor  # noqa: PLC0415

            self.monitor = DeepSpeedMonitor(engine, on_invalid="warn" if policy == "stop" else policy, **options)
        else:
            self.monitor = Monitor(model, optimizer, on_invalid="skip" if policy == "stop" else policy, **options)
        self.stop_requested = False
        self.skipped_steps = 0
        self.nonfinite_tensors = 0  # in the last step checked (0 when it was finite)
        self._inputs: list = []
        self._ids: list = []  # per micro-batch: its samples' ids (a list, a tensor) or None
        self._losses: list = []
        self._kept: dict[int, tuple[list, list]] = {}  # checked steps whose verdict may still come (mode="async")
        self._skipped_now = False

    # -- one step ---------------------------------------------------------------------------------------------
    def begin_step(self, autocast: Any = "current") -> None:
        """The trainer's own step-start hook fired (before the step's first micro-batch): Monitor.begin_step, with
        the autocast region the trainer's precision setting decides (autocast_region)."""
        self.monitor.begin_step(autocast=autocast)

    def add_micro_batch(self, inputs: Any, ids: Any = None) -> None:
        """One micro-batch as the model receives it; `ids`: its samples' ids when the adapter took them out of it
        (else they are read from inputs[sample_id_field])."""
        if ids is None and self.sample_id_field is not None and isinstance(inputs, Mapping):
            ids = inputs.get(self.sample_id_field)
        self._inputs.append(inputs)
        self._ids.append(ids)
        self._losses.append(None)

    def _sample_ids(self, micro: list, ids: list, first: int = 0) -> list | None:
        """The step's sample ids (see the class docstring), its micro-batches numbered from `first`; None when a
        micro-batch has no sample dimension."""
        out = []
        for index, (inputs, given) in enumerate(zip(micro, ids), start=first):
            rows = batch_size(inputs)
            if rows is None:
                return None
            values = given.tolist() if isinstance(given, torch.Tensor) else given
            known = isinstance(values, (list, tuple)) and len(values) == rows
            out += [{"micro_batch": index, "row": row, **({"id": values[row]} if known else {})}
                    for row in range(rows)]
        return out

    def set_loss(self, loss: Any) -> None:
        """The latest micro-batch's loss (a tensor; anything else is ignored)."""
        if self._losses and isinstance(loss, torch.Tensor):
            self._losses[-1] = loss.detach()

    @property
    def inputs(self) -> list:
        """The micro-batches collected for the step not yet checked."""
        return self._inputs

    def check(self, *, step: int | None = None, divide_by: int = 1, extra: dict | None = None) -> ScanReport:
        """Check the step: its micro-batches as the batch {"micro_batches": [...], **extra}, the sum of their losses
        over `divide_by` as the loss (the trainer's normalisation)."""
        micro, losses, ids = self._inputs, self._losses, self._ids
        self._inputs, self._losses, self._ids = [], [], []
        self._skipped_now = False
        present = [loss for loss in losses if loss is not None]
        loss = step_loss(present, divide_by=divide_by) if present else None
        if step is None:
            step = self.monitor.step
        self._kept = {s: kept for s, kept in self._kept.items() if s >= step - 1}
        self._kept[step] = (micro, losses)
        first_before = self.monitor.bundle_path
        try:
            report = self.monitor.check(batch={MICRO_BATCHES: micro, **(extra or {})}, loss=loss, step=step,
                                        sample_ids=self._sample_ids(micro, ids))
        except NonFiniteError as exc:
            self.nonfinite_tensors = len(exc.tensors)
            self._record_micro_batches(first_before)
            raise
        self._record_micro_batches(first_before)
        if report.ok:
            self.nonfinite_tensors = 0
            return report
        self.nonfinite_tensors = self._count(report)
        if (self.policy in ("skip", "stop") or isinstance(self.policy, Rollback)) and self._drops_update:
            self.skipped_steps += 1  # a rollback drops the failing step's gradients too (NOTE: [rollback])
            self._skipped_now = True
        if self.policy == "stop" and not self.stop_requested:
            self.stop_requested = True
            log.warning("nanscan: non-finite values at step %s; %s and training stops (on_invalid='stop'); "
                        "evidence in %s", getattr(report, "decided_step", None) or step,
                        "the update was skipped" if self._drops_update else "the update is DeepSpeed's to skip",
                        self.monitor.bundle_path)
        return report

    def check_micro_batch(self, *, step: int | None = None) -> ScanReport:
        """Check the latest micro-batch on its own, after its backward and before the step's last one
        (Monitor.check(micro_batch=True), nanscan.runtime.verdict NOTE: [micro-batch checks]): its inputs and loss,
        the gradients accumulated so far; under DDP's no_sync() still this rank's own. The step's check still gets
        every micro-batch."""
        index = len(self._inputs) - 1
        if index < 0:
            raise RuntimeError("check_micro_batch: no micro-batch was added since the step's check")
        first_before = self.monitor.bundle_path
        if step is None:
            step = self.monitor.step
        self._kept[step] = (list(self._inputs), list(self._losses))
        try:
            return self.monitor.check(batch={MICRO_BATCHES: self._inputs[index:]}, loss=self._losses[index],
                                      step=step, sample_ids=self._sample_ids(self._inputs[index:],
                                                                             self._ids[index:], first=index),
                                      micro_batch=True)
        finally:
            self._record_micro_batches(first_before)

    def after_update(self, *, skipped: bool) -> None:
        """The framework skipped (or applied) the step's update: a GradScaler's overflow skip is counted here."""
        if skipped and not self._skipped_now:
            self.skipped_steps += 1
        self._skipped_now = False

    def _count(self, report: ScanReport) -> int:
        if isinstance(report, ScanReport):
            return len(report.nonfinite)
        decided = getattr(report, "decided_step", None)  # a PendingReport: its verdict is an earlier step's
        return next((len(e.report.nonfinite) for e in self.monitor.history if e.step == decided), 0)

    def _record_micro_batches(self, bundle_before: Any) -> None:
        """An incident was bundled in this check (the run's first, or the first since a rollback): say in its bundle
        which micro-batch went bad."""
        monitor = self.monitor
        if monitor.bundle_path is None or monitor.bundle_path == bundle_before:
            return
        try:
            step = load_bundle(monitor.bundle_path).step
            if step not in self._kept:
                return
            finding = micro_batch_finding(*self._kept[step], (monitor.autocast or {}).get("dtype"))
            load_bundle(monitor.bundle_path).add_finding(MICRO_BATCH_FINDING, *finding)
        except Exception as exc:  # noqa: BLE001 - the bundle is written; a failed note must not hide the NaN
            log.error("nanscan: could not record the micro-batches in %s: %s: %s", monitor.bundle_path,
                      type(exc).__name__, exc)

    # -- the logs and the end -----------------------------------------------------------------------------------
    def numbers(self) -> dict[str, int]:
        """nanscan's per-step numbers: non-finite tensors in the last checked step, non-finite steps so far, and
        updates skipped (by on_invalid "skip"/"stop", or by the framework's GradScaler where it says so)."""
        monitor = self.monitor
        steps = (monitor.first_invalid_step is not None) + monitor.invalid_steps
        return dict(zip(LOG_KEYS, (self.nonfinite_tensors, steps, self.skipped_steps)))

    def abandon(self, exc: BaseException) -> None:
        """The training loop is failing with `exc`: close the Monitor as its with-block would (a pending verdict is
        still bundled, without replacing the loop's exception) and remove its hook."""
        first_before = self.monitor.bundle_path
        try:
            self.monitor.__exit__(type(exc), exc, exc.__traceback__)
        finally:
            self._record_micro_batches(first_before)

    def close(self) -> None:
        """Read a pending verdict (mode="async") and remove the Monitor's hook."""
        first_before = self.monitor.bundle_path
        try:
            self.monitor.close()
        finally:
            self._record_micro_batches(first_before)
