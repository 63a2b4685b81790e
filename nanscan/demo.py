"""`nanscan demo`: a tiny causal language model trains on a token dataset with one corrupted record, goes
non-finite when that record arrives, and nanscan catches the step, keeps the evidence as a bundle and reports it.

The fault is a data problem that travels the real path. Every record carries token ids and a per-token loss
weight. One record's weights were exported as 3.4028235e+38, the float32 maximum that many tools write for a
missing value. Each weight is finite, so the batch passes an input check, but weight x token loss overflows float32
in the loss: the loss is inf and every gradient jumps to ~1e35. The Monitor sees a non-finite loss computed from
finite values, one input of which, `input:weights`, lies beyond float32's safe range (NOTE: [overflow] in
nanscan/engine/headroom.py), and files the incident as `input` (reason input_overflow) naming it; the bundle keeps the
batch and its record ids.

The workflow runs as ordered stages (STAGES); later stages (replay, ablation, data checks) append to that list.

`nanscan demo --diverging` runs the other way a run fails: the same model on clean data under a learning-rate
warm-up that never ends (the rate grows 5% a step and nobody capped it). The loss and the gradient norm climb for
well over a hundred steps before the first NaN; the Monitor's SpikeWarning names the step they left their range,
and the spike bundle written then, while the weights were still sound, is where the diagnosis starts.

The subcommand and what it prints are nanscan.cli.demo, which imports this module only when it runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nanscan._atomic import atomic_write_bytes, atomic_write_json
from nanscan.entry import ReplaySpec, replay_entry as marked_entry

RUN_ID = "nanscan-demo"
# The demo's config as JSON, for `nanscan preflight --entry nanscan.demo:replay_entry --config <out>/config.json`.
CONFIG_FILE = "config.json"
LOG_FILE = "train.log"
REPLAY_ENTRY = "nanscan.demo:replay_entry"
# The step whose batch holds the corrupted record, and its row in that batch. The loss must have clearly dropped
# by then (it falls from ~5.5 to ~1.1 within 60 steps), so the failure visibly interrupts healthy training.
FAULT_STEP = 80
FAULT_ROW = 5
# What the export tool wrote for "missing": the largest finite float32.
MISSING_SENTINEL = float(np.finfo(np.float32).max)

DEFAULT_CONFIG: dict[str, Any] = {
    "seed": 1234,
    "vocab_size": 256,
    "seq_len": 32,
    "d_model": 64,
    "n_heads": 4,
    "n_layers": 2,
    "batch_size": 16,
    "steps": 120,
    "lr": 1e-2,
    "warmup_steps": 10,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "num_records": 2048,
    "data_path": None,  # the JSON Lines file; set by demo_config()
    "replay_batches": 4,
}


# The diverging run: the rate starts at DIVERGING_LR and is multiplied by DIVERGING_GROWTH every step, for at most
# DIVERGING_STEPS steps (it goes non-finite at step 268, first warned about at step 92).
DIVERGING_RUN_ID = "nanscan-demo-diverging"
DIVERGING_LR = 1e-3
DIVERGING_GROWTH = 1.05
DIVERGING_STEPS = 400


def demo_config(out_dir: Path) -> dict:
    """The demo's training config; the data path is absolute so a bundle's replay finds it from any directory."""
    config = dict(DEFAULT_CONFIG)
    config["data_path"] = str((Path(out_dir) / "data" / "train.jsonl").resolve())
    return config


# ---------------------------------------------------------------------------------------------------------------
# Data: a JSON Lines file of records {"id", "tokens", "weights"}, read back through a Dataset with stable ids.
# ---------------------------------------------------------------------------------------------------------------

def make_records(config: dict) -> list[dict]:
    """Healthy records from a fixed Markov chain: each token is followed by its "successor" 80% of the time and by
    one of three alternatives otherwise, so a model can learn it (entropy ~0.7 nats against ln(256) = 5.5 at start).
    The first few tokens of each record are a prompt whose loss weight is 0, as in instruction tuning."""
    rng = np.random.default_rng(config["seed"])
    vocab, length = config["vocab_size"], config["seq_len"] + 1
    successor = rng.permutation(vocab)
    alternatives = rng.integers(0, vocab, size=(vocab, 3))
    records = []
    for i in range(config["num_records"]):
        tokens = [int(rng.integers(vocab))]
        for _ in range(length - 1):
            prev = tokens[-1]
            follow = rng.random() < 0.8
            tokens.append(int(successor[prev]) if follow else int(alternatives[prev, rng.integers(3)]))
        prompt_len = int(rng.integers(2, 7))
        weights = [0.0] * prompt_len + [1.0] * (length - 1 - prompt_len)
        records.append({"id": f"doc-{i:05d}", "tokens": tokens, "weights": weights})
    return records


def epoch_order(num_records: int, seed: int) -> list[int]:
    """The order in which training reads the records (one seeded shuffle)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_records, generator=generator).tolist()


def plant_fault(records: list[dict], config: dict, *, step: int = FAULT_STEP, row: int = FAULT_ROW) -> str:
    """Corrupt the record that training reads at (step, row): its weights become the missing-value sentinel."""
    order = epoch_order(len(records), config["seed"])
    position = step * config["batch_size"] + row
    if position >= len(order):
        raise ValueError(f"fault step {step} is past the end of the data ({len(order)} records, "
                         f"batch size {config['batch_size']}); use a smaller step or more records")
    record = records[order[position]]
    record["weights"] = [MISSING_SENTINEL] * len(record["weights"])
    return record["id"]


def dataset_bytes(records: list[dict]) -> bytes:
    """The records as JSON Lines: same records, same bytes."""
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()


def write_dataset(path: Path, records: list[dict]) -> str:
    """Write the records as JSON Lines (atomically; same records, same bytes) and return the file's sha256."""
    data = dataset_bytes(records)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


class DataFileError(ValueError):
    """A dataset file that is missing or has a malformed record."""


class TokenRecords(torch.utils.data.Dataset):
    """The records of a JSON Lines file; item i is (row index, record id, tokens int64[T+1], weights float32[T])."""

    def __init__(self, path: str | os.PathLike, seq_len: int):
        self.path = Path(path)
        try:
            lines = self.path.read_text().splitlines()
        except OSError as exc:
            raise DataFileError(f"cannot read the dataset {self.path}: {exc.strerror}; run `nanscan demo` to "
                                "write it, or set data_path in the config") from exc
        self.ids: list[str] = []
        tokens, weights = [], []
        for lineno, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                ids, toks, wts = record["id"], record["tokens"], record["weights"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise DataFileError(f"{self.path}:{lineno}: not a record with id, tokens and weights ({exc})") from None
            if len(toks) != seq_len + 1 or len(wts) != seq_len:
                raise DataFileError(f"{self.path}:{lineno}: record {ids!r} has {len(toks)} tokens and {len(wts)} "
                                    f"weights, expected {seq_len + 1} and {seq_len}")
            self.ids.append(str(ids))
            tokens.append(toks)
            weights.append(wts)
        self.tokens = torch.tensor(tokens, dtype=torch.int64)
        self.weights = torch.tensor(weights, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[int, str, torch.Tensor, torch.Tensor]:
        return i, self.ids[i], self.tokens[i], self.weights[i]


def collate(rows) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A batch dict (what the model and the Monitor see) and the rows' record ids."""
    index, ids, tokens, weights = zip(*rows)
    batch = {"tokens": torch.stack(tokens), "weights": torch.stack(weights),
             "index": torch.tensor(index, dtype=torch.int64)}
    return batch, list(ids)


def batches(dataset: TokenRecords, config: dict) -> Iterator[tuple[dict[str, torch.Tensor], list[str]]]:
    """The training batches of one epoch in epoch_order, through a DataLoader as a training script would."""
    order = epoch_order(len(dataset), config["seed"])
    size = config["batch_size"]
    plan = [order[i:i + size] for i in range(0, len(order) - size + 1, size)]
    return iter(torch.utils.data.DataLoader(dataset, batch_sampler=plan, collate_fn=collate))


# ---------------------------------------------------------------------------------------------------------------
# Model: a GPT-style decoder whose loss is a submodule, so replay can name it when the NaN starts there.
# ---------------------------------------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TokenWeightedLoss(nn.Module):
    """Cross-entropy of each target token times its loss weight, averaged over all token positions (weights are
    importance factors around 1; prompt tokens have weight 0 and do not count)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(weights)
        return (nll * weights).mean()


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_heads: int, n_layers: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.loss_fn = TokenWeightedLoss()

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(tokens) + self.pos_emb.weight[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The training loss of token rows [B, T+1] (inputs and next-token targets) with weights [B, T]."""
        return self.loss_fn(self.logits(tokens[:, :-1]), tokens[:, 1:], weights)


def build_model(config: dict) -> TinyLM:
    """The model with its seeded initial weights (the global torch RNG is seeded, as a training script does)."""
    torch.manual_seed(config["seed"])
    return TinyLM(config["vocab_size"], config["seq_len"], config["d_model"], config["n_heads"], config["n_layers"])


def build_optimizer(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])


def lr_at(step: int, config: dict) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak over the configured steps."""
    peak, warmup, total = config["lr"], config["warmup_steps"], config["steps"]
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def step_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["tokens"], batch["weights"])


@marked_entry
def replay_entry(config: dict) -> ReplaySpec:
    """Rebuild the demo's training step from a bundle's config: model, optimizer, step function, and the first
    `replay_batches` batches of the epoch (healthy: the corrupted record comes much later)."""
    missing = sorted(k for k in DEFAULT_CONFIG if k not in config)
    if missing:
        raise ValueError(f"the demo config lacks {missing}; pass the {CONFIG_FILE} that `nanscan demo` writes into "
                         f"its --out directory (e.g. --config nanscan-demo/{CONFIG_FILE})")
    model = build_model(config)
    dataset = TokenRecords(config["data_path"], config["seq_len"])
    loader = batches(dataset, config)
    healthy = [batch for batch, _ in (next(loader) for _ in range(config["replay_batches"]))]
    return ReplaySpec(model=model, optimizer=lambda m: build_optimizer(m, config), step_fn=step_fn,
                      batches=healthy, clip_grad_norm=config["grad_clip"])


@contextlib.contextmanager
def seeded_rngs(seed: int):
    """Seed Python, numpy and torch for the demo and give the caller its own generator states back afterwards."""
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.random.set_rng_state(saved[2])


@contextlib.contextmanager
def torch_threads(count: int):
    """Run torch on `count` threads, then restore the caller's setting. The demo model is so small that one
    thread is as fast as two on an idle machine and many times faster on a busy one (idle OpenMP workers spin
    against other processes), and its floating-point results then match on every machine."""
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# ---------------------------------------------------------------------------------------------------------------
# The workflow: ordered stages sharing one context.
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class StageResult:
    name: str
    ok: bool
    headline: str  # one line for the terminal
    data: dict = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class DemoContext:
    out_dir: Path
    config: dict
    echo: Callable[[str], None]
    results: list[StageResult] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # the dataset, its one corrupted record included
    planted_record: str | None = None
    # filled in by the stages
    losses: list[float] = field(default_factory=list)
    error: Any = None  # the NonFiniteError the Monitor raised
    bundle: Any = None  # the loaded nanscan.bundle.Bundle
    summary: dict | None = None  # nanscan.review.summary.summarize(bundle)
    replay: Any = None  # nanscan.replay.ReplayResult
    ablation: Any = None  # nanscan.replay.ablate.AblationResult
    data_check: dict | None = None
    conclusion: str | None = None


@dataclass
class DemoResult:
    out_dir: str
    bundle_path: str | None
    caught: bool  # the Monitor stopped training at the planted fault
    ok: bool  # caught, and every later stage ran and pointed at the planted record
    first_invalid_step: int | None
    category: str | None
    planted_record: str | None
    stages: list[StageResult]
    summary: dict | None

    def to_dict(self) -> dict:
        return asdict(self)


def stage_data(ctx: DemoContext) -> StageResult:
    records = ctx.records
    sha = write_dataset(Path(ctx.config["data_path"]), records)
    atomic_write_json(ctx.out_dir / CONFIG_FILE, ctx.config)
    return StageResult("data", True, f"wrote {len(records)} records to {ctx.config['data_path']}",
                       {"records": len(records), "sha256": sha, "path": ctx.config["data_path"],
                        "config": str(ctx.out_dir / CONFIG_FILE)})


def stage_detect(ctx: DemoContext) -> StageResult:
    """Train with the Monitor checking every step, as a user's training loop would."""
    from nanscan.runtime.monitor import Monitor, NonFiniteError

    config = ctx.config
    log_path = ctx.out_dir / LOG_FILE
    with seeded_rngs(config["seed"]):
        model = build_model(config)
        optimizer = build_optimizer(model, config)
        dataset = TokenRecords(config["data_path"], config["seq_len"])
        monitor = Monitor(model, optimizer, bundle_dir=ctx.out_dir / "bundles", config=config, run_id=RUN_ID,
                          log_files=[log_path], on_invalid="raise", replay_entry=REPLAY_ENTRY, snapshot="cpu")
        with monitor, open(log_path, "w", buffering=1) as log:
            for step, (batch, ids) in enumerate(batches(dataset, config)):
                if step >= config["steps"]:
                    break
                lr = lr_at(step, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.zero_grad(set_to_none=True)
                loss = step_fn(model, batch)
                loss.backward()
                log.write(f"step {step:4d}  loss {loss.item():.4f}  lr {lr:.3e}  "
                          f"samples {ids[0]}..{ids[-1]}\n")
                try:
                    monitor.check(batch=batch, loss=loss, sample_ids=ids, lr=lr, step=step)
                except NonFiniteError as exc:
                    log.write(f"step {step:4d}  stopped: non-finite {exc.category}; evidence in {exc.bundle_path}\n")
                    ctx.error = exc
                    break
                ctx.losses.append(loss.item())
                torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])
                optimizer.step()
    if ctx.error is None:
        return StageResult("detect", False, f"trained {len(ctx.losses)} steps and nothing went non-finite; "
                           "the planted fault was not reached", {"steps": len(ctx.losses)})
    err = ctx.error
    first, last = (ctx.losses[0], ctx.losses[-1]) if ctx.losses else (None, None)
    trend = f" (loss {first:.2f} -> {last:.2f})" if ctx.losses else ""
    return StageResult("detect", True, f"healthy for {len(ctx.losses)} steps{trend}, "
                       f"then non-finite at step {err.step}: category {err.category}",
                       {"step": err.step, "category": err.category, "tensors": list(err.tensors),
                        "first_loss": first, "last_finite_loss": last, "healthy_steps": len(ctx.losses)})


def stage_preserve(ctx: DemoContext) -> StageResult:
    """Load the bundle back the way a colleague would, which validates the manifest and every file's sha256."""
    from nanscan.bundle import load_bundle
    from nanscan.bundle.provenance import normalize_config

    if ctx.error is None:
        return StageResult("preserve", False, "no incident, so no bundle")
    if ctx.error.bundle_path is None:
        return StageResult("preserve", False, f"the Monitor could not write the bundle: {ctx.error.__cause__}")
    ctx.bundle = load_bundle(ctx.error.bundle_path)
    # A bundle already at that path is kept as is (bundles are idempotent); make sure it is this run's.
    if ctx.bundle.config != normalize_config(ctx.config) or ctx.bundle.category != ctx.error.category:
        return StageResult("preserve", False, f"{ctx.bundle.path} holds a bundle from an earlier demo with "
                           f"another config; delete {ctx.out_dir / 'bundles'} and run the demo again")
    files = ctx.bundle.manifest["files"]
    return StageResult("preserve", True, f"bundle {ctx.bundle.path} ({len(files)} files, checksums verified)",
                       {"path": str(ctx.bundle.path), "files": len(files)})


def stage_report(ctx: DemoContext) -> StageResult:
    from nanscan.review.summary import summarize

    if ctx.bundle is None:
        return StageResult("report", False, "no bundle to report on")
    ctx.summary = summarize(ctx.bundle)
    groups = ctx.summary["groups"]
    return StageResult("report", True, f"{len(ctx.summary['nonfinite_tensors'])} non-finite tensors in "
                       f"{len(groups)} module(s)", {"groups": len(groups)})


def stage_localize(ctx: DemoContext) -> StageResult:
    """Replay the failing step from the bundle alone, find the first bad module and the smallest failing subset."""
    from nanscan.replay import record_replay, replay

    if ctx.bundle is None:
        return StageResult("localize", False, "no bundle to replay")
    result = replay(ctx.bundle)
    record_replay(result, ctx.bundle)
    ctx.replay = result
    if not result.reproduced:
        return StageResult("localize", False, result.headline(), result.to_dict())
    subset = ""
    if result.bisect is not None and result.bisect.applicable:
        ids = result.bisect.sample_ids or [f"row {i}" for i in result.bisect.indices]
        label = "smallest failing subset" if result.bisect.minimal else "failing subset (not shown to be smallest)"
        subset = f"; {label}: {', '.join(map(str, ids))} of {result.bisect.batch_size} samples"
    return StageResult("localize", True, result.headline() + subset,
                       {"verdict": result.verdict,
                        "module": result.localization.label if result.localization else None,
                        "phase": result.localization.phase if result.localization else None,
                        "samples": result.bisect.sample_ids if result.bisect else None})


def stage_ablate(ctx: DemoContext) -> StageResult:
    """Change one factor at a time from the same state and batch; keep every row, helpful or not."""
    from nanscan.replay.ablate import ablate, record_ablation

    if ctx.bundle is None:
        return StageResult("ablate", False, "no bundle to ablate")
    result = ablate(ctx.bundle)
    record_ablation(result, ctx.bundle)
    ctx.ablation = result
    fixes = [r.factor.key for r in result.fixes]
    kept = [r.factor.key for r in result.rows if not r.fixes]
    return StageResult("ablate", True, f"{len(result.rows)} factors tried one at a time; fixes the step: "
                       f"{', '.join(fixes) or 'none'}; no effect: {', '.join(kept) or 'none'}",
                       {"fixes": fixes, "no_effect": kept})


def _record_ids_at(path: str, lines: Iterable[int]) -> dict[int, str | None]:
    """The `id` fields of the JSON Lines records at 1-based line numbers, read in one pass over the file."""
    wanted, ids = set(lines), {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if number in wanted:
                ids[number] = json.loads(text).get("id")
                if len(ids) == len(wanted):
                    break
    return {line: ids.get(line) for line in wanted}


def stage_check_data(ctx: DemoContext) -> StageResult:
    """Check the whole dataset file, as one would before the next long run."""
    from nanscan.data import check_paths
    from nanscan.data.findings import OVERFLOW

    report = check_paths([ctx.config["data_path"]])
    failing = report.failing()
    extreme = report.largest_magnitude
    flagged = [f for f in report.findings if f.category == OVERFLOW and f.record.line][:5]
    lines = [f.record.line for f in flagged]
    if extreme is not None and extreme.record.line is not None:
        lines.append(extreme.record.line)
    ids = _record_ids_at(ctx.config["data_path"], lines)
    overflow = [{"id": ids[f.record.line], "line": f.record.line, "field": f.field} for f in flagged]
    ctx.data_check = {"findings": sum(report.counts.values()), "failing": failing, "largest": None,
                      "overflow": overflow}
    headline = f"{report.records} records: " + (", ".join(f"{n} {c}" for c, n in failing.items()) or
                                                "no non-finite, overflow, empty, unreadable or inconsistent record")
    if overflow:
        headline += "; overflow in " + ", ".join(f"{o['id']} (line {o['line']})" for o in overflow)
    if extreme is not None and extreme.record.line is not None:
        record_id = ids[extreme.record.line]
        ctx.data_check["largest"] = {"value": extreme.value, "line": extreme.record.line, "field": extreme.field,
                                     "id": record_id}
        headline += (f"; largest magnitude {extreme.value:.4g} in field {extreme.field!r} of {record_id} "
                     f"(line {extreme.record.line})")
    return StageResult("check data", True, headline, ctx.data_check)


def stage_conclude(ctx: DemoContext) -> StageResult:
    """Put the evidence of every stage side by side, record it in the bundle, and say what it points at."""
    replay, ablation, data = ctx.replay, ctx.ablation, ctx.data_check or {}
    subset = (replay.bisect.sample_ids or []) if replay is not None and replay.bisect is not None else []
    fixes = [r.factor.key for r in ablation.fixes] if ablation is not None else []
    no_effect = [r.factor.key for r in ablation.rows if not r.fixes] if ablation is not None else []
    largest = data.get("largest") or {}
    overflow_ids = [o["id"] for o in data.get("overflow") or []]
    agree = len(subset) == 1 and largest.get("id") == subset[0]
    evidence = [
        f"- detected: step {ctx.error.step}, category `{ctx.error.category}`",
        f"- replay: {replay.headline()}" if replay is not None else "- replay: not run",
        f"- bisection: {'smallest ' if replay is not None and replay.bisect is not None and replay.bisect.minimal else ''}"
        f"failing subset {', '.join(map(str, subset)) or 'not found'}",
        f"- one factor at a time: fixes {', '.join(fixes) or 'nothing'}; no effect: {', '.join(no_effect) or '-'}",
        f"- data check: largest magnitude {largest.get('value', float('nan')):.4g} in `{largest.get('field')}` of "
        f"{largest.get('id')}" if largest else "- data check: no extreme record",
        f"- data check: `overflow` (|x| >= 2**64) in {', '.join(map(str, overflow_ids)) or 'no record'}",
    ]
    if agree and fixes == ["drop-suspicious"]:
        verdict = (f"record {subset[0]} is the cause: its `{largest.get('field')}` values are "
                   f"{largest['value']:.4g}, the float32 maximum (a missing-value sentinel)"
                   + (", which the data check flags as `overflow`" if subset[0] in overflow_ids else "")
                   + ", and the step is "
                   "finite without it; learning rate, precision and clipping changes do not fix it, so this is a "
                   "data problem, not a mixed-precision one. Fix the record (or validate the field) and rerun.")
    else:
        verdict = "the stages do not point at one cause; review the evidence above and the bundle's findings"
    body = "\n".join(evidence) + "\n\n**Conclusion:** " + verdict
    if ctx.bundle is not None:
        ctx.bundle.add_finding("demo:conclusion", "Conclusion of the ordered workflow", body,
                               {"subset": subset, "fixes": fixes, "no_effect": no_effect, "data": largest,
                                "agree": agree})
    ctx.conclusion = verdict
    return StageResult("conclude", agree, verdict, {"agree": agree, "verdict": verdict})


STAGES: list[tuple[str, Callable[[DemoContext], StageResult]]] = [
    ("data", stage_data),
    ("detect", stage_detect),
    ("preserve", stage_preserve),
    ("report", stage_report),
    ("localize", stage_localize),
    ("ablate", stage_ablate),
    ("check data", stage_check_data),
    ("conclude", stage_conclude),
]


class DemoOutputError(ValueError):
    """The --out directory cannot be written, or holds files of someone else's that the demo would overwrite."""


def claim_out_dir(out: Path, config: dict, records: list[dict]) -> None:
    """Make sure the demo may write into `out`: it can be created and written, and the files the demo rewrites
    (the dataset, its config, the training log) are absent or an earlier demo's, recognised by its dataset's exact
    bytes. `nanscan demo --out .` in a project must not replace the project's own data/train.jsonl."""
    advice = "pass --out with a new or empty directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoOutputError(f"cannot create the demo directory {out}: {exc.strerror}; {advice} that you can "
                              "write to") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise DemoOutputError(f"cannot write into {out}: permission denied; {advice} that you can write to")
    data_path = Path(config["data_path"])
    rewritten = [data_path, out / CONFIG_FILE, out / LOG_FILE]
    present = [p for p in rewritten if p.exists() or p.is_symlink()]
    if not present:
        return
    try:
        earlier_demo = data_path.is_file() and data_path.read_bytes() == dataset_bytes(records)
    except OSError:
        earlier_demo = False
    if not earlier_demo:
        names = ", ".join(p.relative_to(out).as_posix() for p in present)
        raise DemoOutputError(f"{out} already holds {names}, which `nanscan demo` did not write and would "
                              f"overwrite; {advice}, or move those files away")


def run_demo(out_dir: str | os.PathLike = "nanscan-demo", *, echo: Callable[[str], None] | None = None) -> DemoResult:
    """Run every stage in order into out_dir; a stage that fails stops the ones after it.

    Raises DemoOutputError, before writing anything, when out_dir cannot be used (see claim_out_dir)."""
    out = Path(out_dir).resolve()
    config = demo_config(out)
    records = make_records(config)
    planted = plant_fault(records, config)
    claim_out_dir(out, config, records)
    ctx = DemoContext(out_dir=out, config=config, echo=echo or (lambda _line: None), records=records,
                      planted_record=planted)
    with torch_threads(1):
        for name, stage in STAGES:
            start = time.perf_counter()
            result = stage(ctx)
            result.seconds = round(time.perf_counter() - start, 3)
            ctx.results.append(result)
            ctx.echo(f"[{name}] {result.headline}")
            if not result.ok:
                break
    err = ctx.error
    caught = err is not None and err.step == FAULT_STEP
    finished = len(ctx.results) == len(STAGES) and all(r.ok for r in ctx.results)
    return DemoResult(out_dir=str(out), bundle_path=str(err.bundle_path) if err else None, caught=caught,
                      ok=caught and finished, first_invalid_step=err.step if err else None,
                      category=err.category if err else None, planted_record=ctx.planted_record,
                      stages=ctx.results, summary=ctx.summary)


@dataclass
class DivergingResult:
    out_dir: str
    first_warning_step: int | None  # the first SpikeWarning's step
    first_invalid_step: int | None
    spike_bundle: str | None
    incident_bundle: str | None
    warning: str | None  # the first SpikeWarning's text

    @property
    def ok(self) -> bool:
        """Warned, and at least five steps before the first non-finite step."""
        return (self.first_warning_step is not None and self.first_invalid_step is not None
                and self.first_invalid_step - self.first_warning_step >= 5)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def diverging_lr(step: int) -> float:
    """The warm-up that never ends: DIVERGING_LR x DIVERGING_GROWTH**step."""
    return DIVERGING_LR * DIVERGING_GROWTH ** step


def run_diverging(out_dir: str | os.PathLike = "nanscan-demo", *,
                  echo: Callable[[str], None] | None = None) -> DivergingResult:
    """Train the demo model on clean in-memory records with the endless warm-up until it goes non-finite, under a
    Monitor with spikes="warn"; bundles go to <out_dir>/diverging-bundles."""
    import warnings  # noqa: PLC0415

    from nanscan.incident import NonFiniteError, SpikeWarning  # noqa: PLC0415
    from nanscan.runtime.monitor import Monitor  # noqa: PLC0415

    echo = echo or (lambda _line: None)
    out = Path(out_dir).resolve()
    config = dict(DEFAULT_CONFIG, steps=DIVERGING_STEPS, num_records=DEFAULT_CONFIG["batch_size"] * DIVERGING_STEPS)
    records = make_records(config)
    tokens = torch.tensor([r["tokens"] for r in records], dtype=torch.int64)
    weights = torch.tensor([r["weights"] for r in records], dtype=torch.float32)
    first_warning, error = None, None
    with torch_threads(1), seeded_rngs(config["seed"]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpikeWarning)
        model = build_model(config)
        optimizer = build_optimizer(model, config)
        monitor = Monitor(model, optimizer, bundle_dir=out / "diverging-bundles", config=config,
                          run_id=DIVERGING_RUN_ID, on_invalid="raise", spikes="warn")
        try:
            with monitor:
                for step in range(DIVERGING_STEPS):
                    rows = torch.arange(step * config["batch_size"], (step + 1) * config["batch_size"])
                    batch = {"tokens": tokens[rows], "weights": weights[rows]}
                    for group in optimizer.param_groups:
                        group["lr"] = diverging_lr(step)
                    optimizer.zero_grad(set_to_none=True)
                    loss = step_fn(model, batch)
                    loss.backward()
                    monitor.check(batch=batch, loss=loss, step=step)
                    if first_warning is None and caught:
                        first_warning = caught[0].message
                        echo(f"[warned] step {step}: {first_warning}")
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config["grad_clip"])
                    optimizer.step()
        except NonFiniteError as exc:
            error = exc
            echo(f"[non-finite] step {exc.step}: category {exc.category}; evidence in {exc.bundle_path}")
    return DivergingResult(
        out_dir=str(out), first_warning_step=first_warning.step if first_warning else None,
        first_invalid_step=error.step if error else None,
        spike_bundle=str(monitor.spike_bundle_path) if monitor.spike_bundle_path else None,
        incident_bundle=str(error.bundle_path) if error is not None and error.bundle_path else None,
        warning=str(first_warning) if first_warning else None)
