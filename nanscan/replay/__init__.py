"""Replay a bundle's failing step: reproduce it deterministically, tell a persistent failure from a transient one,
localize the first module that produced a non-finite value, bisect the batch to the fewest samples that still
fail, and export those samples as a regression case (`nanscan replay`, `nanscan export-regression`).

Everything here runs the user's step again through the bundle's replay entry (nanscan.entry). Modules, bottom up:
localize (module hooks, value summaries), step (run_step, its options and outcome, batch handling), replayer (a
bundle's step rebuilt), bisect (ddmin over samples), reproduce (`replay()` and its recorded finding), export
(regression cases), cli (the subcommands).
"""

from nanscan.replay.bisect import BisectResult, bisect_samples, ddmin
from nanscan.replay.export import ExportResult, export_regression
from nanscan.replay.localize import Localization, ValueSummary, summarize_values
from nanscan.replay.replayer import Replayer, open_bundle
from nanscan.replay.reproduce import ReplayResult, localize, record_replay, recorded_replay, replay
from nanscan.replay.step import (PRECISIONS, ReplayError, StepOptions, StepOutcome, batch_size, map_tensors, run_step,
                                 select_samples)

__all__ = ["PRECISIONS", "BisectResult", "ExportResult", "Localization", "ReplayError", "ReplayResult", "Replayer",
           "StepOptions", "StepOutcome", "ValueSummary", "batch_size", "bisect_samples", "ddmin", "export_regression",
           "localize", "map_tensors", "open_bundle", "record_replay", "recorded_replay", "replay", "run_step",
           "select_samples", "summarize_values"]
