"""GradScaler awareness for the Monitor: the loss scale each check's gradients carry, which non-finite steps are a
scaler's expected overflow skips, and when a streak of them becomes an incident; plus the autocast state.

NOTE: [overflow skips]
With a GradScaler (torch.amp's, any device), a step whose only non-finite tensors are gradients (inputs, weights,
optimizer state and loss finite: category "gradient" in nanscan.incident's order) is an overflow skip: the scaled
gradients overflowed, GradScaler.step() skips the update and update() multiplies the scale by its backoff factor.
It is recorded (the history and report.overflow_skip, with the scale before and after), never bundled, never given
to on_invalid. Consecutive skips form a streak, which becomes an incident (category "gradient", reason
SKIP_STREAK) at the skip that would take the scale below `min_scale`, or at the `max_skips`-th skip in a row,
whichever comes first. A finite step ends a streak. The incident names the streak's first step: its batch, sample
ids, step-start captures and report are kept from that step's skip (one step's worth, dropped when the streak
ends; a streak that continues a run's first overflow skips, with no finite step between, starts with them), and
as the scaler skipped every update of the streak, the weights and optimizer state at the incident are
the ones that step started from (buffers the forward pass updates, such as BatchNorm statistics, excepted).
Defaults, measured on healthy fp16-autocast runs (MLP, transformer encoder, CNN; CPU, 60 steps): from 2**16 a run
skips 0 to 2 steps; from 2**24 at most 7 in a row, from 2**32 (Megatron's default) at most 15 in a row. A scale
below 1 shrinks the gradients instead of protecting them, which no healthy fp16 run needs, so MIN_SCALE = 1.0 (from
2**16: the 17th skip in a row); MAX_SKIPS = 24 leaves a healthy run from 2**32 nine skips of margin.

The scale is read without waiting for the GPU (NOTE: [history ring] in nanscan.runtime.history): a GPU scaler's scale is
copied to pinned host memory behind an event at the check, and read after the step's verdict (which waits for a
later event on the same stream), or when the history is read. Whether the gradients still carry the scale comes
from the scaler's per-optimizer state: after GradScaler.unscale_(optimizer) (with or without clip_grad_norm_ after
it) they are the real gradients and are not unscaled again. Fused optimizers (found_inf/grad_scale contract) unscale
inside step(), so at the check their gradients are scaled, as the state says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from nanscan.incident import categorize
from nanscan.engine.stats import ScanReport, Scaling

MAX_SKIPS = 24
MIN_SCALE = 1.0

# GradScaler's per-optimizer stage after unscale_() (torch.amp.grad_scaler.OptState.UNSCALED). Read by name from the
# scaler's state, as torch exports no public question for it.
_UNSCALED_STAGE = "UNSCALED"


def check_scaler(scaler: Any, max_skips: int, min_scale: float) -> None:
    """A ValueError or TypeError naming the argument that cannot drive overflow-skip decisions."""
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or torch.cuda.amp.GradScaler) or None, got "
                        f"{type(scaler).__name__}")
    if not isinstance(max_skips, int) or isinstance(max_skips, bool) or max_skips < 1:
        raise ValueError(f"max_skips={max_skips!r}: give the number of consecutive overflow skips (at least 1) "
                         "after which a streak is an incident")
    if not (isinstance(min_scale, (int, float)) and min_scale >= 0):
        raise ValueError(f"min_scale={min_scale!r}: give the loss scale (>= 0) below which a streak of overflow "
                         "skips is an incident")


def grads_unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether scaler.unscale_(optimizer) ran since the last update(): the gradients are then the real ones."""
    if optimizer is None:
        return False
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    stage = state.get("stage") if isinstance(state, dict) else None
    return getattr(stage, "name", None) == _UNSCALED_STAGE


def read_scaling(scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer | None) -> Scaling | None:
    """The scale this check's gradients carry, without waiting for a GPU; None without an enabled scaler or before
    its first scale() (nothing is scaled yet)."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    if scale is None:
        return None
    scaled = not grads_unscaled(scaler, optimizer)
    backoff = scaler.get_backoff_factor()
    if scale.device.type == "cpu":
        return Scaling(float(scale), scaled, backoff=backoff)
    pinned = torch.empty((), dtype=scale.dtype, pin_memory=True)
    pinned.copy_(scale.reshape(()), non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(scale.device))
    return Scaling(pinned, scaled, event=event, backoff=backoff, tensor=scale)


def autocast_state(device_type: str) -> dict | None:
    """{"device_type", "dtype"} of the autocast region a forward runs in, or None outside one."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return {"device_type": device_type, "dtype": str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")}


@dataclasses.dataclass(frozen=True)
class Skip:
    """One overflow skip: the step and the scale before and after GradScaler's backoff."""

    step: int
    scale_before: float
    scale_after: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Streak:
    """Consecutive overflow skips; `evidence`: what the Monitor kept of the first one (its step's batch, captures
    and report), opaque here."""

    first: Any  # the evidence of the streak's first step
    skips: list[Skip]
    reason: str = ""  # why it became an incident, once it did

    @property
    def first_step(self) -> int:
        return self.skips[0].step


class ScalerWatch:
    """Tells overflow skips from incidents for one GradScaler (NOTE: [overflow skips])."""

    def __init__(self, scaler: torch.amp.GradScaler, *, max_skips: int = MAX_SKIPS, min_scale: float = MIN_SCALE):
        check_scaler(scaler, max_skips, min_scale)
        self.scaler = scaler
        self.max_skips = max_skips
        self.min_scale = float(min_scale)
        self.streak: Streak | None = None
        self.skips_total = 0
        self.recent: list[Skip] = []  # the last max_skips skips of the run, streak or not, for the bundle

    def is_skip(self, report: ScanReport) -> bool:
        """Whether a non-finite step is an overflow skip: only gradients non-finite, under a scale."""
        return report.scaling is not None and categorize(report)[0] == "gradient"

    def end_streak(self) -> None:
        """A finite step: the scaler updated the weights again."""
        self.streak = None

    def record_skip(self, report: ScanReport, evidence: Any) -> Streak | None:
        """Count an overflow skip (`evidence`: the step's, kept if it opens a streak). Returns the streak when it
        has become an incident (its `reason` says why), else None."""
        scale = report.scaling.scale
        skip = Skip(report.step, scale, scale * report.scaling.backoff)
        self.skips_total += 1
        self.recent = [*self.recent[-(self.max_skips - 1):], skip] if self.max_skips > 1 else [skip]
        if self.streak is None:
            self.streak = Streak(evidence, [skip])
        else:
            self.streak.skips.append(skip)
        streak = self.streak
        if skip.scale_after < self.min_scale:
            streak.reason = (f"the scale would fall to {skip.scale_after:g}, below min_scale={self.min_scale:g}, "
                             f"after {len(streak.skips)} consecutive overflow skips")
        elif len(streak.skips) >= self.max_skips:
            streak.reason = f"{len(streak.skips)} consecutive overflow skips (max_skips={self.max_skips})"
        else:
            return None
        self.streak = None
        return streak

    def summary(self, streak: Streak | None = None, autocast: dict | None = None) -> dict:
        """The bundle's mixed-precision record: autocast, the scaler's settings and skips, the streak if any."""
        scaler = self.scaler
        enabled = scaler.is_enabled()
        # a disabled GradScaler (GradScaler(enabled=False), the loop's switch for bf16 and fp32) holds no settings
        settings = {"growth_factor": scaler.get_growth_factor(), "backoff_factor": scaler.get_backoff_factor(),
                    "growth_interval": scaler.get_growth_interval()} if enabled else {}
        out = {
            "autocast": autocast,
            "scale": scaler.get_scale() if enabled else None,  # at an incident: a sync is no cost
            "scaler": {"device": getattr(scaler, "_device", None), "enabled": enabled, **settings,
                       "max_skips": self.max_skips, "min_scale": self.min_scale},
            "skips_total": self.skips_total,
            "recent_skips": [s.to_dict() for s in self.recent],
            "streak": None,
        }
        if streak is not None:
            out["streak"] = {"first_step": streak.first_step, "length": len(streak.skips), "reason": streak.reason,
                             "scale_history": [s.to_dict() for s in streak.skips]}
        return out


def mixed_precision_record(watch: ScalerWatch | None, autocast: dict | None,
                           streak: Streak | None = None) -> dict | None:
    """What a bundle says about mixed precision: None when the run used neither autocast nor a scaler."""
    if watch is not None:
        return watch.summary(streak, autocast)
    return None if autocast is None else {"autocast": autocast, "scale": None, "scaler": None, "skips_total": 0,
                                          "recent_skips": [], "streak": None}
