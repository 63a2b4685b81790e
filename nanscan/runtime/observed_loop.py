"""What the run's loop did, read back from its window (nanscan.runtime.loop_effects NOTE: [observed loop]): the
clip threshold its update factors imply, and, where a window's rerun departs from the record anyway, why, in words
taken from the evidence (a constant ratio is a loss scaling, a ratio that follows the clip threshold is clipping),
never the hardware without evidence."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Sequence

from nanscan.bundle.format import WindowStep

CLIP_EPS = 1e-6  # clip_grad_norm_'s: max_norm / (total_norm + 1e-6)
CLIP_REL_TOL = 1e-3  # the factors of one threshold agree this closely (the scan's norm is float64, torch's not)
UNIT_TOL = 1e-5  # a factor this close to 1 left the gradients as they were


@dataclass(frozen=True)
class LoopClipping:
    """The clip threshold the window's update factors imply (None: none observed), with what was seen."""

    max_norm: float | None
    clipped: int  # steps whose update found the gradients scaled down
    observed: int  # steps with an update factor and a recorded gradient norm
    text: str

    @property
    def seen(self) -> bool:
        return self.observed > 0


def shortest(value: float, rel_tol: float = CLIP_REL_TOL / 10) -> float:
    """The number with the fewest significant digits within rel_tol of `value` (1.0 for 0.99999...)."""
    for digits in range(1, 16):
        rounded = float(f"{value:.{digits}g}")
        if math.isclose(rounded, value, rel_tol=rel_tol):
            return rounded
    return value


def infer_clipping(records: Sequence[WindowStep], grad_norms: dict[int, float | None],
                   unscaled: Collection[int] = ()) -> LoopClipping:
    """The loop's clip threshold from each step's update factor (WindowStep.update_factor) and its recorded gradient
    norm: at a clipped step factor x (norm + 1e-6) is max_norm; every clipped step must give the same one, and no
    unclipped step may have had a larger norm. The GradScaler's scale, where a step recorded one, is taken out of
    the factor first (its unscale divides the gradients by it), except at the `unscaled` steps, whose check came
    after scaler.unscale_() and so saw the gradients the update sees."""
    pairs = []
    for record in records:
        norm = grad_norms.get(record.step)
        if record.micro_batch is not None or record.update_factor is None or norm is None or not math.isfinite(norm):
            continue
        carried = record.loss_scale if record.loss_scale and record.step not in unscaled else 1.0
        factor = record.update_factor * carried
        pairs.append((record.step, factor, norm))
    if not pairs:
        return LoopClipping(None, 0, 0, "no update factor was recorded (a bundle written before them, or no update "
                                        "ran after a check)")
    # A factor of 0 tells no threshold: clip_grad_norm_ over a norm that overflows the gradients' dtype (its sum of
    # squares past float32's range) scales them by max_norm / inf, to zero, as the rerun's clipping will again.
    clipped = [(step, factor * (norm + CLIP_EPS)) for step, factor, norm in pairs if 0 < factor < 1 - UNIT_TOL]
    zeroed = sum(1 for _, factor, _ in pairs if factor == 0)
    grown = [(step, factor) for step, factor, _ in pairs if factor > 1 + UNIT_TOL]
    if grown:
        step, factor = grown[0]
        return LoopClipping(None, len(clipped), len(pairs),
                            f"the loop multiplied its gradients by {factor:.6g} between the check and the update at "
                            f"step {step}: not clipping (which only scales down); the rerun does not repeat it")
    if not clipped and not zeroed:
        return LoopClipping(None, 0, len(pairs), f"no clipping observed: every one of {len(pairs)} update(s) saw the "
                                                 "gradients the check scanned")
    if not clipped:
        return LoopClipping(None, zeroed, len(pairs), f"the loop's update zeroed the gradients at {zeroed} step(s) "
                                                      "and scaled none otherwise: no clip threshold to infer")
    limits = [limit for _, limit in clipped]
    low, high = min(limits), max(limits)
    if high > low * (1 + CLIP_REL_TOL):
        return LoopClipping(None, len(clipped), len(pairs),
                            f"the loop scaled its gradients down at {len(clipped)} step(s) by factors that no one clip "
                            f"threshold explains (factor x norm from {low:.6g} to {high:.6g}); the rerun does not "
                            "repeat it")
    max_norm = shortest(sorted(limits)[len(limits) // 2])
    above = [step for step, factor, norm in pairs if factor >= 1 - UNIT_TOL and norm > max_norm * (1 + CLIP_REL_TOL)]
    if above:
        return LoopClipping(None, len(clipped), len(pairs),
                            f"factor x norm gives {max_norm:g} at {len(clipped)} step(s), but step {above[0]} kept a "
                            "larger norm unclipped: not one clip threshold; the rerun does not repeat it")
    zero_text = f", and to zero at {zeroed} (a norm past the gradients' range)" if zeroed else ""
    return LoopClipping(max_norm, len(clipped) + zeroed, len(pairs),
                        f"clipping observed: the update scaled the gradients to norm {max_norm:g} at {len(clipped)} "
                        f"of {len(pairs)} step(s){zero_text} (clip_grad_norm_ at max_norm={max_norm:g}), applied by "
                        "the rerun")


def simple_ratio(ratio: float, rel_tol: float = 1e-3) -> str | None:
    """"1/k" or "k" for a ratio within rel_tol of one (k an integer from 2 to 4096), else None."""
    if not (ratio > 0 and math.isfinite(ratio)):
        return None
    for value, text in ((ratio, "{k}"), (1.0 / ratio, "1/{k}")):
        k = round(value)
        if 2 <= k <= 4096 and math.isclose(value, k, rel_tol=rel_tol):
            return text.format(k=k)
    return None


def departure_reason(loss: float | None, recorded_loss: float | None, grad_norm: float | None,
                     recorded_grad_norm: float | None, previous_factor: float | None, previous_clip: float | None,
                     loss_tol: float) -> str:
    """Why a rerun step departs from its record, from what the two hold: the loss matching while the gradient norm
    is a simple multiple is a loss scaling the rerun does not repeat; a loss that already differs means the update
    before it differed (the loop scaled that update's gradients in a way the rerun did not apply, or something
    outside step_fn); nothing points at the hardware."""
    loss_same = loss is not None and recorded_loss is not None and \
        math.isclose(loss, recorded_loss, rel_tol=loss_tol, abs_tol=1e-12)
    if loss and recorded_loss and grad_norm and recorded_grad_norm and not loss_same:
        ratio = loss / recorded_loss
        simple = simple_ratio(ratio)
        if simple is not None and math.isclose(ratio, grad_norm / recorded_grad_norm, rel_tol=1e-3):
            return (f"the loss and the gradient norm are both {simple} x the record's: a constant loss scaling the "
                    "rerun does not repeat (the loop divides or sums its micro-batch losses otherwise than the rerun "
                    "does; StepOptions(loss_scale=...) sets it)")
    if loss_same and grad_norm and recorded_grad_norm:
        ratio = grad_norm / recorded_grad_norm
        simple = simple_ratio(ratio)
        if simple is not None:
            return (f"the loss matches but the gradient norm is {simple} x the record's: a constant loss scaling the "
                    "rerun does not repeat (a loop that sums or divides its micro-batch losses otherwise than step_fn "
                    "returns them; the window records the losses it passed from now on, and a ReplaySpec can give "
                    "StepOptions(loss_scale=...))")
        return (f"the loss matches but the gradient norm is {ratio:.6g} x the record's: the backward differs from the "
                "loop's (code between the loss and backward, a hook on the gradients, or the micro-batches: a loop "
                "that ran more forwards than it passed batches to check() and observe())")
    if previous_factor is not None and previous_factor < 1 - UNIT_TOL and previous_clip is None:
        return (f"the update before it found the gradients scaled by {previous_factor:.6g} (clipping, most likely) "
                "and the rerun's update did not scale them")
    return ("the loss already differs: the update before it differs from the loop's (its optimizer, settings or "
            "state), or code outside step_fn changed the weights; nondeterministic kernels depart by a few ulps at "
            "first and grow, a rerun that departs at once does not; nothing here points at the hardware")
