"""DTensor shards (FSDP2, HSDP, tensor parallelism) as one rank sees them: the local tensor it scans, the name
suffix saying which shard it is, the ranks that hold the same bytes (NOTE: [replica agreement] in
nanscan/runtime/replicas.py), and the layout that joins a sharded state again in one process."""

from __future__ import annotations

import sys
from typing import Any, Mapping

import torch

from nanscan.bundle.tree import map_tree, tree_items
from nanscan.engine.plans import ModelScanPlan

SHARD_SUFFIX = "@shard"


def dtensor_type() -> type | None:
    """DTensor, if torch.distributed.tensor has been imported: no DTensor can exist before that, and importing it
    just to ask costs about a second."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def shard_suffix(t: torch.Tensor) -> str:
    """`@shard<i>/<n>` for a DTensor sharded along a mesh dimension of size n (i: this rank's coordinate there;
    several sharded mesh dimensions are joined with ','); "" for a replicated DTensor or a plain tensor."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return ""
    mesh, coordinate = t.device_mesh, t.device_mesh.get_coordinate() or []
    parts = [f"{coordinate[d]}/{mesh.size(d)}" for d, p in enumerate(t.placements) if p.is_shard()]
    return SHARD_SUFFIX + ",".join(parts) if parts else ""


def local_tensor(t: Any) -> Any:
    """The local shard of a DTensor (no copy, no communication); anything else as it is."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        with torch.no_grad():
            return t.to_local()
    return t


def has_dtensors(model: torch.nn.Module) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def replica_ranks(t: Any) -> tuple[int, ...] | None:
    """The global ranks that hold a DTensor's local tensor bit for bit (this one included, ascending): those whose
    mesh coordinates equal this rank's along every mesh dimension the tensor is not replicated over (HSDP's shard
    dimension, a tensor-parallel dimension that shards or holds partial sums). None for a plain tensor, a DTensor
    replicated over no mesh dimension, or a rank outside its mesh."""
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(t, dtensor) or not any(p.is_replicate() for p in t.placements):
        return None
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    where = tuple(slice(None) if p.is_replicate() else c for p, c in zip(t.placements, coordinate))
    ranks = tuple(sorted(int(r) for r in t.device_mesh.mesh[where].flatten().tolist()))
    return ranks if len(ranks) > 1 else None


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """What this rank holds of a tensor, and the name suffix saying which shard it is."""
    return local_tensor(t), shard_suffix(t)


def local_scan_plan() -> ModelScanPlan:
    """nanscan.engine.plans.ModelScanPlan for a rank: DTensors (FSDP2) are scanned as their local shards and named with
    the global parameter name plus the shard index (`param:w@shard1/4`, `grad:w@shard1/4`, `optim:w@shard1/4.exp_avg`).
    Plain tensors get exactly the names a plain plan gives them."""
    return ModelScanPlan(local_shard)


def shard_layout(model_state: Mapping | None, optimizer_state: Mapping | None) -> dict[str, dict]:
    """What BundleSet.state() needs to join the parts of a sharded state again (NOTE: [shard chunks]): {path in the
    stored state ("model/<key>", "optimizer/state/<index>/<key>"): layout}.

    NOTE: [shard chunks]
    Each sharded DTensor records, in this rank's part, its global shape, its placements, and the block of the
    global tensor this rank's local tensor is: its offset and local shape, as DTensor computes them
    (compute_local_shape_and_global_offset, the chunk metadata torch.distributed.checkpoint writes for a DTensor).
    That describes any layout the parts hold as blocks: FSDP2 and HSDP (one sharded mesh dimension), FSDP2 + TP
    (two, or a _StridedShard where FSDP shards a dimension TP already split), each rank's block found without
    knowing the mesh. Joining places every part's local tensor at its offset; replicas write the same bytes twice.
    A layout whose local tensor is not one block of the global one has no offset recorded and is refused by name.
    Bundles written before this record "shard_groups" instead (the ranks along one sharded mesh dimension), which
    BundleSet still joins.
    """
    dtensor = dtensor_type()
    layout: dict[str, dict] = {}
    if dtensor is None:
        return layout
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415 - DTensor's

    for root, tree in (("model", model_state), ("optimizer", optimizer_state)):
        for path, t in tree_items(tree, (root,)):
            if not isinstance(t, dtensor) or not any(p.is_shard() for p in t.placements):
                continue
            entry = {"global_shape": list(t.shape), "placements": [str(p) for p in t.placements]}
            if not any(p.is_partial() for p in t.placements):
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                if tuple(shape) == tuple(t.to_local().shape):
                    entry["offset"], entry["local_shape"] = [int(o) for o in offset], [int(n) for n in shape]
            layout[path] = entry
    return layout


def placed_model_state(model: torch.nn.Module, state: dict) -> dict:
    """A kept state for model.load_state_dict(): each local shard (the window keeps a DTensor's as a plain tensor)
    put back in its DTensor, on the live parameter's mesh with its placements, so it loads in place into the
    sharded parameter (a rollback, the in-process diagnosis); a plain model's state as it is."""
    dtensor = dtensor_type()
    if dtensor is None:
        return state
    live = model.state_dict()
    return {key: _as_live(value, live.get(key), dtensor) for key, value in state.items()}


def placed_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """The optimizer's kept state_dict() likewise, changed in place: a tensor shaped as its parameter's local shard
    takes that parameter's mesh and placements (step counters and other scalars stay as they are)."""
    dtensor = dtensor_type()
    if dtensor is None:
        return state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in state.get("state", {}).items():
        param = params[int(index)] if int(index) < len(params) else None
        for key, value in list(values.items()):
            values[key] = _as_live(value, param, dtensor)
    return state


def _as_live(value: Any, live: Any, dtensor: type) -> Any:
    """`value` as a DTensor placed like `live` when `live` is one and `value` is its local shard; else as it is."""
    if not isinstance(live, dtensor) or not torch.is_tensor(value) or isinstance(value, dtensor):
        return value
    local = live.to_local()
    if value.shape != local.shape:
        return value
    return dtensor.from_local(value.to(device=local.device, dtype=local.dtype), live.device_mesh, live.placements,
                              run_check=False, shape=live.shape, stride=live.stride())


def localize_state(tree: Any) -> Any:
    """A state tree with every DTensor replaced by its local shard (safetensors stores plain tensors only)."""
    return map_tree(tree, lambda _path, t: local_tensor(t).detach())


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ over `parameters`' gradients, also where they lie on several device meshes
    (FSDP2 with tensor parallelism: the split weights' 2-D DTensors beside the others' 1-D ones), which torch's
    refuses (it stacks the per-tensor norms and multiplies the gradients in one foreach op, and DTensors of two
    meshes mix in neither): the norm of each mesh's gradients made whole, the total norm taken over those, and
    every gradient scaled by the one coefficient, as a loop under such a layout clips (torchtitan's
    dist_utils.clip_grad_norm_)."""
    params = [p for p in parameters if p.grad is not None]
    meshes: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        meshes.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(meshes) <= 1:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    norms = []
    for group in meshes.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in meshes.values():  # one foreach multiply per mesh: DTensors of two meshes do not mix in one
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
