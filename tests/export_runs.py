"""The small training run the live-export tests share (tests/test_export_tb.py, tests/test_export_wandb.py): healthy
steps, then a NaN planted in the batch."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nanscan import NonFiniteError

FAIL_AT = 5


def small_model():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(monitor, model, optimizer, steps=8, fail_at=FAIL_AT, *, input_name: str = "x",
          after_step: Callable[[int], None] | None = None):
    """Healthy steps, a NaN in the batch (as `input_name`) at `fail_at`, `after_step(step)` after each finite step;
    returns the NonFiniteError raised (None if none was)."""
    torch.manual_seed(0)
    for step in range(steps):
        x = torch.randn(16, 4)
        if step == fail_at:
            x[0, 1] = float("nan")
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        try:
            monitor.check(batch={input_name: x}, loss=loss)
        except NonFiniteError as exc:
            return exc
        optimizer.step()
        if after_step is not None:
            after_step(step)
    return None
