"""A character-level ReLU RNN trained without gradient clipping: its recurrent weights start at an orthogonal gain of
1.3 and momentum SGD runs at a rate of 3, so the gradients through 64 time steps explode and the loss goes
non-finite (at about iteration 77, through a loss of 4.7e7); the same loop clipping the gradient norm at 1.0 trains
(issue 59: clipping is the fix, a tiny learning rate only leaves diverged weights finite). The loop is written as
such scripts are: the batch drawn with torch's global generator, check() before the update, no replay entry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from nanscan.incident import NonFiniteError
from nanscan.runtime.monitor import Monitor

import karpathy_train as K

CONFIG = {"seed": 0, "vocab_size": 64, "hidden": 64, "seq_len": 64, "batch_size": 8, "gain": 1.3, "lr": 2.5,
          "momentum": 0.9, "clip": None, "iters": 120, "dtype": "float32"}


class CharRNN(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.emb = nn.Embedding(c["vocab_size"], c["hidden"])
        self.rnn = nn.RNN(c["hidden"], c["hidden"], nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(c["hidden"], c["vocab_size"])
        with torch.no_grad():
            nn.init.orthogonal_(self.rnn.weight_hh_l0, gain=c["gain"])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def forward_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"], batch["y"])


@dataclass
class RnnRun:
    nonfinite_step: int | None = None
    error: NonFiniteError | None = None
    losses: list[float] = field(default_factory=list)
    monitor: Monitor | None = None


def train(overrides: dict, bundle_dir: Path | None, *, monitor: bool = True, **monitor_options) -> RnnRun:
    c = {**CONFIG, **overrides}
    torch.manual_seed(c["seed"])
    data = K.token_stream(K.full_config({"seed": 1337, "vocab_size": c["vocab_size"]}), "train")
    model = CharRNN(c)
    optimizer = torch.optim.SGD(model.parameters(), lr=c["lr"], momentum=c["momentum"])
    mon = Monitor(model, optimizer, bundle_dir=bundle_dir, run_id="rnn", config=c, **monitor_options) \
        if monitor else None
    run = RnnRun(monitor=mon)
    T = c["seq_len"]
    try:
        for it in range(c["iters"]):
            ix = torch.randint(len(data) - T - 1, (c["batch_size"],))
            batch = {"x": torch.stack([data[i:i + T] for i in ix]), "y": torch.stack([data[i + 1:i + T + 1] for i in ix])}
            with torch.autocast("cpu", dtype=getattr(torch, c["dtype"]), enabled=c["dtype"] != "float32"):
                loss = model(batch["x"], batch["y"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if mon is not None:
                mon.check(batch=batch, loss=loss)
            if c["clip"] is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip"])
            optimizer.step()
            run.losses.append(loss.item())
            if mon is None and not math.isfinite(run.losses[-1]):
                run.nonfinite_step = it
                break
    except NonFiniteError as exc:
        run.nonfinite_step, run.error = exc.step, exc
    return run
