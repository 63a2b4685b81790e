"""Op-level localization: inside a replayed step, the first operation that turned finite values into non-finite
ones, forward (an aten op, seen by a TorchDispatchMode) and backward (an autograd node, seen by hooks on the
graph's nodes), with the module it ran in and the user's source line that called it.

NOTE: [op localization]
A rerun (replay, or the Monitor's in-process rerun at an incident) runs this after the module-level pass
(nanscan.runtime.localize), on one more run of the step, so its cost never reaches the every-step check. Forward:
a TorchDispatchMode, active only around step_fn, sees every aten op of the model's forward and of step_fn's own
code (the loss); the first op whose floating outputs hold a kind of non-finite value its inputs did not explain
(localize.creates_nonfinite; a Python float argument such as masked_fill's -inf counts as an input) is kept.
Backward: a TorchFunctionMode, active over the same span, tags every autograd node that a torch call created (the
call's name, the module it ran in, the caller's source line) and hooks it; the first node, in the order backward
runs them, whose gradients are non-finite while the gradients it received were not is kept, named by the node
(SqrtBackward0) and the forward call that made it. The source line is the innermost frame outside torch, the
standard library and the nanscan modules that run a step again (nanscan.runtime, nanscan.replay): the user's code
that called the op (a model's forward, step_fn, or a library's modeling code).
"""

from __future__ import annotations

import linecache
import math
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from nanscan.runtime.localize import ValueSummary, creates_nonfinite, summarize_values

# Frames in these directories are not "the user's code that called the op" (NOTE: [op localization]).
_PACKAGE = os.path.dirname(os.path.dirname(__file__))
_INTERNAL_DIRS = tuple(os.path.normcase(os.path.abspath(d)) + os.sep for d in (
    os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.join(_PACKAGE, "replay"),
    sysconfig.get_paths()["stdlib"]))
# Ops whose outputs are uninitialized memory: whatever bits they hold were made by no computation.
_UNINITIALIZED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")
# Where torch's C functions are documented: torch._C._nn.linear is torch.nn.functional.linear.
_PUBLIC_HOMES = {"torch._C._nn": "torch.nn.functional", "torch._C._VariableFunctions": "torch",
                 "torch._C._linalg": "torch.linalg", "torch._C._special": "torch.special", "torch._C._fft": "torch.fft"}
OUTSIDE_MODULES = "step_fn"  # the module path of code outside any module of the model (step_fn's own code)


@dataclass(frozen=True)
class OpSite:
    """The first op (forward) or autograd node (backward) that made a non-finite value from finite ones.

    op: the aten op ("aten.log") or the autograd node ("SqrtBackward0"). call: the torch call that ran it
    ("torch.log", "Tensor.__truediv__", "torch.nn.functional.softmax"); for a node, the forward call that created it.
    module: the module path it ran in ("" the model itself, "step_fn" outside any module); module_type its class.
    file, line, code: the user's source line that made the call (None when every frame was torch's own).
    received / produced: inputs and outputs (forward), incoming and outgoing gradients (backward).
    """

    phase: str
    op: str
    call: str
    module: str
    module_type: str
    file: str | None
    line: int | None
    code: str | None
    received: ValueSummary
    produced: ValueSummary

    @property
    def label(self) -> str:
        return self.module or "(model)"

    @property
    def location(self) -> str | None:
        """file:line, the file relative to the current directory when it is inside it."""
        if self.file is None:
            return None
        shown = self.file
        try:
            relative = os.path.relpath(self.file)
            shown = relative if not relative.startswith("..") else self.file
        except ValueError:  # another drive
            pass
        return f"{shown}:{self.line}"

    @property
    def made(self) -> str:
        """How the op relates to the torch call: a node is "created by" it, an aten op "called as" it."""
        return "created by" if self.phase == "backward" else "called as"

    def describe(self) -> str:
        made = f"{self.made} {self.call}"
        where = f" at {self.location}" if self.location else ""
        code = f": {self.code}" if self.code else ""
        return (f"{self.op} ({made}) in {self.label} ({self.module_type}), {self.phase}{where}{code}; received "
                f"{self.received.describe()}; produced {self.produced.describe()}")

    def to_dict(self) -> dict:
        return {"phase": self.phase, "op": self.op, "call": self.call, "module": self.module,
                "module_type": self.module_type, "label": self.label, "file": self.file, "line": self.line,
                "location": self.location, "code": self.code, "received": self.received.to_dict(),
                "produced": self.produced.to_dict()}


@dataclass(frozen=True)
class _Caller:
    """Where a torch call was made: the module stack's top and the user's frame."""

    call: str
    module: str
    file: str | None
    line: int | None


def user_frame() -> tuple[str | None, int | None]:
    """(file, line) of the innermost frame outside torch, the standard library and nanscan.replay."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.normcase(os.path.abspath(frame.f_code.co_filename))
        if not path.startswith(_INTERNAL_DIRS) and not frame.f_code.co_filename.startswith("<"):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None, None


def call_name(func: Any) -> str:
    """A torch callable as a reader writes it: "torch.sqrt", "Tensor.__mul__", "torch.nn.functional.softmax"."""
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    for base in ("_TensorBase.", "TensorBase."):
        if qual.startswith(base):
            return "Tensor." + qual[len(base):]
    if qual.startswith("Tensor."):
        return qual
    if qual.startswith("_VariableFunctionsClass."):  # torch.sqrt and the other functions of torch itself
        return "torch." + qual.partition(".")[2]
    module = getattr(func, "__module__", None) or "torch"
    return f"{_PUBLIC_HOMES.get(module, module)}.{qual}"


def _floating(values: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(values) if t.is_floating_point() or t.is_complex()]


def _tensors(values: Any) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _tensors(v)]
    if isinstance(values, dict):
        return [t for v in values.values() for t in _tensors(v)]
    return []


def _scalars(values: Any) -> list[float]:
    """Python float arguments (masked_fill's -inf), which are inputs as much as tensors are."""
    if isinstance(values, float):
        return [values]
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _scalars(v)]
    if isinstance(values, dict):
        return [x for v in values.values() for x in _scalars(v)]
    return []


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel() and not t.is_meta)


def _with_scalars(summary: ValueSummary, scalars: list[float]) -> ValueSummary:
    nan = sum(1 for x in scalars if math.isnan(x))
    posinf = sum(1 for x in scalars if x == math.inf)
    neginf = sum(1 for x in scalars if x == -math.inf)
    if not nan + posinf + neginf:
        return summary
    return ValueSummary(summary.tensors, summary.nan + nan, summary.posinf + posinf, summary.neginf + neginf,
                        summary.absmin, summary.absmax, summary.dtypes)


class _ForwardOps(TorchDispatchMode):
    def __init__(self, tracer: "OpTracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        watching = tracer.first_forward is None and func.overloadpacket.__name__ not in _UNINITIALIZED
        before = None
        if watching and func._schema.is_mutable:  # in place: what it received is gone after the call
            before = summarize_values((args, kwargs))
        out = func(*args, **kwargs)
        if watching:
            produced_tensors = _floating(out)
            if produced_tensors and not _all_finite(produced_tensors):
                received = before if before is not None else summarize_values((args, kwargs))
                received = _with_scalars(received, _scalars((args, kwargs)))
                produced = summarize_values(out)
                if creates_nonfinite(received, produced):
                    tracer.first_forward = tracer.site("forward", str(func.overloadpacket), tracer.current_call,
                                                       received, produced)
        return out


class _NodeTags(TorchFunctionMode):
    def __init__(self, tracer: "OpTracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        outer, tracer.current_call = tracer.current_call, call_name(func)
        try:
            out = func(*args, **kwargs)
        finally:
            tracer.current_call = outer
        new = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None and t.grad_fn not in tracer.tags]
        if new:
            file, line = user_frame()
            tracer.tag(new, _Caller(call_name(func), tracer.module_path, file, line))
        return out


class OpTracer:
    """The op-level localizer of one replayed step (NOTE: [op localization]). Enter it around step_fn only; the
    node hooks it leaves on the graph fire during loss.backward(), after it exited."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.first_forward: OpSite | None = None
        self.first_backward: OpSite | None = None
        self.current_call = "(an op inside a torch call)"
        self.tags: dict[Any, _Caller] = {}
        self._stack: list[str] = []
        self._modules = dict(model.named_modules())
        self._handles: list[Any] = []
        self._modes: list[Any] = []

    @property
    def first(self) -> OpSite | None:
        return self.first_forward or self.first_backward

    @property
    def module_path(self) -> str:
        return self._stack[-1] if self._stack else OUTSIDE_MODULES

    def module_type(self, path: str) -> str:
        if path == OUTSIDE_MODULES:
            return "code outside any module"
        return type(self._modules.get(path, self.model)).__name__

    def __enter__(self) -> "OpTracer":
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(module.register_forward_hook(self._leave_module(name), always_call=True))
        self._modes = [_NodeTags(self), _ForwardOps(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _enter_module(self, name: str):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _leave_module(self, name: str):
        def hook(module, args, output):
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
        return hook

    def site(self, phase: str, op: str, call: str, received: ValueSummary, produced: ValueSummary, *,
             caller: _Caller | None = None) -> OpSite:
        if caller is None:
            file, line = user_frame()
            module = self.module_path
        else:
            file, line, module = caller.file, caller.line, caller.module
        code = (linecache.getline(file, line).strip() or None) if file is not None else None
        return OpSite(phase, op, call, module, self.module_type(module), file, line, code, received, produced)

    def tag(self, nodes: list, caller: _Caller) -> None:
        """Tag the nodes a call created (those reachable from its outputs and not tagged yet) and hook them."""
        todo = list(nodes)
        while todo:
            node = todo.pop()
            if node is None or node in self.tags:
                continue
            self.tags[node] = caller
            if not node.name().endswith("AccumulateGrad"):
                node.register_hook(self._node_hook(node))
            todo.extend(next_node for next_node, _ in node.next_functions)

    def _node_hook(self, node):
        def hook(grad_inputs, grad_outputs):
            if self.first_backward is not None:
                return None
            produced_tensors = _floating(grad_inputs)
            if not produced_tensors or _all_finite(produced_tensors):
                return None
            received, produced = summarize_values(grad_outputs), summarize_values(grad_inputs)
            if creates_nonfinite(received, produced):
                caller = self.tags.get(node)
                name = node.name().removeprefix("torch::autograd::")
                self.first_backward = self.site("backward", name, caller.call if caller else "(unknown)",
                                                received, produced, caller=caller)
            return None
        return hook


def op_markdown(site: OpSite) -> str:
    """The first bad op as INCIDENT.md shows it."""
    where = f", at `{site.location}`" if site.location else ""
    code = f":\n\n    {site.code}" if site.code else "."
    return (f"**First bad op:** `{site.op}` ({site.made} `{site.call}`), {site.phase}, in `{site.label}` "
            f"({site.module_type}){where}{code}\n\nIt received: {site.received.describe()}. It produced: "
            f"{site.produced.describe()}.")
