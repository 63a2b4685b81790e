"""The spike detector's measured suite: tiny CPU training runs, healthy ones that must raise no SpikeWarning and
diverging ones that must be warned about at least LEAD steps before their first non-finite step (issue 17).

Each run is a Trainer: `forward_backward(step)` returns (batch, loss) after backward, `update(step)` applies the
step. `drive` runs one under a Monitor and returns when the first warning and the first non-finite step came.
Every run is seeded, so its numbers (and the table in tests/test_spikes.py) repeat exactly.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanscan import demo as D
from nanscan.incident import NonFiniteError, SpikeWarning
from nanscan.runtime.monitor import Monitor

LEAD = 5  # a diverging run must be warned about at least this many steps before its first non-finite step
HEALTHY_STEPS = 320


class Trainer:
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def forward_backward(self, step: int) -> tuple[dict, torch.Tensor]:
        raise NotImplementedError

    def update(self, step: int) -> None:
        self.optimizer.step()


# -- healthy runs ------------------------------------------------------------------------------------------------

class NoisyRegression(Trainer):
    """An MLP regressing a smooth target under heavy label noise, small batches, Adam: batch-to-batch gradient norms
    vary by a factor of several."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.w = torch.randn(8, 1, generator=self.gen)

    def forward_backward(self, step):
        x = torch.randn(8, 8, generator=self.gen)
        y = torch.sin(x @ self.w) + 0.5 * torch.randn(8, 1, generator=self.gen)
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return {"x": x, "y": y}, loss


def small_lm_config(**changes) -> dict:
    config = dict(D.DEFAULT_CONFIG, vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=1, batch_size=8,
                  num_records=512, steps=HEALTHY_STEPS, warmup_steps=20, lr=3e-3)
    config.update(changes)
    return config


class LMRun(Trainer):
    """The demo's causal LM (nanscan.demo.TinyLM) on its Markov-chain records, AdamW, `lr_at(step)` each step,
    gradient clipping as the demo does (clip=None: none). Records cycle in epochs of num_records/batch_size steps."""

    def __init__(self, config: dict, lr_at: Callable[[int], float], clip: float | None = 1.0):
        self.config = config
        self.lr_at = lr_at
        self.clip = clip
        records = D.make_records(config)
        self.tokens = torch.tensor([r["tokens"] for r in records], dtype=torch.int64)
        self.weights = torch.tensor([r["weights"] for r in records], dtype=torch.float32)
        self.order = D.epoch_order(len(records), config["seed"])
        self.model = D.build_model(config)
        self.optimizer = D.build_optimizer(self.model, config)

    def batch(self, step: int) -> dict:
        size = self.config["batch_size"]
        per_epoch = len(self.order) // size
        rows = torch.tensor(self.order[(step % per_epoch) * size:(step % per_epoch + 1) * size])
        return {"tokens": self.tokens[rows], "weights": self.weights[rows]}

    def forward_backward(self, step):
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        batch = self.batch(step)
        self.optimizer.zero_grad(set_to_none=True)
        loss = D.step_fn(self.model, batch)
        loss.backward()
        return batch, loss

    def update(self, step):
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()


def tiny_lm_cosine() -> LMRun:
    """A tiny LM, warm-up then cosine decay over the whole run."""
    config = small_lm_config()
    return LMRun(config, lambda step: D.lr_at(step, config))


class EpochBump(Trainer):
    """A classifier over a fixed set of 256 examples, epochs of 32 steps, the data reshuffled and the learning rate
    restarted at every epoch (SGDR-style warm restarts): the loss rises for a few steps at each new epoch."""

    EPOCH = 32

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed + 7)
        self.x = torch.randn(256, 16, generator=gen)
        self.y = (self.x[:, :4].sum(1) > 0).long() + (self.x[:, 4:8].sum(1) > 0).long()
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.2, momentum=0.9)
        self.gen = gen

    def forward_backward(self, step):
        if step % self.EPOCH == 0:
            self.perm = torch.randperm(256, generator=self.gen)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.2 * 0.5 * (1 + math.cos(math.pi * (step % self.EPOCH) / self.EPOCH))
        rows = self.perm[(step % self.EPOCH) * 8:(step % self.EPOCH + 1) * 8]
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.x[rows]), self.y[rows])
        loss.backward()
        return {"x": self.x[rows]}, loss


def demo_before_fault() -> LMRun:
    """The demo's own model, data and schedule (nanscan.demo.DEFAULT_CONFIG), without its corrupted record, run
    for HEALTHY_STEPS steps (enough records for one epoch of them)."""
    config = dict(D.DEFAULT_CONFIG, steps=HEALTHY_STEPS, num_records=D.DEFAULT_CONFIG["batch_size"] * HEALTHY_STEPS)
    return LMRun(config, lambda step: D.lr_at(step, config), clip=config["grad_clip"])


# -- diverging runs ----------------------------------------------------------------------------------------------

def endless_warmup() -> LMRun:
    """The tiny LM with a learning-rate warm-up that never ends (the schedule's cap forgotten) and no clipping."""
    config = small_lm_config()
    return LMRun(config, lambda step: 1e-3 * 1.05 ** step, clip=None)


class OutlierRecord(Trainer):
    """Regression with plain SGD in which one record arrives with its features a thousand times too large (a unit
    mix-up in the export): the step's gradient is huge but finite, the update throws the weights far out, and the
    run diverges to inf over the following steps."""

    OUTLIER_STEP = 120

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.gen = torch.Generator().manual_seed(seed + 3)
        self.w = torch.randn(8, 1, generator=self.gen)

    def forward_backward(self, step):
        x = torch.randn(16, 8, generator=self.gen)
        y = x @ self.w
        if step == self.OUTLIER_STEP:
            x[3] *= 30.0
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return {"x": x, "y": y}, loss


class AttentionLogitGrowth(Trainer):
    """A one-layer attention model whose attention-logit scale grows a little every step (a temperature that
    drifts, as attention logits do when query and key norms grow): softmax saturates, the loss and the attention
    projections' gradients climb, and the logits finally overflow float32 to inf (inf - inf in softmax is NaN)."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        d = 16
        self.model = nn.ModuleDict({"emb": nn.Embedding(32, d), "qk": nn.Linear(d, 2 * d, bias=False),
                                    "v": nn.Linear(d, d, bias=False), "head": nn.Linear(d, 32)})
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(seed + 5)

    def forward_backward(self, step):
        m = self.model
        tokens = torch.randint(0, 32, (8, 12), generator=self.gen)
        h = m["emb"](tokens)
        q, k = m["qk"](h).chunk(2, dim=-1)
        scale = 1.25 ** step
        attn = torch.softmax((q @ k.transpose(1, 2)) * scale, dim=-1)
        logits = m["head"](attn @ m["v"](h))
        target = tokens.roll(1, dims=1)
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        return {"tokens": tokens}, loss


@dataclass(frozen=True)
class Run:
    name: str
    healthy: bool
    steps: int  # healthy: how many; diverging: at most (it goes non-finite before)
    build: Callable[[], Trainer]


RUNS = (
    Run("noisy regression", True, HEALTHY_STEPS, NoisyRegression),
    Run("tiny LM, cosine decay", True, HEALTHY_STEPS, tiny_lm_cosine),
    Run("loss bump at each new epoch", True, HEALTHY_STEPS, EpochBump),
    Run("demo before its fault", True, HEALTHY_STEPS, demo_before_fault),
    Run("LR warm-up without end", False, 600, endless_warmup),
    Run("outlier record of huge magnitude", False, 600, OutlierRecord),
    Run("growing attention-logit scale", False, 600, AttentionLogitGrowth),
)


@dataclass
class Outcome:
    name: str
    healthy: bool
    steps: int  # checked steps
    warnings: list[int]  # steps named by SpikeWarnings
    spikes: list  # Monitor.spikes
    first_nonfinite: int | None

    @property
    def first_warning(self) -> int | None:
        return self.warnings[0] if self.warnings else None


def drive(run: Run, bundle_dir: Path, **monitor_kwargs) -> Outcome:
    """Train `run` under a Monitor (on_invalid="raise", spikes="warn" unless given) until its first non-finite step
    or its last step, on one torch thread."""
    with D.torch_threads(1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run.build()
        monitor = Monitor(trainer.model, trainer.optimizer, bundle_dir=bundle_dir, run_id=run.name.replace(" ", "-")
                          .replace(",", ""), on_invalid="raise", **{"spikes": "warn", **monitor_kwargs})
        nonfinite, steps = None, 0
        try:
            with monitor:
                for step in range(run.steps):
                    batch, loss = trainer.forward_backward(step)
                    monitor.check(batch=batch, loss=loss, step=step)
                    steps += 1
                    trainer.update(step)
        except NonFiniteError as exc:
            nonfinite = exc.step
    spike_steps = [w.message.step for w in caught if issubclass(w.category, SpikeWarning)]
    return Outcome(run.name, run.healthy, steps, spike_steps, list(monitor.spikes), nonfinite)
