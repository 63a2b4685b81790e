"""The run's record of its rollbacks, `<bundle_dir>/<run_id>/rollbacks.json` (on_invalid=Rollback(...):
nanscan.runtime.rollback NOTE: [rollback]): written atomically by the Monitor, read by report and triage.

The file is JSON, sorted keys, two-space indent: {"format": ROLLBACKS_FORMAT, "rollbacks": [entry, ...]}, one entry
per rollback in the order they happened: at_step, category, bundle (the incident's, relative to the run directory),
restored_step, restored_from, skipped_steps, skipped_sample_ids, skip_next, factor, loss_scale, quarantined and
outcome {status: "pending" | "recovered" | "not recovered" | "failed again", finite_steps, failed_at, and once
settled the measure: loss, loss_ceiling, grad_norm, grad_norm_ceiling, steps, why}; and, once a rollback was
refused and the run stopped, "stopped": {at_step, bundle, why}. No wall-clock time: the same run writes the same
bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nanscan._atomic import atomic_write_bytes
from nanscan.bundle.format import BundleError

ROLLBACKS_FILE = "rollbacks.json"
ROLLBACKS_FORMAT = "nanscan.rollbacks/1"


def write_rollbacks(run_dir: str | os.PathLike, entries: list[dict], stopped: dict | None = None) -> Path:
    """Write the run's rollbacks, and where it stopped (atomically: a crash leaves the previous file whole)."""
    path = Path(run_dir) / ROLLBACKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": ROLLBACKS_FORMAT, "rollbacks": entries, **({"stopped": stopped} if stopped else {})}
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return path


def read_rollbacks(run_dir: str | os.PathLike) -> list[dict]:
    """The run's rollbacks, oldest first; [] when it made none. Raises BundleError naming the file when it is not
    one nanscan wrote."""
    path = Path(run_dir) / ROLLBACKS_FILE
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path} cannot be read ({exc}); it is the Monitor's record of its rollbacks, which "
                          "report and triage show: restore it from a copy, or remove it to show none") from None
    entries = data.get("rollbacks") if isinstance(data, dict) and data.get("format") == ROLLBACKS_FORMAT else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("at_step"), int)
                                               for e in entries):
        raise BundleError(f"{path} is not a rollbacks record ({ROLLBACKS_FORMAT}, a list of rollbacks each with its "
                          "at_step); restore it from a copy, or remove it to show none")
    return entries
