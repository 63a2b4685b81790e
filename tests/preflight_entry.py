"""A tiny replay entry for the preflight tests: a small MLP over variable-length sequences (mean-pooled), with
config switches that break it in the ways a preflight must notice."""

from __future__ import annotations

import torch
from torch import nn

from nanscan.entry import ReplaySpec


class MeanPoolMLP(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).mean(dim=1)


def make_batches(count: int = 6, *, nan_batch: int | None = None) -> list[dict]:
    """Batches of shape (4, T, 8): batch 2 has the longest sequences, batch 4 the largest values."""
    batches = []
    for i in range(count):
        length = 12 if i == 2 else 5
        scale = 40.0 if i == 4 else 1.0
        x = torch.randn(4, length, 8) * scale
        if i == nan_batch:
            x[1, 0, 3] = float("nan")
        batches.append({"x": x, "y": torch.randn(4, 1)})
    return batches


def mse_step(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def replay_entry(config: dict) -> ReplaySpec:
    """Config: lr (0.01), optimizer ("adam" factory or "sgd" instance), explode (huge lr so weights overflow),
    nan_batch (index of a batch with a NaN input), crash_at (step_fn raises on that call), mask_inputs (step_fn
    replaces NaN inputs, so only a parameter canary can be seen), no_batches, int_inputs (token ids only)."""
    model = MeanPoolMLP()
    lr = 1e30 if config.get("explode") else config.get("lr", 0.01)
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        if config.get("crash_at") is not None and calls["n"] == config["crash_at"]:
            raise RuntimeError("simulated crash in step_fn")
        x = batch["x"]
        if config.get("mask_inputs"):
            x = torch.nan_to_num(x)
        if config.get("int_inputs"):
            x = model.embed(x)
        return ((model(x) - batch["y"].float()) ** 2).mean()

    if config.get("int_inputs"):
        model.embed = nn.Embedding(50, 8)
        batches = [{"x": torch.randint(0, 50, (4, 6)), "y": torch.randint(0, 2, (4, 1))} for _ in range(4)]
    else:
        batches = make_batches(nan_batch=config.get("nan_batch"))
    if config.get("optimizer") == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        def optimizer(m):
            return torch.optim.Adam(m.parameters(), lr=lr)
    return ReplaySpec(model=model, optimizer=optimizer, step_fn=step,
                      batches=None if config.get("no_batches") else batches)


def not_a_spec(config: dict):
    return {"model": None}


def raising_entry(config: dict) -> ReplaySpec:
    raise ValueError("the checkpoint path is wrong")
