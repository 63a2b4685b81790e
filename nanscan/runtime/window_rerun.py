"""The window of the run rerun (`nanscan replay --window`, and the Monitor's in-process diagnosis): run the bundle's
window of the run again (nanscan.runtime.window NOTE: [run window]) from its
oldest kept state, each step with its recorded batch, learning rates, precision and RNG state, and say whether the
failure comes back at the recorded step and where the rerun first departs from the recorded history.

NOTE: [window replay]
A failure that built up over many steps (a learning rate too large for its warm-up) cannot be judged on the failing
step alone: its starting state already holds the damage. The window's replay starts where the damage had not
begun (the oldest kept state whose steps all kept their batches) and runs every step since as the run did: the
recorded batch, each param group's recorded learning rate (times the options' lr_scale), the recorded autocast
dtype (unless the options name a precision), the torch generators' state at the step's start, the optimizer's
update. Each step's loss and gradient norm are compared with the history the bundle holds (the yardstick): the
first step where either differs by more than DEPART_REL_TOL (relative) is where the rerun departs; on the CPU a
faithful rerun matches to the last bits. It is "reproduced over the window" when the rerun goes non-finite at the
recorded step. A step checked per micro-batch is rerun as its micro-batches, each from the RNG state at its
forward's start. What the loop did between its backward and its update is taken from the window's own record
(nanscan.runtime.loop_effects NOTE: [observed loop]), not asked of the entry: each micro-batch's loss is scaled as
the loop scaled it (the loss it passed over what step_fn returns, at the first step), and the loop's clipping is
applied at the threshold its update factors imply (a ReplaySpec.clip_grad_norm the entry declares comes first;
where they disagree a note says so). A step the run took under a GradScaler is rerun under one at the scale its
check recorded, and skips its update where the gradients overflow (nanscan.runtime.rerun NOTE: [replayed
scaling]); a skip is compared with the record like a loss: the run skipped the step and the rerun did not, or the
other way round, is a departure. A float32 factor runs without the scaler (a float32 run needs none). A step's loss
is compared as the sum of the losses the loop passed for its micro-batches. Where the rerun departs anyway, the
first departing step says why, from the evidence (observed_loop.departure_reason). What it cannot rebuild is said,
not papered over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
import time
from typing import Any, Callable, Protocol

import torch

from nanscan.bundle import Bundle, load_bundle
from nanscan.bundle.format import WINDOW_REPLAY_FINDING, WindowStep, json_float
from nanscan.engine.inputs import batch_size
from nanscan.entry import ReplaySpec
from nanscan.runtime.observed_loop import LoopClipping, departure_reason, infer_clipping, simple_ratio
from nanscan.runtime.rerun import Accumulation, StepOutcome, model_device, recorded_precision, run_step
from nanscan.runtime.rerun_inputs import ReplayError, loop_options, prepare_batch, select_samples
from nanscan.runtime.step_options import StepOptions

DEPART_REL_TOL = 1e-4


@dataclass
class WindowStepResult:
    """One rerun step beside its record: the replayed and recorded loss and gradient norm."""

    step: int
    finite: bool
    category: str | None
    loss: float | None
    grad_norm: float | None
    recorded_loss: float | None
    recorded_grad_norm: float | None
    departs: str | None = None  # "loss", "grad_norm" or "skip" where this step differs from the record
    error: str | None = None
    reason: str | None = None  # at the first departing step: why, from the evidence (departure_reason)
    skipped: bool = False  # the rerun's GradScaler skipped the update (NOTE: [replayed scaling])
    recorded_skipped: bool = False  # the run's did

    def to_dict(self) -> dict:
        return {"step": self.step, "finite": self.finite, "category": self.category,
                "loss": json_float(self.loss), "grad_norm": json_float(self.grad_norm),
                "recorded_loss": json_float(self.recorded_loss),
                "recorded_grad_norm": json_float(self.recorded_grad_norm), "departs": self.departs,
                "error": self.error, "reason": self.reason, "skipped": self.skipped,
                "recorded_skipped": self.recorded_skipped}


@dataclass
class WindowReplay:
    """The window's rerun (NOTE: [window replay])."""

    bundle: str
    step: int  # the recorded failing step
    bundle_category: str
    entry: str
    start: int  # the kept state the rerun started from
    options: StepOptions
    steps: list[WindowStepResult]
    notes: list[str] = field(default_factory=list)

    @property
    def first_nonfinite(self) -> WindowStepResult | None:
        return next((s for s in self.steps if not s.finite), None)

    @property
    def first_departure(self) -> WindowStepResult | None:
        return next((s for s in self.steps if s.departs is not None), None)

    @property
    def reproduced(self) -> bool:
        bad = self.first_nonfinite
        return bad is not None and bad.error is None and bad.step == self.step

    def headline(self) -> str:
        span = f"steps {self.start}-{self.steps[-1].step}" if self.steps else f"from step {self.start}"
        bad = self.first_nonfinite
        if self.reproduced:
            return (f"reproduced over the window: rerun from the state kept at step {self.start}, {span}, it went "
                    f"non-finite again at step {self.step} ({bad.category})")
        if bad is not None and bad.error is not None:
            return f"the window's rerun stopped at step {bad.step}: {bad.error}"
        if bad is not None:
            return (f"the window's rerun went non-finite at step {bad.step} ({bad.category}), not at the recorded "
                    f"step {self.step}")
        return (f"not reproduced over the window: rerun from the state kept at step {self.start}, {span} stayed "
                "finite")

    def departure_text(self) -> str:
        first = self.first_departure
        if first is None:
            return "the rerun matches the recorded loss and gradient norm at every step it could compare"
        if first.departs == "skip":
            did, did_not = ("the run", "the rerun") if first.recorded_skipped else ("the rerun", "the run")
            return (f"the rerun first departs from the record at step {first.step}: {did}'s GradScaler skipped the "
                    f"update for overflow, {did_not}'s did not")
        replayed, recorded = (first.loss, first.recorded_loss) if first.departs == "loss" else \
            (first.grad_norm, first.recorded_grad_norm)
        return (f"the rerun first departs from the record at step {first.step}: {first.departs} {replayed:.6g} "
                f"against {recorded:.6g} recorded" + (f" ({first.reason})" if first.reason else ""))

    def to_dict(self) -> dict:
        first = self.first_departure
        return {"bundle": self.bundle, "step": self.step, "bundle_category": self.bundle_category,
                "entry": self.entry, "start": self.start, "options": self.options.to_dict(),
                "reproduced": self.reproduced, "headline": self.headline(),
                "first_nonfinite": self.first_nonfinite.step if self.first_nonfinite else None,
                "first_departure": first.step if first else None,
                "steps": [s.to_dict() for s in self.steps], "notes": list(self.notes)}


def _start(bundle: Bundle, records: list[WindowStep]) -> int:
    """The oldest kept state from which every step up to the failing one kept its batch."""
    lost = [r for r in records if r.batch is None and r.step <= bundle.step]
    kept = [s["step"] for s in bundle.window["states"]
            if s["step"] <= bundle.step and all(r.step < s["step"] for r in lost)]
    if kept:
        return kept[0]
    if lost:
        why = f"the window lost the batches of steps {[r.step for r in lost]} ({lost[0].note})"
    else:
        why = "it keeps no state (it was kept within Window(max_bytes=), which holds none)"
    raise ReplayError(f"{bundle.path}'s window cannot be rerun: {why}")


@dataclass(frozen=True)
class WindowEvidence:
    """What a rerun starts from and is compared with, read from the bundle once (an ablation reruns the window once
    per factor): the window's checks, and the recorded (loss, gradient norm) of each step of the history."""

    records: list[WindowStep]
    history: dict[int, tuple[float | None, float | None]]
    clipping: LoopClipping | None = None  # the loop's, observed (NOTE: [observed loop])
    skips: frozenset[int] = frozenset()  # the steps whose update the run's GradScaler skipped (overflow)
    backoff: float = 0.5  # the GradScaler's, where the history recorded it: its scale after a skip

    @classmethod
    def of(cls, bundle: Bundle, lockstep: "Lockstep | None" = None) -> "WindowEvidence":
        """`lockstep`: a group's, whose gradient norms the clipping is inferred from (a sharded rank's own norm is
        not the one clip_grad_norm_ scaled by)."""
        records = bundle.window_records()  # a BundleError saying why, for a bundle that holds no window
        entries = bundle.history()
        history = {entry.step: (entry.loss, entry.grad_norm) for entry in entries}
        norms = (lockstep.grad_norms(bundle) if lockstep is not None else None) or \
            {step: g for step, (_, g) in history.items()}
        scaled = [entry for entry in entries if entry.report.scaling is not None]
        unscaled = {entry.step for entry in scaled if not entry.report.scaling.scaled}
        skips = frozenset(entry.step for entry in scaled if entry.report.overflow_skip)
        backoff = scaled[-1].report.scaling.backoff if scaled else 0.5
        return cls(records, history, infer_clipping(records, norms, unscaled), skips, backoff)

    def loop_clip(self, spec: Any) -> float | None:
        """The loop's clip threshold: the entry's declaration (ReplaySpec.clip_grad_norm), else the observed one."""
        if spec.clip_grad_norm is not None:
            return spec.clip_grad_norm
        return self.clipping.max_norm if self.clipping is not None else None

    def precision(self) -> str:
        """The autocast dtype the window's steps recorded, as a StepOptions precision ("float32": none)."""
        found = [recorded_precision(r.autocast) for r in self.records]
        return next((p for p in found if p), "float32")


def _departs(replayed: float | None, recorded: float | None) -> bool:
    if replayed is None or recorded is None or not (math.isfinite(replayed) and math.isfinite(recorded)):
        return False
    return not math.isclose(replayed, recorded, rel_tol=DEPART_REL_TOL, abs_tol=1e-12)


class Lockstep:
    """How the ranks of a process group keep one window rerun in step (NOTE: [in-process diagnosis] in
    nanscan/runtime/incident_diagnosis.py): every decision that leads to a collective, or to none, is taken the same
    on every rank. One process (SOLO) decides alone; nanscan.runtime.incident_diagnosis.GroupLockstep agrees."""

    def finite(self, outcome: StepOutcome) -> StepOutcome:
        """The step's outcome as the ranks agree on it: non-finite (or failed) when it is on any rank."""
        return outcome

    def row(self, row: Any) -> Any:
        """A judged row (nanscan.runtime.window_ablation.WindowRow) as the ranks agree on it."""
        return row

    def same(self, value: int) -> bool:
        """Whether every rank holds this value."""
        return True

    def grad_norms(self, bundle: Bundle) -> dict[int, float] | None:
        """The group's gradient norm by step, where a rank's recorded one is only its shard's (None: the recorded
        one is the group's): what the loop's clipping acted on."""
        return None

    def time_up(self, deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() > deadline


SOLO = Lockstep()


class WindowSource(Protocol):
    """What a window's rerun is built from: the bundle (its window, history and states) and a way to build the
    model and a fresh optimizer with a state loaded. nanscan.replay.replayer.Replayer builds them through the replay
    entry; the Monitor's in-process diagnosis from the training process's own model, optimizer and step_fn
    (nanscan.runtime.incident_diagnosis)."""

    bundle: Bundle
    entry: str  # how the model is built, as rows and findings name it
    notes: list[str]
    optimizer_state: dict | None  # the failing step's (its param groups carry the run's settings)
    # optionally `driver`: how its steps drive the loop's engine (NOTE: [step driver] in nanscan/runtime/rerun.py),
    # without one the plain loop's; and `fixed_precision`: why no precision factor applies (the engine sets it)

    def build_at(self, model_state: dict | None, optimizer_state: dict | None,
                 options: StepOptions = StepOptions()) -> tuple[ReplaySpec, torch.optim.Optimizer]: ...


@dataclass
class WindowRun:
    """A rerun window and what it leaves to go on with: the model (spec.model) and optimizer after its last step,
    and the learning rates of the recorded failing step."""

    result: WindowReplay
    spec: Any
    optimizer: torch.optim.Optimizer
    last_lrs: list
    options: StepOptions = StepOptions()  # what its steps ran under: the loop's observed clipping and loss scale
    step_batches: list = field(default_factory=list)  # each rerun step's batch (an Accumulation of its micro-batches)
    cut: bool = False  # the deadline came before its last step: its steps so far, not the window
    grad_scale: float | None = None  # the GradScaler's scale for a step after its last (NOTE: [replayed scaling])
    driver: Any = None  # the engine's StepDriver, None: the plain loop's (NOTE: [step driver])


def rerun_window(replayer: WindowSource, options: StepOptions = StepOptions(),
                 drop: Callable[[WindowStep], list[int]] | None = None,
                 evidence: WindowEvidence | None = None, lockstep: Lockstep = SOLO,
                 deadline: float | None = None) -> WindowRun:
    """The window rerun from `replayer` (nanscan.runtime.window_ablation reruns it once per factor, with the
    evidence it read once). `drop(record)`: the sample rows of a recorded step left out of its batch (a suspicious
    record, wherever it is); `lockstep`: how the ranks of a group agree on each step (one process: SOLO);
    `deadline`: a time.monotonic() after which it stops before its next step (`cut`)."""
    target = replayer.bundle
    evidence = evidence or WindowEvidence.of(target)
    records = evidence.records
    start = _start(target, records)
    if not lockstep.same(start):
        raise ReplayError(f"the ranks' windows start at different kept states (this rank's: step {start}): one "
                          "lost batches the others kept, so they cannot rerun the window together")
    model_state, optimizer_state = target.window_state(start)
    spec, optimizer = replayer.build_at(model_state, optimizer_state, options)
    driver = getattr(replayer, "driver", None)
    device = model_device(spec.model)
    # what the replayer says of the failing step's own state and RNG does not concern the window, which has its own
    notes = [note for note in replayer.notes if not note.startswith(("state:", "rng:", "optimizer:"))]
    scaler_off = options.precision == "float32"  # a float32 factor: a float32 run needs no GradScaler
    if any(r.loss_scale is not None for r in records):
        notes.append("the run used a GradScaler: " + (
            "this float32 rerun runs without one" if scaler_off else
            "each step is rerun at the scale its check recorded, and skips its update where the gradients overflow "
            "(NOTE: [replayed scaling])"))
    grad_scale = None
    steps = _optimizer_steps([r for r in records if start <= r.step <= target.step])
    run_options = options
    clipping = evidence.clipping
    if clipping is not None and clipping.seen:
        declared = spec.clip_grad_norm
        if declared is not None and clipping.max_norm is not None and \
                not math.isclose(declared, clipping.max_norm, rel_tol=1e-3):
            notes.append(f"the entry declares clipping at {declared:g} but the run's updates show {clipping.text}; the "
                         "declaration is applied")
        elif declared is None:
            notes.append(clipping.text)
            if clipping.max_norm is not None and options.clip_grad_norm is None:
                run_options = replace(run_options, clip_grad_norm=clipping.max_norm)
    results, lrs, step_batches = [], [], []
    for parts in steps:
        if lockstep.time_up(deadline):
            result = WindowReplay(bundle=str(target.path), step=target.step, bundle_category=target.category,
                                  entry=replayer.entry, start=start, options=options, steps=results, notes=notes)
            return WindowRun(result, spec, optimizer, list(lrs), run_options, step_batches, cut=True,
                             grad_scale=grad_scale, driver=driver)
        record = parts[-1]  # the step's own check; its micro-batches' checks come before it
        grad_scale = None if scaler_off or record.loss_scale is None else float(record.loss_scale)
        lrs = record.lrs
        set_learning_rates(optimizer, lrs, options.lr_scale)
        batches = [prepare_batch(_kept_rows(part, drop, spec), device, options) for part in parts]
        step_batches.append(Accumulation(batches) if len(parts) > 1 else batches[0])
        if len(parts) > 1:
            batch = Accumulation(batches, before=lambda i, parts=parts: _restore_torch_rng(parts[i].rng))
        else:
            batch = batches[0]
            _restore_torch_rng(record.rng)
        # the step's recorded autocast, unless a factor names a precision or the entry enters its own (NOTE:
        # [replayed precision])
        passed = [part.loss for part in parts]
        outcome = run_step(spec.model, optimizer, spec.step_fn, batch,
                           options=loop_options(spec, run_options, record.autocast),
                           passed_losses=passed, grad_scale=grad_scale, driver=driver)
        if run_options.loss_scale is None and outcome.loss_scale is not None and passed[0] is not None:
            run_options = replace(run_options, loss_scale=outcome.loss_scale)  # as seen at the first step
            notes.append(_loss_scale_note(outcome.loss_scale, len(parts)))
        recorded_loss, recorded_norm = evidence.history.get(record.step) or (None, None)
        if None not in passed:
            recorded_loss = math.fsum(passed)  # what the loop backpropagated, summed over its micro-batches
        elif len(parts) > 1:
            recorded_loss = None  # the step's recorded loss is the last micro-batch's alone
        last = record.step == target.step
        if last and outcome.overflow_skip and target.category == "gradient":
            # the failure the run bundled was its scaler's skip (a streak's): the rerun's skip there is it again
            outcome = replace(outcome, finite=False, category="gradient")
        result = _result(record.step, outcome, (recorded_loss, recorded_norm), last=last,
                         recorded_skip=record.step in evidence.skips if record.step in evidence.history else None)
        agreed = lockstep.finite(outcome)  # the departure above is this rank's own; whether to go on, the group's
        result.finite, result.category, result.error = agreed.finite, agreed.category, agreed.error
        if result.departs is not None and not any(r.departs for r in results):
            previous = steps[len(results) - 1][-1] if results else None
            result.reason = departure_reason(outcome.loss, recorded_loss, outcome.grad_norm, recorded_norm,
                                             previous.update_factor if previous is not None else None,
                                             run_options.clip_grad_norm or spec.clip_grad_norm, DEPART_REL_TOL)
        results.append(result)
        if not agreed.finite:
            break
    result = WindowReplay(bundle=str(target.path), step=target.step, bundle_category=target.category,
                          entry=replayer.entry, start=start, options=options, steps=results, notes=notes)
    if grad_scale is not None and results and results[-1].skipped:
        grad_scale *= evidence.backoff  # the scale a step after a skip takes
    return WindowRun(result, spec, optimizer, list(lrs), run_options, step_batches, grad_scale=grad_scale,
                     driver=driver)


def _loss_scale_note(scale: float, parts: int) -> str:
    """How the rerun scales each micro-batch's loss, as the first step showed the loop did."""
    if math.isclose(scale, 1.0 / parts, rel_tol=1e-4) and parts > 1:
        how = f"their mean (each loss x 1/{parts})"
    elif scale == 1.0:
        how = "each loss as step_fn returns it" + (f", summed over the {parts} micro-batches" if parts > 1 else "")
    else:
        how = f"each loss x {simple_ratio(scale) or f'{scale:.6g}'}"
    return (f"loss scaling observed: the loop backpropagated {how}, from the losses it passed at the first step "
            "against what step_fn returns (NOTE: [observed loop]); the rerun does the same")


def _optimizer_steps(records: list[WindowStep]) -> list[list[WindowStep]]:
    """The records grouped by optimizer step, in order: a step's micro-batch checks, then its own check."""
    steps: list[list[WindowStep]] = []
    for record in records:
        if steps and steps[-1][-1].step == record.step and steps[-1][-1].micro_batch is not None:
            steps[-1].append(record)
        else:
            steps.append([record])
    return steps


def _kept_rows(record: WindowStep, drop: Callable[[WindowStep], list[int]] | None, spec: Any) -> Any:
    """The record's batch without the rows `drop` names."""
    dropped = set(drop(record)) if drop is not None else set()
    if not dropped:
        return record.batch
    size = batch_size(record.batch, record.sample_ids)
    return select_samples(record.batch, [i for i in range(size) if i not in dropped], spec, size=size)


def _result(step: int, outcome: StepOutcome, recorded: tuple, *, last: bool,
            recorded_skip: bool | None = None) -> WindowStepResult:
    """`last`: the recorded failing step, whose recorded gradient norm leaves its non-finite values out, so only
    its loss is compared, as at a skip (the run's or the rerun's). `recorded`: (loss, gradient norm); a loss of None
    is not compared. `recorded_skip`: whether the run's GradScaler skipped this step (None: no record of it)."""
    loss, grad_norm = recorded
    skipped = outcome.overflow_skip
    norm_compared = not (last or skipped or recorded_skip)
    departs = "loss" if _departs(outcome.loss, loss) else \
        "skip" if recorded_skip is not None and not last and skipped != recorded_skip else \
        "grad_norm" if norm_compared and _departs(outcome.grad_norm, grad_norm) else None
    return WindowStepResult(step=step, finite=outcome.finite, category=outcome.category, loss=outcome.loss,
                            grad_norm=outcome.grad_norm, recorded_loss=loss, recorded_grad_norm=grad_norm,
                            departs=departs, error=outcome.error, skipped=skipped,
                            recorded_skipped=bool(recorded_skip))


def set_learning_rates(optimizer: torch.optim.Optimizer, lrs: list, scale: float) -> None:
    """Each param group's learning rate: the recorded one (None: left as it is) times `scale`."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if lr is not None and "lr" in group:
            group["lr"] = lr * scale


def _restore_torch_rng(rng: Any) -> None:
    if not rng:
        return
    torch.set_rng_state(rng["torch_cpu"])
    cuda = rng.get("torch_cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def window_markdown(result: WindowReplay) -> str:
    lines = [f"{result.headline()}.", "", f"{result.departure_text()}.", "",
             "| step | loss | recorded | grad norm | recorded |", "| --- | --- | --- | --- | --- |"]
    for s in result.steps:
        cells = [_cell(s.loss), _cell(s.recorded_loss), _cell(s.grad_norm), _cell(s.recorded_grad_norm)]
        marks = (" (overflow skip)" if s.skipped else "") + (" (departs)" if s.departs else "")
        lines.append(f"| {s.step}{marks} | " + " | ".join(cells) + " |")
    lines += [f"- note: {note}" for note in result.notes]
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6g}"


def record_window_replay(result: WindowReplay, bundle: Bundle | None = None) -> bool:
    """Add the window's rerun to the bundle's ledger and INCIDENT.md, once; True when the bundle changed."""
    target = bundle or load_bundle(result.bundle)
    return target.add_finding(WINDOW_REPLAY_FINDING, f"Replay of the window: {result.headline()}",
                              window_markdown(result), result.to_dict())
