"""Monitor(step_fn=..., diagnose=True): at an incident, the window of the run rerun in the training process from its
oldest kept state, then one factor changed at a time over it, with no replay entry (NOTE: [in-process diagnosis]).

NOTE: [in-process diagnosis]
A failure that built up over many steps is judged over the window (nanscan.runtime.window_ablation NOTE: [window
ablation]), and a script-style loop has no replay entry to rebuild it outside the process. At the incident the
process holds the model, the optimizer and, through step_fn, the forward: once the bundle is written and the failing
step rerun (NOTE: [in-process rerun]), the Monitor reads the window back from the bundle it just wrote (the evidence
it diagnoses is the evidence it keeps) and runs nanscan.runtime.window_ablation's ladder on a ProcessSource: the
live model with each kept state loaded into it, and for every rerun a fresh optimizer of the run's own type built
from its param groups (their settings: lr, betas, eps, weight decay, foreach/fused), loaded with a copy of the kept
optimizer state. The loop's clipping and loss scaling come from the window's own record (NOTE: [observed loop]).
Past the failing step each factor goes on with the window's own batches (the process has no later batch to give).
The samples dropped are the failing batch's rows that break a step by themselves, by the rule a rollback quarantines
them by (engine.targets.breaking_rows: a NaN, an infinity or an overflow value, a float32 maximum written for
"missing" counting, or targets that are all the ignore index; under a group, each rank's own; none where no rank's
batch holds one): no bisection runs here (a record in range but fatal to the step is found by `nanscan
ablate`'s, which has the replay entry).

Nothing of the run changes: the live weights are copied to the host first and loaded back after, the gradients (by
reference), buffers, modules' train/eval modes, parameter dtypes (a precision factor casts them to float32) and RNG
streams are put back (incident_rerun.set_aside), the live optimizer is never stepped, and the Monitor's step-start
hook is disarmed. Its cost is bounded by `diagnose_timeout` seconds (DEFAULT_TIMEOUT_S): checked before each factor
and at each of its steps (so the limit is passed by at most one step), the factors left then, or cut short, are
"not judged" and say so; the unchanged window always runs (its verdict decides whether any factor can be
credited). A rerun step costs about a training step (benchmarks/bench_diagnosis.py: 0.8x at GPT-2 small's shapes on
the CPU, 2.7x on the demo's tiny model, where the scan and the optimizer's rebuild weigh more), and the full ladder
over a window of W steps runs about 10 x 3W of them: about 1000 training steps for the default 32-step window. The
default, 300 s, covers that where a step takes 0.3 s; a slower run judges the ladder's first factors (the learning
rate first) and says which were left. `diagnose=False` turns it off.

The verdict goes where the incident's reader looks: the bundle (the window's rerun, one finding per factor and the
finding "diagnosis" with the conclusion, in the ledger and INCIDENT.md), Monitor.diagnosis, and the error's message.

Under a process group every rank reruns the window together, each from its own kept state (its shards: a kept
local shard is loaded back into its DTensor with the live parameter's mesh and placements, the optimizer state's
alike) and with its own recorded batches, through the model as the loop wraps it (DistributedDataParallel's
gradient all-reduce, FSDP2's gathers and reduce-scatters, tensor parallelism's collectives), so the global batch and
the sharded state are the run's. The loop's clip threshold is inferred from the group's gradient norm (each shard's sum
of squares over the copies the group holds of it), and the clipping spans every mesh the gradients lie on
(nanscan.runtime.shards.clip_grad_norm: FSDP2 with TP). Tested on train.py's loop under DDP, FSDP2, HSDP 2x2 and FSDP2 +
TP 2x2 (tests/test_diagnosis_ranks.py). Every decision that leads to a collective is taken the same on every rank
(GroupLockstep): a step is non-finite, or failed, when it is on any rank; a row's verdict is rank 0's (judged on its
loss and on its gradients, which under DDP are the group's; under sharding, its shard's); the time limit is rank
0's clock; the kept state the window starts from must be the same step on every rank. Before anything runs, the
ranks agree that each can (a window, a state that fits, an optimizer it can rebuild): where one cannot, none runs,
and every rank's part says why with the same words. The agreement's collectives are small (two all-reduces of two
numbers a step, one gather a row). A step_fn that raises on one rank before its model's first collective leaves the
others waiting until the process group's timeout; a step_fn that ran the run's steps does not.

A framework that keeps the state itself (DeepSpeed ZeRO: NOTE: [zero window]) gives its TensorSource: each kept
state is loaded back into the engine's own buffers, the rerun steps the engine (NOTE: [step driver]) with the live
optimizer (its settings put back before each rerun) rather than a fresh one, and the live state is copied to the
host first and loaded back after (ProcessSource.live_state_kept).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from nanscan.bundle import Bundle, load_bundle
from nanscan.bundle.format import DIAGNOSIS_FINDING
from nanscan.bundle.tree import map_tree
from nanscan.engine.inputs import batch_size, named_parameters
from nanscan.engine.targets import breaking_rows
from nanscan.entry import ReplaySpec
from nanscan.incident import OTHER_RANK
from nanscan.runtime.distributed import all_gather_json
from nanscan.runtime.incident_rerun import function_name, set_aside
from nanscan.runtime.rerun import HALF_DTYPES, StepOutcome
from nanscan.runtime.shards import SHARD_SUFFIX, dtensor_type, placed_model_state, placed_optimizer_state
from nanscan.runtime.rerun_inputs import ReplayError
from nanscan.runtime.step_options import StepOptions
from nanscan.runtime.window_ablation import (TIME_CUT, TIME_SPENT, WindowAblation, WindowRow, ablate_over_window,
                                             conclusion, record_window_ablation)
from nanscan.runtime.window_rerun import SOLO, Lockstep, record_window_replay

DEFAULT_TIMEOUT_S = 300.0
NO_BISECTION = ("no row of the failing batch holds a non-finite or overflow value, and a record in range is found "
                "by a bisection over the step, which `nanscan ablate BUNDLE --entry ...` runs")
ROWS_ORIGIN = "the failing batch's rows holding a NaN, an infinity or an overflow value"
OTHER_RANK_FAILED = "another rank's rerun failed at this step (its part of the bundle set says how)"


@dataclass
class Diagnosis:
    """What the in-process diagnosis found: `verdict` "done" (see `ablation`), "not run" (why: `reason`) or "error"
    (the diagnosis raised: `error`)."""

    step: int
    step_fn: str
    verdict: str
    reason: str | None = None
    ablation: WindowAblation | None = None
    error: str | None = None
    seconds: float = 0.0
    timeout: float = DEFAULT_TIMEOUT_S

    @property
    def fixes(self) -> list[str]:
        """The confirmed factors' keys."""
        return [r.factor.key for r in self.ablation.fixes] if self.ablation is not None else []

    @property
    def timed_out(self) -> bool:
        return self.ablation is not None and any(r.detail in (TIME_SPENT, TIME_CUT) for r in self.ablation.rows)

    def headline(self) -> str:
        """One line: the error message's, Monitor.diagnosis's and the finding's title."""
        if self.verdict == "not run":
            return f"not run: {self.reason}"
        if self.verdict == "error":
            return f"failed: {self.error}"
        text = conclusion(self.ablation)
        if self.timed_out:
            text += f" (the {self.timeout:g} s limit left some factors unjudged: Monitor(diagnose_timeout=...))"
        return text

    def markdown(self) -> str:
        # No timing in the text: the same incident diagnosed again gives the same INCIDENT.md (seconds: the record).
        lines = [f"The window rerun in the training process through `{self.step_fn}` at the incident, from its oldest "
                 "kept state, then one factor at a time over it (NOTE: [in-process diagnosis]); each row is its own "
                 "finding below."]
        if self.verdict == "not run":
            lines += ["", f"Not run: {self.reason}."]
        elif self.verdict == "error":
            lines += ["", f"The diagnosis failed (the evidence above stands): `{self.error}`"]
        else:
            result = self.ablation
            lines += ["", f"**Conclusion:** {self.headline()}.", "", f"- unchanged window: {result.baseline.detail}"]
            lines += [f"- {row.factor.label}: {row.verdict}" + (f" ({row.detail})" if row.detail else "")
                      for row in result.rows]
            lines += [f"- note: {note}" for note in result.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"step": self.step, "step_fn": self.step_fn, "verdict": self.verdict, "reason": self.reason,
                "error": self.error, "seconds": round(self.seconds, 3), "timeout_s": self.timeout,
                "headline": self.headline(), "fixes": self.fixes,
                "ablation": self.ablation.to_dict() if self.ablation is not None else None}


@dataclass
class BadRows:
    """The failing step's batch rows that break it by themselves: what the in-process diagnosis drops (the shape
    of nanscan.replay.bisect.BisectResult that the window ablation reads)."""

    indices: list[int]
    applicable: bool = True
    sample_ids: list | None = None
    label: str = ""
    reason: str = ""


def failing_rows(bundle: Bundle) -> tuple[list[int], list]:
    """The rows of the failing step's batch (one batch: a step checked once) that break a step by themselves
    (engine.targets.breaking_rows), and their sample ids where the check had them; none when no row
    does, when every row does (nothing would be left to train on), or when the step ran several micro-batches
    (their rows are not one batch's)."""
    records = [r for r in bundle.window_records() if r.step == bundle.step]
    if len(records) != 1 or records[0].batch is None:
        return [], []
    record = records[0]
    size = batch_size(record.batch, record.sample_ids)
    rows = breaking_rows(record.batch, size) if size else []
    if len(rows) >= (size or 0):
        return [], []
    ids = record.sample_ids
    named = isinstance(ids, (list, tuple)) and len(ids) == size
    return rows, [ids[i] for i in rows] if named else []


def _suspicious(rows: list[int], ids: list, anywhere: bool, rank: int | None) -> Callable[[], tuple[Any, str]] | str:
    """The drop factor's samples: this rank's bad rows (`ids`, their sample ids), when any rank has some
    (`anywhere`)."""
    if not anywhere:
        return NO_BISECTION
    where = "its batch" if rank is None else f"rank {rank}'s batch"
    named = f" ({', '.join(map(str, ids))})" if ids else ""
    label = f"rows {rows}{named} of {where}" if rows else f"none of {where} (another rank's held the bad rows)"
    return lambda: (BadRows(rows, label=label), ROWS_ORIGIN)


class GroupLockstep(Lockstep):
    """The ranks of a process group in step (NOTE: [in-process diagnosis]): a step non-finite or failed on any rank
    is so on all, a row is rank 0's, the clock is rank 0's."""

    def __init__(self, group: Any, device: torch.device, model: torch.nn.Module):
        self.group, self.device, self.model = group, device, model

    def _max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def finite(self, outcome: StepOutcome) -> StepOutcome:
        bad, failed = self._max([float(not outcome.finite), float(outcome.error is not None)])
        if failed and outcome.error is None:
            return replace(outcome, finite=False, category=OTHER_RANK, error=OTHER_RANK_FAILED)
        if bad and outcome.finite:
            return replace(outcome, finite=False, category=OTHER_RANK)
        return outcome

    def row(self, row: WindowRow) -> WindowRow:
        mine = {"verdict": row.verdict, "detail": row.detail, "beyond_run": row.beyond_run,
                "beyond_nonfinite": row.beyond_nonfinite, "gaining": row.gaining}
        first = all_gather_json(mine, self.group, self.device)[0]
        return replace(row, **first)

    def same(self, value: int) -> bool:
        low, high = self._max([-float(value), float(value)])
        return -low == high

    def time_up(self, deadline: float | None) -> bool:
        mine = float(deadline is not None and time.monotonic() > deadline)
        return bool(all_gather_json(mine, self.group, self.device)[0])

    def grad_norms(self, bundle: Bundle) -> dict[int, float] | None:
        """The group's gradient norm by step from the ranks' recorded shards: each shard's sum of squares divided by
        the copies of it the group holds, summed over the ranks. The copies: its mesh's Replicate dimensions (HSDP's
        replicas, TP's replicated tensors) times the group's ranks outside its mesh (a tensor on the data-parallel
        sub-mesh only, beside tensor-parallel ones on the 2-D mesh, is the same on every rank of a TP pair). None
        for replicated weights (DDP), whose recorded norm is already the group's."""
        dtensor = dtensor_type()
        if dtensor is None or not any(isinstance(p, dtensor) for p in self.model.parameters()):
            return None
        ranks = dist.get_world_size(self.group)
        copies = {name: math.prod(p.device_mesh.size(d) for d, placement in enumerate(p.placements)
                                  if placement.is_replicate()) * max(ranks // p.device_mesh.size(), 1)
                  for name, p in named_parameters(self.model) if isinstance(p, dtensor)}
        entries = bundle.history()
        if not self.same(len(entries)):
            return None
        sums = [sum(t.sumsq / copies.get(t.name.removeprefix("grad:").split(SHARD_SUFFIX)[0], 1)
                    for t in entry.report.stats if t.name.startswith("grad:")) for entry in entries]
        total = torch.tensor(sums, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.group)
        return {entry.step: math.sqrt(v) if v >= 0 else math.nan for entry, v in zip(entries, total.tolist())}


class ProcessSource:
    """A WindowSource (nanscan.runtime.window_rerun) over the training process: the live model, loaded with each
    kept state; a fresh optimizer of the run's type over the same parameters for every rerun (NOTE: [in-process
    diagnosis])."""

    def __init__(self, bundle: Bundle, model: torch.nn.Module, optimizer: Any, step_fn: Callable,
                 forward: torch.nn.Module | None = None, tensor_source: Any = None):
        """`model`: the plain module (its states load into it); `forward`: the module step_fn is given, as the loop
        wraps it (DistributedDataParallel, DeepSpeed's engine), default `model`; `tensor_source`: a framework's
        TensorSource that loads its states back and drives its steps (NOTE: [tensor source]: DeepSpeed's)."""
        self.bundle, self.model, self.step_fn, self.live_optimizer = bundle, model, step_fn, optimizer
        self.forward = forward if forward is not None else model
        self.entry = function_name(step_fn)
        self.notes: list[str] = []
        self.optimizer_state = None  # a fresh optimizer already carries the run's param groups (their eps)
        self._dtypes = [(t, t.dtype) for t in [*model.parameters(), *model.buffers()]]
        # NOTE: [step driver]: a framework's engine steps its own state in place: the live optimizer (its settings
        # put back before each rerun), not a fresh one, and the engine's precision, which no factor changes
        self.tensor_source = tensor_source if callable(getattr(tensor_source, "load_state", None)) else None
        self.driver = self.tensor_source.step_driver() if self.tensor_source is not None else None
        self.fixed_precision = getattr(self.driver, "fixed_precision", None)
        self._settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] \
            if self.driver is not None and optimizer is not None else []
        self._fresh_optimizer()  # refused now, with its reason, rather than at the first factor

    @contextlib.contextmanager
    def live_state_kept(self):
        """The live state a framework's engine holds (a TensorSource's), copied to the host and loaded back after
        the block; for a plain model, incident_rerun.set_aside keeps its weights."""
        if self.tensor_source is None:
            yield
            return
        live = map_tree(self.tensor_source.state(self.model, self.live_optimizer),
                        lambda _, t: t.detach().to("cpu", copy=True))
        try:
            yield
        finally:
            self.tensor_source.load_state(self.model, self.live_optimizer, *live)
            for group, settings in zip(self.live_optimizer.param_groups, self._settings):
                group.update(settings)

    def spec(self) -> ReplaySpec:
        """The spec the ablation reads: the live model and step_fn; the clipping and loss scaling are observed."""
        return ReplaySpec(self.forward, lambda _model: self._fresh_optimizer(), self.step_fn,
                          clip_grad_norm=getattr(self.driver, "clip_grad_norm", None))

    def build_at(self, model_state: dict | None, optimizer_state: dict | None,
                 options: StepOptions = StepOptions()) -> tuple[ReplaySpec, torch.optim.Optimizer]:
        if self.tensor_source is not None:
            return self._engine_at(model_state, optimizer_state, options)
        with torch.no_grad():
            for t, dtype in self._dtypes:  # a precision factor's float32 weights, back to the run's dtypes
                if t.dtype != dtype:
                    t.data = t.data.to(dtype)
            if model_state is not None:
                # strict: the state is this model's own; only frozen weights (kept by reference) may be absent
                missing, unexpected = self.model.load_state_dict(placed_model_state(self.model, model_state),
                                                                 strict=False)
                trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
                if unexpected or trainable & set(missing):
                    raise ReplayError(f"the window's state does not fit the live model: missing "
                                      f"{sorted(trainable & set(missing))[:4]}, unexpected {sorted(unexpected)[:4]}")
            if options.precision is not None:
                for t, _ in self._dtypes:
                    if t.dtype in HALF_DTYPES:
                        t.data = t.data.float()
        optimizer = self._fresh_optimizer()
        if optimizer_state is not None:
            optimizer.load_state_dict(placed_optimizer_state(optimizer, copy.deepcopy(optimizer_state)))
        if options.eps is not None:
            for group in optimizer.param_groups:
                if "eps" in group:
                    group["eps"] = options.eps
        return self.spec(), optimizer

    def _engine_at(self, model_state: dict | None, optimizer_state: dict | None,
                   options: StepOptions) -> tuple[ReplaySpec, torch.optim.Optimizer]:
        """A framework's engine with a kept state loaded in place (NOTE: [step driver]); the live optimizer with
        the run's settings, and a factor's eps."""
        optimizer = self.live_optimizer
        for group, settings in zip(optimizer.param_groups, self._settings):
            group.update(settings)
        if model_state is not None:
            self.tensor_source.load_state(self.model, optimizer, model_state, optimizer_state)
        if options.eps is not None:
            for group in optimizer.param_groups:
                if "eps" in group:
                    group["eps"] = options.eps
        return self.spec(), optimizer

    def _fresh_optimizer(self) -> torch.optim.Optimizer:
        live = self.live_optimizer
        if self.driver is not None:  # the engine's own, stepped in place and put back after (live_state_kept)
            return live
        if not isinstance(live, torch.optim.Optimizer):
            raise ReplayError(f"the run's optimizer ({type(live).__name__}) is no torch.optim.Optimizer, so a fresh "
                              "copy of it cannot be built in the process")
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in live.param_groups]
        try:
            return type(live)(groups)  # every group carries all its settings
        except Exception as exc:  # noqa: BLE001 - an optimizer whose constructor needs more than its groups
            raise ReplayError(f"a fresh {type(live).__name__} cannot be built from the run's param groups "
                              f"({type(exc).__name__}: {exc})") from None


def diagnose(model: torch.nn.Module, optimizer: Any, step_fn: Callable, path: Any, *, step: int,
             timeout: float = DEFAULT_TIMEOUT_S, forward: torch.nn.Module | None = None, group: Any = None,
             device: torch.device | None = None, tensor_source: Any = None) -> Diagnosis:
    """Rerun the window of the bundle at `path` in the process and change one factor at a time over it (NOTE:
    [in-process diagnosis]). `forward`: the module step_fn is given (the loop's wrapper); `group` (with its
    collective `device`): a process group whose ranks all call this together; `tensor_source`: the Monitor's
    framework source (NOTE: [tensor source]). Never raises: a failure is the result's."""
    began = time.monotonic()
    result = Diagnosis(step, function_name(step_fn), "not run", timeout=timeout)
    source, why = None, None
    try:
        source, why = _prepare(model, optimizer, step_fn, path, forward, tensor_source)
    except Exception as exc:  # noqa: BLE001 - said below, the same way on every rank
        why = f"{type(exc).__name__}: {exc}"
    lockstep: Lockstep = SOLO
    rows, ids = failing_rows(source.bundle) if source is not None else ([], [])
    suspicious = _suspicious(rows, ids, bool(rows), None)
    if group is not None:
        try:
            everyone = all_gather_json({"why": why, "rows": rows}, group, device)
        except Exception as exc:  # noqa: BLE001 - a group that cannot agree runs nothing
            everyone = [{"why": f"the ranks could not agree to rerun the window ({type(exc).__name__}: {exc})",
                         "rows": []}]
        stopped = [(rank, part["why"]) for rank, part in enumerate(everyone) if part["why"] is not None]
        why = "; ".join(f"rank {rank}: {reason}" for rank, reason in stopped) if stopped else None
        lockstep = GroupLockstep(group, device, model)
        suspicious = _suspicious(rows, ids, any(part["rows"] for part in everyone), dist.get_rank(group))
    if why is not None:
        result.reason = why
        result.seconds = time.monotonic() - began
        return result
    try:
        with set_aside(model, None, None, weights=source.tensor_source is None), source.live_state_kept():
            result.ablation = ablate_over_window(source, source.spec(), [], suspicious=suspicious,
                                                 deadline=began + timeout, lockstep=lockstep)
        result.verdict = "done"
    except ReplayError as exc:
        result.verdict, result.reason = "not run", str(exc)
    except Exception as exc:  # noqa: BLE001 - the diagnosis is a diagnostic: its failure is reported, never raised
        result.verdict, result.error = "error", f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - began
    return result


def _prepare(model: torch.nn.Module, optimizer: Any, step_fn: Callable, path: Any, forward: torch.nn.Module | None,
             tensor_source: Any) -> tuple[ProcessSource | None, str | None]:
    """The source to rerun the window from, or why there is none: checked before any rank runs a collective."""
    if path is None:
        return None, "the incident's bundle could not be written, and the window is read from it"
    bundle = load_bundle(path, whole_set=False)
    window = bundle.window
    if not window or not window.get("states"):
        return None, ("the bundle holds no window of the run to rerun (Monitor(window=None), a tensor source that "
                      "cannot load its state back, or a max_bytes that kept no state)")
    try:
        source = ProcessSource(bundle, model, optimizer, step_fn, forward, tensor_source)
        # the first state loads, as every rerun will load one
        with set_aside(model, None, None, weights=source.tensor_source is None), source.live_state_kept():
            source.build_at(*bundle.window_state(window["states"][0]["step"]))
    except ReplayError as exc:
        return None, str(exc)
    return source, None


def record_diagnosis(result: Diagnosis, bundle: Bundle) -> None:
    """Add the diagnosis to the bundle: the unchanged window's rerun, a finding per factor, and the conclusion."""
    if result.ablation is not None:
        if result.ablation.baseline.window is not None:
            record_window_replay(result.ablation.baseline.window, bundle)
        record_window_ablation(result.ablation, bundle)
    bundle.add_finding(DIAGNOSIS_FINDING, f"Diagnosis in process: {result.headline()}", result.markdown(),
                       result.to_dict())
