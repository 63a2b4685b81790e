"""What does comparing the DDP replicas every step cost (nanscan.runtime.distributed NOTE: [replica agreement])?
Two gloo ranks on the CPU train the demo model under DistributedDataParallel with two Monitors, one with
replicas=True and one with replicas=False, and each step calls one of them, in blocks whose order alternates so
that drift falls on both alike. Each mode's cost is the median time of its check() calls (on the rank where it was
larger), and the ratio of the two; the plain training step is timed too, for scale. An untimed barrier before each
check lets both ranks enter it together: without it a check's time held however far the other rank had drifted
behind, and the ratio swung between 0.81 and 1.58 over eight runs (0.94 to 1.24 over three with it). The host's own work is timed apart as well: the replica view
(nanscan.runtime.replicas.ReplicaSets.view, the combined fingerprints of the step's records) repeated on each
replicas check's report, a stable number of microseconds; the payload grows by six int64, which the collective's
latency hides.

    .venv/bin/python benchmarks/bench_replicas.py --blocks 20 --block 10 --json benchmarks/results/bench_replicas.json

20 blocks of 10 steps give each mode 200 checks.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanscan import demo as D
from nanscan._atomic import write_results_json
from nanscan.bench_scan import cpu_model
from nanscan.runtime.monitor import Monitor

MODES = ("replicas", "no_replicas")
WORLD = 2


def _rank(rank: int, store: str, out: str, blocks: int, block: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # two processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    config = dict(D.DEFAULT_CONFIG)
    with D.seeded_rngs(config["seed"]):
        model = D.build_model(config)
    ddp = DDP(model)
    optimizer = D.build_optimizer(ddp, config)
    generator = torch.Generator().manual_seed(rank)
    batches = [{"tokens": torch.randint(0, config["vocab_size"], (config["batch_size"], config["seq_len"] + 1),
                                        generator=generator),
                "weights": torch.ones(config["batch_size"], config["seq_len"])} for _ in range(8)]
    checks: dict[str, list[float]] = {mode: [] for mode in MODES}
    steps: list[float] = []
    views: list[float] = []
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-replicas-") as tmp:
        monitors = {mode: Monitor(ddp, optimizer, bundle_dir=tmp, run_id=mode, spikes=None, window=None,
                                  replicas=mode == "replicas") for mode in MODES}

        def step(mode: str, i: int, timed: bool) -> None:
            start = time.perf_counter()
            batch = batches[i % len(batches)]
            loss = D.step_fn(ddp, batch)
            loss.backward()
            dist.barrier()  # untimed: both ranks enter check() together, so neither's time holds the other's drift
            before = time.perf_counter()
            report = monitors[mode].check(batch=batch, loss=loss)
            after = time.perf_counter()
            if timed and mode == "replicas":  # the host's work again, alone (NOTE: [replica agreement])
                agreement = monitors[mode]._agreement
                start_view = time.perf_counter()
                agreement._replicas.view(report, model, optimizer, gradients=True)
                views.append(time.perf_counter() - start_view)
                start += time.perf_counter() - start_view
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if timed:
                checks[mode].append(after - before)
                steps.append(time.perf_counter() - start)

        for mode in MODES:  # optimizer state, plans, pools
            step(mode, 0, timed=False)
        for b in range(blocks):
            for mode in (MODES if b % 2 == 0 else MODES[::-1]):
                for i in range(block):
                    step(mode, i, timed=True)
        for monitor in monitors.values():
            monitor.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"checks": checks, "steps": steps, "views": views}))
    dist.destroy_process_group()


def run(blocks: int, block: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="nanscan-bench-replicas-run-") as tmp:
        mp.start_processes(_rank, args=(str(Path(tmp) / "store"), tmp, blocks, block), nprocs=WORLD, join=True,
                           start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    median = {mode: max(statistics.median(r["checks"][mode]) for r in ranks) for mode in MODES}
    step = max(statistics.median(r["steps"]) for r in ranks)
    view = max(statistics.median(r["views"]) for r in ranks)
    return {
        "question": "the cost per step of comparing the DDP replicas in the ranks' agreement (2 gloo ranks, CPU)",
        "world_size": WORLD, "blocks": blocks, "block_steps": block, "checks_per_mode": blocks * block,
        "median_check_ms": {mode: 1e3 * value for mode, value in median.items()},
        "median_step_ms": 1e3 * step,
        "check_ratio": median["replicas"] / median["no_replicas"],
        "replicas_cost_pct_of_step": 100.0 * (median["replicas"] - median["no_replicas"]) / step,
        "replica_view_us": 1e6 * view,
        "replica_view_pct_of_check": 100.0 * view / median["no_replicas"],
        "replica_view_pct_of_step": 100.0 * view / step,
        "torch_threads_per_rank": 1, "python": platform.python_version(), "torch": torch.__version__,
        "cpu": cpu_model(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--block", type=int, default=10, help="steps per block and mode")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    result = run(args.blocks, args.block)
    for mode, ms in result["median_check_ms"].items():
        print(f"{mode:<12}{ms:>9.3f} ms a check (median of {result['checks_per_mode']}, the slower rank)")
    print(f"training step {result['median_step_ms']:.2f} ms (median, check included)")
    print(f"check_ratio = {result['check_ratio']:.3f} (check() with replicas / without)")
    print(f"replicas_cost = {result['replicas_cost_pct_of_step']:.2f}% of a training step")
    print(f"replica_view = {result['replica_view_us']:.1f} us a check, {result['replica_view_pct_of_check']:.2f}% of "
          f"a check without replicas, {result['replica_view_pct_of_step']:.3f}% of a training step (the host's work)")
    if args.json:
        print(f"wrote {write_results_json(args.json, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
