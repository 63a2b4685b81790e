"""A bundle (or bundle set) as a checkpoint a trainer resumes from: its model and optimizer state, at the failing step
or at a state its window kept, written as a torch.distributed.checkpoint (DCP) directory, with the data position and
the RNG states beside it (NOTE: [bundle checkpoint]). `nanscan checkpoint BUNDLE OUT` runs it.

NOTE: [bundle checkpoint]
DCP reshards on load: a checkpoint written by one process loads on any number of ranks under any layout (FSDP2,
HSDP, TP), each rank reading its own blocks, and torch's dcp_to_torch_save turns it into one file. So the state is
the set's joined state (NOTE: [shard chunks] in nanscan/runtime/shards.py: every layout whose parts are blocks of
the global tensors), written by one process, which must hold it. Its keys are the ones
torch.distributed.checkpoint.state_dict's get_state_dict gives and set_state_dict takes, which torchtitan's
checkpointer keeps under the same two names: "model", {name: tensor} as the model's state_dict() names them, and
"optimizer", {"state": {name: {key: value}}, "param_groups": [{setting: value, "params": [name, ...]}]}, each
parameter named by the bundle's record of its optimizer's param groups (the state's "optimizer_params"; a bundle
without it gets the model only, and says so). "rng" holds the torch generators' states of the state's step start
where the bundle has them. Beside the DCP files, RESUME_FILE says what the state is: the run, the step it begins
(the first step to train from it), whether it is the exact pre-step state, each param group's learning rate there,
the sample ids of the steps the bundle recorded from it on, and the bundle it came from. The directory is written
under a temporary name and renamed into place, so a crash leaves no half checkpoint that looks whole; an existing
OUT is replaced only when asked. Writing it twice gives the same tensors and JSON (DCP's .metadata carries an id of
its own save).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanscan._atomic import atomic_directory
from nanscan.bundle.format import BundleError
from nanscan.bundle.read import Bundle

RESUME_FILE = "nanscan_resume.json"


@dataclass
class Checkpoint:
    """What was written: where, from which state, and what it holds."""

    path: Path
    bundle: str
    step: int
    pre_step: bool
    keys: list[str]  # the DCP state's top-level keys
    notes: list[str]

    def to_dict(self) -> dict:
        return {"path": str(self.path), "bundle": self.bundle, "step": self.step, "pre_step": self.pre_step,
                "keys": list(self.keys), "notes": list(self.notes)}


def optimizer_by_name(optimizer_state: dict, names: list[list[str]]) -> dict:
    """A torch optimizer's state_dict() ({"state": {index: ...}, "param_groups": [{"params": [index, ...]}]}) keyed
    by parameter names instead, as get_optimizer_state_dict gives it: `names` are each param group's parameter
    names in the order of its "params"."""
    groups = optimizer_state.get("param_groups") or []
    if len(groups) != len(names) or any(len(g["params"]) != len(n) for g, n in zip(groups, names)):
        raise BundleError(f"the bundle's optimizer has param groups of {[len(g['params']) for g in groups]} "
                          f"parameters, but its record of their names gives {[len(n) for n in names]}; the bundle "
                          "was changed, ask for a fresh copy")
    name_of = {index: name for group, group_names in zip(groups, names)
               for index, name in zip(group["params"], group_names)}
    state = {name_of[int(index)]: value for index, value in (optimizer_state.get("state") or {}).items()}
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(group_names)}
                    for group, group_names in zip(groups, names)]
    return {"state": state, "param_groups": param_groups}


def _chosen(bundle: Bundle, step: int | None) -> tuple[int, dict, dict | None, bool, dict | None, list]:
    """(step, model state, optimizer state, pre-step, torch RNG at the step's start, window records from it)."""
    window = bundle.window
    if step is None or step == bundle.step:
        model_state, optimizer_state = bundle.state()
        info = bundle.manifest.get("state") or {}
        records = [r for r in bundle.window_records() if r.step == bundle.step] if window else []
        return bundle.step, model_state, optimizer_state, bool(info.get("pre_step")), bundle.rng_state(), records
    if not window or not any(s["step"] == step for s in window.get("states") or ()):
        kept = [s["step"] for s in (window or {}).get("states") or ()]
        raise BundleError(f"{bundle.path} keeps no state at step {step}: its window keeps {kept or 'none'} and "
                          f"the bundle the failing step {bundle.step}'s; pass one of them")
    model_state, optimizer_state = bundle.window_state(step)
    records = [r for r in bundle.window_records() if r.step >= step]
    rng = next((r.rng for r in records if r.step == step and r.rng), None)
    pre_step = next(s for s in window["states"] if s["step"] == step).get("pre_step", True)
    return step, model_state, optimizer_state, bool(pre_step), rng, records


def write_checkpoint(bundle: Bundle, out: Path, *, step: int | None = None, overwrite: bool = False) -> Checkpoint:
    """Write `bundle`'s state at `step` (None: the failing step's; else a state its window kept) as a DCP
    checkpoint directory `out` (NOTE: [bundle checkpoint]). Raises BundleError for a state it cannot write."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - the writer is DCP's own

    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"{out} already exists and is not empty; choose another OUT or pass --overwrite to replace "
                          "it")
    state_step, model_state, optimizer_state, pre_step, rng, records = _chosen(bundle, step)
    frozen = bundle.frozen_references()
    if frozen:
        raise BundleError(f"{bundle.path}'s state holds its frozen parameters by reference to the run's files "
                          f"({', '.join(sorted(frozen)[:3])} ...), which a checkpoint cannot "
                          "point at; load the model from the run's own weights and this bundle's trained state")
    notes: list[str] = []
    state: dict[str, Any] = {"model": dict(model_state)}
    names = (bundle.manifest.get("state") or {}).get("optimizer_params")
    if optimizer_state is not None and not optimizer_state.get("state"):
        notes.append("the optimizer had no state yet at this step (before its first update): a fresh optimizer with "
                     "the run's settings is that state, so the checkpoint holds the model alone")
    elif optimizer_state is not None and names:
        state["optimizer"] = optimizer_by_name(optimizer_state, names)
    elif optimizer_state is not None:
        notes.append("the optimizer state is left out: the bundle does not record its parameters' names (written "
                     "before they were), so it cannot be keyed by name")
    else:
        notes.append("the bundle holds no optimizer state at this step")
    torch_rng = (rng or {}).get("torch_cpu")
    if isinstance(torch_rng, torch.Tensor):
        state["rng"] = {"torch_cpu": torch_rng}
    else:
        notes.append("no torch generator state of this step's start is in the bundle")
    resume = {"run_id": bundle.manifest.get("run_id"), "step": state_step, "pre_step": pre_step,
              "bundle": str(getattr(bundle, "set_path", bundle.path)), "keys": sorted(state),
              "lrs": list(records[0].lrs) if records else None,
              "sample_ids": {str(r.step): r.sample_ids for r in records if r.micro_batch is None},
              "notes": notes}

    with atomic_directory(out, replace=overwrite) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, as meant
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
        (tmp / RESUME_FILE).write_text(json.dumps(resume, indent=2, sort_keys=True, default=str) + "\n")
    return Checkpoint(out, resume["bundle"], state_step, pre_step, sorted(state), notes)
