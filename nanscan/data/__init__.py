"""Dataset checks: find the records that will make a training run produce NaN/inf, before the run.

`nanscan.data.check(dataset)` checks Python records (a torch Dataset, a list of dicts, any iterable);
`nanscan.data.check_paths(paths)` checks JSON Lines, CSV, Parquet, .npy/.npz, safetensors and image folders.
Both return a DataReport whose findings (`nonfinite`, `overflow`, `empty`, `too_long`, `no_supervised_tokens`,
`corrupt_image`, `unreadable`, `inconsistent`) each name a record by file, line or index, and the sha256 of its
bytes.

Names are loaded on first use, so that `nanscan preflight` and `nanscan runs` work without the readers'
dependencies (pyarrow, Pillow, tokenizers) installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanscan._lazy import lazy_names

_EXPORTS = {
    "Checker": "checker", "check": "api", "check_paths": "api",
    "CATEGORIES": "findings", "DEFAULT_FAIL_ON": "findings", "Boundary": "findings", "DataReport": "findings",
    "Finding": "findings", "RecordId": "findings", "TrainingFields": "findings",
    "RunsReport": "runs", "check_runs": "runs",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from nanscan.data.api import check, check_paths
    from nanscan.data.checker import Checker
    from nanscan.data.findings import (
        CATEGORIES, DEFAULT_FAIL_ON, Boundary, DataReport, Finding, RecordId, TrainingFields,
    )
    from nanscan.data.runs import RunsReport, check_runs


lazy_names(__name__, {name: f"nanscan.data.{home}" for name, home in _EXPORTS.items()}, __all__)
