"""Whether a rollback recovered the run, measured on its loss and gradient norm (NOTE: [recovered]).

NOTE: [recovered]
A rollback (nanscan.runtime.rollback NOTE: [rollback]) counts as recovered only when, after settle_steps finite
steps, the run is back where it was before the trouble, not merely finite: the median loss (and gradient norm) of
those settle steps is within the band of the steps before the restored state (the last REFERENCE_STEPS of them
the history still held at the rollback). The band is their median plus BAND_SIGMAS robust standard deviations
(1.4826 x the median absolute deviation, at least BAND_FLOOR of the median): a healthy step's loss lies below it
about 99.9% of the time, and the settle steps' median, over several steps, varies less than one step does, so a
recovered run is not called unrecovered by noise; a loss several times its earlier level (a learning rate far too
large that a factor of 0.5 does not cure: issue 60's lr 15 run stayed at 100-900 from a start of 4.5) is outside.
Where the steps before were themselves above twice the run's first loss (the trouble began before the kept state),
or where there are none (restored to the run's first step), the ceiling is twice the run's first loss: a model that
much worse than at its start is not recovered (one step's loss is noisy, so not the first loss itself: a small
regression's first batch was 0.39 and its next ones 0.6). Otherwise the status is "not recovered", with the numbers, and the Monitor warns; a
rollback with no loss recorded on either side is judged on finiteness alone and says so.
Medians, not means: one spiking step in the reference would widen a mean band past any failure.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

REFERENCE_STEPS = 16  # the steps before the restored state that make the band
BAND_SIGMAS = 3.0
BAND_FLOOR = 0.05  # the band's least width above the median, a fraction of it (a flat loss has no spread)
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per median absolute deviation


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def band(values: Sequence[float | None]) -> tuple[float, float] | None:
    """(median, ceiling) of finite values (NOTE: [recovered]), or None without any."""
    finite = _finite(values)
    if not finite:
        return None
    median = statistics.median(finite)
    spread = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in finite)
    return median, median + max(BAND_SIGMAS * spread, BAND_FLOOR * abs(median))


def _median(values: Sequence[float | None]) -> float | None:
    finite = _finite(values)
    return statistics.median(finite) if finite else None


def judge(reference: Sequence[Any], after: Sequence[Any], first_loss: float | None) -> dict:
    """The outcome of a rollback once it settled (NOTE: [recovered]): {"status": "recovered" | "not recovered",
    the measured numbers, and "why"}. `reference`: history entries (step, loss, grad_norm) before the restored
    state; `after`: the settle steps' entries; `first_loss`: the run's first recorded loss."""
    loss = _median([e.loss for e in after])
    out: dict[str, Any] = {"loss": loss, "steps": [after[0].step, after[-1].step] if after else None}
    kept = reference[-REFERENCE_STEPS:]
    loss_band = band([e.loss for e in kept])
    start = first_loss + abs(first_loss) if first_loss is not None and math.isfinite(first_loss) else None
    if loss_band is not None and (start is None or loss_band[0] <= start):
        ceiling, against = loss_band[1], (f"the band of steps {kept[0].step}-{kept[-1].step} before the restored "
                                          f"state (median {loss_band[0]:.4g})")
    elif start is not None:
        ceiling, against = start, (f"twice the run's first loss ({first_loss:.4g})" + (
            "; the steps before the restored state were already above it" if loss_band is not None else ""))
    else:
        ceiling, against = None, None
    out.update(loss_ceiling=ceiling)
    if loss is None or ceiling is None:
        out.update(status="recovered", why="finite over the settle steps; no loss recorded to compare")
        return out
    why = []
    if loss > ceiling:
        why.append(f"the loss (median {loss:.4g} over steps {out['steps'][0]}-{out['steps'][1]}) is above "
                   f"{ceiling:.4g}, {against}")
    norm = _median([e.grad_norm for e in after])
    norm_band = band([e.grad_norm for e in kept])
    out.update(grad_norm=norm, grad_norm_ceiling=norm_band[1] if norm_band else None)
    if norm is not None and norm_band is not None and norm > norm_band[1]:
        why.append(f"the gradient norm (median {norm:.4g}) is above {norm_band[1]:.4g}, the band before the restored "
                   f"state (median {norm_band[0]:.4g})")
    if why:
        out.update(status="not recovered", why="finite but " + "; ".join(why))
    else:
        out.update(status="recovered", why=f"the loss (median {loss:.4g}) is within {ceiling:.4g}, {against}")
    return out
