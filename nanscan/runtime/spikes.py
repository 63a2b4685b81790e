"""Early warning of loss and gradient-norm spikes: robust running statistics over the last steps' finite records,
a verdict per step, and which gradient tensors moved first, grouped by layer (the Monitor's `spikes=`).

NOTE: [spike statistic]
Two quantities are watched, both read from the records a step's scan already wrote (no extra pass over any
tensor): the loss, as its magnitude sqrt(sumsq) of the `loss` record, and the global gradient norm, sqrt of the
summed sumsq of every `grad:` record. Each is taken in log space (a norm's noise and drift are multiplicative), and
compared with the last `window` accepted steps: m = median, s = max(1.4826 x MAD, min_scale), z = (log x - m) / s.
A step spikes when, for either quantity, at least `warmup` steps are in the window, z > threshold and x is at
least min_ratio x exp(m). Medians are the lower median (of an even count, the smaller middle value), as
torch.nanmedian takes it, so the host and the device statistics agree exactly. Only finite steps are accepted: a
step whose report is not ok (a NaN, or a scaler's overflowing step) is neither judged nor added to the window. A
spiking step is added (the median and MAD barely move for one outlier, and a run that keeps diverging is still
far out for many steps).

Defaults, measured on tests/spike_runs.py (4 healthy runs of 320 steps, 3 diverging ones): the largest healthy z
was 4.5 (the loss at an SGDR restart: 6.9x its median) and 3.8 for the gradient norm; the diverging runs reached z
of 15 to 685. threshold 8 leaves healthy runs a margin of 1.8x and still warns 165, 6 and 222 steps before their
first non-finite step. warmup 32: early training moves fast (the demo's loss falls 5x in 60 steps; no healthy run
came near the threshold even from step 8). min_ratio 2 keeps a near-constant signal (MAD at the floor) from
warning about a 40% move; min_scale 0.05 (5%) is that floor.

In mode="async" the window lives on the records' device and every step is judged there (DeviceStats): the flag is
folded into `found_inf` for spikes="skip" and copied with the numbers behind it to pinned memory, and the
verdict is read at the next check, like the non-finite one. Which tensors moved first is worked out only at a
spike, from the Monitor's history ring (first_moving).

NOTE: [growth rule]
The spike statistic is silent for its first `warmup` steps, and a run whose learning rate is too large for its
warm-up can go non-finite before then (tests/nanogpt_runs.py DIVERGING: at step 28 or 29). The growth rule needs
no window: a quantity grows when, over its last `growth_steps` finite steps, it rose at all but one of them, by at
least `growth_binades` binades in all (last / first >= 2**growth_binades), to above every earlier value of the run.
binade_growth is its one definition (of a quantity "still gaining binades"). The new high is why a healthy rebound
is not growth: a loss climbing back after a warm restart or a new epoch returns to levels the run has seen, while a
divergence heading for overflow passes every one of them. It is judged on the same log values and the same finite
steps as the spike statistic (a step whose report is not ok is neither judged nor added), at every step, through
the same policies and episodes; a step past both rules is reported as a spike (Spike.kind).

Defaults, measured on tests/spike_runs.py's 4 healthy runs (320 steps), 19 healthy nanoGPT-like configurations of
tests/nanogpt_runs.py (200 steps; float32 and bf16 autocast, dropout 0 and 0.1, peak learning rates 6e-4 to 1e-2
after warm-ups of 2 to 100 steps, accumulation 1, 2 and 4, 4 seeds; checked per micro-batch and per step alike) and
8 fp16 GradScaler runs built as tests/test_amp.py builds them (200 steps). Over 8 steps, rising at all but one,
the most a healthy quantity gained was 1.84 binades (the loss climbing back after an SGDR restart), and 0.58 to a
new high (a gradient norm in a scaler's first steps). Over 7 steps a restart's rebound gained 6.4 binades, and a
gradient norm early in a warm-up 2.1 to a new high: so 8 steps, and growth_binades 3 (8x), which neither healthy
maximum comes near (the new high alone leaves a margin of 2.4 binades, the gain alone 1.2). nanoGPT with a
learning rate of 30 (bf16 and float32, 3 seeds, dropout 0.1, accumulation 1) grows from steps 7 to 16, 14 to 21
steps before its first non-finite step (28 to 32); the spike suite's diverging runs are warned by the spike
statistic first, as before.

Per step the host keeps, per quantity, the last `growth_steps` values and the run's high, and works the rule out
only at a new high that gained the binades, the rare case (under a microsecond a step). On the device the same
state is a [growth_steps, 2] tensor and a [2] one, shifted and judged by a dozen small element-wise operations
beside the spike statistic's, with no host sync, so that the growth flag joins the spike flag in `found_inf` (for
spikes="skip") in the step it belongs to: on CPU tensors DeviceStats.observe went from 67 to 120 us a step.

NOTE: [elevated rule]
A loss that jumps at once and then stays up (karpathy's train.py at learning rate 15: 4.5 to 45 at iteration 1, then
100 to 900 for 27 iterations before its NaN) is neither rule's: the jump lands inside the spike statistic's warm-up
and stays, so it becomes the window's median, and a plateau does not rise step after step. The elevated rule
compares each quantity with its own first finite value: it fires at the step a quantity has been at least
`elevated_binades` binades above that value for `elevated_steps` finite steps in a row (once per entry: a quantity
that stays up does not fire again until it has come down and gone up again). The reference is the first step's
value itself, not a median of the first few: the run being warned about may jump at its second step. It is judged
over each quantity's first `warmup + elevated_steps` finite steps only, the span where the spike statistic is
blind to a jump that stayed (the jump becomes its window's median); later a jump is the spike statistic's, and a
slow drift far from the first step (a gradient norm over thousands of steps) is no alarm.

Defaults, measured (the largest run of `elevated_steps` finite values, each at least that many binades above the
first, by quantity) on tests/spike_runs.py's 4 healthy runs (320 steps: 1.21 binades, the gradient norm after a
new epoch's loss bump; 1.41 over 6 steps), the 10 healthy nanoGPT-like configurations above (200 steps, per
micro-batch and per step: 0.71) and the fp16 GradScaler runs of tests/test_growth.py (which assert no warning):
so 8 steps and 3 binades (8x), a margin of 1.8 binades. nanoGPT with a learning rate of 30 fires at its 8th
check (a fault the growth rule warns about too), train.py at 15 and 30 (tests/karpathy_train.py) at its 8th
step, 20 steps before its NaN. It runs on the same kept steps and through the same policies and episodes as the
others (a step past several rules is reported as the spike statistic's, else the growth rule's). A run whose loss
legitimately climbs far above its start (a loss weight ramped up from near zero) warns once: turn it off with
SpikeRule(elevated_steps=0).
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.incident import ELEVATED, GROWTH, LOSS, SPIKE, is_kind, layer_of
from nanscan.engine.pending import CompletedScan, StepScan
from nanscan.engine.stats import Scaling, ScannedTensor, ScanReport, gradient_rows, lower_median

QUANTITIES = ("loss", "grad_norm")
POLICIES = ("warn", "bundle", "skip", "raise")
MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal noise
# Spikes closer than this many steps to the previous one belong to the same episode: warned and bundled once.
EPISODE_GAP = 16
# first_moving: how many steps before a spike are searched for the step each tensor's norm left its range, the z
# a tensor's own norm must pass to count as moved (half the alarm's: a tensor moves before the sum does), and how
# many are named.
ONSET_LOOKBACK = 8
MOVED_FRACTION = 0.5
FIRST_MOVING_SHOWN = 8
LN2 = math.log(2.0)  # a binade in natural-log units


def episode_start(spike_steps: list[int], step: int) -> int:
    """The first warning of the episode that ends at `step`: the earliest of the spikes each at most EPISODE_GAP
    before the next (the last within EPISODE_GAP of `step`), else `step` itself."""
    start = step
    for s in sorted((s for s in spike_steps if s <= step), reverse=True):
        if start - s > EPISODE_GAP:
            break
        start = s
    return start


@dataclass(frozen=True)
class SpikeRule:
    """The spike statistic's settings (NOTE: [spike statistic] says how each default was measured)."""

    window: int = 64
    warmup: int = 32
    threshold: float = 8.0
    min_ratio: float = 2.0
    min_scale: float = 0.05
    # NOTE: [growth rule]; growth_steps=0 turns it off
    growth_steps: int = 8
    growth_binades: float = 3.0
    # NOTE: [elevated rule]; elevated_steps=0 turns it off
    elevated_steps: int = 8
    elevated_binades: float = 3.0

    def __post_init__(self):
        if not (isinstance(self.window, int) and isinstance(self.warmup, int) and 1 <= self.warmup <= self.window):
            raise ValueError(f"SpikeRule(window={self.window!r}, warmup={self.warmup!r}): need integers with "
                             "1 <= warmup <= window")
        if not (self.threshold > 0 and self.min_ratio >= 1 and self.min_scale > 0):
            raise ValueError(f"SpikeRule(threshold={self.threshold!r}, min_ratio={self.min_ratio!r}, "
                             f"min_scale={self.min_scale!r}): need threshold > 0, min_ratio >= 1, min_scale > 0")
        if not (isinstance(self.growth_steps, int) and (self.growth_steps == 0 or self.growth_steps >= 3)
                and self.growth_binades > 0):
            raise ValueError(f"SpikeRule(growth_steps={self.growth_steps!r}, growth_binades={self.growth_binades!r}): "
                             "need growth_steps 0 (no growth rule) or an integer >= 3, and growth_binades > 0")
        if not (isinstance(self.elevated_steps, int) and self.elevated_steps >= 0 and self.elevated_binades > 0):
            raise ValueError(f"SpikeRule(elevated_steps={self.elevated_steps!r}, elevated_binades="
                             f"{self.elevated_binades!r}): need elevated_steps 0 (no elevated rule) or a positive "
                             "integer, and elevated_binades > 0")


@dataclass(frozen=True)
class Score:
    """One quantity at a spike: its value, the window's median, how many times the median, and the robust z. Of
    the growth rule (kind GROWTH): `median` is the value `growth_steps` finite steps back, where the growth began,
    `ratio` how many times that, and `z` the binades gained (log2 of the ratio). Of the elevated rule (kind
    ELEVATED): `median` is the quantity's first finite value, `ratio` how many times that, `z` its binades above it."""

    quantity: str
    value: float
    median: float
    ratio: float
    z: float
    kind: str = SPIKE  # the rule it passed: SPIKE (NOTE: [spike statistic]), GROWTH (NOTE: [growth rule]) or ELEVATED


@dataclass(frozen=True)
class Spike:
    """A step found far outside its recent range. `scores`: every quantity past the rule, the largest z first;
    `window`: accepted steps the statistics spanned; `first_moving`: the gradient tensors whose norms left their
    own range first, as [{"layer", "onset", "tensors": [{"name", "onset", "ratio", "z"}]}], earliest layer first."""

    step: int
    scores: tuple[Score, ...]
    window: int
    rule: SpikeRule
    first_moving: tuple[dict, ...] = ()

    @property
    def quantity(self) -> str:
        return self.scores[0].quantity

    @property
    def kind(self) -> str:
        """Which rule fired: SPIKE (the spike statistic), GROWTH (the growth rule) or ELEVATED (the elevated rule);
        a step past several is the first of those."""
        return self.scores[0].kind

    @property
    def tensors(self) -> list[str]:
        return [t["name"] for group in self.first_moving for t in group["tensors"]]

    def to_dict(self) -> dict:
        return {"step": self.step, "kind": self.kind, "quantity": self.quantity,
                "scores": [asdict(s) for s in self.scores], "window": self.window, "rule": asdict(self.rule),
                "first_moving": [dict(g) for g in self.first_moving]}

    def describe(self) -> str:
        """One line: what spiked (or grew), by how much, against what, and what moved first."""
        if self.kind == GROWTH:
            shown = "; ".join(f"{s.quantity} {s.value:.4g} gained {s.z:.2f} binades ({s.ratio:.3g}x from "
                              f"{s.median:.4g})" for s in self.scores)
            text = (f"growth at step {self.step}: {shown} over its last {self.window} finite steps, rising at all but "
                    f"at most one, to its highest yet (growth rule: >= {self.rule.growth_binades:g} binades)")
        elif self.kind == ELEVATED:
            shown = "; ".join(f"{s.quantity} {s.value:.4g} is {s.ratio:.3g}x its first step's {s.median:.4g}"
                              for s in self.scores)
            text = (f"elevated at step {self.step}: {shown}, and has stayed at least "
                    f"{2 ** self.rule.elevated_binades:g}x above it for {self.window} finite steps in a row (elevated "
                    f"rule: a jump that did not come back down)")
        else:
            shown = "; ".join(f"{s.quantity} {s.value:.4g} is {s.ratio:.3g}x its median {s.median:.4g} (robust z "
                              f"{s.z:.1f} > {self.rule.threshold:g}, log space)" for s in self.scores)
            text = f"spike at step {self.step}: {shown}, over the last {self.window} finite steps"
        if self.first_moving:
            layers = ", ".join(f"{g['layer']} (step {g['onset']}: {', '.join(t['name'] for t in g['tensors'][:3])})"
                               for g in self.first_moving[:3])
            text += f"; first to move: {layers}"
        return text


# -- which rows of a step's records the quantities read ----------------------------------------------------------

@dataclass(frozen=True)
class Rows:
    """The loss row and the gradient rows of one list of scanned tensors."""

    loss: np.ndarray  # int64[0 or 1]
    grad: np.ndarray  # int64[G]
    # where their sums of squares are in a step's records read flat as float64 (NOTE: [cold check path])
    loss_at: slice | list[int] = field(init=False, repr=False, compare=False)
    grad_at: slice | list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "loss_at", _flat_positions(self.loss))
        object.__setattr__(self, "grad_at", _flat_positions(self.grad))

    @classmethod
    def of(cls, tensors: Sequence[ScannedTensor]) -> "Rows":
        loss = [i for i, t in enumerate(tensors) if t.name == LOSS]
        return cls(np.array(loss[:1], dtype=np.int64), gradient_rows(tensors))


def _flat_positions(rows: np.ndarray) -> slice | list[int]:
    """The positions of `rows`' REC_SUMSQ slots in a records array read flat: a strided slice when the rows are a
    run (a plan's gradients are), else a list."""
    flat = [int(r) * L.RECORD_WIDTH + L.REC_SUMSQ for r in rows]
    if len(flat) > 1 and all(b - a == L.RECORD_WIDTH for a, b in zip(flat, flat[1:])):
        return slice(flat[0], flat[-1] + 1, L.RECORD_WIDTH)
    return flat


def _sum_at(flat: memoryview, at: slice | list[int]) -> float:
    """The sum of the sums of squares at `at` (0 for none)."""
    return sum(flat[at]) if isinstance(at, slice) else sum([flat[i] for i in at])


def logs_of_sums(loss_sumsq: float | None, grad_sumsq: float, scaling: Scaling | None = None) -> tuple[float, float]:
    """(log |loss|, log grad norm) from the loss's sum of squares (None: no loss) and the gradients': 0.5 log of
    each, NaN for a sum that is 0 or not finite; under a GradScaler the scale divided out of the gradient norm.
    log_values takes its sums from the records, the Monitor's one-call host scan from its StepSummary (NOTE: [step
    summary] in csrc/plan/plan_check.cpp), which its call added as log_values adds them."""
    # `0 < s < inf` is false for NaN, as `s > 0 and isfinite(s)` is: one comparison on the every-step path.
    loss = 0.5 * math.log(loss_sumsq) if loss_sumsq is not None and 0.0 < loss_sumsq < math.inf else math.nan
    grad = 0.5 * math.log(grad_sumsq) if 0.0 < grad_sumsq < math.inf else math.nan
    if scaling is not None and scaling.scaled:
        grad -= math.log(scaling.scale)
    return loss, grad


def log_values(records: np.ndarray, rows: Rows, scaling: Scaling | None = None) -> tuple[float, float]:
    """(log |loss|, log grad norm) of one step's host records; NaN for a quantity the step does not have (no
    loss, a zero loss, no gradient). Under a GradScaler the gradient norm is the real gradients' (the scale
    divided out, whatever it is: a GradScaler's growth or backoff is no spike).

    NOTE: [cold check path]
    Measured inside a real step of the demo model, where forward and backward have just evicted the caches, the
    first numpy reduction of a check costs about 35 us (its code is cold), against 1.5 us in a loop; Python's
    own objects stay warm. So the every-step sums here read the records through a memoryview, in plain Python.
    Even that cost 26 us there, and each Python call on the path a few: the Monitor's one-call host scan hands
    the same sums over instead (logs_of_sums, NOTE: [step summary] in csrc/plan/plan_check.cpp), and the window's
    span is worked out only for a spike."""
    if records.dtype != np.int64 or not records.flags.c_contiguous:
        records = np.ascontiguousarray(records, dtype=np.int64)
    flat = memoryview(records).cast("B").cast("d")  # the records' int64 slots as float64: REC_SUMSQ's bits
    return logs_of_sums(_sum_at(flat, rows.loss_at), _sum_at(flat, rows.grad_at), scaling)


def device_log_values(records: torch.Tensor, loss_rows: torch.Tensor, grad_rows: torch.Tensor,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """log_values of records held in an int64 tensor (on the GPU: no host sync), as float64[2]. `scale`: the
    GradScaler's scale tensor the gradients carry, read on the device in stream order (before its update)."""
    sumsq = records[:, L.REC_SUMSQ].contiguous().view(torch.float64)
    sums = torch.stack([sumsq.index_select(0, loss_rows).sum(), sumsq.index_select(0, grad_rows).sum()])
    usable = (sums > 0) & torch.isfinite(sums)
    logs = torch.where(usable, 0.5 * torch.log(torch.where(usable, sums, torch.ones_like(sums))),
                       torch.full_like(sums, math.nan))
    if scale is not None:
        shift = torch.log(scale.to(device=logs.device, dtype=torch.float64).reshape(()))
        logs = logs - torch.stack([torch.zeros_like(shift), shift])
    return logs


# -- the statistic ----------------------------------------------------------------------------------------------

def binade_growth(logs: Sequence[float], steps: int = SpikeRule.growth_steps,
                  min_binades: float = SpikeRule.growth_binades, earlier_high: float = -math.inf) -> float | None:
    """The growth rule (NOTE: [growth rule]) on one quantity: the binades it gained over its last `steps` finite
    values, when it rose at all but one of them, by `min_binades` or more in all, to above every earlier value;
    None when it is not growing (or has fewer than `steps` finite values). `logs`: its natural logs, oldest first
    (NaN: a step without it, skipped); `earlier_high`: the highest log before `logs` begins (the runtime keeps
    only the last `steps` values and the run's high)."""
    finite = [v for v in logs if not math.isnan(v)]
    if steps < 2 or len(finite) < steps:
        return None
    tail = finite[-steps:]
    gain = tail[-1] - tail[0]
    if gain < min_binades * LN2 or tail[-1] <= max(earlier_high, *finite[:-1]):
        return None
    rises = sum(b > a for a, b in zip(tail, tail[1:]))
    return gain / LN2 if rises >= steps - 2 else None


def elevated_score(quantity: str, log_value: float, log_first: float) -> Score:
    """The Score of a quantity the elevated rule fired on, from its log now and at its first finite step."""
    return Score(quantity, math.exp(log_value), math.exp(log_first), math.exp(log_value - log_first),
                 (log_value - log_first) / LN2, ELEVATED)


def growth_score(quantity: str, log_value: float, log_start: float) -> Score:
    """The Score of a quantity the growth rule fired on, from its log now and `growth_steps` finite steps back."""
    return Score(quantity, math.exp(log_value), math.exp(log_start), math.exp(log_value - log_start),
                 (log_value - log_start) / LN2, GROWTH)


class HostStats:
    """The statistic (NOTE: [spike statistic]) and the growth rule (NOTE: [growth rule]) over host floats: the sync
    path, a few microseconds per step.

    Each window is kept twice, in arrival order (to drop the oldest) and sorted (bisect), so the median is read,
    not sorted for, every step; the MAD, which needs a pass over the window, is worked out only for a value at
    least min_ratio x the median, the one kind that can spike. Likewise binade_growth is called only for a new
    high that gained the binades. The scores are those of the plain definitions."""

    def __init__(self, rule: SpikeRule):
        self.rule = rule
        self.windows = [deque(maxlen=rule.window) for _ in QUANTITIES]
        self._sorted: list[list[float]] = [[] for _ in QUANTITIES]
        self._min_log_ratio = math.log(rule.min_ratio)
        self.tails = [deque(maxlen=rule.growth_steps) for _ in QUANTITIES]  # the growth rule's last finite logs
        self.highs = [-math.inf for _ in QUANTITIES]  # the run's highest log so far
        self._min_log_gain = rule.growth_binades * LN2
        self.firsts = [math.nan for _ in QUANTITIES]  # NOTE: [elevated rule]: each quantity's first finite log
        self.above = [0 for _ in QUANTITIES]  # finite steps in a row at least elevated_binades above it
        self.seen = [0 for _ in QUANTITIES]  # finite steps so far, up to the rule's span
        self._elevated_span = rule.warmup + rule.elevated_steps if rule.elevated_steps else 0
        self._min_log_rise = rule.elevated_binades * LN2
        self.span = 0

    def observe(self, logs: Sequence[float]) -> list[Score]:
        """Judge one finite step's log values against the window, the growth rule and the elevated rule, then add
        them; the scores past the spike statistic, else those past the growth rule, else the elevated rule's.
        `span` is then the most steps a window held before this one."""
        found, grown, raised = [], [], []
        span = 0
        steps = self.rule.growth_steps
        for q, (quantity, window, ordered, v) in enumerate(zip(QUANTITIES, self.windows, self._sorted, logs)):
            held = len(window)
            if held > span:
                span = held
            if math.isnan(v):
                continue
            if held >= self.rule.warmup:
                m = ordered[(len(ordered) - 1) // 2]  # the lower median (lower_median)
                if v - m > self._min_log_ratio:
                    score = _score(quantity, v, list(window), m, self.rule)
                    if score is not None:
                        found.append(score)
            if held == window.maxlen:
                del ordered[bisect.bisect_left(ordered, window[0])]
            window.append(v)
            bisect.insort(ordered, v)
            if steps:
                tail, high = self.tails[q], self.highs[q]
                tail.append(v)
                if v > high:
                    self.highs[q] = v
                    if len(tail) == steps and v - tail[0] >= self._min_log_gain and \
                            binade_growth(tail, steps, self.rule.growth_binades, high) is not None:
                        grown.append(growth_score(quantity, v, tail[0]))
            if self.seen[q] < self._elevated_span:
                self.seen[q] += 1
                first = self.firsts[q]
                if first != first:  # NaN: this is the quantity's first finite step
                    self.firsts[q] = first = v
                self.above[q] = self.above[q] + 1 if v - first >= self._min_log_rise else 0
                if self.above[q] == self.rule.elevated_steps:
                    raised.append(elevated_score(quantity, v, first))
        self.span = span
        for scores in (found, grown, raised):
            if scores:
                return sorted(scores, key=lambda s: -s.z)
        return found


def _score(quantity: str, v: float, window: list[float], m: float, rule: SpikeRule) -> Score | None:
    """v's score against a window whose lower median is m, or None below the rule."""
    scale = max(MAD_TO_SIGMA * lower_median([abs(w - m) for w in window]), rule.min_scale)
    z = (v - m) / scale
    if z > rule.threshold and v - m > math.log(rule.min_ratio):
        return Score(quantity, math.exp(v), math.exp(m), math.exp(v - m), z)
    return None


class DeviceStats:
    """The same statistic and growth rule on the records' device, with no host sync: the window is a float64
    [window, 2] tensor whose non-finite steps hold NaN (ignored by nanmedian), written in turn; the growth rule's
    last finite logs a [growth_steps, 2] one, oldest first, shifted only where the step is kept (NaN until filled),
    and the run's high a [2] one; the elevated rule's first finite logs and steps in a row above them [2] ones.
    `observe` returns the step's verdict as a float64 [8, 2] tensor (per quantity: spiked 0/1, log value, median,
    z, grown 0/1, log `growth_steps` finite steps back, elevated 0/1, first log) still on the device, and whether
    any rule fired, a bool tensor beside it."""

    def __init__(self, rule: SpikeRule, device: torch.device):
        self.rule = rule
        self.window = torch.full((rule.window, len(QUANTITIES)), math.nan, dtype=torch.float64, device=device)
        self.tail = torch.full((max(rule.growth_steps, 1), len(QUANTITIES)), math.nan, dtype=torch.float64,
                               device=device)
        self.high = torch.full((len(QUANTITIES),), -math.inf, dtype=torch.float64, device=device)
        self.first = torch.full((len(QUANTITIES),), math.nan, dtype=torch.float64, device=device)
        self.above = torch.zeros(len(QUANTITIES), dtype=torch.float64, device=device)
        self.seen = torch.zeros(len(QUANTITIES), dtype=torch.float64, device=device)
        self.count = 0

    def observe(self, logs: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rule, window = self.rule, self.window
        kept = ~bad & (logs == logs)  # a finite step that has the quantity (NaN != NaN): the rules' steps
        m = window.nanmedian(dim=0).values
        mad = (window - m).abs().nanmedian(dim=0).values
        scale = torch.clamp(MAD_TO_SIGMA * mad, min=rule.min_scale)
        z = (logs - m) / scale
        enough = (~torch.isnan(window)).sum(dim=0) >= rule.warmup
        spiked = enough & (z > rule.threshold) & (logs - m > math.log(rule.min_ratio)) & kept
        window[self.count % rule.window] = torch.where(kept, logs, math.nan)
        self.count += 1
        grown, start = self._grow(logs, kept) if rule.growth_steps else (torch.zeros_like(kept), logs)
        raised = self._raise(logs, kept) if rule.elevated_steps else torch.zeros_like(kept)
        verdict = torch.stack([spiked.to(torch.float64), logs, m, z, grown.to(torch.float64), start,
                               raised.to(torch.float64), self.first])
        return verdict, (spiked | grown | raised).any()

    def _raise(self, logs: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """NOTE: [elevated rule] on the device: a kept step sets the first log where none is yet, and counts one
        more step in a row above it, or starts again from 0; it fires when the count reaches elevated_steps within
        the quantity's first warmup + elevated_steps kept steps."""
        self.seen = self.seen + kept.to(torch.float64)
        self.first = torch.where(kept & torch.isnan(self.first), logs, self.first)
        up = logs - self.first >= self.rule.elevated_binades * LN2
        self.above = torch.where(kept, torch.where(up, self.above + 1, torch.zeros_like(self.above)), self.above)
        return kept & (self.above == self.rule.elevated_steps) & \
            (self.seen <= self.rule.warmup + self.rule.elevated_steps)

    def _grow(self, logs: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NOTE: [growth rule] on the device, in binade_growth's terms: a kept step joins the tail; it grew when it
        is above the earlier high, the tail is full, rose at all but one step and gained the binades. Comparisons
        with NaN are false, so an unfilled tail never grows; the high is the largest value the tail ever ended on."""
        tail = self.tail = torch.where(kept, torch.cat([self.tail[1:], logs.unsqueeze(0)]), self.tail)
        rises = (torch.diff(tail, dim=0) > 0).sum(dim=0)
        grown = kept & (logs > self.high) & (rises >= self.rule.growth_steps - 2) & \
            (logs - tail[0] >= self.rule.growth_binades * LN2)
        self.high = torch.fmax(self.high, tail[-1])
        return grown, tail[0]


def scores_from_verdict(verdict: np.ndarray, rule: SpikeRule) -> list[Score]:
    """The Scores of a DeviceStats verdict copied to the host: the spike statistic's, else the growth rule's, else
    the elevated rule's."""
    found = [Score(q, math.exp(verdict[1, i]), math.exp(verdict[2, i]), math.exp(verdict[1, i] - verdict[2, i]),
                   float(verdict[3, i]))
             for i, q in enumerate(QUANTITIES) if verdict[0, i] > 0]
    if not found:
        found = [growth_score(q, float(verdict[1, i]), float(verdict[5, i]))
                 for i, q in enumerate(QUANTITIES) if verdict[4, i] > 0]
    if not found:
        found = [elevated_score(q, float(verdict[1, i]), float(verdict[7, i]))
                 for i, q in enumerate(QUANTITIES) if verdict[6, i] > 0]
    return sorted(found, key=lambda s: -s.z)


# -- which tensors moved first ----------------------------------------------------------------------------------

def first_moving(entries: Sequence[tuple[Any, ScanReport]], step: int, rule: SpikeRule) -> tuple[dict, ...]:
    """The gradient tensors whose own norms left their range first in the ONSET_LOOKBACK steps up to the spike at
    `step`, grouped by layer: each tensor's log norm is judged as the quantities are, against its own median and
    MAD over the history steps before those, and counts as moved at the first step its z passed MOVED_FRACTION x
    the threshold (and is still past it at the spike). Earliest first, then by z at the spike."""
    steps = [(entry.step, report) for entry, report in entries if entry.step <= step and report.ok]
    recent = [s for s, _ in steps if s > step - ONSET_LOOKBACK - 1]
    baseline = [r for s, r in steps if s <= step - ONSET_LOOKBACK - 1]
    if not steps or steps[-1][0] != step or len(baseline) < 4:
        return ()
    names = [t.name for t in steps[-1][1].tensors if is_kind(t.name, "gradient")]
    logs = np.full((len(steps), len(names)), np.nan)
    for i, (_, report) in enumerate(steps):
        index = {t.name: k for k, t in enumerate(report.tensors)}
        sumsq = report.records[:, L.REC_SUMSQ].view(np.float64)
        for j, name in enumerate(names):
            if name in index:
                s = float(sumsq[index[name]])
                logs[i, j] = 0.5 * math.log(s) if s > 0 and math.isfinite(s) else np.nan
    base = logs[: len(baseline)]
    # A tensor with no finite norm in the baseline (an all-NaN column) cannot be judged: nanmedian's warning says so.
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        m = np.nanmedian(base, axis=0)
        scale = np.maximum(MAD_TO_SIGMA * np.nanmedian(np.abs(base - m), axis=0), rule.min_scale)
        z = (logs[len(baseline):] - m) / scale
    moved = []
    for j, name in enumerate(names):
        past = np.flatnonzero(z[:, j] > MOVED_FRACTION * rule.threshold)
        if len(past) and z[-1, j] > MOVED_FRACTION * rule.threshold:
            moved.append({"name": name, "onset": int(recent[past[0]]), "ratio": float(np.exp(logs[-1, j] - m[j])),
                          "z": float(z[-1, j])})
    moved.sort(key=lambda t: (t["onset"], -t["z"]))
    groups: dict[str, dict] = {}
    for t in moved[:FIRST_MOVING_SHOWN]:
        groups.setdefault(layer_of(t["name"]), {"layer": layer_of(t["name"]), "onset": t["onset"],
                                                "tensors": []})["tensors"].append(t)
    return tuple(groups.values())


def _local_rows(rows: Rows, part_rows: np.ndarray) -> Rows:
    """`rows` as positions within one part's records (the part fills `part_rows` of the step's)."""
    local = {int(g): k for k, g in enumerate(part_rows)}
    return Rows(np.array([local[r] for r in rows.loss if r in local], dtype=np.int64),
                np.array([local[r] for r in rows.grad if r in local], dtype=np.int64))


# -- the Monitor's watch ----------------------------------------------------------------------------------------

@dataclass
class _DeviceStep:
    """An async step's verdict on its way to the host: the device tensor, its pinned copy and the event after it."""

    step: int
    verdict: torch.Tensor
    event: Any = None


@dataclass
class SpikeWatch:
    """The Monitor's spike detection: `observe_host` judges a sync step at its check; `observe_device` enqueues an
    async step's verdict (and returns the flag to fold into found_inf), `read` fetches it at the next check."""

    rule: SpikeRule
    host: HostStats = field(init=False)
    device: DeviceStats | None = None
    _rows: tuple[tuple, Rows] | None = None
    _device_rows: tuple | None = None  # (Rows, device, loss rows, grad rows on that device)
    _pending: _DeviceStep | None = None
    _pinned: torch.Tensor | None = None

    def __post_init__(self):
        self.host = HostStats(self.rule)

    def rows(self, tensors: tuple[ScannedTensor, ...]) -> Rows:
        """The rows of `tensors`, made again only when the scanned tensors change (the plan reuses its tuple)."""
        if self._rows is None or self._rows[0] is not tensors:
            self._rows = (tensors, Rows.of(tensors))
        return self._rows[1]

    def observe_host(self, step: int, report: ScanReport, summary: Any = None) -> Spike | None:
        """Judge a finite sync step at its check (and add it to the window). `summary`: the host scan's
        StepSummary, whose sums stand in for a pass over the records."""
        logs = logs_of_sums(summary.loss_sumsq, summary.grad_sumsq, report.scaling) if summary is not None else \
            log_values(report.records, self.rows(report.tensors), report.scaling)
        scores = self.host.observe(logs)
        if not scores:  # the every-step case: nothing else to work out (NOTE: [cold check path])
            return None
        return self._spike(step, scores, self.host.span)

    def observe_device(self, step: int, scan: StepScan, tensors: tuple[ScannedTensor, ...],
                       scaling: Scaling | None = None) -> torch.Tensor:
        """Judge an async step where its records are; returns its spike flag (float32 0/1, on found_inf's
        device). Nothing here waits for the device. `scaling`: the GradScaler scale the gradients carry."""
        logs = self._step_logs(scan, tensors, scaling)
        if self.device is None:
            self.device = DeviceStats(self.rule, logs.device)
        flag = scan.found_inf
        verdict, fired = self.device.observe(logs, (flag > 0).to(logs.device))
        self._pending = _DeviceStep(step, verdict)
        if verdict.device.type == "cuda":
            if self._pinned is None:
                self._pinned = torch.empty(verdict.shape, dtype=verdict.dtype, pin_memory=True)
            self._pinned.copy_(verdict, non_blocking=True)
            self._pending.event = torch.cuda.Event()
            self._pending.event.record(torch.cuda.current_stream(verdict.device))
        return fired.to(torch.float32).to(flag.device, non_blocking=True)

    def _step_logs(self, scan: StepScan, tensors: tuple[ScannedTensor, ...], scaling: Scaling | None) -> torch.Tensor:
        rows = self.rows(tensors)
        device_parts = [(r, p) for r, p in scan.parts if not isinstance(p, CompletedScan)]
        if not device_parts:  # a host scan (CPU tensors in mode="async"): the records are already here
            return torch.tensor(log_values(scan.records(), rows, scaling), dtype=torch.float64)
        # Weights on a GPU beside CPU step counters: the loss and the gradients are in the (first) device part.
        part_rows, part = device_parts[0]
        records = part.device_records
        cached = self._device_rows
        if cached is None or cached[0] is not rows or cached[1] != records.device:
            local = rows if part_rows is None else _local_rows(rows, part_rows)
            cached = self._device_rows = (rows, records.device, torch.as_tensor(local.loss, device=records.device),
                                          torch.as_tensor(local.grad, device=records.device))
        scale = scaling.tensor if scaling is not None and scaling.scaled else None
        return device_log_values(records, cached[2], cached[3], scale)

    def read(self) -> tuple[int, list[Score]] | None:
        """The pending async step and its scores past the rule (empty: no spike); waits for that step's verdict
        only. None when no step is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.event is not None:
            pending.event.synchronize()
            verdict = self._pinned.numpy().copy()
        else:
            verdict = pending.verdict.numpy()
        return pending.step, scores_from_verdict(verdict, self.rule)

    def spike_of(self, step: int, scores: list[Score]) -> Spike:
        span = int(min(self.device.count - 1, self.rule.window)) if self.device is not None else 0
        return self._spike(step, scores, span)

    def _spike(self, step: int, scores: list[Score], span: int) -> Spike:
        """The Spike of `scores`, over the steps its rule judged: the growth rule's last growth_steps, the elevated
        rule's elevated_steps, else the spike statistic's window (`span` steps)."""
        kind = scores[0].kind if scores else SPIKE
        window = self.rule.growth_steps if kind == GROWTH else self.rule.elevated_steps if kind == ELEVATED else span
        return Spike(step, tuple(scores), window, self.rule)

    def attributed(self, spike: Spike, entries: Sequence[tuple[Any, ScanReport]]) -> Spike:
        return replace(spike, first_moving=first_moving(entries, spike.step, self.rule))
