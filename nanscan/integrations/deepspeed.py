"""DeepSpeed (ZeRO stages 0 to 3) for the Monitor: each rank scans the partitions it holds, under the parameter names
they belong to, and its bundle part stores them.

    from nanscan.integrations.deepspeed import DeepSpeedMonitor
    mon = DeepSpeedMonitor(engine, on_invalid="raise")        # engine from deepspeed.initialize(...)
    loss = engine(batch); engine.backward(loss); mon.check(batch=batch, loss=loss); engine.step()

NOTE: [zero partitions]
Under ZeRO a parameter's `.grad` is None when the Monitor looks (DeepSpeed reduces it into a flat partition and
clears it) and under ZeRO-3 its `.data` has no elements, so the plain plan (nanscan.engine.plans.ModelScanPlan) saw
nothing. ZeroSource (a nanscan.engine.plans.TensorSource, NOTE: [tensor source]) reads, per parameter, the pieces this
rank holds, as views (`narrow`) into DeepSpeed's own buffers, never copies, read after engine.backward() and
before engine.step(), which frees them:
  - ZeRO-1/2 (DeepSpeedZeroOptimizer) and the bf16 optimizer of stage 0: the parameter's `_hp_mapping` (a
    deepspeed.utils.tensor_fragment.tensor_fragment, set by link_hp_params) says which elements of it this rank's
    partition holds (`lp_fragment_address`) and where they sit in the flat fp32 master partition
    (`hp_fragment_address`); its gradient fragment is `get_lp_grad_fragment(param._index_in_param_group)`, an entry
    of `averaged_gradients[group]` (narrowed to the fragment where DeepSpeed keeps the whole parameter's buffer,
    as get_full_hp_grad does). The low-precision weights are whole on every rank.
  - ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): `grad_position[param id]` is (sub-group, offset, count) of the
    parameter's partition in the sub-group's flat buffers: the fp32 masters `fp32_partitioned_groups_flat[g]`, the
    gradients `averaged_gradients[g][i]` (views of `grad_partitions_flat_buffer`; under offload_optimizer, where
    averaged_gradients stays empty, that buffer read in its own layout), the inner optimizer's state
    keyed by the flat master; the low-precision weights are `param.ds_tensor`. A partition is `partition_numel()`
    elements; rank r holds the parameter's flattened elements [r * n, (r + 1) * n), the last rank's tail being
    padding, which is not scanned.
  - the inner optimizer's state tensors shaped like the flat master (Adam's exp_avg, exp_avg_sq) are narrowed the
    same way, as tensor_fragment.set_optim_state_fragment does; scalar state (step) is skipped.
Names follow NOTE: [tensor names] with the FSDP suffix of this rank's partition (`@shard<rank>/<world>` over the
data-parallel group): `param:<name>` (ZeRO-1/2, whole) or `param:<name>@shard1/2` (ZeRO-3), `grad:<name>@shard1/2`,
`optim:<name>@shard1/2.master` (the fp32 master weights), `optim:<name>@shard1/2.exp_avg`. A parameter with no
elements in this rank's partition has no grad:/optim: inputs here. The buffers are new objects after most steps, so
the source prepares its inputs each check (Python, a few microseconds per tensor; the scan itself is one fused
pass, as for any model).

The bundle. Each rank's part stores what it holds (NOTE: [tensor source] `state`), with no collective (under
agreement="async" a rank writes its part alone): under ZeRO-1/2 the whole low-precision weights (the module's
state_dict()); under ZeRO-3 their local shards; and always the fp32 master and optimizer-state fragments, keyed by
the scanned names. The inner optimizer's own state_dict() is not called: under ZeRO-3 it raised KeyError.

NOTE: [zero window]
DeepSpeed keeps a window of its partitions (nanscan.runtime.window NOTE: [run window]): what a bundle stores of a
rank (ZeroSource.state: the low-precision weights, ZeRO-3's local shards, the fp32 master and optimizer-state
fragments) plus the engine's counters, the things besides tensors that make the next step what it was: the engine's
global_steps, global_samples, micro_steps and skipped_steps, the ZeRO optimizer's micro_step_id (a nonzero one makes
the next backward accumulate into the partitions), the inner optimizer's per-state scalars (Adam's step), the fp16
loss scaler's scale and hysteresis, and the lr scheduler's state_dict() where it is plain data. ZeroSource.load_state
copies a kept state back into DeepSpeed's own buffers in place (the views state() took: no buffer is replaced, so
the engine's references stay valid), drops an inner optimizer state the kept copy did not have yet, and under ZeRO-3
gathers the persistent parameters again (a collective: every rank loads together, as the in-process diagnosis does).
Verified bit for bit: three steps from a loaded state give the same losses as the first time, under ZeRO-1, 2 and 3
in float32 and bf16, with and without clipping. The window's rerun then steps the engine itself (DeepSpeedDriver,
nanscan.runtime.rerun NOTE: [step driver]): step_fn is given the engine, engine.backward scales the loss,
engine.step clips by the config (the loop's clipping, declared; a clipping factor sets the threshold for its steps)
and skips by its overflow check, and the precision is the engine's, which no factor changes. The live state is
copied to the host before the diagnosis and loaded back after (tests/test_deepspeed.py compares the partitions and
counters before and after). Not rerun: gradient_accumulation_steps > 1 (the window holds the boundary's batch only).
on_invalid=Rollback loads a kept state the same way (progress=False: the engine's step counters and lr schedule go
on from the live step) and drops the failing step's update as for a torch optimizer (NOTE: [dropped update]): the
Monitor's optimizer is the inner torch optimizer, whose step pre-hook sets the flat fp32 masters' gradients to None,
which DeepSpeed assigns inside engine.step() just before it, so the step changes no master and the low-precision
weights copied from them are the kept ones again.

Skipped steps. DeepSpeed skips an update itself when its overflow check finds a non-finite gradient (fp16 loss
scaling, bf16 with `check_grad_overflow`), logging "OVERFLOW! Skipping step" on rank 0 without naming a tensor.
Under bf16 and fp32 there is no loss scale to back off, so such a step is an incident here, caught at its check as
category "gradient" before engine.step() skips it. Under fp16 dynamic loss scaling an overflow is expected; see
DeepSpeedMonitor for how it is told apart. Whatever the precision, a streak of DEFAULT_MAX_SKIPS steps that
DeepSpeed skipped in a row (`engine.skipped_steps`) warns (DeepSpeedSkipWarning): every update is being dropped.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Iterator, Sequence

import deepspeed
import torch
from deepspeed import comm as ds_comm
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from nanscan.runtime.amp import MAX_SKIPS
from nanscan.runtime.distributed import SHARD_SUFFIX
from nanscan.incident import GradientWarning, is_kind, tensor_name, warn_user
from nanscan.engine.inputs import ScanInputs, prepare
from nanscan.runtime.monitor import Monitor
from nanscan.runtime.rerun_inputs import ReplayError
from nanscan.engine.plans import ModelScanPlan, StepInputs, as_step_inputs

__all__ = ["DeepSpeedMonitor", "ZeroSource", "DeepSpeedSkipWarning", "DEFAULT_MAX_SKIPS", "zero_tensors"]

DEFAULT_MAX_SKIPS = MAX_SKIPS  # the GradScaler default (nanscan.runtime.amp NOTE: [overflow skips])
MASTER = "master"  # the state key of the fp32 master weights in `optim:` names


class DeepSpeedSkipWarning(GradientWarning):
    """DeepSpeed skipped every update of a streak of steps (its overflow check)."""


def _shard(rank: int, world: int) -> str:
    return f"{SHARD_SUFFIX}{rank}/{world}"


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense buffer; a strided one as it is (reshape would copy it, and prepare reads it in place)."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else t


def _flat_state(inner: Any, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The inner optimizer's state tensors of one flat master that are shaped like it (exp_avg, exp_avg_sq)."""
    state = getattr(inner, "state", {}).get(flat, {})
    return [(key, value) for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.shape == flat.shape]


def _zero12_tensors(optimizer: Any, names: dict[int, str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(kind, name, view) for ZeRO-1/2 and the stage-0 bf16 optimizer (NOTE: [zero partitions])."""
    groups = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None) or []
    dp_groups = getattr(optimizer, "real_dp_process_group", None)
    inner = optimizer.optimizer
    for g, params in enumerate(groups):
        dp_group = dp_groups[g] if dp_groups is not None else None
        suffix = _shard(ds_comm.get_rank(group=dp_group), ds_comm.get_world_size(group=dp_group))
        flat = inner.param_groups[g]["params"][0] if g < len(inner.param_groups) else None
        state = _flat_state(inner, flat) if flat is not None else []
        for p in params:
            name = names.get(id(p))
            if name is None:
                continue
            yield "parameter", name, p.detach()
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue  # none of this parameter's elements is in this rank's partition
            lp = mapping.lp_fragment_address
            try:
                grad = mapping.get_lp_grad_fragment(p._index_in_param_group)
            except (ValueError, KeyError, IndexError, TypeError):
                grad = None  # before the first backward, or after engine.step() freed it
            if grad is not None:
                grad = _flat(grad)
                if grad.dim() == 1 and grad.numel() == p.numel() and lp.numel != p.numel():
                    grad = grad.narrow(0, lp.start, lp.numel)  # a whole-parameter buffer (as get_full_hp_grad)
                yield "gradient", name + suffix, grad
            yield "optimizer_state", f"{name}{suffix}.{MASTER}", mapping.hp_fragment.detach()
            hp = mapping.hp_fragment_address
            for key, value in state:
                yield "optimizer_state", f"{name}{suffix}.{key}", value.detach().narrow(0, hp.start, hp.numel)


def _zero3_tensors(optimizer: DeepSpeedZeroOptimizer_Stage3,
                   names: dict[int, str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(kind, name, view) for ZeRO-3 (NOTE: [zero partitions])."""
    group = optimizer.dp_process_group
    rank, world = ds_comm.get_rank(group=group), ds_comm.get_world_size(group=group)
    suffix = _shard(rank, world)
    inner = optimizer.optimizer
    grads = optimizer.averaged_gradients
    offloaded = _offloaded_grad_partitions(optimizer)
    for g, params in enumerate(optimizer.fp16_groups):
        master_flat = optimizer.fp32_partitioned_groups_flat[g]
        state = _flat_state(inner, master_flat)
        group_grads = grads.get(g) if isinstance(grads, dict) else None
        for i, p in enumerate(params):
            name = names.get(id(p))
            if name is None:
                continue
            size = p.partition_numel()
            held = max(0, min(p.ds_numel - rank * size, size))  # the rest of the last partition is padding
            if held == 0:
                continue
            local = _flat(p.ds_tensor).narrow(0, 0, held)
            yield "parameter", name + suffix, local
            if p.requires_grad and offloaded is not None:
                yield "gradient", name + suffix, offloaded[id(p)].narrow(0, 0, held)
            elif p.requires_grad and group_grads is not None and i < len(group_grads):
                yield "gradient", name + suffix, _flat(group_grads[i]).narrow(0, 0, held)
            _, offset, _ = optimizer.grad_position[optimizer.get_param_id(p)]
            master = master_flat.detach().narrow(0, offset, held)
            if master.data_ptr() != local.data_ptr():  # fp32 training: the master is the weight itself
                yield "optimizer_state", f"{name}{suffix}.{MASTER}", master
            for key, value in state:
                yield "optimizer_state", f"{name}{suffix}.{key}", value.detach().narrow(0, offset, held)


def _offloaded_grad_partitions(optimizer: DeepSpeedZeroOptimizer_Stage3) -> dict[int, torch.Tensor] | None:
    """ZeRO-3 with offload_optimizer: each parameter's gradient partition (by id(param)), or None without offload.
    There averaged_gradients stays empty: the partitions are reduced into grad_partitions_flat_buffer, in the order
    of the parameters of fp16_groups, partition_numel() elements each (how DeepSpeed lays it out), and copied to
    the fp32 masters' `.grad` only inside engine.step(), after the check."""
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if not getattr(optimizer, "offload_optimizer", False) or flat is None:
        return None
    views, offset = {}, 0
    for params in optimizer.fp16_groups:
        for p in params:
            views[id(p)] = flat.narrow(0, offset, p.partition_numel())
            offset += p.partition_numel()
    return views


def zero_tensors(engine: Any) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, view) of every tensor this rank holds of the engine's model and optimizer, or [] when the
    engine's optimizer keeps none in partitions (stage 0 without the bf16 optimizer: ZeroSource then scans the
    module and a torch optimizer as a plain Monitor does)."""
    optimizer = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return list(_zero3_tensors(optimizer, names))
    if getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None):
        return list(_zero12_tensors(optimizer, names))
    return []


def _partitioned(engine: Any) -> bool:
    optimizer = engine.optimizer
    return isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or bool(
        getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None))


class ZeroSource:
    """A nanscan.engine.plans.TensorSource (NOTE: [tensor source]) over what this rank holds of a DeepSpeed engine
    (NOTE: [zero partitions]). An engine whose optimizer keeps nothing in partitions (stage 0, fp32 or fp16 with
    a torch optimizer) is scanned by a ModelScanPlan of its module and optimizer."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.partitioned = _partitioned(engine)
        self._plain = None if self.partitioned else ModelScanPlan()
        self.rebuilds = 0
        self.no_gradients = False

    def _plain_optimizer(self) -> torch.optim.Optimizer | None:
        optimizer = self.engine.optimizer
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    def inputs(self, model: torch.nn.Module, optimizer: Any, *, extra: StepInputs | Sequence = ()) -> ScanInputs:
        if self._plain is not None:
            found = self._plain.inputs(self.engine.module, self._plain_optimizer(), extra=extra)
            self.rebuilds, self.no_gradients = self._plain.rebuilds, self._plain.no_gradients
            return found
        items = list(as_step_inputs(extra).items())
        any_grad = trains = False
        for kind, name, tensor in zero_tensors(self.engine):
            item = prepare(tensor_name(kind, name), tensor)
            if item is not None:
                items.append(item)
                any_grad = any_grad or kind == "gradient"
            trains = trains or kind == "parameter"
        self.rebuilds += 1  # the buffers are new objects after most steps: prepared at every check
        self.no_gradients = trains and not any_grad
        return ScanInputs(items)

    def scan_on_host(self, model: torch.nn.Module, optimizer: Any, *, extra: StepInputs,
                     backend_for: Callable[[tuple[str, ...]], Any], carried: tuple | None = None) -> tuple | None:
        if self._plain is not None:
            return self._plain.scan_on_host(self.engine.module, self._plain_optimizer(), extra=extra,
                                            backend_for=backend_for, carried=carried)
        return None  # the Monitor launches inputs() itself

    def stable_tensors(self) -> list[torch.Tensor]:
        return self._plain.stable_tensors() if self._plain is not None else []

    def state(self, model: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        """(model state, optimizer state) this rank holds, with no collective (see the module docstring), and the
        engine's counters (NOTE: [zero window])."""
        if self._plain is not None:
            return self._plain.state(self.engine.module, self._plain_optimizer())
        tensors = zero_tensors(self.engine)
        stage3 = isinstance(self.engine.optimizer, DeepSpeedZeroOptimizer_Stage3)
        if stage3:
            model_state = {name: t for kind, name, t in tensors if kind == "parameter"}
        else:
            model_state = self.engine.module.state_dict()
        optimizer_state = {"zero_stage": self.engine.zero_optimization_stage(),
                           "fragments": {name: t for kind, name, t in tensors if kind == "optimizer_state"},
                           "counters": _counters(self.engine)}
        return model_state, optimizer_state

    def load_state(self, model: torch.nn.Module, optimizer: Any, model_state: Any, optimizer_state: Any, *,
                   progress: bool = True) -> None:
        """Load a state that state() gave (a kept copy) back into the engine in place, counters included (NOTE:
        [zero window]); progress=False keeps the engine's step counters, micro-step and lr schedule as they are (a
        rollback goes on from the live step, as the loop's own counters do). Every rank of the data-parallel group
        calls it together: under ZeRO-3 the persistent parameters are gathered again."""
        engine = self.engine
        counters = None
        if self._plain is not None:  # a module and a torch optimizer (their state_dict()s)
            engine.module.load_state_dict(model_state)
            plain = self._plain_optimizer()
            if plain is not None and optimizer_state is not None:
                plain.load_state_dict(copy.deepcopy(optimizer_state))
        else:
            counters = (optimizer_state or {}).get("counters")
            fragments = (optimizer_state or {}).get("fragments") or {}
            stage3 = isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)
            if not stage3:
                engine.module.load_state_dict(model_state)
            held = {(kind, name): t for kind, name, t in zero_tensors(engine) if kind != "gradient"}
            kept = {("parameter", name): t for name, t in model_state.items()} if stage3 else {}
            kept.update({("optimizer_state", name): t for name, t in fragments.items()})
            # an optimizer state the kept copy does not hold yet (before the first update) is dropped below
            with torch.no_grad():
                for key, view in held.items():
                    if key in kept:
                        view.copy_(kept[key])
                    elif key[0] == "parameter" and stage3:
                        raise ValueError(f"the kept state holds no {key[1]}: it is not this engine's")
        if counters is not None:
            _load_counters(engine, counters, progress=progress)
        persistent = getattr(engine.optimizer, "persistent_parameters", None)
        if persistent:  # ZeRO-3 keeps small parameters whole on every rank: gathered from the loaded partitions
            persistent[0].all_gather(persistent)

    def step_driver(self) -> "DeepSpeedDriver":
        """How a rerun steps the engine (nanscan.runtime.rerun NOTE: [step driver]); a ReplayError where the window
        cannot be rerun through it."""
        accumulated = self.engine.gradient_accumulation_steps()
        if accumulated > 1:
            raise ReplayError(f"DeepSpeed accumulates {accumulated} micro-batches a step "
                              "(gradient_accumulation_steps) and the window holds the batch of each step's check, "
                              "the last micro-batch's (check() runs once, at the boundary): the window's steps "
                              "cannot be rerun whole")
        return DeepSpeedDriver(self.engine, self)


_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _inner(engine: Any) -> Any:
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _counters(engine: Any) -> dict:
    """What besides tensors makes the engine's next step what it was (NOTE: [zero window])."""
    inner = _inner(engine)
    steps = []
    for group in getattr(inner, "param_groups", []):
        for p in group["params"]:
            state = inner.state.get(p)
            # a step count as the optimizer keeps it (a tensor is copied with the state, never read here: no sync)
            steps.append(None if not state else {k: v for k, v in state.items()
                                                  if not isinstance(v, torch.Tensor) or v.numel() == 1})
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    scheduler = getattr(engine, "lr_scheduler", None)
    return {"engine": {name: int(getattr(engine, name)) for name in _ENGINE_COUNTERS},
            "micro_step_id": getattr(engine.optimizer, "micro_step_id", None),
            "optimizer_scalars": steps,
            "loss_scaler": {k: float(getattr(scaler, k)) for k in _SCALER_FIELDS if hasattr(scaler, k)},
            "lr_scheduler": _plain_values(scheduler.state_dict()) if hasattr(scheduler, "state_dict") else None}


def _plain_values(value: Any) -> Any:
    """A scheduler's state_dict() with what a bundle stores as JSON (numbers, strings, lists, dicts); the rest
    (a lambda's closure) left out."""
    if isinstance(value, dict):
        kept = {str(k): _plain_values(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not _LEFT_OUT}
    if isinstance(value, (list, tuple)):
        kept = [_plain_values(v) for v in value]
        return _LEFT_OUT if any(v is _LEFT_OUT for v in kept) else kept
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _LEFT_OUT


_LEFT_OUT = object()


def _load_counters(engine: Any, counters: dict, *, progress: bool) -> None:
    inner = _inner(engine)
    if progress:
        for name, value in counters["engine"].items():
            setattr(engine, name, int(value))
        if counters.get("micro_step_id") is not None:
            engine.optimizer.micro_step_id = int(counters["micro_step_id"])
        scheduler = getattr(engine, "lr_scheduler", None)
        if counters.get("lr_scheduler") is not None and scheduler is not None:  # what it kept over what it has now
            scheduler.load_state_dict({**scheduler.state_dict(), **counters["lr_scheduler"]})
    params = [p for group in getattr(inner, "param_groups", []) for p in group["params"]]
    for p, scalars in zip(params, counters["optimizer_scalars"]):
        if scalars is None:  # no update yet when the state was kept: the first one creates it again
            inner.state.pop(p, None)
            continue
        state = inner.state.setdefault(p, {})
        for key, value in scalars.items():
            if isinstance(state.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                state[key].copy_(value)
            elif isinstance(value, torch.Tensor):
                state[key] = value.clone()
            else:
                state[key] = value
    scaler = getattr(engine.optimizer, "loss_scaler", None)  # fp16's scale, as a rollback restores a GradScaler's
    for key, value in counters["loss_scaler"].items():
        setattr(scaler, key, type(getattr(scaler, key))(value))


class DeepSpeedDriver:
    """The engine's own training step for a rerun (nanscan.runtime.rerun NOTE: [step driver]): engine.backward(loss)
    (its accumulation and loss scaling), the gradient partitions scanned through the ZeroSource, engine.step() (its
    clipping, overflow check and update of the partitions), as the loop calls them."""

    scales_loss = True
    steps = True
    calls = ("engine.backward(loss)", "engine.step()")

    def __init__(self, engine: Any, source: ZeroSource):
        self.engine, self.source = engine, source
        self._clip: float | None = None
        # the engine clips in engine.step() by its config: the loop's clipping, declared (0: none)
        self.clip_grad_norm = float(engine.gradient_clipping()) or None
        dtype = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
        self.fixed_precision = (f"DeepSpeed's engine sets the precision ({dtype}, from its config), which a rerun "
                                "cannot change")

    def _inputs(self, gradients: bool) -> list:
        inputs = self.source.inputs(self.engine.module, _inner(self.engine))
        return [i for i in inputs if is_kind(i.name, "gradient") == gradients]

    def zero_grad(self) -> None:
        self.engine.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.engine.backward(loss)
        if not last:
            self.engine.step()  # a micro-step: the engine counts it and updates nothing

    def state(self) -> list:
        return self._inputs(False)

    def gradients(self) -> list:
        return self._inputs(True)

    def clip(self, max_norm: float) -> None:
        self._clip = max_norm

    def step(self, gradients_ok: bool) -> bool:
        """engine.step(), clipping at a factor's threshold where one is given; True for fp16's expected overflow
        skip (its dynamic loss scale backs off), as DeepSpeedMonitor counts them."""
        optimizer, config = self.engine.optimizer, self.engine._config
        saved = getattr(optimizer, "clip_grad", None), config.gradient_clipping
        if self._clip is not None:
            optimizer.clip_grad = config.gradient_clipping = self._clip
        before = self.engine.skipped_steps
        try:
            self.engine.step()
        finally:
            self._clip = None
            if saved[0] is not None:
                optimizer.clip_grad = saved[0]
            config.gradient_clipping = saved[1]
        return self.engine.skipped_steps > before and self.engine.fp16_enabled() and not gradients_ok


class DeepSpeedMonitor(Monitor):
    """nanscan.Monitor for a DeepSpeed engine (deepspeed.initialize's first result): each rank scans what it holds
    (NOTE: [zero partitions]) and the ranks agree as under DDP (nanscan.runtime.distributed). Call `check(batch=...,
    loss=...)` after engine.backward(loss) and before engine.step(), at every gradient accumulation boundary
    (`engine.is_gradient_accumulation_boundary()`), once per optimizer step.

    Every keyword of nanscan.Monitor is taken, except snapshot="cpu" (it copies the module's state_dict(), which
    under ZeRO-3 holds no elements) and on_invalid="skip" (it sets `.grad` to None, which DeepSpeed does not read:
    with "warn", leave engine.step() to DeepSpeed, whose own overflow check skips a step with non-finite
    gradients under bf16 and fp16). `max_skips`: how many steps DeepSpeed may skip in a row (its overflow check,
    read from `engine.skipped_steps` at each check) before a DeepSpeedSkipWarning says every update is dropped.

    Replicas (nanscan.runtime.replicas NOTE: [replica agreement]): under ZeRO-1/2, where the data-parallel group is
    the whole world, the ranks compare their whole low-precision weights at every check (`replicas` defaults to
    True there); a difference is a replica_mismatch incident. replicas=True is refused under ZeRO-3, which
    replicates nothing; stage 0 compares only with replicas=True.

    fp16 (dynamic loss scaling): an overflow skip is DeepSpeed's expected event, but the ranks' agreement has no
    notion of one yet (nanscan.runtime.distributed), so a step whose scaled fp16 gradients overflowed is reported as an
    incident of category "gradient" like any other; pass on_invalid="warn" (or a callable) for fp16 runs, where
    the skip streak warning above tells a run stuck in overflow from one that recovers.
    """

    def __init__(self, engine: Any, *, max_skips: int = DEFAULT_MAX_SKIPS, **kwargs: Any):
        if not isinstance(engine, deepspeed.DeepSpeedEngine):
            raise TypeError(f"engine must be a deepspeed.DeepSpeedEngine (from deepspeed.initialize), got "
                            f"{type(engine).__name__}")
        if kwargs.get("snapshot", "none") != "none":
            raise ValueError("snapshot='cpu' with DeepSpeed: the module's state_dict() holds no elements under "
                             "ZeRO-3; the bundle stores what each rank holds at the check instead")
        if kwargs.get("on_invalid") == "skip":
            raise ValueError("on_invalid='skip' with DeepSpeed: DeepSpeed does not read param.grad; use 'warn' (its "
                             "own overflow check skips a step whose gradients are non-finite) or 'raise'")
        for given in ("optimizer", "source", "scaler"):
            if given in kwargs:
                raise TypeError(f"DeepSpeedMonitor takes no {given}=: it reads the engine's")
        stage = engine.zero_optimization_stage()
        if kwargs.get("replicas") and stage == 3:
            raise ValueError("replicas=True under ZeRO-3: every rank holds its own partition of the weights, "
                             "gradients and optimizer state, so nothing is replicated to compare; leave replicas at "
                             "its default (ZeRO-1/2's low-precision weights are compared) or pass replicas=False")
        # NOTE: [replica agreement]: ZeRO-1/2 keep the whole low-precision weights on every rank of the
        # data-parallel group, bit for bit after the all-gather that follows each step; the source's names of the
        # partitions carry @shard and are never compared. Only where that group is the whole world (no model,
        # pipeline or sequence parallelism splits the weights).
        if "replicas" not in kwargs and kwargs.get("process_group") is None:
            kwargs["replicas"] = stage in (1, 2) and ds_comm.is_initialized() and \
                engine.dp_world_size == ds_comm.get_world_size()
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        source = ZeroSource(engine)
        # The inner torch optimizer is given for its learning rate (param_groups); its tensors come from the source.
        super().__init__(engine.module, inner if isinstance(inner, torch.optim.Optimizer) else None,
                         source=source, **kwargs)
        self.engine = engine
        self._given_ref = weakref.ref(engine)  # step_fn is given the engine, as the loop calls it (NOTE: [zero window])
        self.max_ds_skips = max_skips
        self._skips_seen = engine.skipped_steps
        self._skip_streak = 0
        self._skip_warned = False

    def check(self, batch: Any = None, loss: Any = None, sample_ids: Any = None, lr: float | None = None,
              step: int | None = None, *, micro_batch: bool = False):
        if not micro_batch:  # one engine.step() ran since the step's last check
            self._watch_skips()
        if lr is None:
            lrs = self.engine.get_lr()
            lr = lrs[0] if lrs else None
        return super().check(batch=batch, loss=loss, sample_ids=sample_ids, lr=lr, step=step,
                             micro_batch=micro_batch)

    def _watch_skips(self) -> None:
        """Count the steps DeepSpeed skipped since the last check: a streak of max_skips warns once."""
        skipped = self.engine.skipped_steps
        # Between two checks one engine.step() ran: skipped (the counter moved) or applied (a streak ends).
        self._skip_streak = self._skip_streak + (skipped - self._skips_seen) if skipped > self._skips_seen else 0
        self._skips_seen = skipped
        if self._skip_streak >= self.max_ds_skips and not self._skip_warned:
            self._skip_warned = True
            warn_user(f"nanscan: DeepSpeed skipped the last {self._skip_streak} optimizer steps in a row (its "
                      f"overflow check; engine.skipped_steps={skipped}, max_skips={self.max_ds_skips}): no update "
                      "is being applied. Under fp16 the loss scale is backing off without recovering; under bf16 "
                      "the gradients are non-finite at every step (see the bundles of the first one)",
                      DeepSpeedSkipWarning)
