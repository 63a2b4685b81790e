"""Small CPU reproductions of twelve NaN failures users reported, as replay entries, and `train`, which runs one under
a real Monitor until it is caught and returns the bundle's path.

Each entry takes a config dict and returns a nanscan.entry.ReplaySpec; BATCHES[name](config, step) makes the batch
of a step (the fault sits in the batch of FAULT_STEP, or, for the divergences, grows step after step), so training
and replay see the same data. Each case's comment says what users saw and what makes the non-finite value.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanscan.entry import ReplaySpec, build_spec, replay_entry
from nanscan.runtime.monitor import Monitor, NonFiniteError

MODULE = Path(__file__).stem
FAULT_STEP = 2
BATCH = 8
BAD_ROW = 5
OTHER_BAD_ROW = 2
VOCAB = 11
IGNORE = -100


def _g(step: int, seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + step)


def _faulty(config: dict, step: int) -> bool:
    return step == config.get("fault_step", FAULT_STEP)


def _sgd(lr: float = 0.05):
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr)


def _spec(name: str, model: nn.Module, optimizer, step_fn) -> ReplaySpec:
    """A spec whose healthy batches are the steps after the fault's, made without it."""
    clean = {"fault_step": -1}
    return ReplaySpec(model, optimizer, step_fn, [BATCHES[name](clean, FAULT_STEP + 1 + i) for i in range(2)])


def _regression_step(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


# 1. a record with a NaN feature: the batch itself ------------------------------------------------------------

def nan_feature_batch(config: dict, step: int) -> dict:
    g = _g(step)
    x = torch.randn(BATCH, 6, generator=g)
    if _faulty(config, step):
        x[BAD_ROW, 3] = float("nan")
    return {"x": x, "y": torch.randn(BATCH, 1, generator=g)}


@replay_entry
def nan_feature(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    return _spec("nan_feature", model, _sgd(), _regression_step)


# 2. every label -100 after truncation: cross_entropy's mean over no token is 0/0 --------------------------------

class TokenTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def token_batch(config: dict, step: int) -> dict:
    g = _g(step)
    tokens = torch.randint(0, VOCAB, (BATCH, 6), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, 6), generator=g)
    labels[:, :3] = IGNORE  # the prompt is never a target
    if _faulty(config, step):
        labels[:] = IGNORE  # prompts longer than the window: truncation cut every answer away
    return {"tokens": tokens, "labels": labels}


def tagging_step(model, batch):
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.view(-1, VOCAB), batch["labels"].view(-1), ignore_index=IGNORE)


@replay_entry
def all_labels_ignored(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("all_labels_ignored", TokenTagger(), _sgd(), tagging_step)


# 3. a summed loss divided by a token count of 0 ------------------------------------------------------------------

def counted_batch(config: dict, step: int) -> dict:
    batch = token_batch(config, step)
    batch["mask"] = (batch["labels"] != IGNORE).float()
    batch["labels"] = batch["labels"].clamp(min=0)
    return batch


def counted_step(model, batch):
    logits = model(batch["tokens"])
    per_token = F.cross_entropy(logits.view(-1, VOCAB), batch["labels"].view(-1), reduction="none")
    mask = batch["mask"].view(-1)
    return (per_token * mask).sum() / mask.sum()  # the count of target tokens: 0 when every one is masked


@replay_entry
def zero_token_count(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("zero_token_count", TokenTagger(), _sgd(), counted_step)


# 4. masked_fill(-inf) + softmax on a fully masked row -------------------------------------------------------------

class MaskedAttention(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return weights @ self.v(x)


class Attender(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MaskedAttention()
        self.head = nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.head(self.attn(x, mask)).mean(1)


def attention_batch(config: dict, step: int) -> dict:
    g = _g(step)
    mask = torch.rand(BATCH, 5, generator=g) > 0.4
    mask[:, 0] = True
    if _faulty(config, step):
        mask[BAD_ROW] = False  # a sample that is all padding
    return {"x": torch.randn(BATCH, 5, 8, generator=g), "mask": mask, "y": torch.randn(BATCH, 1, generator=g)}


def attention_step(model, batch):
    return F.mse_loss(model(batch["x"], batch["mask"]), batch["y"])


@replay_entry
def fully_masked_row(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("fully_masked_row", Attender(), _sgd(), attention_step)


# 5. a minibatch-std layer over a last batch of one: torch.std of one sample is 0/0 ---------------------------------

class MinibatchStd(nn.Module):
    """StyleGAN's minibatch standard deviation: one more feature, the std of each feature over the batch."""

    def forward(self, x):
        std = torch.std(x, dim=0, keepdim=True).mean()
        return torch.cat([x, std.expand(x.shape[0], 1)], dim=1)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.mbstd = MinibatchStd()
        self.head = nn.Linear(7, 1)

    def forward(self, x):
        return self.head(self.mbstd(torch.tanh(self.body(x))))


GENERATED = 8  # generated images in each batch, beside the real ones


def gan_batch(config: dict, step: int) -> dict:
    g = _g(step)
    real = 1 if _faulty(config, step) else 4  # the dataset's last, partial batch holds one real image
    return {"real": torch.randn(real, 6, generator=g), "fake": torch.randn(GENERATED, 6, generator=g)}


def gan_step(model, batch):
    return F.softplus(-model(batch["real"])).mean() + F.softplus(model(batch["fake"])).mean()


@replay_entry
def minibatch_std_of_one(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("minibatch_std_of_one", Discriminator(), _sgd(), gan_step)


def gan_sample_ids(step: int, batch: dict) -> list[str]:
    return [f"real-{step}-{i}" for i in range(batch["real"].shape[0])]


# 6. -log(softmax) underflowing to 0, inside the model's own forward ------------------------------------------------

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x, y):
        probs = torch.softmax(self.head(torch.relu(self.body(x))), dim=-1)
        return -torch.log(probs.gather(1, y[:, None])).mean()  # log(0) = -inf once a probability underflows


def classify_batch(config: dict, step: int) -> dict:
    g = _g(step)
    x = torch.randn(BATCH, 6, generator=g)
    if _faulty(config, step):
        x[BAD_ROW] = x[BAD_ROW].abs() * 3000.0  # an unnormalized record: its logits are thousands apart
    return {"x": x, "y": torch.randint(0, 4, (BATCH,), generator=g)}


@replay_entry
def log_of_softmax(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("log_of_softmax", Classifier(), _sgd(), lambda model, batch: model(batch["x"], batch["y"]))


# 7. sqrt(sum(d**2)) at d = 0, in the step function: finite forward, NaN gradient ------------------------------------

def pair_batch(config: dict, step: int) -> dict:
    g = _g(step)
    a, b = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 6, generator=g)
    if _faulty(config, step):
        b[BAD_ROW] = a[BAD_ROW]  # a pair of identical records: their distance is exactly 0
    return {"a": a, "b": b}


def distance_step(model, batch):
    d = model(batch["a"]) - model(batch["b"])
    return torch.sqrt((d ** 2).sum(-1)).mean()


@replay_entry
def distance_at_zero(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("distance_at_zero", nn.Sequential(nn.Linear(6, 4)), _sgd(), distance_step)


# 8. NaN targets masked after MSELoss(reduction="none"): 0 * NaN is NaN ---------------------------------------------

def masked_target_batch(config: dict, step: int) -> dict:
    g = _g(step)
    y = torch.randn(BATCH, 1, generator=g)
    mask = torch.ones(BATCH, 1)
    if _faulty(config, step):
        for row in (OTHER_BAD_ROW, BAD_ROW):  # missing labels stored as NaN, "masked out" by multiplying by 0
            y[row], mask[row] = float("nan"), 0.0
    return {"x": torch.randn(BATCH, 6, generator=g), "y": y, "mask": mask}


def masked_mse_step(model, batch):
    per_element = nn.MSELoss(reduction="none")(model(batch["x"]), batch["y"])
    return (per_element * batch["mask"]).sum() / batch["mask"].sum()


@replay_entry
def masked_nan_targets(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("masked_nan_targets", nn.Sequential(nn.Linear(6, 1)), _sgd(), masked_mse_step)


# 9. model.half() with Adam eps=1e-8: eps is 0 in float16, so the first update divides by 0 --------------------------

def half_batch(config: dict, step: int) -> dict:
    g = _g(step)
    return {"x": (torch.randn(BATCH, 6, generator=g) * 0.01).half(), "y": torch.zeros(BATCH, 1).half()}


def half_step(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"].float())


@replay_entry
def half_adam(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)).half()
    return _spec("half_adam", model, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, eps=1e-8), half_step)


# 10. a T5 feed-forward overflowing float16 under a GradScaler --------------------------------------------------------

class T5FeedForward(nn.Module):
    def __init__(self, d: int = 8, ff: int = 32):
        super().__init__()
        self.wi = nn.Linear(d, ff, bias=False)
        self.wo = nn.Linear(ff, d, bias=False)

    def forward(self, h):
        return self.wo(torch.relu(self.wi(h)))  # T5's activations grow with depth: wo's sum passes 65504


class T5Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = T5FeedForward()
        self.head = nn.Linear(8, 1)

    def forward(self, h):
        return self.head(h + self.ff(h))


def t5_batch(config: dict, step: int) -> dict:
    g = _g(step)
    scale = 1000.0 if _faulty(config, step) else 1.0  # the residual stream's scale after many layers
    return {"h": torch.randn(BATCH, 8, generator=g).abs() * scale + scale, "y": torch.randn(BATCH, 1, generator=g)}


def t5_step(model, batch):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(batch["h"])
    return F.mse_loss(out.float(), batch["y"])


@replay_entry
def t5_fp16_overflow(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    model = T5Block()
    with torch.no_grad():
        model.ff.wi.weight.abs_().mul_(4.0)
        model.ff.wo.weight.abs_().mul_(4.0)
    return _spec("t5_fp16_overflow", model, _sgd(1e-6), t5_step)


# 11. mean pooling of an empty history: (sum over nothing) / 0 ---------------------------------------------------------

class MeanPool(nn.Module):
    def forward(self, items, mask):
        return (items * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.item = nn.Linear(6, 8)
        self.pool = MeanPool()
        self.head = nn.Linear(8, 1)

    def forward(self, history, mask):
        return self.head(self.pool(self.item(history), mask))


def history_batch(config: dict, step: int) -> dict:
    g = _g(step)
    mask = (torch.rand(BATCH, 4, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    if _faulty(config, step):
        mask[BAD_ROW] = 0.0  # a new user: no history yet
    return {"history": torch.randn(BATCH, 4, 6, generator=g), "mask": mask, "y": torch.randn(BATCH, 1, generator=g)}


@replay_entry
def empty_history(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("empty_history", Recommender(), _sgd(),
                 lambda model, batch: F.mse_loss(model(batch["history"], batch["mask"]), batch["y"]))


# 12. a learning rate meant for a 4x larger batch: the weights grow each step until the loss overflows ---------------

def regression_batch(config: dict, step: int) -> dict:
    g = _g(step)
    x = torch.randn(BATCH, 6, generator=g) * 3.0
    return {"x": x, "y": x.sum(1, keepdim=True)}


@replay_entry
def large_lr(config: dict) -> ReplaySpec:
    torch.manual_seed(0)
    return _spec("large_lr", nn.Sequential(nn.Linear(6, 1)), _sgd(lr=0.5), _regression_step)


BATCHES = {"nan_feature": nan_feature_batch, "all_labels_ignored": token_batch, "zero_token_count": counted_batch,
           "fully_masked_row": attention_batch, "minibatch_std_of_one": gan_batch, "log_of_softmax": classify_batch,
           "distance_at_zero": pair_batch, "masked_nan_targets": masked_target_batch, "half_adam": half_batch,
           "t5_fp16_overflow": t5_batch, "empty_history": history_batch, "large_lr": regression_batch}
SCALED = {"t5_fp16_overflow"}  # trained under a GradScaler


def sample_ids(name: str, step: int, batch: dict) -> list[str]:
    if name == "minibatch_std_of_one":
        return gan_sample_ids(step, batch)
    return [f"{name}-{step}-{row}" for row in range(BATCH)]


def train(name: str, bundle_dir: Path, *, steps: int = 60, **monitor_options) -> Path:
    """Train entry `name` under a Monitor (snapshot="cpu") until it raises; return the bundle's path."""
    spec = build_spec(f"{MODULE}:{name}", {})
    optimizer = spec.make_optimizer()
    scaler = torch.amp.GradScaler("cpu") if name in SCALED else None
    monitor = Monitor(spec.model, optimizer, bundle_dir=bundle_dir, run_id=name, replay_entry=f"{MODULE}:{name}",
                      snapshot="cpu", scaler=scaler, spikes=None, **monitor_options)
    with monitor:
        for step in range(steps):
            batch = BATCHES[name]({}, step)
            optimizer.zero_grad(set_to_none=True)
            loss = spec.step_fn(spec.model, batch)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(optimizer)
            try:
                monitor.check(batch=batch, loss=loss, sample_ids=sample_ids(name, step, batch), step=step)
            except NonFiniteError as exc:
                assert exc.bundle_path is not None, "the Monitor could not write its bundle"
                return Path(exc.bundle_path)
            try:  # the post-update check raises from inside optimizer.step(), at the update that went bad
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
            except NonFiniteError as exc:
                assert exc.bundle_path is not None, "the Monitor could not write its bundle"
                return Path(exc.bundle_path)
    raise AssertionError(f"entry {name} trained {steps} steps without a non-finite value")


@replay_entry
def fully_masked_row_broken_select(config: dict) -> ReplaySpec:
    """fully_masked_row with a select_samples that raises: bisection fails, the other phases must stand."""
    spec = fully_masked_row(config)

    def select(batch, rows):
        raise ValueError(f"rows {rows} cannot be selected here")

    return ReplaySpec(spec.model, spec.optimizer, spec.step_fn, spec.batches, select_samples=select)
