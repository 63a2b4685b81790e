"""The window's kept states on disk (Window(directory=...)), for a model whose R states would not fit in host memory:
one host copy at a time, written in the background, atomically, in the bundle's own format (NOTE: [spilled states]).

NOTE: [spilled states]
With Window(directory=...), a state the window keeps (nanscan.runtime.window NOTE: [run window]) is copied into one
set of host buffers (pinned for a GPU's tensors, the copy asynchronous as ever) and written from there by a
background thread, as the two files a bundle's window state is made of (nanscan.bundle.write.save_state_files:
safetensors and JSON, each written to a temporary name and renamed), so a crash mid-write leaves no half state that
looks whole. The states go to a folder of their own, `<directory>/nanscan-window-XXXXXXXX/` (one per process, so
ranks and runs sharing the directory never meet, and nothing of the user's is overwritten), named by step; the ring
of R states is kept there, the oldest deleted as a newer one is kept, and the folder is removed when the Monitor
goes away (a killed process leaves it). Host memory: one state instead of R. The loop never waits for the disk
unless the next state is due before the last one was written (`every` steps later); the time it waited is counted
(StateSpill.waited). At an incident the bundle takes the finished files as they are (hard-linked where the file
system allows, else copied), so a state is never read back into memory to be written again. A write that fails
(a full disk) leaves that state out of the window, and says so once.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nanscan.bundle.write import save_state_files
from nanscan.runtime.snapshot import CpuSnapshot, StateOf


@dataclass
class SpilledState:
    """A state being written (or written) to the spill folder: its two files, and the write's future."""

    files: tuple[Path, Path]
    has_optimizer: bool
    future: Future

    def error(self) -> BaseException | None:
        """Waits for the write; the exception it raised, if any."""
        return self.future.exception()


def _remove(root: Path, writer: ThreadPoolExecutor) -> None:
    writer.shutdown(wait=True)
    shutil.rmtree(root, ignore_errors=True)


class StateSpill:
    """One process's spill folder and its background writer (NOTE: [spilled states])."""

    def __init__(self, directory, local: Callable[[torch.Tensor], torch.Tensor] | None = None):
        parent = Path(directory)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix="nanscan-window-", dir=parent))
        except OSError as exc:
            raise ValueError(f"Window(directory={str(directory)!r}): cannot keep the window's states there "
                             f"({type(exc).__name__}: {exc}); give a writable directory, or directory=None to keep "
                             "them in host memory") from exc
        self._staging = CpuSnapshot(local)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanscan-window")
        self._last: SpilledState | None = None
        self._warned = False
        self.waited = 0.0  # seconds the loop waited for the previous state's write before copying the next
        weakref.finalize(self, _remove, self.root, self._writer)

    def capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                skip: frozenset[str], state_of: StateOf | None = None) -> None:
        """Copy the state into the host buffers, once the previous state's write has read them."""
        if self._last is not None and not self._last.future.done():
            start = time.perf_counter()
            self._last.future.exception()
            self.waited += time.perf_counter() - start
        self._staging.capture(model, optimizer, skip=skip, state_of=state_of)

    def write(self, step: int) -> SpilledState:
        """Write what capture() copied, as the state of `step`, in the background."""
        files = (self.root / f"state-{step}.safetensors", self.root / f"state-{step}.json")
        self._last = SpilledState(files, self._staging.optimizer_state is not None,
                                  self._writer.submit(self._write, files))
        return self._last

    def _write(self, files: tuple[Path, Path]) -> None:
        model_state, optimizer_state = self._staging.result()  # waits for a GPU's copies, in this thread
        save_state_files(files[0], files[1], model_state, optimizer_state)

    def failure(self, spilled: SpilledState) -> str | None:
        """Waits for the state's write: None when its files are whole, else what went wrong, said the first time
        (a failed state is left out of the window)."""
        error = spilled.error()
        if error is None:
            return None
        text = (f"nanscan: the window could not write a kept state to {self.root} ({type(error).__name__}: {error}); "
                "a bundle's window leaves such states out; free space there or give another Window(directory=...)")
        first, self._warned = not self._warned, True
        return text if first else ""

    def remove(self, spilled: SpilledState) -> None:
        """A state left the ring: its files are deleted once written (a bundle that took them keeps its own)."""
        spilled.future.exception()
        for path in spilled.files:
            with contextlib.suppress(OSError):
                path.unlink()

    def nbytes(self) -> int:
        """Host bytes the spill holds: its one set of buffers."""
        return self._staging.nbytes()
