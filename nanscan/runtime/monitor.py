"""The Monitor: one call per training step that scans the batch, loss, weights, gradients and optimizer state,
keeps a bounded history, and on the first non-finite step decides a failure category and writes an evidence
bundle (nanscan.bundle) before applying the `on_invalid` policy.

    mon = nanscan.Monitor(model, optimizer, config=cfg, log_files=["train.log"])
    for step, (batch, ids) in enumerate(loader):
        loss = compute_loss(model, batch)
        loss.backward()
        report = mon.check(batch=batch, loss=loss, sample_ids=ids)   # after backward, before optimizer.step()
        if not report.ok:        # only reached with on_invalid="warn", "skip" or a callable
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mon.close()                  # in mode="async", reads the last step's verdict

Modes. In mode="sync" (the default on CPU) check() waits for the scan and decides the step before returning. In
mode="async" (the default when the model is on a GPU) check() only enqueues the scan on the current CUDA stream,
copies a 4-byte flag to pinned memory behind an event, and returns a PendingReport; the verdict for step s is read
at step s+1's check (or at flush() / close()) and still names step s as the first invalid step, with step s's
batch, loss, sample ids, step-start RNG state and (snapshot="cpu") pre-step state in its bundle. Until then the
Monitor keeps step s's batch: CPU tensors as copies, GPU tensors by reference (not copied: do not modify them in
place before the next check). Per step, nothing synchronizes the host with the GPU: no `.item()`, no float(loss),
no record copy (the history stays on the GPU, nanscan.runtime.history NOTE: [history ring]). The only wait, at step
s+1's check, is for step s's scan, which was enqueued before step s's update and step s+1's forward and backward, so
the GPU's queue never runs dry. On CPU tensors the scan finishes inside check() but its verdict takes the same path.

Skipping a non-finite step's update without a host sync: `report.found_inf` (1.0 when the step holds a NaN or an
infinity, else 0.0; on the GPU for a GPU scan) in the form torch's fused optimizers take. Adam, AdamW, SGD and
Adagrad built with fused=True read the optimizer attributes `found_inf` and `grad_scale` in step() (the contract
torch.amp.GradScaler uses, `optimizer._step_supports_amp_scaling`), and skip the whole update on the device when
found_inf is 1.0 (Adam's step count included):

        report = mon.check(batch=batch, loss=loss)
        optimizer.found_inf = report.found_inf    # torch.optim.AdamW(..., fused=True)
        optimizer.step()
        del optimizer.found_inf                   # as GradScaler does: a stale flag would skip later steps

Non-fused optimizers raise on a found_inf attribute. GradScaler.step() sets and deletes found_inf itself; with a
scaler, let it skip (its own check covers the gradients).

With a GradScaler, pass it (`Monitor(..., scaler=scaler)`): a step whose only non-finite tensors are gradients is an
expected overflow skip, recorded but never bundled, and only a streak of them is an incident (nanscan.runtime.amp NOTE:
[overflow skips]); gradient statistics are reported unscaled (nanscan.engine.stats NOTE: [unscaled gradients]). Always
call scaler.step(optimizer) and scaler.update() (they skip and back off on their own); an overflow skip's report has
`ok` False (its gradients are non-finite) and `overflow_skip` True, so skip a step yourself only when
`not report.ok and not report.overflow_skip`. Pass the unscaled loss, and check after scaler.unscale_() and
clip_grad_norm_ if the loop uses them.

Spikes (nanscan.runtime.spikes NOTE: [spike statistic]): every finite step's loss and gradient norm are also judged
against their recent range, from the same records, and from the first steps by the growth rule (NOTE: [growth rule]:
still rising, by binades, to a new high). A spike warns (SpikeWarning) and the run's first one is bundled (category
"spike"), while the weights are still sound; it is not an invalid step. spikes="skip" folds the spike into
`report.found_inf`, so the found_inf contract above skips a spiking step's update too, on the device.

check() is its stages (nanscan.runtime.stages NOTE: [check stages]): prepare, scan, count, record, spike, then
decide and act; a new every-step feature joins as a stage.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import secrets
import sys
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from nanscan.bundle import HistoryEntry, check_run_id
from nanscan.bundle.provenance import RNG_SOURCES, capture_rng, capture_source, normalize_config
from nanscan.engine import _layout as L
from nanscan.engine.dispatch import launch, select_for_part
from nanscan.engine.plans import BatchPlan, ModelScanPlan, TensorSource
from nanscan.engine.stats import PendingReport, ScanReport, gradient_rows
from nanscan.entry import EntryWarning, entry_problem
from nanscan.incident import GradientWarning, NonFiniteError, SnapshotWarning, warn_user
from nanscan.integrations import tensorboard as tensorboard_export
from nanscan.integrations import wandb as wandb_export
from nanscan.integrations.live import monitor_export
from nanscan.runtime.amp import MAX_SKIPS, MIN_SCALE, ScalerWatch, autocast_state, read_scaling
from nanscan.runtime.dropped_update import DroppedUpdate
from nanscan.runtime.history import HistoryRing, kept_scalar, read_scalar
from nanscan.runtime.incident_diagnosis import DEFAULT_TIMEOUT_S as DEFAULT_DIAGNOSE_TIMEOUT_S, Diagnosis
from nanscan.runtime.incident_rerun import DEFAULT_TIMEOUT_S as DEFAULT_RERUN_TIMEOUT_S, RerunResult
from nanscan.runtime.observed import ObservedMicroBatches
from nanscan.runtime.resume import Resume
from nanscan.runtime.rollback import Rollback, Rollbacks
from nanscan.runtime.snapshot import CpuSnapshot
from nanscan.runtime.spikes import POLICIES as SPIKE_POLICIES
from nanscan.runtime.spikes import Spike, SpikeRule, SpikeWatch
from nanscan.runtime.stages import CheckPath, StepCheck
from nanscan.runtime.update import UpdateContext, UpdateWatch
from nanscan.runtime.verdict import PendingStep, StepStart, StepVerdicts, retained, scanned_report
from nanscan.runtime.window import Window, WindowKeeper, reloads, window_setting
from nanscan.runtime.wrappers import COMPILED, DATA_PARALLEL, inner_optimizer, peel

log = logging.getLogger("nanscan")

ON_INVALID = ("raise", "warn", "skip")
SNAPSHOTS = ("none", "cpu")
MODES = ("auto", "sync", "async")
BUNDLE_DIR_ENV = "NANSCAN_BUNDLE_DIR"
DEFAULT_BUNDLE_DIR = "nanscan-bundles"
_REPLAY_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def grad_norm(report: ScanReport) -> float | None:
    """L2 norm over the finite values of every `grad:` tensor of the report (from the records' sumsq), of the
    unscaled gradients under a GradScaler (nanscan.engine.stats NOTE: [unscaled gradients])."""
    rows = gradient_rows(report.tensors)
    if not len(rows):
        return None
    sumsq = L.sumsq_values(report.records, rows)
    exponent = 0 if report.scaling is None else report.scaling.grad_exponent
    return float(np.ldexp(np.sqrt(sumsq.sum()), -exponent))


def _unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module whose forward marks a step's start, the module whose tensors are scanned and stored).

    DistributedDataParallel, DataParallel, torch.compile's OptimizedModule and Lightning Fabric's module are
    unwrapped (nanscan.runtime.wrappers), so that names and the bundle's state are the plain model's, which replay
    builds (a compiled model's would all start with `_orig_mod.`, a Fabric one's with `_forward_module.`). The
    forward pre-hook stays on a compiled wrapper, where it runs eagerly (inside, dynamo would trace it, and the hook
    does nothing there: litgpt's compiled model under Fabric), and on DataParallel, whose replicas of the inner
    module are other objects."""
    hooked = None
    while (peeled := peel(model)) is not None:
        inner, kind = peeled
        if kind in (DATA_PARALLEL, COMPILED) and hooked is None:  # never bool(module): its __len__
            hooked = model
        model = inner
    return (model if hooked is None else hooked), model


def _distributed_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _new_run_id() -> str:
    return f"{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _step_number(step: Any) -> int:
    """A step given to check() as a Python int: a numpy integer or an integer tensor (a step counter kept in a
    tensor) would otherwise reach the bundle's JSON, which cannot hold it, and the evidence would be lost."""
    try:
        return operator.index(step)
    except TypeError:
        raise TypeError(f"step={step!r}: pass the step number as an int") from None


class _StepStartHook:
    """The forward pre-hook that marks a step's start. It holds the Monitor weakly (the model must not keep it
    alive) and pickles as an inert hook, so torch.save or deepcopy of the whole module keeps working."""

    def __init__(self, monitor: "Monitor"):
        self._monitor: weakref.ref | None = weakref.ref(monitor)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            # inside a compiled region (model.compile()): nothing to trace, so no graph break and fullgraph=True
            # works; such a step's start is seen through Monitor.begin_step (the SnapshotWarning says so)
            return
        monitor = self._monitor() if self._monitor is not None else None
        if monitor is not None:
            monitor._on_step_start(module)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._monitor = None


class Monitor(StepVerdicts):
    """Watches one model (and optimizer) for the first step with a NaN or infinity and preserves the evidence.

    Call `check(...)` once per step after `loss.backward()` and before `optimizer.step()`.

    model, optimizer: what to scan (`param:<name>`, `grad:<name>`, `optim:<name>.<key>`; the optimizer's parameters
        outside the model as `optimizer.param_groups.<group>.params.<index>`). A DistributedDataParallel,
        DataParallel or torch.compile wrapper is unwrapped: names and stored state are the plain model's.
    bundle_dir: where bundles go, as `<bundle_dir>/<run_id>/step-<N>/`; default: $NANSCAN_BUNDLE_DIR, else
        "nanscan-bundles" (relative to the current directory when the Monitor is created).
    config: the run's configuration (dict, dataclass or namespace of JSON values), stored with its sha256.
    run_id: names the run's bundle directory; default: UTC time plus a random suffix. With a process group (below)
        every rank must use the same run_id (default: rank 0's); independent processes that may fail at the same
        step and share a bundle_dir need one run_id each.
    history: how many steps of statistics to keep, compacted where the scan left them (on the GPU for GPU scans;
        nanscan.runtime.history NOTE: [history ring]): about 90 to 140 bytes per scanned tensor per step for host scans,
        348 on a GPU (2112 for a step whose tensors span more than 64 binades on average), e.g. 64 steps x 300
        tensors = about 2.5 MiB on the host, 6.4 MiB on a GPU. Reading `history` copies it to the host (on a
        GPU, that waits for the GPU).
    log_files: log files whose last 200 lines (at most 64 KiB) are copied into the bundle.
    on_invalid: what check() does when a step is non-finite, after writing the bundle of the first one:
        "raise" (NonFiniteError), "warn" (NonFiniteWarning once, then go on), "skip" (set the gradient of every
        parameter of the model and the optimizer to None, so torch optimizers skip them all and optimizer.step()
        changes nothing, then go on; zeroed gradients would not do, as Adam's momentum would still move the
        weights), a nanscan.Rollback(...) (go back to a state the window kept, skip what broke the run, optionally
        change one factor, and keep training; nanscan.runtime.rollback NOTE: [rollback]; "rollback" is
        Rollback()), a nanscan.Resume(directory) (write the last good state the window kept as a checkpoint to
        resume from and exit with a code a launcher acts on: nanscan.runtime.resume NOTE: [resume elsewhere]), or
        a callable `on_invalid(report, bundle_path)`. In every non-raising mode check() returns a
        report whose `.ok` is False: the loop should `continue` (skip optimizer.step() and the scheduler) for
        that step.
        Later non-finite steps are counted in `invalid_steps`, not bundled again.
    spikes: what check() does at a finite step whose loss or gradient norm jumps far outside its recent range
        (nanscan.runtime.spikes NOTE: [spike statistic]; after `spike_rule.warmup` finite steps) or keeps growing
        (NOTE: [growth rule]: up at all but one of its last 8 finite steps, 8x or more, to a new high; Spike.kind
        "growth", a SpikeWarning like a spike's): "warn" (the default: a SpikeWarning at the first spike of each
        episode of spikes, and a bundle of category "spike" for the run's first), "bundle" (also a bundle at every
        episode's first spike), "skip" (also skip the spiking step's update: its gradients are set to None in
        mode="sync", and `report.found_inf` is 1.0 in either mode, so a fused optimizer given it skips on the
        device), "raise" (raise the SpikeWarning), a callable `spikes(spike, bundle_path)` called at every spiking
        step, or None (no spike detection). Detected spikes are kept in `spikes`, and the report of the check that
        decided one has it as `report.spike` (in mode="async": the check after the spiking step, like its non-finite
        verdict). With a process group, spikes are not watched (the ranks would have to agree on them).
    spike_rule: a nanscan.runtime.spikes.SpikeRule (window, warm-up, threshold, minimum ratio, scale floor; the
        growth rule's steps and binades, growth_steps=0 for none).
    replay_entry: "package.module:function" that rebuilds the training step from the config (nanscan.entry).
    snapshot: "none" stores the state at the failing check (the step's update has not run yet, so the weights
        and optimizer state are the step's starting point; buffers the forward pass updates, e.g. BatchNorm
        statistics, already include the failing batch). "cpu" copies model and optimizer state to preallocated
        CPU buffers at the start of every training step (first forward in train mode after a check), so the
        bundle holds the exact state the failing step started from, at the cost of one state copy per step.
    backend: scan backend (see nanscan.scan).
    process_group: the torch.distributed group whose ranks agree on every step's verdict; default: the world group
        when torch.distributed is initialized; False: this process decides alone. With a group, call check() on
        every rank at every step: see nanscan.runtime.distributed for the agreement, the per-rank names of FSDP shards
        and the bundle set (a part per rank under the step directory, plus an index).
    agreement: with a process group, "sync" (each step is decided on every rank inside its check, before
        optimizer.step()) or "async" (the verdict for step s arrives at step s+1's check, after step s's update;
        `flush()` waits for it at once). Either way the report's `.ok` is the ranks' agreed answer, the same on
        every rank, so the loop below keeps them in lockstep.
    replicas: with a process group, whether the ranks also check every step that their replicas are bit-identical
        (nanscan.runtime.replicas NOTE: [replica agreement]; docs/replicas.md): parameters and optimizer state at
        every check, the all-reduced gradients at each step's own check (not at micro_batch=True checks), each
        within its replica set (the whole group under DDP; for a DTensor the ranks its placements replicate it over,
        as HSDP's replicate dimension). A difference, finite or not, is an incident of category "replica_mismatch"
        naming the odd rank(s) (by majority with 3 or more replicas), the first differing tensors and whether the
        gradients already differed; with on_invalid="raise" every rank raises ReplicaMismatchError. None (the
        default): on for a model given as DistributedDataParallel and for DTensors replicated over a mesh
        dimension (HSDP, tensor-parallel norms), off otherwise (shards, FSDP's flat parameters and other per-rank
        tensors are never compared); False: off; True: also for a TensorSource's or a plain module's tensors that
        the caller knows are replicated. Cost: six more int64 slots per replica set in the all-reduce the agreement
        already makes (no extra collective on a healthy step) and, on the host, one multiply-add over the step's
        per-tensor fingerprints, which every scan record already holds (benchmarks/bench_replicas.py); on a
        failing step one more all-gather of the fingerprints.
    mode: "sync" (check() waits for the scan and decides the step), "async" (check() returns at once; see the
        module docstring) or "auto" (the default): "async" when the model's parameters are on a GPU at the first
        check, else "sync"; `mode` holds the choice after the first check. In async mode check() returns a
        PendingReport whose `.ok` is False only at the check after a non-finite step (when on_invalid did not
        raise there), and on_invalid acts for step s at step s+1's check: "raise" raises NonFiniteError naming
        step s, "skip" drops step s+1's gradients; step s's own update has happened by then unless its
        `report.found_inf` went to a fused optimizer or `flush()` was called before optimizer.step(). With a
        process group the scan is always read at the check (the ranks' agreement needs each rank's answer on
        the host): use agreement="async" there, not mode="async".
    scaler: the torch.amp.GradScaler whose scaled gradients are checked (see the module docstring); max_skips and
        min_scale: when a streak of its overflow skips becomes an incident (nanscan.runtime.amp NOTE: [overflow skips]).
    post_update: how an update that writes non-finite weights or optimizer state becomes an incident of the step
        whose update wrote them (category "update", reason "optimizer_update"), with that step's batch and, under
        snapshot="cpu", the state the update read (an Optimizer step post-hook; nanscan.runtime.update NOTE:
        [post-update check]). "scan" (or True): the weights and state are scanned right after each optimizer.step()
        that follows a finite check, and the incident is raised from it; about half a check on a small CPU model
        (README). "date": the hook only stamps them (version counter, address, dtype; a few microseconds), and
        the next check, which scans them anyway, dates non-finite ones that nothing else wrote since to the update
        (NOTE: [dated updates]). "auto" (the default): "scan" while the optimizer holds float16 or bfloat16
        parameters, where an update's settings most often break (an eps that is 0 in float16), "date" elsewhere.
        False: neither; such an update is a "parameter" incident of the next step. Not with a process group.
    tensorboard: a log directory or a torch.utils.tensorboard.SummaryWriter (or a
        nanscan.integrations.tensorboard.TensorBoardExport, for the choice of tensors) to write each step's
        statistics to, live: loss, lr, gradient norm (NaN, never 0.0, where gradients are non-finite) and the count
        of non-finite tensors and elements every step; exponent histograms over log2|x| (one bucket per binade) and
        per-module gradient norms every `log_every` steps (default 100) and at every non-finite step, where each
        non-finite tensor's NaN and inf counts are logged too. No host sync of its own: in mode="async" step s is written when its records are back,
        at step s+1's check. Needs the tensorboard and google-crc32c packages (nanscan[tensorboard]).
    wandb: a wandb run (`wandb.init(...)`, or a nanscan.integrations.wandb.WandbExport) to log the same statistics
        into, on an axis of their own, nanscan/step (nanscan.integrations.wandb NOTE: [wandb step]); with
        tensorboard= too, both get the same steps and tensors (nanscan.integrations.live). Needs wandb.

    source: where the model's tensors are, when not in its parameters and a torch optimizer (nanscan.engine.plans NOTE:
        [tensor source]): a framework adapter's (nanscan.integrations.deepspeed); default: the module's own.
    frozen_weights: how a bundle holds the frozen parameters (requires_grad=False, a LoRA's base): "digest" (the
        default) by name, dtype, shape and sha256 only, replay taking them from the model its entry builds after
        checking them (nanscan.bundle.frozen NOTE: [frozen references]); "copy": their bytes too. A frozen weight
        that is non-finite is always copied. Checks read frozen weights only when they change (nanscan.engine.plans
        NOTE: [frozen records]).
    window: what of the run the Monitor keeps to rerun the steps before an incident (nanscan.runtime.window NOTE:
        [run window]): a nanscan.runtime.window.Window(steps, every, max_bytes), a number of steps, or None (keep
        none). The default, Window(steps=32, every=32), copies the model's and optimizer's state every 32 steps into
        a ring of 2 host copies (6 times the trainable parameters' bytes under Adam; at most a quarter of the
        machine's memory, else fewer, said once) and holds every check's batch, sample ids, learning rates, loss
        scale, precision and RNG state since the oldest; a bundle holds it. With a TensorSource (source=), what
        its `state` holds (DeepSpeed: this rank's partitions), where it can load that back (`load_state`).
    step_fn: the loop's forward, `step_fn(model, batch) -> loss` (a closure over the script's own objects; it must
        call the model it is given, and the loss it returns is the one backpropagated). At the first incident,
        once its bundle is written and before on_invalid acts, the Monitor reruns the failing step in the process
        from the state it started from, on its batch, under its recorded autocast, and names the first bad module,
        op and source line and where an overflow began, as `nanscan replay` does but with no replay entry; the
        bundle (finding "rerun") and the error's message say what it found, or that the rerun stayed finite
        (nanscan.runtime.incident_rerun NOTE: [in-process rerun]). Nothing of the run changes: gradients, buffers,
        modes and RNG streams are put back. rerun_timeout: seconds after which the rerun's op pass is left out.
    diagnose: with step_fn, after that rerun, the window of the run (window=) is rerun in the process from its
        oldest kept state with a fresh optimizer of the run's own type and settings, then one factor at a time over
        it (the learning rate down a ladder, a longer warm-up, clipping, eps, precision), each judged past the
        failing step (finite, not still growing, the loss back within 2x its level before it diverged); the
        conclusion goes to the bundle (findings "diagnosis", "replay:window" and "ablate:window:*"),
        Monitor.diagnosis and the error's message, and everything of the run is put back (nanscan.runtime.
        incident_diagnosis NOTE: [in-process diagnosis]). diagnose_timeout: seconds after which the factors left
        are not judged (default 300). diagnose=False turns it off.

    The RNG states are captured at the start of each step (same forward pre-hook, a few microseconds) so that
    replay can redraw the failing step's dropout masks; without a forward through `model` they are captured at
    check time and the bundle says so.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 bundle_dir: str | os.PathLike | None = None, config: Any = None, run_id: str | None = None,
                 history: int = 64, log_files: Sequence[str | os.PathLike] = (),
                 on_invalid: str | Callable[[ScanReport, Path | None], Any] = "raise",
                 spikes: str | Callable[[Spike, Path | None], Any] | None = "warn", spike_rule: SpikeRule | None = None,
                 replay_entry: str | None = None, snapshot: str = "none", backend=None, process_group: Any = None,
                 agreement: str = "sync", mode: str = "auto", scaler: Any = None, max_skips: int = MAX_SKIPS,
                 min_scale: float = MIN_SCALE, tensorboard: Any = None, wandb: Any = None,
                 log_every: int | None = None, post_update: bool | str = "auto", source: TensorSource | None = None,
                 frozen_weights: str = "digest", window: Window | int | None | str = "default",
                 step_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
                 rerun_timeout: float = DEFAULT_RERUN_TIMEOUT_S, diagnose: bool = True,
                 diagnose_timeout: float = DEFAULT_DIAGNOSE_TIMEOUT_S, replicas: bool | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        engine_type = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)  # set once deepspeed is imported
        if source is None and engine_type is not None and isinstance(model, engine_type):
            raise TypeError("model is a DeepSpeedEngine, whose gradients and (ZeRO-3) weights are not in its "
                            "parameters: use nanscan.integrations.deepspeed.DeepSpeedMonitor(engine)")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if optimizer is not None:
            optimizer = inner_optimizer(optimizer)  # a container's torch optimizer (torchtitan's)
        if isinstance(on_invalid, str) and on_invalid == "rollback":
            on_invalid = Rollback()  # the string for the default policy
        if not (callable(on_invalid) or on_invalid in ON_INVALID or isinstance(on_invalid, (Rollback, Resume))):
            raise ValueError(f"on_invalid={on_invalid!r}: use one of {', '.join(ON_INVALID)}, 'rollback' (Rollback()), "
                             "a nanscan.Rollback(...), a nanscan.Resume(directory), or a callable "
                             "f(report, bundle_path)")
        if not (spikes is None or callable(spikes) or spikes in SPIKE_POLICIES):
            raise ValueError(f"spikes={spikes!r}: use one of {', '.join(SPIKE_POLICIES)}, a callable f(spike, "
                             "bundle_path), or None to turn spike detection off")
        if spike_rule is not None and not isinstance(spike_rule, SpikeRule):
            raise TypeError("spike_rule must be a nanscan.runtime.spikes.SpikeRule or None, got "
                            f"{type(spike_rule).__name__}")
        if agreement not in ("sync", "async"):
            raise ValueError(f"agreement={agreement!r}: use 'sync' (each step decided before optimizer.step()) or "
                             "'async' (the verdict arrives one step later)")
        if snapshot not in SNAPSHOTS:
            raise ValueError(f"snapshot={snapshot!r}: use 'none' or 'cpu'")
        if frozen_weights not in ("digest", "copy"):
            raise ValueError(f"frozen_weights={frozen_weights!r}: use 'digest' (a bundle names each frozen weight "
                             "with its sha256; replay takes it from the entry's model) or 'copy' (a bundle holds it)")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use 'sync' (check waits for the scan), 'async' (the verdict is read at "
                             "the next check) or 'auto' (async when the model is on a GPU)")
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history={history!r}: keep at least 1 step (the failing one)")
        if replay_entry is not None and not _REPLAY_ENTRY.match(replay_entry):
            raise ValueError(f"replay_entry={replay_entry!r} must look like 'package.module:function'")
        entry_unusable = entry_problem(replay_entry) if replay_entry is not None else None
        if entry_unusable:  # now, while the run can still be fixed; after an incident replay would fail on it
            warn_user(f"nanscan: {entry_unusable}", EntryWarning)
        if step_fn is not None and not callable(step_fn):
            raise TypeError(f"step_fn must be a function step_fn(model, batch) -> loss, got {type(step_fn).__name__}")
        if not (isinstance(rerun_timeout, (int, float)) and rerun_timeout > 0):
            raise ValueError(f"rerun_timeout={rerun_timeout!r}: give the seconds the in-process rerun may take (> 0)")
        if not (isinstance(diagnose_timeout, (int, float)) and diagnose_timeout > 0):
            raise ValueError(f"diagnose_timeout={diagnose_timeout!r}: give the seconds the in-process diagnosis may "
                             "take (> 0)")
        if isinstance(log_files, (str, os.PathLike)):
            log_files = [log_files]
        given = model  # as passed: replicas= compares a DistributedDataParallel's replicas by default
        hooked, model = _unwrap(model)

        self._model: torch.nn.Module | None = model
        self._model_ref = weakref.ref(model)
        self._hooked_ref = weakref.ref(hooked)  # the module whose forward pre-hook marks a step's start
        self._given_ref = weakref.ref(given)  # as the loop calls it: the in-process diagnosis's forward (DDP's)
        self.optimizer = optimizer
        self.bundle_dir = Path(bundle_dir or os.environ.get(BUNDLE_DIR_ENV) or DEFAULT_BUNDLE_DIR).absolute()
        self.config = normalize_config(config)
        self.run_id = check_run_id(run_id) if run_id is not None else _new_run_id()
        self.log_files = tuple(Path(p) for p in log_files)
        self.on_invalid = on_invalid
        self.replay_entry = replay_entry
        self.step_fn = step_fn
        self.rerun_timeout = float(rerun_timeout)
        self.rerun: RerunResult | None = None  # the in-process rerun of the first incident (step_fn)
        self.diagnose = bool(diagnose)
        self.diagnose_timeout = float(diagnose_timeout)
        self.diagnosis: Diagnosis | None = None  # the in-process diagnosis over the window (step_fn, diagnose)
        self.snapshot = snapshot
        self.frozen_weights = frozen_weights
        self.backend = backend
        self.mode = mode
        self.source = capture_source()  # at start-up: the code that runs is the code that was imported

        self._ring = HistoryRing(history)
        self._pending: PendingStep | None = None  # mode="async": the last checked step, verdict not yet read
        self._next_step = 0
        self._micro_batch = 0  # the next micro-batch check's index within its step (NOTE: [micro-batch checks])
        self._observed = ObservedMicroBatches()  # NOTE: [observed micro-batches]
        self._deciding_micro: int | None = None  # the micro-batch whose check is being decided
        self._deciding_observed = False  # ... found by its observed loss (NOTE: [observed micro-batches])
        self.first_invalid_step: int | None = None
        self.bundle_path: Path | None = None
        self.bundle_error: BaseException | None = None  # why the bundle could not be written, if it could not
        self.invalid_steps = 0

        # Spike detection (nanscan.runtime.spikes): the early warning before a divergence; see `spikes` above.
        self.on_spike = spikes
        self.spikes: list[Spike] = []
        self.spike_bundle_path: Path | None = None  # the run's first spike bundle
        self._bundle_attempts: dict[int, int] = {}  # bundles written per step (NOTE: [bundle attempts])
        self._held_step: int | None = None  # under a group: the step whose batch held a quarantined record here
        self._spike_watch = SpikeWatch(spike_rule or SpikeRule()) if spikes is not None else None
        self._decided_spike: Spike | None = None  # mode="async": the spike read at this check, for its report

        # Step-start captures, made by the forward pre-hook and consumed by the next check().
        self._armed = True
        self._started = False
        self._start_warned = False
        self._grad_warned = False
        self._rng: dict | None = None
        self._snapshot = CpuSnapshot() if snapshot == "cpu" else None
        self._spare_snapshot = None  # mode="async": the other buffer, while the pending step's holds its state
        self._hook = hooked.register_forward_pre_hook(_StepStartHook(self), prepend=True)
        weakref.finalize(self, self._hook.remove)

        self.max_skips, self.min_scale = max_skips, min_scale
        self._scaler: ScalerWatch | None = None
        self.scaler = scaler
        self._autocast: dict | None = None  # the autocast region of the last step's forward (nanscan.runtime.amp)
        # The live export (Monitor(tensorboard=..., wandb=...)), fed each step's records; nanscan.integrations.live.
        self._export = monitor_export(log_every, [("tensorboard", tensorboard, tensorboard_export.as_sink),
                                                  ("wandb", wandb, wandb_export.as_sink)])

        setting = window_setting(window, source)  # NOTE: [tensor source]: a framework's where it loads states back
        self._window = WindowKeeper(setting, state_of=source.state if source is not None else None) \
            if setting is not None else None
        if isinstance(on_invalid, Resume) and setting is None:  # NOTE: [resume elsewhere]
            raise ValueError("on_invalid=Resume(...) writes a state the window kept, and this Monitor keeps no window: "
                             "pass window=Window(...) (the default keeps one)")
        self._rollbacks: Rollbacks | None = None  # on_invalid=Rollback(...): NOTE: [rollback]
        # the step whose update skip or a rollback dropped (NOTE: [dropped update]); a TensorSource's optimizer
        # steps over the framework's own gradient buffers, which are put back after the step
        self._dropped = DroppedUpdate(keep_buffers=source is not None)
        if isinstance(on_invalid, Rollback):
            if not reloads(source):
                raise ValueError("on_invalid=Rollback(...) with a TensorSource (source=) that cannot load a state back "
                                 "(no load_state): a rollback loads a kept state into the framework's tensors; use "
                                 "on_invalid='raise' and resume from a checkpoint")
            if setting is None:
                raise ValueError("on_invalid=Rollback(...) goes back to a state the window kept, and this Monitor keeps "
                                 "no window: pass window=Window(...) (the default keeps one)")
            self._rollbacks = Rollbacks(on_invalid, self.bundle_dir / self.run_id, settle_default=setting.steps,
                                        history=self._history_entries,
                                        first_loss=lambda: read_scalar(self._ring.first_loss),
                                        keep_buffers=source is not None)
        self._plan: TensorSource = ModelScanPlan()  # prepares the model's tensors again only when they change
        self._batch_plan = BatchPlan()  # and the batch's, when its structure changes
        self._chosen_backends: dict[tuple[str, str | None, bool], Any] = {}  # see backend_for
        self._agreement = None
        self.tensor_source = source  # a framework's (DeepSpeed's), or None: the module's own tensors
        if source is not None:  # NOTE: [tensor source]: the framework's adapter knows where its tensors are
            self._plan = source
        elif _distributed_ready():
            from nanscan.runtime import distributed  # noqa: PLC0415 - only where torch.distributed is in use

            self._plan = distributed.local_scan_plan()  # FSDP2 shards are DTensors: scan the local part
            if self._snapshot is not None and distributed.has_dtensors(model):
                self._snapshot = CpuSnapshot(local=distributed.local_tensor)  # and copy the local part
            if self._window is not None and distributed.has_dtensors(model):
                self._window = WindowKeeper(self._window.window, local=distributed.local_tensor)  # each rank's own
        if process_group is not False and (process_group is not None or _distributed_ready()):
            from nanscan.runtime.distributed import Agreement, is_replicated  # noqa: PLC0415

            if mode == "async":
                raise ValueError("mode='async' with a process group: the ranks' agreement reads every rank's scan at "
                                 "its check; pass agreement='async' (the verdict arrives one step later) and leave "
                                 "mode at 'auto' or 'sync'")
            self._agreement = Agreement(self, process_group, agreement, run_id_given=run_id is not None,
                                        replicas=replicas, replicated=is_replicated(given))
        # NOTE: [post-update check]: the ranks would have to agree on it, so not under a process group.
        if post_update not in (True, False, "auto", "scan", "date"):
            raise ValueError(f"post_update={post_update!r}: use 'scan' (or True), 'date', 'auto' (scan float16/"
                             "bfloat16 updates, date the others) or False")
        self._updates = UpdateWatch(self, policy=post_update) if post_update and self._agreement is None else None

    # -- public state ---------------------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        model = self._model if self._model is not None else self._model_ref()
        if model is None:
            raise RuntimeError("the Monitor's model has been garbage collected; create a Monitor for the new model")
        return model

    @property
    def autocast(self) -> dict | None:
        """The autocast region ({"device_type", "dtype"}) of the last step's forward, None when it ran outside one."""
        return self._autocast

    @property
    def step(self) -> int:
        """The step number the next check() will use."""
        return self._next_step

    @property
    def scaler(self) -> Any:
        """The GradScaler whose overflow skips are expected (nanscan.runtime.amp), or None."""
        return None if self._scaler is None else self._scaler.scaler

    @scaler.setter
    def scaler(self, scaler: Any) -> None:
        if scaler is not self.scaler:
            self._scaler = None if scaler is None else ScalerWatch(scaler, max_skips=self.max_skips,
                                                                   min_scale=self.min_scale)

    @property
    def history(self) -> tuple[HistoryEntry, ...]:
        """The last `history` steps, oldest first (the first failing step included), copied from the ring."""
        return tuple(self._history_entries())

    def _history_entries(self) -> list[HistoryEntry]:
        # grad_norm comes from the records once they are on the host, never on the every-step path.
        return [HistoryEntry(entry.step, read_scalar(entry.loss), read_scalar(entry.lr), grad_norm(report), report)
                for entry, report in self._ring.entries()]

    def flush(self):
        """Wait for the verdict of the last checked step and apply on_invalid now: call it before optimizer.step()
        to keep a failing step's update from being applied (mode="async", or agreement="async").

        Returns, with a process group, the latest nanscan.runtime.distributed.Verdict; in mode="async", the finished
        ScanReport of the step whose verdict it read (None when none was pending); in mode="sync", None."""
        if self._agreement is not None:
            return self._agreement.flush(self)
        pending = self._pending
        if pending is None:
            return None
        _, _, overflow_skip = self._read_verdict(read_at="flush")
        result = pending.report.result()
        result.overflow_skip = overflow_skip
        return result

    def close(self) -> None:
        """Act on a pending verdict (flush()), then remove the forward pre-hook from the model (and a rollback's
        optimizer hooks, its record brought up to date)."""
        try:
            self.flush()
        finally:
            self._hook.remove()
            if self._updates is not None:
                self._updates.close()
            if self._export is not None:
                self._export.close()
            if self._rollbacks is not None:
                self._rollbacks.close()
            self._dropped.disarm()
            if self._window is not None:
                self._window.update_factors.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            if self._agreement is not None:
                self._agreement.discard()  # already failing: start no collective that other ranks may not join
            elif self._pending is not None:
                self._read_verdict_quietly()
        self.close()

    def _read_verdict_quietly(self) -> None:
        """The loop is already failing: still bundle the last step if it was non-finite (the failure may be its
        consequence), but do not replace the loop's exception with on_invalid's."""
        try:
            self._read_verdict(read_at="close")
        except Exception as exc:  # noqa: BLE001 - logged; the exception leaving the with-block is the loop's
            text = str(exc) if isinstance(exc, NonFiniteError) else \
                f"nanscan: on_invalid raised {type(exc).__name__}: {exc}"
            log.error("%s (not raised: the loop is already failing)", text)

    # -- the step -------------------------------------------------------------------------------------------
    def _on_step_start(self, module: torch.nn.Module) -> None:
        model = self._model_ref()
        if not self._armed or module is not self._hooked_ref() or model is None or not model.training:
            return  # an eval forward, a second forward of the same step, or another module sharing the hook
        self.begin_step()

    def begin_step(self, *, autocast: Any = "current") -> None:
        """Mark the start of a training step: the RNG states (and with snapshot="cpu" the pre-step state) are
        taken now. A hand-written loop need not call it: the model's first forward in train mode after a check
        does. The trainer adapters (nanscan.integrations) call it from the trainer's own step-start hook, which
        also sees a step whose training_step calls a submodule (self.net(...)) rather than the model.

        autocast: the autocast region the step's forward runs in, {"device_type", "dtype"} or None, when the
        trainer decides it (its precision setting: accelerate enters autocast inside forward, where no hook sees
        it); by default the autocast state at this call. Once the step has started, only an explicit `autocast`
        is taken (it replaces the one recorded)."""
        if autocast != "current" and not (autocast is None or isinstance(autocast, dict)):
            raise TypeError(f"autocast={autocast!r}: give {{'device_type': ..., 'dtype': ...}} or None")
        if not self._armed:
            if autocast != "current":
                self._autocast = autocast
            return
        model = self.model
        self._armed = False
        self._started = True
        # torch's generators drive the random ops inside the model (dropout); numpy's and Python's state APIs are
        # slow enough (~0.2 ms) to be taken every step only in exact-snapshot mode, else at the incident.
        self._rng = capture_rng(RNG_SOURCES if self._snapshot is not None else ("torch",))
        self._autocast = (autocast_state("cuda") or autocast_state("cpu")) if autocast == "current" else autocast
        if self._micro_batch:
            # a later micro-batch of the same optimizer step: no update came since its first micro-batch's start,
            # whose copies (snapshot, window) still hold the pre-step state, so none is taken again (a copy per
            # micro-batch cost 1.2x a step at two micro-batches); the RNG state is each forward's own
            return
        if self._snapshot is not None:
            self._snapshot.capture(model, self.optimizer)
        if self._window is not None:  # NOTE: [run window]: a state every `every` steps
            self._window.begin(model, self.optimizer)

    def check(self, batch: Any = None, loss: Any = None, sample_ids: Any = None, lr: float | None = None,
              step: int | None = None, *, micro_batch: bool = False) -> ScanReport:
        """Scan this step's batch, loss, weights, gradients and optimizer state in one scan.

        batch: tensors in nested dicts/lists/tuples; floating ones are scanned as `input:<path>` (e.g.
            `input:tokens`, `input:0.x`); all of them are stored in the bundle of a failing step.
        loss: the loss tensor (or float), scanned as `loss`. sample_ids: ids of the batch's samples (stored).
        lr: the learning rate (default: the optimizer's first param group). step: an int that overrides the step
            counter.
        micro_batch: True after the backward of each micro-batch but the last of an optimizer step (gradient
            accumulation, DDP's no_sync(); nanscan.runtime.verdict NOTE: [micro-batch checks]): no step of its own,
            decided at once, a non-finite one the step's incident at that micro-batch (and rank).
        Returns the ScanReport (in mode="async" a PendingReport, before the scan has finished); see the class
        docstring for what happens when it is not ok.
        """
        step_check = self._prepare(batch, loss, sample_ids, lr, step, micro_batch)
        micro = step_check.micro is not None
        path = self._MICRO if micro else self._ASYNC if self.mode == "async" else self._SYNC
        return path.run(self, step_check)  # NOTE: [check stages]

    def observe(self, batch: Any = None, loss: Any = None, sample_ids: Any = None, *,
                step: int | None = None) -> None:
        """Hand the Monitor a micro-batch without a scan: after the backward of each micro-batch but the last of an
        optimizer step (gradient accumulation), its loss as the loop backpropagates it (divided by the
        accumulation count) and its batch (NOTE: [observed micro-batches] in nanscan/runtime/observed.py).

        No scan: the loss is kept (no host sync), the batch by reference, the window records the micro-batch
        (benchmarks/bench_observe.py: three calls cost about a quarter of three micro-batch checks). The step's
        check then scans the sum of the observed losses and its own (the step's mean loss, the one recorded); a non-finite loss in any micro-batch is that step's incident, at that micro-batch, with
        its batch in the bundle. `step`: the step number, when the loop gives check() its own."""
        step = self._next_step if step is None else _step_number(step)
        started, self._started, self._armed = self._started, False, True  # the next micro-batch's start is its own
        self._drop_quarantined(step, batch, sample_ids)  # NOTE: [dropped update]
        micro, self._micro_batch = self._micro_batch, self._micro_batch + 1
        self._observed.add(micro, loss, batch, sample_ids)
        self._keep_in_window(self.model, step, micro, started, batch, sample_ids, None, loss)  # its rerun replays each

    # -- check()'s stages (nanscan.runtime.stages NOTE: [check stages]) -----------------------------------------
    def _prepare(self, batch: Any, loss: Any, sample_ids: Any, lr: Any, step: int | None,
                 micro_batch: bool) -> StepCheck:
        """What every path starts from: the step's number and micro-batch index, the step start this check closes,
        the update before it, the batch plan's inputs, the GradScaler's state and the mode."""
        model = self.model
        step = self._next_step if step is None else _step_number(step)
        # Taken (and the next step's start armed) before anything can fail: a check that raises below leaves no
        # step-start capture behind for a later step to pass off as its own.
        started, self._started, self._armed = self._started, False, True
        micro = self._micro_batch if micro_batch else None  # this check's index within its step, or None
        self._drop_quarantined(step, batch, sample_ids)  # NOTE: [dropped update]
        self._micro_batch = self._micro_batch + 1 if micro_batch else 0
        if micro is not None and self._pending is not None:  # decided at once: the step before it first
            self._read_verdict(read_at="next_check")
        carried = dated = None
        if self._updates is not None:  # NOTE: [post-update check]: only an update right after a finite check
            self._updates.forget()
            self._updates.attach(self.optimizer)
            carried = self._updates.carried_rows(self._plan)  # NOTE: [carried records]
            dated = self._updates.take_dated()  # NOTE: [dated updates]
        if not started and self._snapshot is not None and not self._start_warned:
            self._start_warned = True  # at the first such check, while the run can still be fixed
            warn_user(f"nanscan: snapshot='cpu' but no step start was seen before the check of step {step}: no "
                      "forward of the model in train mode since the previous check (a training_step calling "
                      "self.net(...)?), so a bundle would hold the state at the check, not the pre-step state; "
                      "call monitor.begin_step() at each step's start, or use a trainer adapter "
                      "(nanscan.integrations)", SnapshotWarning)
        if loss is not None and not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss), dtype=torch.float64)
        passed = loss  # as the loop backpropagated it (NOTE: [observed loop])
        if micro is None:  # the step's own check: the losses of its earlier micro-batches join its own
            loss = self._observed.fold(step, loss)  # NOTE: [observed micro-batches]
        else:
            self._observed.add_checked(step, loss)
        step_inputs = self._batch_plan.prepare(batch, loss)  # NOTE: [batch plan]
        scaling = read_scaling(self.scaler, self.optimizer)  # NOTE: [overflow skips]; before the scan is enqueued
        if self.mode == "auto":
            self.mode = self._auto_mode(model)
        return StepCheck(model, step, batch, loss, sample_ids, lr, started, micro, step_inputs, scaling,
                         carried=carried, dated=dated, passed_loss=passed)

    def _scan(self, check: StepCheck) -> None:
        """Scan now: on the CPU the plans are confirmed and scanned in one native call (ModelScanPlan.scan_on_host),
        elsewhere the inputs are launched on their backends."""
        check.host = self._plan.scan_on_host(check.model, self.optimizer, extra=check.step_inputs,
                                             backend_for=self.backend_for, carried=check.carried)
        if check.host is None:
            check.inputs = self._plan.inputs(check.model, self.optimizer, extra=check.step_inputs)
            check.scan = launch(check.inputs, backend=self.backend_for(check.inputs.devices))

    def _read_inputs(self, check: StepCheck) -> None:
        """mode="async": the inputs only; they are launched after the previous step's verdict is read (_launch)."""
        check.inputs = self._plan.inputs(check.model, self.optimizer, extra=check.step_inputs)

    def _count(self, check: StepCheck) -> None:
        """Count the step once its inputs are read (a check that could not scan is no step, nor is a micro-batch's),
        warn once where it saw no gradient, and take the learning rate."""
        step = check.step
        self._next_step = step if check.micro is not None else step + 1
        if self._plan.no_gradients and not self._grad_warned:
            self._grad_warned = True
            warn_user(f"nanscan: the check of step {step} saw no gradient although the model has parameters that "
                      "train: check() must come after loss.backward() and before optimizer.zero_grad() (with "
                      "set_to_none=True the gradients are gone); under gradient accumulation, check once per "
                      "optimizer step, after the last micro-batch's backward", GradientWarning)
        if check.lr is None and self.optimizer is not None and self.optimizer.param_groups:
            check.lr = self.optimizer.param_groups[0].get("lr")

    def _record(self, check: StepCheck) -> None:
        """mode="sync": the step's report, into the history ring and the live export (written before the verdict
        acts: a raising incident is in the log too)."""
        summary = check.host.summary if check.host is not None else None  # NOTE: [step summary] (plan_check.cpp)
        kept_loss = summary.loss_value if summary is not None and summary.loss_value is not None else \
            kept_scalar(check.loss, check.step_inputs)
        kept_lr = kept_scalar(check.lr)
        report = check.report = scanned_report(check.host, check.scan, check.skipped, check.step, check.scaling)
        tensors = report.tensors
        if check.host is not None:
            check.slot = self._ring.append_host(check.step, tensors, report.records, check.skipped, report.backend,
                                                loss=kept_loss, lr=kept_lr, scaling=check.scaling,
                                                compacted=summary.compact if summary is not None else None)
        else:
            check.slot = self._ring.append(check.step, check.scan, tensors, check.skipped, loss=kept_loss, lr=kept_lr,
                                           scaling=check.scaling)
        if self._export is not None:
            self._export.record(check.step, report.records, tensors, loss=kept_loss, lr=kept_lr)

    def _spot_spike(self, check: StepCheck) -> None:
        """mode="sync": a finite step's loss and gradient norm against their recent range (NOTE: [spike
        statistic]); at a spike the report carries it. Not with a process group (the ranks would have to agree)."""
        if self._spike_watch is not None and self._agreement is None and check.report.ok:
            summary = check.host.summary if check.host is not None else None
            check.report = self._spike_at_check(check.report, check.step, check.batch, check.sample_ids,
                                                check.started, summary)

    def _decide(self, check: StepCheck) -> ScanReport:
        """mode="sync", last: decide the step, alone or with the other ranks (nanscan.runtime.distributed), and act
        on a non-finite one (nanscan.runtime.verdict: the bundle, then on_invalid's raise, skip or warn)."""
        report, step = check.report, check.step
        if self._agreement is not None:
            return self._agreement.decide(self, report, step, check.batch, check.sample_ids, check.started,
                                          slot=check.slot)
        if report.ok:
            self.finite_step(step)
            if self._updates is not None:
                start = StepStart(self._rng, self._snapshot) if check.started else StepStart(None, None)
                context = UpdateContext(step, check.batch, check.sample_ids, check.started, start)
                if self._updates.expect(context, self._plan) == "date" and check.started:
                    self._keep_start_snapshot()  # read at the next check, after the next step's start
            return report
        if check.dated is not None and self._dated_incident(report, check.dated, step):
            return report
        return self._invalid(report, step, check.batch, check.sample_ids, check.started, slot=check.slot)

    def _decide_pending(self, check: StepCheck) -> None:
        """mode="async": act on the previous step's verdict now, before this step's scan is launched. The dated
        update is stamped first (NOTE: [dated updates]): its verdict is read one step later."""
        if check.dated is not None:
            check.dated.seen()
        check.decided = self._read_verdict(read_at="next_check")

    def _launch(self, check: StepCheck) -> None:
        check.scan = launch(check.inputs, backend=self.backend_for(check.inputs.devices))

    def _record_pending(self, check: StepCheck) -> None:
        """mode="async": the step into the live export and the history ring, whose verdict flag is read later (the
        export's copies are enqueued before the flag's: back once the verdict is)."""
        tensors = check.inputs.identities
        kept_loss, kept_lr = kept_scalar(check.loss), kept_scalar(check.lr)
        if self._export is not None:
            self._export.record(check.step, check.scan, tensors, loss=kept_loss, lr=kept_lr)
        check.slot = self._ring.append(check.step, check.scan, tensors, check.skipped, loss=kept_loss, lr=kept_lr,
                                       verdict=True, scaling=check.scaling)

    def _spot_spike_on_device(self, check: StepCheck) -> None:
        check.found_inf = self._spike_on_device(check.step, check.scan, check.inputs.identities, check.scaling)

    def _keep_pending(self, check: StepCheck) -> PendingReport:
        """mode="async", last: keep the step until its verdict is read, and return without waiting for its scan."""
        decided_step, decided_ok, decided_skip = check.decided
        step, scan, started = check.step, check.scan, check.started
        report = PendingReport(check.inputs.identities, scan, skipped=check.skipped, backend=scan.backend, step=step,
                               ok=decided_ok, decided_step=decided_step, found_inf=check.found_inf,
                               scaling=check.scaling, overflow_skip=decided_skip)
        report.spike, self._decided_spike = self._decided_spike, None
        start = StepStart(self._rng, self._snapshot) if started else StepStart(None, None)
        self._pending = PendingStep(step, report, scan, check.slot, retained(check.batch),
                                    retained(check.sample_ids), started, start, check.dated)
        if self._updates is not None:  # read with its verdict, later
            self._updates.expect(UpdateContext(step, self._pending.batch, self._pending.sample_ids, started, start),
                                 self._plan)
        if started:
            self._keep_start_snapshot()  # the pending step's
        return report

    def _keep_window(self, check: StepCheck) -> None:
        """The step into the run's window (NOTE: [run window]): its batch and settings, and a state when one is due;
        after an async check's decision on the step before it, so that step's bundle does not hold this one."""
        self._keep_in_window(check.model, check.step, check.micro, check.started, check.batch, check.sample_ids,
                             check.scaling, check.passed_loss)

    def _keep_in_window(self, model: torch.nn.Module, step: int, micro: int | None, started: bool, batch: Any,
                        sample_ids: Any, scaling: Any, loss: Any) -> None:
        """A check's or an observed micro-batch's batch, settings and loss into the run's window, if it keeps one."""
        if self._window is not None:
            self._window.keep(model=model, optimizer=self.optimizer, step=step, micro=micro, started=started,
                              batch=batch, sample_ids=sample_ids, scaling=scaling, autocast=self._autocast,
                              rng=self._rng, loss=loss)

    _SYNC = CheckPath((_scan, _count, _keep_window, _record, _spot_spike), _decide)
    _ASYNC = CheckPath((_read_inputs, _count, _decide_pending, _keep_window, _launch, _record_pending,
                        _spot_spike_on_device), _keep_pending)
    _MICRO = CheckPath((_scan, _count, _keep_window), StepVerdicts._decide_micro)

    def backend_for(self, devices: tuple[str, ...]) -> Any:
        """The backend for a check's inputs on `devices`: the one Backend of a check on one device, or a mapping
        from device to Backend for a check that spans several (CUDA weights beside AdamW's CPU step counters). Each
        is chosen once per device and `backend` setting, by launch's policy (nanscan.engine.dispatch.select_for_part;
        NANSCAN_BACKEND is read at the first check on the device), because choosing again every step costs as much
        as a tenth of a small model's scan."""
        backend = self.backend
        if not devices or not (backend is None or isinstance(backend, str)):
            return backend
        mixed = len(devices) > 1
        chosen = {}
        for device in devices:
            key = (device, backend, mixed)
            found = self._chosen_backends.get(key)
            if found is None:
                found = self._chosen_backends[key] = select_for_part(torch.device(device), backend, mixed=mixed)
            chosen[device] = found
        return chosen if mixed else chosen[devices[0]]

    def _auto_mode(self, model: torch.nn.Module) -> str:
        if self._agreement is not None:
            return "sync"
        first = next(iter(model.parameters()), None)
        return "async" if first is not None and first.device.type == "cuda" else "sync"

    def _read_verdict(self, *, read_at: str) -> tuple[int | None, bool, bool]:
        """Read the pending step's verdict (waiting for its flag only) and act on it as check() does in sync mode.
        Returns (that step or None, whether it was finite, whether it was an overflow skip)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None, True, False
        nonfinite = self._ring.verdict(pending.slot, pending.scan)
        if self._export is not None:  # step s's records came back before its flag (_check_async)
            self._export.poll()
        if not nonfinite:
            self.finite_step(pending.step)
            self._read_spike(pending, read_at)
            if self._updates is not None:  # its update's verdict, enqueued after the step's own
                self._updates.read()
            return pending.step, True, False
        if pending.dated is not None and self._dated_incident(pending.report.result(), pending.dated, pending.step):
            return pending.step, False, False
        result = self._invalid(pending.report.result(), pending.step, pending.batch, pending.sample_ids,
                               pending.started, start=pending.start, read_at=read_at, slot=pending.slot)
        return pending.step, False, result.overflow_skip
