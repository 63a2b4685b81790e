"""nanscan: catch the first non-finite training step cheaply, preserve the evidence, and find its cause.

The public face. The layers below it (ARCHITECTURE.md): the scan engine (inputs, plans, dispatch, backends/,
pending, stats), the in-loop runtime (monitor, spikes, history, snapshot, distributed, incident), the evidence (bundle/)
and the workflow tools (report, replay/, ablate, triage, preflight, data/, demo, cli)."""

from nanscan.backends import BackendUnavailable, backend_info
from nanscan.bundle import Bundle, BundleError, HistoryEntry, load_bundle
from nanscan.entry import ReplaySpec
from nanscan.headroom import headroom
from nanscan.incident import NonFiniteError, NonFiniteWarning, SpikeWarning
from nanscan.inputs import UnsupportedTensorError
from nanscan.monitor import Monitor, check, first_invalid
from nanscan.scan import scan
from nanscan.spikes import Spike, SpikeRule
from nanscan.stats import PendingReport, ScanReport, TensorStats

__all__ = [
    "BackendUnavailable", "PendingReport", "ScanReport", "TensorStats", "UnsupportedTensorError",
    "backend_info", "check", "first_invalid", "headroom", "scan",
    "Bundle", "BundleError", "HistoryEntry", "Monitor", "NonFiniteError", "NonFiniteWarning", "load_bundle",
    "ReplaySpec", "Spike", "SpikeRule", "SpikeWarning",
]

try:
    from importlib.metadata import version as _version

    __version__ = _version("nanscan")
except Exception:  # noqa: BLE001 - running from a source tree without an install
    __version__ = "0.0.0+unknown"
