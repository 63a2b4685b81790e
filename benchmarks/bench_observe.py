"""What does handing the Monitor every micro-batch cost under gradient accumulation: observe() without a scan
(nanscan.runtime.observed NOTE: [observed micro-batches]) against check(micro_batch=True) with one, on the demo
model with 4 micro-batches a step? Steps run in blocks whose order rotates (plain, one check a step, observe,
micro-batch checks), so drift falls on all alike; each variant's cost is its median step over the one-check step's,
as a share of a plain step.

    .venv/bin/python benchmarks/bench_observe.py --blocks 48 --json benchmarks/results/bench_observe.json

With 24 blocks the one-check step's own cost swung from 2% to 7% between runs (the step is 34 ms on 2 cores); 48
blocks gave observe 0.88-0.94% and micro-batch checks 3.2-4.3% of a plain step, three calls each.
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

VARIANTS = ("plain", "check", "observe", "micro_checks")


def run(blocks: int, block: int, accum: int) -> dict:
    config = dict(D.DEFAULT_CONFIG)
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
    optimizer = D.build_optimizer(model, config)
    generator = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, config["vocab_size"], (config["batch_size"], config["seq_len"] + 1),
                                        generator=generator),
                "weights": torch.ones(config["batch_size"], config["seq_len"])} for _ in range(8)]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-observe-") as tmp:
        monitors = {name: Monitor(model, optimizer, bundle_dir=tmp, run_id=name, spikes=None)
                    for name in VARIANTS[1:]}

        def step(name: str, i: int) -> None:
            monitor = monitors.get(name)
            for micro in range(accum):
                batch = batches[(i * accum + micro) % len(batches)]
                loss = D.step_fn(model, batch) / accum
                loss.backward()
                last = micro == accum - 1
                if monitor is None:
                    continue
                if last or name == "micro_checks":
                    monitor.check(batch=batch, loss=loss, micro_batch=not last)
                elif name == "observe":
                    monitor.observe(batch=batch, loss=loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for name in VARIANTS:  # optimizer state, plans, pools
            step(name, 0)
        for b in range(blocks):
            order = VARIANTS[b % len(VARIANTS):] + VARIANTS[:b % len(VARIANTS)]
            for name in order:
                start = time.perf_counter()
                for i in range(block):
                    step(name, i)
                times[name].append((time.perf_counter() - start) / block)
        for monitor in monitors.values():
            monitor.close()
    median = {name: statistics.median(t) for name, t in times.items()}
    plain = median["plain"]
    return {
        "question": "the cost of handing every micro-batch to the Monitor: observe() against micro-batch checks",
        "accumulation": accum, "blocks": blocks, "block_steps": block,
        "median_step_ms": {name: 1e3 * value for name, value in median.items()},
        "observe_cost_pct": 100.0 * (median["observe"] - median["check"]) / plain,
        "micro_checks_cost_pct": 100.0 * (median["micro_checks"] - median["check"]) / plain,
        "check_cost_pct": 100.0 * (median["check"] - plain) / plain,
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
        "cpu": cpu_model(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--block", type=int, default=5, help="steps per block")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    result = run(args.blocks, args.block, args.accum)
    for name, ms in result["median_step_ms"].items():
        print(f"{name:<14}{ms:>10.2f} ms a step ({args.accum} micro-batches)")
    print(f"check_cost = {result['check_cost_pct']:.2f}% of a plain step (one check a step)")
    print(f"observe_cost = {result['observe_cost_pct']:.2f}% of a plain step ({args.accum - 1} observe() calls, over "
          "the one-check step)")
    print(f"micro_checks_cost = {result['micro_checks_cost_pct']:.2f}% of a plain step ({args.accum - 1} "
          "check(micro_batch=True) scans, over the one-check step)")
    if args.json:
        print(f"wrote {write_results_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
