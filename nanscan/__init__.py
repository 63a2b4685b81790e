"""nanscan: catch the first non-finite training step cheaply, preserve the evidence, and find its cause.

The public face. The layers below it, each its folders (ARCHITECTURE.md): the scan engine (engine/: inputs, plans,
dispatch, backends/, pending, stats, headroom; with scan and incident here), the in-loop runtime (runtime/: monitor,
amp, spikes, history, snapshot, distributed; integrations/), the evidence (bundle/, entry) and the workflow tools
(replay/, review/, data/, preflight, demo, testing), with the command line (cli/) on top.

Every public name is loaded on first use (module __getattr__, PEP 562): most of them need torch, and importing
torch and the backends costs seconds, which `nanscan --help` and the subcommands' help must not pay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanscan._lazy import lazy_names

# public name -> the module that defines it
_HOMES = {
    "BackendUnavailable": "nanscan.engine.backends", "backend_info": "nanscan.engine.backends",
    "Bundle": "nanscan.bundle", "BundleError": "nanscan.bundle", "HistoryEntry": "nanscan.bundle",
    "load_bundle": "nanscan.bundle",
    "ReplaySpec": "nanscan.entry",
    "headroom": "nanscan.engine.headroom",
    "NonFiniteError": "nanscan.incident", "NonFiniteWarning": "nanscan.incident", "SpikeWarning": "nanscan.incident",
    "SnapshotWarning": "nanscan.incident", "GradientWarning": "nanscan.incident", "replay_entry": "nanscan.entry",
    "UnsupportedTensorError": "nanscan.engine.inputs",
    "Monitor": "nanscan.runtime.monitor",
    "Rollback": "nanscan.runtime.rollback", "RollbackWarning": "nanscan.runtime.rollback",
    "Resume": "nanscan.runtime.resume", "ResumeExit": "nanscan.runtime.resume",
    "check": "nanscan.runtime.default", "first_invalid": "nanscan.runtime.default",
    "compare_state_dicts": "nanscan.engine.fingerprint", "StateDictComparison": "nanscan.engine.fingerprint",
    "scan": "nanscan.scan",
    "Spike": "nanscan.runtime.spikes", "SpikeRule": "nanscan.runtime.spikes",
    "PendingReport": "nanscan.engine.stats", "ScanReport": "nanscan.engine.stats",
    "TensorStats": "nanscan.engine.stats",
    "skip_quarantined": "nanscan.data.quarantine", "QuarantinedDataset": "nanscan.data.quarantine",
    "QuarantinedIterableDataset": "nanscan.data.quarantine",
}

__all__ = [
    "BackendUnavailable", "PendingReport", "ScanReport", "StateDictComparison", "TensorStats",
    "UnsupportedTensorError", "backend_info", "check", "compare_state_dicts", "first_invalid", "headroom", "scan",
    "Bundle", "BundleError", "HistoryEntry", "Monitor", "NonFiniteError", "NonFiniteWarning", "load_bundle",
    "GradientWarning", "ReplaySpec", "SnapshotWarning", "Spike", "SpikeRule", "SpikeWarning", "replay_entry",
    "QuarantinedDataset", "QuarantinedIterableDataset", "skip_quarantined", "Rollback", "RollbackWarning",
    "Resume", "ResumeExit",
]

if TYPE_CHECKING:  # what editors and type checkers see; at run time __getattr__ loads each name
    from nanscan.engine.backends import BackendUnavailable, backend_info
    from nanscan.bundle import Bundle, BundleError, HistoryEntry, load_bundle
    from nanscan.entry import ReplaySpec, replay_entry
    from nanscan.engine.fingerprint import StateDictComparison, compare_state_dicts
    from nanscan.engine.headroom import headroom
    from nanscan.incident import GradientWarning, NonFiniteError, NonFiniteWarning, SnapshotWarning
    from nanscan.engine.inputs import UnsupportedTensorError
    from nanscan.runtime.default import check, first_invalid
    from nanscan.runtime.monitor import Monitor
    from nanscan.runtime.resume import Resume, ResumeExit
    from nanscan.runtime.rollback import Rollback, RollbackWarning
    from nanscan.scan import scan
    from nanscan.engine.stats import PendingReport, ScanReport, TensorStats
    from nanscan.data.quarantine import QuarantinedDataset, QuarantinedIterableDataset, skip_quarantined


lazy_names(__name__, _HOMES, __all__, functions_named_like_modules=("scan",))


try:
    from importlib.metadata import version as _version

    __version__ = _version("nanscan")
except Exception:  # noqa: BLE001 - running from a source tree without an install
    __version__ = "0.0.0+unknown"
