"""The batch and the loop's settings around a rerun step, shared by replay (nanscan.replay) and the Monitor's
in-process diagnosis (nanscan.runtime.incident_diagnosis): the run's precision and clipping as a rerun applies them
(NOTE: [replayed precision]), the sample selection and device placement of its batch, and ReplayError.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from nanscan.engine.inputs import batch_size, map_tensors, take_rows
from nanscan.entry import ReplaySpec
from nanscan.runtime.rerun import HALF_DTYPES, recorded_precision
from nanscan.runtime.step_options import StepOptions

# NOTE: [replayed precision]
# A replayed step runs in the run's precision. The autocast region the Monitor recorded for the step's forward
# (nanscan.runtime.amp.autocast_state: device type and dtype; none when the forward ran outside autocast) is entered
# around the entry's step_fn by replay, ablate and the tests export-regression writes, and preflight enters the one
# it is given: an entry need not repeat the loop's `with torch.autocast(...)`, and a bfloat16 run is not replayed
# in float32 by default. The region is entered on the model's device whatever device recorded it (a cuda run
# replayed on the CPU autocasts on the CPU). Only autocast is re-applied: the weights and the batch stay as the
# entry builds them and the bundle holds them. A precision factor (StepOptions.precision) replaces the recorded
# region, so the precision ablations work whether or not the run used autocast. An entry whose step_fn enters
# autocast itself says so (ReplaySpec.autocast="entry"): nothing is entered for it, as its own region would
# override an outer one anyway, and a precision factor counts as applied only where the forward then ran in the
# factor's dtype, which the entry's own region decides (Replayer.run notes it, and ablate marks the row "not
# applied").


class ReplayError(RuntimeError):
    """A bundle that cannot be replayed (no replay entry, no batch, a model that does not match the state)."""


def loop_options(spec: ReplaySpec, options: StepOptions, autocast: Mapping | None = None) -> StepOptions:
    """The options a step runs under with the loop's own clipping (ReplaySpec.clip_grad_norm) where the options
    name none, and the run's recorded `autocast` region where they name no precision (with_run_precision): a replay
    reruns the loop's step, clipping and autocast included, and a clipping or precision factor replaces them."""
    if options.clip_grad_norm is None and spec.clip_grad_norm is not None:
        options = replace(options, clip_grad_norm=spec.clip_grad_norm)
    return with_run_precision(spec, options, autocast)


def with_run_precision(spec: ReplaySpec, options: StepOptions, autocast: Mapping | None) -> StepOptions:
    """`options` with the run's recorded `autocast` region as their precision (NOTE: [replayed precision]), unless
    they name one (a precision factor) or the entry enters its own (ReplaySpec.autocast="entry")."""
    precision = recorded_precision(autocast)
    if options.precision is not None or precision is None or spec.autocast == "entry":
        return options
    return replace(options, precision=precision)


def select_samples(batch: Any, indices: Sequence[int], spec: ReplaySpec | None = None, *,
                   size: int | None = None) -> Any:
    """The batch restricted to the given sample rows: spec.select_samples when the entry gives one, else every
    tensor whose leading dimension is the batch size (`size`, default batch_size(batch)) is indexed along
    dimension 0 (other tensors kept whole)."""
    indices = [int(i) for i in indices]
    if spec is not None and spec.select_samples is not None:
        try:
            return spec.select_samples(batch, indices)
        except Exception as exc:  # noqa: BLE001 - the user's function: name it, not a line deep inside it
            shown = f"{indices[:8]}{' ...' if len(indices) > 8 else ''}"
            raise ReplayError(f"ReplaySpec.select_samples raised {type(exc).__name__}: {exc} (selecting rows "
                              f"{shown}); fix it in the replay entry") from exc
    size = batch_size(batch) if size is None else size
    if size is None:
        raise ReplayError("the batch has no tensor with a sample dimension, so samples cannot be selected; give "
                          "the replay entry a ReplaySpec.select_samples")
    return take_rows(batch, indices, size)


def prepare_batch(batch: Any, device: torch.device, options: StepOptions) -> Any:
    """The batch on the model's device, each tensor in an allocation of its own: a bundle's tensors are views into
    its file's buffer at any offset, and the CPU's math library (MKL) rounds a product differently by the operands'
    alignment, so a rerun on them would not give the recorded bits (NOTE: [bit-exact rerun])."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, copy=True)
        if options.precision is not None and t.dtype in HALF_DTYPES:
            t = t.float()  # the precision rows start from float32 data; autocast does the rest
        return t

    return map_tensors(batch, convert)


def sample_ids_of(ids: Any, indices: Sequence[int], size: int | None) -> list | None:
    if isinstance(ids, (list, tuple)) and size is not None and len(ids) == size:
        return [ids[i] for i in indices]
    return None


