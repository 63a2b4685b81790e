"""karpathy's nanoGPT `train.py`, statement for statement as it trains on one process (its public design), with
nanscan added the way docs/monitor.md tells a user to: `observe()` after each earlier micro-batch's backward, `check()`
after the last, each given the micro-batch its forward consumed (taken before the prefetch overwrites X, Y).

What makes it train.py and not a tidied copy: the batches are drawn with torch's global generator
(`torch.randint`, as its get_batch does over a memmap), `estimate_loss()` runs eval forwards at iteration 0 (on
the global generator too, under model.eval() and no_grad), the next micro-batch is fetched right after the forward
and before backward, each micro-batch's loss is divided by the accumulation count, a GradScaler (disabled unless
float16) unscales before `clip_grad_norm_(1.0)` and steps, wte and lm_head share one weight, and
`configure_optimizers` makes two AdamW groups (2-D weights decay, the rest does not). The model is tiny and the
"dataset" a seeded token stream, so a run repeats exactly.

`train(overrides, bundle_dir, ...)` returns what happened (the failing iteration, the bundle, the warnings, the
losses, and an independent isfinite truth); `LR30` is learning rate 30 with a 10-step warm-up in float32: the loss
jumps from 4.2 to 227 at iteration 1, stays in the hundreds and thousands, and the gradients go non-finite at 27.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanogpt_runs import get_lr  # train.py's schedule: linear warm-up, cosine decay to min_lr
from nanscan.entry import ReplaySpec, replay_entry
from nanscan.incident import NonFiniteError, SpikeWarning
from nanscan.runtime.monitor import Monitor

ENTRY = f"{Path(__file__).stem}:nanogpt_entry"
# train.py's defaults, shrunk to a CPU test (block 16, 2 layers, 2 heads, 32 wide; 2 micro-batches of 4)
CONFIG = {"seed": 1337, "vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
          "dropout": 0.0, "bias": True, "batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 6e-4,
          "max_iters": 60, "weight_decay": 1e-1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "decay_lr": True,
          "warmup_iters": 10, "lr_decay_iters": 600, "min_lr": 6e-5, "eval_interval": 250, "eval_iters": 4,
          "dtype": "float32", "init_scale": 2.0 ** 16}  # init_scale: the float16 GradScaler's (its default)
LR30 = {"learning_rate": 30.0}


class LayerNorm(nn.Module):
    """train.py's model.py LayerNorm: an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c["n_embd"], 3 * c["n_embd"], bias=c["bias"])
        self.c_proj = nn.Linear(c["n_embd"], c["n_embd"], bias=c["bias"])
        self.attn_dropout, self.resid_dropout = nn.Dropout(c["dropout"]), nn.Dropout(c["dropout"])
        self.n_head, self.n_embd, self.dropout = c["n_head"], c["n_embd"], c["dropout"]

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"], bias=c["bias"])
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"], bias=c["bias"])
        self.dropout = nn.Dropout(c["dropout"])

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(c["n_embd"], c["bias"]), CausalSelfAttention(c)
        self.ln_2, self.mlp = LayerNorm(c["n_embd"], c["bias"]), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c["vocab_size"], c["n_embd"]), wpe=nn.Embedding(c["block_size"], c["n_embd"]),
            drop=nn.Dropout(c["dropout"]), h=nn.ModuleList([Block(c) for _ in range(c["n_layer"])]),
            ln_f=LayerNorm(c["n_embd"], c["bias"])))
        self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.naive_loss = c.get("naive_loss", False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c["n_layer"]))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            if self.naive_loss:  # a code bug users write: log of a softmax that underflows to 0 for a large logit gap
                probs = torch.softmax(logits.view(-1, logits.size(-1)), dim=-1)
                loss = -torch.log(probs.gather(1, targets.view(-1, 1))).mean()
            else:
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                        {"params": nodecay_params, "weight_decay": 0.0}]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def full_config(overrides: dict) -> dict:
    return {**CONFIG, **overrides}


def token_stream(c: dict, split: str) -> torch.Tensor:
    """The memmap's stand-in: a seeded Markov chain of tokens (each token favours a few successors)."""
    g = torch.Generator().manual_seed(c["seed"] + (0 if split == "train" else 1))
    table = torch.softmax(3.0 * torch.randn(c["vocab_size"], c["vocab_size"], generator=g), dim=1)
    return _chain(table, g)


def _chain(table: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    tokens = [0]
    for _ in range(4095):
        tokens.append(int(torch.multinomial(table[tokens[-1]], 1, generator=g)))
    return torch.tensor(tokens, dtype=torch.int64)


def build_model(c: dict) -> GPT:
    torch.manual_seed(c["seed"])
    return GPT(c)


def load_checkpoint(path: Path, overrides: dict) -> tuple[GPT, torch.optim.Optimizer]:
    """A fresh model and train.py's optimizer with a DCP checkpoint (nanscan.bundle.checkpoint) loaded by plain DCP
    and set_state_dict, as a trainer resumes; the model alone where the checkpoint holds no optimizer state (kept
    before the first update: a fresh optimizer is that state)."""
    import json  # noqa: PLC0415 - only the checkpoint tests read one

    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415

    c = full_config(overrides)
    model = build_model(c)
    optimizer = model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]))
    if "optimizer" not in json.loads((Path(path) / "nanscan_resume.json").read_text())["keys"]:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        return model, optimizer
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return model, optimizer


def forward_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The loop's forward as step_fn: one micro-batch's loss as the model returns it (undivided)."""
    return model(batch["x"], batch["y"])[1]


@replay_entry
def nanogpt_entry(config: dict) -> ReplaySpec:
    """A replay entry written per the docs: the model, train.py's optimizer groups and the forward; no clipping
    declared (the Monitor observes it) and no held-out batches (the window's own batches go on past it)."""
    c = full_config(config)
    return ReplaySpec(build_model(c), lambda m: m.configure_optimizers(c["weight_decay"], c["learning_rate"],
                                                                        (c["beta1"], c["beta2"])), forward_loss)


@dataclass
class TrainRun:
    nonfinite_step: int | None = None
    bundle: Path | None = None
    error: NonFiniteError | None = None
    warnings: list[tuple[int, str]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # each iteration's summed (mean) micro-batch loss
    truth: int | None = None  # the first iteration whose loss, gradients or weights an isfinite check finds bad
    monitor: Monitor | None = None

    @property
    def first_warning(self) -> int | None:
        return self.warnings[0][0] if self.warnings else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), for the loop's own isfinite truth; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _clip_2d(model: GPT, max_norm: float) -> None:
    """The clipping a loop under FSDP2 + TP needs (torch's clip_grad_norm_ cannot stack the norms of DTensors on
    two meshes): torchtitan's recipe, the whole norm of each mesh's gradients, then their total, applied mesh by
    mesh."""
    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    total = torch.linalg.vector_norm(torch.stack(
        [torch.nn.utils.get_total_norm([p.grad for p in ps]).full_tensor() for ps in by_mesh.values()]))
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)


def _shard(model: GPT, parallel: str) -> None:
    """FSDP2 over the world ("fsdp"), HSDP over a (replicate, shard) mesh, or FSDP2 over "dp" with each MLP split
    over "tp" (see train())."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = None
    if parallel == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    elif parallel == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.transformer.h:
            parallelize_module(block.mlp, grid["tp"], {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
        mesh = grid["dp"]
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(overrides: dict, bundle_dir: Path | None, *, monitor: bool = True, sum_losses: bool = False,
          parallel: str | None = None, fault: tuple[int, int] | None = None, **monitor_options) -> TrainRun:
    """train.py's loop; `sum_losses`: the micro-batch losses are summed, not averaged (a common variant that
    makes the gradients `gradient_accumulation_steps` times larger). `parallel`: in an initialized process group,
    "ddp" as train.py runs under torchrun (each rank's seed offset by its rank, the model wrapped in
    DistributedDataParallel after its optimizer is made, gradients synchronized only at the last micro-step),
    "fsdp" (FSDP2's fully_shard on every block and the model before the optimizer is made, as torchtitan does),
    and on 4 ranks "hsdp" (fully_shard over a 2x2 (replicate, shard) mesh) or "tp" (each block's MLP split
    Megatron-style, c_fc by columns and c_proj by rows, over the mesh's "tp" dimension, and FSDP2 over its "dp"
    one; the two ranks of a tensor-parallel pair draw the same data). `fault`: (iteration, rank) whose forwards
    give NaN out of the final LayerNorm, that iteration only (a one-off fault on one rank; rank 0 without a group)."""
    c = full_config(overrides)
    rank = torch.distributed.get_rank() if parallel else 0
    seed_offset = rank // 2 if parallel == "tp" else rank
    torch.manual_seed(c["seed"] + seed_offset)  # train.py: torch.manual_seed(1337 + seed_offset)
    data = {split: token_stream(c, split) for split in ("train", "val")}
    block_size, batch_size, accum = c["block_size"], c["batch_size"], c["gradient_accumulation_steps"]

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - block_size, (batch_size,))
        x = torch.stack([d[i:i + block_size] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    model = build_model(c)
    torch.manual_seed(c["seed"] + seed_offset)  # the data's draws do not depend on the model's build
    scaler = torch.amp.GradScaler("cpu", init_scale=c["init_scale"], enabled=(c["dtype"] == "float16"))
    if parallel in ("fsdp", "hsdp", "tp"):
        _shard(model, parallel)
    raw_model = model
    optimizer = model.configure_optimizers(c["weight_decay"], c["learning_rate"], (c["beta1"], c["beta2"]))
    if parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    ctx = torch.autocast("cpu", dtype=getattr(torch, c["dtype"]), enabled=c["dtype"] != "float32")

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(c["eval_iters"])
            for k in range(c["eval_iters"]):
                X, Y = get_batch(split)
                with ctx:
                    _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    run = TrainRun()
    mon = None
    if monitor:
        options = {"bundle_dir": bundle_dir, "run_id": "train-py", "config": overrides, "replay_entry": ENTRY,
                   **monitor_options}
        mon = run.monitor = Monitor(model, optimizer, scaler=scaler if scaler.is_enabled() else None, **options)
    X, Y = get_batch("train")
    iter_num = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpikeWarning)
        try:
            while True:
                lr = get_lr(iter_num, c) if c["decay_lr"] else c["learning_rate"]
                for param_group in optimizer.param_groups:
                    param_group["lr"] = lr
                if iter_num % c["eval_interval"] == 0:
                    estimate_loss()
                step_loss = 0.0
                broken = None
                if fault is not None and fault == (iter_num, rank):
                    broken = raw_model.transformer.ln_f.register_forward_hook(lambda m, a, out: out * float("nan"))
                for micro_step in range(accum):
                    if parallel == "ddp":  # train.py: sync only at the last micro-step
                        model.require_backward_grad_sync = micro_step == accum - 1
                    with ctx:
                        logits, loss = model(X, Y)
                        loss = loss if sum_losses else loss / accum
                    batch = {"x": X, "y": Y}  # the micro-batch this forward consumed
                    X, Y = get_batch("train")  # prefetch, as train.py does, before backward
                    scaler.scale(loss).backward()
                    step_loss += float(loss.detach())
                    if mon is not None:
                        seen = len(caught)
                        if micro_step < accum - 1:
                            mon.observe(batch=batch, loss=loss)
                        else:
                            mon.check(batch=batch, loss=loss)
                        run.warnings += [(iter_num, str(w.message)) for w in caught[seen:]
                                         if issubclass(w.category, SpikeWarning)]
                if broken is not None:
                    broken.remove()
                run.losses.append(step_loss)
                finite = math.isfinite(step_loss) and all(
                    bool(torch.isfinite(_local(t)).all())
                    for p in raw_model.parameters() for t in (p, p.grad) if t is not None)
                if not finite and run.truth is None:
                    run.truth = iter_num
                    if mon is None:
                        break
                if c["grad_clip"] != 0.0:
                    scaler.unscale_(optimizer)
                    if parallel == "tp":
                        _clip_2d(raw_model, c["grad_clip"])
                    else:
                        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), c["grad_clip"])
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                iter_num += 1
                if iter_num > c["max_iters"]:
                    break
        except NonFiniteError as exc:
            run.nonfinite_step, run.error = exc.step, exc
            run.bundle = Path(exc.bundle_path) if exc.bundle_path else None
    return run
