"""One training step run again, scanned and optionally localized (run_step), with its outcome and the options'
torch side (precisions, autocast, deterministic algorithms): the Monitor's in-process rerun at an incident
(Monitor(step_fn=...)) and every tool that reruns a step (replay, ablate, preflight, nanscan.testing, through
nanscan.replay.step) run it.

Hooks are attached to the model only for the duration of one rerun step: the every-step path (Monitor.check)
never sees them.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch

from nanscan.bundle import json_float
from nanscan.engine import _layout as L
from nanscan.engine.headroom import overflowing_inputs, range_limit_text
from nanscan.engine.inputs import iter_batch_tensors
from nanscan.engine.stats import ScanReport
from nanscan.incident import is_kind, owner_module, tensor_name
from nanscan.runtime.localize import Localization, Localizer, ValueSummary, first_bad, fmt_value, summary_of
from nanscan.runtime.ops import OpSite, OpTracer
from nanscan.runtime.shards import clip_grad_norm, has_dtensors, local_shard
from nanscan.runtime.step_options import PRECISION_NAMES, StepOptions
from nanscan.engine.plans import whole_tensor
from nanscan.scan import model_inputs, scan, scan_inputs

# Each precision's autocast dtype ("float32": autocast off); StepOptions checks the names without torch.
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert tuple(PRECISIONS) == PRECISION_NAMES
# The precision of each autocast dtype a run records ("bfloat16" -> "bfloat16"): NOTE: [replayed precision].
PRECISION_OF = {str(dtype).removeprefix("torch."): name for name, dtype in PRECISIONS.items() if dtype is not None}
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Accumulation:
    """One optimizer step over several micro-batches, as a loop with gradient accumulation runs it (NOTE: [replayed
    accumulation]): `before(i)`, when given, runs before micro-batch i's forward (the window restores the RNG state
    recorded at that forward's start).

    NOTE: [replayed accumulation]
    Each micro-batch's loss is divided by their count and backpropagated into the same gradients, then one update
    follows: the mean, as nanoGPT's loop (loss / gradient_accumulation_steps) and the trainers (HF, Lightning,
    accelerate) accumulate. The step's loss is that mean. A loop that sums its micro-batches' losses instead gets
    gradients N times larger than the rerun's, which the window's replay shows as a departure in the gradient norm
    at the first accumulated step."""

    batches: list
    before: Callable[[int], None] | None = None


def recorded_precision(autocast: Mapping | None) -> str | None:
    """The precision of an autocast region as the Monitor records it ({"device_type", "dtype"}, with "enabled"
    where given): None outside autocast, or for a dtype a replay cannot autocast to."""
    if not isinstance(autocast, Mapping) or autocast.get("enabled") is False:
        return None
    return PRECISION_OF.get(autocast.get("dtype"))


@dataclass
class StepOutcome:
    """What one replayed step did. `category` uses the bundle's vocabulary (STEP_CATEGORIES); None when finite."""

    finite: bool
    category: str | None
    loss: float | None
    nonfinite: list[str]  # names as the Monitor writes them: input:, param:, optim:, loss, grad:
    grad_norm: float | None  # over the finite gradient values
    grad_max_exponent: int | None  # floor(log2) of the largest finite |gradient|
    autocast: str | None  # the autocast dtype in effect during the model's forward, None when off
    param_dtypes: list[str]
    localization: Localization | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    start_nonfinite: bool = False  # the weights or optimizer state were non-finite before the step ran
    op_site: OpSite | None = None  # with trace_ops: the first op or autograd node that went non-finite
    part_losses: list[float] = field(default_factory=list)  # each micro-batch's loss as step_fn returned it
    loss_scale: float | None = None  # the factor each returned loss was multiplied by before its backward
    overflow_skip: bool = False  # a GradScaler's expected skip: the update was not applied (NOTE: [replayed scaling])
    # The scans behind the outcome, for callers that read more than the verdict (preflight's headroom): the
    # gradients after backward (and clipping) and the weights and optimizer state after optimizer.step().
    gradients: ScanReport | None = field(default=None, repr=False, compare=False)
    updated: ScanReport | None = field(default=None, repr=False, compare=False)
    # and the batch and the starting state as the step began (compared with a record: NOTE: [bit-exact rerun])
    inputs: ScanReport | None = field(default=None, repr=False, compare=False)
    start: ScanReport | None = field(default=None, repr=False, compare=False)
    loss_scan: ScanReport | None = field(default=None, repr=False, compare=False)  # "loss": one part's, as returned

    def scanned(self) -> list:
        """Every tensor this step scanned before its update: the batch, the starting state, the loss (a step of one
        part), the gradients."""
        reports = (self.inputs, self.start, self.loss_scan, self.gradients)
        return [s for report in reports if report is not None for s in report.stats]

    @property
    def signature(self) -> tuple:
        """What makes two failures "the same failure": where they started and which tensors went non-finite."""
        return self.finite, self.category, tuple(self.nonfinite), self.error

    def to_dict(self) -> dict:
        return {"finite": self.finite, "category": self.category, "loss": json_float(self.loss),
                "nonfinite": list(self.nonfinite[:50]), "nonfinite_count": len(self.nonfinite),
                "grad_norm": json_float(self.grad_norm), "grad_max_exponent": self.grad_max_exponent,
                "autocast": self.autocast, "param_dtypes": list(self.param_dtypes),
                "localization": self.localization.to_dict() if self.localization else None,
                "error": self.error, "notes": list(self.notes), "start_nonfinite": self.start_nonfinite,
                "op": self.op_site.to_dict() if self.op_site else None}

    def describe(self) -> str:
        if self.error:
            return f"error: {self.error}"
        if self.finite:
            return f"finite (loss {fmt_value(self.loss)})"
        where = f"; first in {self.localization.describe()}" if self.localization else ""
        return f"non-finite ({self.category}: {', '.join(self.nonfinite[:3])}" \
               f"{' ...' if len(self.nonfinite) > 3 else ''}){where}"


def model_device(model: torch.nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """torch.use_deterministic_algorithms(True, warn_only=True) and deterministic cuDNN for the block, then the
    previous settings. warn_only: an operation without a deterministic version warns (naming itself) instead of
    stopping the replay."""
    if not enabled:
        yield
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    # cuBLAS reads this when it creates its handle: deterministic only if set before the first CUDA matmul.
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is None and not torch.cuda.is_initialized():
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2], previous[3]
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def autocast_context(options: StepOptions, device_type: str):
    if options.precision is None:
        return contextlib.nullcontext()
    dtype = PRECISIONS[options.precision]
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


def top_exponent(report: ScanReport) -> int | None:
    if not len(report):
        return None
    occupied = np.flatnonzero(report.totals.exp_hist)
    return int(occupied[-1]) + L.MIN_BIN_EXPONENT if len(occupied) else None


def param_dtypes(model: torch.nn.Module) -> list[str]:
    return list(dict.fromkeys(str(p.dtype).removeprefix("torch.") for p in model.parameters()))


def run_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step_fn: Callable, batch: Any, *,
             options: StepOptions = StepOptions(), localize: bool = False,
             backward_module_hooks: bool = True, trace_ops: bool = False, train: bool = True,
             passed_losses: Sequence[float | None] | None = None, grad_scale: float | None = None,
             driver: "StepDriver | None" = None) -> StepOutcome:
    """Run one training step (forward through step_fn, backward, optional clipping, optimizer.step()) and scan
    the batch, the starting state, the loss, the gradients and the updated state.

    The caller has loaded the state and moved the batch to the model's device. Without an optimizer the step ends
    after the gradients. `localize` adds the hooks of Localizer for this step only; `trace_ops` the op tracer
    (nanscan.replay.ops NOTE: [op localization]), whose first site is `outcome.op_site`. Exceptions raised by the
    step become `outcome.error`; nothing is raised for a non-finite step. `train`: put the model in training mode
    first (a model the replay entry built); False keeps each module's mode (the live model, as the loop set it).
    `passed_losses`: the losses the loop passed for the step's micro-batches (WindowStep.loss); where the options
    give no loss_scale, the first micro-batch's against what step_fn returns for it sets the scale of them all
    (observed_loss_scale, nanscan.runtime.loop_effects NOTE: [observed loop]). `grad_scale`: the run's GradScaler
    scale for this step (NOTE: [replayed scaling]); None: no GradScaler.

    NOTE: [replayed scaling]
    A step the run took under a GradScaler is rerun under one, at the scale the run's check recorded for it
    (WindowStep.loss_scale): each micro-batch's loss is scaled before its backward, the gradients are unscaled
    before they are scanned and clipped, and the update is skipped where they are not finite, by torch's own
    GradScaler (scale, unscale_, step) as the loop called it. In float16 the scale decides which gradients
    underflow and which overflow, so a rerun without it computes other gradients from the first step on. Such a
    skip, with the batch, state and loss finite, is the scaler's expected overflow skip (NOTE: [overflow skips] in
    nanscan/runtime/amp.py): the outcome is finite with `overflow_skip` set, and its gradient norm is over the
    finite values, as the Monitor records a skip's.

    `driver`: how the step drives the loop's engine (NOTE: [step driver]); default a TorchDriver over `model` and
    `optimizer` at `grad_scale`.
    """
    device_type = model_device(model).type
    notes: list[str] = []
    seen_autocast: list[str | None] = []

    def record_autocast(module, args):
        if not seen_autocast:
            enabled = torch.is_autocast_enabled(device_type)
            seen_autocast.append(str(torch.get_autocast_dtype(device_type)).removeprefix("torch.") if enabled
                                 else None)

    scans: dict[str, ScanReport] = {}

    def outcome(category, nonfinite, loss_value=None, grads=None, error=None, localization=None, updated=None):
        return StepOutcome(op_site=tracer.first if tracer is not None else None, **scans,
            finite=category is None and error is None, category=category, loss=loss_value, nonfinite=nonfinite,
            grad_norm=float(np.sqrt(grads.totals.sumsq)) if grads is not None and len(grads) else None,
            grad_max_exponent=top_exponent(grads) if grads is not None else None,
            autocast=seen_autocast[0] if seen_autocast else None, param_dtypes=param_dtypes(model),
            localization=localization, error=error, notes=notes, gradients=grads, updated=updated)

    localizer = Localizer(model, backward_modules=backward_module_hooks) if localize else None
    tracer = OpTracer(model) if trace_ops else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(deterministic_algorithms(options.deterministic))
        stack.enter_context(warnings.catch_warnings())
        # a module whose inputs need no gradient (the first layer) fires its full backward hook early: expected
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        # a module returning a ModelOutput (transformers) gets no backward hook: its submodules still localize
        warnings.filterwarnings("ignore", message="For backward hooks to be called, module output should be")
        # On every module: a step_fn may call a submodule only (LightningModule.training_step -> self.net(...))
        for module in model.modules():
            stack.callback(module.register_forward_pre_hook(record_autocast).remove)
        if localizer is not None:
            stack.enter_context(localizer)

        if train:
            model.train()
        if driver is None:
            driver = TorchDriver(model, optimizer, grad_scale)
        driver.zero_grad()
        parts = batch.batches if isinstance(batch, Accumulation) else [batch]
        shown = parts if isinstance(batch, Accumulation) else batch  # a step's micro-batches: input:<i>.<path>
        batch_report = scan([(tensor_name("input", path), t) for path, t in iter_batch_tensors(shown)])
        state_report = scan_inputs(driver.state())
        scans.update(inputs=batch_report, start=state_report)
        if not state_report.ok:
            bad = state_report.nonfinite
            category = "parameter" if any(is_kind(n, "parameter") for n in bad) else "optimizer_state"
            notes.append("the starting state is already non-finite: an earlier step (or an outside write) did "
                         "the damage, and this step cannot show where")
            where = owner_of([n for n in bad if is_kind(n, "parameter")] or bad)
            owner = dict(model.named_modules()).get(where, model)
            loc = Localization("state", where, type(owner).__name__, ValueSummary(), summary_of(state_report),
                               f"{category}: {len(bad)} non-finite tensor(s), first {bad[0]}")
            result = outcome(category, batch_report.nonfinite + bad, localization=loc)
            result.start_nonfinite = True
            return result

        loss_value = 0.0
        scale = options.loss_scale
        returned: list[float] = []
        # DistributedDataParallel all-reduces a step's gradients once, at its last micro-batch, as the loops that
        # accumulate under it do (no_sync, train.py's require_backward_grad_sync): a reduction per micro-batch would
        # round the sum otherwise, and a diverging run amplifies the difference within steps
        synced = isinstance(model, torch.nn.parallel.DistributedDataParallel) and len(parts) > 1
        if synced:
            stack.callback(setattr, model, "require_backward_grad_sync", True)
        for index, part in enumerate(parts):  # one part, or a step's micro-batches (NOTE: [replayed accumulation])
            if synced:
                model.require_backward_grad_sync = index == len(parts) - 1
            if isinstance(batch, Accumulation) and batch.before is not None:
                batch.before(index)
            try:
                with autocast_context(options, device_type), tracer or contextlib.nullcontext():
                    loss = step_fn(model, part)
            except Exception as exc:  # noqa: BLE001 - the user's step failing is a result to report
                return outcome("loss", [], error=f"step_fn raised {type(exc).__name__}: {exc}")
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else \
                    f"a tensor of shape {tuple(loss.shape)}"
                return outcome("loss", [], error=f"step_fn returned {what}; it must return the scalar loss tensor")
            returned.append(float(loss.detach().float()))
            if scale is None and index == 0 and passed_losses:
                scale = observed_loss_scale(passed_losses[0], returned[0])
            factor = scale if scale is not None else 1.0 / len(parts)
            scaled = loss * factor if factor != 1.0 else loss
            if len(parts) == 1:
                scans["loss_scan"] = scan([("loss", scaled.detach())])
            loss_value += float(scaled.detach().float())
            try:  # an engine that scales the loss itself is given it as step_fn returned it (NOTE: [step driver])
                driver.backward(loss if driver.scales_loss else scaled, last=index == len(parts) - 1)
            except Exception as exc:  # noqa: BLE001
                return outcome("loss", [], loss_value, error=f"{driver.calls[0]} raised {type(exc).__name__}: {exc}")
        loss_ok = math.isfinite(loss_value)
        # before clipping, as the Monitor checks them: a clip over one NaN gradient makes every gradient NaN
        grads = scan_inputs(driver.gradients())
        if options.clip_grad_norm is not None:
            driver.clip(options.clip_grad_norm)
        update_report = None
        skipped = False
        if driver.steps:
            try:
                # an expected skip (a GradScaler's) only where nothing before the gradients went non-finite
                skipped = driver.step(grads.ok) and batch_report.ok and loss_ok
            except Exception as exc:  # noqa: BLE001 - as for step_fn: the user's optimizer failing is a result
                return outcome("update", [], loss_value, grads, error=f"{driver.calls[1]} raised "
                                                                      f"{type(exc).__name__}: {exc}")
            update_report = scan_inputs(driver.state())

    nonfinite = list(batch_report.nonfinite)
    nonfinite += [] if loss_ok else ["loss"]
    nonfinite += grads.nonfinite + (update_report.nonfinite if update_report is not None else [])
    if not batch_report.ok:
        category = "input"
    elif not loss_ok:
        category = "loss"
    elif not grads.ok:
        category = "gradient"
    elif update_report is not None and not update_report.ok:
        category = "update"
    else:
        category = None
    if skipped:
        category, nonfinite = None, []
    localization = None
    if localizer is not None and category is not None:
        localization = first_bad(localizer, category, batch_report, loss_value, grads, update_report, optimizer)
    compute_dtype = seen_autocast[0] if seen_autocast else None
    huge = overflowing_inputs(batch_report.stats, compute_dtype) if category in ("loss", "gradient") else []
    if huge:  # as the Monitor decides (NOTE: [overflow] in nanscan/engine/headroom.py); the localization says where
        largest = max(s.absmax for s in batch_report.stats if s.name in huge)
        notes.append(f"likely cause: the batch's {', '.join(huge[:3])} held finite values beyond the step's range "
                     f"({range_limit_text(compute_dtype)}; largest |x| {largest:.4g}), which the model turned "
                     f"non-finite ({category}); `nanscan data` flags them as overflow")
        category = "input"
    result = outcome(category, nonfinite, loss_value, grads, localization=localization, updated=update_report)
    result.part_losses, result.loss_scale, result.overflow_skip = returned, factor, skipped
    return result


class StepDriver(Protocol):
    """How a rerun step drives the loop's training engine (NOTE: [step driver]).

    NOTE: [step driver]
    run_step calls step_fn for the forward and leaves the rest of a training step to a driver: clear the gradients,
    backpropagate each micro-batch's loss, give the gradients as the loop's clipping sees them, clip, update, and
    give the state's tensors to scan, as the loop's engine does it. The default, TorchDriver, is the plain loop's:
    loss.backward(), clip_grad_norm_, optimizer.step(), under a GradScaler where the run had one (NOTE: [replayed
    scaling]). A framework whose engine keeps the gradients and state itself gives its own (DeepSpeed's
    engine.backward/engine.step over its ZeRO partitions: nanscan.integrations.deepspeed.DeepSpeedDriver), so that
    the window rerun and the in-process diagnosis run its steps as the loop did.
      - `scales_loss`: the engine scales each loss itself (DeepSpeed divides by its accumulation steps and applies
        its loss scale): backward() is given the loss as step_fn returned it;
      - `steps`: whether step() updates anything (a rerun without an optimizer ends at the gradients);
      - `calls`: what its backward and its update call, as an error names them;
      - `state()`: the weights and optimizer state, `gradients()`: the gradients, as ScanInputs named as the
        Monitor names them (NOTE: [tensor names]);
      - `step(gradients_ok)`: the update; True where the engine skipped it as expected (a loss scale's overflow)."""

    scales_loss: bool
    steps: bool
    calls: tuple[str, str]

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor, *, last: bool) -> None: ...

    def state(self) -> list: ...

    def gradients(self) -> list: ...

    def clip(self, max_norm: float) -> None: ...

    def step(self, gradients_ok: bool) -> bool: ...


class TorchDriver:
    """The plain loop's step (NOTE: [step driver]): loss.backward(), clip_grad_norm_ and optimizer.step(), under
    torch's GradScaler at `grad_scale` where the run had one (NOTE: [replayed scaling])."""

    scales_loss = False
    calls = ("loss.backward()", "optimizer.step()")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, grad_scale: float | None):
        self.model, self.optimizer, self.grad_scale = model, optimizer, grad_scale
        self.steps = optimizer is not None
        self.scaler = torch.amp.GradScaler(model_device(model).type, init_scale=grad_scale) \
            if grad_scale is not None else None
        # a sharded model's tensors as this rank holds them (FSDP2, TP: its shards; the in-process diagnosis under a
        # process group, NOTE: [in-process diagnosis])
        self.shard = local_shard if has_dtensors(model) else whole_tensor

    def zero_grad(self) -> None:
        (self.optimizer or self.model).zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def state(self) -> list:
        return [i for i in model_inputs(self.model, self.optimizer, shard=self.shard)
                if not is_kind(i.name, "gradient")]

    def gradients(self) -> list:
        """The gradients unscaled as the loop's scaler.unscale_(optimizer) does; without an optimizer (a step that
        ends at its gradients), each divided by the scale."""
        if self.scaler is not None and self.optimizer is not None:
            self.scaler.unscale_(self.optimizer)
        elif self.scaler is not None:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.grad_scale)
        return [i for i in model_inputs(self.model, shard=self.shard) if is_kind(i.name, "gradient")]

    def clip(self, max_norm: float) -> None:
        clip_grad_norm(list(self.model.parameters()), max_norm)

    def step(self, gradients_ok: bool) -> bool:
        """The GradScaler skips an update whose unscaled gradients are not finite."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            return not gradients_ok
        self.optimizer.step()
        return False


def observed_loss_scale(passed: float | None, returned: float) -> float | None:
    """The loop's loss scaling seen on one micro-batch (NOTE: [observed loop] in nanscan/runtime/loop_effects.py):
    the loss it passed over the loss step_fn returns, from the same state and batch; 1/k for an integer k when it is
    that to 1e-4 (a mean over k micro-batches), else the ratio itself; None when either is 0 or not finite."""
    if passed is None or not (math.isfinite(passed) and math.isfinite(returned)) or passed == 0 or returned == 0:
        return None
    ratio = passed / returned
    k = round(1.0 / ratio) if ratio > 0 else 0
    if k >= 1 and math.isclose(ratio, 1.0 / k, rel_tol=1e-4):
        return 1.0 / k
    return ratio


def owner_of(names: Sequence[str]) -> str:
    """The module of the first named tensor ("param:blocks.0.attn.qkv.weight" -> "blocks.0.attn.qkv")."""
    return owner_module(names[0]) if names else ""


def run_localized(attempt: Callable[[bool], StepOutcome]) -> StepOutcome:
    """`attempt(backward_module_hooks)` with full backward hooks, and once more without them if the step raised.

    Full backward hooks refuse modules that change their input or output in place (nn.ReLU(inplace=True)); the
    second attempt still localizes the forward pass and the parameter gradients. `attempt` must start each time
    from the same state.
    """
    result = attempt(True)
    if result.error is None:
        return result
    retry = attempt(False)
    if retry.error is not None:
        return result
    retry.notes.append(f"module backward hooks could not be used ({result.error}); backward localization "
                       "watched parameter gradients only")
    return retry
