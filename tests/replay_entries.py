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

from nanscan.entry import ReplaySpec, build_spec, replay_entry
from nanscan.runtime.monitor import Monitor, NonFiniteError

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


@replay_entry
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


@replay_entry
def sqrt_backward(config: dict) -> ReplaySpec:
    config = _config(config)
    torch.manual_seed(config["seed"])
    return ReplaySpec(SqrtModel(), _sgd(config), sqrt_step, _healthy(sqrt_batch, config))


# -- a frozen base under a trainable model: its weights held by digest in the bundle ---------------------------

class FrozenBase(nn.Module):
    """A frozen linear base (its weights from `base_seed`, as a fine-tuning run loads a pretrained base) under a
    trainable SqrtModel; without a bias, an all-zero row stays zero through it, so sqrt_batch's fault still fires."""

    def __init__(self, base_seed: int):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(base_seed)
            self.base = nn.Linear(4, 4, bias=False)
        self.base.requires_grad_(False)
        self.top = SqrtModel()

    def forward(self, x):
        return self.top(self.base(x))


@replay_entry
def frozen_base(config: dict) -> ReplaySpec:
    config = _config(config, base_seed=7)
    torch.manual_seed(config["seed"])
    model = FrozenBase(config["base_seed"])
    return ReplaySpec(model, lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad],
                                                       lr=config["lr"], momentum=0.9),
                      sqrt_step, _healthy(sqrt_batch, config))


@replay_entry
def frozen_base_elsewhere(config: dict) -> ReplaySpec:
    """frozen_base whose base comes from another seed: another checkpoint than the run's."""
    return frozen_base({**config, "base_seed": config.get("base_seed", 7) + 1})


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


@replay_entry
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


@replay_entry
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


@replay_entry
def poisoned_sample(config: dict) -> ReplaySpec:
    """config["clamp"]: the fix, clamping the features before the model (the exported regression test passes)."""
    config = _config(config)
    torch.manual_seed(config["seed"])

    def step(model, batch):
        x = batch["x"].clamp(-100.0, 100.0) if config.get("clamp") else batch["x"]
        return ((model(x) - batch["y"]) ** 2).mean()

    return ReplaySpec(nn.Sequential(nn.Linear(8, 1)), _sgd(config), step, _healthy(poison_batch, config))


# -- sqrt at 0 written inline in the model's own forward: no submodule makes the NaN --------------------------

class InlineSqrtModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 8, bias=False)
        self.lin2 = nn.Linear(8, 1)

    def forward(self, x):
        h = self.lin1(x)
        return self.lin2(torch.sqrt(h * h))


@replay_entry
def inline_sqrt(config: dict) -> ReplaySpec:
    config = _config(config)
    torch.manual_seed(config["seed"])
    return ReplaySpec(InlineSqrtModel(), _sgd(config), sqrt_step, _healthy(sqrt_batch, config))


# -- the poisoned sample, stepped in micro-batches of a fixed count: subsets of other sizes cannot run ------------

MICRO_BATCHES = 4


@replay_entry
def micro_batched(config: dict) -> ReplaySpec:
    spec = poisoned_sample(config)

    def step(model, batch):
        # gradient accumulation folded into one loss: the batch must split into MICRO_BATCHES equal parts
        x = batch["x"].view(MICRO_BATCHES, -1, batch["x"].shape[-1])
        y = batch["y"].view(MICRO_BATCHES, -1, 1)
        return sum(((model(xi) - yi) ** 2).mean() for xi, yi in zip(x, y)) / MICRO_BATCHES

    return ReplaySpec(spec.model, spec.optimizer, step, spec.batches)


# -- a fault of the whole batch: its float32 sum overflows only when every sample is in it ----------------------

# 16 of them sum to 2**128, past float32's largest value; fewer sum exactly (k < 16 fits the significand), so any
# smaller batch centres them to exactly 0
BATCH_SUM_VALUE = 2.0 ** 124


class BatchCenter(nn.Module):
    """Subtracts the batch mean, computed as a plain float32 sum: a batch statistic, like BatchNorm's."""

    def forward(self, x):
        return x - x.sum(0, keepdim=True) / x.shape[0]


def batch_sum_batch(config: dict, step: int) -> dict:
    g = _generator(config, step)
    x = torch.randn(config["batch_size"], 4, generator=g)
    if step == config["fault_step"]:
        x[:, 0] = BATCH_SUM_VALUE
    return {"x": x, "y": torch.randn(config["batch_size"], 1, generator=g)}


@replay_entry
def batch_statistics(config: dict) -> ReplaySpec:
    config = _config(config)
    torch.manual_seed(config["seed"])
    model = nn.Sequential(BatchCenter(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    return ReplaySpec(model, _sgd(config), sqrt_step, _healthy(batch_sum_batch, config))


# -- an optimizer without a learning rate ----------------------------------------------------------------------

class ScaledDescent(torch.optim.Optimizer):
    """p -= scale * grad: plain descent whose step size is not called "lr"."""

    def __init__(self, params, scale: float):
        super().__init__(params, {"scale": scale})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["scale"])


@replay_entry
def no_learning_rate(config: dict) -> ReplaySpec:
    spec = poisoned_sample(config)
    return ReplaySpec(spec.model, lambda model: ScaledDescent(model.parameters(), 0.05), spec.step_fn, spec.batches)


# -- entries that break the contract, each given to a poisoned_sample bundle with --entry -------------------------

@replay_entry
def loss_not_a_tensor(config: dict) -> ReplaySpec:
    spec = poisoned_sample(config)
    return ReplaySpec(spec.model, spec.optimizer, lambda model, batch: spec.step_fn(model, batch).detach().item())


@replay_entry
def no_model(config: dict) -> ReplaySpec:
    return ReplaySpec(None, None, None)


@replay_entry
def optimizer_factory_returns_a_name(config: dict) -> ReplaySpec:
    spec = poisoned_sample(config)
    return ReplaySpec(spec.model, lambda model: "sgd", spec.step_fn)


@replay_entry
def optimizer_factory_raises(config: dict) -> ReplaySpec:
    spec = poisoned_sample(config)
    return ReplaySpec(spec.model, lambda model: torch.optim.SGD(model.parameters(), lr=config["missing"]),
                      spec.step_fn)


NOT_A_FUNCTION = 42

DRAWS: list = []


@replay_entry
def rng_draws(config: dict) -> ReplaySpec:
    """poisoned_sample whose step records one draw of torch's, numpy's and Python's generators in DRAWS. The model
    is built under a forked RNG, so the entry leaves the process's generators as it found them."""
    import random  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    with torch.random.fork_rng():
        spec = poisoned_sample(config)

    def step(model, batch):
        DRAWS.append((torch.rand(()).item(), float(np.random.rand()), random.random()))
        return spec.step_fn(model, batch)

    return ReplaySpec(spec.model, spec.optimizer, step)


BATCHES = {"masked_attention": attention_batch, "sqrt_backward": sqrt_batch, "fp16_overflow": half_batch,
           "transient": sqrt_batch, "poisoned_sample": poison_batch, "inline_sqrt": sqrt_batch,
           "micro_batched": poison_batch, "batch_statistics": batch_sum_batch, "no_learning_rate": poison_batch,
           "frozen_base": sqrt_batch}


def sample_ids(step: int, size: int) -> list[str]:
    return [f"s{step:03d}-{row:02d}" for row in range(size)]


def train(name: str, bundle_dir: Path, *, config: dict | None = None, steps: int = 8, snapshot: str = "cpu",
          run_id: str | None = None, entry: bool = True, **monitor_options) -> Path:
    """Train entry `name` under a Monitor (check after backward, before the update; `monitor_options` given to it)
    until it raises; return the bundle's path. Fails the test if nothing went non-finite."""
    config = dict(config or {})
    spec = build_spec(f"{MODULE}:{name}", config)
    full = _config(config)
    optimizer = spec.make_optimizer()
    make_batch = BATCHES[name]
    monitor = Monitor(spec.model, optimizer, bundle_dir=bundle_dir, config=config, run_id=run_id or name,
                      replay_entry=f"{MODULE}:{name}" if entry else None, snapshot=snapshot, **monitor_options)
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


# -- a learning rate too large for its warm-up: the weights diverge over many steps ------------------------------

WARMUP_STEPS = 10


def warmup_lr(step: int, peak: float) -> float:
    """The loop's schedule, set by hand each step as nanoGPT does: linear warm-up to `peak`."""
    return peak * min(1.0, (step + 1) / WARMUP_STEPS)


def regression_batch(config: dict, step: int) -> dict:
    g = _generator(config, step)
    x = torch.randn(BATCH_SIZE, 8, generator=g)
    return {"x": x, "y": x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(BATCH_SIZE, 1, generator=g)}


@replay_entry
def warmup_regression(config: dict) -> ReplaySpec:
    """Linear regression by SGD; the loop's learning rate (warmup_lr) decides whether it diverges. Nothing in any
    one batch is wrong."""
    config = _config(config)
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    held_out = [regression_batch(config, 10_000 + i) for i in range(4)]  # steps the run never saw
    return ReplaySpec(model, lambda m: torch.optim.SGD(m.parameters(), lr=config["lr"]),
                      lambda m, b: F.mse_loss(m(b["x"]), b["y"]), held_out)


def unmarked_poisoned_sample(config: dict) -> ReplaySpec:
    """poisoned_sample without the @replay_entry mark: a bundle naming it replays only with --entry (NOTE: [trust
    rule] in nanscan/entry.py)."""
    return poisoned_sample(config)
