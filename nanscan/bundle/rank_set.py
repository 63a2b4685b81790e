"""The on-disk multi-rank bundle set of a distributed incident: a part per rank plus index.json, read as one."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from nanscan._atomic import atomic_write_json
from nanscan.bundle.format import INDEX, STEP_DIR, BundleError, plain_json, read_json, refuse_link
from nanscan.bundle.read import Bundle, open_single
from nanscan.bundle.tree import map_tree, tree_items

log = logging.getLogger("nanscan")


INDEX_SCHEMA = "nanscan.bundle-index/1"


# Optional keys, absent from indexes written before them: "replicas_compared" and "replicas" (the replica verdict of
# nanscan.runtime.distributed NOTE: [replica agreement], None when the replicas agreed), "hosts" (each host with its
# ranks and devices), and each rank's row's "device" ({host, device, index, name, uuid, pci_bus_id}).
INDEX_REQUIRED_KEYS = ("schema", "run_id", "first_invalid_step", "world_size", "first_bad_ranks", "bad_ranks",
                       "category", "ranks")


_RANK_DIR = re.compile(r"^rank-(\d+)$")




def device_label(info: dict | None) -> str:
    """One line for a rank's device as its part records it: "cuda:3 (GPU-1234..., 0000:41:00.0)", "cpu", or
    "unknown" for a part written before devices were recorded."""
    if not info:
        return "unknown"
    extra = ", ".join(str(info[k]) for k in ("uuid", "pci_bus_id") if info.get(k))
    return f"{info.get('device')}{f' ({extra})' if extra else ''}"


def write_index(set_dir: Path, index: dict) -> Path:
    """Write the set's index atomically; an index already there (the same incident written again) is kept."""
    path = Path(set_dir) / INDEX
    if path.exists():
        try:
            existing = json.loads(path.read_bytes())
        except (OSError, ValueError):
            existing = None
        if isinstance(existing, dict) and existing.get("schema") == INDEX_SCHEMA:
            if existing != plain_json(index):
                log.warning("nanscan: %s already holds an index (detected %s); kept it. Use a new run_id to keep "
                            "both.", path, existing.get("detected_at"))
            return path
    Path(set_dir).mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, plain_json(index))


def bundle_set_root(path: Path) -> tuple[Path, int | None] | None:
    """(set directory, rank of the part asked for or None) when `path` is a bundle set, a run directory holding
    only one, or one part of a set; None for an ordinary bundle. Raises BundleError for parts without an index."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / INDEX).is_file():
        return path, None
    match = _RANK_DIR.match(path.name)
    if match and (path.parent / INDEX).is_file():
        return path.parent, int(match.group(1))
    if (path / "manifest.json").exists():
        return None
    parts = sorted(p.name for p in path.iterdir() if p.is_dir() and _RANK_DIR.match(p.name))
    if parts:
        raise BundleError(f"{path} holds per-rank bundles ({', '.join(parts[:4])}) but no {INDEX}: rank 0 did not "
                          "finish writing it (it stopped, or could not write); open one part directly, e.g. "
                          f"{path / parts[0]}")
    steps = [p for p in path.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    if len(steps) == 1 and (steps[0] / INDEX).is_file():
        return steps[0], None
    return None


def _read_index(root: Path) -> dict:
    path = root / INDEX
    refuse_link(path, holder="bundle set")
    index = read_json(path, holder="bundle set")
    if not isinstance(index, dict) or index.get("schema") != INDEX_SCHEMA:
        schema = index.get("schema") if isinstance(index, dict) else None
        raise BundleError(f"{path} has schema {schema!r}, this nanscan reads {INDEX_SCHEMA!r}: it is not a nanscan "
                          "bundle set index, or another nanscan version wrote it")
    missing = [k for k in INDEX_REQUIRED_KEYS if k not in index]
    if missing or not isinstance(index["ranks"], list) or not all(isinstance(e, dict) for e in index["ranks"]):
        raise BundleError(f"{path} lacks {', '.join(missing) or 'a list of ranks'}: the index is incomplete or was "
                          "edited; ask for a fresh copy")
    return index


def load_bundle_set(root: Path, rank: int | None = None) -> "BundleSet":
    """Open a bundle set: the index and every part it lists (each validated like any bundle). The set stands for
    the part of `rank`, by default the first bad rank's."""
    root = Path(root)
    index = _read_index(root)
    parts: dict[int, Bundle] = {}
    for entry in index["ranks"]:
        if not entry.get("dir"):
            continue  # the index records why this rank has no part
        if not _RANK_DIR.match(str(entry["dir"])):
            raise BundleError(f"{root / INDEX} names the part {entry['dir']!r}, which is not a rank-<r> directory; "
                              "the index was edited, do not use this set")
        refuse_link(root / entry["dir"], holder="bundle set")
        part = open_single(root / entry["dir"])
        info = part.manifest.get("distributed") or {}
        expected = (index["run_id"], index["first_invalid_step"], entry["rank"], entry.get("detected_at"))
        found = (part.manifest["run_id"], part.manifest["first_invalid_step"], info.get("rank"),
                 part.manifest.get("detected_at"))
        if found != expected:
            raise BundleError(f"{part.path} does not belong to this set (run, step, rank, detection time "
                              f"{found} where {root / INDEX} says {expected}): a part was replaced; copy the whole "
                              "set again")
        parts[int(entry["rank"])] = part
    if not parts:
        raise BundleError(f"{root} lists no readable part: every rank failed to write (see the errors in "
                          f"{root / INDEX})")
    if rank is None:
        rank = next((r for r in index["first_bad_ranks"] if r in parts), min(parts))
    if rank not in parts:
        raise BundleError(f"{root} has no part for rank {rank}; parts: {sorted(parts)}")
    return BundleSet(root, index, parts, rank)


class BundleSet(Bundle):
    """A distributed incident: behaves as the part of `rank` (by default the first bad rank's), so report,
    replay, notes and findings use it unchanged, and gives access to every rank's part and the index."""

    def __init__(self, root: Path, index: dict, parts: dict[int, Bundle], rank: int):
        super().__init__(parts[rank].path, parts[rank].manifest)
        self.set_path = Path(root)
        self.index = index
        self.parts = dict(sorted(parts.items()))
        self.rank = rank

    def __repr__(self) -> str:
        return (f"BundleSet({str(self.set_path)!r}, step={self.step}, first_bad_ranks={self.first_bad_ranks}, "
                f"parts={sorted(self.parts)}, showing rank {self.rank})")

    @property
    def first_bad_ranks(self) -> list[int]:
        return list(self.index["first_bad_ranks"])

    @property
    def bad_ranks(self) -> list[int]:
        return list(self.index["bad_ranks"])

    @property
    def world_size(self) -> int:
        return int(self.index["world_size"])

    @property
    def replicas(self) -> dict | None:
        """The replica verdict (odd ranks, first differing tensors, whether the gradients differed), or None: the
        replicas agreed, were not compared, or the index predates the comparison."""
        return self.index.get("replicas")

    def device_of(self, rank: int) -> dict | None:
        """A rank's host and device as its row in the index records them (None for an index without them)."""
        row = next((r for r in self.index["ranks"] if r.get("rank") == rank), None)
        return (row or {}).get("device")

    def part(self, rank: int) -> Bundle:
        try:
            return self.parts[rank]
        except KeyError:
            raise KeyError(f"{self.set_path} has no part for rank {rank}; parts: {sorted(self.parts)}") from None

    def set_summary(self) -> dict:
        """The set at a glance, JSON-ready (nanscan report shows it as the ranks table)."""
        return {"set": str(self.set_path), "world_size": self.world_size, "backend": self.index.get("backend"),
                "agreement": self.index.get("agreement"), "first_bad_ranks": self.first_bad_ranks,
                "bad_ranks": self.bad_ranks, "shown_rank": self.rank,
                "replicas": self.replicas,
                "ranks": [{k: row.get(k) for k in ("rank", "host", "device", "dir", "category", "category_tensors",
                                                   "nonfinite_count", "error")} for row in self.index["ranks"]]}

    def state(self) -> tuple[dict[str, torch.Tensor], dict | None]:
        """The model and optimizer state of this rank's part; sharded tensors are joined from every rank's part into
        the full tensors (NOTE: [shard chunks] in nanscan/runtime/shards.py), so the state loads into the unsharded
        model. Raises BundleError when they cannot be."""
        return self._joined(Bundle.state, "the failing step's state")

    def window_state(self, step: int) -> tuple[dict[str, torch.Tensor], dict | None]:
        """The window's kept state at `step`, joined as state() joins the failing step's: a kept state holds each
        rank's shards under the same names and layout."""
        return self._joined(lambda part: Bundle.window_state(part, step), f"the window's state at step {step}")

    def _joined(self, read: Any, what: str) -> tuple[dict[str, torch.Tensor], dict | None]:
        info = self.manifest.get("distributed") or {}
        if not info.get("sharded"):
            return read(self.parts[self.rank])
        layouts = {r: (p.manifest.get("distributed") or {}).get("shards") or {} for r, p in self.parts.items()}
        groups: list[list[int]] = info.get("shard_groups") or []  # a bundle written before NOTE: [shard chunks]
        states = {r: read(p) for r, p in self.parts.items()}
        local = {r: dict(tree_items({"model": s[0], "optimizer": s[1]})) for r, s in states.items()}
        global_to_rank = {int(row["global_rank"]): int(row["rank"]) for row in self.index["ranks"]}
        missing = [g for g in (int(row["global_rank"]) for row in self.index["ranks"])
                   if global_to_rank.get(g) not in local]

        def join(path: str, t: torch.Tensor) -> torch.Tensor:
            where = layouts[self.rank].get(path)
            if where is None:
                return t
            if "offset" in where:
                return self._join_chunks(path, t, layouts, local, missing, what)
            if "group" not in where:
                raise BundleError(f"{self.set_path}: {path} is placed as {where['placements']}, whose local tensor "
                                  "is not one block of the global one, so it cannot be joined in one process; "
                                  "replay it on the job's own mesh")
            return self._join_group(path, where, groups[where["group"]], global_to_rank, local)

        model, optimizer = states[self.rank]
        return (map_tree(model, join, ("model",)),
                map_tree(optimizer, join, ("optimizer",)) if optimizer is not None else None)

    def _join_chunks(self, path: str, t: torch.Tensor, layouts: dict, local: dict, missing: list,
                     what: str) -> torch.Tensor:
        """The full tensor from every part's block (NOTE: [shard chunks]); a block no part holds is named."""
        shape = layouts[self.rank][path]["global_shape"]
        full = torch.empty(shape, dtype=t.dtype)
        covered = torch.zeros(shape, dtype=torch.bool)
        for r, layout in layouts.items():
            where, piece = layout.get(path), local[r].get(path)
            if where is None or "offset" not in where or piece is None:
                continue
            block = tuple(slice(o, o + n) for o, n in zip(where["offset"], where["local_shape"]))
            if list(piece.shape) != where["local_shape"]:
                raise BundleError(f"{self.set_path}: rank {r}'s {path} in {what} has shape {list(piece.shape)}, "
                                  f"not the {where['local_shape']} its manifest records; the part was changed, copy "
                                  "the set again")
            full[block] = piece
            covered[block] = True
        if not bool(covered.all()):
            held = int(covered.sum())
            raise BundleError(f"{self.set_path}: the parts hold {held} of {covered.numel()} elements of {path} "
                              f"({what}); " + (f"the parts of global ranks {missing} are missing: copy the whole "
                                              "set, every rank-<r> directory with it" if missing else
                                              "the set's layout leaves a block no rank wrote"))
        return full

    def _join_group(self, path: str, where: dict, group: list[int], global_to_rank: dict,
                    local: dict) -> torch.Tensor:
        """A bundle written before NOTE: [shard chunks]: the pieces of one mesh dimension, in its ranks' order."""
        pieces = []
        for g in group:
            r = global_to_rank.get(g)
            if r not in local or path not in local[r]:
                raise BundleError(f"{self.set_path}: the part of global rank {g}, which holds a shard of {path}, "
                                  "is missing, so the full tensor cannot be rebuilt in one process; copy the "
                                  "whole set, every rank-<r> directory with it")
            pieces.append(local[r][path])
        full = torch.cat(pieces, dim=where["dim"])
        if list(full.shape) != where["global_shape"]:
            raise BundleError(f"{self.set_path}: the shards of {path} join to shape {list(full.shape)}, not "
                              f"{where['global_shape']}; this layout cannot be rebuilt in one process")
        return full


def require_full_state(bundle: Bundle) -> None:
    """Refuse a lone part of a sharded set: its state is one rank's shards, which no unsharded model can load."""
    info = bundle.manifest.get("distributed") or {}
    if info.get("sharded") and not isinstance(bundle, BundleSet):
        raise BundleError(f"{bundle.path} holds only rank {info.get('rank')}'s FSDP shards of the model, and no "
                          f"{INDEX} beside it to find the other ranks' parts; open the whole set (the step-<N> "
                          "directory with every rank-<r> part) so the shards can be joined for a single-process "
                          "replay")
