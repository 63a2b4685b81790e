"""A window of the run (Monitor(window=...)): the model and optimizer state kept every few steps, in a ring, and
every step's batches, sample ids, learning rates, loss scale, precision and RNG state since the oldest kept state,
so that the steps that led to an incident can be run again from before the damage (NOTE: [run window]).

NOTE: [run window]
A cause that builds up over many steps (a learning rate too large for its warm-up) has done its damage long before
the step that goes non-finite: by then no change to that step alone can tell the cause from a coincidence. So the
Monitor keeps enough to rerun the last `steps` optimizer steps (at least; Window):
  - states: the model's state (trainable parameters and buffers; frozen parameters are in every bundle by
    reference) and the optimizer's, copied at the start of a step (the forward pre-hook, begin_step; at the check,
    before the update, when no step start was seen) every `every` steps, into a ring of
    R = ceil(steps / every) + 1 copies whose buffers are allocated once and reused, so that the oldest kept state is
    at least `steps` steps back from any step once the run is that long, and at most steps + every - 1;
  - steps: from the oldest kept state on, each check's batch (every micro-batch's, with check(micro_batch=True)),
    sample ids, the learning rate of every param group, the GradScaler's scale, the autocast region of the step's
    forward and the torch generators' state at the step's start: the batch's CPU tensors held by reference, a
    GPU's copied into pinned host buffers, asynchronously (never a host sync; NOTE: [window batches]).
Memory: R x (the model's trainable parameters and buffers + the optimizer's state, in bytes) + (steps + every) x
(one step's batch tensors, every micro-batch; held, not copied, on the CPU: NOTE: [window batches]) of host memory.
At most `max_bytes` of it go to states (default: a quarter of the machine's memory); a run whose R states would
take more keeps as many as fit (fewer than 2: none, and the window holds its last `steps` steps only), and says so.
The default (steps=32, every=32) keeps 2 states: 6 times the trainable parameters' float32 bytes under Adam (2 x
1.86 GB for GPT-2-small's shapes), one copy every 32 steps (bench_window.py: 0.13 s there, 0.22% of a CPU step;
bench_overhead.py: 0.4-0.5% of the demo model's 11 ms step, with the stage in check()).
At an incident the window goes into the bundle (nanscan.bundle.format.RunWindow): the kept states that begin at or
before the failing step and the steps since the oldest. Window(directory=...) keeps the states on disk instead,
one host copy at a time (NOTE: [spilled states] in nanscan/runtime/spill.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from typing import Any, Callable, NamedTuple

import torch

from nanscan.bundle.format import RunWindow, WindowState, WindowStep
from nanscan.incident import warn_user
from nanscan.runtime.history import kept_scalar, read_scalar
from nanscan.runtime.loop_effects import UpdateFactorProbe
from nanscan.runtime.snapshot import CpuSnapshot, StateOf
from nanscan.runtime.spill import SpilledState, StateSpill
from nanscan.engine.inputs import named_parameters, plain_ids
from nanscan.runtime.verdict import retained

# The torch generators' states, as nanscan.bundle.provenance.capture_rng names them.
_TORCH_RNG_KEYS = ("torch_cpu", "torch_cuda")


class WindowWarning(UserWarning):
    """The window keeps less than asked (its states would not fit the memory it may use)."""


@dataclasses.dataclass(frozen=True)
class Window:
    """What the Monitor keeps of the run (NOTE: [run window]).

    steps: how many optimizer steps back from any step the window reaches at least (once the run is that long).
    every: a state is kept every `every` steps (the copy's cost is spread over them).
    max_bytes: host memory the kept states may take; None: a quarter of the machine's memory.
    directory: where to keep the states instead of host memory (NOTE: [spilled states]), for a model whose R states
        would not fit there; None: host memory."""

    steps: int = 32
    every: int = 32
    max_bytes: int | None = None
    directory: str | os.PathLike | None = None

    def __post_init__(self):
        for name in ("steps", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Window({name}={value!r}): give a number of steps, at least 1")
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int)
                                           or self.max_bytes < 0):
            raise ValueError(f"Window(max_bytes={self.max_bytes!r}): give a number of bytes, or None for a quarter "
                             "of the machine's memory")
        if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
            raise TypeError(f"Window(directory={self.directory!r}): give a directory path, or None to keep the states "
                            "in host memory")

    @property
    def states(self) -> int:
        """R, the kept states: enough that the oldest is at least `steps` back from any step."""
        return -(-self.steps // self.every) + 1

    def state_budget(self) -> int:
        if self.max_bytes is not None:
            return self.max_bytes
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        except (ValueError, OSError, AttributeError):  # no sysconf here: no bound of our own
            return 1 << 62


def reloads(source: Any) -> bool:
    """Whether a Monitor's TensorSource (None: the module's own) can load a kept state back (NOTE: [tensor
    source]): the window keeps states only then."""
    return source is None or callable(getattr(source, "load_state", None))


def window_setting(window: Any, source: Any = None) -> Window | None:
    """Monitor(window=...) as a Window: "default" (Window(), or None for a `source` that cannot load a state back),
    a Window, an int (steps, the default spacing), or None (off)."""
    if window == "default":
        return Window() if reloads(source) else None
    if window is not None and not reloads(source):
        raise ValueError("window= with a TensorSource (source=) that cannot load a state back (no load_state): "
                         "the framework keeps the model's tensors outside the module's state, which the window "
                         "copies; pass window=None")
    if window is None or isinstance(window, Window):
        return window
    if isinstance(window, int) and not isinstance(window, bool):
        return Window(steps=window, every=min(Window.every, window))
    raise TypeError(f"window={window!r}: give a nanscan.runtime.window.Window(steps=..., every=...), a number of "
                    "steps, or None to keep no window")


class _Held(NamedTuple):
    """What one step's batch holds: CPU tensors by reference with their version counters and addresses, and the
    host buffers its copies took (with their pool keys)."""

    references: list[tuple[torch.Tensor, int, int]]  # (tensor, its version at the check, its data_ptr)
    buffers: list[tuple[tuple, torch.Tensor]]


class _StepBatches:
    """Each step's batch as the window holds it (NOTE: [window batches]).

    NOTE: [window batches]
    Data loaders make new batch tensors every step (collate, torch.stack, .pin_memory(), .to()), so a CPU batch
    tensor is held by reference with its version counter and address: no copy (copying the demo's three batch
    tensors took ~90 us of a check in a training step, 0.75% of it). The same tensor again, unchanged (a loop that
    trains on a fixed set of batches), is held again. A loop that refills a tensor in place is seen either way: its
    version counter moved (a torch write: at the step that brings it back, or by the incident), or another tensor
    object wraps the address a kept step holds (torch.from_numpy over a reused array, whose writes no version
    counter sees). From the first such step on, every step's CPU tensors are copied, and the steps held by
    reference until then say their batch was overwritten (a bundle holds no batch for them, and says why). A GPU
    tensor is copied into a pinned host buffer, asynchronously (no host sync, and no GPU memory held for the
    window); buffers come back to a pool as steps leave the window. A tensor met twice in one step (sample ids that
    are a column of the batch) is held once. Containers are rebuilt as nanscan.runtime.verdict.retained rebuilds
    them."""

    def __init__(self):
        self.copy_cpu = False  # set once the loop was seen to refill a batch tensor in place
        self._free: dict[tuple, list[torch.Tensor]] = {}
        # data_ptr -> [the tensor held there by reference, its version when last kept, how many kept steps hold it]
        self._held_ptrs: dict[int, list] = {}
        self.overwritten: set[int] = set()  # the addresses a kept step held when the loop refilled them
        self._held: _Held | None = None  # the step being kept
        self._seen: dict[int, torch.Tensor] = {}

    def keep_step(self, batch: Any, sample_ids: Any) -> tuple[Any, Any, _Held]:
        """The step's batch and sample ids as held, and what they hold (for release and changed)."""
        held = self._held = _Held([], [])
        self._seen = {}
        if type(batch) is dict and not self.copy_cpu:
            batch = self._keep_dict(batch)
        else:
            batch = retained(batch, self._keep_tensor)
        if sample_ids is not None:
            same = next((t for t, _, _ in held.references if t is sample_ids), None)  # a column of the batch
            sample_ids = same if same is not None else retained(sample_ids, self._keep_tensor)
        self._held, self._seen = None, {}
        for tensor, version, ptr in held.references:
            entry = self._held_ptrs.get(ptr)
            if entry is None:
                self._held_ptrs[ptr] = [tensor, version, 1]
            else:
                entry[2] += 1
        return batch, sample_ids, held

    def _keep_dict(self, batch: dict) -> dict:
        """The usual batch, a dict of CPU tensors, held by reference with as few reads as can be (every step)."""
        kept, references, entries = {}, self._held.references, self._held_ptrs
        for key, value in batch.items():
            if type(value) is torch.Tensor and not value.is_cuda:
                ptr, version = value.data_ptr(), value._version
                entry = entries.get(ptr)
                if entry is None or (entry[0] is value and entry[1] == version):
                    references.append((value, version, ptr))
                    kept[key] = value
                    continue
            kept[key] = retained(value, self._keep_tensor)
        return kept

    def _keep_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        seen = self._seen.get(id(tensor))  # a tensor met twice in one step is held once
        if seen is not None:
            return seen
        on_gpu = tensor.is_cuda  # not tensor.device: a torch.device costs ~20 us cold, inside a training step
        if not on_gpu and not self.copy_cpu:
            ptr, version = tensor.data_ptr(), tensor._version
            entry = self._held_ptrs.get(ptr)
            if entry is None or (entry[0] is tensor and entry[1] == version):  # new, or the same one unchanged
                self._held.references.append((tensor, version, ptr))
                self._seen[id(tensor)] = tensor
                return tensor
            self.copy_cpu = True  # the loop refilled a tensor a kept step holds: copy from now on
            self.overwritten.add(ptr)
        if tensor.is_quantized or tensor.layout != torch.strided:  # no plain buffer holds it: a copy of its own
            copy = tensor.clone()
        else:
            key = (tuple(tensor.shape), tensor.dtype, on_gpu)
            free = self._free.get(key)
            copy = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu)
            copy.copy_(tensor, non_blocking=on_gpu)
            self._held.buffers.append((key, copy))
        self._seen[id(tensor)] = copy
        return copy

    def release(self, held: _Held) -> None:
        """A step left the window: its buffers go back to the pool, its references are let go."""
        for key, buffer in held.buffers:
            self._free.setdefault(key, []).append(buffer)
        for _, _, ptr in held.references:
            entry = self._held_ptrs[ptr]
            entry[2] -= 1
            if not entry[2]:
                del self._held_ptrs[ptr]
                self.overwritten.discard(ptr)

    def changed(self, held: _Held) -> bool:
        """Whether the loop wrote into a tensor this step holds by reference since its check."""
        return any(ptr in self.overwritten or tensor._version != version for tensor, version, ptr in held.references)

    @staticmethod
    def nbytes(held: _Held) -> int:
        return sum(t.numel() * t.element_size() for t, _, _ in held.references) + \
            sum(b.numel() * b.element_size() for _, b in held.buffers)


class _Step(NamedTuple):
    """A check as the window keeps it until an incident (a WindowStep then)."""

    step: int
    micro: int | None
    batch: Any
    sample_ids: Any
    lrs: list
    scaling: Any  # the GradScaler's Scaling, read at the incident
    autocast: dict | None
    rng: dict | None  # the generators' states at the step's start (capture_rng's), None without a step start
    held: _Held
    loss: Any = None  # the loss the loop passed, kept as the history keeps one (NOTE: [observed loop])


@dataclasses.dataclass
class _Kept:
    step: int | None  # set by the check of the step it starts (None until then)
    snapshot: CpuSnapshot | None  # None where the state goes to the window's directory
    pre_step: bool
    spilled: SpilledState | None = None  # written to the directory, once its step is known


class WindowKeeper:
    """The Monitor's window (NOTE: [run window]): `begin(model, optimizer)` at a step's start, `keep(...)` at each
    check (a stage of check(), nanscan.runtime.stages NOTE: [check stages]), `record(step)` at an incident."""

    def __init__(self, window: Window, *, local: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 state_of: StateOf | None = None):
        """`local`: what of a tensor this process copies (a DTensor's local shard); `state_of`: the state a kept
        copy takes (a framework's TensorSource's `state`: NOTE: [tensor source]), default the state_dict()s."""
        self.window = window
        self._local = local
        self._state_of = state_of
        self._states: deque[_Kept] = deque()
        self._capacity = window.states  # lowered where the states would not fit (NOTE: [run window])
        self._starting: _Kept | None = None  # taken at a step's start, not yet claimed by its check
        self._steps: deque[_Step] = deque()
        self._since_state = 0  # steps checked since the newest kept state began
        self._batches = _StepBatches()
        self._frozen: tuple | None = None  # (the model's trainable-parameter ids, the frozen keys)
        # NOTE: [spilled states]: with a directory, one host copy at a time, written there in the background
        self.spill = StateSpill(window.directory, local) if window.directory is not None else None
        self.update_factors = UpdateFactorProbe()  # NOTE: [observed loop]

    # -- states -------------------------------------------------------------------------------------------------
    def due(self) -> bool:
        return self._capacity >= 2 and (not self._states or self._since_state >= self.window.every)

    def begin(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """At a step's start (before its forward): keep the state when one is due."""
        if self._starting is None and self.due():
            self._starting = self._capture(model, optimizer, pre_step=True)

    def _capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 pre_step: bool) -> _Kept | None:
        if self.spill is not None:  # NOTE: [spilled states]: the ring is on disk, bounded by R, not by memory
            if len(self._states) >= self._capacity:
                self.spill.remove(self._states.popleft().spilled)
            self.spill.capture(model, optimizer, skip=self._frozen_keys(model), state_of=self._state_of)
            return _Kept(None, None, pre_step)
        if len(self._states) >= self._capacity:
            snapshot = self._states.popleft().snapshot  # its buffers are reused
        else:
            snapshot = CpuSnapshot(self._local)
        snapshot.capture(model, optimizer, skip=self._frozen_keys(model), state_of=self._state_of)
        self._fit(snapshot.nbytes())
        return _Kept(None, snapshot, pre_step) if self._capacity >= 2 else None

    def _fit(self, size: int) -> None:
        """As many states as fit the budget (NOTE: [run window]); checked at every kept state, as the optimizer's
        state appears at its first step."""
        budget = self.window.state_budget()
        fits = budget // size if size else self._capacity
        if fits >= self._capacity:
            return
        self._capacity = int(fits)
        while self._states and len(self._states) >= max(self._capacity, 1):
            self._states.popleft()
        if self._capacity < 2:
            self._states.clear()
        kept = "no state (the window holds its steps only)" if fits < 2 else f"{fits} states"
        warn_user(f"nanscan: the window's {self.window.states} kept states would take {self.window.states * size:,} "
                  f"bytes of host memory, more than the {budget:,} it may use (Window(max_bytes=...)); it keeps "
                  f"{kept}, so a replay of the window reaches {max(fits - 1, 0) * self.window.every} steps back at "
                  "least; pass window=Window(steps=..., every=..., max_bytes=...) to choose, "
                  "Window(directory=...) to keep the states on disk, or window=None", WindowWarning)

    def _frozen_keys(self, model: torch.nn.Module) -> frozenset:
        """The state keys of frozen parameters, which a bundle holds by reference (the window need not copy them)."""
        trainable = tuple(id(p) for p in model.parameters() if p.requires_grad)
        if self._frozen is None or self._frozen[0] != trainable:
            frozen = frozenset(name for name, p in named_parameters(model) if not p.requires_grad)
            self._frozen = (trainable, frozen)
        return self._frozen[1]

    # -- steps --------------------------------------------------------------------------------------------------
    def keep(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
             micro: int | None, started: bool, batch: Any, sample_ids: Any, scaling: Any, autocast: dict | None,
             rng: dict | None, loss: Any = None) -> None:
        """At a check (or an observed micro-batch): claim the state its step's start kept (or keep one now, before
        the update, when due and no step start was seen), then record the step, with the loss the loop passed and,
        at a step's own check, the sample its update will be compared with (NOTE: [observed loop])."""
        starting, self._starting = self._starting, None
        if starting is None and micro in (None, 0) and self.due():
            starting = self._capture(model, optimizer, pre_step=False)
        if starting is not None:
            starting.step = step
            if self.spill is not None:
                starting.spilled = self.spill.write(step)
            self._states.append(starting)
            self._since_state = 0
            self._forget_steps_before(self._states[0].step)
        if micro is None:  # an optimizer step's own check (its micro-batch checks come before it)
            self._since_state += 1
            self.update_factors.attach(optimizer)
            self.update_factors.arm(model, step)
        # NOTE: [window batches]: every step, so as little as can be: the record stays a tuple until an incident
        lrs = [group.get("lr") for group in optimizer.param_groups] if optimizer is not None else []
        for lr in lrs:
            if type(lr) is not float:  # a tensor learning rate: a copy, read at the incident
                lrs = [kept_scalar(lr) for lr in lrs]
                break
        batch, sample_ids, held = self._batches.keep_step(batch, sample_ids)
        self._steps.append(_Step(step, micro, batch, sample_ids, lrs, scaling, autocast, rng if started else None,
                                 held, kept_scalar(loss)))
        if not self._states:  # no state to start from (none fits): the last `steps` steps, for what they show
            while len(self._steps) > self.window.steps:
                self._drop_step()

    def _forget_steps_before(self, step: int) -> None:
        while self._steps and self._steps[0].step < step:
            self._drop_step()

    def _drop_step(self) -> None:
        dropped = self._steps.popleft()
        self._batches.release(dropped.held)
        if dropped.micro is None:
            self.update_factors.forget(dropped.step)

    # -- at an incident -----------------------------------------------------------------------------------------
    def record(self, step: int) -> RunWindow:
        """The window up to `step` (its states that begin at or before it, its steps up to it), as a bundle holds
        it; reading it waits for the copies (a GPU's), which an incident may."""
        states = []
        for kept in self._states:
            if kept.step is None or kept.step > step:
                continue
            if kept.spilled is not None:  # NOTE: [spilled states]: the bundle takes its files as they are
                failure = self.spill.failure(kept.spilled)
                if failure:
                    warn_user(failure, WindowWarning)
                if failure is None:
                    files = tuple(str(path) for path in kept.spilled.files)
                    states.append(WindowState(kept.step, {}, None, kept.pre_step, files=files,
                                              has_optimizer=kept.spilled.has_optimizer))
                continue
            model_state, optimizer_state = kept.snapshot.result()
            states.append(WindowState(kept.step, dict(model_state), optimizer_state, kept.pre_step))
        steps = [self._recorded(kept) for kept in self._steps if kept.step <= step]
        return RunWindow(steps=self.window.steps, every=self.window.every, states=states, records=steps)

    def _recorded(self, kept: _Step) -> WindowStep:
        """A kept step as the bundle holds it: its scalars read, its batch left out if the loop overwrote it."""
        changed = self._batches.changed(kept.held)
        rng = _torch_rng(kept.rng)
        return WindowStep(step=kept.step, micro_batch=kept.micro, batch=None if changed else kept.batch,
                          sample_ids=None if changed else kept.sample_ids, lrs=[read_scalar(lr) for lr in kept.lrs],
                          loss_scale=None if kept.scaling is None else kept.scaling.scale,
                          autocast=dict(kept.autocast) if kept.autocast else None, rng=rng,
                          note="the loop wrote into this step's batch tensors after its check (NOTE: [window "
                               "batches])" if changed else None, loss=read_scalar(kept.loss),
                          update_factor=self.update_factors.take(kept.step) if kept.micro is None else None)

    # -- a rollback (nanscan.runtime.rollback NOTE: [rollback]) ----------------------------------------------------
    def state_at_or_before(self, step: int) -> tuple[_Kept, tuple, dict | None, float | None] | None:
        """The newest kept state that began at or before `step`: it, its (model state, optimizer state), and the
        torch generators' state and GradScaler scale recorded at its step's start; None when there is none. Raises
        ValueError for a state kept on disk (Window(directory=...)), which a rollback does not read back."""
        for kept in reversed(self._states):
            if kept.step is None or kept.step > step:
                continue
            if kept.snapshot is None:
                raise ValueError("the window keeps its states on disk (Window(directory=...)), which a rollback does "
                                 "not read back; keep them in host memory (the default) to roll back")
            record = next((s for s in self._steps if s.step == kept.step), None)
            rng = _torch_rng(record.rng) if record is not None else None
            scale = record.scaling.scale if record is not None and record.scaling is not None else None
            return kept, kept.snapshot.result(), rng, scale
        return None

    def steps_between(self, first: int, last: int) -> list[dict]:
        """The kept steps from `first` through `last`: their step and sample ids (a rollback skips them)."""
        ids: dict[int, list] = {}
        for s in self._steps:
            if first <= s.step <= last:
                kept = ids.setdefault(s.step, [])
                if s.sample_ids is not None:  # each micro-batch's, as its check gave them
                    kept.append(plain_ids(s.sample_ids))
        return [{"step": step, "sample_ids": (kept[0] if len(kept) == 1 else kept) or None}
                for step, kept in ids.items()]

    def restart(self, kept: _Kept, step: int) -> None:
        """After a rollback to `kept`: it becomes the state the steps from `step` on start from, and the steps and
        states of the abandoned branch are let go."""
        for other in self._states:
            if other is not kept and other.spilled is not None:
                self.spill.remove(other.spilled)
        self._states = deque([kept])
        kept.step = step
        self.update_factors.forget_after(step - 1)
        while self._steps:
            self._drop_step()
        self._starting, self._since_state = None, 0

    def kept_steps(self) -> list[int]:
        """The steps the window holds now (a step checked per micro-batch appears once)."""
        return sorted({s.step for s in self._steps})

    def kept_states(self) -> list[int]:
        return [kept.step for kept in self._states if kept.step is not None]

    def nbytes(self) -> int:
        """Host bytes the window holds now: its states (a spill's one set of buffers) and its steps' copies."""
        states = self.spill.nbytes() if self.spill is not None else \
            sum(kept.snapshot.nbytes() for kept in self._states)
        return states + sum(self._batches.nbytes(kept.held) for kept in self._steps)


def _torch_rng(rng: dict | None) -> dict | None:
    """The torch generators' part of a step start's RNG states (capture_rng's), as a window keeps them."""
    return {key: rng[key] for key in _TORCH_RNG_KEYS if key in rng} if rng else None


def window_span(record: RunWindow) -> tuple[int, int] | None:
    """(first, last) step of a recorded window, or None when it holds no step."""
    steps = [s.step for s in record.records]
    return (min(steps), max(steps)) if steps else None


