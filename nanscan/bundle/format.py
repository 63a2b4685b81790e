"""The bundle format: file names, the schema, the records a bundle is written from (Incident, HistoryEntry),
paths and JSON helpers.

A bundle is one directory per incident, `<bundle_dir>/<run_id>/step-<N>/`, holding everything needed to understand
and replay the first non-finite step (nanscan.bundle.write writes it, nanscan.bundle.read validates and reads it).

Layout (schema "nanscan.bundle/1"):
  manifest.json        what happened, where the code and config came from, and the sha256 of every other file;
                       "spikes": the run's loss and gradient-norm spikes so far (a spike bundle is the last's)
  batch.safetensors    the failing step's batch (every tensor, integer ones too); its nesting is in the manifest
  rng.safetensors      RNG states (torch CPU/CUDA, numpy, Python random) at the failing step's start, or at its
                       check where the manifest's rng.captured_at_by_source says so
  history.safetensors  stats records of the last steps; history.json names their tensors, loss, lr, grad norm
                       (sparse histograms: NOTE: [sparse history records] in nanscan.bundle.history)
  state.safetensors    model and optimizer state; state.json holds the optimizer's non-tensor structure; frozen
                       parameters by reference only, their dtype, shape and sha256 under the manifest's
                       state.frozen (NOTE: [frozen references] in nanscan.bundle.frozen)
  source.diff          uncommitted changes (`git diff HEAD`), when the work tree was dirty and the diff is small
  logs/                the last lines of each log file
  window/              the run's window (nanscan.runtime.window NOTE: [run window]), when the Monitor kept one:
                       state-<S>.safetensors and state-<S>.json, the state kept at step S's start, as state.*;
                       steps.safetensors and steps.json, every step's batches, RNG states, learning rates, loss
                       scale and precision since the oldest kept state
  ledger.jsonl         one JSON record per automatic finding and reviewer note
  INCIDENT.md          the incident note: "Automatic findings" and "Reviewer notes", rendered from the ledger

Tensors are safetensors and everything else JSON, so reading a bundle never runs code.
INCIDENT.md is the one file reviewers may edit (nanscan.bundle.incident_md NOTE: [editable incident note]).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from nanscan.incident import NONFINITE

# annotations only: this module stays free of torch and numpy (NOTE: [fast help] in nanscan/cli/main.py)
if TYPE_CHECKING:
    from nanscan.bundle.provenance import SourceInfo
    from nanscan.engine.stats import ScanReport

SCHEMA = "nanscan.bundle/1"


MANIFEST = "manifest.json"


INCIDENT = "INCIDENT.md"


LEDGER = "ledger.jsonl"


BATCH = "batch.safetensors"


RNG = "rng.safetensors"


HISTORY = "history.safetensors"


HISTORY_INDEX = "history.json"


STATE = "state.safetensors"


STATE_STRUCTURE = "state.json"


SOURCE_DIFF = "source.diff"


LOGS = "logs"


WINDOW = "window"
WINDOW_STEPS = "window/steps.safetensors"
WINDOW_STEPS_INDEX = "window/steps.json"


PENDING_PREFIX = ".pending-"


# A distributed incident's set: this index beside the rank-<r> parts (nanscan.bundle.rank_set).
INDEX = "index.json"


RNG_METADATA_KEY = "nanscan.rng"


# A log file is copied from its end: at most this many lines and bytes.
LOG_TAIL_LINES = 200


LOG_TAIL_BYTES = 64 << 10


# Ledger keys of the automatic findings: the detection's, the replay's, and one per ablation factor
# (ABLATE_FINDING_PREFIX + the factor's key, "ablate:baseline" for the unchanged step).
DETECT_FINDING = "detect"


REPLAY_FINDING = "replay"


WINDOW_REPLAY_FINDING = "replay:window"


# The Monitor's in-process rerun at the incident (Monitor(step_fn=...), nanscan.runtime.incident_rerun).
RERUN_FINDING = "rerun"


# The Monitor's in-process diagnosis over the window (Monitor(step_fn=...), nanscan.runtime.incident_diagnosis): its
# conclusion; its rows are WINDOW_REPLAY_FINDING and the window ablation's.
DIAGNOSIS_FINDING = "diagnosis"


# A rollback the Monitor made at the incident (on_invalid=Rollback(...), nanscan.runtime.rollback).
ROLLBACK_FINDING = "rollback"


ABLATE_FINDING_PREFIX = "ablate:"


REQUIRED_KEYS = ("schema", "run_id", "first_invalid_step", "category", "nonfinite_tensors", "source", "config",
                 "config_sha256", "environment", "batch", "rng", "history", "state", "replay_entry", "files",
                 "incident", "ledger")


RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# NOTE: [bundle attempts]
# A run's incident at step N is bundled in step-N. A run that bundles step N again (a spike bundle at N, then the
# step's incident at a later micro-batch; a rollback that goes on and fails at a step it bundled before) writes
# step-N-attempt-2, -3, ...: every attempt keeps its own evidence, and the first keeps the plain name the tools and
# docs use. The Monitor counts its own bundles per step (Monitor.write_incident), never what the disk holds, so a
# run written twice into the same directory still writes the same names (and keeps the bundles already there).
STEP_DIR = re.compile(r"^step-(\d+)(?:-attempt-([2-9]|[1-9]\d+))?$")


def step_dir_order(path: Path) -> tuple[int, int]:
    """(step, attempt) of a step directory (STEP_DIR), for sorting the bundles of a run in the order they came."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)), int(match.group(2) or 1)


class BundleError(ValueError):
    """A bundle that is missing, incomplete, damaged, modified or not a nanscan bundle."""


@dataclasses.dataclass(frozen=True)
class HistoryEntry:
    """One step of the Monitor's history: the scan report and the scalars that go with it."""

    step: int
    loss: float | None
    lr: float | None
    grad_norm: float | None  # L2 norm over the finite values of every gradient (from the records' sumsq)
    report: ScanReport = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class WindowState:
    """A state the window kept (nanscan.runtime.window NOTE: [run window]): the model's (frozen parameters left out:
    the bundle holds them by reference) and the optimizer's, at the start of `step` (or at its check, before the
    update, where `pre_step` is False)."""

    step: int
    model_state: Mapping
    optimizer_state: Mapping | None
    pre_step: bool
    # A state the window spilled to its directory (Window(directory=...)): its two files, in the bundle's format
    # (write.save_state_files), which the bundle takes as they are; model_state and optimizer_state are then empty.
    files: tuple[str, str] | None = None
    has_optimizer: bool | None = None  # with `files`: whether they hold an optimizer state


@dataclasses.dataclass(frozen=True)
class WindowStep:
    """One check the window recorded: its step (and micro-batch, under check(micro_batch=True)), batch, sample ids,
    each param group's learning rate, the GradScaler's scale, the autocast region of the step's forward
    ({"device_type", "dtype"} or None) and the torch generators' state at the step's start (None where no step start
    was seen); `note` says why the batch is None where the window lost it."""

    step: int
    micro_batch: int | None
    batch: Any
    sample_ids: Any
    lrs: Sequence[Any]
    loss_scale: Any
    autocast: Mapping | None
    rng: Mapping | None
    note: str | None = None  # why the batch is missing (the loop overwrote it after the check)
    # What the loop did, observed (nanscan.runtime.loop_effects NOTE: [observed loop]): the loss it passed with this
    # check or observe() (as it backpropagated it, before the Monitor sums a step's observed losses), and at a
    # step's own check the factor its update found the checked gradients multiplied by (clipping; a GradScaler's
    # unscale). None where not seen (bundles written before them).
    loss: float | None = None
    update_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class RunWindow:
    """The window of the run up to an incident: `steps` and `every` as the Monitor kept it, its states (oldest first)
    and every check since the oldest (`records`)."""

    steps: int
    every: int
    states: Sequence[WindowState]
    records: Sequence[WindowStep]


@dataclasses.dataclass
class Incident:
    """Everything a bundle records about one non-finite step; `write_bundle` turns it into files.

    Built once when the incident is detected (timestamps, environment and log tails included), so writing the
    same Incident twice yields identical bytes.
    """

    run_id: str
    step: int
    category: str
    tensors: list[str]  # the non-finite tensors that decided the category
    report: ScanReport
    detected_at: str  # ISO 8601, UTC
    history: Sequence[HistoryEntry] = ()
    batch: Any = None
    sample_ids: Any = None
    config: dict | None = None
    source: SourceInfo | None = None
    environment: dict | None = None
    rng: dict | None = None
    # per RNG source ("torch", "numpy", "python"): "step_start" (forward pre-hook) or "check"
    rng_captured_at: Mapping[str, str] = dataclasses.field(default_factory=dict)
    model_state: Mapping | None = None
    optimizer_state: Mapping | None = None
    state_pre_step: bool = False
    state_note: str = ""
    logs: Sequence[dict] = ()  # from read_log_tail
    replay_entry: str | None = None
    # The Monitor's in-process rerun of this step (Monitor(step_fn=...), nanscan.runtime.incident_rerun NOTE:
    # [in-process rerun]): {"step_fn": "module:qualname", "timeout_s": ...}, stored as the manifest's "rerun"; its
    # result is the ledger's finding "rerun", added once the bundle is written. None: no step_fn was given.
    rerun: Mapping | None = None
    # One rank's part of a distributed incident (nanscan.runtime.distributed): written to step-<N>/rank-<r>/, with the
    # `distributed` mapping stored in the manifest.
    rank: int | None = None
    distributed: Mapping | None = None
    # Why the step is an incident (nanscan.incident REASONS): a non-finite value, or a streak of GradScaler overflow
    # skips starting at `step`; `mixed_precision`: autocast, the scaler's state and skips (nanscan.runtime.amp), or
    # None.
    reason: str = NONFINITE
    mixed_precision: Mapping | None = None
    # The run's spikes up to this step (nanscan.runtime.spikes.Spike.to_dict), stored as the manifest's "spikes". A
    # bundle of category "spike" is the early warning at the last of them: every value finite, and its
    # "first_invalid_step" is the spike's step (the run's first invalid step came later, if at all).
    spikes: Sequence[Mapping] = ()
    # The micro-batch of `step` whose check found it, under gradient accumulation (nanscan.runtime.monitor NOTE:
    # [micro-batch checks]); None for the step's own check.
    micro_batch: int | None = None
    # True when that micro-batch was observed (Monitor.observe: NOTE: [observed micro-batches]), its non-finite loss
    # found at the step's own check, whose gradients are the whole step's.
    micro_batch_observed: bool = False
    # The run's how-many-th bundle of `step` (NOTE: [bundle attempts]): 1 writes step-<N>, k > 1 step-<N>-attempt-<k>.
    attempt: int = 1
    # The steps the run's rollbacks abandoned before this incident (nanscan.runtime.rollback NOTE: [rollback]): the
    # history holds them, and the divergence does not judge them (their updates were undone).
    abandoned_steps: Sequence[int] = ()
    # The model-state keys of frozen parameters (requires_grad=False), which the bundle holds by reference: dtype,
    # shape and sha256, not bytes (nanscan.bundle.frozen NOTE: [frozen references]); empty: every tensor is copied.
    frozen: Sequence[str] = ()
    # The run's window (nanscan.runtime.window NOTE: [run window]), or None when the Monitor kept none.
    window: RunWindow | None = None
    # Each optimizer param group's parameter names (state dict names), in the order of its "params": what names
    # the optimizer state's integer keys, for a checkpoint keyed by name (NOTE: [bundle checkpoint]); None when the
    # optimizer's parameters are not the model's own (a framework's flat partitions).
    optimizer_params: Sequence[Sequence[str]] | None = None


def json_float(value: float | None) -> float | str | None:
    """A float for strict JSON: non-finite values become the strings "nan", "inf", "-inf"."""
    if value is None:
        return None
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def float_from_json(value: float | str | None) -> float | None:
    return None if value is None else float(value)


def plain_json(value: Any, where: str = "value") -> Any:
    """A JSON-ready copy of `value`: numbers (non-finite as strings), strings, lists, string-keyed dicts."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return json_float(value)
    # Looked up, not imported: a numpy or torch value exists only once its library is loaded.
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if np is not None and isinstance(value, np.generic):
        return plain_json(value.item(), where)
    if torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1:
        return plain_json(value.item(), where)
    if (torch is not None and isinstance(value, torch.Tensor)) or (np is not None and isinstance(value, np.ndarray)):
        return plain_json(value.tolist(), where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): plain_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where} is a {type(value).__name__}, which cannot be stored as JSON; "
                    "pass numbers, strings, lists or dicts")


def read_json(path: Path, *, holder: str = "bundle", object_pairs_hook=None) -> Any:
    """A JSON file of a bundle (or bundle set, `holder`), or a BundleError naming it: bytes that are not UTF-8 or
    not JSON, nesting too deep for the parser, or a file that cannot be read."""
    try:
        return json.loads(path.read_bytes(), object_pairs_hook=object_pairs_hook)
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError and JSONDecodeError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise BundleError(f"{path} is not valid JSON ({reason}): the file is truncated, damaged or was edited; ask "
                          f"for a fresh copy of the {holder}") from None
    except OSError as exc:
        raise BundleError(f"{path} cannot be read ({exc}); check its permissions") from None


def refuse_link(path: Path, *, holder: str = "bundle") -> None:
    """A BundleError when `path` is a symbolic link: bundles and bundle sets hold plain files and directories only,
    and a link in one received from someone could make a reader show (or a note replace) a file anywhere."""
    if path.is_symlink():
        raise BundleError(f"{path} is a symbolic link: a {holder} holds plain files only, and a link could point "
                          f"outside it; do not use this {holder}, ask for a copy made without links")


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ValueError(f"run_id {run_id!r} cannot name a directory: use 1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return run_id


def bundle_path(bundle_dir: str | os.PathLike, run_id: str, step: int, rank: int | None = None,
                attempt: int = 1) -> Path:
    """Where the bundle of `run_id`'s incident at `step` lives (a distributed rank's part: `rank-<r>` below it);
    the run's second and later bundles of the same step: `step-<N>-attempt-<k>` (NOTE: [bundle attempts])."""
    name = f"step-{int(step)}" if attempt == 1 else f"step-{int(step)}-attempt-{int(attempt)}"
    path = Path(bundle_dir) / check_run_id(run_id) / name
    return path if rank is None else path / f"rank-{int(rank)}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
