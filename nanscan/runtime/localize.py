"""Localization: which module of a replayed step first turned finite inputs into non-finite outputs, found with
hooks on every module for the duration of one step, and the value summaries it compares; and where values first
grew overflow-sized, which may be an earlier module (NOTE: [overflow onset]).

NOTE: [overflow onset]
The first module with a non-finite output is often not where the trouble began: an activation multiplied by 1e38
in one block stays finite until a later LayerNorm squares it. So the forward hooks also keep the first module whose
output was overflow-sized while what it computed from (its inputs and its own parameters) was not: |x| past the
step's range (engine.headroom NOTE: [overflow]: 2**64, whose squares overflow float32 and bfloat16; 65504 for a
float16 output), or a jump of JUMP_BINADES binades or more above its inputs' largest |x| times its parameters'
(at least 1): a sum of products of its inputs and weights gains at most log2 of its fan-in in binades, so 16 binades
(a factor 65,536) is more than any layer's fan-in explains. It is named beside the first non-finite module: "h.1.mlp
made 3.5e37 from inputs within 8; transformer.ln_f then produced NaN".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from nanscan.bundle import json_float
from nanscan.engine.headroom import FLOAT16_MAX, OVERFLOW_MIN, range_limit_text
from nanscan.engine.inputs import iter_batch_tensors
from nanscan.scan import scan
from nanscan.engine.stats import ScanReport


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
        if self.absmax is None:
            span = "no finite values"
        elif self.absmin is None:  # absmin is over finite non-zero values: there are none
            span = "finite values all zeros"
        else:
            span = f"|x| in [{fmt_value(self.absmin)}, {fmt_value(self.absmax)}]"
        return f"{'finite' if not bad else bad}; {span} ({'/'.join(self.dtypes)})"


def summarize_values(values: Any) -> ValueSummary:
    """ValueSummary of every floating-point tensor inside `values` (tensors, nested tuples, lists and dicts)."""
    tensors = [t for _, t in iter_batch_tensors(values)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not t.is_meta]
    if not tensors:
        return ValueSummary()
    return summary_of(scan(tensors), tuple(dict.fromkeys(str(t.dtype).removeprefix("torch.") for t in tensors)))


def summary_of(report: ScanReport, dtypes: tuple[str, ...] = ()) -> ValueSummary:
    totals = report.totals
    nonzero = [s.absmin for s in report.stats if s.absmin > 0]
    finite = totals.finite > 0
    return ValueSummary(len(report), totals.nan, totals.posinf, totals.neginf,
                        min(nonzero) if nonzero else None, totals.absmax if finite else None,
                        dtypes or tuple(dict.fromkeys(t.dtype for t in report.tensors)))


def creates_nonfinite(received: ValueSummary, produced: ValueSummary) -> bool:
    """True when `produced` holds a kind of non-finite value that `received` did not explain.

    A NaN is new when nothing received was NaN (a fully masked softmax row turns -inf into NaN: the -inf came in,
    the NaN was made here); an infinity is new when everything received was finite.
    """
    return (produced.nan > 0 and received.nan == 0) or (produced.inf > 0 and received.nonfinite == 0)


JUMP_BINADES = 16
# The localizations that computation made, where an op can be named next (nanscan.runtime.ops): not the batch (its
# record is named) nor a state that was non-finite before the step ran.
OP_PHASES = ("forward", "backward", "loss")


def overflow_made(received: ValueSummary, parameters: ValueSummary, produced: ValueSummary) -> str | None:
    """Why `produced` is overflow-sized where what it was computed from was not (NOTE: [overflow onset]), or None."""
    out = produced.absmax
    if out is None:
        return None
    source = max(received.absmax or 0.0, parameters.absmax or 0.0)
    half = "float16" in produced.dtypes
    limit = FLOAT16_MAX if half else OVERFLOW_MIN
    if out > limit and source <= limit:
        past = range_limit_text("float16" if half else None)
        return f"made {fmt_value(out)} from inputs within {fmt_value(source)} ({past})"
    bound = (received.absmax or 0.0) * max(1.0, parameters.absmax or 0.0)
    if bound > 0 and math.log2(out / bound) >= JUMP_BINADES:
        return (f"made {fmt_value(out)} from inputs within {fmt_value(received.absmax)} and parameters within "
                f"{fmt_value(parameters.absmax)}: {math.log2(out / bound):.0f} binades above their product, more "
                "than any fan-in explains")
    return None


def fmt_value(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


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
    overflow_began: "Localization | None" = None  # an earlier module whose output grew overflow-sized first

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
        text = f"{where}{extra}: {'; '.join(parts)}"
        if self.overflow_began is not None:  # NOTE: [overflow onset]
            began = self.overflow_began
            text = f"{began.label} ({began.module_type}) {began.detail}; then {text}"
        return text

    def markdown_lines(self) -> list[str]:
        """The first bad module as INCIDENT.md shows it (replay's finding and the in-process rerun's)."""
        lines = [f"**First bad module:** `{self.label}` ({self.module_type}), {self.phase}"
                 f"{f' ({self.detail})' if self.detail else ''}.",
                 f"It received: {self.received.describe()}.", f"It produced: {self.produced.describe()}."]
        if self.overflow_began is not None:  # NOTE: [overflow onset]
            began = self.overflow_began
            lines.append(f"**Where the overflow began:** `{began.label}` ({began.module_type}) {began.detail}.")
        return lines

    def to_dict(self) -> dict:
        return {"phase": self.phase, "module": self.module, "module_type": self.module_type, "label": self.label,
                "detail": self.detail, "received": self.received.to_dict(), "produced": self.produced.to_dict(),
                "parameters": self.parameters.to_dict() if self.parameters else None,
                "overflow_began": self.overflow_began.to_dict() if self.overflow_began is not None else None}


class Localizer:
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
        self.first_overflow: Localization | None = None  # NOTE: [overflow onset]
        self._inputs: dict[str, list[ValueSummary]] = {}
        self._grad_out: dict[str, ValueSummary] = {}
        self._handles: list[Any] = []
        self._modules = dict(model.named_modules())

    def __enter__(self) -> "Localizer":
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
            if creates_nonfinite(received, produced):
                weights = summarize_values(list(module.parameters(recurse=False)))
                self.first_forward = Localization("forward", name, self._type(name), received, produced, "output",
                                                  weights)
            elif self.first_overflow is None and produced.absmax is not None and produced.absmax > FLOAT16_MAX:
                weights = summarize_values(list(module.parameters(recurse=False)))
                why = overflow_made(received, weights, produced)
                if why is not None:
                    self.first_overflow = Localization("forward", name, self._type(name), received, produced, why,
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
            if creates_nonfinite(received, produced):
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
            if creates_nonfinite(received, produced):
                detail = f"gradient of parameter {pname}" if module != owner else f"gradient of parameter {leaf}"
                if module not in self._grad_out:
                    detail += "; the output gradient it received was not observed (module backward hooks off)"
                self.first_backward = Localization("backward", module, self._type(module), received, produced,
                                                   detail)
            return None
        return hook


def first_bad(localizer: Localizer, category: str, batch_report: ScanReport, loss_value: float,
               grads: ScanReport, update_report: ScanReport | None, optimizer) -> Localization:
    """The earliest place, in the order the step ran, where non-finite values appeared, with the module where
    values first grew overflow-sized when that came before it elsewhere (NOTE: [overflow onset])."""
    found = _first_nonfinite(localizer, category, batch_report, loss_value, grads, update_report, optimizer)
    began = localizer.first_overflow
    if began is None or found.phase in ("input", "state") or (found.phase == "forward" and
                                                             found.module == began.module):
        return found
    return dataclasses.replace(found, overflow_began=began)


def _first_nonfinite(localizer: Localizer, category: str, batch_report: ScanReport, loss_value: float,
                     grads: ScanReport, update_report: ScanReport | None, optimizer) -> Localization:
    if not batch_report.ok:  # before any module ran
        bad = batch_report.nonfinite
        return Localization("input", "batch", "batch", ValueSummary(), summary_of(batch_report),
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
        return Localization("backward", "step_fn", "code outside any module", ValueSummary(), summary_of(grads),
                            "no module's backward created it: the gradient came from step_fn's own code "
                            "(or from a module whose backward hooks could not be attached)")
    received = summary_of(grads)
    produced = summary_of(update_report) if update_report is not None else ValueSummary()
    return Localization("update", type(optimizer).__name__, "optimizer", received, produced,
                        "gradients were finite; optimizer.step() produced the non-finite values")
