"""`nanscan replay --window`: the bundle's window rerun through its replay entry (nanscan.runtime.window_rerun NOTE:
[window replay], which the Monitor's in-process diagnosis shares)."""

from __future__ import annotations

import os

from nanscan.bundle import Bundle
from nanscan.replay.replayer import Replayer, open_bundle
from nanscan.runtime.step_options import StepOptions
# re-exported: the tools' names
from nanscan.runtime.window_rerun import (DEPART_REL_TOL, WindowEvidence, WindowReplay, WindowRun,  # noqa: F401
                                          WindowStepResult, record_window_replay, rerun_window, set_learning_rates,
                                          window_markdown)


def replay_window(bundle: Bundle | str | os.PathLike, entry: str | None = None, *,
                  options: StepOptions = StepOptions(), trust_bundle_paths: bool = False) -> WindowReplay:
    """Rerun the bundle's window (NOTE: [window replay]) under `options` (the defaults: as recorded); the replay
    entry is chosen as for `nanscan replay` (NOTE: [trust rule] in nanscan/entry.py)."""
    return rerun_window(Replayer(open_bundle(bundle), entry, trust_bundle_paths=trust_bundle_paths), options).result
