"""Known numeric traps of an optimizer's settings against the dtypes of the parameters it updates: an eps that is 0
(or subnormal) in the parameters' dtype, a learning rate times a gradient that overflows it. Replay checks them
for an update that went non-finite (nanscan.replay.reproduce), preflight before the run (nanscan.preflight).

NOTE: [update traps]
torch's Adam, AdamW and their kin compute in the parameter's dtype: under model.half(), eps=1e-8 is stored as
float16, where it rounds to 0 (the smallest float16 subnormal is 6e-8), so an element whose second moment
underflows to 0 is divided by exactly 0 and the first update writes inf or NaN. An eps below the dtype's smallest
normal survives only as a subnormal (with fewer significant bits, and flushed to 0 where denormals are off). A step
lr * |grad| past the dtype's largest finite value overflows whatever the optimizer. Each trap names its group, the
setting, the dtype and how many parameters it applies to.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

import torch

BREAKS = "breaks"  # the update goes non-finite as soon as the trap is met
RISK = "risk"  # the setting works differently from what it says


@dataclass(frozen=True)
class Trap:
    group: int
    setting: str
    value: float
    dtype: str
    params: int
    severity: str
    problem: str

    def describe(self) -> str:
        return f"param group {self.group}: {self.setting}={self.value:g} with {self.params} {self.dtype} " \
               f"parameter(s): {self.problem}"

    def to_dict(self) -> dict:
        return {"group": self.group, "setting": self.setting, "value": self.value, "dtype": self.dtype,
                "params": self.params, "severity": self.severity, "problem": self.problem,
                "text": self.describe()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _number(value) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def eps_traps(group: int, eps: float, dtypes: Counter) -> list[Trap]:
    """NOTE: [update traps]: eps against each floating dtype of a param group."""
    traps = []
    for dtype, count in dtypes.items():
        if not dtype.is_floating_point or eps <= 0:
            continue
        info = torch.finfo(dtype)
        stored = float(torch.tensor(eps, dtype=dtype))
        name = _dtype_name(dtype)
        if stored == 0.0:
            traps.append(Trap(group, "eps", eps, name, count, BREAKS,
                              f"eps rounds to 0 in {name} (its smallest subnormal is "
                              f"{info.smallest_normal * info.eps:.3g}), so an element whose second moment "
                              "underflows to 0 is divided by 0 and the update writes inf or NaN; use eps >= "
                              f"{info.smallest_normal:.3g}, or keep float32 master weights"))
        elif eps < info.smallest_normal:
            traps.append(Trap(group, "eps", eps, name, count, RISK,
                              f"eps is below {name}'s smallest normal ({info.smallest_normal:.3g}): stored as the "
                              f"subnormal {stored:.3g}, with fewer significant bits, and 0 where denormals are "
                              "flushed"))
    return traps


def optimizer_traps(optimizer: torch.optim.Optimizer,
                    grad_absmax: Mapping[int, float] | None = None) -> list[Trap]:
    """Every trap of NOTE: [update traps] in `optimizer`'s param groups. `grad_absmax`: the largest finite |grad|
    per parameter (by id), for the lr * grad check; without it that check is not made."""
    traps: list[Trap] = []
    for g, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if isinstance(p, torch.Tensor)]
        dtypes = Counter(p.dtype for p in params)
        eps = _number(group.get("eps"))
        if eps is not None:
            traps += eps_traps(g, eps, dtypes)
        lr = _number(group.get("lr"))
        if lr is None or not grad_absmax:
            continue
        over: Counter = Counter()
        for p in params:
            largest = grad_absmax.get(id(p))
            if largest is not None and p.dtype.is_floating_point and lr * largest > torch.finfo(p.dtype).max:
                over[p.dtype] += 1
        for dtype, count in over.items():
            name = _dtype_name(dtype)
            traps.append(Trap(g, "lr", lr, name, count, BREAKS,
                              f"lr * |grad| passes {name}'s largest finite value ({torch.finfo(dtype).max:.3g}): "
                              "the step itself overflows"))
    return traps
