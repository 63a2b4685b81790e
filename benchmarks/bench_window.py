"""What does the run's window (Monitor(window=...), nanscan.runtime.window NOTE: [run window]) cost per step on
GPT-2-small shapes, and what does a bundle of it weigh? The demo model's figures come from bench_overhead.py, which
runs the window beside its other variants; this script takes the demo's transformer at GPT-2-small's sizes (12
layers, d_model 768, 12 heads, vocabulary 50257, its embeddings untied; AdamW; 2 x 64 tokens a step), where a
step and a state copy both take long enough to time one by one:

    gpt2-small: 162,299,904 parameters; plain step 1.895 s (with the window 1.916 s); the window's stage 0.074 ms a
    check, its state copy 0.132 s every 32 steps
    window_cost(gpt2-small, steps=32, every=32) = 0.22% of a plain step (state copies 0.22%, stage 0.004%)
    window_states = 2 x 1857.4 MiB of host memory
    spill (Window(directory=...)): ... (the background write of one state, and the steps run meanwhile)

Steps alternate between a Monitor without a window and one with the default window (both on the same model, each
checking its own steps), so both see the same machine; the window's own work is timed where it runs (its state
copy at a step's start, its stage inside check()). A dry run: `--steps 2 --layers 1 --d-model 64 --vocab 256`.

    .venv/bin/python benchmarks/bench_window.py --json benchmarks/results/bench_window.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanscan import demo as D
from nanscan._atomic import write_results_json
from nanscan.bench_scan import cpu_model
from nanscan.runtime.monitor import Monitor
from nanscan.runtime.snapshot import CpuSnapshot
from nanscan.runtime.spill import StateSpill
from nanscan.runtime.window import Window


def timed(seconds: list[float], call):
    """`call`, appending each call's seconds to `seconds`."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)
    return timed


def _spill_cost(model, optimizer, monitor: Monitor, batches: list, skip: frozenset, tmp: str) -> dict:
    """Window(directory=...) (NOTE: [spilled states]): the copy and the hand-off the loop pays, the background
    write's time, and what the steps run meanwhile cost against steps run without one (the write shares the
    machine's cores)."""
    spill = StateSpill(tmp)
    spill.capture(model, optimizer, skip=skip)  # allocates its buffers
    spill.remove(spill.write(-1))

    def step(i: int) -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = D.step_fn(model, batches[i % len(batches)])
        loss.backward()
        monitor.check(batch=batches[i % len(batches)], loss=loss)
        optimizer.step()
        return time.perf_counter() - start

    quiet = [step(i) for i in range(3)]
    start = time.perf_counter()
    spill.capture(model, optimizer, skip=skip)
    kept = spill.write(0)
    handed = time.perf_counter() - start
    during = []
    while not kept.future.done():
        during.append(step(len(during)))
    written = time.perf_counter() - start
    assert spill.failure(kept) is None
    return {"loop_s": handed, "write_s": written, "steps_during_write": len(during),
            "step_during_write_ratio": statistics.median(during) / statistics.median(quiet) if during else None}


def run(steps: int, layers: int, d_model: int, heads: int, vocab: int, seq_len: int, batch: int) -> dict:
    config = dict(D.DEFAULT_CONFIG, n_layers=layers, d_model=d_model, n_heads=heads, vocab_size=vocab,
                  seq_len=seq_len, batch_size=batch, lr=1e-4)
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
    optimizer = D.build_optimizer(model, config)
    generator = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, vocab, (batch, seq_len), generator=generator),
                "weights": torch.ones(batch, seq_len - 1)} for _ in range(4)]
    window = Window()
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-window-") as tmp:
        monitors = {"plain": Monitor(model, optimizer, bundle_dir=tmp, window=None, spikes=None),
                    "window": Monitor(model, optimizer, bundle_dir=tmp, window=window, spikes=None)}
        keeper = monitors["window"]._window
        begin_seconds: list[float] = []
        keep_seconds: list[float] = []
        keeper.begin = timed(begin_seconds, keeper.begin)
        keeper.keep = timed(keep_seconds, keeper.keep)
        step_seconds: dict[str, list[float]] = {name: [] for name in monitors}
        for i in range(2 * steps + 2):
            name = ("plain", "window")[i % 2]
            monitor = monitors[name]
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = D.step_fn(model, batches[i % len(batches)])
            loss.backward()
            report = monitor.check(batch=batches[i % len(batches)], loss=loss)
            if not report.ok:
                raise SystemExit(f"validation failed: a healthy step reported {report.nonfinite[:3]}")
            optimizer.step()
            if i >= 2:  # the first two build the optimizer's state and both plans
                step_seconds[name].append(time.perf_counter() - start)
        # The state copy, every `every` steps, into buffers a ring reuses: timed directly, after one copy that
        # allocates them (the window's own first copies were taken before the optimizer had its state)
        snapshot = CpuSnapshot()
        skip = keeper._frozen_keys(model)
        snapshot.capture(model, optimizer, skip=skip)
        copies = []
        for _ in range(max(2, min(steps, 5))):
            start = time.perf_counter()
            snapshot.capture(model, optimizer, skip=skip)
            copies.append(time.perf_counter() - start)
        state_bytes = snapshot.nbytes()
        spill = _spill_cost(model, optimizer, monitors["plain"], batches, skip, tmp)
        for monitor in monitors.values():
            monitor.close()
    plain = statistics.median(step_seconds["plain"])
    copy = statistics.median(copies)
    stage = statistics.median(keep_seconds)
    states = copy / window.every / plain
    return {
        "question": "the run's window's cost per step on GPT-2-small shapes, and its host memory",
        "config": {k: config[k] for k in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "batch_size")},
        "parameters": sum(p.numel() for p in model.parameters()),
        "window": {"steps": window.steps, "every": window.every, "states": window.states},
        "steps_timed": steps,
        "median_step_s": {name: statistics.median(times) for name, times in step_seconds.items()},
        "median_state_copy_s": copy,
        "median_stage_ms": stage * 1e3,
        "state_bytes": state_bytes,
        "window_cost_pct": {"state_copies": 100.0 * states, "stage": 100.0 * stage / plain,
                            "total": 100.0 * (states + stage / plain)},
        "spill": spill,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
        "cpu": cpu_model(),
    }


def model_arguments(parser: argparse.ArgumentParser, *, steps: int, layers: int, d_model: int, heads: int,
                    vocab: int, batch: int, seq_len: int = 64) -> None:
    """The demo transformer's sizes, the timed steps and --json, with these defaults."""
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per variant (default {steps})")
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser, steps=4, layers=12, d_model=768, heads=12, vocab=50257, batch=2)
    args = parser.parse_args(argv)
    result = run(args.steps, args.layers, args.d_model, args.heads, args.vocab, args.seq_len, args.batch)
    cost, window = result["window_cost_pct"], result["window"]
    print(f"gpt2-small: {result['parameters']:,} parameters; plain step {result['median_step_s']['plain']:.3f} s "
          f"(with the window {result['median_step_s']['window']:.3f} s); the window's stage "
          f"{result['median_stage_ms']:.3f} ms a check, its state copy {result['median_state_copy_s']:.3f} s "
          f"every {window['every']} steps")
    print(f"window_cost(gpt2-small, steps={window['steps']}, every={window['every']}) = {cost['total']:.2f}% of a "
          f"plain step (state copies {cost['state_copies']:.2f}%, stage {cost['stage']:.3f}%)")
    print(f"window_states = {window['states']} x {result['state_bytes'] / (1 << 20):.1f} MiB of host memory")
    spill = result["spill"]
    during = spill["step_during_write_ratio"]
    print(f"spill (Window(directory=...)): the loop's copy and hand-off {spill['loop_s']:.3f} s, the background "
          f"write {spill['write_s']:.2f} s ({spill['write_s'] / result['median_step_s']['plain']:.1f} plain steps); "
          f"steps during the write = {during:.2f}x a plain step" if during is not None else
          "steps during the write: none (the write finished first)")
    if args.json:
        print(f"wrote {write_results_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
