"""Replay a bundle's failing step: reproduce it deterministically, tell a persistent failure from one the replay
entry does not reproduce (and name what a rerun cannot see), localize the first module that produced a non-finite
value, bisect the batch to the fewest samples that still fail, and export those samples as a regression case (`nanscan replay`, `nanscan export-regression`); rerun the
window of the run that led to it (`replay --window`); change one factor at a time, on the failing step or over the
window (`nanscan ablate`, `ablate --window`).

Everything here runs the user's step again through the bundle's replay entry (nanscan.entry), with the step runner
and the localization the Monitor's in-process rerun shares (nanscan.runtime: rerun, localize, ops, step_options).
Modules, bottom up: options (the ablations' factors and the defaults, free of torch), traps (an optimizer's
settings against the dtypes), step (the run's precision and clipping, batch handling), replayer (a bundle's step rebuilt), bisect (ddmin over samples), reproduce
(`replay()`, its recorded finding, the suspicious samples), window (the window's rerun), ablate and ablate_window
(one factor at a time), export (regression cases), cli (the subcommands).

Every public name is loaded on first use (module __getattr__, PEP 562), as nanscan's own are: they need torch,
which the subcommands' help must not import (NOTE: [fast help] in nanscan/cli/main.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanscan._lazy import lazy_names

# public name -> the module that defines it
_HOMES = {
    "BisectResult": "nanscan.replay.bisect", "bisect_samples": "nanscan.replay.bisect",
    "ddmin": "nanscan.replay.bisect",
    "ExportResult": "nanscan.replay.export", "export_regression": "nanscan.replay.export",
    "Localization": "nanscan.runtime.localize", "ValueSummary": "nanscan.runtime.localize",
    "summarize_values": "nanscan.runtime.localize",
    "OpSite": "nanscan.runtime.ops", "OpTracer": "nanscan.runtime.ops",
    "StepOptions": "nanscan.runtime.step_options",
    "Trap": "nanscan.runtime.traps", "optimizer_traps": "nanscan.runtime.traps",
    "Replayer": "nanscan.replay.replayer", "open_bundle": "nanscan.replay.replayer",
    "ReplayResult": "nanscan.replay.reproduce", "localize": "nanscan.replay.reproduce",
    "record_replay": "nanscan.replay.reproduce", "recorded_replay": "nanscan.replay.reproduce",
    "replay": "nanscan.replay.reproduce",
    "PRECISIONS": "nanscan.runtime.rerun", "StepOutcome": "nanscan.runtime.rerun", "run_step": "nanscan.runtime.rerun",
    "ReplayError": "nanscan.replay.step", "select_samples": "nanscan.replay.step",
    "batch_size": "nanscan.engine.inputs", "map_tensors": "nanscan.engine.inputs",
}

__all__ = ["PRECISIONS", "BisectResult", "ExportResult", "Localization", "OpSite", "OpTracer", "ReplayError",
           "ReplayResult", "Replayer", "StepOptions", "StepOutcome", "Trap", "ValueSummary", "batch_size",
           "bisect_samples", "ddmin", "export_regression", "localize", "map_tensors", "open_bundle",
           "optimizer_traps", "record_replay", "recorded_replay", "replay", "run_step", "select_samples",
           "summarize_values"]

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ loads each name
    from nanscan.replay.bisect import BisectResult, bisect_samples, ddmin
    from nanscan.replay.export import ExportResult, export_regression
    from nanscan.engine.inputs import batch_size, map_tensors
    from nanscan.replay.replayer import Replayer, open_bundle
    from nanscan.replay.reproduce import ReplayResult, localize, record_replay, recorded_replay, replay
    from nanscan.replay.step import ReplayError, select_samples
    from nanscan.runtime.traps import Trap, optimizer_traps
    from nanscan.runtime.localize import Localization, ValueSummary, summarize_values
    from nanscan.runtime.ops import OpSite, OpTracer
    from nanscan.runtime.rerun import PRECISIONS, StepOutcome, run_step
    from nanscan.runtime.step_options import StepOptions


lazy_names(__name__, _HOMES, __all__)
