"""What a replay can be asked to do, without torch: the ablations' factors (Factor, FACTORS) over the options a
rerun step runs under (StepOptions and the precisions by name; both from nanscan.runtime.step_options, which the
Monitor's in-process diagnosis shares), and the defaults of replay() and export_regression().

They live apart from the modules that run the step so that `nanscan replay --help`, `nanscan export-regression
--help` and `nanscan ablate --help` show them without importing torch (NOTE: [fast help] in nanscan/cli/main.py);
nanscan.runtime.rerun maps each precision to its torch dtype.
"""

from __future__ import annotations

# re-exported: the tools' names
from nanscan.runtime.step_options import (BASELINE, FACTOR_KEYS, FACTORS, PRECISION_NAMES,  # noqa: F401
                                           Factor, StepOptions)

DEFAULT_RUNS = 3  # the reproduction and two more, to tell persistent from transient

DEFAULT_MAX_STATE_MB = 64  # the largest model and optimizer state a regression case stores by default
