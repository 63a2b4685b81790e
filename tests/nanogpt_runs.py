"""A small GPT trained the way karpathy's nanoGPT `train.py` trains one: the learning rate set by hand each
iteration (linear warm-up, then cosine decay), gradient accumulation with each micro-batch's loss divided by the
accumulation count, bf16 autocast on the CPU (or float32), dropout, AdamW with decay and no-decay groups, gradient
clipping at 1.0 after the check. The model, the data and the replay entry are small and seeded, so a run repeats
exactly.

`train(config, bundle_dir, ...)` runs the loop under a Monitor and returns what happened: the first non-finite step
(and its bundle) and every SpikeWarning with its step. `nanogpt(config)` is its replay entry. DIVERGING is a
learning rate too large for its warm-up (30, with a 10-step warm-up: under AdamW's decoupled weight decay,
lr x weight_decay > 2 makes every step multiply the weights by more than 1 in magnitude, and the run goes non-finite
at step 29 in bf16 and 28 in float32, before the spike statistic's 32-step warm-up, as nanoGPT with
learning_rate=15 does at iteration 21); HEALTHY_CONFIGS are runs that stay healthy (float32, bf16 autocast,
dropout 0.1, peak learning rates up to 1e-2 with warm-up).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanscan.entry import ReplaySpec, replay_entry
from nanscan.incident import NonFiniteError, SpikeWarning
from nanscan.runtime.monitor import Monitor
from nanscan.runtime.rollback import RollbackWarning

MODULE = Path(__file__).stem
ENTRY = f"{MODULE}:nanogpt"

BASE = {"seed": 1337, "vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0,
        "batch_size": 4, "accum": 2, "learning_rate": 6e-4, "min_lr": 6e-5, "warmup_iters": 10,
        "lr_decay_iters": 200, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
        "dtype": "bfloat16"}
# A learning rate too large for its warm-up: finite for the warm-up's first steps, then the weights' growth
# overflows the forward (the cause lives in every step's update, not in any one batch).
DIVERGING = {**BASE, "learning_rate": 30.0}
HEALTHY_CONFIGS = {
    "float32": {**BASE, "dtype": "float32"},
    "bf16": BASE,
    "bf16-dropout": {**BASE, "dropout": 0.1},
    "float32-lr1e-2": {**BASE, "dtype": "float32", "learning_rate": 1e-2, "min_lr": 1e-3},
    "bf16-dropout-lr1e-2": {**BASE, "dropout": 0.1, "learning_rate": 1e-2, "min_lr": 1e-3},
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.n_head = c["n_head"]
        self.c_attn = nn.Linear(c["n_embd"], 3 * c["n_embd"])
        self.c_proj = nn.Linear(c["n_embd"], c["n_embd"])
        self.resid_dropout = nn.Dropout(c["dropout"])
        self.dropout = c["dropout"]

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d)))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"])
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"])
        self.dropout = nn.Dropout(c["dropout"])

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"])
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c["n_embd"])
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c["vocab_size"], c["n_embd"]), wpe=nn.Embedding(c["block_size"], c["n_embd"]),
            drop=nn.Dropout(c["dropout"]), h=nn.ModuleList(Block(c) for _ in range(c["n_layer"])),
            ln_f=nn.LayerNorm(c["n_embd"])))
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * c["n_layer"]))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t)))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                                           ignore_index=-1)
        return logits, loss


def full_config(config: dict) -> dict:
    return {**BASE, **config}


def build_model(c: dict) -> GPT:
    torch.manual_seed(c["seed"])
    return GPT(c)


def configure_optimizer(model: nn.Module, c: dict) -> torch.optim.Optimizer:
    """nanoGPT's groups: 2-D weights decay, biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": c["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]))


def get_lr(it: int, c: dict) -> float:
    """nanoGPT's schedule: linear warm-up, cosine decay to min_lr, then min_lr."""
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it > c["lr_decay_iters"]:
        return c["min_lr"]
    ratio = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


def _stream(c: dict) -> torch.Tensor:
    """The "dataset": a token stream from a seeded Markov chain (each token favours a few successors)."""
    g = torch.Generator().manual_seed(c["seed"])
    table = torch.softmax(3.0 * torch.randn(c["vocab_size"], c["vocab_size"], generator=g), dim=1)
    tokens = [0]
    for _ in range(4095):
        tokens.append(int(torch.multinomial(table[tokens[-1]], 1, generator=g)))
    return torch.tensor(tokens, dtype=torch.int64)


_STREAMS: dict[tuple, torch.Tensor] = {}


def get_batch(c: dict, it: int, micro: int) -> dict:
    """Micro-batch `micro` of iteration `it`: random windows of the stream, from a generator keyed on both (the
    data does not depend on the run's global RNG, which dropout draws from)."""
    key = (c["seed"], c["vocab_size"])
    data = _STREAMS.get(key)
    if data is None:
        data = _STREAMS[key] = _stream(c)
    g = torch.Generator().manual_seed(c["seed"] * 1_000_003 + it * 1009 + micro)
    ix = torch.randint(len(data) - c["block_size"] - 1, (c["batch_size"],), generator=g)
    x = torch.stack([data[i:i + c["block_size"]] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + 1 + c["block_size"]] for i in ix.tolist()])
    return {"x": x, "y": y}


def step_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"], batch["y"])[1]


@replay_entry
def nanogpt(config: dict) -> ReplaySpec:
    """The replay entry: the model, the optimizer, one micro-batch's loss (undivided: nanscan averages a step's
    micro-batches as the loop does), held-out batches the run never saw, and the loop's own clipping."""
    c = full_config(config)
    model = build_model(c)
    held_out = [get_batch(c, 100_000 + i, 0) for i in range(32)]
    return ReplaySpec(model, lambda m: configure_optimizer(m, c), step_fn, held_out, clip_grad_norm=c["grad_clip"])


@dataclass
class NanoRun:
    """What a run did: its first non-finite step and bundle (None when it stayed finite), its SpikeWarnings by
    step, and the steps it ran."""

    nonfinite_step: int | None = None
    bundle: Path | None = None
    error: NonFiniteError | None = None
    warnings: list[tuple[int, str]] = field(default_factory=list)
    rollbacks_said: list[str] = field(default_factory=list)  # every RollbackWarning's message
    steps: int = 0

    @property
    def first_warning(self) -> int | None:
        return self.warnings[0][0] if self.warnings else None


def train(config: dict, bundle_dir: Path | None, *, iters: int = 120, micro_checks: bool = True,
          **monitor_options) -> NanoRun:
    """nanoGPT's loop under a Monitor: with `micro_checks`, a check after every micro-batch's backward
    (micro_batch=True for all but the last); else one check per iteration after the last micro-batch's."""
    c = full_config(config)
    model = build_model(c)
    optimizer = configure_optimizer(model, c)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=c["dtype"] == "bfloat16")
    options = {"bundle_dir": bundle_dir, "run_id": "nanogpt", "config": config, "replay_entry": ENTRY,
               **monitor_options}
    run = NanoRun()
    mon = Monitor(model, optimizer, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpikeWarning)
        warnings.simplefilter("always", RollbackWarning)
        try:
            for it in range(iters):
                lr = get_lr(it, c)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                for micro in range(c["accum"]):
                    batch = get_batch(c, it, micro)
                    with autocast:
                        _, loss = model(batch["x"], batch["y"])
                        loss = loss / c["accum"]
                    loss.backward()
                    last = micro == c["accum"] - 1
                    if micro_checks or last:
                        seen = len(caught)
                        mon.check(batch=batch, loss=loss, micro_batch=not last)
                        run.warnings += [(it, str(w.message)) for w in caught[seen:]
                                         if issubclass(w.category, SpikeWarning)]
                        run.rollbacks_said += [str(w.message) for w in caught[seen:]
                                               if issubclass(w.category, RollbackWarning)]
                torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                run.steps = it + 1
        except NonFiniteError as exc:
            run.nonfinite_step, run.error = exc.step, exc
            run.bundle = Path(exc.bundle_path) if exc.bundle_path else None
    return run
