"""`nanscan preflight`: before a long run, check the data, then train a few steps from the replay entry on a
fixed review sample with a scan after every backward and every optimizer step, check the optimizer's settings
against the parameters' dtypes (nanscan.runtime.traps NOTE: [update traps]), and give a go / no-go verdict.

The review sample holds normal batches and the boundary batches (the longest samples, the largest input
magnitude) from the entry's healthy batches. Before the real steps, a canary runs on a copy of the model and
optimizer: a normal batch with a NaN injected into an input (or, when no input can hold a NaN or the model
masks it, into a parameter). The scan must catch it; that proves the checks are live. Nothing the canary touches
is used afterwards.

The subcommand and its GO / NO-GO view are nanscan.cli.preflight, which imports this module only when it runs; the
defaults both use are nanscan.cli.preflight_options.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.entry import EntryError, ReplaySpec, build_spec, entry_search_dirs, locate_entry
from nanscan.engine.headroom import headroom
from nanscan.incident import shown_names
from nanscan.cli.preflight_options import DEFAULT_SAMPLE_BATCHES, DEFAULT_STEPS
from nanscan.replay.options import PRECISION_NAMES, StepOptions
from nanscan.replay.step import StepOutcome, autocast_context, model_device, run_step, with_run_precision
from nanscan.runtime.traps import BREAKS, optimizer_traps
from nanscan.engine.stats import ScanReport

# Warn when the largest value is this close (in binades, i.e. factors of two) to a low-precision format's maximum.
HEADROOM_WARN_BINADES = 2
# Warn when more than this share of the gradient values would flush to zero in the model's low-precision format.
UNDERFLOW_WARN_SHARE = 0.01
_LOW_PRECISION = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_GROUPS = {"param": "parameters", "grad": "gradients", "optim": "optimizer state"}


@dataclass
class SampleBatch:
    index: int  # position in the entry's batches
    roles: list[str]  # "normal", "longest", "largest magnitude"
    length: int  # elements per sample of the largest input tensor
    magnitude: float  # largest finite |x| over the floating inputs

    def label(self) -> str:
        return f"batch {self.index} ({', '.join(self.roles)})"

    def to_dict(self) -> dict:
        return {"index": self.index, "roles": self.roles, "length": self.length, "magnitude": self.magnitude}


@dataclass
class StepResult:
    step: int
    batch: str
    loss: float | None
    ok: bool
    problem: str | None = None

    def to_dict(self) -> dict:
        return {"step": self.step, "batch": self.batch, "loss": _finite_or_text(self.loss), "ok": self.ok,
                "problem": self.problem}


@dataclass
class CanaryResult:
    injected_into: str  # e.g. "input x[0]" or "parameter 0.weight"
    caught: bool
    detail: str

    def to_dict(self) -> dict:
        return {"injected_into": self.injected_into, "caught": self.caught, "detail": self.detail}


@dataclass
class PreflightReport:
    go: bool
    reasons: list[str]
    warnings: list[str] = field(default_factory=list)
    data: Any = None  # nanscan.data.DataReport when --data was given
    fail_on: tuple[str, ...] = ()
    sample: list[SampleBatch] = field(default_factory=list)
    canaries: list[CanaryResult] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    headroom: dict[str, list[dict]] = field(default_factory=dict)
    low_precision: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "verdict": "go" if self.go else "no-go", "go": self.go, "reasons": self.reasons,
            "warnings": self.warnings,
            "data": self.data.to_dict(self.fail_on) if self.data is not None else None,
            "sample": [s.to_dict() for s in self.sample], "canaries": [c.to_dict() for c in self.canaries],
            "steps": [s.to_dict() for s in self.steps], "headroom": self.headroom,
            "low_precision_dtypes": self.low_precision,
        }


def _finite_or_text(value: float | None):
    """JSON has no NaN: non-finite numbers are written as text."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


# -- batches -------------------------------------------------------------------------------------------------
def _tensors(batch: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor inside a batch (dicts, lists, tuples, dataclass-like objects)."""
    if isinstance(batch, torch.Tensor):
        return [(prefix or "input", batch)]
    if isinstance(batch, dict):
        return [t for k, v in batch.items() for t in _tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(batch, (list, tuple)):
        return [t for i, v in enumerate(batch) for t in _tensors(v, f"{prefix}[{i}]")]
    return []


def _scan(tensors: list[torch.Tensor]) -> ScanReport:
    import nanscan

    return nanscan.scan(tensors)


def profile_batch(index: int, batch: Any) -> tuple[SampleBatch, list[str]]:
    """Length and magnitude of one batch, and the names of its inputs holding non-finite values."""
    named = _tensors(batch)
    floating = [(n, t) for n, t in named if t.is_floating_point() or t.is_complex()]
    length = max((t.numel() // max(t.shape[0], 1) if t.dim() else 1 for _, t in named), default=0)
    magnitude, bad = 0.0, []
    if floating:
        report = _scan([t for _, t in floating])
        magnitude = max((s.absmax for s in report.stats), default=0.0)
        bad = [floating[int(n.removeprefix("tensor[").rstrip("]"))][0] for n in report.nonfinite]
    return SampleBatch(index, [], length, magnitude), bad


def choose_sample(profiles: list[SampleBatch], normal: int = 2) -> list[SampleBatch]:
    """The first `normal` batches, then the longest and the largest-magnitude batch (a batch may fill roles)."""
    chosen: dict[int, SampleBatch] = {}
    for p in profiles[:normal]:
        chosen.setdefault(p.index, p).roles.append("normal")
    if profiles:
        longest = max(profiles, key=lambda p: (p.length, -p.index))
        chosen.setdefault(longest.index, longest).roles.append("longest")
        largest = max(profiles, key=lambda p: (p.magnitude, -p.index))
        chosen.setdefault(largest.index, largest).roles.append("largest magnitude")
    return list(chosen.values())


# -- model scans --------------------------------------------------------------------------------------------------
def scan_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int | None = None
               ) -> ScanReport:
    """What `nanscan.check(model, optimizer)` scans (parameters, gradients, optimizer state), without its
    side effects (no step counting, no evidence bundle): a preflight is a rehearsal."""
    from nanscan.scan import model_inputs, scan_inputs

    return scan_inputs(model_inputs(model, optimizer), step=step)


def _loss_value(loss: Any) -> float:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"step_fn returned {type(loss).__name__}; it must return the loss as a tensor")
    if loss.numel() != 1:
        raise TypeError(f"step_fn returned a tensor of shape {tuple(loss.shape)}; it must return a scalar loss")
    return float(loss.detach().float().cpu())


# -- canary -------------------------------------------------------------------------------------------------------
def _inject_into_input(batch: Any) -> tuple[Any, str] | None:
    """A copy of the batch with a NaN in the first element of its first floating tensor (None if it has none)."""
    replaced = {}

    def rebuild(value, name):
        if isinstance(value, torch.Tensor):
            if not replaced and (value.is_floating_point() or value.is_complex()) and value.numel():
                poisoned = value.detach().clone()
                poisoned.view(-1)[0] = float("nan")
                replaced["name"] = name
                return poisoned
            return value
        if isinstance(value, dict):
            return type(value)((k, rebuild(v, f"{name}.{k}" if name else str(k))) for k, v in value.items())
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(rebuild(v, f"{name}.{f}") for f, v in zip(value._fields, value)))
        if isinstance(value, (list, tuple)):
            return type(value)(rebuild(v, f"{name}[{i}]") for i, v in enumerate(value))
        return value

    poisoned = rebuild(batch, "")
    return (poisoned, f"input {replaced['name'] or 'input'}[0]") if replaced else None


def run_canary(spec: ReplaySpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
               scan: Callable = scan_model, options: StepOptions = StepOptions()) -> list[CanaryResult]:
    """Train one step on copies with a NaN planted; the scan must report it. Tries an input first, then a
    parameter (when no input can hold a NaN, the step raised, or the model masked the NaN). `options`: the
    precision the steps run in (run_preflight's `precision`)."""
    results = []
    poisoned = _inject_into_input(batch)
    if poisoned is not None:
        results.append(_canary_step(spec, model, optimizer, poisoned[0], poisoned[1], None, scan, options))
        if results[-1].caught:
            return results
    name = next((n for n, p in model.named_parameters() if p.is_floating_point() and p.numel()), None)
    if name is None:
        results.append(CanaryResult("nothing", False, "the model has no floating-point parameter to plant a NaN "
                                                      "in, and no batch input can hold one"))
        return results
    results.append(_canary_step(spec, model, optimizer, batch, f"parameter {name}", name, scan, options))
    return results


def _canary_step(spec: ReplaySpec, model, optimizer, batch, where: str, parameter: str | None,
                 scan: Callable, options: StepOptions) -> CanaryResult:
    canary_model, canary_optimizer = copy.deepcopy((model, optimizer))
    if parameter is not None:
        with torch.no_grad():
            dict(canary_model.named_parameters())[parameter].view(-1)[0] = float("nan")
    canary_optimizer.zero_grad(set_to_none=True)
    try:
        with autocast_context(options, model_device(canary_model).type):
            loss = spec.step_fn(canary_model, batch)
        loss_value = _loss_value(loss)
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - the user's step may refuse a NaN; then the scan never ran
        return CanaryResult(where, False, f"the step raised {type(exc).__name__}: {exc} before the scan ran")
    report = scan(canary_model, canary_optimizer)
    if not report.ok:
        return CanaryResult(where, True, f"non-finite values in {shown_names(report.nonfinite, 4)} (loss {loss_value})")
    return CanaryResult(where, False, f"the scan saw only finite values (loss {loss_value})")


# -- training steps -----------------------------------------------------------------------------------------------
def _group_of(name: str) -> str:
    return _GROUPS.get(name.split(":", 1)[0], "other")


def train_steps(spec: ReplaySpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                sample: list[tuple[SampleBatch, Any]], steps: int,
                options: StepOptions = StepOptions()) -> tuple[list[StepResult], dict[str, np.ndarray]]:
    """Train `steps` steps cycling through the sample, each through the replay's step runner (run_step: the batch
    and starting state, the loss, the gradients after backward and the state after the optimizer step are
    scanned) under `options` (the run's precision). Stops at the first problem. Returns the step results and
    exponent histograms summed per tensor group over the gradients and the updated state."""
    results: list[StepResult] = []
    hists: dict[str, np.ndarray] = {}
    for step in range(steps):
        info, batch = sample[step % len(sample)]
        out = run_step(model, optimizer, spec.step_fn, batch, options=options)
        for scanned in (out.gradients, out.updated):
            for name, record in zip(scanned.names, scanned.records) if scanned is not None else ():
                group = _group_of(name)
                hists.setdefault(group, np.zeros(L.HIST_BINS, dtype=np.int64))
                hists[group] += record[L.REC_HIST:L.REC_HIST_END]
        problem = None if out.finite else _step_problem(out)
        results.append(StepResult(step, info.label(), out.loss, out.finite, problem))
        if problem is not None:
            break
    return results, hists


# What a failed rehearsal step says, by the step's category (the error, when the step raised, says it itself).
_PROBLEM_AT = {"input": "non-finite input in ", "parameter": "non-finite weights before the step in ",
               "optimizer_state": "non-finite optimizer state before the step in ",
               "gradient": "non-finite after backward in ", "update": "non-finite after the optimizer step in "}


def _step_problem(out: StepOutcome) -> str:
    if out.error is not None:
        return out.error
    if out.category == "loss":
        return f"the loss is {out.loss}"
    return _PROBLEM_AT[out.category] + shown_names(out.nonfinite, 4)


def headroom_report(hists: dict[str, np.ndarray], low_precision: list[str]) -> tuple[dict, list[str]]:
    """Headroom per tensor group and format; warnings for the low-precision formats the model uses."""
    table, warnings = {}, []
    for group, hist in hists.items():
        rows = [h.to_dict() for h in headroom(hist)]
        table[group] = rows
        for row in rows:
            if row["format"] not in low_precision or not row["values"]:
                continue
            fmt = row["format"]
            if row["overflow"] > 0:
                warnings.append(f"{row['overflow']:.2%} of {group} values lie above the {fmt} range")
            elif row["binades_to_overflow"] is not None and row["binades_to_overflow"] <= HEADROOM_WARN_BINADES:
                warnings.append(f"{group}: the largest value is within {row['binades_to_overflow']} binade(s) of "
                                f"{fmt} overflow")
            if group == "gradients" and row["underflow"] > UNDERFLOW_WARN_SHARE:
                warnings.append(f"{row['underflow']:.2%} of gradient values would flush to zero in {fmt} "
                                "(consider loss scaling)")
    return table, warnings


# -- the whole preflight ------------------------------------------------------------------------------------------
def run_preflight(entry: "str | ReplaySpec", *, config: dict | None = None, steps: int = DEFAULT_STEPS,
                  data_paths: Iterable[str] = (), fail_on: Iterable[str] | None = None,
                  data_options: dict | None = None, sample_batches: int = DEFAULT_SAMPLE_BATCHES, seed: int = 0,
                  scan: Callable = scan_model, progress: Any = None, precision: str | None = None) -> PreflightReport:
    """Run the preflight. `entry` is "package.module:function" (called with `config`) or a ReplaySpec.
    `precision`: the autocast dtype the run's loop enters around its forward ("bfloat16", "float16"; None or
    "float32": none), entered around step_fn as replay enters a recorded one, unless the entry enters its own
    (NOTE: [replayed precision] in nanscan/runtime/rerun_inputs.py).

    Raises EntryError when the entry cannot be found or does not return a ReplaySpec; every other problem
    (including the entry raising) is a reason in the no-go verdict.
    """
    from nanscan.data.findings import DEFAULT_FAIL_ON

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if precision is not None and precision not in PRECISION_NAMES:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISION_NAMES)} or None")
    fail_on = tuple(DEFAULT_FAIL_ON if fail_on is None else fail_on)
    report = PreflightReport(go=False, reasons=[], fail_on=fail_on)
    data_paths = list(data_paths)
    if data_paths:
        from nanscan.data import check_paths

        report.data = check_paths(data_paths, progress=progress, **(data_options or {}))
        failing = report.data.failing(fail_on)
        if failing:
            report.reasons.append("data: " + ", ".join(f"{n} {c}" for c, n in failing.items())
                                  + " (the listed records must be fixed or removed)")
        if not report.data.complete:
            # Whatever fail_on says: records that were never read cannot be vouched for.
            unread = report.data.unreadable_inputs
            report.reasons.append(f"data: {report.data.unreadable_input_count} input(s) could not be read through, "
                                  "so their records were not all checked: " + ", ".join(unread[:5])
                                  + (" ..." if report.data.unreadable_input_count > 5 else ""))
    torch.manual_seed(seed)
    if isinstance(entry, ReplaySpec):
        spec = entry
    else:
        found_in = locate_entry(entry, entry_search_dirs())
        if found_in is not None:
            report.warnings.append(f"the replay entry {entry!r} is not importable as is; imported it from "
                                   f"{found_in} (set PYTHONPATH or install the package for replay in CI)")
        try:
            spec = build_spec(entry, config)
        except EntryError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's entry failing is a no-go, not a crash
            empty = ("; it was called with an empty config {} (no --config given): pass --config config.json "
                     "with the keys it reads") if not config else ""
            report.reasons.append(f"the replay entry {entry!r} raised {type(exc).__name__}: {exc}{empty}")
            return _finish(report)
    # the region a Monitor would record for the run's forward, entered as replay enters a recorded one
    options = with_run_precision(spec, StepOptions(), {"dtype": precision} if precision else None)
    _rehearse(spec, report, steps, sample_batches, scan, options)
    return _finish(report)


def _rehearse(spec: ReplaySpec, report: PreflightReport, steps: int, sample_batches: int, scan: Callable,
              options: StepOptions) -> None:
    if spec.batches is None:
        report.reasons.append("the replay entry returned no batches (ReplaySpec.batches); preflight trains on them")
        return
    try:
        batches = list(itertools.islice(iter(spec.batches), sample_batches))
    except Exception as exc:  # noqa: BLE001
        report.reasons.append(f"reading the entry's batches raised {type(exc).__name__}: {exc}")
        return
    if not batches:
        report.reasons.append("the replay entry's batches are empty; preflight needs at least one batch")
        return
    profiles, poisoned = [], False
    for i, batch in enumerate(batches):
        profile, bad = profile_batch(i, batch)
        profiles.append(profile)
        if bad:
            poisoned = True
            report.reasons.append(f"batch {i} already holds non-finite input values in {', '.join(bad)}")
    if poisoned:
        return
    report.sample = choose_sample(profiles)
    model = spec.model
    try:
        optimizer = spec.make_optimizer()
    except Exception as exc:  # noqa: BLE001
        report.reasons.append(f"building the optimizer raised {type(exc).__name__}: {exc}")
        return
    report.low_precision = sorted({_LOW_PRECISION[p.dtype] for p in model.parameters() if p.dtype in _LOW_PRECISION})
    _add_traps(report, optimizer_traps(optimizer))  # NOTE: [update traps]: before any step runs
    normal = batches[report.sample[0].index]
    report.canaries = run_canary(spec, model, optimizer, normal, scan, options)
    if not any(c.caught for c in report.canaries):
        report.reasons.append("the canary was not caught: a planted NaN went unseen, so the checks are not live ("
                              + "; ".join(f"{c.injected_into}: {c.detail}" for c in report.canaries) + ")")
        return
    sample = [(info, batches[info.index]) for info in report.sample]
    report.steps, hists = train_steps(spec, model, optimizer, sample, steps, options)
    failed = [s for s in report.steps if not s.ok]
    if failed:
        s = failed[0]
        report.reasons.append(f"step {s.step} on {s.batch}: {s.problem}")
    largest = {id(p): float(p.grad.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) for p in model.parameters()
               if p.grad is not None and p.grad.numel()}
    # after the steps, from their gradients: an explanation beside a failed step's reason, not a reason of its own
    report.warnings += [f"optimizer: {t.describe()}" for t in optimizer_traps(optimizer, largest) if t.setting == "lr"]
    report.headroom, headroom_warnings = headroom_report(hists, report.low_precision)
    report.warnings += headroom_warnings


def _add_traps(report: PreflightReport, traps: list) -> None:
    """An optimizer setting that breaks the update in these dtypes is a no-go, one that only weakens it a warning."""
    for trap in traps:
        (report.reasons if trap.severity == BREAKS else report.warnings).append(f"optimizer: {trap.describe()}")


def _finish(report: PreflightReport) -> PreflightReport:
    report.go = not report.reasons
    return report
