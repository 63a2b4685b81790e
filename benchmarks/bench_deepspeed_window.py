"""What does the window cost a DeepSpeed run, now that DeepSpeedMonitor keeps one by default (nanscan.integrations.
deepspeed NOTE: [zero window])? Two gloo ranks on the CPU train the demo's transformer under ZeRO-2 and ZeRO-3 (bf16,
AdamW); on each, steps alternate between a DeepSpeedMonitor without a window and one with the default window, both
on the same engine, so both see the same machine. The window's own work is timed where it runs: its stage inside
check() at every step, and its state copy (ZeroSource.state: this rank's partitions and the engine's counters, into
the ring's host buffers) timed directly, as it runs once every `every` steps:

    zero2: 5,273,088 parameters; step 2.807 s (with the window 2.818 s); stage 0.777 ms a check, state copy
    0.0115 s every 32 steps (40.2 MiB a rank)
    window_cost(zero2, steps=32, every=32) = 0.04% of a step (state copies 0.01%, stage 0.028%)
    zero3: 5,273,088 parameters; step 2.931 s (with the window 2.887 s); stage 0.822 ms a check, state copy
    0.0153 s every 32 steps (35.2 MiB a rank)
    window_cost(zero3, steps=32, every=32) = 0.04% of a step (state copies 0.02%, stage 0.028%)

The alternating steps' ratio (1.004 and 0.985 above) swings more than the window's cost: on 2 ranks sharing 2 cores
a step's time varies by a few percent, so the cost is the direct timing of the window's work, not that ratio.

    .venv/bin/python benchmarks/bench_deepspeed_window.py --json benchmarks/results/bench_deepspeed_window.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: it picks its accelerator then

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench_window import model_arguments, timed  # noqa: E402
from nanscan import demo as D  # noqa: E402
from nanscan._atomic import write_results_json  # noqa: E402
from nanscan.bench_scan import cpu_model  # noqa: E402

WORLD = 2


def _stage(stage: int, args: argparse.Namespace, tmp: str) -> dict:
    import deepspeed

    from nanscan.integrations.deepspeed import DeepSpeedMonitor
    from nanscan.runtime.snapshot import CpuSnapshot
    from nanscan.runtime.window import Window

    config = dict(D.DEFAULT_CONFIG, n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                  vocab_size=args.vocab, seq_len=args.seq_len, batch_size=args.batch, lr=1e-4)
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
    parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them away
    ds_config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                 "steps_per_print": 10 ** 9, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=ds_config)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [{"tokens": torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator),
                "weights": torch.ones(args.batch, args.seq_len - 1)} for _ in range(4)]
    window = Window()
    monitors = {"plain": DeepSpeedMonitor(engine, bundle_dir=tmp, run_id=f"plain{stage}", window=None, spikes=None),
                "window": DeepSpeedMonitor(engine, bundle_dir=tmp, run_id=f"window{stage}", window=window,
                                           spikes=None)}
    keeper = monitors["window"]._window
    keep_seconds: list[float] = []
    keeper.keep = timed(keep_seconds, keeper.keep)
    step_seconds: dict[str, list[float]] = {name: [] for name in monitors}
    for i in range(2 * args.steps + 2):
        name = ("plain", "window")[i % 2]
        start = time.perf_counter()
        batch = batches[i % len(batches)]
        loss = D.step_fn(engine, batch)
        engine.backward(loss)
        report = monitors[name].check(batch=batch, loss=loss)
        if not report.ok:
            raise SystemExit(f"validation failed: a healthy step reported {report.nonfinite[:3]}")
        engine.step()
        if i >= 2:  # the first two build the optimizer's state and both plans
            step_seconds[name].append(time.perf_counter() - start)
    source = monitors["window"].tensor_source
    snapshot = CpuSnapshot()
    snapshot.capture(engine.module, None, state_of=source.state)  # allocates the buffers
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        snapshot.capture(engine.module, None, state_of=source.state)
        copies.append(time.perf_counter() - start)
    for monitor in monitors.values():
        monitor.close()
    plain = statistics.median(step_seconds["plain"])
    copy = statistics.median(copies)
    stage_s = statistics.median(keep_seconds)
    states = copy / window.every / plain
    return {"parameters": parameters,
            "median_step_s": {name: statistics.median(times) for name, times in step_seconds.items()},
            "median_state_copy_s": copy, "median_stage_ms": stage_s * 1e3, "state_bytes_per_rank": snapshot.nbytes(),
            "window": {"steps": window.steps, "every": window.every, "states": window.states},
            "window_cost_pct": {"state_copies": 100.0 * states, "stage": 100.0 * stage_s / plain,
                                "total": 100.0 * (states + stage_s / plain)}}


def _worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)  # two processes share 2 cores
    import deepspeed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    deepspeed.init_distributed(dist_backend="gloo")
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-dswindow-") as tmp:
        results = {f"zero{stage}": _stage(stage, args, tmp) for stage in (2, 3)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser, steps=6, layers=4, d_model=256, heads=4, vocab=4096, batch=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-dswindow-") as out:
        mp.spawn(_worker, args=(args, str(Path(out) / "store"), out), nprocs=WORLD, join=True)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    result = {"question": "the default window's cost per step of a DeepSpeed ZeRO run (2 gloo ranks, bf16, AdamW)",
              "config": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "vocab": args.vocab,
                         "seq_len": args.seq_len, "batch": args.batch},
              "steps_timed": args.steps, "ranks": ranks, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_model()}
    for name, stage in ranks[0].items():
        cost, window = stage["window_cost_pct"], stage["window"]
        print(f"{name}: {stage['parameters']:,} parameters; step {stage['median_step_s']['plain']:.3f} s (with the "
              f"window {stage['median_step_s']['window']:.3f} s); stage {stage['median_stage_ms']:.3f} ms a check, "
              f"state copy {stage['median_state_copy_s']:.4f} s every {window['every']} steps "
              f"({stage['state_bytes_per_rank'] / (1 << 20):.1f} MiB a rank)")
        print(f"window_cost({name}, steps={window['steps']}, every={window['every']}) = {cost['total']:.2f}% of a "
              f"step (state copies {cost['state_copies']:.2f}%, stage {cost['stage']:.3f}%)")
    if args.json:
        print(f"wrote {write_results_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
