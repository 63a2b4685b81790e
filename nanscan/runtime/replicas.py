"""Replica agreement (NOTE: [replica agreement]): which ranks must hold each scanned tensor bit for bit, the combined
fingerprints every rank adds to the per-step agreement collective, and what the gathered per-tensor fingerprints say
on the failure path. nanscan.runtime.distributed runs the collectives."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterable

import numpy as np
import torch

from nanscan.engine import _layout as L
from nanscan.engine.inputs import named_parameters
from nanscan.engine.stats import ScanReport
from nanscan.incident import is_kind, shown_names, tensor_name
from nanscan.runtime.shards import SHARD_SUFFIX, dtensor_type, replica_ranks, shard_suffix
from nanscan.runtime.wrappers import DDP, peel

# NOTE: [replica agreement]
# Bytes that every replica must hold identically: under DDP every rank's parameters and optimizer state, and after
# the gradient all-reduce its gradients; under ZeRO-1/2 (DeepSpeed) every rank's low-precision weights; for a
# DTensor (FSDP2, HSDP, tensor parallelism) the local tensor, across the ranks whose mesh coordinates differ only
# along the mesh dimensions its placements replicate (HSDP's replicate dimension, a norm weight replicated over the
# tensor-parallel dimension). A replica that differs is silent corruption (memory, compute, communication), finite
# or not.
#  - Replica sets. Each compared tensor belongs to one set of ranks that must agree: the whole group for a plain
#    tensor of a DDP model (or one the caller declares replicated, replicas=True), replica_ranks() for a DTensor
#    (its own placements: a gradient that is Partial where its parameter is Replicate is not compared). A tensor
#    sharded across the ranks (an `@shard` name of a plain tensor: ZeRO's partitions) or replicated over no mesh
#    dimension is not compared. The ranks agree on the table of sets once, at start-up, in the settings gather.
#  - Combined values. Every scan record carries an exact fingerprint of its tensor's bits (NOTE: [scan
#    fingerprint] in csrc/include/nanscan/stats_record.h). Per set and per group of REPLICA_GROUPS each rank
#    combines, on the host, its records' fingerprints into h = sum of fp_k * (2k + 1) mod 2**64, k the tensor's
#    index within that set and group in scan order (a set's members hold the same names, so the same order). The
#    odd multipliers are invertible mod 2**64: a change of any one tensor's fingerprint changes h, and so does
#    swapping two tensors' contents.
#  - The collective. The per-step all-reduce (MAX) carries h and ~h for every set and group, read as int64: MAX of
#    ~h is ~MIN of h, so one collective gives each one's MAX and MIN across its members, and MAX != MIN is a
#    mismatch. A rank outside a set writes INT64_MIN, the identity of MAX, in both of its slots. No extra
#    collective on a healthy step; six more int64 per set in the payload (one set under DDP).
#  - What is compared when: parameters and optimizer state at every check; the gradients only at a step's own
#    check, after the gradient all-reduce, never at a micro-batch check (under no_sync() each rank's gradients are
#    its own; NOTE: [micro-batch checks] in nanscan/runtime/verdict.py). A parameter without a gradient
#    (find_unused_parameters) has none on every rank, so the groups still line up. FSDP's flat parameters hold
#    different bytes on each rank and are never compared.
#  - The failure path only: the ranks gather their per-tensor fingerprints (names, sets and uint64) to name the odd
#    rank(s) out by per-tensor majority within the tensor's set when it has 3 or more members (with 2 both are
#    named: it cannot tell which), the first differing tensors, and whether the reduced gradients already differed
#    (communication, or the compute around it) or only the parameters and optimizer state (memory, or an earlier
#    update on that rank). A step that is non-finite too keeps its non-finite category; the replica verdict is
#    recorded beside it.

_REPLICA_SLOT = 6  # the first replica slot of the agreement's payload (nanscan.runtime.distributed)
REPLICA_GROUPS = ("parameter", "optimizer_state", "gradient")  # kinds of tensor (nanscan.incident), in slot order
REPLICA_LISTED = 20  # differing tensors listed in the replica verdict (and the incident's category tensors)
_ABSENT = int(np.iinfo(np.int64).min)  # a rank outside a set: the identity of MAX
MICRO_BATCH = "at this micro-batch check (no_sync: each rank's are its own)"
PARTITIONED = "(none is replicated: each rank holds its own partition of them)"


def is_replicated(model: Any) -> bool:
    """Whether `model`, as it was given to the Monitor, is a DistributedDataParallel (possibly inside torch.compile's
    wrapper, or Fabric's): what replicas= compares by default."""
    while (peeled := peel(model)) is not None:
        if peeled[1] == DDP:
            return True
        model = peeled[0]
    return False


def replicated_dtensors(model: torch.nn.Module) -> bool:
    """Whether any parameter is a DTensor replicated over a mesh dimension (HSDP, tensor-parallel norms): what
    replicas= compares by default for a DTensor model."""
    return any(replica_ranks(p) is not None for p in model.parameters())


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """What one rank compares of one check: the compared tensors' names, their sets (indices into the agreed table)
    and fingerprints (a copy: the records may be reused by the next scan), and the payload's replica slots."""

    names: tuple[str, ...]
    sets: tuple[int, ...]
    fingerprints: np.ndarray  # uint64, one per name
    slots: tuple[int, ...]
    gradients: bool  # whether any gradient was compared
    why_not: str | None = None  # why the gradients were not compared (MICRO_BATCH, PARTITIONED)


class ReplicaSets:
    """The replica sets of one agreement (NOTE: [replica agreement]) and the every-step host side: which records
    are compared and in which set, found again only when the scanned names change, and the combined values.

    `ranks`: the group rank of each global rank in the agreement's group (a set reaching outside it is dropped);
    `plain`: whether plain tensors are replicated across the whole group (DDP, replicas=True)."""

    def __init__(self, model: torch.nn.Module, ranks: dict[int, int], *, plain: bool):
        self.plain = plain
        self._ranks = ranks
        self._whole = tuple(sorted(ranks.values()))
        local = {self._in_group(replica_ranks(p)) for p in model.parameters()} - {None}
        if plain and len(self._whole) > 1:
            local.add(self._whole)
        self.local: list[tuple[int, ...]] = sorted(local)
        self._set_table(self.local)
        self._names: tuple[str, ...] | None = None
        self._tensors: Any = None  # the report's identities the selection was made for
        self._listed: dict[bool, tuple[np.ndarray, tuple[str, ...], tuple[int, ...]]] = {}
        self._compared_grads = False
        self._rows, self._weights, self._starts = (np.zeros(0, np.intp), np.zeros(0, np.uint64),
                                                   np.zeros(0, np.intp))
        self._segments: list[tuple[int, bool]] = []  # each segment's first slot, and whether it holds gradients

    def _in_group(self, ranks: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if ranks is None or any(r not in self._ranks for r in ranks):
            return None
        return tuple(sorted(self._ranks[r] for r in ranks))

    def agree(self, everyone: Iterable[Iterable[Iterable[int]]]) -> None:
        """Take the table every rank uses: the union of every rank's local sets (from the settings gather)."""
        self._set_table(sorted({tuple(s) for sets in everyone for s in sets}))
        self._names = self._tensors = None

    def _set_table(self, table: list[tuple[int, ...]]) -> None:
        self.table = table
        self._index = {s: i for i, s in enumerate(table)}
        # A rank outside a set writes the identity of MAX; a member writes 0 for a group it has nothing of, as every
        # member does (its names are theirs).
        self._member_slots = [_ABSENT] * self.width
        for s in {self._index[t] for t in self.local if t in self._index}:
            for g in range(len(REPLICA_GROUPS)):
                at = 2 * (len(REPLICA_GROUPS) * s + g)
                self._member_slots[at], self._member_slots[at + 1] = 0, ~0

    @property
    def width(self) -> int:
        """The payload's replica slots: two per set and group."""
        return 2 * len(REPLICA_GROUPS) * len(self.table)

    def _dtensor_sets(self, model: torch.nn.Module, optimizer: Any) -> dict[str, int | None]:
        """The set of every DTensor the plan scans, by its scanned name (the plan's naming, NOTE: [tensor names]:
        the parameter's name, its shard suffix, the state key)."""
        dtensor = dtensor_type()
        found: dict[str, int | None] = {}
        if dtensor is None:
            return found

        def add(kind: str, name: str, t: Any, key: str = "") -> None:
            if isinstance(t, dtensor):
                found[tensor_name(kind, f"{name}{shard_suffix(t)}{key}")] = self._index.get(
                    self._in_group(replica_ranks(t)))

        named = named_parameters(model)  # NOTE: [state dict names]
        for name, p in named:
            add("parameter", name, p)
            add("gradient", name, p.grad)
        states = getattr(optimizer, "state", None)
        if isinstance(states, dict):
            names = {id(p): name for name, p in named}
            for p, state in states.items():
                if id(p) in names and isinstance(state, dict):
                    for key, value in state.items():
                        add("optimizer_state", names[id(p)], value, f".{key}")
        return found

    def _select(self, names: tuple[str, ...], model: torch.nn.Module, optimizer: Any) -> None:
        dtensors = self._dtensor_sets(model, optimizer)
        whole = self._index.get(self._whole) if self.plain else None
        rows: dict[tuple[int, int], list[int]] = {}
        for i, name in enumerate(names):
            group = next((g for g, kind in enumerate(REPLICA_GROUPS) if is_kind(name, kind)), None)
            if group is None:
                continue
            where = dtensors[name] if name in dtensors else (None if SHARD_SUFFIX in name else whole)
            if where is not None:  # a shard of a plain tensor (ZeRO's partitions) holds its own bytes
                rows.setdefault((where, group), []).append(i)
        self._names = names
        # (set, group, record rows, multipliers 2k + 1) in slot order
        selection = [(s, g, np.asarray(r, dtype=np.intp),
                      np.arange(len(r), dtype=np.uint64) * np.uint64(2) + np.uint64(1))
                     for (s, g), r in sorted(rows.items())]
        # What a view lists, with and without the gradients, in scan order: fixed until the names change.
        self._listed = {}
        for gradients in (False, True):
            where = {i: s for s, g, r, _ in selection
                     if gradients or REPLICA_GROUPS[g] != "gradient" for i in r.tolist()}
            order = np.array(sorted(where), dtype=np.intp)
            self._listed[gradients] = (order, tuple(names[i] for i in order), tuple(where[i] for i in order))
        self._compared_grads = any(REPLICA_GROUPS[g] == "gradient" for _, g, _, _ in selection)
        # The segments of one gather and one reduceat: every (set, group)'s rows and multipliers end to end.
        self._rows = np.concatenate([r for _, _, r, _ in selection] or [np.zeros(0, np.intp)])
        self._weights = np.concatenate([w for _, _, _, w in selection] or [np.zeros(0, np.uint64)])
        self._starts = np.cumsum([0] + [len(r) for _, _, r, _ in selection[:-1]], dtype=np.intp)
        self._segments = [(2 * (len(REPLICA_GROUPS) * s + g), REPLICA_GROUPS[g] == "gradient")
                          for s, g, _, _ in selection]

    def view(self, report: ScanReport, model: torch.nn.Module, optimizer: Any, *, gradients: bool) -> ReplicaView:
        """This check's combined values (the every-step part: one multiply-add per compared tensor in numpy) and what
        the failure path would gather."""
        # The plan hands out the same identity objects while nothing changed: comparing the tuples compares pointers.
        if report.tensors != self._tensors:
            names = tuple(t.name for t in report.tensors)
            if names != self._names:
                self._select(names, model, optimizer)
            self._tensors = report.tensors
        all_fps = L.fingerprints(report.records) if report.fingerprinted else np.zeros(len(self._names), np.uint64)
        slots = list(self._member_slots)
        if self._segments:
            with np.errstate(over="ignore"):  # mod 2**64 is the point
                combined = np.add.reduceat(all_fps[self._rows] * self._weights, self._starts, dtype=np.uint64)
            for (at, of_gradients), h in zip(self._segments, combined.view(np.int64).tolist()):
                if gradients or not of_gradients:
                    slots[at], slots[at + 1] = h, ~h
        order, names, sets = self._listed[gradients]
        grads = gradients and self._compared_grads
        return ReplicaView(names, sets, all_fps[order], tuple(slots), grads,
                           None if grads else (PARTITIONED if gradients else MICRO_BATCH))

    def differing(self, values: list[int]) -> tuple[str, ...]:
        """The groups whose combined fingerprint differed among some set's members, from the reduced payload."""
        groups = set()
        for s in range(len(self.table)):
            for g, group in enumerate(REPLICA_GROUPS):
                at = _REPLICA_SLOT + 2 * (len(REPLICA_GROUPS) * s + g)
                if values[at] != ~values[at + 1]:
                    groups.add(group)
        return tuple(g for g in REPLICA_GROUPS if g in groups)


def hex_fingerprints(view: ReplicaView) -> dict:
    """This rank's part of the failure path's gather."""
    return {"names": list(view.names), "sets": list(view.sets),
            "fingerprints": [f"{int(f):016x}" for f in view.fingerprints]}


def replica_verdict(everyone: list[dict], groups: tuple[str, ...], *, gradients: bool,
                    table: list[tuple[int, ...]] | None = None, why_not: str | None = None) -> dict:
    """What the gathered per-tensor fingerprints say (NOTE: [replica agreement]): `everyone` is each rank's
    {"names", "sets" (indices into `table`), "fingerprints" (16 hex digits each)} in rank order; without `table`
    (or "sets") every rank is one set. `why_not`: why the gradients were not compared. The same on every rank;
    "involved" lists the members of every set that differed."""
    world = len(everyone)
    table = table or [tuple(range(world))]
    held: dict[tuple[int, str], dict[int, str]] = {}
    for rank, e in enumerate(everyone):
        for name, s, fp in zip(e["names"], e.get("sets") or [0] * len(e["names"]), e["fingerprints"]):
            held.setdefault((s, name), {})[rank] = fp
    odd: set[int] = set()
    involved: set[int] = set()
    undecided, pairs, differing = [], [], []
    for (s, name), by_rank in held.items():  # rank 0's order first
        members = table[s]
        values = [by_rank.get(m) for m in members]
        if len(set(values)) < 2:
            continue
        differing.append((name, members, values))
        involved |= set(members)
        top, count = Counter(values).most_common(1)[0]
        if len(members) >= 3 and 2 * count > len(members):
            odd |= {m for m, v in zip(members, values) if v != top}
        else:
            odd |= set(members)
            (pairs if len(members) == 2 else undecided).append((name, members))
    if undecided:
        who = "no_majority"
        ranks_text = (f"no majority among the {len(undecided[0][1])} replicas for "
                      f"{shown_names([n for n, _ in undecided], 3)}, so every rank is named")
    elif pairs:
        who = "cannot_tell"
        ranks_text = (f"ranks {' and '.join(map(str, sorted(odd)))} differ; with 2 replicas nanscan cannot tell which "
                      "one is wrong")
    else:
        who = "majority"
        agree = sorted(involved - odd)
        ranks_text = (f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, sorted(odd)))} "
                      f"{'are' if len(odd) > 1 else 'is'} the odd one out (ranks {', '.join(map(str, agree))} agree)")
    grads = "gradient" in groups
    others = [g.replace("_", " ") for g in groups if g != "gradient"]
    if grads:
        cause = ("the all-reduced gradients already differed: the gradient communication (the all-reduce, or a "
                 "communication hook) or the compute around it on the odd rank(s)"
                 + (f"; the {' and '.join(others)} differed too" if others else ""))
    else:
        cause = (f"only the {' and '.join(others) or 'parameters'} differed, "
                 + ("the all-reduced gradients agreed" if gradients else
                    f"the gradients were not compared {why_not or MICRO_BATCH}")
                 + ": memory corruption, or an earlier optimizer update computed differently on the odd rank(s)")
    return {"groups": list(groups), "odd_ranks": sorted(odd), "involved": sorted(involved), "who": who,
            "ranks_text": ranks_text,
            "gradients_compared": gradients, "gradients_differed": grads, "cause": cause,
            "differing_count": len(differing),
            "tensors": list(dict.fromkeys(n for n, _, _ in differing))[:REPLICA_LISTED],
            "first_differing": [{"name": n, "fingerprints": {str(m): v for m, v in zip(members, values)}}
                                for n, members, values in differing[:REPLICA_LISTED]]}
