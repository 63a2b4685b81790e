"""Replay entries and the trust rule: how nanscan rebuilds a user's training step from a bundle's config (replay,
ablate, export-regression, preflight), and what a bundle may make it import and call.

A replay entry is a function named "package.module:function". It receives the config dict recorded in the bundle
(or given to preflight) and returns a ReplaySpec. The demo's is nanscan.demo:replay_entry.

NOTE: [trust rule]
nanscan calls only what its user chose. An entry given on the command line (--entry) or by the user's own code
(Monitor(replay_entry=...) in the training process, nanscan.testing's ENTRY in an exported test) is the user's
choice. A name read from a bundle (its replay_entry, the classes of a zero-config recipe) is data someone else may
have written: nanscan imports its module from this machine's sys.path and the current directory only, and calls it
only when it is a function its author marked with @replay_entry, or, for a zero-config rebuild, a class of the
expected kind (checked before anything is called; its arguments are the bundle's JSON data, never code). The
directories a bundle records (the run's working and script directories) are searched only with
--trust-bundle-paths. Everything else is refused with an UntrustedError that names the field and the way on
(--entry). load_entry and load_bundle_class are the only places that enforce it.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

# Who enters the run's autocast region around step_fn (ReplaySpec.autocast): nanscan, or the entry's own step_fn.
AUTOCAST_OWNERS = ("replay", "entry")


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
    clip_grad_norm: the loop's own gradient clipping (the max norm it gives clip_grad_norm_ between backward and the
        update), which replay then applies as the loop did; None: the loop does not clip.
    autocast: who enters the run's autocast region around step_fn (NOTE: [replayed precision] in
        nanscan/runtime/rerun_inputs.py): "replay" (the default), nanscan re-applies the region the Monitor recorded, as the
        loop's `with torch.autocast(...)` did; "entry", step_fn enters its own and nanscan leaves it alone.
    The model is built on the device it should run on; replay moves the batch and the bundle's state there.
    """

    model: torch.nn.Module
    optimizer: Any
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: Iterable[Any] | None = None
    select_samples: Callable[[Any, list[int]], Any] | None = None
    extras: dict = field(default_factory=dict)
    clip_grad_norm: float | None = None
    autocast: str = "replay"

    def __post_init__(self):
        if self.autocast not in AUTOCAST_OWNERS:
            raise EntryError(f"ReplaySpec(autocast={self.autocast!r}): give 'replay' (nanscan re-applies the run's "
                             "recorded autocast around step_fn) or 'entry' (step_fn enters its own)")

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


class UntrustedError(EntryError):
    """A name a bundle gives that nanscan will not call (NOTE: [trust rule]); the message says how to proceed."""


ENTRY_MARK = "__nanscan_replay_entry__"


def replay_entry(function: Callable[[dict], "ReplaySpec"]) -> Callable[[dict], "ReplaySpec"]:
    """Mark a function as a replay entry, so that replay, ablate and export-regression call it when a bundle names
    it (NOTE: [trust rule]); without the mark they ask for `--entry package.module:function`."""
    if not inspect.isfunction(function):
        raise TypeError(f"@replay_entry marks a function taking the config dict and returning a ReplaySpec, not "
                        f"{type(function).__name__}")
    function.__dict__[ENTRY_MARK] = True  # in the function's own dict: no attribute lookup can fake it
    return function


def is_marked_entry(obj: Any) -> bool:
    return inspect.isfunction(obj) and obj.__dict__.get(ENTRY_MARK) is True


@dataclass(frozen=True)
class ImportSearch:
    """Where a module a bundle names may be imported from when it is not importable as is: `dirs`, in order, each
    (what to call it, directory); `withheld`, the bundle's recorded directories left out (no --trust-bundle-paths),
    named in the error when the module is found only there."""

    dirs: tuple[tuple[str, str], ...] = ()
    withheld: tuple[tuple[str, str], ...] = ()


_RECORDED_DIRS = (("the run's working directory (recorded in the bundle)", "working_directory"),
                  ("the run's script directory (recorded in the bundle)", "main_path"))


def entry_search_dirs(environment: Mapping | None = None, *, trust_bundle_paths: bool = False) -> ImportSearch:
    """Where a command-line tool may look for a module that is not importable as is: the current directory
    (`python -m pkg.train` puts it on sys.path), then, with trust_bundle_paths, the recorded run's working and
    script directories (nanscan.bundle.provenance.environment records them in the bundle; NOTE: [trust rule])."""
    env = environment or {}
    recorded = tuple((label, env[key]) for label, key in _RECORDED_DIRS if isinstance(env.get(key), str) and env[key])
    here = (("the current directory", os.getcwd()),)
    return ImportSearch(here + recorded, ()) if trust_bundle_paths else ImportSearch(here, recorded)


def _module_missing(exc: ImportError, module_name: str) -> bool:
    """Whether the entry's module itself (or a package above it) was not found, rather than an import inside it."""
    name = getattr(exc, "name", None)
    return isinstance(exc, ModuleNotFoundError) and name is not None and \
        (module_name == name or module_name.startswith(name + "."))


def _found_in(directory: str, module_name: str) -> bool:
    """Whether the module's top-level package lies in `directory`: a look at the file system, nothing imported."""
    try:
        return importlib.machinery.PathFinder.find_spec(module_name.partition(".")[0], [directory]) is not None
    except (ImportError, ValueError, OSError):
        return False


def locate_module(module_name: str, search: ImportSearch | Sequence[tuple[str, str]] = (), *,
                  what: str) -> str | None:
    """Make `module_name` importable and return where it was found: None when it imports as is, else the
    description of the directory of `search` that was put on sys.path for it. `what` names the module's role in
    messages ("replay entry 'pkg.train:entry'").

    Raises EntryError, naming every place tried (and a withheld recorded directory that holds it), when the module
    is in none of them."""
    if not isinstance(search, ImportSearch):
        search = ImportSearch(tuple(search))
    try:
        importlib.import_module(module_name)
        return None
    except ImportError as exc:
        if not _module_missing(exc, module_name):
            raise EntryError(f"{what}: importing {module_name!r} failed ({exc}); the module was found, an import "
                             "inside it is what fails") from exc
        first = exc
    tried = []
    for label, directory in search.dirs:
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
            raise EntryError(f"{what}: importing {module_name!r} from {directory} failed ({exc}); the module was "
                             "found, an import inside it is what fails") from exc
        return f"{label} {directory}"
    where = f" (also looked in {', '.join(tried)})" if tried else ""
    for label, directory in search.withheld:
        if os.path.isdir(directory) and _found_in(directory, module_name):
            raise UntrustedError(
                f"{what}: {module_name!r} is not importable here{where}, but {label}, {directory}, holds it; "
                "nanscan imports from a directory a bundle names only when you say so (NOTE: [trust rule]): pass "
                "--trust-bundle-paths if you trust this bundle and that directory, or set PYTHONPATH") from first
    raise EntryError(f"{what}: cannot import {module_name!r} ({first}){where}; install the package, run from the "
                     "directory the training ran from, or set PYTHONPATH to it") from first


def locate_entry(target: str, search: ImportSearch | Sequence[tuple[str, str]] = ()) -> str | None:
    """locate_module for a replay entry's module (see there)."""
    return locate_module(_split_target(target)[0], search, what=f"replay entry {target!r}")


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
                        "check the spelling, and that the package is installed or its directory on PYTHONPATH; "
                        "bundles will record it, but replay cannot use it")
            main_file = getattr(sys.modules.get("__main__"), "__file__", None)
            if main_file and spec.origin and os.path.abspath(spec.origin) == os.path.abspath(main_file):
                # the function may be defined further down the script, after the Monitor is made
                return None
            module = importlib.import_module(module_name)
        function = getattr(module, attr, None)
        if function is None:
            return (f"replay entry {target!r}: module {module_name!r} has no attribute {attr!r}; check the spelling; "
                    "bundles will record it, but replay cannot use it")
        if not callable(function):
            return (f"replay entry {target!r} names an object of type {type(function).__name__}, not a function "
                    "taking the config dict and returning a nanscan.entry.ReplaySpec; bundles will record it, but "
                    "replay cannot use it")
        if not is_marked_entry(function):
            return (f"replay entry {target!r} is not marked with @nanscan.entry.replay_entry, so replay will not "
                    "call it on a bundle's word (NOTE: [trust rule] in nanscan/entry.py): mark it, or pass "
                    f"--entry {target} to replay, ablate and export-regression")
    except EntryError as exc:
        return f"{exc}; bundles will record it, but replay cannot use it"
    except Exception as exc:  # noqa: BLE001 - importing user code may raise anything; the run must go on
        return (f"replay entry {target!r}: importing it raised {type(exc).__name__}: {exc}; bundles will record "
                "it, but replay cannot use it")
    return None


def _split_target(target: str) -> tuple[str, str]:
    module_name, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise EntryError(f"replay entry {target!r} must look like 'package.module:function'")
    return module_name, attr


def _resolve(module_name: str, qualname: str, what: str) -> Any:
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryError(f"{what}: cannot import {module_name!r} ({exc}); is the package installed, or the "
                         "directory on PYTHONPATH?") from exc
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EntryError(f"{what}: module {module_name!r} has no attribute {qualname!r}") from None
    return target


def load_entry(target: str, *, from_bundle: bool = False) -> Callable[[dict], ReplaySpec]:
    """The function named by "package.module:function" (importable as is, or after locate_entry). `from_bundle`:
    the name was read from a bundle or a regression case rather than given by the user, so the function must be
    marked with @replay_entry (NOTE: [trust rule])."""
    module_name, attr = _split_target(target)
    function = _resolve(module_name, attr, f"replay entry {target!r}")
    if from_bundle and not is_marked_entry(function):
        raise UntrustedError(
            f"the bundle's replay_entry {target!r} is not marked as a replay entry (@nanscan.entry.replay_entry), so "
            "nanscan does not call it on the bundle's word (NOTE: [trust rule]); if it is your entry, mark it, or "
            f"pass it yourself: --entry {target}")
    if not callable(function):
        raise EntryError(f"replay entry {target!r} names an object of type {type(function).__name__}, not a function "
                         "taking the config dict and returning a nanscan.entry.ReplaySpec")
    return function


# The search a tool that opened a bundle allows for the classes its recipe names (Replayer.build sets it).
_BUNDLE_SEARCH: contextvars.ContextVar[ImportSearch] = contextvars.ContextVar("nanscan_bundle_search",
                                                                               default=ImportSearch())


@contextlib.contextmanager
def bundle_imports(search: ImportSearch) -> Iterator[None]:
    """Within the block, load_bundle_class looks for modules in `search` (the tool's entry_search_dirs)."""
    token = _BUNDLE_SEARCH.set(search)
    try:
        yield
    finally:
        _BUNDLE_SEARCH.reset(token)


def load_bundle_class(path: Any, *, field: str, kind: str, accept: Callable[[type], bool]) -> type:
    """The class a bundle names at `field` ("pkg.mod:Qual.Name"), imported with the search bundle_imports allows,
    and returned only when `accept(cls)` holds: it is of the expected `kind` (NOTE: [trust rule]). Nothing named is
    called here; the caller then calls the class with the bundle's data."""
    module_name, sep, qualname = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module_name or not qualname:
        raise UntrustedError(f"the bundle's {field} is {path!r}, not a class path 'package.module:Class'; the "
                             "bundle was edited or damaged: pass --entry package.module:function")
    what = f"the bundle's {field} {path!r}"
    locate_module(module_name, _BUNDLE_SEARCH.get(), what=what)
    cls = _resolve(module_name, qualname, what)
    if not (isinstance(cls, type) and accept(cls)):
        shown = cls.__name__ if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise UntrustedError(f"{what} names {shown}, which is not a {kind}; nanscan calls only classes of that kind "
                             "from a bundle (NOTE: [trust rule]): pass --entry package.module:function to rebuild "
                             "the step with code you chose")
    return cls


def build_spec(target: str, config: dict | None, *, from_bundle: bool = False) -> ReplaySpec:
    """Call the entry with the config and check what it returns (from_bundle: see load_entry)."""
    spec = load_entry(target, from_bundle=from_bundle)(dict(config or {}))
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
