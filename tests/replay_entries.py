"""Replay entries with planted faults for the replay, ablation, triage and export tests, and `train`, which runs one
of them under a real Monitor until the fault is caught and returns the bundle's path.

Each entry takes a config dict and returns a nanscan.entry.ReplaySpec. Batches are generated from the step number,
so training and replay see the same data; the fault sits in the batch of `fault_step` (or, for the transient
fault, in one forward call counted across the whole process).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanscan.entry import ReplaySpec, build_spec
from nanscan.monitor import Monitor, NonFiniteError

MODULE = Path(__file__).stem  # importable as a top-level module: pytest puts tests/ on sys.path
BATCH_SIZE = 16
POISON_ROW = 11
MASKED_ROW = 6
ZERO_ROW = 3


def _config(config: dict, **defaults) -> dict:
    return {"seed": 0, "fault_step": 3, "batch_size": BATCH_SIZE, "lr": 0.05, **defaults, **config}


def _generator(config: dict, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(config["seed"] * 100_003 + step)


def _healthy(make_batch, config: dict, count: int = 3) -> list:
    """Held-out batches: the steps after the fault's, generated without it."""
    clean = {**config, "fault_step": -1}
    return [make_batch(clean, config["fault_step"] + 1 + i) for i in range(count)]


def _sgd(config: dict):
    return lambda model: torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)


# -- a fully masked attention row: NaN made by the softmax in the forward pass ---------------------------------

class MaskedAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))  # padding keys are never attended to
        return self.out(self.softmax(scores) @ self.v(x))


class AttentionModel(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.attn = MaskedAttention(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x, mask):
        return self.head(self.attn(self.embed(x), mask))


def attention_batch(config: dict, step: int) -> dict:
    g = _generator(config, step)
    b, t, d = config["batch_size"], 5, 8
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True  # every sample keeps at least its first token ...
    if step == config["fault_step"]:
        mask[MASKED_ROW] = False  # ... except one that arrives with nothing but padding
    return {"x": torch.randn(b, t, d, generator=g), "mask": mask, "y": torch.randn(b, t, d, generator=g)}


def attention_step(model, batch):
    return F.mse_loss(model(batch["x"], batch["mask"]), batch["y"])


def masked_attention(config: dict) -> ReplaySpec:
    config = _config(config)
    torch.manual_seed(config["seed"])
    return ReplaySpec(AttentionModel(), _sgd(config), attention_step, _healthy(attention_batch, config))


# -- sqrt at 0: finite forward, NaN only in the backward pass --------------------------------------------------

class Magnitude(nn.Module):
    """|h| written as sqrt(h*h): the value is right, the gradient at h = 0 is inf * 0 = NaN."""

    def forward(self, h):
        return torch.sqrt(h * h)


class SqrtModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 8, bias=False)
        self.mag = Magnitude()
        self.lin2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.lin2(self.mag(self.lin1(x)))


def sqrt_batch(config: dict, step: int) -> dict:
    g = _generator(config, step)
    x = torch.randn(config["batch_size"], 4, generator=g)
    if step == config["fault_step"]:
        x[ZERO_ROW] = 0.0  # an all-zero feature row: the first layer's output is exactly 0 there
    return {"x": x, "y": torch.randn(config["batch_size"], 1, generator=g)}


def sqrt_step(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def sqrt_backward(config: dict) -> ReplaySpec:
    config = _config(config)
    torch.manual_seed(config["seed"])
    return ReplaySpec(SqrtModel(), _sgd(config), sqrt_step, _healthy(sqrt_batch, config))


# -- float16 overflow in a matmul ------------------------------------------------------------------------------

class HalfModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)))


def half_batch(config: dict, step: int) -> dict:
    g = _generator(config, step)
    x = torch.randn(config["batch_size"], 16, generator=g)
    if step == config["fault_step"]:
        x = x * 8000.0  # a batch in the wrong units: every sample is 8000x too large for float16
    return {"x": x.to(torch.float16), "y": torch.randn(config["batch_size"], 1, generator=g)}


def half_step(model, batch):
    out = model(batch["x"])
    return F.mse_loss(out.float(), batch["y"])


def fp16_overflow(config: dict) -> ReplaySpec:
    config = _config(config, lr=0.01)
    torch.manual_seed(config["seed"])
    model = HalfModel()
    with torch.no_grad():
        model.proj.weight.mul_(8.0)  # large-ish weights, as after some training
    return ReplaySpec(model.half(), _sgd(config), half_step, _healthy(half_batch, config))


# -- a transient fault: one NaN injected once per process, at a planted forward call ----------------------------

FLAKY = {"calls": 0, "fail_at": None}


def arm_transient(fail_at: int) -> None:
    FLAKY.update(calls=0, fail_at=fail_at)


class Flaky(nn.Module):
    """Stands in for a bit flip: the output of one forward call, counted across the process, gets a NaN."""

    def forward(self, x):
        FLAKY["calls"] += 1
        if FLAKY["calls"] - 1 == FLAKY["fail_at"]:
            x = x.clone()
            x.view(-1)[0] = float("nan")
        return x


def transient(config: dict) -> ReplaySpec:
    config = _config(config)
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(4, 8), Flaky(), nn.Tanh(), nn.Linear(8, 1))
    return ReplaySpec(model, _sgd(config), sqrt_step, _healthy(sqrt_batch, {**config, "fault_step": -1}))


# -- one poisoned sample in a batch of 16 ----------------------------------------------------------------------

def poison_batch(config: dict, step: int) -> dict:
    g = _generator(config, step)
    x = torch.randn(config["batch_size"], 8, generator=g)
    if step == config["fault_step"]:
        # by default finite, so it passes an input check, but its square does not fit float32
        x[POISON_ROW, 2] = float(config.get("poison", 1e22))
    return {"x": x, "y": torch.randn(config["batch_size"], 1, generator=g)}


def poisoned_sample(config: dict) -> ReplaySpec:
    """config["clamp"]: the fix, clamping the features before the model (the exported regression test passes)."""
    config = _config(config)
    torch.manual_seed(config["seed"])

    def step(model, batch):
        x = batch["x"].clamp(-100.0, 100.0) if config.get("clamp") else batch["x"]
        return ((model(x) - batch["y"]) ** 2).mean()

    return ReplaySpec(nn.Sequential(nn.Linear(8, 1)), _sgd(config), step, _healthy(poison_batch, config))


BATCHES = {"masked_attention": attention_batch, "sqrt_backward": sqrt_batch, "fp16_overflow": half_batch,
           "transient": sqrt_batch, "poisoned_sample": poison_batch}


def sample_ids(step: int, size: int) -> list[str]:
    return [f"s{step:03d}-{row:02d}" for row in range(size)]


def train(name: str, bundle_dir: Path, *, config: dict | None = None, steps: int = 8, snapshot: str = "cpu",
          run_id: str | None = None, entry: bool = True) -> Path:
    """Train entry `name` under a Monitor (check after backward, before the update) until it raises; return the
    bundle's path. Fails the test if nothing went non-finite."""
    config = dict(config or {})
    spec = build_spec(f"{MODULE}:{name}", config)
    full = _config(config)
    optimizer = spec.make_optimizer()
    make_batch = BATCHES[name]
    monitor = Monitor(spec.model, optimizer, bundle_dir=bundle_dir, config=config, run_id=run_id or name,
                      replay_entry=f"{MODULE}:{name}" if entry else None, snapshot=snapshot)
    with monitor:
        for step in range(steps):
            batch = make_batch(full, step)
            optimizer.zero_grad(set_to_none=True)
            loss = spec.step_fn(spec.model, batch)
            loss.backward()
            try:
                monitor.check(batch=batch, loss=loss, sample_ids=sample_ids(step, full["batch_size"]), step=step)
            except NonFiniteError as exc:
                assert exc.bundle_path is not None, "the Monitor could not write its bundle"
                return Path(exc.bundle_path)
            optimizer.step()
    raise AssertionError(f"entry {name} trained {steps} steps without a non-finite value")
