"""A training run for the write-fault tests, as its own process: a Monitor over a small model whose batch turns NaN
at step 2, so the Monitor writes a bundle there. Run as `python fault_writer.py BUNDLE_DIR RUN_ID [WIDTH]`; it
prints "ready" just before the failing step's check (so a test can kill it during the write), then the bundle's
path or "no bundle: <reason>" after the NonFiniteError, and exits 3 (0 would mean nothing was caught).
Importable too: train() is the same run in the test's own process."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import nanscan

BAD_STEP = 2


def train(bundle_dir: str | Path, run_id: str, *, width: int = 64, log_file: Path | None = None,
          before_bad_check=None) -> nanscan.NonFiniteError:
    """Train until the Monitor raises at BAD_STEP; return its NonFiniteError."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    logs = [log_file] if log_file is not None else []
    monitor = nanscan.Monitor(model, optimizer, bundle_dir=bundle_dir, run_id=run_id, snapshot="cpu",
                              config={"width": width}, log_files=logs)
    for step in range(BAD_STEP + 1):
        x = torch.randn(8, width)
        if step == BAD_STEP:
            x[3, 0] = float("nan")
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        if step == BAD_STEP and before_bad_check is not None:
            before_bad_check()
        try:
            monitor.check(batch={"x": x}, loss=loss, step=step)
        except nanscan.NonFiniteError as exc:
            return exc
        optimizer.step()
    raise AssertionError("no NonFiniteError at the planted step")


def main(argv: list[str]) -> int:
    bundle_dir, run_id = argv[0], argv[1]
    width = int(argv[2]) if len(argv) > 2 else 64

    def ready() -> None:
        print("ready", flush=True)

    error = train(bundle_dir, run_id, width=width, before_bad_check=ready)
    print(error.bundle_path if error.bundle_path is not None else f"no bundle: {error}", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
