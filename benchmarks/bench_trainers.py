"""What does each NaN checker cost a Hugging Face Trainer step? A small GPT-2 (built from config, no download)
trained under transformers.Trainer with no checker, with nanscan's NanscanCallback, with a per-tensor
`isfinite` loop over the gradients (the check users write by hand), with DebugUnderflowOverflow
(`TrainingArguments(debug="underflow_overflow")`) and with torch anomaly mode, side by side in one run:

    nanscan_overhead = <p>% of step                 (one line per checker)
    isfinite_loop / nanscan overhead = <r>x         (target: at least 0.5x, nanscan checking everything it checks)
    debug_underflow_overflow / nanscan overhead = <r>x   (target: at least 10x)
    anomaly / nanscan overhead = <r>x

Run it alone: `flock /tmp/nanscan-bench.lock .venv/bin/python benchmarks/bench_trainers.py --json
benchmarks/results/bench_trainers.json` (`--quick` for a smoke run of a few seconds). Each round trains every
variant once, from the same initial weights, in an order that alternates between rounds so that drift in machine
load falls on all of them alike; a variant's step time is the median over its rounds of the median step of that
round (the first `--warmup` steps of each run dropped). A step is timed from on_step_begin to on_step_end (with a
CUDA synchronize at both ends on a GPU), so it holds every micro-batch's forward and backward, the clipping, the
check and the optimizer step. nanscan's check is validated first: a clean run writes no bundle and a planted NaN
is caught.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import nanscan
from nanscan._atomic import write_results_json
from nanscan.integrations.transformers import NanscanCallback

VARIANTS = ("none", "nanscan", "isfinite_loop", "debug_underflow_overflow", "anomaly")


class StepTimer(transformers.TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        self.times.append(time.perf_counter() - self._start)


class IsfiniteLoop(transformers.TrainerCallback):
    """The hand-written check: every gradient's isfinite().all(), one host read per tensor."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        for name, p in self.model.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                raise FloatingPointError(f"non-finite gradient in {name} at step {state.global_step}")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int, seq: int, vocab: int):
        self.data = torch.randint(0, vocab, (size, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def collate(items: list[dict]) -> dict:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def build(config: transformers.GPT2Config, state: dict) -> transformers.GPT2LMHeadModel:
    model = transformers.GPT2LMHeadModel(config)
    model.load_state_dict(state)
    return model


def train(variant: str, model, data, workdir: Path, opts, *, nan_at: int | None = None) -> StepTimer:
    timer = StepTimer()
    callbacks: list = [timer]
    if variant == "nanscan":
        callbacks.append(NanscanCallback(bundle_dir=workdir / "bundles", run_id=f"bench-{time.time_ns()}"))
    elif variant == "isfinite_loop":
        callbacks.append(IsfiniteLoop(model))
    args = transformers.TrainingArguments(
        output_dir=str(workdir / "out"), per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.accumulation, max_steps=opts.steps, report_to=[], save_strategy="no",
        logging_steps=10 ** 6, disable_tqdm=True, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
        bf16=opts.bf16, debug="underflow_overflow" if variant == "debug_underflow_overflow" else "")

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                   callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)  # its per-run summary line, not a result
    if nan_at is not None:
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.view(-1)[0] = float("nan")
    anomaly = torch.autograd.detect_anomaly(check_nan=True) if variant == "anomaly" else contextlib.nullcontext()
    with anomaly:
        trainer.train()
    return timer


def validate(config, state, data, workdir: Path, opts) -> None:
    """nanscan must see a clean run as clean and a planted NaN as an incident before anything is timed."""
    train("nanscan", build(config, state), data, workdir / "clean", opts)
    if (workdir / "clean" / "bundles").exists():
        raise SystemExit("validation failed: a clean run wrote a bundle")
    try:
        train("nanscan", build(config, state), data, workdir / "nan", opts, nan_at=0)
    except nanscan.NonFiniteError as exc:
        if exc.category != "parameter":
            raise SystemExit(f"validation failed: a planted NaN weight was caught as {exc.category}") from None
    else:
        raise SystemExit("validation failed: a planted NaN weight was not caught")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps: a smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (TrainingArguments(bf16=True))")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", default=None, help="write the results here")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.rounds, opts.steps, opts.warmup, opts.layers, opts.width, opts.seq, opts.batch = 1, 4, 1, 1, 32, 16, 2
    variants = [v for v in opts.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "none" not in variants:
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}, 'none' included (unknown: {unknown})")
    transformers.logging.set_verbosity_error()

    config = transformers.GPT2Config(n_layer=opts.layers, n_embd=opts.width, n_head=max(1, opts.width // 64),
                                     vocab_size=1024, n_positions=opts.seq, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in transformers.GPT2LMHeadModel(config).state_dict().items()}
    data = Tokens(opts.batch * opts.accumulation * opts.steps, opts.seq, config.vocab_size)
    per_round: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-trainers-") as tmp:
        workdir = Path(tmp)
        validate(config, state, data, workdir / "validate", opts)
        for r in range(opts.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for variant in order:
                timer = train(variant, build(config, state), data, workdir / f"{variant}-{r}", opts)
                kept = timer.times[opts.warmup:] or timer.times
                per_round[variant].append(statistics.median(kept))

    step = {v: statistics.median(times) for v, times in per_round.items()}
    base = step["none"]
    overhead = {v: step[v] - base for v in variants if v != "none"}
    lines = [f"{v}_overhead = {100 * overhead[v] / base:.1f}% of step" for v in overhead]
    if "nanscan" in overhead:
        ours = overhead["nanscan"]
        for v in overhead:
            if v != "nanscan":
                lines.append(f"{v} / nanscan overhead = {overhead[v] / ours:.1f}x" if ours > 0 else
                             f"{v} / nanscan overhead = n/a (nanscan's overhead is below this run's noise)")
    print(f"step time (median of {opts.rounds} round(s), {opts.steps} steps each, {opts.warmup} dropped):")
    for v in variants:
        print(f"  {v:>26}: {1000 * step[v]:.2f} ms")
    for line in lines:
        print(line)
    if opts.json:
        write_results_json(opts.json, {
            "benchmark": "bench_trainers", "options": vars(opts), "step_seconds": step, "per_round": per_round,
            "overhead_seconds": overhead, "lines": lines, "nanscan": nanscan.__version__,
            "backend": nanscan.backend_info()["active"], "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "python": sys.version.split()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
