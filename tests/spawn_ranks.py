"""Multi-process tests' launcher: one function run on every rank of a spawned world, each rank's failure written
where the test can show it, and a deadline after which the ranks are killed, so a hung rank cannot hang the suite.
Used by tests/test_distributed.py and tests/test_deepspeed.py."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def guarded(rank: int, worker: Callable[[int, Any, str, str], None], arg: Any, store: str, out: str) -> None:
    """Run one rank's `worker(rank, arg, store, out)`; whatever it raises is written to `error-rank<r>.txt` and the
    process group is always destroyed. In 2 of 5 fresh-clone CI runs (numba backend) one rank died of SIGABRT
    ("terminate called without an active exception": a native thread destroyed while still running), which hid
    everything else; such aborts come from native teardown at interpreter exit, so a rank that finished its work
    leaves without finalization. The results the tests check are in the files the worker wrote; an exception
    still fails the test with its traceback."""
    try:
        worker(rank, arg, store, out)
    except BaseException:
        (Path(out) / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable[[int, Any, str, str], None], arg: Any, world: int, out: Path, *, timeout_s: float,
          label: str) -> None:
    """Run `worker(rank, arg, store, out)` on `world` spawned processes (a file store under `out` for
    init_process_group); killed after `timeout_s`. A failure raises with every rank's traceback."""
    out.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(guarded, args=(worker, arg, str(out / "store"), str(out)), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label} on {world} processes did not finish in {timeout_s} s: a rank is blocked")
    except Exception as exc:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error-rank*.txt")))
        raise RuntimeError(f"{label} failed: {exc}\n{errors}") from exc
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def gloo_rank(rank: int, store: str, world: int, *, timeout_s: float = 120) -> None:
    """A spawned rank's process group: gloo over the file store, one torch thread (the ranks share 2 cores)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def write_result(out: str, rank: int, run: Callable[[], dict]) -> None:
    """`run()`'s dict as rank<r>.json under `out`, or what it raised (with its traceback), for the test to show; its
    warnings silenced (the test asserts on what it returns)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run()
    except Exception as exc:  # noqa: BLE001 - written for the test to show
        result = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
