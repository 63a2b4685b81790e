"""Dataset checks: find the records that will make a training run produce NaN/inf, before the run.

`nanscan.data.check(dataset)` checks Python records (a torch Dataset, a list of dicts, any iterable);
`nanscan.data.check_paths(paths)` checks JSON Lines, CSV, Parquet, .npy/.npz, safetensors and image folders.
Both return a DataReport whose findings (`nonfinite`, `empty`, `too_long`, `corrupt_image`, `unreadable`,
`inconsistent`) each name a record by file, line or index, and the sha256 of its bytes.
"""

try:
    import pyarrow  # noqa: F401 - the columnar readers and the token counter need it
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("nanscan.data needs pyarrow (and Pillow, tokenizers for images and --tokenizer); install "
                      "them with: pip install 'nanscan[data]'") from exc

from nanscan.data.check import Checker, check, check_paths
from nanscan.data.findings import (
    CATEGORIES, DEFAULT_FAIL_ON, Boundary, DataReport, Finding, RecordId,
)
from nanscan.data.runs import RunsReport, check_runs

__all__ = [
    "CATEGORIES", "DEFAULT_FAIL_ON", "Boundary", "Checker", "DataReport", "Finding", "RecordId", "RunsReport",
    "check", "check_paths", "check_runs",
]
