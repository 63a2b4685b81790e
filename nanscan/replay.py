"""Replay a bundle's failing step: reproduce it deterministically, tell a persistent failure from a transient one,
localize the first module that produced a non-finite value, bisect the batch to the fewest samples that still
fail, and export those samples as a regression case (`nanscan replay`, `nanscan export-regression`).

Everything here runs the user's step again through the bundle's replay entry (nanscan.entry). Hooks are attached
to the rebuilt model only for the duration of one replayed step: the every-step path (Monitor.check) never sees
them.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import click
import numpy as np
import torch

from nanscan import _layout as L
from nanscan.bundle import Bundle, BundleError, iter_batch_tensors, json_float, load_bundle, plain_json
from nanscan.entry import EntryError, ReplaySpec, build_spec
from nanscan.provenance import restore_rng
from nanscan.scan import model_inputs, scan, scan_inputs
from nanscan.stats import ScanReport

REPLAY_FINDING = "replay"
DEFAULT_RUNS = 3  # the reproduction and two more, to tell persistent from transient
MAX_BISECT_TRIALS = 64

# Bundle categories (nanscan.monitor.CATEGORIES) plus "update": non-finite only after optimizer.step(), which the
# Monitor sees one step later as a non-finite parameter or optimizer state.
STEP_CATEGORIES = ("input", "parameter", "optimizer_state", "loss", "gradient", "update")

PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class ReplayError(RuntimeError):
    """A bundle that cannot be replayed (no replay entry, no batch, a model that does not match the state)."""


# ---------------------------------------------------------------------------------------------------------------
# What a set of tensors holds, summarised with nanscan's own scan
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ValueSummary:
    """Non-finite counts and the abs range of the finite values of some tensors (a module's inputs, a gradient)."""

    tensors: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    absmin: float | None = None  # smallest finite non-zero |x|, None when there is none
    absmax: float | None = None  # largest finite |x|, None when there is no finite value
    dtypes: tuple[str, ...] = ()

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def inf(self) -> int:
        return self.posinf + self.neginf

    def to_dict(self) -> dict:
        return {"tensors": self.tensors, "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf,
                "absmin": json_float(self.absmin), "absmax": json_float(self.absmax), "dtypes": list(self.dtypes)}

    def describe(self) -> str:
        if not self.tensors:
            return "no floating-point tensors"
        bad = ", ".join(f"{n} {kind}" for n, kind in ((self.nan, "NaN"), (self.posinf, "+inf"),
                                                      (self.neginf, "-inf")) if n)
        span = (f"|x| in [{_fmt(self.absmin)}, {_fmt(self.absmax)}]" if self.absmax is not None
                else "no finite values")
        return f"{'finite' if not bad else bad}; {span} ({'/'.join(self.dtypes)})"


def summarize_values(values: Any) -> ValueSummary:
    """ValueSummary of every floating-point tensor inside `values` (tensors, nested tuples, lists and dicts)."""
    tensors = [t for _, t in iter_batch_tensors(values)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not t.is_meta]
    if not tensors:
        return ValueSummary()
    return _summary_of(scan(tensors), tuple(dict.fromkeys(str(t.dtype).removeprefix("torch.") for t in tensors)))


def _summary_of(report: ScanReport, dtypes: tuple[str, ...] = ()) -> ValueSummary:
    totals = report.totals
    nonzero = [s.absmin for s in report.stats if s.absmin > 0]
    finite = totals.finite > 0
    return ValueSummary(len(report), totals.nan, totals.posinf, totals.neginf,
                        min(nonzero) if nonzero else None, totals.absmax if finite else None,
                        dtypes or tuple(dict.fromkeys(t.dtype for t in report.tensors)))


def _creates_nonfinite(received: ValueSummary, produced: ValueSummary) -> bool:
    """True when `produced` holds a kind of non-finite value that `received` did not explain.

    A NaN is new when nothing received was NaN (a fully masked softmax row turns -inf into NaN: the -inf came in,
    the NaN was made here); an infinity is new when everything received was finite.
    """
    return (produced.nan > 0 and received.nan == 0) or (produced.inf > 0 and received.nonfinite == 0)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


# ---------------------------------------------------------------------------------------------------------------
# Localization: hooks on every module for one replayed step
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Localization:
    """Where non-finite values first appeared in a replayed step.

    phase: "forward" or "backward" (a module), "input" (the batch), "state" (the saved weights or optimizer state),
    "loss" (computed in step_fn outside any module), "update" (optimizer.step()).
    module: the module's qualified name ("" is the model itself), or "batch", "step_fn", the optimizer's class.
    received: what the module received (inputs in forward, output gradients in backward).
    produced: what it produced (outputs, or input / parameter gradients).
    """

    phase: str
    module: str
    module_type: str
    received: ValueSummary
    produced: ValueSummary
    detail: str = ""
    parameters: ValueSummary | None = None  # the module's own parameters (forward phase)

    @property
    def label(self) -> str:
        return self.module or "(model)"

    def describe(self) -> str:
        where = f"{self.label} ({self.module_type}), {self.phase}"
        extra = f" [{self.detail}]" if self.detail else ""
        parts = [f"received {self.received.describe()}"] if self.received.tensors else []
        if self.parameters is not None and self.parameters.tensors:
            parts.append(f"its parameters: {self.parameters.describe()}")
        parts.append(f"produced {self.produced.describe()}")
        return f"{where}{extra}: {'; '.join(parts)}"

    def to_dict(self) -> dict:
        return {"phase": self.phase, "module": self.module, "module_type": self.module_type, "label": self.label,
                "detail": self.detail, "received": self.received.to_dict(), "produced": self.produced.to_dict(),
                "parameters": self.parameters.to_dict() if self.parameters else None}


class _Localizer:
    """Forward pre/post hooks, full backward pre/post hooks and parameter gradient hooks on every module; keeps the
    first module, in execution order, that created a non-finite value from values that did not explain it.

    `backward_modules=False` leaves out the full backward hooks, which wrap module inputs and outputs and so
    refuse modules that modify their input or output in place; parameter gradients are still watched.
    """

    def __init__(self, model: torch.nn.Module, *, backward_modules: bool = True):
        self.model = model
        self.backward_modules = backward_modules
        self.first_forward: Localization | None = None
        self.first_backward: Localization | None = None
        self._inputs: dict[str, list[ValueSummary]] = {}
        self._grad_out: dict[str, ValueSummary] = {}
        self._handles: list[Any] = []
        self._modules = dict(model.named_modules())

    def __enter__(self) -> "_Localizer":
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_forward(name), with_kwargs=True))
            if self.backward_modules:
                self._handles.append(module.register_full_backward_pre_hook(self._pre_backward(name)))
                self._handles.append(module.register_full_backward_hook(self._post_backward(name)))
        for pname, param in self.model.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._param_grad(pname)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _type(self, name: str) -> str:
        return type(self._modules[name]).__name__

    def _pre_forward(self, name: str):
        def hook(module, args, kwargs):
            if self.first_forward is None:
                # a stack: a module may run again inside its own forward (recursion, weight sharing)
                self._inputs.setdefault(name, []).append(summarize_values((args, kwargs)))
        return hook

    def _post_forward(self, name: str):
        def hook(module, args, kwargs, output):
            stack = self._inputs.get(name)
            if self.first_forward is not None or not stack:
                return
            received = stack.pop()
            produced = summarize_values(output)
            if _creates_nonfinite(received, produced):
                weights = summarize_values(list(module.parameters(recurse=False)))
                self.first_forward = Localization("forward", name, self._type(name), received, produced, "output",
                                                  weights)
        return hook

    def _pre_backward(self, name: str):
        def hook(module, grad_output):
            received = summarize_values(grad_output)
            self._grad_out[name] = received
            if self.first_backward is None and received.nonfinite:
                # No hooked module made it, yet the gradient reaching this module's output is non-finite: it was
                # made by code that consumed that output without being a module (a torch.sqrt in the parent's
                # forward, or the loss in step_fn), which ran its backward just before.
                self.first_backward = self._made_by_code_above(name, received)
        return hook

    def _made_by_code_above(self, name: str, reached: ValueSummary) -> Localization:
        if not name:
            return Localization("backward", "step_fn", "code outside any module", ValueSummary(), reached,
                                "the gradient of the model's output was already non-finite: step_fn's own code "
                                "(the loss) made it")
        parent = name.rpartition(".")[0]
        child = name.rpartition(".")[2]
        return Localization("backward", parent, self._type(parent), self._grad_out.get(parent, ValueSummary()),
                            reached, f"in its own code, not in a submodule: the gradient it passed back to {child} "
                                     "was already non-finite")

    def _post_backward(self, name: str):
        def hook(module, grad_input, grad_output):
            if self.first_backward is not None:
                return
            received = self._grad_out.get(name) or summarize_values(grad_output)
            produced = summarize_values(grad_input)
            if _creates_nonfinite(received, produced):
                self.first_backward = Localization("backward", name, self._type(name), received, produced,
                                                   "gradient of its inputs")
        return hook

    def _param_grad(self, pname: str):
        owner, _, leaf = pname.rpartition(".")

        def hook(grad):
            if self.first_backward is not None:
                return None
            # The module whose forward used the parameter: its owner, or the nearest enclosing module that has
            # received an output gradient (a parameter read directly by a parent's code, e.g. pos_emb.weight[:T]).
            module = owner
            while module not in self._grad_out and module:
                module = module.rpartition(".")[0]
            received = self._grad_out.get(module, ValueSummary())
            produced = summarize_values(grad)
            if _creates_nonfinite(received, produced):
                detail = f"gradient of parameter {pname}" if module != owner else f"gradient of parameter {leaf}"
                if module not in self._grad_out:
                    detail += "; the output gradient it received was not observed (module backward hooks off)"
                self.first_backward = Localization("backward", module, self._type(module), received, produced,
                                                   detail)
            return None
        return hook


# ---------------------------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepOptions:
    """How a replayed step differs from the recorded one (the ablation factors), all off by default.

    lr_scale: multiplies every param group's learning rate. precision: None (as recorded), "float32" (weights and
    batch in float32, autocast off), "bfloat16" or "float16" (float32 weights, torch.autocast to that dtype).
    clip_grad_norm: clip the total gradient norm before optimizer.step(). deterministic: torch's deterministic
    algorithms (warn-only where an operation has none) and deterministic cuDNN.
    """

    lr_scale: float = 1.0
    precision: str | None = None
    clip_grad_norm: float | None = None
    deterministic: bool = False

    def __post_init__(self):
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: use one of {', '.join(PRECISIONS)} or None")

    def to_dict(self) -> dict:
        return {"lr_scale": self.lr_scale, "precision": self.precision, "clip_grad_norm": self.clip_grad_norm,
                "deterministic": self.deterministic}


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
                "error": self.error, "notes": list(self.notes)}

    def describe(self) -> str:
        if self.error:
            return f"error: {self.error}"
        if self.finite:
            return f"finite (loss {_fmt(self.loss)})"
        where = f"; first in {self.localization.describe()}" if self.localization else ""
        return f"non-finite ({self.category}: {', '.join(self.nonfinite[:3])}" \
               f"{' ...' if len(self.nonfinite) > 3 else ''}){where}"


def _model_device(model: torch.nn.Module) -> torch.device:
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


def _autocast_context(options: StepOptions, device_type: str):
    if options.precision is None:
        return contextlib.nullcontext()
    dtype = PRECISIONS[options.precision]
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


def _top_exponent(report: ScanReport) -> int | None:
    if not len(report):
        return None
    occupied = np.flatnonzero(report.totals.exp_hist)
    return int(occupied[-1]) + L.MIN_BIN_EXPONENT if len(occupied) else None


def _param_dtypes(model: torch.nn.Module) -> list[str]:
    return list(dict.fromkeys(str(p.dtype).removeprefix("torch.") for p in model.parameters()))


def _owner_of(names: Sequence[str]) -> str:
    """The module of the first named tensor ("param:blocks.0.attn.qkv.weight" -> "blocks.0.attn.qkv")."""
    if not names:
        return ""
    body = names[0].partition(":")[2]
    if names[0].startswith("optim:"):
        body = body.rpartition(".")[0]
    return body.rpartition(".")[0]


def run_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step_fn: Callable, batch: Any, *,
             options: StepOptions = StepOptions(), localize: bool = False,
             backward_module_hooks: bool = True) -> StepOutcome:
    """Run one training step (forward through step_fn, backward, optional clipping, optimizer.step()) and scan
    the batch, the starting state, the loss, the gradients and the updated state.

    The caller has loaded the state and moved the batch to the model's device. Without an optimizer the step ends
    after the gradients. `localize` adds the hooks of _Localizer for this step only. Exceptions raised by the
    step become `outcome.error`; nothing is raised for a non-finite step.
    """
    device_type = _model_device(model).type
    notes: list[str] = []
    seen_autocast: list[str | None] = []

    def record_autocast(module, args):
        if not seen_autocast:
            enabled = torch.is_autocast_enabled(device_type)
            seen_autocast.append(str(torch.get_autocast_dtype(device_type)).removeprefix("torch.") if enabled
                                 else None)

    def outcome(category, nonfinite, loss_value=None, grads=None, error=None, localization=None):
        return StepOutcome(
            finite=category is None and error is None, category=category, loss=loss_value, nonfinite=nonfinite,
            grad_norm=float(np.sqrt(grads.totals.sumsq)) if grads is not None and len(grads) else None,
            grad_max_exponent=_top_exponent(grads) if grads is not None else None,
            autocast=seen_autocast[0] if seen_autocast else None, param_dtypes=_param_dtypes(model),
            localization=localization, error=error, notes=notes)

    localizer = _Localizer(model, backward_modules=backward_module_hooks) if localize else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(deterministic_algorithms(options.deterministic))
        stack.enter_context(warnings.catch_warnings())
        # a module whose inputs need no gradient (the first layer) fires its full backward hook early: expected
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        stack.callback(model.register_forward_pre_hook(record_autocast).remove)
        if localizer is not None:
            stack.enter_context(localizer)

        model.train()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        batch_report = scan([(f"input:{path}", t) for path, t in iter_batch_tensors(batch)])
        state_report = scan_inputs(model_inputs(model, optimizer))
        if not state_report.ok:
            bad = state_report.nonfinite
            category = "parameter" if any(n.startswith("param:") for n in bad) else "optimizer_state"
            notes.append("the starting state is already non-finite: an earlier step (or an outside write) did "
                         "the damage, and this step cannot show where")
            where = _owner_of([n for n in bad if n.startswith("param:")] or bad)
            owner = dict(model.named_modules()).get(where, model)
            loc = Localization("state", where, type(owner).__name__, ValueSummary(), _summary_of(state_report),
                               f"{category}: {len(bad)} non-finite tensor(s), first {bad[0]}")
            return outcome(category, batch_report.nonfinite + bad, localization=loc)

        try:
            with _autocast_context(options, device_type):
                loss = step_fn(model, batch)
        except Exception as exc:  # noqa: BLE001 - the user's step failing is a result to report
            return outcome("loss", [], error=f"step_fn raised {type(exc).__name__}: {exc}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
            return outcome("loss", [], error=f"step_fn returned {what}; it must return the scalar loss tensor")
        loss_value = float(loss.detach().float())
        loss_ok = math.isfinite(loss_value)
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            return outcome("loss", [], loss_value, error=f"loss.backward() raised {type(exc).__name__}: {exc}")
        if options.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                           options.clip_grad_norm)
        grads = scan_inputs([i for i in model_inputs(model) if i.name.startswith("grad:")])
        update_report = None
        if optimizer is not None:
            try:
                optimizer.step()
            except Exception as exc:  # noqa: BLE001 - as for step_fn: the user's optimizer failing is a result
                return outcome("update", [], loss_value, grads, error=f"optimizer.step() raised "
                                                                      f"{type(exc).__name__}: {exc}")
            update_report = scan_inputs([i for i in model_inputs(model, optimizer)
                                         if not i.name.startswith("grad:")])

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
    localization = None
    if localizer is not None and category is not None:
        localization = _first_bad(localizer, category, batch_report, loss_value, grads, update_report, optimizer)
    return outcome(category, nonfinite, loss_value, grads, localization=localization)


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


def _first_bad(localizer: _Localizer, category: str, batch_report: ScanReport, loss_value: float,
               grads: ScanReport, update_report: ScanReport | None, optimizer) -> Localization:
    """The earliest place, in the order the step ran, where non-finite values appeared."""
    if not batch_report.ok:  # before any module ran
        bad = batch_report.nonfinite
        return Localization("input", "batch", "batch", ValueSummary(), _summary_of(batch_report),
                            f"non-finite in {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}")
    if localizer.first_forward is not None:
        return localizer.first_forward
    if not math.isfinite(loss_value):
        return Localization("loss", "step_fn", "code outside any module", ValueSummary(),
                            summarize_values(torch.tensor(loss_value)),
                            "every module's output was finite; the loss is computed in step_fn's own code")
    if localizer.first_backward is not None:
        return localizer.first_backward
    if not grads.ok:
        return Localization("backward", "step_fn", "code outside any module", ValueSummary(), _summary_of(grads),
                            "no module's backward created it: the gradient came from step_fn's own code "
                            "(or from a module whose backward hooks could not be attached)")
    received = _summary_of(grads)
    produced = _summary_of(update_report) if update_report is not None else ValueSummary()
    return Localization("update", type(optimizer).__name__, "optimizer", received, produced,
                        "gradients were finite; optimizer.step() produced the non-finite values")


# ---------------------------------------------------------------------------------------------------------------
# Batches: sample selection and moving to the model
# ---------------------------------------------------------------------------------------------------------------

def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with fn applied to every tensor inside nested dicts, lists and tuples (other leaves kept)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return type(value)({k: map_tensors(v, fn) for k, v in value.items()}) if type(value) is not dict \
            else {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def batch_size(batch: Any) -> int | None:
    """The number of samples: the leading size most tensors of the batch share (None for a batch of scalars)."""
    sizes = [t.shape[0] for _, t in iter_batch_tensors(batch) if t.dim() > 0]
    if not sizes:
        return None
    return max(set(sizes), key=sizes.count)


def select_samples(batch: Any, indices: Sequence[int], spec: ReplaySpec | None = None) -> Any:
    """The batch restricted to the given sample rows: spec.select_samples when the entry gives one, else every
    tensor whose leading dimension is the batch size is indexed along dimension 0 (other tensors kept whole)."""
    indices = [int(i) for i in indices]
    if spec is not None and spec.select_samples is not None:
        try:
            return spec.select_samples(batch, indices)
        except Exception as exc:  # noqa: BLE001 - the user's function: name it, not a line deep inside it
            shown = f"{indices[:8]}{' ...' if len(indices) > 8 else ''}"
            raise ReplayError(f"ReplaySpec.select_samples raised {type(exc).__name__}: {exc} (selecting rows "
                              f"{shown}); fix it in the replay entry") from exc
    size = batch_size(batch)
    if size is None:
        raise ReplayError("the batch has no tensor with a sample dimension, so samples cannot be selected; give "
                          "the replay entry a ReplaySpec.select_samples")

    def pick(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != size:
            return t
        return t.index_select(0, torch.tensor(indices, dtype=torch.long, device=t.device))

    return map_tensors(batch, pick)


def _prepare_batch(batch: Any, device: torch.device, options: StepOptions) -> Any:
    def convert(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        if options.precision is not None and t.dtype in _HALF_DTYPES:
            t = t.float()  # the precision rows start from float32 data; autocast does the rest
        return t

    return map_tensors(batch, convert)


def _sample_ids(ids: Any, indices: Sequence[int], size: int | None) -> list | None:
    if isinstance(ids, (list, tuple)) and size is not None and len(ids) == size:
        return [ids[i] for i in indices]
    return None


# ---------------------------------------------------------------------------------------------------------------
# Replaying a bundle
# ---------------------------------------------------------------------------------------------------------------

def open_bundle(bundle: Bundle | str | os.PathLike) -> Bundle:
    return bundle if isinstance(bundle, Bundle) else load_bundle(bundle)


class Replayer:
    """Runs a bundle's failing step again, as often as needed, each time from the bundle's state and RNG states.

    The replay entry is called for every run, so each run starts from a freshly built model and optimizer with
    nothing carried over from an earlier run (a precision change, a hook, optimizer state).
    """

    def __init__(self, bundle: Bundle | str | os.PathLike, entry: str | None = None):
        self.bundle = open_bundle(bundle)
        self.entry = entry or self.bundle.replay_entry
        where = self.bundle.path
        if not self.entry:
            raise ReplayError(f"{where} records no replay entry: pass one with --entry package.module:function "
                              "(a function taking the config dict and returning a nanscan.entry.ReplaySpec), or "
                              "give replay_entry= to the Monitor")
        self.batch = self.bundle.batch(nested=True)
        if self.batch is None:
            raise ReplayError(f"{where} holds no batch (check() was called without batch=), so the step cannot be "
                              "replayed; pass the batch to Monitor.check")
        info = self.bundle.manifest["state"]
        self.notes: list[str] = []
        if info.get("file"):
            if self.bundle.manifest.get("distributed"):
                from nanscan.distributed import require_full_state  # noqa: PLC0415

                require_full_state(self.bundle)  # one rank's FSDP shards alone do not fit the model
            self.model_state, self.optimizer_state = self.bundle.state()
            self.pre_step = bool(info.get("pre_step"))
            if not self.pre_step:
                self.notes.append("state: the bundle holds the state at the failing step's check (no pre-step "
                                  f"snapshot): {info.get('note') or 'buffers may already include this batch'}")
        else:
            self.model_state, self.optimizer_state, self.pre_step = None, None, False
            self.notes.append("state: the bundle holds no model state; the step runs on the freshly built model "
                              "from the replay entry, which may not be the weights that failed")
        if info.get("file") and self.optimizer_state is None:
            self.notes.append("optimizer: the bundle holds no optimizer state; the step uses a fresh optimizer")
        self.rng = self.bundle.rng_state()
        rng_at = self.bundle.manifest["rng"].get("captured_at")
        if self.rng is None:
            self.notes.append("rng: no RNG state recorded; every replay seeds the generators with 0, so random draws "
                              "(dropout) are the same on each replay but differ from the original step")
        elif rng_at != "step_start":
            self.notes.append(f"rng: recorded at {rng_at or 'an unknown time'}, not at the start of the step; random "
                              "draws in the forward pass (dropout) may differ from the original step")
        # What the replay cannot rebuild exactly: a failure that does not come back may depend on it.
        self.inexact = [text for text in (
            "no model state" if self.model_state is None else "",
            "the state at the check, not a pre-step snapshot" if self.model_state is not None and not self.pre_step
            else "",
            "no optimizer state" if self.model_state is not None and self.optimizer_state is None else "",
            "no RNG state" if self.rng is None else "",
            "RNG states not from the start of the step" if self.rng is not None and rng_at != "step_start" else "",
        ) if text]
        self.sample_count = batch_size(self.batch)
        self._rng_warned = False

    @property
    def state_description(self) -> str:
        if self.model_state is None:
            return "none (freshly built model)"
        return "pre-step snapshot" if self.pre_step else "at the failing step"

    def build(self) -> ReplaySpec:
        try:
            return build_spec(self.entry, self.bundle.config)
        except EntryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user entry failing deserves its name in the message
            raise ReplayError(f"replay entry {self.entry!r} raised {type(exc).__name__}: {exc}") from exc

    def _restore_rng(self) -> None:
        if self.rng is None:
            # Not the original draws, but the same ones on every replay: otherwise each run draws other dropout
            # masks and the verdict (and the bisection) would depend on where the process's generators happen to be.
            torch.manual_seed(0)
            np.random.seed(0)
            random.seed(0)
            return
        try:
            restore_rng(self.rng)
        except RuntimeError as exc:  # recorded on a GPU, replayed without one
            restore_rng({**self.rng, "torch_cuda": []})
            if not self._rng_warned:
                self.notes.append(f"rng: CUDA generator states not restored ({exc})")
                self._rng_warned = True

    def prepare(self, options: StepOptions = StepOptions(), *, samples: Sequence[int] | None = None,
                batch: Any = None) -> tuple[ReplaySpec, torch.optim.Optimizer, Any]:
        """A fresh (spec, optimizer, batch) with the bundle's state loaded and `options` applied; RNGs restored."""
        spec = self.build()
        model = spec.model
        if options.precision is not None:
            for t in [*model.parameters(), *model.buffers()]:
                if t.dtype in _HALF_DTYPES:
                    t.data = t.data.float()
        if self.model_state is not None:
            try:
                model.load_state_dict(self.model_state)
            except RuntimeError as exc:
                raise ReplayError(f"the model built by {self.entry!r} does not match the state stored in "
                                  f"{self.bundle.path}: {exc}; use the entry (and config) of the run that wrote the "
                                  "bundle") from None
        try:
            optimizer = spec.make_optimizer()
        except EntryError:
            raise
        except Exception as exc:  # noqa: BLE001 - as in build(): the user's factory failing is named as such
            raise ReplayError(f"the optimizer factory of replay entry {self.entry!r} raised {type(exc).__name__}: "
                              f"{exc}") from exc
        if self.optimizer_state is not None:
            try:
                # a deep copy: load_state_dict may keep our tensors, and optimizer.step() updates them in place
                optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
            except (ValueError, KeyError, RuntimeError) as exc:
                raise ReplayError(f"the optimizer built by {self.entry!r} does not match the optimizer state in "
                                  f"{self.bundle.path}: {exc}") from None
        if options.lr_scale != 1.0:
            for group in optimizer.param_groups:
                if "lr" in group:  # an optimizer without a learning rate: run() says the factor was not in effect
                    group["lr"] = group["lr"] * options.lr_scale
        step_batch = self.batch if batch is None else batch
        if samples is not None:
            step_batch = select_samples(step_batch, samples, spec)
        step_batch = _prepare_batch(step_batch, _model_device(model), options)
        self._restore_rng()
        return spec, optimizer, step_batch

    def run(self, options: StepOptions = StepOptions(), *, samples: Sequence[int] | None = None, batch: Any = None,
            localize: bool = False) -> StepOutcome:
        """Replay the step once (on `samples` of the saved batch, or on another `batch`) and return its outcome."""
        learning_rates: list[Any] = []

        def attempt(backward_module_hooks: bool) -> StepOutcome:
            spec, optimizer, step_batch = self.prepare(options, samples=samples, batch=batch)
            learning_rates[:] = [group.get("lr") for group in optimizer.param_groups]
            return run_step(spec.model, optimizer, spec.step_fn, step_batch, options=options, localize=localize,
                            backward_module_hooks=backward_module_hooks)

        result = run_localized(attempt) if localize else attempt(True)
        if options.lr_scale != 1.0 and not any(lr for lr in learning_rates if lr is not None):
            result.notes.append(f"learning rate x{options.lr_scale:g} was not in effect: the optimizer's param groups "
                                "have no non-zero 'lr' to scale")
        requested = options.precision
        if requested is not None and result.error is None:
            wanted = PRECISIONS[requested]
            got = result.autocast
            expected = None if wanted is None else str(wanted).removeprefix("torch.")
            if got != expected:
                result.notes.append(f"precision {requested} was not in effect: step_fn sets its own autocast "
                                    f"({got or 'off'}), which overrides the replay's")
        return result


# ---------------------------------------------------------------------------------------------------------------
# Bisection to the fewest failing samples
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class BisectResult:
    """The smallest set of sample rows found that still fails, or why the batch could not be bisected.

    minimal: the step was replayed without each one of them in turn and was finite every time (1-minimal). False
    when that was not shown: the trial budget ran out, or some of those smaller subsets raised an error instead
    of running (`errors`; a batch of one sample in BatchNorm, a step that needs a fixed batch size).
    """

    applicable: bool
    indices: list[int] = field(default_factory=list)
    sample_ids: list | None = None
    batch_size: int | None = None
    trials: int = 0
    reason: str = ""
    minimal: bool = True
    errors: list[str] = field(default_factory=list)

    @property
    def says_more(self) -> bool:
        """True when describe() qualifies a plain "these samples fail": not minimal, or the whole batch."""
        return self.applicable and (not self.minimal or len(self.indices) == self.batch_size)

    def describe(self) -> str:
        """One sentence on how far the bisection got (the samples themselves are shown by the caller)."""
        if not self.applicable:
            return f"bisection not done: {self.reason}"
        if self.minimal and len(self.indices) == self.batch_size:
            return (f"no smaller subset fails: the failure needs all {self.batch_size} samples together (a batch "
                    f"statistic, such as BatchNorm's or a sum over the batch), not particular ones ({self.trials} "
                    "trials)")
        if self.minimal:
            return (f"{len(self.indices)} of {self.batch_size} samples fail together; without any one of them the "
                    f"step is finite ({self.trials} trials)")
        why = (f"subsets of them raised an error instead of running ({self.errors[0]})" if self.errors
               else "the trial budget ran out before every smaller subset was tried")
        return (f"{len(self.indices)} of {self.batch_size} samples still fail; not shown to be the fewest: {why} "
                f"({self.trials} trials)")

    def to_dict(self) -> dict:
        return {"applicable": self.applicable, "indices": list(self.indices), "sample_ids": self.sample_ids,
                "batch_size": self.batch_size, "trials": self.trials, "reason": self.reason,
                "minimal": self.minimal, "errors": list(self.errors)}


def ddmin(items: Sequence[int], fails: Callable[[list[int]], bool], *, max_trials: int = MAX_BISECT_TRIALS,
          tested: dict[frozenset, bool] | None = None) -> tuple[list[int], int]:
    """Delta debugging (Zeller's ddmin): a 1-minimal failing subset of `items`, which must fail as a whole.

    Starts by halving (one failing sample in 16 takes about 8 trials); when no half fails alone, tests finer
    chunks and their complements, which finds failures that need several samples together.
    Returns (subset, trials used); stops early with the smallest set so far after max_trials. `tested`, when
    given, receives every subset tried and whether it failed (a subset missing from it was never tried).
    """
    cache: dict[frozenset, bool] = {} if tested is None else tested
    trials = 0

    def test(subset: list[int]) -> bool:
        nonlocal trials
        key = frozenset(subset)
        if key not in cache:
            if trials >= max_trials:
                return False
            trials += 1
            cache[key] = fails(subset)
        return cache[key]

    current, n = list(items), 2
    while len(current) >= 2:
        size = len(current)
        bounds = [round(i * size / n) for i in range(n + 1)]
        chunks = [current[bounds[i]:bounds[i + 1]] for i in range(n) if bounds[i] < bounds[i + 1]]
        reduced = False
        for chunk in chunks:
            if test(chunk):
                current, n, reduced = chunk, 2, True
                break
        if not reduced and n > 2:
            for chunk in chunks:
                complement = [x for x in current if x not in chunk]
                if test(complement):
                    current, n, reduced = complement, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= size or trials >= max_trials:
                break
            n = min(size, 2 * n)
    return current, trials


def bisect_samples(replayer: Replayer, options: StepOptions = StepOptions(deterministic=True), *,
                   max_trials: int = MAX_BISECT_TRIALS) -> BisectResult:
    """The fewest samples of the saved batch on which the replayed step is still non-finite.

    A subset on which the step raises an error (BatchNorm given one sample, a step that needs a fixed batch size)
    has not been shown to fail: it counts as not failing, and the result says it is not shown to be minimal.
    """
    size = replayer.sample_count
    if size is None:
        return BisectResult(False, reason="the batch has no tensor with a sample dimension")
    if size < 2:
        return BisectResult(False, batch_size=size, reason="the batch has fewer than 2 samples")
    everything = list(range(size))
    whole = replayer.run(options, samples=everything)
    if whole.error is not None:
        return BisectResult(False, batch_size=size, trials=1, reason=f"the replayed step raised an error "
                                                                     f"({whole.error})", errors=[whole.error])
    if whole.finite:
        return BisectResult(False, batch_size=size, trials=1,
                            reason="the step is finite when replayed, so there is nothing to narrow down")
    errors: dict[str, None] = {}
    errored: set[frozenset] = set()

    def fails(subset: list[int]) -> bool:
        outcome = replayer.run(options, samples=subset)
        if outcome.error is not None:
            errors[outcome.error] = None
            errored.add(frozenset(subset))
            return False
        return not outcome.finite

    tested: dict[frozenset, bool] = {}
    indices, trials = ddmin(everything, fails, max_trials=max_trials, tested=tested)
    kept = frozenset(indices)
    # 1-minimal only when the step ran, and was finite, without each one of them in turn
    without_one = [kept - {i} for i in kept] if len(kept) > 1 else []
    minimal = all(key in tested and key not in errored for key in without_one)
    ids = _sample_ids(replayer.bundle.sample_ids, indices, size)
    return BisectResult(True, sorted(indices), ids, size, trials + 1, minimal=minimal,
                        errors=list(errors)[:3])


# ---------------------------------------------------------------------------------------------------------------
# `replay`: reproduce, classify, localize, bisect, record
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class ReplayResult:
    bundle: str
    run_id: str
    step: int
    bundle_category: str
    entry: str
    state: str  # "pre-step snapshot", "at the failing step" or "none (freshly built model)"
    reproduced: bool
    verdict: str  # "persistent", "transient" or "intermittent"
    runs: list[StepOutcome]
    localization: Localization | None
    bisect: BisectResult | None
    notes: list[str] = field(default_factory=list)
    inexact: list[str] = field(default_factory=list)  # what the replay could not rebuild (Replayer.inexact)

    @property
    def failing_run(self) -> StepOutcome | None:
        """The first replay that went non-finite, None when none did."""
        return next((r for r in self.runs if not r.finite and r.error is None), None)

    @property
    def same_category(self) -> bool:
        failing = self.failing_run
        return failing is not None and failing.category == self.bundle_category

    def to_dict(self) -> dict:
        return {"bundle": self.bundle, "run_id": self.run_id, "step": self.step,
                "bundle_category": self.bundle_category, "entry": self.entry, "state": self.state,
                "reproduced": self.reproduced, "verdict": self.verdict, "same_category": self.same_category,
                "runs": [r.to_dict() for r in self.runs],
                "localization": self.localization.to_dict() if self.localization else None,
                "bisect": self.bisect.to_dict() if self.bisect else None, "notes": list(self.notes),
                "inexact": list(self.inexact)}

    def headline(self) -> str:
        failing = self.failing_run
        if failing is None:
            text = (f"not reproduced ({self.verdict}): the replayed step {self.step} is finite "
                    f"{len(self.runs)} time(s) out of {len(self.runs)}")
            if self.inexact:
                text += f", but from inexact conditions ({', '.join(self.inexact)})"
            return text
        where = f"; first bad: {self.localization.label} ({self.localization.module_type}, " \
                f"{self.localization.phase})" if self.localization else ""
        if self.verdict == "intermittent":
            bad = sum(1 for r in self.runs if not r.finite and r.error is None)
            return f"reproduced {bad} time(s) out of {len(self.runs)}, intermittent: {failing.category}{where}"
        return f"reproduced, {self.verdict}: {failing.category}{where}"

    def explanation(self) -> str:
        """What the verdict means, limited to what these replays can show."""
        if self.verdict == "transient" and self.inexact:
            return ("The failure did not come back, but the replay did not start from exactly the recorded "
                    f"conditions ({', '.join(self.inexact)}): a failure that depends on them can vanish on replay, "
                    "so this does not show a hardware fault or a race. A Monitor with snapshot='cpu' on the model "
                    "that the step runs keeps the state and RNG states of the start of the step, for an exact "
                    "replay.")
        return VERDICT_EXPLANATIONS[self.verdict]


VERDICT_EXPLANATIONS = {
    "persistent": "The same failure came back on every replay: the cause is in the code, the data or the state, "
                  "and the replay can be used to find it.",
    "transient": "The failure did not come back from the same state, batch and RNG states: this points at "
                 "hardware (a bad GPU or memory), a race, or non-determinism, not at the code or the data.",
    "intermittent": "The failure came back on some replays but not all (or differently): the step is not "
                    "deterministic here; look for races, atomics, or non-deterministic kernels.",
}


def _verdict(outcomes: Sequence[StepOutcome]) -> str:
    # a run that raised an error showed nothing about the failure, but differs from one that ran
    failing = [not o.finite and o.error is None for o in outcomes]
    if not any(failing):
        return "transient"
    if all(failing) and all(o.signature == outcomes[0].signature for o in outcomes):
        return "persistent"
    return "intermittent"


def replay(bundle: Bundle | str | os.PathLike, entry: str | None = None, *, runs: int = DEFAULT_RUNS,
           bisect: bool = True, progress: Callable[[str], None] | None = None) -> ReplayResult:
    """Replay the bundle's failing step `runs` times (deterministic algorithms on), classify the failure as
    persistent, transient or intermittent, localize the first bad module with hooks, and bisect the batch.

    `entry` overrides the bundle's replay entry. Nothing is written; see record_replay.
    """
    if runs < 1:
        raise ValueError(f"runs={runs}: replay at least once")
    say = progress or (lambda _msg: None)
    replayer = Replayer(bundle, entry)
    options = StepOptions(deterministic=True)
    outcomes = []
    for i in range(runs):
        say(f"replay {i + 1}/{runs}")
        outcomes.append(replayer.run(options))
        if i == 0 and outcomes[0].error is not None:
            # An error is not the failure being replayed: the entry does not run on this bundle's batch and state.
            raise ReplayError(f"the replayed step of {replayer.bundle.path} raised an error instead of running: "
                              f"{outcomes[0].error}; fix the replay entry {replayer.entry!r} (or pass --entry) so "
                              "that it runs the recorded batch")
    verdict = _verdict(outcomes)
    failing = next((o for o in outcomes if not o.finite and o.error is None), None)
    reproduced = failing is not None
    localization = None
    bisected = None
    if reproduced:
        say("localizing with module hooks")
        localized = replayer.run(options, localize=True)
        localization = localized.localization
        failing.notes.extend(n for n in localized.notes if n not in failing.notes)
        if bisect and verdict == "persistent":
            say("bisecting the batch")
            bisected = bisect_samples(replayer, options)
        elif bisect:
            bisected = BisectResult(False, batch_size=replayer.sample_count,
                                    reason=f"the failure is {verdict}, so a subset's result would not be reliable")
    notes = list(replayer.notes)
    if reproduced and failing.category != replayer.bundle.category:
        notes.append(f"the bundle's category is {replayer.bundle.category}, the replay first saw non-finite "
                     f"values as {failing.category}")
    return ReplayResult(str(replayer.bundle.path), replayer.bundle.manifest["run_id"], replayer.bundle.step,
                        replayer.bundle.category, replayer.entry, replayer.state_description, reproduced, verdict,
                        outcomes, localization, bisected, notes, list(replayer.inexact))


def localize(bundle: Bundle | str | os.PathLike, entry: str | None = None) -> Localization | None:
    """Only the localization: where the replayed step first went non-finite (None when it stays finite)."""
    return Replayer(bundle, entry).run(StepOptions(deterministic=True), localize=True).localization


def _replay_markdown(result: ReplayResult) -> str:
    lines = [result.explanation(), "",
             f"- replayed {len(result.runs)} times from the {result.state} state with `{result.entry}`, "
             "deterministic algorithms on",
             "- runs: " + "; ".join(("finite" if r.finite else "error" if r.error else f"non-finite ({r.category})")
                                     for r in result.runs)]
    first = result.failing_run
    if first is not None:
        lines.append(f"- loss {_fmt(first.loss)}, {len(first.nonfinite)} non-finite tensor(s)"
                     f"{', largest gradient exponent 2^' + str(first.grad_max_exponent) if first.grad_max_exponent is not None else ''}")
    if result.localization is not None:
        loc = result.localization
        lines += ["", f"**First bad module:** `{loc.label}` ({loc.module_type}), {loc.phase}"
                      f"{f' ({loc.detail})' if loc.detail else ''}.",
                  f"It received: {loc.received.describe()}.", f"It produced: {loc.produced.describe()}."]
    if result.bisect is not None:
        b = result.bisect
        if b.applicable:
            shown = b.sample_ids if b.sample_ids is not None else [f"row {i}" for i in b.indices]
            title = "Smallest failing subset" if b.minimal else "Fewest failing samples found"
            lines += ["", f"**{title}:** {len(b.indices)} of {b.batch_size} samples: "
                          f"{', '.join(f'`{s}`' for s in shown)} (rows {b.indices}; {b.trials} trials)."]
            if b.says_more:
                lines[-1] += f" {b.describe()[0].upper()}{b.describe()[1:]}."
        else:
            lines += ["", f"Bisection not done: {b.reason}."]
    if result.notes:
        lines += [""] + [f"- note: {n}" for n in result.notes]
    return "\n".join(lines)


def record_replay(result: ReplayResult, bundle: Bundle | None = None) -> bool:
    """Add the replay's finding to the bundle (ledger and INCIDENT.md), once: the same result again changes nothing.
    Returns True when the bundle changed."""
    target = bundle or load_bundle(result.bundle)
    title = f"Replay: {result.headline()}"
    return target.add_finding(REPLAY_FINDING, title, _replay_markdown(result), result.to_dict())


def recorded_replay(bundle: Bundle) -> dict | None:
    """The record of the bundle's replay finding, if replay has run on it."""
    for finding in bundle.findings():
        if finding.get("key") == REPLAY_FINDING:
            return finding.get("record")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Command-line output
# ---------------------------------------------------------------------------------------------------------------

def _print_replay(result: ReplayResult, console) -> None:
    from rich.markup import escape  # noqa: PLC0415 - errors, paths and module names are not markup
    from rich.table import Table  # noqa: PLC0415

    style = "green" if not result.reproduced else ("red" if result.verdict == "persistent" else "yellow")
    console.print(f"[bold]{escape(result.bundle)}[/bold] (run {result.run_id}, step {result.step}, "
                  f"category {result.bundle_category})")
    console.print(f"[{style}]{escape(result.headline())}[/{style}]", highlight=False)
    console.print(result.explanation(), highlight=False, markup=False)
    table = Table(title="replays (deterministic algorithms on)")
    for column in ("run", "outcome", "loss", "non-finite tensors", "grad max exp"):
        table.add_column(column)
    for i, run in enumerate(result.runs, 1):
        table.add_row(str(i), "finite" if run.finite else escape(run.error or run.category), _fmt(run.loss),
                      str(len(run.nonfinite)),
                      "n/a" if run.grad_max_exponent is None else f"2^{run.grad_max_exponent}")
    console.print(table)
    loc = result.localization
    if loc is not None:
        console.print(f"first bad module: [bold]{escape(loc.label)}[/bold] ({escape(loc.module_type)}), phase "
                      f"[bold]{loc.phase}[/bold]{escape(f' - {loc.detail}') if loc.detail else ''}", highlight=False)
        console.print(f"  received: {loc.received.describe()}", highlight=False, markup=False)
        console.print(f"  produced: {loc.produced.describe()}", highlight=False, markup=False)
    if result.bisect is not None:
        b = result.bisect
        if b.applicable:
            shown = b.sample_ids if b.sample_ids is not None else b.indices
            title = "smallest failing subset" if b.minimal else "fewest failing samples found"
            console.print(f"{title}: {len(b.indices)} of {b.batch_size} samples: {shown} "
                          f"(rows {b.indices}, {b.trials} trials)", highlight=False, markup=False)
            if b.says_more:
                console.print(f"  {b.describe()}", highlight=False, markup=False)
        else:
            console.print(f"bisection not done: {b.reason}", highlight=False, markup=False)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, markup=False)


def _json_out(data: Any) -> None:
    click.echo(json.dumps(plain_json(data), indent=2, allow_nan=False))


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn nanscan's own errors into one-line command-line messages (no traceback)."""
    try:
        yield
    except (BundleError, EntryError, ReplayError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


@click.command("replay")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--entry", default=None, help="Replay entry package.module:function (default: the bundle's).")
@click.option("--runs", default=DEFAULT_RUNS, show_default=True, type=click.IntRange(1, 20),
              help="How many times to replay the step (persistent/transient needs at least 2).")
@click.option("--no-bisect", is_flag=True, help="Do not bisect the batch to the fewest failing samples.")
@click.option("--no-record", is_flag=True, help="Do not add the result to the bundle's ledger and INCIDENT.md.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def replay_command(bundle, entry, runs, no_bisect, no_record, as_json):
    """Replay BUNDLE's failing step: reproduced? persistent or transient? first bad module, fewest samples."""
    from rich.console import Console  # noqa: PLC0415

    console = Console(stderr=True) if as_json else Console()
    with cli_errors():
        with console.status("replaying") as status:
            result = replay(bundle, entry, runs=runs, bisect=not no_bisect,
                            progress=lambda msg: status.update(msg))
        changed = None if no_record else record_replay(result)
    if as_json:
        _json_out({**result.to_dict(), "recorded": changed})
        return
    _print_replay(result, console)
    if changed is not None:
        console.print(f"recorded in {Path(result.bundle) / 'INCIDENT.md'}" if changed
                      else "the same result is already recorded in the bundle; nothing changed", markup=False)


# ---------------------------------------------------------------------------------------------------------------
# Regression case export
# ---------------------------------------------------------------------------------------------------------------

REGRESSION_SCHEMA = "nanscan.regression/1"
CASE_JSON = "case.json"
CASE_BATCH = "batch.safetensors"
CASE_STATE = "state.safetensors"
CASE_RNG = "rng.safetensors"
DEFAULT_MAX_STATE_MB = 64


@dataclass
class ExportResult:
    case_dir: str
    test_file: str
    indices: list[int]
    sample_ids: list | None
    reproduced: bool  # the exported samples went non-finite when replayed
    with_state: bool
    notes: list[str]
    error: str | None = None  # the error the replay of the exported samples raised, if it did
    changed: bool = True  # False when the same export was already there

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "case"


def _state_bytes(state: Mapping | None) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_batch_tensors(state or {}))


def export_regression(bundle: Bundle | str | os.PathLike, dest: str | os.PathLike, entry: str | None = None, *,
                      samples: Sequence[int] | None = None, with_state: bool | None = None,
                      max_state_mb: float = DEFAULT_MAX_STATE_MB, overwrite: bool = False) -> ExportResult:
    """Write the bundle's minimal failing sample(s) as a regression case under `dest`:
    `<dest>/<case>/` (case.json, batch.safetensors, state.safetensors unless too large, rng.safetensors) and
    `<dest>/test_<case>.py`, a pytest file calling nanscan.testing.assert_step_finite.

    Samples: `samples` (row indices), else the bundle's replay finding, else a fresh bisection. `with_state`: store
    the model and optimizer state (default: when it is at most `max_state_mb`). Writing is atomic and idempotent:
    the same bundle exported again gives the same files. A file or directory of the same name that this function
    did not write is never replaced; an earlier export that differs is replaced only with `overwrite`.
    """
    from nanscan._atomic import atomic_write_bytes, json_bytes  # noqa: PLC0415
    from nanscan.bundle import _TreeEncoder  # noqa: PLC0415 - the bundle's own tree format
    from nanscan.provenance import rng_to_tensors  # noqa: PLC0415 - only the export writes RNG files

    replayer = Replayer(bundle, entry)
    b = replayer.bundle
    notes: list[str] = list(replayer.notes)
    size = replayer.sample_count
    if samples is None:
        recorded = recorded_replay(b) or {}
        if (recorded.get("bisect") or {}).get("applicable") and recorded.get("entry") == replayer.entry:
            samples = recorded["bisect"]["indices"]
        elif size is not None and size >= 2:
            found = bisect_samples(replayer)
            samples = found.indices if found.applicable else None
            if not found.applicable:
                notes.append(f"whole batch exported: {found.reason}")
            elif not found.minimal:
                notes.append(found.describe())
    else:
        samples = [int(i) for i in samples]
        outside = [i for i in samples if size is None or not 0 <= i < size]
        if outside or not samples or len(set(samples)) != len(samples):
            raise ReplayError(f"samples {samples}: give distinct row numbers from 0 to {(size or 0) - 1} (the batch "
                              f"in {b.path} has {size if size is not None else 'no'} samples)")
    indices = list(range(size)) if samples is None and size is not None else [int(i) for i in samples or []]
    options = StepOptions(deterministic=True)
    if samples is None:
        case_batch = replayer.batch
    else:
        case_batch = select_samples(replayer.batch, indices, replayer.build())
    observed = replayer.run(options, batch=case_batch, localize=True)
    if observed.error is not None:
        notes.append(f"replaying the exported samples raised an error ({observed.error}): the test fails with "
                     "that error, not with a non-finite step; fix the replay entry or export other samples")
    elif observed.finite:
        notes.append("the exported samples do not fail when replayed: the test will pass as is")

    if with_state is None:
        with_state = _state_bytes(replayer.model_state) + _state_bytes(replayer.optimizer_state) \
            <= max_state_mb * (1 << 20)
        if not with_state and replayer.model_state is not None:
            notes.append(f"state not exported (over {max_state_mb} MB): the test runs on the entry's freshly "
                         "built model; pass --with-state to include it")
    with_state = with_state and replayer.model_state is not None

    name = _slug(f"nanscan_{b.manifest['run_id']}_step{b.step}")
    dest = Path(dest)
    case_dir = dest / name
    test_file = dest / f"test_{name}.py"
    batch_encoder = _TreeEncoder(".")
    batch_structure = batch_encoder.encode(map_tensors(case_batch, lambda t: t.detach().cpu()))
    case: dict[str, Any] = {
        "schema": REGRESSION_SCHEMA,
        "source": {"bundle": str(b.path), "run_id": b.manifest["run_id"], "step": b.step, "category": b.category,
                   "batch_sha256": b.manifest["batch"].get("sha256"), "config_sha256": b.manifest["config_sha256"]},
        "replay_entry": replayer.entry, "config": b.config,
        "samples": {"indices": indices, "sample_ids": _sample_ids(b.sample_ids, indices, size),
                    "batch_size": size},
        "expected": {"finite": True},
        "observed": observed.to_dict(),
        "batch": {"file": CASE_BATCH, "structure": batch_structure},
        "state": None, "rng": None, "notes": notes,
    }
    if with_state:
        state_encoder = _TreeEncoder("/")
        structure = {"model": state_encoder.encode(dict(replayer.model_state), ("model",)),
                     "optimizer": (state_encoder.encode(replayer.optimizer_state, ("optimizer",))
                                   if replayer.optimizer_state is not None else None)}
        case["state"] = {"file": CASE_STATE, "structure": structure, "pre_step": replayer.pre_step}
    if replayer.rng is not None:
        case["rng"] = {"file": CASE_RNG}
    # Everything is rendered first, so an earlier export can be compared byte for byte before anything is written.
    contents = {CASE_BATCH: _tensor_bytes(batch_encoder.tensors)}
    if with_state:
        contents[CASE_STATE] = _tensor_bytes(state_encoder.tensors)
    if replayer.rng is not None:
        tensors, meta = rng_to_tensors(replayer.rng)
        contents[CASE_RNG] = _tensor_bytes(tensors, {"nanscan.rng": json.dumps(meta, sort_keys=True)})
    contents[CASE_JSON] = json_bytes(plain_json(case))
    source = _test_source(name, case, observed).encode("utf-8")

    if dest.exists() and not dest.is_dir():
        raise ReplayError(f"{dest} is a file; pass a directory for the regression case")
    case_same, test_same = _check_earlier_export(case_dir, contents, test_file, source, name, overwrite)
    dest.mkdir(parents=True, exist_ok=True)
    if not case_same:
        _replace_directory(case_dir, contents)
    if not test_same:
        atomic_write_bytes(test_file, source)
    ids = case["samples"]["sample_ids"]
    return ExportResult(str(case_dir), str(test_file), indices, ids, not observed.finite and observed.error is None,
                        bool(with_state), notes, observed.error, changed=not (case_same and test_same))


def _tensor_bytes(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save  # noqa: PLC0415
    from nanscan.bundle import _for_saving  # noqa: PLC0415 - the bundle's own tensor preparation

    return save(_for_saving(tensors), metadata=metadata)


_TEST_HEADER = '"""Regression case exported by nanscan'


def _check_earlier_export(case_dir: Path, contents: Mapping[str, bytes], test_file: Path, source: bytes, name: str,
                          overwrite: bool) -> tuple[bool, bool]:
    """(case unchanged, test unchanged) against what is already at those paths. Refuses anything export-regression
    did not write (a user's file or directory of the same name), and an earlier export that differs from this
    one unless `overwrite`: it may have been edited (a config changed to test a fix)."""
    def refuse(path: Path, what: str) -> ReplayError:
        return ReplayError(f"{path} already exists and {what}, so it was not written by `nanscan export-regression`; "
                           "nothing was written: move it away or choose another directory")

    differs = []
    case_same = test_same = False
    if case_dir.is_symlink() or case_dir.exists():
        if case_dir.is_symlink() or not case_dir.is_dir():
            raise refuse(case_dir, "is not a directory")
        found = {p.name: p for p in case_dir.iterdir()}
        foreign = sorted(n for n, p in found.items()
                         if n not in (CASE_JSON, CASE_BATCH, CASE_STATE, CASE_RNG) or p.is_symlink() or not p.is_file())
        if foreign:
            raise refuse(case_dir, f"holds {', '.join(foreign[:5])}")
        meta = None
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads(found[CASE_JSON].read_bytes()) if CASE_JSON in found else None
        if not isinstance(meta, dict) or meta.get("schema") != REGRESSION_SCHEMA:
            raise refuse(case_dir, f"has no {CASE_JSON} of schema {REGRESSION_SCHEMA}")
        case_same = set(found) == set(contents) and all(found[f].read_bytes() == data for f, data in contents.items())
        if not case_same:
            differs.append(str(case_dir))
    if test_file.is_symlink() or test_file.exists():
        text = test_file.read_bytes() if test_file.is_file() and not test_file.is_symlink() else b""
        if not (text.startswith(_TEST_HEADER.encode()) and f'parent / "{name}"'.encode() in text):
            raise refuse(test_file, "is not the test file of this case")
        test_same = text == source
        if not test_same:
            differs.append(str(test_file))
    if differs and not overwrite:
        raise ReplayError(f"an earlier export differs from this one in {' and '.join(differs)} (edited since, or "
                          "exported from another bundle or samples); nothing was written: pass --overwrite to "
                          "replace it, or choose another directory")
    return case_same, test_same


def _replace_directory(case_dir: Path, contents: Mapping[str, bytes]) -> None:
    """Put a directory holding `contents` at case_dir: built beside it, the old one parked, swapped, deleted."""
    import shutil  # noqa: PLC0415

    from nanscan._atomic import atomic_directory  # noqa: PLC0415

    old = None
    if case_dir.exists():
        old = case_dir.with_name(f".tmp-{case_dir.name}-old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(case_dir, old)
    try:
        with atomic_directory(case_dir) as temp:
            for file, data in contents.items():
                (temp / file).write_bytes(data)
    except BaseException:
        if old is not None and not case_dir.exists():
            os.rename(old, case_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _in_docstring(text: str) -> str:
    """`text` as it can stand inside a triple-quoted docstring: sample ids are the user's data, and a quote, a
    backslash or a control character in one must not end the string or break the generated file."""
    def escape(ch: str) -> str:
        if ch in '\\"':
            return "\\" + ch
        code = ord(ch)
        if (code < 32 and ch != "\n") or code == 127 or 0xD800 <= code <= 0xDFFF:
            return f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}"
        return ch

    return "".join(escape(ch) for ch in text)


def _test_source(name: str, case: Mapping, observed: StepOutcome) -> str:
    src = case["source"]
    loc = observed.localization
    if observed.error is not None:
        seen = f"raised an error when exported ({observed.error})"
    elif loc is not None:
        seen = f"went non-finite ({observed.category}), first in {loc.label} ({loc.module_type}, {loc.phase})"
    else:
        seen = "went non-finite" if not observed.finite else "was finite when exported"
    ids = case["samples"]["sample_ids"]
    which = f"samples {ids}" if ids is not None else f"rows {case['samples']['indices']}"
    promise = ("This test fails until that cause is fixed, and then keeps the edge case from coming back unnoticed."
               if not observed.finite else
               "This test passed when it was written (the samples did not fail on replay); it guards the step only.")
    about = _in_docstring(f"""from run {src["run_id"]}, step {src["step"]} (category {src["category"]}).

The training step on {which} {seen}.
{promise}
The case (batch, state, RNG states, config) is in ./{name}/; the model comes from the replay entry
{case["replay_entry"]!r}, which must be importable here.""")
    return f'''{_TEST_HEADER} {about}
"""

from pathlib import Path

from nanscan.testing import assert_step_finite, load_regression_case

CASE = Path(__file__).resolve().parent / "{name}"


def test_{name}_stays_finite():
    case = load_regression_case(CASE)
    spec = case.build_spec()
    case.restore_rng()
    assert_step_finite(spec.model, spec.step_fn, case.batch, optimizer=spec.make_optimizer(),
                       state=case.model_state, optimizer_state=case.optimizer_state)
'''


@click.command("export-regression")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--entry", default=None, help="Replay entry package.module:function (default: the bundle's).")
@click.option("--samples", default=None, help="Comma-separated sample rows to export (default: the smallest "
                                              "failing subset from replay, or a fresh bisection).")
@click.option("--with-state/--no-state", default=None,
              help=f"Store the model and optimizer state (default: when at most {DEFAULT_MAX_STATE_MB} MB).")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export of this case that differs from this one.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def export_regression_command(bundle, dest, entry, samples, with_state, overwrite, as_json):
    """Write BUNDLE's minimal failing sample(s) to DEST as a regression case and a pytest file."""
    rows = None
    if samples:
        try:
            rows = [int(s) for s in samples.split(",") if s.strip()]
        except ValueError:
            raise click.BadParameter(f"{samples!r} is not a comma-separated list of row numbers",
                                     param_hint="--samples") from None
    with cli_errors():
        result = export_regression(bundle, dest, entry, samples=rows, with_state=with_state, overwrite=overwrite)
    if as_json:
        _json_out(result.to_dict())
        return
    click.echo(f"regression case: {result.case_dir}")
    click.echo(f"pytest file:     {result.test_file}")
    shown = result.sample_ids if result.sample_ids is not None else result.indices
    now = "fails now" if result.reproduced else ("fails now with an error" if result.error else "passes now")
    click.echo(f"samples: {shown}; {now} ({'with' if result.with_state else 'without'} the saved state)"
               f"{'' if result.changed else '; the same export was already there, nothing changed'}")
    for note in result.notes:
        click.echo(f"note: {note}")
