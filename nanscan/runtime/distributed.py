"""Distributed training (torch.distributed, DDP and FSDP2): every rank scans what it holds, the ranks agree on each
step's verdict through one small all-reduce, and a failing step leaves one bundle set: a part per rank plus an
index written by rank 0.

A Monitor created while torch.distributed is initialized agrees over the world group (or the `process_group=` it
is given); nothing here runs for a single process.

Agreement. At every check each rank all-reduces (MAX) four int64 values: its non-finite flag, the step, minus the
step and minus its rank when its flag is set (and, with replicas compared, six more per replica set: NOTE: [replica
agreement] in nanscan/runtime/replicas.py).
One collective tells every rank whether any rank saw NaN/inf at this step, which rank was the lowest to see it, and
whether all ranks checked the same step. Every rank then applies the same `on_invalid` at the same step, so no rank
is left waiting in a collective that the others never join.

- agreement="sync" (default): the all-reduce is issued and waited for inside the check. Every rank decides step s
  before its optimizer.step(): with on_invalid="raise" all ranks raise NonFiniteError naming step s, and step s's
  update is never applied; with "skip" every rank drops step s's gradients. The cost is one tiny collective per
  step (on CPU/gloo about the latency of one round trip), on top of the host synchronisation the scan already does.
- agreement="async": the all-reduce is issued with async_op=True and the host does not wait for it; its result is
  read at the next check (or at Monitor.flush() / close()). The verdict for step s therefore arrives at step s+1's
  check and names step s, after every rank has already applied step s's update (and run step s+1's forward and
  backward). A rank that sees NaN/inf itself writes its part at once, at step s; ranks whose own tensors were
  finite write theirs when the verdict arrives, with the state of step s+1's check (the part's manifest says so).
  Where step s's update must not happen, call `mon.flush()` before `optimizer.step()` (on every rank): it waits
  for step s's verdict and applies on_invalid then, exactly as in sync mode.

The report check() returns has the agreed `ok`, the same on every rank at every check, so a loop that branches on
it (`if not report.ok: continue`) keeps the ranks in lockstep; `report.local_ok` (nanscan.runtime.distributed.
AgreedScanReport) is the rank's own answer where the two differ. In sync mode `ok` is False on every rank at the
failing step, also where the rank's own tensors were finite. In async mode it is False from the check where the
verdict arrives; until then a rank that saw NaN/inf itself gets `ok` True like the others, which do not know yet.

Replicas. The same all-reduce also compares what every replica must hold bit for bit: under DDP the parameters,
optimizer state and reduced gradients; under ZeRO-1/2 the low-precision weights; for DTensors the local tensors of
the ranks their placements replicate them over (HSDP's replicate dimension, tensor-parallel norms). A few more int64
slots carry each replica set's combined fingerprints, and a difference is an incident of its own category,
replica_mismatch, with no NaN needed (NOTE: [replica agreement] in nanscan/runtime/replicas.py).

Names. Under DDP each rank scans whole parameters under their unwrapped names (the Monitor unwraps
DistributedDataParallel, so the names and the stored state match the single-process model). Under FSDP2
(`fully_shard`) parameters, gradients and optimizer state are DTensors: each rank scans its local shard and names it
with the global parameter name and its shard index, e.g. `param:layers.0.weight@shard1/4` (shard 1 of 4 along the
mesh dimension that shards it).

Bundle set. On the first failing step every rank writes its part, `<bundle_dir>/<run_id>/step-<s>/rank-<r>/` (an
ordinary bundle whose manifest has a `distributed` section); then the ranks gather one summary each (a collective
on the failure path only) and rank 0 writes `step-<s>/index.json`, naming the first bad rank(s) and their tensors.
"First" orders the ranks by how early in the step their non-finite values appeared (input, parameter, optimizer
state, loss, gradient: the order of the Monitor's categories), then by rank: under DDP a NaN in rank 1's batch makes
every rank's gradients NaN through the gradient all-reduce, but only rank 1's batch was non-finite. Ranks that tie
are all named. `load_bundle(step-dir)` returns a nanscan.bundle.BundleSet: the first bad rank's part (so report, replay and notes
work on it unchanged) with every other part and the index beside it. Its `state()` joins FSDP shards from all parts
into full tensors, so the failing rank's step can be replayed in a single process.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import socket
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from nanscan.bundle import BundleError, Incident, bundle_path
from nanscan.bundle.format import MANIFEST
from nanscan.bundle.rank_set import INDEX, INDEX_SCHEMA, device_label, write_index
from nanscan.incident import (OTHER_RANK, REPLICA_MISMATCH, NonFiniteError, categorize, category_rank,
                              shown_names, warn_user)
from nanscan.engine.stats import ScanReport
from nanscan.runtime.replicas import (ReplicaSets, ReplicaView, hex_fingerprints, is_replicated,
                                      replica_verdict, replicated_dtensors)
from nanscan.runtime.resume import CHECKPOINT_ERRORS, Resume, exit_for_restart
from nanscan.runtime.rollback import Rollback, bad_row_ids
from nanscan.runtime.shards import (SHARD_SUFFIX, has_dtensors, local_scan_plan, local_shard, local_tensor,
                                    localize_state, shard_layout, shard_suffix)

__all__ = ["AGREEMENTS", "Agreement", "AgreedScanReport", "DistributedNonFiniteError", "ReplicaMismatchError",
           "SHARD_SUFFIX", "Verdict", "device_info", "distributed_ready", "first_bad_ranks", "has_dtensors",
           "hosts_summary", "is_replicated", "local_scan_plan", "local_shard", "local_tensor", "shard_layout",
           "shard_suffix"]

log = logging.getLogger("nanscan")

# How long a Monitor closed by an exception waits for its last agreement collective (Agreement.discard).
DISCARD_WAIT = datetime.timedelta(seconds=60)

AGREEMENTS = ("sync", "async")
NONFINITE_LISTED = 20  # non-finite tensors listed per rank in the index; every one is in the rank's own manifest
# Payload slots of the per-step all-reduce (MAX); see the module docstring. With replicas compared, two more per
# replica set and group of REPLICA_GROUPS: its combined fingerprint and that value's bitwise complement (NOTE:
# [replica agreement] in nanscan/runtime/replicas.py).
# _HELD: NOTE: [dropped update]; _NOT_SKIP: a rank's failure is no GradScaler overflow skip (NOTE: [agreed skips])
_FLAG, _STEP, _NEG_STEP, _NEG_BAD_RANK, _HELD, _NOT_SKIP = range(6)


def _sharded(model: torch.nn.Module, source: Any = None, world_size: int = 2) -> str | None:
    """Why this rank's weights cannot be rerun alone (nanscan.runtime.incident_rerun NOTE: [in-process rerun]), or
    None: a replicated model (DDP) reruns on the plain module, with no collective, and on a group of one rank
    (`world_size`) the sharded module's collectives involve no other rank. `source`: the Monitor's tensor source
    (NOTE: [tensor source]), a framework's whose hooks run collectives inside the module's own passes."""
    if world_size == 1 and source is None:
        return None
    if source is not None:
        return (f"{type(source).__name__} keeps the model's tensors for its framework (DeepSpeed), whose hooks run "
                "collectives inside the module's forward and backward: one rank cannot rerun the step alone; "
                "`nanscan replay` with a replay entry reruns it")
    if has_dtensors(model) or _flat_parameters(model):
        return ("the weights are sharded across the ranks (FSDP): a rerun on one rank alone cannot gather them; "
                "`nanscan replay` with a replay entry reruns the step")
    return None


def _flat_parameters(model: torch.nn.Module) -> bool:
    """Whether the model holds FSDP (1)'s flat parameters: each rank's bytes are its own, nothing is replicated."""
    return any(type(p).__name__ == "FlatParameter" for p in model.parameters())


def device_info(model: torch.nn.Module) -> dict:
    """This rank's host and device, as a part and the index record them: the device of the model's first parameter,
    its index, and on a GPU its name, UUID and PCI bus id (None where torch does not give them, and on the CPU)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    info = {"host": socket.gethostname(), "device": str(device), "index": device.index, "name": None, "uuid": None,
            "pci_bus_id": None}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        bus, domain, slot = (getattr(props, f"pci_{k}_id", None) for k in ("bus", "domain", "device"))
        info.update(device=f"cuda:{index}", index=index, name=props.name, uuid=None if uuid is None else str(uuid),
                    pci_bus_id=None if bus is None else f"{domain or 0:04x}:{bus:02x}:{slot or 0:02x}.0")
    return info


# -- the process group ------------------------------------------------------------------------------------------

def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device(group) -> torch.device:
    """Where the group's collectives take their tensors: NCCL wants the current CUDA device, gloo and MPI the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(value: Any, group, device: torch.device) -> list:
    """Every rank's JSON value, in rank order (two collectives: the lengths, then the padded bytes). JSON rather
    than all_gather_object, which pickles."""
    data = np.frombuffer(json.dumps(value, allow_nan=False).encode("utf-8"), dtype=np.uint8)
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.from_numpy(data.copy())
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [json.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, sizes)]


# -- verdicts ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the ranks agreed about one step. `lowest_bad_rank`: the lowest rank that saw NaN/inf (None when ok).
    On the first failing step `first_bad_ranks` and `bad_ranks` come from the gathered summaries (see the module
    docstring for "first"); later failing steps only carry lowest_bad_rank. `replica_groups`: the groups whose
    replicas differed (NOTE: [replica agreement]); `replicas`: on the first failing step, what the gathered
    fingerprints say (replica_verdict)."""

    step: int
    ok: bool
    lowest_bad_rank: int | None = None
    first_bad_ranks: tuple[int, ...] = ()
    bad_ranks: tuple[int, ...] = ()
    replica_groups: tuple[str, ...] = ()
    replicas: dict | None = None
    held: bool = False  # some rank's batch held a record a rollback quarantined: the step's update is dropped
    overflow_skip: bool = False  # every rank's failure is its GradScaler's overflow skip (NOTE: [agreed skips])

    @property
    def replica_only(self) -> bool:
        """The replicas differed and no rank saw NaN/inf: an incident of category replica_mismatch."""
        return bool(self.replica_groups) and self.lowest_bad_rank is None


class AgreedScanReport(ScanReport):
    """This rank's scan of a step, whose `ok` is the ranks' agreed answer rather than this rank's own
    (`local_ok`), so that every rank's loop takes the same branch.

    Returned where the two differ: on every rank of a step agreed non-finite (`ok` False, also where this rank's
    tensors were finite), and in async mode on a rank that saw NaN/inf itself before the others know (`ok` True:
    no rank has decided yet; the verdict comes at the next check). `verdict`: the verdict read at this check (in
    async mode the previous step's), None before any.
    """

    def __init__(self, report: ScanReport, verdict: Verdict | None, *, ok: bool, overflow_skip: bool = False):
        super().__init__(report.tensors, report.records, skipped=report.skipped, backend=report.backend,
                         step=report.step, scaling=report.scaling, overflow_skip=overflow_skip)
        self.verdict = verdict
        self._agreed_ok = ok

    @property
    def ok(self) -> bool:
        return self._agreed_ok

    @property
    def local_ok(self) -> bool:
        return ScanReport.ok.fget(self)


class DistributedNonFiniteError(NonFiniteError):
    """NonFiniteError raised on every rank at the same step. `category` and `tensors` are the first bad rank's;
    `rank` is this process's rank, `local_category` its own category at that step, `first_bad_ranks` and
    `bad_ranks` as in the bundle set's index. `bundle_path` is the set (the step-<s> directory)."""

    def __init__(self, message: str, *, rank: int, local_category: str, verdict: Verdict, **fields):
        super().__init__(message, **fields)
        self.rank = rank
        self.local_category = local_category
        self.first_bad_ranks = list(verdict.first_bad_ranks)
        self.bad_ranks = list(verdict.bad_ranks)


class ReplicaMismatchError(DistributedNonFiniteError):
    """Raised on every rank at the same step when replicas that must be bit-identical differed and no value was
    non-finite (category replica_mismatch, NOTE: [replica agreement]); a DistributedNonFiniteError, so a loop that
    stops on NonFiniteError stops on it too. `odd_ranks`: the ranks named (by majority with 3 or more replicas,
    both with 2); `replicas`: the whole replica verdict, as in the bundle set's index."""

    def __init__(self, message: str, **fields):
        super().__init__(message, **fields)
        replicas = fields["verdict"].replicas or {}
        self.odd_ranks = list(replicas.get("odd_ranks", []))
        self.replicas = replicas


@dataclasses.dataclass
class _Pending:
    """An issued, not yet read all-reduce (async mode) and the evidence of its step."""

    work: Any
    payload: torch.Tensor
    step: int
    report: ScanReport
    batch: Any
    sample_ids: Any
    started: bool
    view: ReplicaView | None = None  # what this rank compares of the step (NOTE: [replica agreement])


class MonitorSide(Protocol):
    """What the agreement uses of its Monitor (nanscan.runtime.monitor.Monitor is one): the settings the ranks must
    share, the incident state it keeps for the ranks (the first invalid step, the later ones' count, where the set
    went), and `incident(...)`, which gathers one step's evidence for this rank's part. Nothing else of the Monitor's is
    read or changed here."""

    on_invalid: Any
    run_id: str
    bundle_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    step: int  # the step the next check will use: equal to a micro-batch check's own (NOTE: [micro-batch checks])
    first_invalid_step: int | None
    invalid_steps: int
    bundle_path: Path | None
    bundle_error: BaseException | None
    rerun: Any  # the in-process rerun's result (Monitor(step_fn=...)), None until one ran
    diagnosis: Any  # the in-process diagnosis over the window (Monitor(step_fn=...)), None until one ran
    tensor_source: Any  # a framework's TensorSource (NOTE: [tensor source]), or None

    def incident(self, report: ScanReport, step: int, category: str, tensors: list[str], batch: Any,
                 sample_ids: Any, started: bool) -> Incident: ...

    def rerun_record(self) -> dict | None: ...

    def write_incident(self, incident: Incident) -> Path: ...

    def attempt_of(self, step: int) -> int: ...

    def finite_step(self, step: int) -> None: ...

    def is_overflow_skip(self, report: ScanReport) -> bool: ...

    def agreed_overflow_skip(self, report: ScanReport, slot: int | None) -> bool: ...

    def quarantine_held(self, step: int) -> bool: ...

    def drop_update(self, step: int) -> None: ...

    def update_dropped(self, step: int) -> bool: ...

    def roll_back(self, step: int, category: str, tensors: list[str], message: str, *, live_start: bool,
                  batch: Any = None, sample_ids: Any = None, ledger: bool = True) -> None: ...

    def rerun_incident(self, path: Path | None, step: int, batch: Any, started: bool, *, start: Any,
                       read_at: str | None, sharded: str | None = None) -> None: ...

    def diagnose_incident(self, path: Path | None, step: int) -> None: ...


class Agreement:
    """The Monitor's side of the distributed protocol (see the module docstring). Created by Monitor when a process
    group is in effect; every method that runs a collective is reached by every rank in the same order."""

    def __init__(self, monitor: MonitorSide, process_group=None, mode: str = "sync", *, run_id_given: bool,
                 replicas: bool | None = None, replicated: bool = False):
        if mode not in AGREEMENTS:
            raise ValueError(f"agreement={mode!r}: use 'sync' (decide each step before optimizer.step()) or 'async' "
                             "(the verdict arrives one step later)")
        if not distributed_ready():
            raise ValueError("process_group was given but torch.distributed is not initialized: call "
                             "torch.distributed.init_process_group first, or pass process_group=False")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.mode = mode
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process_group given to the Monitor; pass a group "
                             "it belongs to (or process_group=False)")
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        self.device = _collective_device(self.group)
        self.verdict: Verdict | None = None
        self._pending: _Pending | None = None
        self._early: tuple[int, Path | None, BaseException | None] | None = None  # async: part written at once
        self._first_bad: tuple[str, list[str]] | None = None  # category and tensors of the first bad rank
        self.replicas = self._compares(monitor.model, replicas, replicated)
        self._replicas = None
        if self.replicas:  # NOTE: [replica agreement]: plain tensors across the group for DDP or replicas=True only
            ranks = {dist.get_global_rank(self.group, r) if self.group is not dist.group.WORLD else r: r
                     for r in range(self.world_size)}
            self._replicas = ReplicaSets(monitor.model, ranks, plain=bool(replicas) or replicated)
        self._agree_on_settings(monitor, run_id_given)

    @staticmethod
    def _compares(model: torch.nn.Module, replicas: bool | None, replicated: bool) -> bool:
        """Whether replicas are compared (NOTE: [replica agreement]): by default for a DistributedDataParallel
        model and for DTensors replicated over a mesh dimension (HSDP, tensor-parallel norms); replicas=True also
        for a TensorSource's or a plain module's tensors that the caller knows are replicated."""
        if replicas is None:
            return (replicated and not _flat_parameters(model) and not has_dtensors(model)) or \
                replicated_dtensors(model)
        if replicas and (_flat_parameters(model) or has_dtensors(model) and not replicated_dtensors(model)):
            raise ValueError("replicas=True with sharded weights (FSDP's flat parameters, or DTensors sharded over "
                             "every mesh dimension): each rank holds other bytes, there is nothing replicated to "
                             "compare; leave replicas at its default (DDP models and DTensors replicated over a "
                             "mesh dimension, as HSDP's) or pass replicas=False")
        return bool(replicas)

    def _agree_on_settings(self, monitor: MonitorSide, run_id_given: bool) -> None:
        """One gather at start-up: every rank must write into the same run and react the same way, else one rank
        would raise while another waits for it in the next collective."""
        policy = monitor.on_invalid if isinstance(monitor.on_invalid, str) else "callable"
        mine = {"run_id": monitor.run_id if run_id_given else None, "proposed": monitor.run_id,
                "on_invalid": policy, "agreement": self.mode, "replicas": self.replicas,
                "replica_sets": self._replicas.local if self._replicas is not None else []}
        everyone = all_gather_json(mine, self.group, self.device)
        for key in ("on_invalid", "agreement", "replicas"):
            values = sorted({str(e[key]) for e in everyone})
            if len(values) > 1:
                raise ValueError(f"the ranks created their Monitors with different {key} ({', '.join(values)}): "
                                 f"pass the same {key} on every rank, else one rank stops while another waits for it")
        if self._replicas is not None:
            self._replicas.agree(e["replica_sets"] for e in everyone)
        given = {e["run_id"] for e in everyone}
        if len(given) > 1:
            shown = ", ".join(sorted(str(g) for g in given))
            raise ValueError(f"the ranks passed different run_ids ({shown}): pass the same run_id on every rank "
                             "(or none, and rank 0's is used), so that their parts land in one bundle set")
        monitor.run_id = everyone[0]["run_id"] or everyone[0]["proposed"]

    # -- every step ------------------------------------------------------------------------------------------------
    def _issue(self, monitor: MonitorSide, report: ScanReport, step: int):
        bad = not report.ok
        values = [int(bad), step, -step, -(self.rank if bad else self.world_size), int(monitor.quarantine_held(step)),
                  # every rank must record an agreed skip alike: one without a scale in effect vetoes it
                  int(report.scaling is None or bad and not monitor.is_overflow_skip(report))]
        view = None
        if self._replicas is not None:  # NOTE: [replica agreement]; a micro-batch check leaves monitor.step at its step
            view = self._replicas.view(report, monitor.model, monitor.optimizer, gradients=monitor.step != step)
            values += view.slots
        payload = torch.tensor(values, dtype=torch.int64, device=self.device)
        work = dist.all_reduce(payload, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return work, payload, view

    def _read(self, work, payload: torch.Tensor, step: int) -> Verdict:
        work.wait()
        values = payload.tolist()
        last, first = values[_STEP], -values[_NEG_STEP]
        if last != first:
            raise RuntimeError(f"nanscan: the ranks checked different steps in one agreement (steps {first} to {last}, "
                               f"this rank {step}): call Monitor.check exactly once per training step on every rank "
                               "of the group, with the same step= if you pass one")
        bad = values[_FLAG] > 0
        groups = self._replicas.differing(values) if self._replicas is not None else ()
        return Verdict(step, not bad and not groups, -values[_NEG_BAD_RANK] if bad else None, replica_groups=groups,
                       held=values[_HELD] > 0, overflow_skip=bad and not groups and values[_NOT_SKIP] == 0)

    @staticmethod
    def _held(monitor: MonitorSide, verdict: Verdict) -> bool:
        """A step whose batch held a quarantined record on some rank has its update dropped on every rank; a failure
        in a step whose update is dropped on every rank (that, or a rollback at an earlier micro-batch of it, which
        every rank made together) is no new incident (NOTE: [dropped update]). True when it failed in such a step."""
        if verdict.held:
            monitor.drop_update(verdict.step)
        return not verdict.ok and monitor.update_dropped(verdict.step)

    def decide(self, monitor: MonitorSide, report: ScanReport, step: int, batch: Any, sample_ids: Any, started: bool,
               slot: int | None = None) -> ScanReport:
        """Called by Monitor.check after the scan; returns what check returns, or raises for on_invalid="raise".
        `slot`: the step's record in the history ring (an agreed overflow skip is marked there).

        NOTE: [agreed skips]
        Under a GradScaler a step whose gradients overflowed is the scaler's expected skip (NOTE: [overflow skips] in
        nanscan/runtime/amp.py), and every rank skips it: DDP's all-reduce gives every rank the same gradients, and
        FSDP's ShardedGradScaler all-reduces found_inf, so a shard that overflowed on one rank skips the update on
        all. So the step's all-reduce carries one more slot, whether any rank failed otherwise (its batch, loss,
        weights or optimizer state, or with no scaler to skip); where no rank did, every rank records the skip,
        and the streak it counts (the same on every rank, as the skips are agreed) becomes an incident of the group
        only at max_skips in a row or the scale's floor. Before, the first overflow of every fp16 run under a
        process group (the scale calibrating, at its start) was an incident."""
        if self.mode == "sync":
            work, payload, view = self._issue(monitor, report, step)
            verdict = self._read(work, payload, step)
            self.verdict = verdict
            if self._held(monitor, verdict):
                return AgreedScanReport(report, verdict, ok=False)
            if verdict.ok:
                monitor.finite_step(step)
                return report
            if verdict.overflow_skip and monitor.agreed_overflow_skip(report, slot):
                return AgreedScanReport(report, verdict, ok=False, overflow_skip=True)
            verdict = self._failed(monitor, verdict, report, batch, sample_ids, started, view, late=False)
            return self._apply_policy(monitor, verdict, report, report, late=False, batch=batch,
                                      sample_ids=sample_ids)

        pending, self._pending = self._pending, None
        outcome = None
        if pending is not None:
            verdict = self._read(pending.work, pending.payload, pending.step)
            self.verdict = verdict
            dropped = self._held(monitor, verdict)  # failed in a dropped step: no new incident
            if verdict.ok:
                monitor.finite_step(pending.step)
            elif verdict.overflow_skip and monitor.agreed_overflow_skip(pending.report, None):
                pass  # the scaler skipped that update on every rank, as expected (NOTE: [agreed skips])
            elif not dropped:
                verdict = self._failed(monitor, verdict, pending.report, pending.batch, pending.sample_ids,
                                       pending.started, pending.view, late=True)
                # Before the next all-reduce is issued: a raise leaves no collective behind on any rank.
                outcome = self._apply_policy(monitor, verdict, pending.report, report, late=True, batch=pending.batch,
                                             sample_ids=pending.sample_ids)
        if outcome is None and not report.ok and monitor.first_invalid_step is None and self._early is None:
            # This rank knows now, the others learn it at the next check. Its evidence is exact only now, before
            # optimizer.step() changes the weights, and writing it involves no other rank.
            self._early = (step, *self._write_part(monitor, report, step, batch, sample_ids, started, late=False))
        work, payload, view = self._issue(monitor, report, step)
        self._pending = _Pending(work, payload, step, report, batch, sample_ids, started, view)
        if outcome is not None:
            return outcome
        return report if report.ok else AgreedScanReport(report, self.verdict, ok=True)

    def flush(self, monitor: MonitorSide) -> Verdict | None:
        """Async mode: wait for the last checked step's verdict and act on it now (see the module docstring).
        Returns the latest verdict (None before the first check)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self.verdict
        verdict = self._read(pending.work, pending.payload, pending.step)
        self.verdict = verdict
        if not verdict.ok and not self._held(monitor, verdict):
            # Still before this step's optimizer.step(): the evidence is that of the failing check itself.
            verdict = self._failed(monitor, verdict, pending.report, pending.batch, pending.sample_ids,
                                   pending.started, pending.view, late=False)
            self._apply_policy(monitor, verdict, pending.report, pending.report, late=False, batch=pending.batch,
                               sample_ids=pending.sample_ids)
        return self.verdict

    def discard(self) -> None:
        """Forget an unread verdict (the Monitor is closed by an exception). Every rank issued that collective, so
        waiting for it blocks no rank; it is waited for all the same, because a collective still in flight when the
        process group is destroyed or the process exits can abort the process (gloo's worker threads then still
        hold the work: "terminate called without an active exception")."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.work.wait(timeout=DISCARD_WAIT)  # bounded: a rank that died before issuing it never will
            except Exception as exc:  # noqa: BLE001 - the loop's own exception is the one leaving; keep it
                log.warning("nanscan: the last agreement collective failed while the Monitor closed: %s", exc)

    # -- the failure path ------------------------------------------------------------------------------------------
    def _failed(self, monitor: MonitorSide, verdict: Verdict, report: ScanReport, batch: Any, sample_ids: Any, started: bool,
                view: ReplicaView | None, *, late: bool) -> Verdict:
        """On the first failing step: (replicas that differed: gather every rank's fingerprints, NOTE: [replica
        agreement]) write this rank's part, gather every rank's summary and let rank 0 write the index; returns the
        verdict with the rank lists. Later failing steps are only counted."""
        if monitor.first_invalid_step is not None:
            monitor.invalid_steps += 1
            return verdict
        monitor.first_invalid_step = verdict.step
        if verdict.replica_groups and view is not None:  # the failure path's own collective, on every rank
            everyone = all_gather_json(hex_fingerprints(view), self.group, self.device)
            verdict = dataclasses.replace(verdict, replicas=replica_verdict(
                everyone, verdict.replica_groups, gradients=view.gradients, table=self._replicas.table,
                why_not=view.why_not))
        if self._early is not None and self._early[0] == verdict.step:
            _, path, error = self._early
        else:
            # A late part's step-start captures (RNG, snapshot) already belong to the next step: take them now.
            path, error = self._write_part(monitor, report, verdict.step, batch, sample_ids, started and not late,
                                           late=late, verdict=verdict)
        summaries = all_gather_json(self._summary(report, path, error, device_info(monitor.model)), self.group,
                                     self.device)
        if verdict.replica_only and verdict.replicas is not None:
            first = bad = verdict.replicas["odd_ranks"]
            self._first_bad = (REPLICA_MISMATCH, list(verdict.replicas["tensors"]))
        else:
            first, bad = first_bad_ranks(summaries)
        verdict = dataclasses.replace(verdict, first_bad_ranks=tuple(first), bad_ranks=tuple(bad))
        self.verdict = verdict
        if first and not verdict.replica_only:
            row = next(s for s in summaries if s["rank"] == first[0])
            self._first_bad = (row["category"], list(row["category_tensors"]))
        set_dir = bundle_path(monitor.bundle_dir, monitor.run_id, verdict.step,
                              attempt=monitor.attempt_of(verdict.step))  # NOTE: [bundle attempts]
        status = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            try:
                write_index(set_dir, self._index(monitor, verdict, summaries))
                status.fill_(1)
            except Exception as exc:  # noqa: BLE001 - every rank must still reach the broadcast below
                log.error("nanscan: could not write the bundle set index in %s: %s: %s", set_dir,
                          type(exc).__name__, exc)
        dist.broadcast(status, src=dist.get_global_rank(self.group, 0), group=self.group)
        if status.item():
            monitor.bundle_path, monitor.bundle_error = set_dir, error
        else:
            monitor.bundle_path = path
            monitor.bundle_error = error or BundleError(f"rank 0 could not write {set_dir / INDEX} (see its log); "
                                                        f"this rank's part is {path}")
        return verdict

    def _write_part(self, monitor: MonitorSide, report: ScanReport, step: int, batch: Any, sample_ids: Any, started: bool, *,
                    late: bool, verdict: Verdict | None = None) -> tuple[Path | None, BaseException | None]:
        try:
            category, tensors = categorize(report)
            replicas = verdict.replicas if verdict is not None else None
            if verdict is not None and verdict.replica_only and self._involved(verdict):
                # the part of a rank whose replica set differed: the group's incident, its tensors
                category, tensors = REPLICA_MISMATCH, list(replicas["tensors"]) if replicas else []
            incident = monitor.incident(report, step, category or OTHER_RANK, tensors, batch, sample_ids, started)
            if category == REPLICA_MISMATCH:
                incident = dataclasses.replace(incident, reason=REPLICA_MISMATCH)
            model, optimizer = monitor.model, monitor.optimizer
            layout = {}
            if has_dtensors(model):  # placements are static, so the live state describes a snapshot's too
                layout = shard_layout(model.state_dict(), optimizer.state_dict() if optimizer is not None else None)
            incident.model_state = localize_state(incident.model_state)
            incident.optimizer_state = localize_state(incident.optimizer_state)
            incident.history = [e for e in incident.history if e.step <= step]
            if late:
                incident.state_pre_step = False
                incident.state_note = (f"written one step late (agreement='async'): this rank's tensors were finite "
                                       f"at step {step}, so it wrote its part when the ranks' verdict arrived at the "
                                       f"next check; the state includes step {step}'s update")
            rerun = not late and not report.ok  # a rank whose own tensors went bad, at its check
            incident.rerun = monitor.rerun_record() if rerun else None
            incident.rank = self.rank
            incident.distributed = {
                "rank": self.rank, "global_rank": self.global_rank, "world_size": self.world_size,
                "backend": self.backend, "agreement": self.mode, "host": socket.gethostname(),
                "index": f"../{INDEX}", "written": "one_step_late" if late else "at_check",
                "sharded": bool(layout), "shards": layout,
                "device": device_info(model), "replicas_compared": self.replicas, "replicas": replicas,
            }
            path = monitor.write_incident(incident)
        except Exception as exc:  # noqa: BLE001 - a failed write must not keep this rank out of the gather
            log.error("nanscan: rank %d could not write its part of the bundle for step %d: %s: %s", self.rank, step,
                      type(exc).__name__, exc)
            return None, exc
        if rerun:  # before the gather: a rank that raised first could end the job while this one reruns
            monitor.rerun_incident(path, step, batch, started, start=None, read_at=None,
                                   sharded=_sharded(monitor.model, monitor.tensor_source, self.world_size),
                                   report=report)
        monitor.diagnose_incident(path, step)  # every rank: each part says the same of the window
        return path, None

    def _involved(self, verdict: Verdict) -> bool:
        """Whether this rank belongs to a replica set that differed (NOTE: [replica agreement]): under HSDP or
        tensor parallelism the other sets' members agreed, and their parts say another rank stopped them."""
        return verdict.replicas is None or self.rank in verdict.replicas["involved"]

    def _summary(self, report: ScanReport, path: Path | None, error: BaseException | None, device: dict) -> dict:
        """This rank's row in the index, read back from its part as it is on disk, so that the index of parts that
        were kept (the same incident written again) comes out identical."""
        row = {"rank": self.rank, "global_rank": self.global_rank, "host": socket.gethostname(), "dir": None,
               "error": None if error is None else f"{type(error).__name__}: {error}", "device": device}
        manifest = None
        if path is not None:
            try:
                manifest = json.loads((Path(path) / MANIFEST).read_bytes())
                row["dir"] = Path(path).name
            except (OSError, ValueError) as exc:
                row["error"] = f"cannot read back {path}: {exc}"
        if manifest is not None:
            rows = manifest.get("nonfinite_tensors", [])
            row.update(category=manifest["category"], category_tensors=manifest.get("category_tensors", []),
                       detected_at=manifest.get("detected_at"))
        else:
            category, tensors = categorize(report)
            rows = [{"name": s.name, "nan": s.nan, "posinf": s.posinf, "neginf": s.neginf, "numel": s.numel}
                    for s in report.stats if not s.ok]
            row.update(category=category or OTHER_RANK, category_tensors=tensors, detected_at=None)
        row["nonfinite_count"] = len(rows)
        row["nonfinite_tensors"] = [{k: r[k] for k in ("name", "nan", "posinf", "neginf", "numel")}
                                    for r in rows[:NONFINITE_LISTED]]
        return row

    def _index(self, monitor: MonitorSide, verdict: Verdict, summaries: list[dict]) -> dict:
        first = [s for s in summaries if s["rank"] in verdict.first_bad_ranks]
        return {
            "schema": INDEX_SCHEMA, "run_id": monitor.run_id, "first_invalid_step": verdict.step,
            "world_size": self.world_size, "backend": self.backend, "agreement": self.mode,
            "first_bad_ranks": list(verdict.first_bad_ranks), "bad_ranks": list(verdict.bad_ranks),
            "category": first[0]["category"] if first else OTHER_RANK,
            "category_tensors": {str(s["rank"]): s["category_tensors"] for s in first},
            "detected_at": next((s["detected_at"] for s in first if s["detected_at"]), None),
            "ranks": sorted(summaries, key=lambda s: s["rank"]),
            "replicas_compared": self.replicas, "replicas": verdict.replicas, "hosts": hosts_summary(summaries),
        }

    # -- the policy ------------------------------------------------------------------------------------------------
    def _apply_policy(self, monitor: MonitorSide, verdict: Verdict, failing: ScanReport, current: ScanReport, *,
                      late: bool, batch: Any = None, sample_ids: Any = None) -> ScanReport:
        """Apply on_invalid for the failing step `verdict.step` (`failing`: this rank's report of it; `batch`,
        `sample_ids`: this rank's batch of it) and return what check returns for the `current` step."""
        first = monitor.first_invalid_step == verdict.step
        local_category = categorize(failing)[0] or (REPLICA_MISMATCH if verdict.replica_only and self._involved(verdict)
                                                    else OTHER_RANK)
        if first and self._first_bad is not None:
            category, tensors = self._first_bad
        else:  # a later failing step: no summaries were gathered, this rank speaks for itself
            category, tensors = local_category, categorize(failing)[1]
        message = self._message(monitor, verdict, category, tensors, local_category, late)
        policy = monitor.on_invalid
        if isinstance(policy, Rollback):  # every rank, at the same step: the agreement decided it for all
            # each rank's bad rows, gathered: every rank chooses the same skip and knows every quarantined record,
            # and rank 0 writes them into the quarantine (one writer of its file)
            rows = [row for part in all_gather_json(bad_row_ids(batch, sample_ids), self.group, self.device)
                    for row in part]
            monitor.roll_back(verdict.step, category, tensors, message, live_start=not late, ledger=self.rank == 0,
                              batch=batch, sample_ids=sample_ids, rows=rows)
            return AgreedScanReport(current, verdict, ok=False)
        if isinstance(policy, Resume):  # every rank, at the same step; rank 0 writes the checkpoint
            try:
                checkpoint, kept = monitor.resume_checkpoint(verdict.step, group=self.group, device=self.device)
            except CHECKPOINT_ERRORS as exc:
                error = ReplicaMismatchError if verdict.replica_only else DistributedNonFiniteError
                raise error(f"{message}; on_invalid=Resume: no checkpoint to resume from was written: {exc}",
                            rank=self.rank, local_category=local_category, verdict=verdict,
                            bundle_path=monitor.bundle_path, step=verdict.step, category=category,
                            tensors=tensors) from monitor.bundle_error
            exit_for_restart(message, policy, bundle_path=monitor.bundle_path, checkpoint=checkpoint, step=kept)
        if policy == "raise":
            error = ReplicaMismatchError if verdict.replica_only else DistributedNonFiniteError
            raise error(message, rank=self.rank, local_category=local_category, verdict=verdict,
                                            bundle_path=monitor.bundle_path, step=verdict.step, category=category,
                                            tensors=tensors) from monitor.bundle_error
        agreed = AgreedScanReport(current, verdict, ok=False)
        if policy == "skip":
            for p in monitor.model.parameters():
                p.grad = None
        if policy in ("warn", "skip"):
            if first:
                warn_user(message)
        else:
            policy(agreed, monitor.bundle_path)
        return agreed

    def _message(self, monitor: MonitorSide, verdict: Verdict, category: str, tensors: list[str], local_category: str,
                 late: bool) -> str:
        shown = shown_names(tensors)
        if verdict.replica_only:
            replicas = verdict.replicas or {}
            text = (f"nanscan: replicas differ at step {verdict.step} (no value non-finite) in the "
                    f"{', '.join(verdict.replica_groups).replace('_', ' ')}: "
                    + (f"{replicas['ranks_text']}; first differing: {shown}; {replicas['cause']}"
                       if replicas else "a later step, not analysed again")
                    + f"; every rank of the group stops at this step (this is rank {self.rank})")
            if "gradient" in verdict.replica_groups:
                text += ("; a check inside no_sync() must pass micro_batch=True, else its local gradients are "
                         "compared")
            return self._with_evidence(monitor, text)
        if verdict.first_bad_ranks:
            ranks = ", ".join(map(str, verdict.first_bad_ranks))
            who = f"rank{'s' if len(verdict.first_bad_ranks) > 1 else ''} {ranks} first ({category}: {shown})"
        else:
            who = f"rank {verdict.lowest_bad_rank} (and maybe others)"
        text = (f"nanscan: non-finite values at step {verdict.step} on {who}; every rank of the group stops at this "
                f"step (this is rank {self.rank}: {local_category})")
        if late:
            text += (f"; agreement='async': the verdict arrived at the next check, after step {verdict.step}'s "
                     "update (call Monitor.flush() before optimizer.step() to decide each step before its update)")
        if verdict.replica_groups:
            text += f"; the replicas differed too, in the {', '.join(verdict.replica_groups).replace('_', ' ')}"
        if monitor.rerun is not None:
            text += f"; rerun in process on this rank: {monitor.rerun.headline()}"
        if monitor.diagnosis is not None:
            text += f"; diagnosis over the window in process: {monitor.diagnosis.headline()}"
        return self._with_evidence(monitor, text)

    @staticmethod
    def _with_evidence(monitor: MonitorSide, text: str) -> str:
        if monitor.bundle_path is not None:
            return f"{text}; evidence in {monitor.bundle_path} (see `nanscan report {monitor.bundle_path}`)"
        if monitor.bundle_error is not None:
            return f"{text}; the evidence could not be written: {monitor.bundle_error}"
        return text


def hosts_summary(summaries: list[dict]) -> list[dict]:
    """The index's hosts: each host with its ranks and their devices (device_label), in rank order."""
    hosts: dict[str, dict] = {}
    for row in sorted(summaries, key=lambda s: s["rank"]):
        entry = hosts.setdefault(str(row.get("host")), {"host": row.get("host"), "ranks": [], "devices": []})
        entry["ranks"].append(row["rank"])
        entry["devices"].append(device_label(row.get("device")))
    return list(hosts.values())


def first_bad_ranks(summaries: list[dict]) -> tuple[list[int], list[int]]:
    """(first bad ranks, every bad rank): the ranks whose non-finite values appeared earliest in the step (by the
    Monitor's category order), and all ranks that saw any."""
    bad = [s for s in summaries if s["category"] != OTHER_RANK]
    if not bad:
        return [], []
    earliest = min(category_rank(s["category"]) for s in bad)
    return (sorted(s["rank"] for s in bad if category_rank(s["category"]) == earliest),
            sorted(s["rank"] for s in bad))
