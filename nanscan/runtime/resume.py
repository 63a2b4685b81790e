"""on_invalid=Resume(directory): at an incident, the last good state the window kept written as a checkpoint to resume
from, and the process exits with a code a launcher acts on (NOTE: [resume elsewhere]).

NOTE: [resume elsewhere]
A fault that comes from a node (a bad GPU, a flipped bit) does not go away by rolling back on that node, and a job
at scale is restarted by its launcher anyway. So, as Megatron's rerun machine exits with a code its launcher reads,
on_invalid=Resume(...) ends the run cleanly once its evidence is safe: the bundle is written (and the failing step
rerun and diagnosed, with step_fn), then the newest state the window kept from before the episode's first warning
(as Rollback(skip="window") chooses it: the fault's damage came after it) is written from that bundle as a
torch.distributed.checkpoint directory (nanscan.bundle.checkpoint NOTE: [bundle checkpoint]: DCP reshards on load,
so the restart may use other nodes and another world size; the data position and the RNG states are beside it),
`<directory>/<run id>/step-<S>`, and every process raises ResumeExit, a SystemExit whose code is `exit_code`
(RESUME_EXIT_CODE, 75: EX_TEMPFAIL, "try again"), its message naming the bundle and the checkpoint, also logged.
Under a process group every rank writes its bundle part first; after a barrier rank 0 writes the checkpoint from the
whole set (it joins the shards: the state must fit its host memory), the ranks agree on the result, and every rank
exits with the same code, or every rank raises NonFiniteError with the same reason where no checkpoint could be
written (no window, no kept state from before the fault, a bundle that could not be written). Writing the same
incident's checkpoint again replaces it with the same files.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from nanscan.bundle import load_bundle
from nanscan.bundle.checkpoint import write_checkpoint

log = logging.getLogger("nanscan")

RESUME_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, the job may be tried again
# what a checkpoint that could not be written raises: ValueError (nanscan's BundleError is one) with the reason, or
# the OSError of a directory it could not write
CHECKPOINT_ERRORS = (ValueError, OSError)


@dataclasses.dataclass(frozen=True)
class Resume:
    """on_invalid=Resume(directory): at an incident write the last good kept state as a checkpoint under `directory`
    and exit with `exit_code` (NOTE: [resume elsewhere])."""

    directory: str | os.PathLike
    exit_code: int = RESUME_EXIT_CODE

    def __post_init__(self):
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise TypeError(f"Resume(directory={self.directory!r}): give the directory the checkpoint goes under")
        if isinstance(self.exit_code, bool) or not isinstance(self.exit_code, int) or not 1 <= self.exit_code <= 255:
            raise ValueError(f"Resume(exit_code={self.exit_code!r}): give a process exit code from 1 to 255 (the "
                             f"default, {RESUME_EXIT_CODE}, is EX_TEMPFAIL)")


class ResumeExit(SystemExit):
    """The run stopped for a restart (on_invalid=Resume): `code` is the policy's exit code; `bundle_path`, the
    incident's evidence; `checkpoint`, the checkpoint to resume from; `step`, the first step to train from it."""

    def __init__(self, message: str, code: int, *, bundle_path: Path | None, checkpoint: Path, step: int):
        super().__init__(code)
        self.message, self.bundle_path, self.checkpoint, self.step = message, bundle_path, checkpoint, step

    def __str__(self) -> str:
        return self.message


def resume_state_step(window_states: list[int], first: int) -> int | None:
    """The kept state a restart begins from: the newest that began at or before `first` (the episode's first
    warning, or the failing step), None when there is none."""
    kept = [s for s in window_states if s <= first]
    return max(kept) if kept else None


def write_resume_checkpoint(policy: Resume, bundle_path: Path | None, run_id: str, first: int) -> tuple[Path, int]:
    """The checkpoint of the kept state a restart begins from, written from the bundle (or set) at `bundle_path`;
    raises ValueError saying why there is none."""
    if bundle_path is None:
        raise ValueError("the incident's bundle could not be written, and the checkpoint is written from it")
    bundle = load_bundle(bundle_path)
    window = bundle.window
    states = [s["step"] for s in (window or {}).get("states") or []]
    step = resume_state_step(states, first)
    if step is None:
        raise ValueError(f"the window kept no state from at or before step {first} (it kept {states or 'none'}); a "
                         "longer window (Window(steps=...)) reaches further back")
    out = Path(policy.directory) / run_id / f"step-{step}"
    written = write_checkpoint(bundle, out, step=step, overwrite=True)
    return written.path, step


def resume_message(message: str, policy: Resume, checkpoint: Path, step: int) -> str:
    return (f"{message}; on_invalid=Resume: the state kept at step {step} is written as a checkpoint to resume from, "
            f"{checkpoint} (`nanscan_resume.json` beside it says the step and data position), and the process exits "
            f"with code {policy.exit_code} for the launcher to restart the job")


def exit_for_restart(message: str, policy: Resume, *, bundle_path: Path | None, checkpoint: Path,
                     step: int) -> Any:
    """Log the message and raise ResumeExit."""
    text = resume_message(message, policy, checkpoint, step)
    log.error(text)
    raise ResumeExit(text, policy.exit_code, bundle_path=bundle_path, checkpoint=checkpoint, step=step)
