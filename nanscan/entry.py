"""Replay entries: how nanscan rebuilds a user's training step from a bundle's config (replay, ablate, preflight).

A replay entry is a function named "package.module:function". It receives the config dict recorded in the bundle
(or given to preflight) and returns a ReplaySpec. The demo registers its own (nanscan.demo:replay_entry).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch


@dataclass
class ReplaySpec:
    """Everything needed to run one training step again.

    model: the model, freshly built from the config (weights are then loaded from the bundle's state).
    optimizer: an optimizer over model's parameters, or a factory `optimizer(model) -> Optimizer`.
    step_fn: `step_fn(model, batch) -> loss` (forward only; nanscan calls backward and the optimizer itself).
    batches: optional healthy batches (e.g. for preflight and for confirming an ablation on held-out data).
    select_samples: optional `select_samples(batch, indices) -> batch` that keeps only the given sample rows;
        when absent, nanscan slices every tensor in the batch along dimension 0.
    extras: the entry's own objects (a tokenizer, a scheduler); nanscan carries them and never reads them.
    The model is built on the device it should run on; replay moves the batch and the bundle's state there.
    """

    model: torch.nn.Module
    optimizer: Any
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: Iterable[Any] | None = None
    select_samples: Callable[[Any, list[int]], Any] | None = None
    extras: dict = field(default_factory=dict)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, built by the factory when one was given."""
        optimizer = self.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise EntryError(f"ReplaySpec.optimizer is {type(optimizer).__name__}: give a torch.optim.Optimizer "
                                 "over the model's parameters, or a factory optimizer(model) -> Optimizer")
            optimizer = optimizer(self.model)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise EntryError(f"the ReplaySpec.optimizer factory returned {type(optimizer).__name__}, expected a "
                                 "torch.optim.Optimizer over the model's parameters")
        return optimizer


class EntryError(ValueError):
    """A replay entry that cannot be found or does not return a ReplaySpec."""


def entry_search_dirs(environment: Mapping | None = None) -> list[tuple[str, str]]:
    """Where a command-line tool may look for an entry module that is not importable as is, in order: the current
    directory (`python -m pkg.train` puts it on sys.path), then the recorded run's working directory and script
    directory (nanscan.provenance.environment records them in the bundle). Each is (what to call it, directory)."""
    found = [("the current directory", os.getcwd())]
    env = environment or {}
    for label, key in (("the run's working directory (recorded in the bundle)", "working_directory"),
                       ("the run's script directory (recorded in the bundle)", "main_path")):
        if isinstance(env.get(key), str) and env[key]:
            found.append((label, env[key]))
    return found


def _module_missing(exc: ImportError, module_name: str) -> bool:
    """Whether the entry's module itself (or a package above it) was not found, rather than an import inside it."""
    name = getattr(exc, "name", None)
    return isinstance(exc, ModuleNotFoundError) and name is not None and \
        (module_name == name or module_name.startswith(name + "."))


def locate_entry(target: str, search: Sequence[tuple[str, str]] = ()) -> str | None:
    """Make the entry's module importable and return where it was found: None when it imports as is, else the
    description of the directory of `search` (see entry_search_dirs) that was put on sys.path for it.

    Raises EntryError, naming every place tried, when the module is in none of them."""
    module_name = _split_target(target)[0]
    try:
        importlib.import_module(module_name)
        return None
    except ImportError as exc:
        if not _module_missing(exc, module_name):
            raise EntryError(f"replay entry {target!r}: importing {module_name!r} failed ({exc}); the module "
                             "was found, an import inside it is what fails") from exc
        first = exc
    tried = []
    for label, directory in search:
        directory = os.path.abspath(directory)
        if directory in tried or not os.path.isdir(directory):
            continue
        tried.append(directory)
        if directory in sys.path:
            continue
        sys.path.insert(0, directory)
        importlib.invalidate_caches()
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            if _module_missing(exc, module_name):
                sys.path.remove(directory)
                continue
            raise EntryError(f"replay entry {target!r}: importing {module_name!r} from {directory} failed "
                             f"({exc}); the module was found, an import inside it is what fails") from exc
        return f"{label} {directory}"
    where = f" (also looked in {', '.join(tried)})" if tried else ""
    raise EntryError(f"replay entry {target!r}: cannot import {module_name!r} ({first}){where}; install the "
                     "package, run from the directory the training ran from, or set PYTHONPATH to it") from first


class EntryWarning(UserWarning):
    """A replay entry given to the Monitor that cannot be resolved now, so replay would fail after an incident."""


def entry_problem(target: str) -> str | None:
    """Why "package.module:function" cannot be resolved in this process, or None when it can: the module is
    imported (never the function called), as replay will. A module that is the running script (`python -m
    pkg.train`) is not imported again, which would run the training a second time (its function may not be defined
    yet either: that case is accepted)."""
    try:
        module_name, attr = _split_target(target)
        module = sys.modules.get(module_name)
        if module is None:
            try:
                spec = importlib.util.find_spec(module_name)
            except (ImportError, ValueError) as exc:
                spec, missing = None, exc
            else:
                missing = None
            if spec is None:
                return (f"replay entry {target!r}: cannot import {module_name!r} ({missing or 'no such module'}); "
                        "check the spelling, and that the package is installed or its directory on PYTHONPATH")
            main_file = getattr(sys.modules.get("__main__"), "__file__", None)
            if main_file and spec.origin and os.path.abspath(spec.origin) == os.path.abspath(main_file):
                # the function may be defined further down the script, after the Monitor is made
                return None
            module = importlib.import_module(module_name)
        function = getattr(module, attr, None)
        if function is None:
            return f"replay entry {target!r}: module {module_name!r} has no attribute {attr!r}; check the spelling"
        if not callable(function):
            return (f"replay entry {target!r} names an object of type {type(function).__name__}, not a function "
                    "taking the config dict and returning a nanscan.entry.ReplaySpec")
    except EntryError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - importing user code may raise anything; the run must go on
        return f"replay entry {target!r}: importing it raised {type(exc).__name__}: {exc}"
    return None


def _split_target(target: str) -> tuple[str, str]:
    module_name, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise EntryError(f"replay entry {target!r} must look like 'package.module:function'")
    return module_name, attr


def load_entry(target: str) -> Callable[[dict], ReplaySpec]:
    """The function named by "package.module:function" (importable as is, or after locate_entry)."""
    module_name, attr = _split_target(target)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryError(f"replay entry {target!r}: cannot import {module_name!r} ({exc}); "
                         "is the package installed, or the directory on PYTHONPATH?") from exc
    try:
        function = getattr(module, attr)
    except AttributeError:
        raise EntryError(f"replay entry {target!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(function):
        raise EntryError(f"replay entry {target!r} names an object of type {type(function).__name__}, not a function "
                         "taking the config dict and returning a nanscan.entry.ReplaySpec")
    return function


def build_spec(target: str, config: dict | None) -> ReplaySpec:
    """Call the entry with the config and check what it returns."""
    spec = load_entry(target)(dict(config or {}))
    if not isinstance(spec, ReplaySpec):
        raise EntryError(f"replay entry {target!r} returned {type(spec).__name__}, expected nanscan.entry.ReplaySpec")
    # Checked here, so that a wrong field is named now and not met as an AttributeError deep inside a replay.
    wrong = []
    if not isinstance(spec.model, torch.nn.Module):
        wrong.append(f"model is {type(spec.model).__name__}, not a torch.nn.Module")
    if not callable(spec.step_fn):
        wrong.append(f"step_fn is {type(spec.step_fn).__name__}, not a function step_fn(model, batch) -> loss")
    if not (isinstance(spec.optimizer, torch.optim.Optimizer) or callable(spec.optimizer)):
        wrong.append(f"optimizer is {type(spec.optimizer).__name__}, not a torch.optim.Optimizer or a factory "
                     "optimizer(model) -> Optimizer")
    if spec.select_samples is not None and not callable(spec.select_samples):
        wrong.append(f"select_samples is {type(spec.select_samples).__name__}, not a function "
                     "select_samples(batch, indices) -> batch")
    if wrong:
        raise EntryError(f"replay entry {target!r} returned a ReplaySpec whose {'; '.join(wrong)}")
    return spec
