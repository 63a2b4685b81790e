"""Replay's side of a rerun step, by the names replay's modules, nanscan.testing, preflight and the regression tests
export-regression wrote import: the step itself runs in nanscan.runtime.rerun (run_step, its outcome and options)
and its batch and loop settings are nanscan.runtime.rerun_inputs' (NOTE: [replayed precision]), which the Monitor's
in-process rerun and diagnosis share.
"""

from __future__ import annotations

from nanscan.engine.inputs import batch_size, map_tensors  # noqa: F401
from nanscan.runtime.rerun import (HALF_DTYPES, PRECISION_OF, PRECISIONS, Accumulation,  # noqa: F401
                                   StepOutcome, autocast_context, deterministic_algorithms, model_device, owner_of,
                                   recorded_precision, run_localized, run_step)
from nanscan.runtime.rerun_inputs import (ReplayError, loop_options, prepare_batch, sample_ids_of,  # noqa: F401
                                          select_samples, with_run_precision)
from nanscan.runtime.step_options import PRECISION_NAMES, StepOptions  # noqa: F401
