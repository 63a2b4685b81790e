"""nanscan: catch the first non-finite training step cheaply, preserve the evidence, and find its cause."""

from nanscan.backends import BackendUnavailable, backend_info
from nanscan.bundle import Bundle, BundleError, HistoryEntry, load_bundle
from nanscan.headroom import headroom
from nanscan.inputs import UnsupportedTensorError
from nanscan.monitor import Monitor, NonFiniteError, NonFiniteWarning
from nanscan.scan import check, first_invalid, scan
from nanscan.stats import PendingReport, ScanReport, TensorStats

__all__ = [
    "BackendUnavailable", "PendingReport", "ScanReport", "TensorStats", "UnsupportedTensorError",
    "backend_info", "check", "first_invalid", "headroom", "scan",
    "Bundle", "BundleError", "HistoryEntry", "Monitor", "NonFiniteError", "NonFiniteWarning", "load_bundle",
]

try:
    from importlib.metadata import version as _version

    __version__ = _version("nanscan")
except Exception:  # noqa: BLE001 - running from a source tree without an install
    __version__ = "0.0.0+unknown"
