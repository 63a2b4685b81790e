"""One factor at a time over the window of the run (`nanscan ablate BUNDLE`, and the Monitor's in-process diagnosis),
from its oldest kept state on, each judged by whether the run stays finite and recovered past the failing step
(NOTE: [window ablation]).

NOTE: [window ablation]
A cause that builds up over many steps is judged where it builds up. Each factor is applied to every step of the
window's rerun (nanscan.runtime.window_rerun NOTE: [window replay]), from the oldest kept state, and the run then goes on
for `beyond` steps on the replay entry's held-out batches (ReplaySpec.batches), at the failing step's learning
rates as the factor sets them (a longer warm-up climbs back: see below). The verdicts:
  - confirmed fix: the window and those steps stay finite, and the gradient norm no longer gains binades step after
    step (it is "gaining" by the Monitor's own growth rule, nanscan.runtime.spikes NOTE: [growth rule]: over its
    last 8 finite steps it rose at all but one, by 3 binades or more in all, to a new high), nor does the weights'
    norm over the steps past the failing one (a decoupled weight decay times a rate above 2 makes the weights grow
    every step while LayerNorm keeps the gradients in range);
  - delays, does not fix: finite past the recorded step, but non-finite later, or still gaining binades;
  - stays finite over the window, not confirmed: the entry gives no held-out batches to go on with;
  - no effect: non-finite at the recorded step again; fails earlier: non-finite before it.
Precision factors are judged by the same rule as any other: a dtype that merely rounds one step differently is
not a fix when the run still diverges. Dropping the failing batch's suspicious samples (its bisection) leaves
them out of every step that holds them, by sample id: a bad record is confirmed when the window and the steps past
it stay finite without it. The learning rate is tried down a ladder (LR_LADDER), from the largest
scale, stopping at the first confirmed fix, which is named with the learning rate it means. Where the recorded
rate was still rising at the failing step (a warm-up), a WARMUP_STRETCH times longer warm-up is tried: a linear
warm-up that long reaches 1/WARMUP_STRETCH of the rate at the same step, so every step of the window runs at that
fraction, and past the failing step the rate climbs on at the stretched slope until it is back at the failing
step's recorded rate, then `beyond` steps more (at most WARMUP_MAX_BEYOND in all): a longer warm-up only fixes the
run if the rate it was heading for is then safe, and short of it the row says how far it got. The clipping factor
is not applied when the loop already clips at that norm or below (ReplaySpec.clip_grad_norm). Where an update
trap points at the optimizer's eps (nanscan.runtime.traps), it is raised to the smallest normal of the trapped dtype
over the window. Every row is
recorded, the ones that did not help included. A failure that the unchanged window does not reproduce has no
factor to credit: then every row says so.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from nanscan.bundle import Bundle, load_bundle
from nanscan.bundle.format import ABLATE_FINDING_PREFIX
from nanscan.runtime.rerun import model_device, run_step
from nanscan.runtime.rerun_inputs import ReplayError, loop_options, prepare_batch
from nanscan.runtime.spikes import SpikeRule, binade_growth
from nanscan.runtime.step_options import BASELINE, FACTORS, Factor, StepOptions
from nanscan.runtime.traps import optimizer_traps
from nanscan.runtime.window_rerun import (SOLO, Lockstep, WindowEvidence, WindowReplay, WindowSource, rerun_window,
                                          set_learning_rates)

DEFAULT_BEYOND = 16  # the fewest steps past the failing one; the horizon is at least twice the window's span
HORIZON_PER_STEP = 2
# Recovered: the median loss over the horizon's last quarter (at least TAIL_MIN steps) is at most LOSS_BAND times
# the run's loss before it diverged (loss_before_divergence). A fixed run trains at or below where it started (a
# healthy run's loss falls: tests/nanogpt_runs.py's healthy runs end at 0.6-0.9 of their first step's); one binade
# above that is no training, whatever stayed finite.
LOSS_BAND = 2.0
TAIL_MIN = 4
LR_LADDER = (0.5, 0.1, 0.01, 0.001)
WARMUP_STRETCH = 2
WARMUP_MAX_BEYOND = 128
FINDING_PREFIX = f"{ABLATE_FINDING_PREFIX}window:"
TIME_SPENT = "left out: the diagnosis's time limit was spent before this factor"
TIME_CUT = "cut short: the diagnosis's time limit was spent while this factor ran"

CONFIRMED, DELAYS, UNCONFIRMED, NO_EFFECT, EARLIER, NOT_JUDGED, NOT_APPLIED, NOT_RECOVERED = (
    "confirmed fix", "delays, does not fix", "stays finite over the window, not confirmed", "no effect",
    "fails earlier", "not judged", "not applied", "finite, loss not recovered")


@dataclass
class WindowRow:
    """One factor over the window: its rerun, the steps past it, and the verdict."""

    factor: Factor
    verdict: str
    window: WindowReplay | None
    beyond_run: int = 0  # held-out steps run past the failing step
    beyond_nonfinite: int | None = None  # the held-out step (1-based) that went non-finite
    gaining: float | None = None  # binades the gradient norm gained over its last steps, if gaining (gaining())
    detail: str = ""

    def to_dict(self) -> dict:
        w = self.window
        return {"factor": self.factor.key, "label": self.factor.label, "options": self.factor.options.to_dict(),
                "verdict": self.verdict, "detail": self.detail, "beyond_run": self.beyond_run,
                "beyond_nonfinite": self.beyond_nonfinite, "gaining_binades": self.gaining,
                "first_nonfinite": w.first_nonfinite.step if w and w.first_nonfinite else None,
                "window": [w.start, w.steps[-1].step] if w and w.steps else None}


@dataclass
class WindowAblation:
    bundle: str
    step: int
    entry: str
    baseline: WindowRow
    rows: list[WindowRow]
    notes: list[str] = field(default_factory=list)
    lrs: dict[int, float] = field(default_factory=dict)  # the first param group's recorded rate, by step

    @property
    def fixes(self) -> list[WindowRow]:
        return [r for r in self.rows if r.verdict == CONFIRMED]

    def to_dict(self) -> dict:
        return {"bundle": self.bundle, "step": self.step, "entry": self.entry, "baseline": self.baseline.to_dict(),
                "rows": [r.to_dict() for r in self.rows], "fixes": [r.factor.key for r in self.fixes],
                "notes": list(self.notes)}


# the single-step ablation's factors, applied to every step of the window alike
_FACTORS = {factor.key: factor for factor in FACTORS}
OTHER_FACTORS = (_FACTORS["clip-1.0"],)
PRECISION_FACTORS = {"float32": _FACTORS["fp32"], "bfloat16": _FACTORS["bf16-autocast"],
                     "float16": _FACTORS["fp16-autocast"]}


def gaining(norms: list[float | None]) -> float | None:
    """The binades a norm gained over its last finite steps when it is still growing by the Monitor's rule
    (binade_growth, NOTE: [growth rule]); None when it is not (or too few steps were finite)."""
    return binade_growth([math.log(g) if g is not None and 0 < g < math.inf else math.nan for g in norms])


def _warmup_factor() -> Factor:
    return Factor(f"warmup-x{WARMUP_STRETCH}", f"warm-up {WARMUP_STRETCH}x longer",
                  StepOptions(lr_scale=1 / WARMUP_STRETCH))


def _climb(failing: int, beyond: int) -> list[float]:
    """A longer warm-up's rate past the failing step, as a fraction of the failing step's recorded rate: the
    stretched linear warm-up ((step + 1) / (WARMUP_STRETCH x (failing + 1))) up to 1, then `beyond` steps at 1,
    at most WARMUP_MAX_BEYOND steps in all."""
    ramp = [(failing + 2 + j) / (WARMUP_STRETCH * (failing + 1)) for j in range(WARMUP_MAX_BEYOND)]
    ramp = [r for r in ramp if r < 1.0]
    return (ramp + [1.0] * beyond)[:WARMUP_MAX_BEYOND]


def horizon(window: WindowReplay, beyond: int) -> int:
    """How many steps past the failing one a factor must stay finite and recovered: at least `beyond`, and at least
    HORIZON_PER_STEP times the steps from the kept state to the failure (a cause that took that long to build must
    be shown gone for longer than it took, or a delay passes for a fix)."""
    return max(beyond, HORIZON_PER_STEP * (window.step - window.start + 1))


def loss_before_divergence(history: dict[int, tuple[float | None, float | None]]) -> float | None:
    """The run's loss before it diverged: the largest of its recorded losses from the first one up to the step
    before the first that is more than LOSS_BAND times the first (the level it trained down from, before a jump;
    a factor judged on held-out batches, whose loss sits above the training batches', is held to it too)."""
    losses = [loss for _, (loss, _) in sorted(history.items()) if loss is not None and math.isfinite(loss)]
    if not losses:
        return None
    calm = list(itertools.takewhile(lambda v: abs(v) <= LOSS_BAND * abs(losses[0]), losses))
    return max(calm or losses[:1], key=abs)


def _judge(replayer: WindowSource, evidence: WindowEvidence, factor: Factor, held_out: list[Any], beyond: int,
           drop: Callable | None = None, stretched: bool = False, go_on: bool = True,
           lockstep: Lockstep = SOLO, deadline: float | None = None) -> WindowRow:
    """Rerun the window under `factor`, then go on past the failing step for horizon() steps: on the entry's
    held-out batches, else on the window's own batches again (the loop's data; the process has no later batch),
    and judge (NOTE: [window ablation]). `stretched`: the rate past the failing step climbs as a longer warm-up's
    (_climb); else the factor's lr_scale throughout. `deadline`: checked at every step, in the window and past it,
    so a time limit cuts a factor short, unjudged, instead of waiting for its whole horizon."""
    run = rerun_window(replayer, factor.options, drop, evidence, lockstep, deadline)
    window = run.result
    if run.cut:
        return WindowRow(factor, NOT_JUDGED, window, detail=TIME_CUT)
    bad = window.first_nonfinite
    if bad is not None:
        if bad.error is not None:
            return WindowRow(factor, NOT_JUDGED, window, detail=f"the rerun raised an error: {bad.error}")
        verdict = NO_EFFECT if bad.step == window.step else EARLIER if bad.step < window.step else DELAYS
        return WindowRow(factor, verdict, window, detail=f"non-finite at step {bad.step} ({bad.category})")
    norms = [s.grad_norm for s in window.steps]
    if not go_on:
        return WindowRow(factor, UNCONFIRMED, window, gaining=gaining(norms))
    batches, options = (held_out, replace(run.options, loss_scale=None)) if held_out else \
        (run.step_batches, run.options)
    if not batches:
        return WindowRow(factor, UNCONFIRMED, window, gaining=gaining(norms),
                         detail="no batch to go on with past the failing step")
    steps = horizon(window, beyond)
    climb = _climb(window.step, steps) if stretched else None
    scales = climb if climb is not None else [factor.options.lr_scale] * steps
    data = "held-out" if held_out else "the window's own"
    weights: list[float | None] = []  # past the failing step: a weight decay too strong for its rate shows there
    losses: list[float] = []
    model, optimizer = run.spec.model, run.optimizer
    device = model_device(model)
    grad_scale = run.grad_scale  # the run's GradScaler goes on from its last scale, backing off at each skip
    for i, (batch, scale) in enumerate(zip(itertools.cycle(batches), scales)):
        if lockstep.time_up(deadline):
            return WindowRow(factor, NOT_JUDGED, window, beyond_run=i, detail=TIME_CUT)
        set_learning_rates(optimizer, run.last_lrs, scale)
        if held_out:
            batch = prepare_batch(batch, device, factor.options)
        outcome = lockstep.finite(run_step(model, optimizer, run.spec.step_fn, batch,
                                           options=loop_options(run.spec, options), grad_scale=grad_scale,
                                           driver=run.driver))
        if outcome.overflow_skip:
            grad_scale *= evidence.backoff
        if not outcome.finite:
            return WindowRow(factor, DELAYS, window, beyond_run=i + 1, beyond_nonfinite=i + 1,
                             detail=f"finite over the window, non-finite {i + 1} step(s) past it on {data} batches "
                                    f"({outcome.category}{_rate_reached(climb, i)}; judged over {steps} steps: "
                                    f"twice the {window.step - window.start + 1} it took to fail, at least {beyond})")
        norms.append(outcome.grad_norm)
        weights.append(_weight_norm(outcome))
        losses.append(outcome.loss)
    for what, values in (("gradient norm", norms), ("weights' norm", weights)):
        growth = gaining(values)
        if growth is not None:
            return WindowRow(factor, DELAYS, window, beyond_run=len(scales), gaining=growth,
                             detail=f"finite, but the {what} still gains binades: {growth:.1f} over its last "
                                    f"{SpikeRule.growth_steps} steps")
    reference = loss_before_divergence(evidence.history)
    tail = sorted(losses[-max(TAIL_MIN, len(losses) // 4):])
    ended = tail[(len(tail) - 1) // 2] if tail else None
    if reference is not None and ended is not None and abs(ended) > LOSS_BAND * abs(reference):
        return WindowRow(factor, NOT_RECOVERED, window, beyond_run=len(scales),
                         detail=f"finite over steps {window.start}-{window.step} and {len(scales)} steps past them on "
                                f"{data} batches, but the loss ended at {ended:.4g} (median of the last {len(tail)}), "
                                f"{abs(ended / reference):.3g}x its {reference:.4g} before the run diverged "
                                f"(recovered: at most {LOSS_BAND:g}x)")
    if climb is not None and climb[-1] < 1.0:
        return WindowRow(factor, UNCONFIRMED, window, beyond_run=len(scales),
                         detail=f"finite over steps {window.start}-{window.step} and {len(scales)} steps past them, "
                                f"but the longer warm-up's rate had climbed back only to {climb[-1]:.2g}x the "
                                "failing step's")
    level = f", the loss at {ended:.4g} against {reference:.4g} before it diverged" \
        if reference is not None and ended is not None else ""
    return WindowRow(factor, CONFIRMED, window, beyond_run=len(scales),
                     detail=f"finite over steps {window.start}-{window.step} and {len(scales)} steps past them on "
                            f"{data} batches (twice the steps it took to fail, at least {beyond}), the gradient norm "
                            f"no longer gaining{level}" +
                            (" (the rate climbed back to the failing step's and held there for "
                             f"{scales.count(1.0)} steps)" if climb is not None else ""))


def _weight_norm(outcome) -> float | None:
    """The norm of the model's weights after the step's update (its scan of the updated state)."""
    if outcome.updated is None:
        return None
    return math.sqrt(sum(s.sumsq for s in outcome.updated.stats if s.name.startswith("param:")))


def _rate_reached(climb: list[float] | None, index: int) -> str:
    return "" if climb is None else f"; the rate at {climb[index]:.2g}x the failing step's"


def ablate_over_window(replayer: WindowSource, spec: Any, held_out: list[Any], *, beyond: int = DEFAULT_BEYOND,
                       suspicious: Callable[[], tuple[Any, str]] | str,
                       progress: Callable[[str], None] | None = None,
                       deadline: float | None = None, lockstep: Lockstep = SOLO) -> WindowAblation:
    """Rerun the window as recorded, then once per factor (NOTE: [window ablation]); nothing is written (see
    record_window_ablation). `spec`: the model's ReplaySpec as `replayer` builds it (its clipping and autocast
    declarations); `held_out`: batches to go on with past the failing step ([]: the window's own);
    `suspicious()`: the failing batch's suspicious samples and where they came from (a bisection), or why there
    are none to drop; `deadline`: a time.monotonic() past which the factors left are not judged (the in-process
    diagnosis's time limit); `lockstep`: how the ranks of a group agree on each step and row (one process:
    SOLO)."""
    say = progress or (lambda _description: None)
    evidence = WindowEvidence.of(replayer.bundle, lockstep)
    say("the window as recorded")
    baseline = lockstep.row(_judge(replayer, evidence, BASELINE, [], 0, go_on=False, lockstep=lockstep))
    failed = baseline.window.first_nonfinite if baseline.window else None
    if failed is not None and failed.error is not None:
        # as the single-step ablation: against a window that cannot run, a factor that makes it run looks like a fix
        raise ReplayError(f"the unchanged window of {replayer.bundle.path} raised an error instead of running (at "
                          f"step {failed.step}): {failed.error}; fix the replay entry {replayer.entry!r} (or pass "
                          "--entry) before changing factors")
    notes = list(baseline.window.notes) if baseline.window else []
    reproduced = baseline.window is not None and baseline.window.reproduced
    baseline.verdict = "reproduced" if reproduced else "not reproduced"
    baseline.detail = baseline.window.headline() if baseline.window else baseline.detail
    if not reproduced:
        notes.append("the unchanged window does not reproduce the failure, so no factor can be credited with fixing "
                     "it; `nanscan replay --window` shows where the rerun departs")
    rows = []

    def judge(factor: Factor, drop: Callable | None = None, stretched: bool = False) -> WindowRow:
        if not reproduced:
            return WindowRow(factor, NOT_JUDGED, None)
        if lockstep.time_up(deadline):
            return WindowRow(factor, NOT_JUDGED, None, detail=TIME_SPENT)
        return lockstep.row(_judge(replayer, evidence, factor, held_out, beyond, drop, stretched, lockstep=lockstep,
                                   deadline=deadline))

    peak = max((lr for r in evidence.records for lr in r.lrs if lr is not None), default=None)
    for scale in LR_LADDER:
        factor = Factor(f"lr-x{scale:g}", f"learning rate x{scale:g}" +
                        (f" (at most {peak * scale:.3g})" if peak is not None else ""), StepOptions(lr_scale=scale))
        say(factor.label)
        rows.append(judge(factor))
        if rows[-1].verdict == CONFIRMED:
            break
    rows.append(_longer_warmup(replayer, evidence, judge, say))
    rows.append(_safe_eps(replayer, judge, say))
    precision = evidence.precision()
    others = [*OTHER_FACTORS, *(f for name, f in PRECISION_FACTORS.items()
                                if (name == "float32") == (precision != "float32"))]
    for factor in others:
        say(factor.label)
        clip, loop_clip = factor.options.clip_grad_norm, evidence.loop_clip(spec)
        if clip is not None and loop_clip is not None and loop_clip <= clip:
            how = "" if spec.clip_grad_norm is not None else " (observed: NOTE: [observed loop])"
            rows.append(WindowRow(factor, NOT_APPLIED, None, detail=f"the loop already clips the gradient norm at "
                                                                    f"{loop_clip:g}{how}"))
            continue
        fixed = getattr(replayer, "fixed_precision", None)  # an engine's (NOTE: [step driver])
        if factor.options.precision is not None and fixed:
            rows.append(WindowRow(factor, NOT_APPLIED, None, detail=fixed))
            continue
        if factor.options.precision is not None and spec.autocast == "entry":
            rows.append(WindowRow(factor, NOT_APPLIED, None, detail="the replay entry enters its own autocast "
                                  "(ReplaySpec.autocast='entry'), which a replay cannot override"))
            continue
        rows.append(judge(factor))
    say(_FACTORS["drop-suspicious"].label)
    rows.append(_drop_suspicious(replayer, suspicious, judge) if reproduced else
                WindowRow(_FACTORS["drop-suspicious"], NOT_JUDGED, None))
    if not held_out:
        notes.append("no held-out batches (ReplaySpec.batches): past the failing step each factor goes on with the "
                     "window's own batches again (the loop's data, seen before); held-out batches there judge it on "
                     "data the run did not train on")
    lrs = _first_group_rates(evidence.records)
    return WindowAblation(str(replayer.bundle.path), replayer.bundle.step, replayer.entry, baseline, rows, notes,
                          lrs)


def _longer_warmup(replayer: WindowSource, evidence: WindowEvidence, judge: Callable[..., WindowRow],
                   say: Callable[[str], None]) -> WindowRow:
    """The warm-up WARMUP_STRETCH times longer, where the recorded rate was still rising at the failing step."""
    factor = _warmup_factor()
    say(factor.label)
    if not _rising(_first_group_rates(evidence.records), replayer.bundle.step):
        return WindowRow(factor, NOT_APPLIED, None, detail="the recorded learning rate was not rising at the failing "
                                                           "step (no warm-up to lengthen)")
    return judge(factor, stretched=True)


def _safe_eps(replayer: WindowSource, judge: Callable[..., WindowRow], say: Callable[[str], None]) -> WindowRow:
    """The optimizer's eps raised to the smallest normal of the dtypes where it is a trap (nanscan.runtime.traps
    NOTE: [update traps]), when the run's settings hold one."""
    # the model's parameters' dtypes (a state loads into them as they are) and the run's param groups (its eps)
    _, optimizer = replayer.build_at(None, replayer.optimizer_state)
    traps = [t for t in optimizer_traps(optimizer) if t.setting == "eps"]
    if not traps:
        return WindowRow(Factor("eps", "optimizer eps raised"), NOT_APPLIED, None,
                         detail="no update trap points at the optimizer's eps")
    safe = max(torch.finfo(getattr(torch, t.dtype)).smallest_normal for t in traps)
    factor = Factor("eps", f"optimizer eps {safe:.3g} ({traps[0].dtype}'s smallest normal; the run's "
                           f"{traps[0].value:g} is a trap)", StepOptions(eps=safe))
    say(factor.label)
    return judge(factor)


def _first_group_rates(records: list) -> dict[int, float]:
    """The first param group's recorded learning rate, by step."""
    return {r.step: r.lrs[0] for r in records if r.lrs and r.lrs[0] is not None}


def _rising(rates: dict[int, float], failing: int) -> bool:
    """Whether the recorded rate was still rising at the failing step (a warm-up not yet over)."""
    before = [rate for step, rate in sorted(rates.items()) if step < failing]
    return failing in rates and bool(before) and rates[failing] > before[-1]


def _drop_suspicious(replayer: WindowSource, suspicious: Callable[[], tuple[Any, str]] | str,
                     judge: Callable[..., WindowRow]) -> WindowRow:
    """The failing batch's suspicious samples (its bisection) left out of every step of the window that holds them:
    the failing step's rows, and, where sample ids were recorded, the rows with the same ids in the other steps
    (the same record met again in another epoch)."""
    factor = _FACTORS["drop-suspicious"]
    if isinstance(suspicious, str):
        return WindowRow(factor, NOT_APPLIED, None, detail=suspicious)
    found, origin = suspicious()
    if found is None or not found.applicable:
        return WindowRow(factor, NOT_APPLIED, None, detail=f"no suspicious samples: {found.reason if found else ''}")
    failing = replayer.bundle.step
    ids = found.sample_ids or []
    met: list[int] = []

    def drop(record) -> list[int]:
        if record.step == failing:
            rows = list(found.indices)
        elif ids and isinstance(record.sample_ids, list):
            rows = [i for i, sample in enumerate(record.sample_ids) if sample in ids]
        else:
            rows = []
        if rows:
            met.append(record.step)
        return rows

    row = judge(factor, drop)
    shown = getattr(found, "label", None) or (ids if ids else found.indices)  # a source's own words for them
    row.detail = f"dropped {shown} ({origin}) at step(s) {sorted(set(met))}; {row.detail}"
    return row


def lr_summary(result: WindowAblation) -> str | None:
    """The learning-rate finding in one line, when a scale is a confirmed fix."""
    fix = next((r for r in result.rows if r.factor.key.startswith("lr-") and r.verdict == CONFIRMED), None)
    if fix is None:
        return None
    w = fix.window
    lrs = [lr for step, lr in sorted(result.lrs.items()) if w.start <= step <= w.step]
    return (f"{fix.factor.label} stays finite over steps {w.start}-{w.step} and {fix.beyond_run} steps past them: "
            "the learning rate is too large for this point of the run"
            + (f" (still in its warm-up: the recorded rate rose from {lrs[0]:.3g} to {lrs[-1]:.3g})"
               if _rising(result.lrs, w.step) else f" (the recorded rate was {lrs[-1]:.3g} there)" if lrs else ""))


def conclusion(result: WindowAblation) -> str:
    """The ablation in one line: the learning-rate finding, else the confirmed factors, else that none is; a factor
    that only delays the failure is named as such, never as its fix."""
    summary = lr_summary(result)
    others = [r.factor.label for r in result.fixes if not r.factor.key.startswith("lr-")]
    if summary:
        return summary + (f"; also confirmed: {', '.join(others)}" if others else "")
    if result.fixes:
        return "confirmed fix over the window: " + ", ".join(r.factor.label for r in result.fixes)
    if result.baseline.verdict != "reproduced":
        return "not judged: the unchanged window does not reproduce the failure"
    delays = [r.factor.label for r in result.rows if r.verdict in (DELAYS, NOT_RECOVERED)]
    return "no single factor is a confirmed fix over the window" + (
        f" ({', '.join(delays)}: only delays it or leaves the loss wrecked)" if delays else "")


def _title(row: WindowRow) -> str:
    return f"Ablation over the window: {row.factor.label}: {row.verdict}"


def _markdown(row: WindowRow, result: WindowAblation) -> str:
    lines = [f"Applied to every step of the window's rerun with `{result.entry}`, from its oldest kept state, then "
             "past the failing step for the horizon its row names (NOTE: [window ablation]).", "",
             f"- verdict: {row.verdict}"]
    if row.detail:
        lines.append(f"- {row.detail}")
    return "\n".join(lines)


def record_window_ablation(result: WindowAblation, bundle: Bundle | None = None) -> int:
    """One finding per row ("ablate:window:<factor>"); the same rows again change nothing. Returns how many
    changed."""
    target = bundle or load_bundle(result.bundle)
    return sum(target.add_finding(f"{FINDING_PREFIX}{row.factor.key}", _title(row), _markdown(row, result),
                                  row.to_dict())
               for row in [result.baseline, *result.rows])
