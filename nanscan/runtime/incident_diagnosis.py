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
No bisection runs here (the failing batch's suspicious samples: `nanscan ablate`, which has the replay entry).

Nothing of the run changes: the live weights are copied to the host first and loaded back after, the gradients (by
reference), buffers, modules' train/eval modes, parameter dtypes (a precision factor casts them to float32) and RNG
streams are put back (incident_rerun.set_aside), the live optimizer is never stepped, and the Monitor's step-start
hook is disarmed. Its cost is bounded by `diagnose_timeout` seconds (DEFAULT_TIMEOUT_S): checked before each factor,
the factors left then are "not judged" and say so; the unchanged window always runs (its verdict decides whether any
factor can be credited). The default, 300 s, is a few times what a 124M-parameter GPT's window of 32 steps and its
ladder take on one GPU, and small beside the restart the incident costs. `diagnose=False` turns it off.

The verdict goes where the incident's reader looks: the bundle (the window's rerun, one finding per factor and the
finding "diagnosis" with the conclusion, in the ledger and INCIDENT.md), Monitor.diagnosis, and the error's message.
Under a process group the window is not rerun here: each rank's batch is only part of the global batch and its kept
state may be a shard, so a rank alone would rerun another run; every rank says so, the same way.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nanscan.bundle import Bundle, load_bundle
from nanscan.bundle.format import DIAGNOSIS_FINDING
from nanscan.entry import ReplaySpec
from nanscan.runtime.incident_rerun import function_name, set_aside
from nanscan.runtime.rerun import HALF_DTYPES
from nanscan.runtime.rerun_inputs import ReplayError
from nanscan.runtime.step_options import StepOptions
from nanscan.runtime.window_ablation import (TIME_SPENT, WindowAblation, ablate_over_window, conclusion,
                                             record_window_ablation)
from nanscan.runtime.window_rerun import record_window_replay

DEFAULT_TIMEOUT_S = 300.0
NO_BISECTION = ("not tried in the process: finding the failing batch's suspicious samples is a bisection over the "
                "step, which `nanscan ablate BUNDLE --entry ...` runs")
IN_GROUP = ("under a process group the window is rerun on every rank together, which this Monitor does not do yet: "
            "a rank alone holds part of the global batch and may hold a shard of the state; `nanscan ablate` on the "
            "bundle set with a replay entry judges it")


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
        return self.ablation is not None and any(r.detail == TIME_SPENT for r in self.ablation.rows)

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


class ProcessSource:
    """A WindowSource (nanscan.runtime.window_rerun) over the training process: the live model, loaded with each
    kept state; a fresh optimizer of the run's type over the same parameters for every rerun (NOTE: [in-process
    diagnosis])."""

    def __init__(self, bundle: Bundle, model: torch.nn.Module, optimizer: Any, step_fn: Callable):
        self.bundle, self.model, self.step_fn, self.live_optimizer = bundle, model, step_fn, optimizer
        self.entry = function_name(step_fn)
        self.notes: list[str] = []
        self.optimizer_state = None  # a fresh optimizer already carries the run's param groups (their eps)
        self._dtypes = [(t, t.dtype) for t in [*model.parameters(), *model.buffers()]]
        self._fresh_optimizer()  # refused now, with its reason, rather than at the first factor

    def spec(self) -> ReplaySpec:
        """The spec the ablation reads: the live model and step_fn; the clipping and loss scaling are observed."""
        return ReplaySpec(self.model, lambda _model: self._fresh_optimizer(), self.step_fn)

    def build_at(self, model_state: dict | None, optimizer_state: dict | None,
                 options: StepOptions = StepOptions()) -> tuple[ReplaySpec, torch.optim.Optimizer]:
        with torch.no_grad():
            for t, dtype in self._dtypes:  # a precision factor's float32 weights, back to the run's dtypes
                if t.dtype != dtype:
                    t.data = t.data.to(dtype)
            if model_state is not None:
                # strict: the state is this model's own; only frozen weights (kept by reference) may be absent
                missing, unexpected = self.model.load_state_dict(model_state, strict=False)
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
            optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # step() updates its tensors in place
        if options.eps is not None:
            for group in optimizer.param_groups:
                if "eps" in group:
                    group["eps"] = options.eps
        return self.spec(), optimizer

    def _fresh_optimizer(self) -> torch.optim.Optimizer:
        live = self.live_optimizer
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
             timeout: float = DEFAULT_TIMEOUT_S, in_group: bool = False) -> Diagnosis:
    """Rerun the window of the bundle at `path` in the process and change one factor at a time over it (NOTE:
    [in-process diagnosis]); records what it found in the bundle. Never raises: a failure is the result's."""
    began = time.monotonic()
    result = Diagnosis(step, function_name(step_fn), "not run", timeout=timeout)
    try:
        if in_group:
            result.reason = IN_GROUP
        elif path is None:
            result.reason = "the incident's bundle could not be written, and the window is read from it"
        else:
            bundle = load_bundle(path, whole_set=False)
            window = bundle.window
            if not window or not window.get("states"):
                result.reason = ("the bundle holds no window of the run to rerun (Monitor(window=None), or its "
                                 "max_bytes kept no state)")
            else:
                source = ProcessSource(bundle, model, optimizer, step_fn)
                with set_aside(model, None, None, weights=True):
                    result.ablation = ablate_over_window(source, source.spec(), [], suspicious=NO_BISECTION,
                                                         deadline=began + timeout)
                result.verdict = "done"
    except ReplayError as exc:
        result.verdict, result.reason = "not run", str(exc)
    except Exception as exc:  # noqa: BLE001 - the diagnosis is a diagnostic: its failure is reported, never raised
        result.verdict, result.error = "error", f"{type(exc).__name__}: {exc}"
    result.seconds = time.monotonic() - began
    return result


def record_diagnosis(result: Diagnosis, bundle: Bundle) -> None:
    """Add the diagnosis to the bundle: the unchanged window's rerun, a finding per factor, and the conclusion."""
    if result.ablation is not None:
        if result.ablation.baseline.window is not None:
            record_window_replay(result.ablation.baseline.window, bundle)
        record_window_ablation(result.ablation, bundle)
    bundle.add_finding(DIAGNOSIS_FINDING, f"Diagnosis in process: {result.headline()}", result.markdown(),
                       result.to_dict())
