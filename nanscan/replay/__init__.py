"""Replay a bundle's failing step: reproduce it deterministically, tell a persistent failure from one the replay
entry does not reproduce (and name what a rerun cannot see), localize the first module that produced a non-finite
value, bisect the batch to the fewest samples that still fail, and export those samples as a regression case (`nanscan replay`, `nanscan export-regression`); rerun the
window of the run that led to it (`replay --window`); change one factor at a time, on the failing step or over the
window (`nanscan ablate`, `ablate --window`).

Everything here runs the user's step again through the bundle's replay entry (nanscan.entry). Modules, bottom up:
options (StepOptions, the ablations' factors and the defaults, free of torch), localize (module hooks, value
summaries), ops (the first bad op and its source line), traps (an optimizer's settings against the dtypes), step
(run_step, its outcome, batch handling), replayer (a bundle's step rebuilt), bisect (ddmin over samples), reproduce
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
    "Localization": "nanscan.replay.localize", "ValueSummary": "nanscan.replay.localize",
    "summarize_values": "nanscan.replay.localize",
    "OpSite": "nanscan.replay.ops", "OpTracer": "nanscan.replay.ops",
    "StepOptions": "nanscan.replay.options",
    "Trap": "nanscan.replay.traps", "optimizer_traps": "nanscan.replay.traps",
    "Replayer": "nanscan.replay.replayer", "open_bundle": "nanscan.replay.replayer",
    "ReplayResult": "nanscan.replay.reproduce", "localize": "nanscan.replay.reproduce",
    "record_replay": "nanscan.replay.reproduce", "recorded_replay": "nanscan.replay.reproduce",
    "replay": "nanscan.replay.reproduce",
    "PRECISIONS": "nanscan.replay.step", "ReplayError": "nanscan.replay.step", "StepOutcome": "nanscan.replay.step",
    "batch_size": "nanscan.replay.step", "map_tensors": "nanscan.replay.step", "run_step": "nanscan.replay.step",
    "select_samples": "nanscan.replay.step",
}

__all__ = ["PRECISIONS", "BisectResult", "ExportResult", "Localization", "OpSite", "OpTracer", "ReplayError",
           "ReplayResult", "Replayer", "StepOptions", "StepOutcome", "Trap", "ValueSummary", "batch_size",
           "bisect_samples", "ddmin", "export_regression", "localize", "map_tensors", "open_bundle",
           "optimizer_traps", "record_replay", "recorded_replay", "replay", "run_step", "select_samples",
           "summarize_values"]

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ loads each name
    from nanscan.replay.bisect import BisectResult, bisect_samples, ddmin
    from nanscan.replay.export import ExportResult, export_regression
    from nanscan.replay.localize import Localization, ValueSummary, summarize_values
    from nanscan.replay.ops import OpSite, OpTracer
    from nanscan.replay.options import StepOptions
    from nanscan.replay.replayer import Replayer, open_bundle
    from nanscan.replay.reproduce import ReplayResult, localize, record_replay, recorded_replay, replay
    from nanscan.replay.step import (PRECISIONS, ReplayError, StepOutcome, batch_size, map_tensors, run_step,
                                     select_samples)
    from nanscan.replay.traps import Trap, optimizer_traps


# localize is the function (reproduce.localize), not the submodule nanscan.replay.localize.
lazy_names(__name__, _HOMES, __all__, functions_named_like_modules=("localize",))
