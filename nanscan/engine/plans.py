"""The every-step fast path: what a Monitor scans each step, prepared once and only confirmed per step.

ModelScanPlan holds a model's (and optimizer's) `param:`, `grad:` and `optim:` inputs, BatchPlan a batch's
`input:` and `loss` inputs, StepInputs the two joined for one check. TensorSource is what a Monitor asks of the
first (NOTE: [tensor source]): a framework that keeps its tensors elsewhere gives the Monitor its own. On the CPU the confirmation and the scan are
one native call (nanscan._C.PlanCheck, csrc/plan/); elsewhere the plans hand their inputs to nanscan.engine.dispatch.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from nanscan.engine._native import native_function, tensor_access
from nanscan.engine.dispatch import launch
from nanscan.incident import LOSS, tensor_name
from nanscan.engine.inputs import (CONTIGUOUS, GAPPED, ScanInput, ScanInputs, bind, is_dense_permutation,
                                   iter_batch_tensors, named_parameters, prepare, read_host_scalar)
from nanscan.engine.pending import HostScan, StepScan, completed_scan
from nanscan.engine.stats import ScannedTensor


class StepInputs:
    """A check's batch and loss inputs as the model plan joins them with the model's (the `extra` of
    nanscan.engine.plans.ModelScanPlan): their identities, data pointers and the skipped batch tensors' names, the loss
    last when `has_loss`. The ScanInput objects are made only when something asks for them (`items()`), which the
    one-call path of a steady batch never does (NOTE: [batch plan])."""

    __slots__ = ("identities", "ptrs", "skipped", "has_loss", "_items", "_templates", "_leaves")

    def __init__(self, identities: tuple[ScannedTensor, ...], ptrs: list[int], skipped: tuple[str, ...] = (),
                 has_loss: bool = False, *, items: list[ScanInput] | None = None,
                 templates: Sequence[ScanInput] = (), leaves: Sequence[torch.Tensor] = ()):
        self.identities = identities
        self.ptrs = ptrs
        self.skipped = skipped
        self.has_loss = has_loss
        self._items, self._templates, self._leaves = items, templates, leaves

    @classmethod
    def of(cls, items: Sequence[ScanInput], skipped: tuple[str, ...] = (), has_loss: bool = False) -> "StepInputs":
        items = list(items)
        return cls(tuple(item.identity for item in items), [item.data_ptr() for item in items], skipped, has_loss,
                   items=items)

    def __len__(self) -> int:
        return len(self.identities)

    def items(self) -> list[ScanInput]:
        if self._items is None:
            self._items = [bind(template, leaf) for template, leaf in zip(self._templates, self._leaves)]
        return self._items

    def loss_value(self) -> float | None:
        """The loss read from host memory where the scan read it, for a one-element CPU loss; else None."""
        if not self.has_loss:
            return None
        loss = self.identities[-1]
        if loss.numel != 1 or loss.device != "cpu":
            return None
        return read_host_scalar(self.ptrs[-1], loss.scanned_code)


def as_step_inputs(extra: Any) -> StepInputs:
    return extra if isinstance(extra, StepInputs) else StepInputs.of(extra)


class BatchPlan:
    """A Monitor's `input:<path>` and `loss` inputs, step after step.

    NOTE: [batch plan]
    A training loop hands every check a batch of one structure: the same keys, tensors of the same dtype and shape.
    Walking it in Python (iter_batch_tensors, then prepare per tensor) cost a tenth of a small model's check, almost
    all of it in the interpreter's cold caches. So the plan prepares a batch the ordinary way once, and when it is
    a plain dict, list or tuple of tensors (or one tensor, or None) whose scanned tensors are contiguous on the CPU,
    and the loss is such a tensor too, it keeps their descriptions (ScanInput templates) and what each leaf must
    match. Each later step one native call (nanscan._C.batch_leaves, reading tensors through nanscan._torch_access)
    checks the new batch against that and returns its scanned leaves, which are bound to the templates; anything
    else (another structure, dtype, size, device, layout, a nested batch, numpy arrays, a missing extension) takes
    the ordinary path, which also builds the next plan. Both paths give the same inputs and skipped names.
    """

    _KINDS = {type(None): 0, dict: 2, list: 3, tuple: 4}

    def __init__(self):
        self._check = native_function("batch_leaves")
        self._plan: tuple | None = None  # the native check's description, when the last batch allowed one
        self._templates: list[ScanInput] = []
        self._identities: tuple[ScannedTensor, ...] = ()
        self._skipped: tuple[str, ...] = ()
        self.rebuilds = 0

    def prepare(self, batch: Any, loss: torch.Tensor | None) -> StepInputs:
        """The inputs of the batch's floating tensors then of the loss (`input:<path>`, `loss`), and the names of
        the batch tensors that are not scanned."""
        if self._plan is not None:
            found = self._check(batch, loss, self._plan)
            if found is not None:
                leaves, ptrs = found
                return StepInputs(self._identities, ptrs, self._skipped, loss is not None,
                                  templates=self._templates, leaves=leaves)
        return self._rebuild(batch, loss)

    def _rebuild(self, batch: Any, loss: torch.Tensor | None) -> StepInputs:
        self.rebuilds += 1
        items, skipped, leaves = [], [], []
        if batch is not None:
            for path, tensor in iter_batch_tensors(batch):
                name = tensor_name("input", path)
                item = prepare(name, tensor)
                leaves.append((tensor, item))
                if item is None:
                    skipped.append(name)
                else:
                    items.append(item)
        loss_input = None
        if loss is not None:
            loss_input = prepare(LOSS, loss)
            if loss_input is not None:
                items.append(loss_input)
        self._plan = self._describe(batch, leaves, loss, loss_input)
        self._templates = [bind(item, None) for item in items]
        self._skipped = tuple(skipped)
        step = StepInputs.of(items, self._skipped, loss_input is not None)
        self._identities = step.identities
        return step

    def _describe(self, batch: Any, leaves: list, loss: torch.Tensor | None, loss_input: ScanInput | None):
        """The native check's description of this batch, or None when the batch or loss takes the ordinary path."""
        access = tensor_access()
        if self._check is None or access is None:
            return None
        kind = 1 if type(batch) is torch.Tensor else self._KINDS.get(type(batch))
        values = [] if batch is None else [batch] if kind == 1 else \
            list(batch.values()) if kind == 2 else list(batch) if kind is not None else None
        if values is None or len(values) != len(leaves) or loss is not None and loss_input is None:
            return None  # nested, numpy, dataclass, or a loss that is not scanned
        dtypes, nbytes = [], []
        for value, (tensor, item) in zip(values, leaves):
            if type(value) is not torch.Tensor or tensor is not value:
                return None
            if item is not None and not (item.tensor is value and item.layout == CONTIGUOUS and value.is_cpu):
                return None  # derived (complex parts), permuted, gapped, or not on the CPU
            dtypes.append(value.dtype)
            nbytes.append(value.nbytes if item is not None else -1)
        if loss is not None and not (type(loss) is torch.Tensor and loss_input.tensor is loss and
                                     loss_input.layout == CONTIGUOUS and loss.is_cpu):
            return None
        keys = tuple(batch) if kind == 2 else None
        return (kind, keys, tuple(dtypes), tuple(nbytes), torch.Tensor, access,
                None if loss is None else loss.dtype, -1 if loss is None else loss.nbytes)


class TensorSource(Protocol):
    """What a Monitor scans each step besides the batch and the loss, and what a bundle stores of it.

    NOTE: [tensor source]
    The Monitor joins the batch's inputs (BatchPlan) with those of one tensor source, and knows nothing else of
    where a model keeps its tensors. The default is a ModelScanPlan (the module's parameters and their `.grad`, a
    torch optimizer's state); a framework that keeps them elsewhere (DeepSpeed ZeRO: flat partitions per rank,
    nanscan.integrations.deepspeed) gives `Monitor(..., source=...)` its own, which names what it scans as
    NOTE: [tensor names] says, so categories, agreement and bundles work unchanged. A source:
      - `inputs(model, optimizer, extra=...)`: a ScanInputs of `extra` (the batch and the loss, prepared by the
        caller) followed by its own inputs;
      - `scan_on_host(model, optimizer, extra=..., backend_for=..., carried=None)`: a one-call host scan, or
        None (then the Monitor launches `inputs()` itself; a source without such a path always returns None);
        `carried` records (nanscan.runtime.update NOTE: [carried records]) index `stable_tensors()`;
      - `stable_tensors()`: the tensors a passing per-step check confirms unchanged since the last rebuild (a
        source that confirms none gives []);
      - `state(model, optimizer)`: (model state, optimizer state) as a bundle stores them: trees of tensors;
        optionally `frozen_keys(model)`: the keys of that model state a bundle may hold by reference
        (nanscan.bundle.frozen NOTE: [frozen references]); a source without it has every tensor copied;
      - optionally `load_state(model, optimizer, model_state, optimizer_state)`: what state() gave (a kept copy of
        it) loaded back in place, and `step_driver()`: how a rerun steps the framework's engine (NOTE: [step
        driver] in nanscan/runtime/rerun.py); a source with both keeps a window (NOTE: [run window]) and its
        incidents are diagnosed in the process (NOTE: [zero window]);
      - `rebuilds` (how often it prepared everything again) and `no_gradients` (it found no gradient where
        parameters train: the check is in the wrong place).
    """

    rebuilds: int
    no_gradients: bool

    def inputs(self, model: torch.nn.Module, optimizer: Any, *, extra: StepInputs | Sequence[ScanInput] = ()
               ) -> ScanInputs: ...

    def scan_on_host(self, model: torch.nn.Module, optimizer: Any, *, extra: StepInputs,
                     backend_for: Callable[[tuple[str, ...]], Any], carried: tuple | None = None
                     ) -> HostScan | None: ...

    def stable_tensors(self) -> list[torch.Tensor]: ...

    def state(self, model: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]: ...


def whole_tensor(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The shard function of a single process: the whole tensor, no name suffix."""
    return t, ""


_data_ptr = torch.Tensor.data_ptr


_is_contiguous = torch.Tensor.is_contiguous


_MODULE_WALK = (torch.nn.Module.named_parameters, torch.nn.Module._named_members, torch.nn.Module.named_modules)


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _uses_module_walk(module: torch.nn.Module) -> bool:
    """Whether named_parameters() of this module is torch's own walk (no subclass overrides how it is found)."""
    cls = type(module)
    return (cls.named_parameters, cls._named_members, cls.named_modules) == _MODULE_WALK


# NOTE: [frozen records]
# A frozen parameter (requires_grad=False, and no gradient at the plan's rebuild) is most of a fine-tuned model (PEFT
# LoRA on a GPT-2: 96.6% of the elements a check read), and nothing in a training step writes it: autograd gives it
# no gradient, and an optimizer skips a parameter that has none. So the plan keeps its frozen parameters' records
# from the first native check after each rebuild, with their stamps (tensor_stamps: version counter, data pointer,
# dtype), as a standing part of the records the next checks carry (nanscan.runtime.update NOTE: [carried records]),
# joined with the post-update records the Monitor hands in (those are newer and win). nanscan._C.PlanCheck compares
# the stamps in C++ inside the check, as for those: a frozen tensor whose stamp moved (an edit under no_grad,
# copy_, load_state_dict, a `.data` swap, model.half()) is read again at that check, and its new stamp and record
# are written into the standing part in place, so it stands in again from the next check on; a step with any
# non-finite tensor is scanned whole, and refreshes the whole part. Every check's report, the history, the live
# export and the bundle still hold every frozen tensor's record. What keeps it sound, and where it stops:
#   - the per-step check confirms that each parameter without a gradient at the rebuild still has none: a parameter
#     unfrozen between steps gets one at its next backward, which rebuilds the plan before any update can write it;
#     one frozen between steps is carried once its gradient is gone (zero_grad(set_to_none=True) rebuilds), and read
#     every step until then: with a gradient left in place (set_to_none=False) an optimizer still updates it.
#     (A check after zero_grad sees no gradient at all and warns, GradientWarning.)
#   - an in-place write through `.data` (`p.data[0] = nan`, `p.data.clamp_()`) moves no version counter: the one
#     write the stamps miss. A non-finite value written that way into a weight the forward reads makes the loss and
#     gradients non-finite at that step, which is then scanned whole, the weight itself named (category parameter);
#     a finite one, or one in a weight nothing reads, shows when the standing part is next left out: every
#     FROZEN_RESCAN_CHECKS checks (ModelScanPlan(frozen_period=...)) every frozen tensor is read again. 64 is the
#     Monitor's default history, so its window (and a bundle's) always holds a check that read every frozen
#     tensor, at 1/64 of the frozen scan's cost.
#   - only the one-call path on the CPU carries (scan_on_host, the native backend): the numba backend, the Python
#     check, mode="async" and GPU scans read every frozen tensor at every check, as before.
FROZEN_RESCAN_CHECKS = 64


class ModelScanPlan:
    """`param:<name>`, `grad:<name>` and `optim:<name>.<key>` inputs of a model (and its optimizer), step after step.

    NOTE: [model scan plan]
    The Monitor asks for these inputs every step, and they are nearly always the same: the same parameter and
    optimizer-state tensors (updated in place), and gradients that are new tensors (zero_grad(set_to_none=True))
    but have their parameter's dtype and shape, which autograd and the `.grad` setter enforce. So the plan prepares
    every tensor once (a rebuild) and afterwards, per step, only checks that nothing changed:
      - the module tree: every module's children are the objects they were (the plan holds them, so their ids
        cannot be reused), and so are the entries of every module's parameter dict, which is all that
        named_parameters() reads; without walking it again (the walk costs more than the rest of the check);
      - the same parameters have gradients, the optimizer's state values are the same tensor objects, and its
        parameter groups hold the same parameter lists (parameters outside the model are scanned too);
      - the parameters and state tensors point where they did, with the dtype and size in bytes they had (a
        `.data` swap, `model.half()` or `model.to()` moves them, or, when the allocator hands the old address
        back, changes their format or extent at the same address), and every gradient has the layout it had.
    Anything else (a new tensor, a dtype or layout change, a strided view, a DTensor shard, a module class that
    overrides how its parameters are found, optimizer state kept in lists as LBFGS does) rebuilds the plan, so a
    step costs the full preparation only when something changed. The result is a ScanInputs (NOTE: [input table])
    whose counts, codes and identities are the rebuild's. Inputs come in three runs: parameters, gradients,
    optimizer state.
    """

    def __init__(self, shard: Callable[[torch.Tensor], tuple[torch.Tensor, str]] = whole_tensor, *,
                 frozen_period: int = FROZEN_RESCAN_CHECKS):
        """frozen_period: how many checks the frozen parameters' records may stand in before every one is read
        again (NOTE: [frozen records]); 0 reads them at every check."""
        if not isinstance(frozen_period, int) or frozen_period < 0:
            raise ValueError(f"frozen_period={frozen_period!r}: give a number of checks, 0 or more")
        self._shard = shard
        self.frozen_period = frozen_period
        self._fast = False  # whether the last rebuild allows the per-step checks above
        # The module tree as dictionaries (each module's _modules), not modules: holding the root module would keep
        # a model alive that only the default Monitor's weak dictionary refers to.
        self._child_dicts: list[dict] = []
        self._children: list[torch.nn.Module] = []
        self._param_dicts: list[dict] = []
        self._raw_params: list = []  # every value of every module's parameter dict, duplicates and None included
        self._params: list[torch.Tensor] = []  # as named_parameters() gives them
        self._grad_absent: list[bool] = []
        self.no_gradients = False  # parameters that train, none with a gradient (a check in the wrong place)
        self._grad_contiguous: list[bool] = []  # per gradient with an input: whether it was contiguous
        self._permuted_grads: list[int] = []  # the others (dense in another dimension order, e.g. channels_last)
        self._state_values: list[Any] = []  # every value of every parameter's state, in optimizer.state's order
        self._state_tensors: list[torch.Tensor] = []  # the scanned ones, in input order
        # The parameters, then the state tensors, as the rebuild found them: data pointers, dtypes, sizes in bytes.
        self._stable_ptrs = np.empty(0, dtype=np.int64)
        self._stable_dtypes: list[torch.dtype] = []
        self._stable_nbytes = np.empty(0, dtype=np.int64)
        self._native_check = native_function("PlanCheck")  # the class; None for the check in Python
        self._native = None  # the rebuild's nanscan._C.PlanCheck, when the check can run in C++
        self._tensor_access = tensor_access()  # how that check reads tensors: None for Python calls
        self._templates: list[ScanInput] = []
        self._numels = self._codes = None
        self._identities: tuple[ScannedTensor, ...] = ()
        self._devices: tuple[str, ...] = ()
        # The last step's extra inputs (their identities), and their table and identities joined with the model's.
        self._extra_key: tuple[ScannedTensor, ...] | None = None
        self._extra_numels = self._extra_codes = self._extra_identities = None
        self._extra_devices: tuple[str, ...] = ()
        # The joined counts and codes as the one-call host scan takes them (nanscan._C.ScanTable, NOTE: [scan table]
        # in csrc/plan/plan_check.cpp), made with them; None without the extension.
        self._scan_table = native_function("ScanTable")
        self._extra_table = None
        self._group_params: list[tuple[list, int]] = []  # each optimizer group's parameter list and its length
        self._state_owners = 0
        self._update_targets: tuple[list[torch.Tensor], list[str]] | None = None
        # NOTE: [frozen records]: the frozen parameters (stable indices, tensors) and their standing carried part
        self._frozen_rows = np.empty(0, dtype=np.int64)
        self._frozen: list[torch.Tensor] = []
        self._frozen_part: tuple | None = None
        self._frozen_checks = 0  # checks the standing part has stood in since the frozen tensors were last read
        self.frozen_rescans = 0  # how often every frozen tensor was read again (a rebuild's first check, a period)
        self.rebuilds = 0

    def inputs(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               extra: StepInputs | Sequence[ScanInput] = ()) -> ScanInputs:
        """The inputs to scan this step: `extra` (the batch and the loss, prepared by the caller), then the model's
        parameters, gradients and optimizer state."""
        extra = as_step_inputs(extra)
        if self._unchanged_structure(model, optimizer):
            checked = self._check(optimizer, extra.ptrs)
            if checked is not None:
                ptrs, grads = checked
                numels, codes, identities, devices = self._joined(extra)
                return ScanInputs([*extra.items(), *self._templates], tensors=[None] * len(extra) + self._params +
                                  grads + self._state_tensors, ptrs=ptrs, numels=numels, codes=codes,
                                  identities=identities, devices=devices)
        return self._rebuilt_inputs(model, optimizer, extra)

    def launch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               extra: StepInputs | Sequence[ScanInput] = (),
               backend_for: Callable[[tuple[str, ...]], Any]) -> StepScan:
        """The scan of inputs(), launched by nanscan.engine.dispatch.launch; its `tensors` name them.
        `backend_for(devices)` gives the backend (or the mapping from device to backend) that launch takes. When nothing
        changed and every input is on the CPU for the native backend, the per-step check and the scan are one native
        call, the check running while the scan's threads wake up (NOTE: [wake overlap] in csrc/cpu/scan_cpu.cpp), and
        no ScanInputs is made."""
        extra = as_step_inputs(extra)
        done = self.scan_on_host(model, optimizer, extra=extra, backend_for=backend_for)
        if done is not None:
            return completed_scan(done.tensors, done.records, done.nonfinite, done.backend)
        inputs = self.inputs(model, optimizer, extra=extra)
        return launch(inputs, backend=backend_for(inputs.devices))

    def scan_on_host(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, extra: StepInputs,
                     backend_for: Callable[[tuple[str, ...]], Any], carried: tuple | None = None
                     ) -> HostScan | None:
        """launch()'s one native call on its own: a HostScan (identities, records, whether any tensor holds a NaN
        or an infinity, backend name, the step's summary) when nothing changed and every input is on the CPU for
        the native backend, else None, and nothing was scanned. The Monitor's every-step path on the CPU, which
        needs no StepScan.

        carried: (indices into stable_tensors(), their tensor_stamps, their records) from a scan since (nanscan.
        runtime.update NOTE: [carried records]): the tensors whose stamps did not move are not read again, their
        records are copied in; a step with a non-finite tensor is scanned whole. The plan's own frozen parameters'
        records join them (NOTE: [frozen records])."""
        if self._native is None or not self._unchanged_structure(model, optimizer):
            return None
        _, _, identities, devices = self._joined(extra)  # and self._extra_table, the scan's form of the rest
        backend = backend_for(devices)
        scan_planned = getattr(backend, "scan_planned", None)
        if scan_planned is None:
            return None
        state = None if optimizer is None else optimizer.state
        standing = self._frozen_part if self._frozen_checks < self.frozen_period else None
        if standing is not None:  # the post-update records are newer: later in the list, they win
            carried = standing if carried is None else [standing, carried]
        loss_row = len(extra.identities) - 1 if extra.has_loss else -1  # the loss is the last extra input
        scanned = scan_planned(self._native, state, extra.ptrs, self._extra_table, carried, loss_row)
        if scanned is None:
            return None
        if standing is not None:
            self._frozen_checks += 1
        elif self._frozen and self.frozen_period:
            self._keep_frozen(scanned[0], len(extra))
        return HostScan(identities, scanned[0], scanned[1], backend.name, scanned[2])

    def _keep_frozen(self, records: np.ndarray, num_extra: int) -> None:
        """The frozen parameters' records of a check that read them all, with their stamps now, as the standing part
        of the next checks (NOTE: [frozen records]); nothing where the stamps cannot be read natively."""
        self._frozen_checks = 0
        self.frozen_rescans += 1
        stamps = tensor_stamps(self._frozen)
        if self._tensor_access is None or (stamps[:, 2] < 0).any():
            self._frozen_part = None  # stamped in Python: they would never match the native reads
            return
        self._frozen_part = (self._frozen_rows, stamps, records[self._frozen_rows + num_extra], True)

    def stable_tensors(self) -> list[torch.Tensor]:
        """The parameters, then the optimizer-state tensors, that the last rebuild found and every passing per-step
        check confirms are the same objects at the same addresses (NOTE: [model scan plan]); empty where the plan
        keeps nothing between steps."""
        return self._params + self._state_tensors if self._fast else []

    def update_targets(self) -> tuple[list[torch.Tensor], list[str]]:
        """The stable tensors an optimizer update can write, and their scanned names: the parameters that have a
        gradient (the rebuild's, which every passing per-step check confirms) and the state tensors. A frozen
        weight, which no update writes, is not one of them (nanscan.runtime.update NOTE: [dated updates]). Kept
        per rebuild: a dated update asks after every optimizer.step(); ([], []) where the plan keeps nothing."""
        if not self._fast:
            return [], []
        if self._update_targets is None:
            states = len(self._state_tensors)
            written = [i for i, absent in enumerate(self._grad_absent) if not absent]
            names = [self._identities[i].name for i in written] + \
                [i.name for i in self._identities[len(self._identities) - states:]]
            self._update_targets = ([self._params[i] for i in written] + list(self._state_tensors), names)
        return self._update_targets

    @property
    def state_owners(self) -> int:
        """How many parameters had optimizer state at the last rebuild (Adam creates its state at the first
        update, which the plan sees at the next check)."""
        return self._state_owners

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Any, Any]:
        """(model state, optimizer state) for a bundle (NOTE: [tensor source]): their state_dict()s."""
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None

    def frozen_keys(self, model: torch.nn.Module) -> list[str]:
        """The keys of state()'s model state that are frozen parameters (requires_grad=False), which a bundle holds
        by reference (nanscan.bundle.frozen NOTE: [frozen references]); every name of a shared one."""
        return [key for key, value in model.state_dict(keep_vars=True).items()
                if isinstance(value, torch.nn.Parameter) and not value.requires_grad]

    def _unchanged_structure(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """The cheap part of the check, in Python: the last rebuild allows the fast path, the root's children
        are the dict it saw, and the optimizer's parameter groups are the lists it saw."""
        return self._fast and model._modules is self._child_dicts[0] and self._same_groups(optimizer)

    def _rebuilt_inputs(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                        extra: StepInputs) -> ScanInputs:
        state_values = [] if optimizer is None else [v for d in optimizer.state.values() for v in d.values()]
        named = named_parameters(model)  # NOTE: [state dict names]
        inputs = self._rebuild(model, named + _optimizer_only(named, optimizer), optimizer, state_values)
        return ScanInputs.join([ScanInputs(extra.items()), inputs])

    def _same_groups(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether the optimizer's parameter lists are the ones of the rebuild (add_param_group adds one; its
        parameters may be outside the model, and have no state before their first update). A few groups: cheap."""
        groups = () if optimizer is None else optimizer.param_groups
        if len(groups) != len(self._group_params):
            return False
        for group, (params, size) in zip(groups, self._group_params):
            held = group["params"]
            if held is not params or len(held) != size:
                return False
        return True

    def _check(self, optimizer: torch.optim.Optimizer | None, extra_ptrs: list[int]) -> tuple | None:
        """(data pointers of the extra inputs, parameters, gradients and state; the gradients) when nothing changed
        since the rebuild, else None. nanscan._C.PlanCheck does it in C++ (NOTE: [plan check] in
        csrc/plan/plan_check.cpp); this is the same check in Python, for gradients with permuted layouts and for
        installations without the extension."""
        state = None if optimizer is None else optimizer.state
        if self._native is not None:
            return self._native.check(state, extra_ptrs)
        if not (_same_objects([c for d in self._child_dicts for c in d.values()], self._children)
                and _same_objects([p for d in self._param_dicts for p in d.values()], self._raw_params)
                and _same_objects([] if state is None else [v for d in state.values() for v in d.values()],
                                  self._state_values)):
            return None
        params, tensors = self._params, self._state_tensors
        grads = [p.grad for p in params]
        if [g is None for g in grads] != self._grad_absent:
            return None
        grads = [g for g in grads if g is not None]
        if list(map(_is_contiguous, grads)) != self._grad_contiguous or \
                not all(is_dense_permutation(grads[i]) for i in self._permuted_grads):
            return None
        param_ptrs, state_ptrs = list(map(_data_ptr, params)), list(map(_data_ptr, tensors))
        stable = params + tensors
        if not np.array_equal(param_ptrs + state_ptrs, self._stable_ptrs) or \
                [t.dtype for t in stable] != self._stable_dtypes or \
                not np.array_equal([t.nbytes for t in stable], self._stable_nbytes):
            return None
        return np.array(extra_ptrs + param_ptrs + list(map(_data_ptr, grads)) + state_ptrs, dtype=np.int64), grads

    def _joined(self, extra: StepInputs) -> tuple[np.ndarray, np.ndarray, tuple, tuple[str, ...]]:
        """The step's table without pointers (counts, codes, identities, devices), `extra` first. The batch and the
        loss change their identities (name, dtype, device, size, format) only when the batch's structure or shapes
        do, so the joined table is kept until they do (a BatchPlan hands the same tuple every step), and with it
        `_extra_table`, the same counts and codes as the one-call host scan takes them."""
        key = extra.identities
        if key is not self._extra_key and key != self._extra_key:
            self._extra_key = key
            self._extra_numels = np.concatenate([np.array([i.numel for i in key], np.int64), self._numels])
            self._extra_codes = np.concatenate([np.array([i.scanned_code for i in key], np.int32), self._codes])
            self._extra_table = None if self._scan_table is None else \
                self._scan_table(self._extra_numels, self._extra_codes)
            self._extra_identities = (*key, *self._identities)
            devices = self._devices
            if any(i.device not in devices for i in key):
                devices = tuple(dict.fromkeys([*(i.device for i in key), *devices]))
            self._extra_devices = devices
        return self._extra_numels, self._extra_codes, self._extra_identities, self._extra_devices

    def _rebuild(self, model: torch.nn.Module, named: list, optimizer: torch.optim.Optimizer | None,
                 state_values: list) -> ScanInputs:
        """Prepare every tensor (the uncached path), and keep what the next steps' checks compare against."""
        self.rebuilds += 1
        self._update_targets = None
        self._frozen_rows, self._frozen, self._frozen_part = np.empty(0, dtype=np.int64), [], None
        items: list[ScanInput] = []
        fast = True

        def add(kind: str, name: str, t: torch.Tensor, key: str = "") -> bool:
            nonlocal fast
            local, suffix = self._shard(t)
            item = prepare(tensor_name(kind, f"{name}{suffix}{key}"), local)
            if item is None or item.tensor is not t or item.layout == GAPPED:
                fast = False  # skipped (integer), derived (complex parts, sparse values, a shard) or compacted
            if item is not None:
                items.append(item)
            return item is not None

        grads = [p.grad for _, p in named]
        for name, p in named:
            add("parameter", name, p)
        for (name, _), g in zip(named, grads):
            if g is not None:
                add("gradient", name, g)
        state_tensors = []
        if optimizer is not None:
            names = {id(p): name for name, p in named}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    pname = names[id(p)]
                    for key, value in optimizer.state.get(p, {}).items():
                        if _scanned_state(value):
                            if add("optimizer_state", pname, value, f".{key}"):
                                state_tensors.append(value)
                        elif isinstance(value, list):
                            # LBFGS keeps its curvature history (old_dirs, old_stps, ro, al) as lists that it
                            # changes in place, which the per-step check cannot see: rebuild every step.
                            fast = False
                            for i, element in enumerate(value):
                                if _scanned_state(element):
                                    add("optimizer_state", pname, element, f".{key}.{i}")
        inputs = ScanInputs(items)
        modules = list(model.modules())
        self._fast = fast and all(map(_uses_module_walk, modules))
        if self._fast:
            params = [p for _, p in named]
            self._child_dicts = [m._modules for m in modules]
            self._children = [c for d in self._child_dicts for c in d.values()]
            self._param_dicts = [m._parameters for m in modules]
            self._raw_params = [p for d in self._param_dicts for p in d.values()]
            self._params = params
            self._grad_absent = [g is None for g in grads]
            # a change of which parameters have gradients rebuilds the plan, so this holds for every later step
            self.no_gradients = any(p.requires_grad for p in params) and all(self._grad_absent)
            present = [g for g in grads if g is not None]
            grad_items = items[len(params) : len(params) + len(present)]
            self._grad_contiguous = [item.layout == CONTIGUOUS for item in grad_items]
            self._permuted_grads = [i for i, contiguous in enumerate(self._grad_contiguous) if not contiguous]
            self._state_values, self._state_tensors = state_values, state_tensors
            # NOTE: [frozen records]: no gradient (the per-step check confirms it stays absent) and none to come
            frozen = [j for j, p in enumerate(params) if not p.requires_grad and grads[j] is None]
            self._frozen_rows = np.array(frozen, dtype=np.int64)
            self._frozen = [params[j] for j in frozen]
            stable = params + state_tensors
            self._stable_ptrs = np.array(list(map(_data_ptr, stable)), dtype=np.int64)
            self._stable_dtypes = [t.dtype for t in stable]
            self._stable_nbytes = np.array([t.nbytes for t in stable], dtype=np.int64)
            self._templates = [bind(item, None) for item in items]  # descriptions only: no tensor kept
            self._native = None if self._native_check is None or self._permuted_grads else self._native_check(
                self._child_dicts, self._children, self._param_dicts, self._raw_params, self._state_values, params,
                self._grad_absent, self._state_tensors, self._stable_ptrs, self._stable_dtypes, self._stable_nbytes,
                _data_ptr, _is_contiguous, self._tensor_access)
            _, self._numels, self._codes = inputs.table()
            self._identities = inputs.identities
            self._devices = inputs.devices
            self._extra_key = None
            groups = () if optimizer is None else optimizer.param_groups
            self._group_params = [(group["params"], len(group["params"])) for group in groups]
            self._state_owners = 0 if optimizer is None else len(optimizer.state)
        else:  # nothing is kept: the next step prepares everything again
            self._child_dicts, self._children, self._param_dicts, self._raw_params = [], [], [], []
            self._params, self._state_values, self._state_tensors, self._templates = [], [], [], []
            self._group_params = []
            self._native = None
        return inputs


_native_stamps = native_function("tensor_stamps")
_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")
_dtype_numbers: dict[torch.dtype, int] = {}


def tensor_stamps(tensors: list[torch.Tensor]) -> np.ndarray:
    """What an in-place write, a `.data` swap or a dtype change alters, per tensor: an (n, 3) int64 array of
    (autograd version counter, data pointer, dtype), compared with `==` between two moments of a run (nanscan.
    runtime.update NOTE: [carried records]). Read in one native call through nanscan._torch_access where it was
    built for this torch (about 0.03 us a tensor on the demo model), else through Python (about 0.2 us). The
    Python reads number dtypes below zero, where no torch scalar type is: their stamps never equal the ones
    nanscan._C.PlanCheck reads natively, so a tensor stamped in Python is never taken as unchanged there."""
    access = tensor_access()
    if access is not None and _native_stamps is not None:
        stamps = _native_stamps(tensors, access)
        if stamps is not None:
            return stamps
    out = np.empty((len(tensors), 3), dtype=np.int64)
    out[:, 0] = list(map(_VERSION, tensors))
    out[:, 1] = list(map(_data_ptr, tensors))
    out[:, 2] = [_dtype_numbers.setdefault(d, -1 - len(_dtype_numbers)) for d in map(_DTYPE, tensors)]
    return out


def _scanned_state(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _optimizer_only(named: list, optimizer: torch.optim.Optimizer | None) -> list:
    """(name, parameter) for the optimizer's parameters that are not the model's (a loss weight or temperature
    kept beside the model): the optimizer updates them, so they are scanned too, named by where the optimizer
    holds them: `optimizer.param_groups.<group>.params.<index>`."""
    if optimizer is None:
        return []
    known = {id(p) for _, p in named}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in known:
                known.add(id(p))
                out.append((f"optimizer.param_groups.{g}.params.{i}", p))
    return out
