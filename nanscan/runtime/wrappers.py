"""The wrappers a model comes in (DistributedDataParallel, DataParallel, torch.compile's OptimizedModule, Lightning
Fabric's _FabricModule): one layer peeled at a time, so the Monitor scans and stores the plain model's tensors
under the names replay builds, and finds whether the model is replicated. No framework is imported: a wrapper
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
