"""The wrappers a model comes in (DistributedDataParallel, DataParallel, torch.compile's OptimizedModule, Lightning
Fabric's _FabricModule): one layer peeled at a time, so the Monitor scans and stores the plain model's tensors
under the names replay builds, and finds whether the model is replicated; and the containers an optimizer comes in
(torchtitan's OptimizersContainer), whose torch optimizer holds the state. No framework is imported: a wrapper
class is looked up only among the modules already loaded (a model wrapped by Fabric has loaded it)."""

from __future__ import annotations

import sys

import torch

DDP, DATA_PARALLEL, COMPILED, FABRIC = "ddp", "data_parallel", "compiled", "fabric"
# Lightning ships Fabric under two names, one module object each
_FABRIC_MODULES = ("lightning_fabric.wrappers", "lightning.fabric.wrappers")


def peel(model: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """(the module inside the outermost wrapper of `model`, the wrapper's kind), or None for a module that is no
    wrapper. A Fabric module's inside is the module its forward calls (itself possibly DDP or compiled), whose
    parameters are the original module's."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module, DDP
    if isinstance(model, torch.nn.DataParallel):
        return model.module, DATA_PARALLEL
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)  # set by compile
    if compiled is not None and isinstance(model, compiled):
        return model._orig_mod, COMPILED
    for name in _FABRIC_MODULES:
        fabric = getattr(sys.modules.get(name), "_FabricModule", None)
        if fabric is not None and isinstance(model, fabric):
            return model._forward_module, FABRIC
    return None


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a container of optimizers, else `optimizer` itself.

    A container (torchtitan's OptimizersContainer) is a torch.optim.Optimizer whose own state stays empty and whose
    `optimizers` hold the state and the learning rates its step() and the lr schedulers update, one per model part
    and optimizer type: scanned as it is, a check would see no optimizer state and no learning rate, without a word.
    One inner optimizer is taken as the run's (its step runs inside the container's, so its hooks fire); several
    are refused, naming the fix, as the Monitor keeps one optimizer."""
    parts = getattr(optimizer, "optimizers", None)
    if not isinstance(parts, (list, tuple)) or not parts or \
            not all(isinstance(part, torch.optim.Optimizer) for part in parts) or optimizer.state:
        return optimizer
    if len(parts) == 1:
        return parts[0]
    kinds = ", ".join(type(part).__name__ for part in parts)
    raise TypeError(f"optimizer is a {type(optimizer).__name__} of {len(parts)} optimizers ({kinds}: one per model "
                    "part and optimizer type), whose own state is empty; a Monitor checks one optimizer: pass "
                    f"optimizer={type(optimizer).__name__.lower()}.optimizers[i] with the model part it updates (one "
                    "Monitor per part), or optimizer=None to check the model alone")
