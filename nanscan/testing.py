"""Helpers for a user's test suite: `assert_step_finite` runs one training step and fails, naming the first bad
module, when anything in it goes non-finite; `load_regression_case` reads a case written by
`nanscan export-regression`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from nanscan.bundle import BundleError
from nanscan.bundle.tree import decode_tree, load_tensors
from nanscan.entry import build_spec
from nanscan.bundle.provenance import restore_rng, rng_from_tensors
from nanscan.replay.export import CASE_JSON, REGRESSION_SCHEMA
from nanscan.replay.step import StepOptions, StepOutcome, map_tensors, model_device, run_localized, run_step


def assert_step_finite(model: torch.nn.Module, step_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                       batch: Any, *, optimizer: torch.optim.Optimizer | None = None,
                       state: Mapping[str, torch.Tensor] | None = None, optimizer_state: Mapping | None = None,
                       options: StepOptions = StepOptions(), localize: bool = True) -> StepOutcome:
    """Run one training step and assert that the batch, loss, gradients and (with an optimizer) the updated
    weights and optimizer state are all finite.

    step_fn(model, batch) returns the loss; this function calls backward and optimizer.step() itself. `state` and
    `optimizer_state` are loaded first when given. The batch is moved to the model's device. On failure the
    AssertionError names the category, the non-finite tensors and (with `localize`) the first module that
    produced them. Returns the StepOutcome when the step is finite.
    """
    if state is not None:
        model.load_state_dict(state)
    if optimizer_state is not None:
        if optimizer is None:
            raise ValueError("optimizer_state was given without an optimizer to load it into")
        optimizer.load_state_dict(optimizer_state)
    device = model_device(model)
    batch = map_tensors(batch, lambda t: t.to(device))
    def attempt(backward_module_hooks: bool) -> StepOutcome:
        # a step that raised did not reach optimizer.step(), so the second attempt starts from the same weights
        return run_step(model, optimizer, step_fn, batch, options=options, localize=localize,
                        backward_module_hooks=backward_module_hooks)

    outcome = run_localized(attempt) if localize else attempt(True)
    if outcome.error is not None:
        raise AssertionError(f"the training step failed before it could be checked: {outcome.error}")
    if not outcome.finite:
        shown = ", ".join(outcome.nonfinite[:8]) + (f" and {len(outcome.nonfinite) - 8} more"
                                                    if len(outcome.nonfinite) > 8 else "")
        lines = [f"the training step went non-finite ({outcome.category}): {shown}"]
        if outcome.localization is not None:
            lines.append(f"first bad: {outcome.localization.describe()}")
        lines += [f"note: {n}" for n in outcome.notes]
        raise AssertionError("\n".join(lines))
    return outcome


class RegressionCaseError(ValueError):
    """A regression case directory that is missing, incomplete or from another nanscan version."""


@dataclass
class RegressionCase:
    """A case written by `nanscan export-regression`: the failing samples, the state and RNG states they failed
    from, and the replay entry and config that rebuild the model."""

    path: Path
    meta: dict
    batch: Any
    model_state: dict | None
    optimizer_state: dict | None
    rng: dict | None

    @property
    def replay_entry(self) -> str:
        return self.meta["replay_entry"]

    @property
    def config(self) -> dict | None:
        return self.meta.get("config")

    @property
    def expected(self) -> dict:
        return self.meta["expected"]

    @property
    def observed(self) -> dict:
        return self.meta["observed"]

    def build_spec(self, entry: str | None = None):
        """The ReplaySpec from the config and `entry`, the entry the test's code names, else the recorded one, which
        must be marked with @nanscan.entry.replay_entry (NOTE: [trust rule] in nanscan/entry.py): the case file is
        data, the test's source is code its reader chose."""
        return build_spec(entry or self.replay_entry, self.config, from_bundle=entry is None)

    def restore_rng(self) -> None:
        """Put the RNGs into the state the failing step started from (same dropout masks), when recorded."""
        if self.rng is None:
            return

        try:
            restore_rng(self.rng)
        except RuntimeError:  # recorded on a GPU, run without one: the CPU generators still matter
            restore_rng({**self.rng, "torch_cuda": []})


def load_regression_case(path: str | os.PathLike) -> RegressionCase:
    """Read a regression case directory (safetensors and JSON only; nothing is unpickled)."""

    root = Path(path)
    meta_path = root / CASE_JSON
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise RegressionCaseError(f"{root} has no {CASE_JSON}: not a regression case written by "
                                  "`nanscan export-regression`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RegressionCaseError(f"{meta_path} cannot be read as JSON ({exc}); export the case again") from None
    if meta.get("schema") != REGRESSION_SCHEMA:
        raise RegressionCaseError(f"{meta_path} has schema {meta.get('schema')!r}, this nanscan reads "
                                  f"{REGRESSION_SCHEMA!r}; export the case again with this version")
    try:
        tensors, _ = load_tensors(root / meta["batch"]["file"])
        batch = decode_tree(meta["batch"]["structure"], tensors)
        model_state = optimizer_state = rng = None
        if meta.get("state"):
            tensors, _ = load_tensors(root / meta["state"]["file"])
            structure = meta["state"]["structure"]
            model_state = decode_tree(structure["model"], tensors)
            if structure.get("optimizer") is not None:
                optimizer_state = decode_tree(structure["optimizer"], tensors)
        if meta.get("rng"):
            tensors, metadata = load_tensors(root / meta["rng"]["file"])
            rng = rng_from_tensors(tensors, json.loads(metadata["nanscan.rng"]))
    except (BundleError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise RegressionCaseError(f"{root} is incomplete or damaged ({exc}); export the case again") from None
    return RegressionCase(root, meta, batch, model_state, optimizer_state, rng)
